"""The loader's generic part on the ToyModel (difflet_tpu.testing), through a toy port.

A toy port (config_from_diffusers / build / PLAN / key_map, like a real port
package) is registered under `_class_name` "ToyTransformer" by patching
`difflet_tpu.models` (registered for the test); a diffusers-style checkpoint of it is written
as one safetensors file or as two shards with an index. Expected values are
computed here from the torch-layout arrays, independently of the loader.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from difflet_tpu import testing
from difflet_tpu.layers import rope
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import TP, make_mesh
from difflet_tpu import models
from difflet_tpu.parallel.modes import Parallel
from difflet_tpu.loading.checkpoint import Key, WeightsError

CLASS_NAME = "ToyTransformer"
DIFFUSERS_CONFIG = {
    "_class_name": CLASS_NAME,
    "_diffusers_version": "0.42.1",
    "num_attention_heads": 4,
    "attention_head_dim": 8,
    "num_layers": 2,
    "ffn_dim": 64,
    "in_channels": 2,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm",
}
COLUMN_SHARDED = ("to_q", "to_k", "to_v", "net.0.proj")  # torch [out, in], sharded on out


# --------------------------------------------------------------------------
# The toy port
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToyPortConfig:
    heads: int = 4
    head_dim: int = 8
    ffn: int = 64
    layers: int = 2
    in_channels: int = 2
    patch: tuple = (1, 2, 2)
    split_rope: bool = True

    @property
    def dim(self):
        return self.heads * self.head_dim


def _config_from_diffusers(cfg, *, split_rope=True):
    if cfg.get("qk_norm", "rms_norm") != "rms_norm":
        raise ValueError(f"qk_norm={cfg['qk_norm']!r} is not supported (only 'rms_norm')")
    return ToyPortConfig(heads=cfg["num_attention_heads"], head_dim=cfg["attention_head_dim"],
                         ffn=cfg["ffn_dim"], layers=cfg["num_layers"], in_channels=cfg["in_channels"],
                         patch=tuple(cfg["patch_size"]), split_rope=split_rope)


def _build(config, *, dtype, rngs):
    c = testing.ToyConfig(dim=config.dim, heads=config.heads, ffn=config.ffn, layers=config.layers,
                          in_channels=config.in_channels * math.prod(config.patch))
    model = testing.ToyModel(c, rngs)
    model.config = config  # the port config records split_rope
    return model


def _key_map(config, model):
    km = loading.default_key_map(model, stacked={"blocks": config.layers})
    km["proj_in.kernel"] = Key("proj_in.weight", "conv_as_linear")  # a Conv3d patch embedding
    for n in ("norm_q", "norm_k"):  # kept fp32 whatever the load dtype
        km[f"blocks.attn.{n}.scale"] = dataclasses.replace(km[f"blocks.attn.{n}.scale"], dtype="float32")
    if config.split_rope:
        hp = tuple(int(i) for i in rope.heads_permutation(config.heads, config.head_dim))
        rp = tuple(int(i) for i in rope.rope_permutation(config.head_dim))
        for n in ("to_q", "to_k"):
            for leaf in ("kernel", "bias"):
                km[f"blocks.attn.{n}.{leaf}"] = dataclasses.replace(km[f"blocks.attn.{n}.{leaf}"], perm=hp)
        for n in ("norm_q", "norm_k"):
            km[f"blocks.attn.{n}.scale"] = dataclasses.replace(km[f"blocks.attn.{n}.scale"], perm=rp)
    return km


TOY_PORT = types.SimpleNamespace(name="toy_weights", class_names=(CLASS_NAME,),
                                 config_from_diffusers=_config_from_diffusers, build=_build, plan=testing.PLAN,
                                 key_map=_key_map, ignored_keys=())


def register(monkeypatch, spec):
    """`spec` is the loader's port for its class names for this test: first among the registered
    specs (the bench's toy port, difflet_tpu.testing, loads the same class name and stays registered)."""
    monkeypatch.setattr(models, "_EXTRA", [spec] + [s for s in models._EXTRA if s.name != spec.name])


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch):
    register(monkeypatch, TOY_PORT)


