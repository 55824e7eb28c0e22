"""The parallel linears (`Linear`, `column`, `row`), stacked blocks and their scan.

The layers built on them (norms, embeddings, attention, feed-forward, the
MMDiT blocks) are `difflet_tpu/layers/`.

Parameters follow Flax conventions (Linear `kernel` is `[in, out]`, i.e. the
transpose of torch's weight); module attribute names follow diffusers, so a
diffusers key maps to a parameter path by renaming the leaf only.
"""

from __future__ import annotations

import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.parallel.collective_matmul import KERNEL_ACTIVATIONS, Epilogue, LayerWeight, row_sum_squares


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


def weight(linear: Linear):
    """The kernel as `par.column` / `par.row` take it: an array, or inside
    `scan_blocks` a `LayerWeight` (its layer of the stack, not sliced out)."""
    return linear.kernel.get_value()


def kernel_activation(activation):
    """The name under which the Pallas all-gather kernel applies `activation`
    (`collective_matmul.KERNEL_ACTIVATIONS`), or None if it cannot."""
    if isinstance(activation, str):
        return activation if activation in KERNEL_ACTIVATIONS else None
    return next((name for name, fn in KERNEL_ACTIVATIONS.items() if activation is fn), None)


def epilogue(linear: Linear, activation=None, sum_squares: bool = False, heads=None):
    """Row-wise epilogue for a column-parallel product: bias, then activation.

    An `Epilogue` (bias and/or GELU tanh, which the Pallas all-gather kernel
    applies on its float32 tile) when the activation is None or one the
    kernel knows (`kernel_activation`), else a plain function (applied after
    the kernel). Either computes `activation(y + bias)` the same way when
    called on a product. With `sum_squares` it returns `(y, ssq)`: ssq each
    row's float32 sum of squares of y over its columns (`Epilogue.sum_squares`,
    accumulated by the all-gather kernel from its tiles). `heads`: a
    `layers.attention.HeadsOut` (no activation): the output head-major for
    attention (`Epilogue.heads`).
    """
    bias = None if linear.bias is None else linear.bias.get_value()  # in scan_blocks a LayerWeight
    if heads is not None:
        if activation is not None:
            raise ValueError("a projection written as attention heads takes no activation")
        return Epilogue(bias, None, sum_squares, heads)
    if activation is None:
        return Epilogue(bias, None, sum_squares) if bias is not None or sum_squares else None
    name = kernel_activation(activation)
    if name is not None:
        return Epilogue(bias, name, sum_squares)

    def fn(y):
        y = activation(linear.add_bias(y))
        return (y, row_sum_squares(y)) if sum_squares else y

    return fn


def column(par, x, linears, activations=None, sum_squares=None, heads=False, row_major=False, heads_out=None):
    """Column-parallel `linears` sharing input `x` through `par.column`.

    `heads`: the outputs are split into attention heads (`Parallel.column`).
    `heads_out`: optional, per linear a `layers.attention.HeadsOut` or None: that
    output comes head-major `[..., H, S, D]`, normalised / rotated / scaled for
    attention (under SP by the all-gather kernel itself).

    `sum_squares`: optional, per linear a bool; that linear's output is then
    the pair `(y, ssq)`, ssq `[..., rows, 1]` the float32 sum over this rank's
    columns of y's squares, per row (under SP the Pallas all-gather kernel
    accumulates it from its tiles; elsewhere it is computed from y), for
    `rms_norm_across_heads(..., sum_sq=ssq)`.

    `row_major`: where the rows are not sequence-sharded (the projections are plain
    dots: one device, TP, a rank-local `par`), the outputs come through an
    optimization barrier, row-major as the dot writes them. Without it XLA may lay
    the dot out to produce splash's head-major `[H, S, D]` directly, as a dot batched
    over heads, for which it copies the layer's weight out of the stack transposed
    every layer (LTX-2's text K/V: 8 MB a weight, ~40 us each on v5e, estimated);
    with it the dot reads the stacked weight in place and only its (smaller) output
    is relaid for splash.
    """
    linears = list(linears)
    activations = activations or [None] * len(linears)
    sum_squares = sum_squares or [False] * len(linears)
    heads_out = heads_out or [None] * len(linears)
    outs = par.column(x, [weight(l) for l in linears],
                      [epilogue(l, a, q, h) for l, a, q, h in zip(linears, activations, sum_squares, heads_out)],
                      heads=heads)
    return jax.lax.optimization_barrier(outs) if row_major and not par.seq_sharded else outs


