"""Wan 2.1 / 2.2 port: the model-specific mechanisms against the plain model (float64,
each shown to fail without the mechanism), the Pallas kernels' fallback and
interpret-mode runs, the text K/V cache, input errors, experts, presets.

Fixture parity (one device, TP and SP on 2 and 4 devices, sp-xla, SP == TP at
padded counts) and the deviceless v5e:2x2 compile of Wan2.1-T2V-14B are in the
conformance suite (tests/test_conformance.py), as for every port."""

import dataclasses
import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from difflet_tpu.testing import read_fixture_io, rel_l2
from difflet_tpu.parallel import site_plan
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import TP, make_mesh
from difflet_tpu.parallel.modes import COLUMN, ROW, role_of
from difflet_tpu.models import wan

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

rel = rel_l2


def fixture(case, dtype=np.float32):
    """(diffusers forward kwargs, expected sample) of a fixture case."""
    kwargs, out = read_fixture_io(FIXTURES / case)
    return {k: v.astype(dtype) for k, v in kwargs.items()}, out["sample"]


def load(case, dtype=jnp.float32, mesh=None, split_rope=True):
    return loading.load_transformer(FIXTURES / case / "transformer", dtype=dtype, mesh=mesh,
                                    config=Config(split_rope=split_rope))


@functools.lru_cache(maxsize=None)
def load_f32(case, tp=None):
    return load(case, mesh=None if tp is None else make_mesh(tp))


def run(case, tp=None, mode=None, config=None):
    kwargs, _ = fixture(case)
    mesh = None if tp is None else make_mesh(tp)
    return wan.Runner(load_f32(case, tp), mesh, config or Config(), mode)(**kwargs).sample


def rows(runner, kwargs):
    """Rows of the compiled patch sequence for these kwargs (the prepared step input)."""
    return runner.prepare(kwargs).inputs["patches"].shape[1]


# --------------------------------------------------------------------------
# The Pallas kernels under SP
# --------------------------------------------------------------------------

def test_parity_sp_pallas_config_falls_back_on_fixture_shapes():
    """Config(sp_kernel="pallas", sp_rs_kernel="pallas") on a fixture: the kernels
    reject 16-column shards (their unsupported_reason), the JAX ring runs."""
    _, ref = fixture("wan_i2v")
    site_plan._NOTICED.clear()
    out = run("wan_i2v", 4, "sp", Config(sp_kernel="pallas", sp_rs_kernel="pallas"))
    assert rel(out, ref) <= 1e-5
    assert {op for op, _ in site_plan._NOTICED} == {"all_gather_matmul", "matmul_reduce_scatter"}


@pytest.mark.slow
def test_sp_pallas_kernels_interpret_mode():
    """A Wan with 128-wide shards (heads 4 x 128, ffn 512, tp 4) runs the Pallas
    all-gather-matmul and matmul-reduce-scatter kernels (TPU interpret mode)
    under SP and matches the one-device model."""
    c = wan.config_from_diffusers(dict(wan.PRESETS["tiny"], attention_head_dim=128, ffn_dim=512, num_layers=1))
    model = wan.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0))
    kwargs = wan.example_inputs(c, height=64, width=96, frames=9, text_len=16)
    ref = wan.Runner(model)(**kwargs).sample
    site_plan._NOTICED.clear()
    mesh = make_mesh(4)
    out = wan.Runner(model, mesh, Config(sp_kernel="pallas", sp_rs_kernel="pallas"), "sp")(**kwargs).sample
    assert not site_plan._NOTICED, f"a kernel fell back to the ring: {site_plan._NOTICED}"
    assert rel(out, ref) <= 1e-5