# --------------------------------------------------------------------------
# Writing a diffusers-style checkpoint of the toy, and the expected parameters
# --------------------------------------------------------------------------

def torch_weights(seed=0, cfg=DIFFUSERS_CONFIG) -> dict[str, np.ndarray]:
    """Random float32 tensors under their diffusers names and torch layouts."""
    rng = np.random.default_rng(seed)
    c = _config_from_diffusers(cfg)
    D, F, C = c.dim, c.ffn, c.in_channels
    shapes = {"proj_in.weight": (D, C, *c.patch), "proj_in.bias": (D,),
              "proj_out.weight": (C * math.prod(c.patch), D), "proj_out.bias": (C * math.prod(c.patch),)}
    for i in range(c.layers):
        b = f"blocks.{i}."
        for n in ("to_q", "to_k", "to_v", "to_out.0"):
            shapes[b + f"attn.{n}.weight"], shapes[b + f"attn.{n}.bias"] = (D, D), (D,)
        shapes[b + "attn.norm_q.weight"] = shapes[b + "attn.norm_k.weight"] = (c.head_dim,)
        shapes[b + "ff.net.0.proj.weight"], shapes[b + "ff.net.0.proj.bias"] = (F, D), (F,)
        shapes[b + "ff.net.2.weight"], shapes[b + "ff.net.2.bias"] = (D, F), (D,)
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in sorted(shapes.items())}


def write_checkpoint(path, tensors=None, *, sharded=False, cfg=DIFFUSERS_CONFIG):
    """A diffusers transformer directory: config.json + one file, or two shards + index."""
    tensors = torch_weights() if tensors is None else tensors
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if not sharded:
        save_file(tensors, str(path / loading.SINGLE_FILE))
        return path
    names = sorted(tensors)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[::2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for f, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / f))
        weight_map.update({k: f for k in keys})
    total = sum(t.nbytes for t in tensors.values())
    (path / loading.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                       "weight_map": weight_map}))
    return path


def expected_params(tensors, *, split_rope=True, cfg=DIFFUSERS_CONFIG) -> dict[str, np.ndarray]:
    """The Flax parameters (float32) the loader must produce, by hand."""
    c = _config_from_diffusers(cfg, split_rope=split_rope)
    hp = rope.heads_permutation(c.heads, c.head_dim)
    rp = rope.rope_permutation(c.head_dim)
    out = {"proj_in.kernel": tensors["proj_in.weight"].reshape(c.dim, -1).T,
           "proj_in.bias": tensors["proj_in.bias"],
           "proj_out.kernel": tensors["proj_out.weight"].T, "proj_out.bias": tensors["proj_out.bias"]}
    layer = lambda name: [tensors[f"blocks.{i}.{name}"] for i in range(c.layers)]
    for n in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"):
        kernel = np.stack([w.T for w in layer(n + ".weight")])
        bias = np.stack(layer(n + ".bias"))
        if split_rope and n in ("attn.to_q", "attn.to_k"):
            kernel, bias = kernel[..., hp], bias[..., hp]
        out[f"blocks.{n}.kernel"], out[f"blocks.{n}.bias"] = kernel, bias
    for n in ("attn.norm_q", "attn.norm_k"):
        scale = np.stack(layer(n + ".weight"))
        out[f"blocks.{n}.scale"] = scale[..., rp] if split_rope else scale
    return out


def flat_params(model) -> dict[str, jax.Array]:
    state = nnx.state(model, nnx.Param)
    return {".".join(k): v.get_value() if hasattr(v, "get_value") else v.value
            for k, v in nnx.to_flat_state(state)}


