"""Small Flax NNX building blocks shared by the ports, and the block scan.

Parameters follow Flax conventions (Linear `kernel` is `[in, out]`, i.e. the
transpose of torch's weight); module attribute names follow diffusers, so a
diffusers key maps to a parameter path by renaming the leaf only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    """`y = x @ kernel + bias`; kernel `[in, out]`."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features), dtype)
                                / math.sqrt(in_features))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x):
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]

    def add_bias(self, y):
        return y if self.bias is None else y + self.bias[...]


def epilogue(linear: Linear, activation=None):
    """Row-wise epilogue for a column-parallel product: bias, then activation."""

    def fn(y):
        y = linear.add_bias(y)
        return y if activation is None else activation(y)

    return fn


def column(par, x, linears, activations=None):
    """Column-parallel `linears` sharing input `x` through `par.column`."""
    linears = list(linears)
    activations = activations or [None] * len(linears)
    return par.column(x, [l.kernel[...] for l in linears],
                      [epilogue(l, a) for l, a in zip(linears, activations)])


def row(par, pairs):
    """Row-parallel output of `(x, linear)` pairs; the first linear's bias is added once."""
    pairs = list(pairs)
    bias = pairs[0][1].bias
    return par.row([(x, l.kernel[...]) for x, l in pairs], None if bias is None else bias[...])


class Weight(nnx.Module):
    """A bare norm weight (`scale`), e.g. an RMSNorm's elementwise affine."""

    def __init__(self, dim: int, *, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))


def rms_norm(x, scale=None, eps: float = 1e-6, sum_sq=None, dim: int | None = None):
    """RMSNorm in float32, cast back to x's dtype.

    `sum_sq`/`dim` let a caller supply a per-token sum of squares reduced over
    ranks (across-heads norms under TP/SP) and the full width it covers.
    """
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if sum_sq is None:
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    else:
        var = sum_sq / dim
    y = xf * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * scale.astype(y.dtype)
    return y.astype(x.dtype)


def layer_norm(x, scale=None, bias=None, eps: float = 1e-6):
    """LayerNorm in float32 (optional affine), cast back to x's dtype."""
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * scale.astype(y.dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype)


def gelu_tanh(x):
    """diffusers' "gelu-approximate" (tanh) GELU."""
    return jax.nn.gelu(x, approximate=True)


def stacked(make_block, num: int, rngs: nnx.Rngs):
    """`num` blocks with parameters stacked on a leading axis (for `scan_blocks`)."""

    @nnx.split_rngs(splits=num)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make_block(r)

    return build(rngs)


def scan_blocks(blocks, carry, fn):
    """Runs `fn(block, carry) -> carry` over stacked `blocks` with `lax.scan`,
    so compile time does not grow with depth."""
    graphdef, state = nnx.split(blocks)

    def body(c, s):
        return fn(nnx.merge(graphdef, s), c), None

    carry, _ = jax.lax.scan(body, carry, state)
    return carry