@pytest.mark.slow
def test_sp_cross_local_fused_kernel_interpret_mode(monkeypatch):
    """With splash attention (here interpreted) under SP and Config.sp_cross_local, the
    cross-attention runs kernels/cross_attention.py (q's norm and every head in one
    kernel, once per block) and matches the one-device model and the unfused SP path;
    heads of 128 (the kernel's lane block), 16 text tokens (one key block)."""
    from difflet_tpu.layers import sdpa as attention_mod

    c = wan.config_from_diffusers(dict(wan.PRESETS["tiny"], attention_head_dim=128, ffn_dim=512, num_layers=2))
    model = wan.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0))
    kwargs = wan.example_inputs(c, height=64, width=128, frames=9, text_len=16)  # 24 rows a rank
    ref = wan.Runner(model)(**kwargs).sample
    mesh = make_mesh(4)
    calls = []

    def counted(*a, **k):
        calls.append(a[1].shape)  # (par, q, ...)
        return kernel(*a, **k)

    kernel = attention_mod.rms_cross_attention
    monkeypatch.setattr(attention_mod, "rms_cross_attention", counted)
    outs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(attention_mod, "fuses_rms_cross", lambda *a: False)
        # interpret-mode splash kernels built in one trace hold its tracers: build anew
        attention_mod._splash_kernel.cache_clear()
        r = wan.Runner(model, mesh, Config(sp_cross_local=True, check_vma=True), "sp")
        r.par = dataclasses.replace(r.par, attn_impl="splash")
        outs[fused] = r(**kwargs).sample
    assert len(calls) == 1 and calls[0][-1] == c.inner_dim, calls  # traced once: the blocks' scan body
    assert rel(outs[True], ref) <= 1e-5
    assert rel(outs[True], outs[False]) <= 1e-5


# --------------------------------------------------------------------------
# Model-specific mechanisms against the plain model (float64)
# --------------------------------------------------------------------------

def test_sp_row_padding_float64():
    """SP with row padding equals the unpadded one-device model; pad keys must be dropped."""
    with jax.enable_x64(True):
        kwargs, expected = fixture("wan_t2v_pad", np.float64)
        ref = wan.Runner(load("wan_t2v_pad", jnp.float64))(**kwargs).sample
        assert rel(ref, expected) <= 1e-5
        mesh = make_mesh(4)
        runner = wan.Runner(load("wan_t2v_pad", jnp.float64, mesh), mesh, Config(), "sp")
        assert rows(runner, kwargs) == 48  # each ring half: 6 rows
        assert rel(runner(**kwargs).sample, ref) <= 1e-12
        runner.mask_pad_keys = False  # mechanism removed: pad keys attended to
        assert rel(runner(**kwargs).sample, ref) > 1e-3


def test_sp_without_row_padding():
    """DIFFLET_TPU_SP_PAD=0: a sequence that splits runs unpadded; one that does not is refused."""
    mesh = make_mesh(4)
    kwargs, ref = fixture("wan_t2v")  # 72 tokens = 8 * 9
    runner = wan.Runner(load_f32("wan_t2v", 4), mesh, Config(sp_pad=False), "sp")
    assert rows(runner, kwargs) == 72
    assert rel(runner(**kwargs).sample, ref) <= 1e-5
    kwargs, _ = fixture("wan_t2v_pad")  # 45 tokens
    runner = wan.Runner(load_f32("wan_t2v_pad", 4), mesh, Config(sp_pad=False), "sp")
    with pytest.raises(ValueError, match=r"cannot split 45 patch tokens over tp=4.*multiple of 2\*P = 8.*pad=True"):
        runner(**kwargs).sample