def set_params(model, flat: dict[str, np.ndarray]):
    """Sets a model's parameters from dot-joined paths."""
    state = nnx.state(model, nnx.Param)
    pure = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        d = pure
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = jnp.asarray(value)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def expected_spec(path: str, ndim: int) -> P:
    if path.startswith("blocks.") and any(f".{n}.kernel" in path for n in COLUMN_SHARDED):
        return P(None, None, TP)
    if path.startswith("blocks.") and any(f".{n}.bias" in path for n in COLUMN_SHARDED):
        return P(None, TP)
    if path in ("blocks.attn.to_out.0.kernel", "blocks.ff.net.2.kernel"):
        return P(None, TP, None)
    return P()


def assert_loaded(model, expected, *, mesh=None, dtype=jnp.float32, kept=()):
    got = flat_params(model)
    assert sorted(got) == sorted(expected)
    for path, want in expected.items():
        arr = got[path]
        target = jnp.float32 if path in kept else dtype
        assert arr.dtype == target, path
        np.testing.assert_array_equal(np.asarray(arr), want.astype(target), err_msg=path)
        if mesh is None:
            assert arr.sharding.device_set == {jax.devices()[0]}, path
        else:
            assert arr.sharding.mesh.shape == mesh.shape, path
            assert arr.sharding.mesh.devices.tolist() == mesh.devices.tolist(), path
            want_spec = expected_spec(path, arr.ndim)
            assert arr.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, want_spec), arr.ndim), \
                (path, arr.sharding.spec, want_spec)


KEPT_FP32 = ("blocks.attn.norm_q.scale", "blocks.attn.norm_k.scale")


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True], ids=["single_file", "index"])
@pytest.mark.parametrize("tp", [None, 2, 4])
def test_load_bit_identical_with_shardings(tmp_path, sharded, tp):
    tensors = torch_weights()
    path = write_checkpoint(tmp_path / "transformer", tensors, sharded=sharded)
    mesh = None if tp is None else make_mesh(tp)
    model = loading.load_transformer(path, dtype=jnp.float32, mesh=mesh, config=Config())
    assert isinstance(model, testing.ToyModel) and model.config.split_rope
    assert_loaded(model, expected_params(tensors), mesh=mesh)


def test_bf16_cast_keeps_fp32_keys(tmp_path):
    tensors = torch_weights()
    path = write_checkpoint(tmp_path / "transformer", tensors)
    model = loading.load_transformer(path, mesh=make_mesh(4), config=Config())  # default dtype bf16
    assert_loaded(model, expected_params(tensors), mesh=make_mesh(4), dtype=jnp.bfloat16, kept=KEPT_FP32)


def test_split_rope_permutation_applied_once(tmp_path):
    tensors = torch_weights()
    path = write_checkpoint(tmp_path / "transformer", tensors)
    plain = flat_params(loading.load_transformer(path, dtype=jnp.float32, config=Config(split_rope=False)))
    split = flat_params(loading.load_transformer(path, dtype=jnp.float32, mesh=make_mesh(4),
                                                 config=Config(split_rope=True)))
    hp = rope.heads_permutation(4, 8)
    once = np.asarray(plain["blocks.attn.to_q.kernel"])[..., hp]
    np.testing.assert_array_equal(np.asarray(split["blocks.attn.to_q.kernel"]), once)
    assert not np.array_equal(once[..., hp], once)  # twice would differ
    np.testing.assert_array_equal(np.asarray(plain["blocks.attn.to_q.kernel"]),
                                  np.stack([tensors[f"blocks.{i}.attn.to_q.weight"].T for i in range(2)]))
    np.testing.assert_array_equal(np.asarray(split["blocks.attn.norm_k.scale"]),
                                  np.asarray(plain["blocks.attn.norm_k.scale"])[..., rope.rope_permutation(8)])
    np.testing.assert_array_equal(np.asarray(split["blocks.attn.to_v.kernel"]),
                                  np.asarray(plain["blocks.attn.to_v.kernel"]))