def row(par, pairs):
    """Row-parallel output of `(x, linear)` pairs; the first linear's bias is added once."""
    pairs = list(pairs)
    bias = pairs[0][1].bias
    return par.row([(x, weight(l)) for x, l in pairs], None if bias is None else bias[...])


def stacked(make_block, num: int, rngs: nnx.Rngs):
    """`num` blocks with parameters stacked on a leading axis (for `scan_blocks`)."""

    @nnx.split_rngs(splits=num)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make_block(r)

    return build(rngs)


# The step cache's trace-time chain (difflet_tpu.step_cache.BlockChain) while a cached step is
# traced; None otherwise, so a step without a cache traces exactly as before.
BLOCK_CHAIN = contextvars.ContextVar("difflet_block_chain", default=None)


def num_blocks(blocks) -> int:
    """How many blocks a `stacked` module holds (the leading axis of its parameters)."""
    return int(jax.tree_util.tree_leaves(nnx.state(blocks))[0].shape[0])


def scan_blocks(blocks, carry, fn, xs=None, *, chain: bool = False, derive=None):
    """Runs `fn(block, carry) -> carry` over stacked `blocks` with `lax.scan`,
    so compile time does not grow with depth. With `xs` (stacked like the
    blocks, e.g. each block's text K/V): `fn(block, carry, x)`.

    `chain`: these blocks are part of the model's main block chain (its stacks in
    the order they run), which a step cache (difflet_tpu.step_cache) splits into
    first / middle / last blocks; ignored when no cached step is traced. `derive`:
    recomputes the parts of the carry that are functions of its others (Wan's row
    moments, LTX-2's sum of squares) after the cache added a residual to them.

    The scan runs over the layer index and every parameter but the `Linear`
    kernels and biases: a block's kernel (and bias) is a `LayerWeight` (the
    whole stack and the index), so the Pallas collective-matmul kernels DMA its
    layer straight out of the stack instead of from a per-layer copy (the
    all-gather kernel reads a column-parallel bias the same way, for its fused
    epilogue); every other use slices the layer out (`kernel[...]`,
    `bias[...]`), the same slice `lax.scan` takes of its inputs.
    """
    active = BLOCK_CHAIN.get() if chain else None
    if active is not None:
        return active.scan(blocks, carry, fn, xs, derive)
    return scan_range(blocks, carry, fn, xs)


def scan_range(blocks, carry, fn, xs=None, start: int = 0, stop: int | None = None):
    """`scan_blocks` over the blocks `[start, stop)` of the stack only."""
    linears = {path for path, node in nnx.iter_graph(blocks) if isinstance(node, Linear)}
    is_kernel = lambda path, _: path[-1] in ("kernel", "bias") and tuple(path[:-1]) in linears
    graphdef, kernels, rest = nnx.split(blocks, is_kernel, ...)
    if start != 0 or stop is not None:  # the layers' slices (the kernels stay whole: LayerWeight indexes them)
        rest, xs = jax.tree.map(lambda a: a[start:stop], (rest, xs))

    def body(c_i, s_x):  # the layer index is carried (a slice of an arange would feed the kernels)
        (c, i), (s, x) = c_i, s_x
        block = nnx.merge(graphdef, jax.tree.map(lambda k: LayerWeight(k, i), kernels), s)
        return ((fn(block, c) if xs is None else fn(block, c, x)), i + 1), None

    (carry, _), _ = jax.lax.scan(body, (carry, jnp.int32(start)), (rest, xs))
    return carry


def map_blocks(blocks, fn):
    """`fn(block) -> y` for every stacked block, the ys stacked (`lax.scan`)."""
    graphdef, state = nnx.split(blocks)

    def body(c, s):
        return c, fn(nnx.merge(graphdef, s))

    _, ys = jax.lax.scan(body, None, state)
    return ys
