"""The parallel linears (`Linear`, `column`, `row`), stacked blocks and their scan.

The layers built on them (norms, embeddings, attention, feed-forward, the
MMDiT blocks) are `difflet_tpu/layers/`.

Parameters follow Flax conventions (Linear `kernel` is `[in, out]`, i.e. the
transpose of torch's weight); module attribute names follow diffusers, so a
diffusers key maps to a parameter path by renaming the leaf only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def fp32(dtype):
    """The dtype of float32 math for `dtype`: float32, or float64 for float64 models."""
    return jnp.promote_types(dtype, jnp.float32)


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


def stacked(make_block, num: int, rngs: nnx.Rngs):
    """`num` blocks with parameters stacked on a leading axis (for `scan_blocks`)."""

    @nnx.split_rngs(splits=num)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make_block(r)

    return build(rngs)


def scan_blocks(blocks, carry, fn, xs=None):
    """Runs `fn(block, carry) -> carry` over stacked `blocks` with `lax.scan`,
    so compile time does not grow with depth. With `xs` (stacked like the
    blocks, e.g. each block's text K/V): `fn(block, carry, x)`."""
    graphdef, state = nnx.split(blocks)

    def body(c, s_x):
        s, x = s_x
        block = nnx.merge(graphdef, s)
        return (fn(block, c) if xs is None else fn(block, c, x)), None

    carry, _ = jax.lax.scan(body, carry, (state, xs))
    return carry


def map_blocks(blocks, fn):
    """`fn(block) -> y` for every stacked block, the ys stacked (`lax.scan`)."""
    graphdef, state = nnx.split(blocks)

    def body(c, s):
        return c, fn(nnx.merge(graphdef, s))

    _, ys = jax.lax.scan(body, None, state)
    return ys