@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_reads_only_its_slice(tmp_path, monkeypatch, tp):
    tensors = torch_weights()
    path = write_checkpoint(tmp_path / "transformer", tensors, sharded=True)
    reads = []
    orig = loading.Checkpoint.read

    def counting(self, key, index=None):
        out = orig(self, key, index)
        reads.append((key, out.nbytes))
        return out

    monkeypatch.setattr(loading.Checkpoint, "read", counting)
    loading.load_transformer(path, dtype=jnp.float32, mesh=make_mesh(tp), config=Config())
    sharded = [k for k in tensors if any(f".{n}." in k for n in COLUMN_SHARDED + ("to_out.0", "net.2"))
               and k.endswith(".weight")]
    sharded += [k for k in tensors if any(f".{n}.bias" in k for n in COLUMN_SHARDED)]
    for k in sharded:
        sizes = [n for key, n in reads if key == k]
        assert len(sizes) == tp, (k, sizes)  # one read per device
        assert all(n == tensors[k].nbytes // tp for n in sizes), (k, sizes, tensors[k].nbytes)
    # Replicated tensors are read once, whole; nothing is read that the model does not use.
    for k in set(tensors) - set(sharded):
        assert [n for key, n in reads if key == k] == [tensors[k].nbytes], k
    assert sum(n for _, n in reads) == sum(t.nbytes for t in tensors.values())


def test_loaded_model_runs(tmp_path):
    tensors = torch_weights()
    path = write_checkpoint(tmp_path / "transformer", tensors)
    model = loading.load_transformer(path, dtype=jnp.float32, config=Config(split_rope=False))
    ref = _build(_config_from_diffusers(DIFFUSERS_CONFIG, split_rope=False), dtype=None, rngs=nnx.Rngs(1))
    set_params(ref, expected_params(tensors, split_rope=False))
    x = jax.random.normal(jax.random.key(0), (1, 16, 8))
    run = jax.jit(lambda m, x: m(Parallel(), x))
    np.testing.assert_array_equal(np.asarray(run(model, x)), np.asarray(run(ref, x)))


def test_load_params_api(tmp_path):
    """What the ports call directly: load_params on an abstract model with a Checkpoint."""
    tensors = torch_weights()
    path = write_checkpoint(tmp_path / "transformer", tensors, sharded=True)
    cfg = _config_from_diffusers(DIFFUSERS_CONFIG)
    abstract = loading.abstract_port_model(TOY_PORT, cfg, dtype=jnp.float32)
    assert set(loading.param_paths(abstract)) == set(expected_params(tensors))
    ckpt = loading.Checkpoint(path)
    model = loading.load_params(abstract, ckpt, _key_map(cfg, abstract), dtype=jnp.float32,
                                mesh=make_mesh(4), plan=testing.PLAN)
    assert_loaded(model, expected_params(tensors), mesh=make_mesh(4))


# --------------------------------------------------------------------------
# Errors, before anything is compiled
# --------------------------------------------------------------------------

def test_unknown_class_name(tmp_path):
    path = write_checkpoint(tmp_path / "t", cfg={**DIFFUSERS_CONFIG, "_class_name": "NopeModel"})
    with pytest.raises(WeightsError, match=r"unknown _class_name 'NopeModel'.*ToyTransformer"):
        loading.load_transformer(path)


def test_unsupported_config_value(tmp_path):
    path = write_checkpoint(tmp_path / "t", cfg={**DIFFUSERS_CONFIG, "qk_norm": "layer_norm"})
    with pytest.raises(WeightsError) as e:
        loading.load_transformer(path)
    msg = str(e.value)
    assert str(path / "config.json") in msg and "qk_norm" in msg and "layer_norm" in msg


def test_missing_config_json(tmp_path):
    path = write_checkpoint(tmp_path / "t")
    (path / "config.json").unlink()
    with pytest.raises(WeightsError, match="no config.json"):
        loading.load_transformer(path)
    with pytest.raises(WeightsError, match="/nowhere: no such folder"):  # an absolute path is no hub id
        loading.load_transformer(tmp_path / "nowhere")


def test_no_safetensors(tmp_path):
    path = tmp_path / "t"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(DIFFUSERS_CONFIG))
    with pytest.raises(WeightsError, match="no diffusion_pytorch_model.safetensors"):
        loading.load_transformer(path)


