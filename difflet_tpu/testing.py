"""A toy DiT-like model for tests of the parallel machinery and the loader.

One stack of pre-norm blocks (self-attention with per-head RMSNorm, GELU
MLP) over `[B, S, D]`, written once for every parallel mode with
`difflet_tpu.nn.column` / `row`. Its parameter names follow diffusers
(`blocks.{i}.attn.to_q`, `blocks.{i}.ff.net.0.proj`, ...), so the loader's
generic part can be tested on it without a real port.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from difflet_tpu import nn
from difflet_tpu.attention import attention
from difflet_tpu.parallel import COLUMN, ROW

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
        self.norm_q = nn.Weight(self.head_dim)
        self.norm_k = nn.Weight(self.head_dim)
        self.to_out = nnx.Dict({"0": nn.Linear(c.dim, c.dim, rngs=rngs)})

    def __call__(self, par, x, kv_mask):
        q, k, v = nn.column(par, x, [self.to_q, self.to_k, self.to_v])
        heads = par.local_heads(self.heads)
        split = lambda t: t.reshape(*t.shape[:2], heads, self.head_dim)
        q = nn.rms_norm(split(q), self.norm_q.scale[...])
        k = nn.rms_norm(split(k), self.norm_k.scale[...])
        o = attention(q, k, split(v), kv_mask, impl=par.attn_impl)
        return nn.row(par, [(o.reshape(*o.shape[:2], -1), self.to_out["0"])])


class FeedForward(nnx.Module):
    def __init__(self, c: ToyConfig, rngs):
        self.net = nnx.Dict({"0": nnx.Dict({"proj": nn.Linear(c.dim, c.ffn, rngs=rngs)}), "2": nn.Linear(c.ffn, c.dim, rngs=rngs)})

    def __call__(self, par, x):
        (h,) = nn.column(par, x, [self.net["0"]["proj"]], [nn.gelu_tanh])
        return nn.row(par, [(h, self.net["2"])])


class Block(nnx.Module):
    def __init__(self, c: ToyConfig, rngs):
        self.attn = Attention(c, rngs)
        self.ff = FeedForward(c, rngs)

    def __call__(self, par, x, kv_mask):
        x = x + self.attn(par, nn.layer_norm(x), kv_mask)
        return x + self.ff(par, nn.layer_norm(x))


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
    import pathlib

    import numpy as np

    z = np.load(pathlib.Path(case_dir) / "io.npz")
    inputs = {k[3:]: (z[k].item() if z[k].ndim == 0 else z[k]) for k in z.files if k.startswith("in.")}
    outputs = {k[4:]: z[k] for k in z.files if k.startswith("out.")}
    return inputs, outputs