def test_rope_tables_pad_rows_and_split_order():
    c = wan.preset("tiny")
    cos, sin = wan.rope_tables(c, (3, 4, 6), rows=80, split=False)
    assert (cos[72:] == 1).all() and (sin[72:] == 0).all()  # pad rows: identity rotation
    # token (f, h, w) = (2, 1, 3): t/h/w channels 8/4/4, interleaved pairs
    t_dim, h_dim, w_dim = c.rope_dims
    tok = 2 * 24 + 1 * 6 + 3
    ang = np.concatenate([p * 10000.0 ** (-np.arange(0, d, 2) / d) for p, d in ((2, t_dim), (1, h_dim), (3, w_dim))])
    np.testing.assert_allclose(cos[tok], np.repeat(np.cos(ang), 2), atol=1e-7)
    np.testing.assert_allclose(sin[tok], np.repeat(np.sin(ang), 2), atol=1e-7)
    cs, ss = wan.rope_tables(c, (3, 4, 6), rows=80, split=True)
    perm = np.r_[0:16:2, 1:16:2]
    np.testing.assert_array_equal(cs, cos[:, perm])
    np.testing.assert_array_equal(ss, sin[:, perm])


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_sharded_model_float64(mode):
    """TP / SP (across-heads norms, sharded time_proj, per-token modulation under SP)
    against the one-device model in float64 on the per-token TI2V case."""
    with jax.enable_x64(True):
        kwargs, _ = fixture("wan_ti2v", np.float64)
        ref = wan.Runner(load("wan_ti2v", jnp.float64))(**kwargs).sample
        mesh = make_mesh(4)
        out = wan.Runner(load("wan_ti2v", jnp.float64, mesh), mesh, Config(), mode)(**kwargs).sample
        assert rel(out, ref) <= 1e-12


@pytest.mark.parametrize("case", ["wan_t2v_pad", "wan_i2v"])
def test_sp_cross_local_float64(case):
    """Config.sp_cross_local: cross-attention on each rank's rows with every head
    (attn2.to_q / norm_q / to_out replicated, text K/V gathered in the block, or
    cached with all heads) equals the one-device model in float64, K/V computed in
    the step and cached alike; off, the weights keep the column / row plan.
    Broken gathers or rows would not match to 1e-12."""
    with jax.enable_x64(True):
        kwargs, _ = fixture(case, np.float64)
        ref = wan.Runner(load(case, jnp.float64))(**kwargs).sample
        mesh = make_mesh(4)
        model = load(case, jnp.float64, mesh)
        for local in (True, False):
            r = wan.Runner(model, mesh, Config(sp_cross_local=local), "sp")
            assert r.par.cross_local is local
            to_q, to_out = r.model.blocks.attn2.to_q.kernel[...], r.model.blocks.attn2.to_out["0"].kernel[...]
            assert to_q.sharding.spec == (P() if local else P(None, None, TP))
            assert to_out.sharding.spec == (P() if local else P(None, TP, None))
            assert rel(r(**kwargs).sample, ref) <= 1e-12
            kv = r.encode_text(kwargs["encoder_hidden_states"], kwargs.get("encoder_hidden_states_image"))
            assert kv["k"].sharding.spec == (P() if local else P(None, None, None, TP))
            assert rel(r(kwargs["hidden_states"], kwargs["timestep"], text_kv=kv).sample, ref) <= 1e-12
        # TP ignores the setting
        assert not wan.Runner(model, mesh, Config(sp_cross_local=True), "tp").par.cross_local


def test_split_rope_float64():
    """Split-halves RoPE (q/k rows and q/k norm weights permuted at load, tables
    permuted per forward) equals the interleaved model; each part is needed."""
    with jax.enable_x64(True):
        kwargs, _ = fixture("wan_t2v", np.float64)
        split = load("wan_t2v", jnp.float64, split_rope=True)
        plain = load("wan_t2v", jnp.float64, split_rope=False)
        assert split.config.split_rope and not plain.config.split_rope
        ref = wan.Runner(plain)(**kwargs).sample
        assert rel(wan.Runner(split)(**kwargs).sample, ref) <= 1e-12
        wq_split = np.asarray(split.blocks.attn1.to_q.kernel[...])
        wq_plain = np.asarray(plain.blocks.attn1.to_q.kernel[...])
        assert not np.array_equal(wq_split, wq_plain)

        # Removed: tables left interleaved.
        r = wan.Runner(split)
        grid, n = (3, 4, 6), 72  # wan_t2v's token grid, unpadded on one device
        # the port's RoPE constant (models/wan/port.py) cached with interleaved tables
        r.constant(("rope", grid, n), lambda: wan.rope_tables(split.config, grid, n, split=False))
        assert rel(r(**kwargs).sample, ref) > 1e-3

        # Removed: norm_q / norm_k weights not permuted with the q/k rows.
        abstract = nnx.eval_shape(lambda: wan.build(split.config, dtype=jnp.float64, rngs=nnx.Rngs(0)))
        km = wan.key_map(split.config, abstract)
        for p in ("blocks.attn1.norm_q.scale", "blocks.attn1.norm_k.scale"):
            km[p] = dataclasses.replace(km[p], perm=None)
        ckpt = loading.Checkpoint(FIXTURES / "wan_t2v" / "transformer")
        bad = loading.load_params(abstract, ckpt, km, dtype=jnp.float64)
        assert rel(wan.Runner(bad)(**kwargs).sample, ref) > 1e-3

        # Removed: permuted weights run with the interleaved rotation.
        bad = load("wan_t2v", jnp.float64, split_rope=True)
        bad.config = dataclasses.replace(bad.config, split_rope=False)
        assert rel(wan.Runner(bad)(**kwargs).sample, ref) > 1e-3