@pytest.mark.parametrize("sharded", [False, True], ids=["single_file", "index"])
def test_key_problems_listed_together(tmp_path, sharded):
    tensors = torch_weights()
    del tensors["blocks.1.attn.to_k.weight"]
    del tensors["proj_out.bias"]
    tensors["blocks.0.attn.extra.weight"] = np.zeros((3,), np.float32)
    tensors["blocks.0.ff.net.2.weight"] = np.zeros((32, 60), np.float32)  # expected (32, 64)
    tensors["blocks.1.attn.norm_q.weight"] = np.zeros((9,), np.float32)
    tensors["proj_in.weight"] = np.zeros((32, 3, 1, 2, 2), np.float32)  # conv: 12 != 8 inputs
    path = write_checkpoint(tmp_path / "t", tensors, sharded=sharded)
    with pytest.raises(WeightsError) as e:
        loading.load_transformer(path)
    msg = str(e.value)
    assert str(path) in msg and "6 problem(s)" in msg, msg
    for part in ["missing key blocks.1.attn.to_k.weight", "missing key proj_out.bias",
                 "unexpected key blocks.0.attn.extra.weight",
                 "wrong shape for blocks.0.ff.net.2.weight", "(32, 60)", "(32, 64)",
                 "wrong shape for blocks.1.attn.norm_q.weight", "wrong shape for proj_in.weight"]:
        assert part in msg, (part, msg)
    assert ".safetensors" in msg  # mis-shaped / unexpected keys name their file


def test_truncated_file(tmp_path):
    path = write_checkpoint(tmp_path / "t", sharded=True)
    f = path / "diffusion_pytorch_model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=r"00002-of-00002\.safetensors: cannot read.*truncated or corrupt"):
        loading.load_transformer(path)


def test_corrupt_header(tmp_path):
    path = write_checkpoint(tmp_path / "t")
    f = path / loading.SINGLE_FILE
    data = bytearray(f.read_bytes())
    data[8:16] = b"{garbage"
    f.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"diffusion_pytorch_model\.safetensors: cannot read.*header"):
        loading.load_transformer(path)


def test_index_names_missing_shard(tmp_path):
    path = write_checkpoint(tmp_path / "t", sharded=True)
    (path / "diffusion_pytorch_model-00001-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"index\.json names shard\(s\) that do not exist: "
                                           r"diffusion_pytorch_model-00001-of-00002\.safetensors"):
        loading.load_transformer(path)


def test_index_maps_key_to_wrong_shard(tmp_path):
    path = write_checkpoint(tmp_path / "t", sharded=True)
    index = json.loads((path / loading.INDEX_FILE).read_text())
    index["weight_map"]["proj_in.bias"] = "diffusion_pytorch_model-00002-of-00002.safetensors"
    index["weight_map"]["proj_in.weight"] = "diffusion_pytorch_model-00002-of-00002.safetensors"
    (path / loading.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="keys are not in the shard it names"):
        loading.load_transformer(path)


def test_mesh_that_does_not_divide(tmp_path):
    cfg = {**DIFFUSERS_CONFIG, "num_attention_heads": 3, "attention_head_dim": 6}  # dim 18
    path = write_checkpoint(tmp_path / "t", torch_weights(cfg=cfg), cfg=cfg)
    with pytest.raises(WeightsError, match=r"do not divide over the tp axis(.|\n)*to_q.kernel"):
        loading.load_transformer(path, mesh=make_mesh(4))


def test_class_without_a_port(tmp_path):
    path = write_checkpoint(tmp_path / "t", cfg={**DIFFUSERS_CONFIG, "_class_name": "GhostModel"})
    with pytest.raises(WeightsError, match=r"unknown _class_name 'GhostModel'; supported: .*FluxTransformer2DModel"):
        loading.load_transformer(path)


