"""Normalization (diffusers `normalization.py`, torch `nn.LayerNorm` / `nn.RMSNorm`).

Statistics in float32 (float64 for float64 models), the result cast back to
the input dtype, as diffusers' `FP32LayerNorm` and `RMSNorm` compute them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.layers import nn


def row_moments(x):
    """Each row's float32 `(E[x], E[x^2])` over the last axis, `[..., 1]` each: a LayerNorm's
    statistics as `layer_norm` takes them (`moments=`). Read without a barrier, so XLA
    reduces them in the fusion that writes x (e.g. a residual add), and a scan can
    carry them to the next layer's norm instead of a pass of their own over x."""
    xf = x.astype(nn.fp32(x.dtype))
    return jnp.mean(xf, axis=-1, keepdims=True), jnp.mean(xf * xf, axis=-1, keepdims=True)


def layer_norm(x, scale=None, bias=None, eps: float = 1e-6, moments=None):
    """LayerNorm over the last axis in float32 (optional affine), cast back to x's dtype.

    Both statistics come from one read of x, var = E[x^2] - E[x]^2 (clamped at
    0), as flax's `nnx.LayerNorm(use_fast_variance=True)` (its default) computes
    them: XLA fuses the two sums into one reduction, where the two-pass form
    reads x once more for E[(x - mean)^2] (Wan, v5e: 199 -> 138 us per adaLN of
    a 1184 x 5120 shard, estimated). It loses float32 digits only when |mean|
    is large against the spread (a relative error of var near 6e-8 x
    mean^2 / var), far below a bfloat16 model's rounding; the float32 fixture
    parity and the float64 tests hold it to diffusers' two-pass statistics.

    `moments`: x's `row_moments(x)` if the caller already has them (reduced where x
    was written); the same values, so the same result.
    """
    xf = x.astype(nn.fp32(x.dtype))
    mean, mean_sq = row_moments(x) if moments is None else moments
    var = jnp.maximum(mean_sq - mean * mean, 0)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * scale.astype(y.dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype)


def rms_norm(x, scale=None, eps: float = 1e-6, sum_sq=None, dim: int | None = None):
    """RMSNorm over the last axis in float32, cast back to x's dtype.

    `sum_sq` / `dim`: a per-token sum of squares reduced over ranks and the
    full width it covers (`rms_norm_across_heads`).

    The mean of squares reads x through an `optimization_barrier` (an identity):
    otherwise XLA shares one float32 copy of x between the reduction and the
    scaling and writes it out (FLUX's per-head q/k norms: a float32 pass per
    tensor), where apart each fusion converts the model-dtype x it reads, and
    the scaling fuses into its consumer (the q/k RoPE and relayout for splash
    attention, benchmark/qk_passes.py).
    """
    f = nn.fp32(x.dtype)
    if sum_sq is None:
        xs = jax.lax.optimization_barrier(x).astype(f)
        var = jnp.mean(xs * xs, axis=-1, keepdims=True)
    else:
        var = sum_sq / dim
    xf = x.astype(f)
    y = xf * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * scale.astype(y.dtype)
    return y.astype(x.dtype)


LANE = 128


