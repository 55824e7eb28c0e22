"""Normalization (diffusers `normalization.py`, torch `nn.LayerNorm` / `nn.RMSNorm`).

Statistics in float32 (float64 for float64 models), the result cast back to
the input dtype, as diffusers' `FP32LayerNorm` and `RMSNorm` compute them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu import nn


def layer_norm(x, scale=None, bias=None, eps: float = 1e-6):
    """LayerNorm over the last axis in float32 (optional affine), cast back to x's dtype.

    Both statistics come from one read of x, var = E[x^2] - E[x]^2 (clamped at
    0), as flax's `nnx.LayerNorm(use_fast_variance=True)` (its default) computes
    them: XLA fuses the two sums into one reduction, where the two-pass form
    reads x once more for E[(x - mean)^2] (Wan, v5e: 199 -> 138 us per adaLN of
    a 1184 x 5120 shard, estimated). It loses float32 digits only when |mean|
    is large against the spread (a relative error of var near 6e-8 x
    mean^2 / var), far below a bfloat16 model's rounding; the float32 fixture
    parity and the float64 tests hold it to diffusers' two-pass statistics.
    """
    xf = x.astype(nn.fp32(x.dtype))
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(xf * xf, axis=-1, keepdims=True) - mean * mean, 0)
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
    """
    xf = x.astype(nn.fp32(x.dtype))
    var = jnp.mean(xf * xf, axis=-1, keepdims=True) if sum_sq is None else sum_sq / dim
    y = xf * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * scale.astype(y.dtype)
    return y.astype(x.dtype)


def rms_norm_across_heads(par, x, scale, eps: float, dim: int, sum_sq=None):
    """`torch.nn.RMSNorm(dim)` over all heads' channels (Wan's and LTX-2's q/k norms),
    of which this rank holds a column-parallel slice: the per-token sum of squares
    is summed over the `tp` ranks in float32, so every rank divides by the
    full-width mean (on one device: a plain RMSNorm).

    `sum_sq`: optional, this rank's per-token sum of squares of x, `[..., rows, 1]`
    float32, already computed (`nn.column(..., sum_squares=...)`: the all-gather
    kernel accumulates it from its tiles, so no pass over x reads it here); it is
    summed over the ranks the same way."""
    if sum_sq is None:
        xf = x.astype(nn.fp32(x.dtype))
        sum_sq = jnp.sum(xf * xf, axis=-1, keepdims=True)
    sum_sq = par.sum_over_ranks(sum_sq.astype(nn.fp32(x.dtype)))
    return rms_norm(x, scale, eps, sum_sq=sum_sq, dim=dim)


def modulate(x, shift, scale, eps: float = 1e-6):
    """adaLN: `norm(x) * (1 + scale) + shift` with a LayerNorm without affine
    (diffusers' `AdaLayerNormZero` & co.); shift and scale broadcast over rows."""
    return layer_norm(x, eps=eps) * (1 + scale) + shift


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
        chunks = jnp.split(par.gather_columns(self.linear(jax.nn.silu(emb))), self.chunks, axis=-1)
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