def test_key_map_errors():
    cfg = _config_from_diffusers(DIFFUSERS_CONFIG)
    abstract = loading.abstract_port_model(TOY_PORT, cfg, dtype=jnp.float32)

    class Empty:
        where = {}

        def keys(self):
            return []

    km = _key_map(cfg, abstract)
    km["blocks.attn.typo.kernel"] = Key("x.weight", "linear")
    with pytest.raises(WeightsError, match="typo.kernel names no parameter"):
        loading.validate(Empty(), km, loading.param_paths(abstract), "here")
    del km["proj_out.bias"]
    with pytest.raises(WeightsError, match=r"no entry for parameters \['proj_out.bias'\]"):
        loading.load_params(abstract, Empty(), km, dtype=None)


class Buffer(nnx.Variable):
    """A non-parameter array a port computes from its config (e.g. a RoPE table)."""


def test_non_param_state_is_materialised(tmp_path, monkeypatch):
    def build(config, *, dtype, rngs):
        model = _build(config, dtype=dtype, rngs=rngs)
        model.table = Buffer(jnp.arange(8, dtype=jnp.float32) * 2)
        return model

    register(monkeypatch, types.SimpleNamespace(**{**vars(TOY_PORT), "build": build}))
    tensors = torch_weights()
    path = write_checkpoint(tmp_path / "t", tensors)
    for cache in (None, tmp_path / "cache", tmp_path / "cache"):  # converted, saved, restored
        model = loading.load_transformer(path, dtype=jnp.float32, mesh=make_mesh(4), config=Config(),
                                         cache_dir=cache)
        table = model.table.get_value()
        assert isinstance(table, jax.Array) and table.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(table), np.arange(8) * 2)
        assert_loaded(model, expected_params(tensors), mesh=make_mesh(4))


def test_top_level_entry_point():
    import difflet_tpu

    assert difflet_tpu.load_transformer is loading.load_transformer


# --------------------------------------------------------------------------
# A packed torch Linear feeding two kernels (Key.in_range)
# --------------------------------------------------------------------------
# torch `proj.weight` [16, 32] over cat([a (8), b (24)]) -> Flax `proj.a` [8, 16] (no
# bias) and `proj.b` [24, 16] (the bias), both row-parallel: rank r needs input
# features [2r, 2r+2) and [8 + 6r, 8 + 6r + 6), not one contiguous slice.

A_IN, B_IN, OUT, PACKED_LAYERS = 8, 24, 16, 2


class PackedProj(nnx.Module):
    def __init__(self, rngs):
        from difflet_tpu.layers import nn

        self.a = nn.Linear(A_IN, OUT, bias=False, rngs=rngs)
        self.b = nn.Linear(B_IN, OUT, rngs=rngs)

    def __call__(self, par, xa, xb):
        return par.row([(xa, self.a.kernel[...]), (xb, self.b.kernel[...])], self.b.bias[...])


class PackedToy(nnx.Module):
    def __init__(self, rngs):
        from difflet_tpu.layers import nn

        self.head = PackedProj(rngs)
        self.blocks = nn.stacked(PackedProj, PACKED_LAYERS, rngs)


PACKED_PLAN = {"head.a": "row", "head.b": "row", "blocks.a": "row", "blocks.b": "row"}


def packed_tensors(seed=0, n_in=A_IN + B_IN, out=OUT):
    rng = np.random.default_rng(seed)
    t = {"head.weight": rng.standard_normal((out, n_in), dtype=np.float32),
         "head.bias": rng.standard_normal((out,), dtype=np.float32)}
    for i in range(PACKED_LAYERS):
        t[f"blocks.{i}.weight"] = rng.standard_normal((out, n_in), dtype=np.float32)
        t[f"blocks.{i}.bias"] = rng.standard_normal((out,), dtype=np.float32)
    return t


def packed_key_map(a_range=(0, A_IN), b_range=(A_IN, A_IN + B_IN)):
    km = {}
    for prefix, layers in (("head", None), ("blocks", PACKED_LAYERS)):
        t = prefix + (".{i}" if layers else "")
        km[f"{prefix}.a.kernel"] = Key(f"{t}.weight", "linear", layers=layers, in_range=a_range)
        km[f"{prefix}.b.kernel"] = Key(f"{t}.weight", "linear", layers=layers, in_range=b_range)
        km[f"{prefix}.b.bias"] = Key(f"{t}.bias", layers=layers)
    return km


