"""A toy DiT-like model for tests of the parallel machinery and the loader.

One stack of pre-norm blocks (self-attention with per-head RMSNorm, GELU
MLP) over `[B, S, D]`, written once for every parallel mode with
`difflet_tpu.layers.nn.column` / `row`. Its parameter names follow diffusers
(`blocks.{i}.attn.to_q`, `blocks.{i}.ff.net.0.proj`, ...), so the loader's
generic part can be tested on it without a real port.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax

import jax.numpy as jnp
from flax import nnx

from difflet_tpu.layers import nn
from difflet_tpu.layers import FeedForward, Weight, attend, layer_norm, rms_norm
from difflet_tpu.parallel.modes import COLUMN, ROW, Parallel, param_specs

# The parallel plan: module path pattern -> role. Everything else is replicated.
PLAN = {
    "blocks.attn.to_q": COLUMN,
    "blocks.attn.to_k": COLUMN,
    "blocks.attn.to_v": COLUMN,
    "blocks.attn.to_out.0": ROW,
    "blocks.ff.net.0.proj": COLUMN,
    "blocks.ff.net.2": ROW,
}


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    dim: int = 32
    heads: int = 4
    ffn: int = 64
    layers: int = 2
    in_channels: int = 8


class Attention(nnx.Module):
    def __init__(self, c: ToyConfig, rngs):
        self.heads, self.head_dim = c.heads, c.dim // c.heads
        self.to_q = nn.Linear(c.dim, c.dim, rngs=rngs)
        self.to_k = nn.Linear(c.dim, c.dim, rngs=rngs)
        self.to_v = nn.Linear(c.dim, c.dim, rngs=rngs)
        self.norm_q = Weight(self.head_dim)
        self.norm_k = Weight(self.head_dim)
        self.to_out = nnx.Dict({"0": nn.Linear(c.dim, c.dim, rngs=rngs)})

    def __call__(self, par, x, kv_mask):
        q, k, v = nn.column(par, x, [self.to_q, self.to_k, self.to_v])
        heads = par.local_heads(self.heads)
        split = lambda t: t.reshape(*t.shape[:2], heads, self.head_dim)
        q = rms_norm(split(q), self.norm_q.scale[...])
        k = rms_norm(split(k), self.norm_k.scale[...])
        o = attend(par, q, k, split(v), kv_mask)
        return nn.row(par, [(o.reshape(*o.shape[:2], -1), self.to_out["0"])])


class Block(nnx.Module):
    def __init__(self, c: ToyConfig, rngs):
        self.attn = Attention(c, rngs)
        self.ff = FeedForward(c.dim, inner_dim=c.ffn, dtype=jnp.float32, rngs=rngs)

    def __call__(self, par, x, kv_mask):
        x = x + self.attn(par, layer_norm(x), kv_mask)
        return x + self.ff(par, layer_norm(x))


class ToyModel(nnx.Module):
    def __init__(self, c: ToyConfig, rngs: nnx.Rngs):
        self.config = c
        self.proj_in = nn.Linear(c.in_channels, c.dim, rngs=rngs)
        self.blocks = nn.stacked(lambda r: Block(c, r), c.layers, rngs)
        self.proj_out = nn.Linear(c.dim, c.in_channels, rngs=rngs)

    def __call__(self, par, hidden_states, kv_mask=None):
        """hidden_states `[B, S, C]` (this rank's rows under SP); kv_mask `[B, S_full]`."""
        x = self.proj_in(hidden_states)
        x = nn.scan_blocks(self.blocks, x, lambda blk, h: blk(par, h, kv_mask))
        return self.proj_out(x)


# --------------------------------------------------------------------------
# Shared by the tests
# --------------------------------------------------------------------------

def rel_l2(a, b) -> float:
    """Relative L2 error `||a - b|| / ||b||`, computed in float64."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def read_fixture_io(case_dir):
    """A diffusers fixture's `io.npz` as (forward kwargs, outputs): `in.<kwarg>`
    and `out.<field>` with the prefixes dropped; 0-d inputs as Python scalars."""
    import numpy as np

    z = np.load(pathlib.Path(case_dir) / "io.npz")
    inputs = {k[3:]: (z[k].item() if z[k].ndim == 0 else z[k]) for k in z.files if k.startswith("in.")}
    outputs = {k[4:]: z[k] for k in z.files if k.startswith("out.")}
    return inputs, outputs


@functools.lru_cache(maxsize=None)
def fixture_sample(case_dir):
    """(forward kwargs, expected `sample`) of a fixture case, read once per case."""
    kwargs, out = read_fixture_io(case_dir)
    return kwargs, out["sample"]


def load_fixture_transformer(case_dir, tp=None, *, split_rope=True, dtype=jnp.float32):
    """(model, mesh): a fixture case's `transformer/` folder loaded as the runtime loads it,
    replicated (`tp` None) or on a `tp` mesh of the CPU devices."""
    from difflet_tpu.config import Config
    from difflet_tpu.loading import load_transformer
    from difflet_tpu.parallel.mesh import make_mesh

    mesh = None if tp is None else make_mesh(tp)
    model = load_transformer(pathlib.Path(case_dir) / "transformer", dtype=dtype, mesh=mesh,
                             config=Config(split_rope=split_rope))
    return model, mesh


# --------------------------------------------------------------------------
# The toy port: the worked example of docs/porting.md
# --------------------------------------------------------------------------
# A port is a PortSpec: the loader's contract (config_from_diffusers, presets,
# build, plan, key_map) and the Runner's (prepare, forward). `register_toy_port()`
# makes `--model toy:tiny` and `Runner(ToyModel(...))` work.

TOY_PRESETS = {
    "tiny": dict(dim=32, heads=4, ffn=64, layers=2, in_channels=8, tokens=24),
    "toy-small": dict(dim=256, heads=8, ffn=1024, layers=4, in_channels=64, tokens=1000),
}


def contiguous_proj_out_rows(model, ranks: int) -> None:
    """A mechanism removed, for the tests that show it matters: each rank of a single-stream
    block's packed `proj_out` (FLUX, HunyuanVideo: cat([attn, mlp]) rows) gets a contiguous
    1/P of the checkpoint rows, split into its attn and mlp shards, as one plain
    row-parallel Linear would, instead of the rows of the inputs it holds."""
    import numpy as np

    blocks = model.single_transformer_blocks.proj_out
    a_var, m_var = blocks.attn.kernel, blocks.mlp.kernel
    a, m = np.asarray(a_var.get_value()), np.asarray(m_var.get_value())
    full = np.concatenate([a, m], axis=1)  # [L, attn + mlp rows, D], checkpoint row order
    rows, a_rows = full.shape[1] // ranks, a.shape[1] // ranks
    chunks = [full[:, r * rows:(r + 1) * rows] for r in range(ranks)]
    bad_a = np.concatenate([ch[:, :a_rows] for ch in chunks], axis=1)
    bad_m = np.concatenate([ch[:, a_rows:] for ch in chunks], axis=1)
    assert not np.array_equal(bad_a, a)
    a_var.set_value(jax.device_put(bad_a, a_var.get_value().sharding))
    m_var.set_value(jax.device_put(bad_m, m_var.get_value().sharding))


def _toy_config(cfg: dict, *, split_rope=True):
    del split_rope  # the toy has no RoPE
    return ToyConfig(**{k: v for k, v in cfg.items() if k not in ("tokens", "_class_name")}), cfg.get("tokens", 24)


def _toy_build(config, *, dtype=jnp.float32, rngs):
    import jax

    c, tokens = config if isinstance(config, tuple) else (config, 24)
    model = ToyModel(c, rngs)
    if jnp.dtype(dtype) != jnp.float32:
        nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), nnx.state(model)))
    return model


def _toy_key_map(config, model):
    from difflet_tpu import loading

    c = config[0] if isinstance(config, tuple) else config
    return loading.default_key_map(model, stacked={"blocks": c.layers})


def _toy_prepare(run, kw):
    """hidden_states `[B, S, C]` padded by the Runner's rule (pad keys masked);
    the timestep scales the input (a stand-in for a timestep embedding)."""
    import numpy as np

    from difflet_tpu.parallel import padding
    from difflet_tpu.port import Prepared, returned_sample

    x = kw["hidden_states"]
    if x.ndim != 3 or x.shape[-1] != run.cfg.in_channels:
        raise ValueError(f"hidden_states: shape {x.shape}, expected (B, S, {run.cfg.in_channels})")
    n = x.shape[1]
    x, rows = run.pad_stream(x)
    inputs = dict(x=x, t=np.asarray(kw["timestep"], np.float32),
                  mask=padding.key_mask(n, rows, batch=x.shape[0]))
    specs = dict(x=run.row_spec(), t=run.batch_spec(), mask=run.batch_spec())  # the mask is (B, S)
    return Prepared(key=None, inputs=inputs, specs=specs, out_specs=run.row_spec(),
                    finish=returned_sample(n, kw.get("return_dict", True)))


def _toy_forward(model, par, inputs, key):
    x, t = inputs["x"], inputs["t"]
    return model(par, x * (1.0 + t[:, None, None] / 1000.0).astype(x.dtype), inputs["mask"])


def _toy_example_inputs(config, *, height=64, width=64, frames=1, batch=1, seed=0, dtype=None):
    import numpy as np

    c, tokens = config
    rng = np.random.default_rng(seed)
    return {"hidden_states": rng.standard_normal((batch, tokens, c.in_channels)).astype(dtype or np.float32),
            "timestep": np.full((batch,), 900.0, np.float32)}


def _toy_flops(config, inputs):
    c, _ = config
    B, N, _ = inputs["hidden_states"].shape
    D = c.dim
    return float(B * c.layers * (8 * N * D * D + 4 * N * D * c.ffn + 4 * N * N * D))


def toy_spec():
    """The toy port's PortSpec (built on first use; `register_toy_port` registers it)."""
    import numpy as np

    from difflet_tpu.pipeline import schedules as S
    from difflet_tpu.port import Pipeline, PortSpec

    return PortSpec(
        name="toy", class_names=("ToyTransformer",), model_class=ToyModel,
        config_from_diffusers=_toy_config, presets=TOY_PRESETS, build=_toy_build, plan=PLAN,
        key_map=_toy_key_map, prepare=_toy_prepare, forward=_toy_forward,
        forward_args=("hidden_states", "timestep", "return_dict"),
        heads=lambda c: {"heads": (c[0] if isinstance(c, tuple) else c).heads},  # a model's config or the preset's
        released="toy-small", bench_shape=dict(height=64, width=64, frames=1),
        tiny_shape=dict(height=64, width=64, frames=1), example_inputs=_toy_example_inputs, flops=_toy_flops,
        pipeline=Pipeline(schedule=lambda steps, inputs, preset: S.flow_match_euler(
            S.SchedulerConfig(shift=1.0), steps, sigmas=np.linspace(1.0, 1 / steps, steps)),
            steps=8, guidance=1.0, guidance_mode="none", expert=_toy_expert))


def _toy_expert(timestep: float, boundary_ratio: float | None) -> int:
    """The toy's expert for a step when a test gives it two (`PortSpec.experts`), switched as
    Wan2.2-A14B's: expert 0 while `t >= boundary * 1000`, expert 1 after."""
    return 0 if boundary_ratio is None or timestep >= boundary_ratio * 1000 else 1


def register_toy_port():
    """Registers the toy port (`difflet_tpu.models.register`) and returns its spec."""
    from difflet_tpu import models

    for s in models._EXTRA:
        if s.name == "toy":
            return s
    return models.register(toy_spec())


def compile_step(model, fn, par: Parallel, mesh=None, plan=None, in_specs=(), out_specs=None,
                 static_argnums=()):
    """A jitted `step(state, *inputs)` and the model state to call it with.

    `fn(model, par, *inputs)` is the port's step; under a mesh it runs inside
    one `shard_map` with the parameters sharded by `plan`.
    """
    graphdef, state = nnx.split(model)

    def inner(state, *inputs):
        return fn(nnx.merge(graphdef, state), par, *inputs)

    if mesh is None:
        return jax.jit(inner), state
    specs = param_specs(state, plan)
    mapped = jax.shard_map(inner, mesh=mesh, in_specs=(specs, *in_specs), out_specs=out_specs,
                           check_vma=False)
    return jax.jit(mapped), state