def rms_norm_across_heads(par, x, scale, eps: float, dim: int, sum_sq=None):
    """`torch.nn.RMSNorm(dim)` over all heads' channels (Wan's and LTX-2's q/k norms),
    of which this rank holds a column-parallel slice: the per-token sum of squares
    is summed over the `tp` ranks in float32, so every rank divides by the
    full-width mean (on one device: a plain RMSNorm).

    `sum_sq`: this rank's per-token partial sum of squares `[..., 1]` in float32,
    if its producer computed it (`nn.column(..., sum_squares=...)`: the all-gather
    kernel accumulates it from its tiles, so no pass over x reads it here); else
    it is reduced here from x read through an
    optimization barrier (as `rms_norm` does), with the channels as
    `[..., C / 128, 128]` blocks (a reshape: the same products; the reduction
    sums the same squares). In that shape XLA fuses the scaling into the
    consumer of the head-split result (the q/k RoPE matmul and splash's
    relayout) instead of writing the normalised tensor in a pass of its own
    (benchmark/qk_passes.py). With `sum_sq` given, the flat form prices lower
    (the blocked one writes a float32 copy of x for that fusion)."""
    f = nn.fp32(x.dtype)
    c = x.shape[-1]
    if sum_sq is not None:
        return rms_norm(x, scale, eps, sum_sq=par.sum_over_ranks(sum_sq.astype(f)), dim=dim)
    lanes = LANE if c % LANE == 0 else c
    xb = x.reshape(*x.shape[:-1], c // lanes, lanes)
    xs = jax.lax.optimization_barrier(xb).astype(f)
    sum_sq = par.sum_over_ranks(jnp.sum(xs * xs, axis=(-2, -1), keepdims=True))
    y = rms_norm(xb, scale.reshape(c // lanes, lanes), eps, sum_sq=sum_sq, dim=dim)
    return y.reshape(x.shape)


def rms_scale_across_heads(par, sum_sq, eps: float, dim: int):
    """The per-token factor `rsqrt(mean of squares + eps)` of `rms_norm_across_heads`
    from this rank's partial sum of squares `[..., 1]` (summed over the `tp` ranks in
    float32), for `rope.rms_norm_rope`."""
    f = nn.fp32(sum_sq.dtype)
    return jax.lax.rsqrt(par.sum_over_ranks(sum_sq.astype(f)) / dim + eps)


def modulate(x, shift, scale, eps: float = 1e-6, moments=None):
    """adaLN: `norm(x) * (1 + scale) + shift` with a LayerNorm without affine
    (diffusers' `AdaLayerNormZero` & co.); shift and scale broadcast over rows.
    `moments`: as `layer_norm`'s."""
    return layer_norm(x, eps=eps, moments=moments) * (1 + scale) + shift


class Weight(nnx.Module):
    """A bare norm weight (`scale`): the affine of a per-head or across-heads q/k RMSNorm."""

    def __init__(self, dim: int, *, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))


class LayerNorm(nnx.Module):
    """`nn.LayerNorm(dim, eps)` with its affine (`scale`, `bias`), float32 statistics."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x):
        return layer_norm(x, self.scale[...], self.bias[...], self.eps)


class RMSNorm(nnx.Module):
    """diffusers' `RMSNorm(dim, eps, elementwise_affine)`: `weight` only with the affine."""

    def __init__(self, dim: int, eps: float, elementwise_affine: bool, *, dtype):
        self.eps = eps
        self.weight = Weight(dim, dtype=dtype) if elementwise_affine else None

    def __call__(self, x):
        return rms_norm(x, None if self.weight is None else self.weight.scale[...], self.eps)


MATMUL_ROWS = 8  # `few_rows` pads a conditioning input's rows to a multiple of this (one f32 sublane tile)


def few_rows(x):
    """A `[B, ...]` x of few rows (conditioning embeddings) with its rows zero-padded to a
    multiple of MATMUL_ROWS; the first B rows of anything computed row by row from it are
    the result for x (rows do not mix in a product: each row's result is the same dot).
    Why: XLA's TPU compiler turns a one-row product into a multiply-reduce loop fusion it
    prices near 4x the HBM read of the weight (Qwen-Image's 3072 x 4608 modulation shard:
    133 us a layer, estimated), where with 8 rows it emits an MXU matmul (48 us)."""
    pad = -x.shape[0] % MATMUL_ROWS
    return x if pad == 0 else jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))


def few_rows_linear(linear, x):
    """`linear(x)` for a `[B, K]` x of few rows, over `few_rows(x)`, sliced back."""
    if x.ndim != 2:
        return linear(x)
    return linear(few_rows(x))[:x.shape[0]]


class AdaLN(nnx.Module):
    """The modulation of adaLN: `linear(silu(emb))` in `chunks` pieces of `dim`.

    One module for diffusers' `AdaLayerNormZero` (6 chunks: shift, scale, gate
    of attention and MLP), `AdaLayerNormZeroSingle` (3), `AdaLayerNormContinuous`
    (2: scale, then shift) and `HunyuanVideoAdaNorm` (2 gates); `modulate`
    applies a shift and scale. `linear` is column-parallel (PLAN): each rank
    computes its columns of the small `(B, chunks * dim)` output, then all are
    gathered. Each chunk comes back as `(B, 1, dim)`, broadcast over rows.
    """

    def __init__(self, dim: int, chunks: int, *, dtype, rngs: nnx.Rngs):
        self.chunks = chunks
        self.linear = nn.Linear(dim, chunks * dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, emb, token_replace=None):
        """`token_replace`: None, or (bool `[rows]`, emb `[B, D]`): those rows take the
        second embedding's modulation (HunyuanVideo's first-frame tokens), so each
        chunk is `(B, rows, dim)`."""
        chunks = jnp.split(par.gather_columns(few_rows_linear(self.linear, jax.nn.silu(emb))), self.chunks, axis=-1)
        chunks = [c[:, None] for c in chunks]
        if token_replace is None:
            return chunks
        rows, replace_emb = token_replace
        return [jnp.where(rows[None, :, None], r, c) for c, r in zip(chunks, self(par, replace_emb))]


class AdaLayerNormContinuous(AdaLN):
    """diffusers' `AdaLayerNormContinuous(dim, dim, elementwise_affine=False)`, the MMDiTs'
    `norm_out`: `norm(x) * (1 + scale) + shift`, scale then shift from `linear(silu(emb))`."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        super().__init__(dim, 2, dtype=dtype, rngs=rngs)
        self.eps = eps

    def __call__(self, par, x, emb):
        scale, shift = AdaLN.__call__(self, par, emb)
        return modulate(x, shift, scale, self.eps)