def packed_abstract():
    return nnx.eval_shape(lambda: PackedToy(nnx.Rngs(0)))


@pytest.mark.parametrize("tp", [None, 2, 4])
def test_packed_linear_into_two_kernels(tmp_path, monkeypatch, tp):
    """Each kernel is its input range of the torch weight, transposed; on a mesh each
    device reads only its rows of each range (one read of its a rows, one of its b
    rows), every byte once overall, and the packed key is expected (not unexpected)."""
    tensors = packed_tensors()
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, str(tmp_path / loading.SINGLE_FILE))
    reads = []
    orig = loading.Checkpoint.read

    def recording(self, key, index=None):
        out = orig(self, key, index)
        reads.append((key, None if index is None else tuple((s.start, s.stop) for s in index), out.shape))
        return out

    monkeypatch.setattr(loading.Checkpoint, "read", recording)
    mesh = None if tp is None else make_mesh(tp)
    model = loading.load_params(packed_abstract(), loading.Checkpoint(tmp_path), packed_key_map(),
                                dtype=jnp.float32, mesh=mesh, plan=PACKED_PLAN)
    got = flat_params(model)
    stack = lambda name: np.stack([tensors[f"blocks.{i}.{name}"] for i in range(PACKED_LAYERS)])
    want = {"head.a.kernel": tensors["head.weight"][:, :A_IN].T, "head.b.kernel": tensors["head.weight"][:, A_IN:].T,
            "head.b.bias": tensors["head.bias"],
            "blocks.a.kernel": stack("weight")[:, :, :A_IN].transpose(0, 2, 1),
            "blocks.b.kernel": stack("weight")[:, :, A_IN:].transpose(0, 2, 1), "blocks.b.bias": stack("bias")}
    assert sorted(got) == sorted(want)
    for path, w in want.items():
        np.testing.assert_array_equal(np.asarray(got[path]), w, err_msg=path)
        if mesh is not None and path.endswith("kernel"):
            spec = P(TP, None) if path.startswith("head") else P(None, TP, None)
            assert got[path].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), w.ndim), path
    # The rows each read covers: a's rows [r*2, r*2+2), b's rows 8 + [r*6, r*6+6), out features all.
    n = tp or 1
    for key in ["head.weight"] + [f"blocks.{i}.weight" for i in range(PACKED_LAYERS)]:
        rows = sorted(idx[1] for k, idx, _ in reads if k == key)
        a, b = A_IN // n, B_IN // n
        assert rows == sorted([(r * a, (r + 1) * a) for r in range(n)]
                              + [(A_IN + r * b, A_IN + (r + 1) * b) for r in range(n)]), (key, rows)
        assert all(idx[0] == (0, OUT) for k, idx, _ in reads if k == key)
    assert sum(int(np.prod(s)) * 4 for _, _, s in reads) == sum(t.nbytes for t in tensors.values())


def test_packed_linear_forward_matches_torch(tmp_path):
    """x_a @ a + x_b @ b + bias == cat([x_a, x_b]) @ W.T + bias, one device and the two
    pairs summed in one all-reduce (TP) / reduce-scatter (SP) on 4 devices."""
    tensors = packed_tensors()
    save_file(tensors, str(tmp_path / loading.SINGLE_FILE))
    rng = np.random.default_rng(1)
    xa = rng.standard_normal((1, 8, A_IN), dtype=np.float32)
    xb = rng.standard_normal((1, 8, B_IN), dtype=np.float32)
    ref = np.concatenate([xa, xb], -1) @ tensors["head.weight"].T + tensors["head.bias"]
    plain = loading.load_params(packed_abstract(), loading.Checkpoint(tmp_path), packed_key_map(),
                                dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(plain.head(Parallel(), xa, xb)), ref, rtol=1e-5, atol=1e-5)
    mesh = make_mesh(4)
    model = loading.load_params(packed_abstract(), loading.Checkpoint(tmp_path), packed_key_map(),
                                dtype=jnp.float32, mesh=mesh, plan=PACKED_PLAN)
    graphdef, state = nnx.split(model.head)
    specs = jax.tree.map(lambda x: x.sharding.spec, state)
    for mode, out_spec in (("tp", P()), ("sp", P(None, TP))):
        par = Parallel(mode=mode, size=4)

        def f(s, xa, xb, par=par):
            return nnx.merge(graphdef, s)(par, xa, xb)

        fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(specs, P(None, None, TP), P(None, None, TP)),
                                   out_specs=out_spec, check_vma=False))
        np.testing.assert_allclose(np.asarray(fn(state, xa, xb)), ref, rtol=1e-5, atol=1e-5, err_msg=mode)