def test_text_kv_cache():
    """encode_text once per prompt, reused by every step: the same output as
    computing K/V in the step (one device and SP), a different prompt's cache
    gives a different output, and the compiled step does less work."""
    kwargs, ref = fixture("wan_i2v")
    runner = wan.Runner(load_f32("wan_i2v"))
    kv = runner.encode_text(kwargs["encoder_hidden_states"], kwargs["encoder_hidden_states_image"])
    assert set(kv) == {"k", "v", "k_img", "v_img"} and kv["k"].shape == (2, 1, 512, 64)
    cached = runner(kwargs["hidden_states"], kwargs["timestep"], text_kv=kv).sample
    assert rel(cached, runner(**kwargs).sample) == 0.0 and rel(cached, ref) <= 1e-5
    other_prompt = kwargs["encoder_hidden_states"] + np.random.default_rng(1).standard_normal((1, 512, 24)).astype(np.float32)
    other = runner.encode_text(other_prompt, kwargs["encoder_hidden_states_image"])
    assert rel(runner(kwargs["hidden_states"], kwargs["timestep"], text_kv=other).sample, ref) > 1e-3

    auto = wan.Runner(load_f32("wan_i2v"), cache_text=True)  # a denoise loop passing the same prompt
    for _ in range(2):
        np.testing.assert_array_equal(auto(**kwargs).sample, cached)
    first = auto.state["text_kv"][2]
    auto(**kwargs)
    assert auto.state["text_kv"][2] is first
    auto(**dict(kwargs, encoder_hidden_states=other_prompt))
    assert auto.state["text_kv"][2] is not first

    mesh = make_mesh(4)
    kwargs, ref = fixture("wan_t2v_pad")
    for local, spec in ((False, P(None, None, None, TP)), (True, P())):  # Config.sp_cross_local
        sp = wan.Runner(load_f32("wan_t2v_pad", 4), mesh, Config(sp_cross_local=local), "sp")
        kv = sp.encode_text(kwargs["encoder_hidden_states"])
        assert kv["k"].sharding.spec == spec  # local: every head on every rank
        assert rel(sp(kwargs["hidden_states"], kwargs["timestep"], text_kv=kv).sample, ref) <= 1e-5

    # Compiled per-step cost, one layer (XLA's cost analysis counts a scan body once):
    # the cached step skips the text projection and the K/V projections.
    c = wan.config_from_diffusers(dict(wan.PRESETS["tiny"], num_layers=1))
    r = wan.Runner(wan.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    inputs = wan.example_inputs(c, height=48, width=64, frames=9, text_len=512)
    ab = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in inputs.items()}
    full = r.trace(**ab).lower().compile().cost_analysis()["flops"]
    cached = r.trace(ab["hidden_states"], ab["timestep"], text_kv=r.text_kv_shapes(1, 512)).lower().compile()
    cached = cached.cost_analysis()["flops"]
    saving = wan.flops(c, inputs) - wan.flops(c, inputs, text_kv_cached=True)
    print(f"\nper-step flops (1 layer, L=512): full {full:.3e}, cached {cached:.3e}, "
          f"saved {full - cached:.3e} (analytic matmul saving {saving:.3e})")
    assert cached < 0.5 * full
    assert 0.9 * saving <= full - cached <= 1.2 * saving


# --------------------------------------------------------------------------
# Errors before compilation
# --------------------------------------------------------------------------

def test_i2v_needs_512_text_tokens():
    kwargs, _ = fixture("wan_i2v")
    runner = wan.Runner(load_f32("wan_i2v"))
    with pytest.raises(ValueError, match="512"):
        runner(**dict(kwargs, encoder_hidden_states=kwargs["encoder_hidden_states"][:, :100])).sample
    with pytest.raises(ValueError, match="needs encoder_hidden_states_image"):
        runner(**{k: v for k, v in kwargs.items() if k != "encoder_hidden_states_image"}).sample


def test_input_errors():
    kwargs, _ = fixture("wan_t2v")
    runner = wan.Runner(load_f32("wan_t2v"))
    with pytest.raises(ValueError, match="in_channels=4"):
        runner(**dict(kwargs, hidden_states=np.zeros((1, 5, 3, 8, 12), np.float32))).sample
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        runner(**dict(kwargs, hidden_states=np.zeros((1, 4, 3, 7, 12), np.float32))).sample
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        runner(**dict(kwargs, hidden_states=np.zeros((1, 4, 3, 8, 66), np.float32))).sample
    with pytest.raises(ValueError, match=r"timestep must be \(1,\) or per token \(1, 72\)"):
        runner(**dict(kwargs, timestep=np.zeros((1, 71), np.float32))).sample
    with pytest.raises(ValueError, match="text_dim=24"):
        runner(**dict(kwargs, encoder_hidden_states=np.zeros((1, 10, 23), np.float32))).sample
    with pytest.raises(ValueError, match="no image branch"):
        runner(**kwargs, encoder_hidden_states_image=np.zeros((1, 6, 20), np.float32)).sample
    with pytest.raises(ValueError, match="4 heads do not divide over tp=3"):
        wan.Runner(wan.build(wan.preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0)), make_mesh(3), Config())


def test_config_from_diffusers_refuses_unsupported_values():
    base = wan.PRESETS["tiny"]
    for key, value in (("qk_norm", "rms_norm"), ("pos_embed_seq_len", 514), ("cross_attn_norm", False),
                       ("added_kv_proj_dim", 64)):
        with pytest.raises(ValueError, match=key):
            wan.config_from_diffusers(dict(base, **{key: value}))
    with pytest.raises(ValueError, match="added_kv_proj_dim"):
        wan.config_from_diffusers(dict(base, image_dim=20, added_kv_proj_dim=32))


# --------------------------------------------------------------------------
# Wan2.2 A14B experts
# --------------------------------------------------------------------------

def test_experts_switch_at_the_boundary(tmp_path):
    """load_experts reads transformer + transformer_2 and switches at boundary_ratio * 1000."""
    src = FIXTURES / "wan_t2v" / "transformer"
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer_2").mkdir()
    for sub in ("transformer", "transformer_2"):
        shutil.copy(src / "config.json", tmp_path / sub / "config.json")
    tensors = load_file(str(src / "diffusion_pytorch_model.safetensors"))
    save_file(tensors, str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"))
    low = {k: (v * 0.5 if k.startswith("blocks.") and k.endswith(".weight") else v) for k, v in tensors.items()}
    save_file(low, str(tmp_path / "transformer_2" / "diffusion_pytorch_model.safetensors"))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.875}))

    experts = wan.load_experts(tmp_path, dtype=jnp.float32, config=Config())
    assert experts.boundary_timestep == 875.0
    kwargs, _ = fixture("wan_t2v")
    hi, lo = dict(kwargs, timestep=np.array([900.0], np.float32)), dict(kwargs, timestep=np.array([500.0], np.float32))
    assert experts.expert_for(hi["timestep"]) == "high" and experts.expert_for(lo["timestep"]) == "low"
    assert experts.expert_for(np.array([875.0])) == "high"
    np.testing.assert_array_equal(experts(**hi).sample, experts.high(**hi).sample)
    np.testing.assert_array_equal(experts(**lo).sample, experts.low(**lo).sample)
    assert rel(experts.low(**lo).sample, experts.high(**lo).sample) > 1e-2
    kv = experts.encode_text(kwargs["encoder_hidden_states"])
    np.testing.assert_array_equal(experts(hi["hidden_states"], hi["timestep"], text_kv=kv).sample, experts(**hi).sample)
    np.testing.assert_array_equal(experts(lo["hidden_states"], lo["timestep"], text_kv=kv).sample, experts(**lo).sample)
    with pytest.raises(ValueError, match="straddle"):
        experts.expert_for(np.array([900.0, 500.0]))