@pytest.mark.parametrize("change,tensors_kw,messages", [
    (dict(a_range=(0, 10)), {}, ["head.a.kernel: in_range (0, 10) selects 10 input features, the kernel (8, 16)"]),
    (dict(b_range=(4, 28)), {}, ["head.weight", "input features [4, 8) read by more than one key",
                                 "input features [28, 32) of 32 read by no key"]),
    (dict(b_range=(9, 33)), {}, ["wrong shape for head.weight", "checkpoint (16, 32), expected (16, >= 33)",
                                 "input features [8, 32) of 32 read by no key"]),
    ({}, dict(n_in=40), ["head.weight", "input features [32, 40) of 40 read by no key",
                         "blocks.0.weight", "input features [32, 40) of 40 read by no key"]),
    ({}, dict(out=12), ["wrong shape for head.weight", "checkpoint (12, 32), expected (16, >= 8)",
                        "expected (16, >= 32)", "wrong shape for head.bias"]),
    (dict(a_range=(3, 1)), {}, ["in_range (3, 1) is not a tuple (a, b) with 0 <= a < b"]),
])
def test_packed_linear_wrong_ranges_reported(tmp_path, change, tensors_kw, messages):
    save_file(packed_tensors(**tensors_kw), str(tmp_path / loading.SINGLE_FILE))
    with pytest.raises(WeightsError) as e:
        loading.validate(loading.Checkpoint(tmp_path), packed_key_map(**change),
                         loading.param_paths(packed_abstract()), "here")
    msg = str(e.value)
    for m in messages:
        assert m in msg, (m, msg)
    assert "unexpected key" not in msg, msg


def test_packed_linear_other_problems(tmp_path):
    """A missing packed key is reported once; in_range on a non-linear Key, and a Key
    reading the packed weight whole next to ranged ones, are refused."""
    tensors = packed_tensors()
    del tensors["head.weight"]
    save_file(tensors, str(tmp_path / loading.SINGLE_FILE))
    shapes = loading.param_paths(packed_abstract())
    with pytest.raises(WeightsError) as e:
        loading.validate(loading.Checkpoint(tmp_path), packed_key_map(), shapes, "here")
    assert str(e.value).count("missing key head.weight") == 1 and "1 problem(s)" in str(e.value), str(e.value)

    save_file(packed_tensors(), str(tmp_path / loading.SINGLE_FILE))
    km = packed_key_map()
    km["head.b.bias"] = Key("head.bias", in_range=(0, 16))
    with pytest.raises(WeightsError, match=r"head.b.bias: in_range \(0, 16\) applies only to transform 'linear'"):
        loading.validate(loading.Checkpoint(tmp_path), km, shapes, "here")


def test_key_map_digest_sees_in_range():
    """The orbax cache (difflet_tpu.loading.cache) is keyed by a hash of the key map: a
    different in_range must be a different conversion."""
    from difflet_tpu.loading import cache as checkpoint

    base = packed_key_map()
    assert checkpoint.key_map_digest(base) == checkpoint.key_map_digest(packed_key_map())
    assert checkpoint.key_map_digest(base) != checkpoint.key_map_digest(packed_key_map(a_range=(1, 9)))