# --------------------------------------------------------------------------
# Presets, plan, FLOPs, bench inputs
# --------------------------------------------------------------------------

PARAMS = {  # counted from diffusers WanTransformer3DModel(**config) on the meta device
    "Wan2.1-T2V-1.3B": 1_418_996_800, "Wan2.1-T2V-14B": 14_288_491_584, "Wan2.1-I2V-14B-480P": 16_394_878_784,
    "Wan2.2-T2V-A14B": 14_288_491_584, "Wan2.2-I2V-A14B": 14_288_901_184, "Wan2.2-TI2V-5B": 4_999_787_712,
    "tiny": 154_832,
}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_presets_build_the_released_sizes(name):
    c = wan.preset(name)
    model = nnx.eval_shape(lambda: wan.build(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state)) == PARAMS[name]
    km = wan.key_map(c, model)
    assert km["patch_embedding.kernel"].transform == "conv_as_linear"
    assert km["blocks.scale_shift_table"].dtype == "float32"
    assert km["condition_embedder.time_embedder.linear_1.kernel"].dtype == "float32"
    assert km["blocks.attn1.to_q.kernel"].perm is not None and km["blocks.attn2.to_q.kernel"].perm is None


def test_plan_covers_every_block_linear():
    model = nnx.eval_shape(lambda: wan.build(wan.preset("Wan2.1-I2V-14B-480P"), dtype=jnp.bfloat16,
                                             rngs=nnx.Rngs(0)))
    paths = loading.param_paths(model)
    linears = {p.rsplit(".", 1)[0] for p in paths if p.startswith("blocks.") and p.endswith(".kernel")}
    roles = {p: role_of(p, wan.PLAN) for p in linears}
    assert all(r in (COLUMN, ROW) for r in roles.values()), roles
    assert roles["blocks.attn2.add_k_proj"] == COLUMN and roles["blocks.ffn.net.2"] == ROW
    assert role_of("condition_embedder.time_proj", wan.PLAN) == COLUMN


def test_flops_match_the_brief():
    c14, c13, c5 = wan.preset("Wan2.1-T2V-14B"), wan.preset("Wan2.1-T2V-1.3B"), wan.preset("Wan2.2-TI2V-5B")
    for c, frames, tflops in ((c14, 9, 133.99), (c14, 81, 1678.37), (c13, 9, 16.34), (c13, 81, 283.00)):
        inputs = wan.example_inputs(c, frames=frames)
        assert inputs["hidden_states"].shape[2:] == ((frames - 1) // 4 + 1, 60, 104)
        assert abs(wan.flops(c, inputs) / 1e12 - tflops) < 0.01
    inputs = wan.example_inputs(c5, height=704, width=1280, frames=121, per_token=False)
    assert abs(wan.flops(c5, inputs) / 1e12 - 517.0) < 0.05
    ti2v = wan.example_inputs(c5, height=704, width=1280, frames=121)
    assert ti2v["timestep"].shape == (1, 27280) and ti2v["hidden_states"].shape == (1, 48, 31, 44, 80)
    i2v = wan.example_inputs(wan.preset("Wan2.1-I2V-14B-480P"))
    assert i2v["encoder_hidden_states_image"].shape == (1, 257, 1280)
