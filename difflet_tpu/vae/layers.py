"""Layers shared by the VAE decoders, channels-last (NHWC / NTHWC).

Parameters are `nnx.Param`s that carry their checkpoint form as metadata
(`torch_leaf`: the diffusers leaf name, `torch_shape`, `torch_layout`: how the
torch tensor becomes ours), so `loading.py` maps a checkpoint key to a
parameter by one rule: the module path joined by dots, then `torch_leaf`.

Layouts: `"conv"`: torch `[out, in, *kernel]` -> `[*kernel, in, out]` (OIHW ->
HWIO, OIDHW -> DHWIO); `"linear"`: `[out, in]` -> `[in, out]`; `"flat"`: any
torch shape of the same size -> 1-D (the RMS norms' `gamma`, torch
`[C, 1, 1(, 1)]`); `"same"`: unchanged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu.vae import spread


def fp32(dtype):
    """The dtype of norm statistics for `dtype`: float32 (float64 for float64 models)."""
    return jnp.promote_types(dtype, jnp.float32)


def param(rngs: nnx.Rngs | None, shape, dtype, *, torch_leaf: str, torch_shape, torch_layout: str,
          init: str = "fan_in") -> nnx.Param:
    """A parameter of `shape` with its checkpoint form as metadata. `rngs=None` initialises
    zeros (the loader overwrites every value); else `init`: `fan_in` N(0, 1/fan_in),
    `ones`, `zeros`."""
    if rngs is None or init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        fan_in = math.prod(torch_shape[1:])
        value = jax.random.normal(rngs.params(), shape, dtype) / math.sqrt(fan_in)
    return nnx.Param(value, torch_leaf=torch_leaf, torch_shape=tuple(torch_shape), torch_layout=torch_layout)


def from_torch(array: np.ndarray, layout: str, shape) -> np.ndarray:
    """A checkpoint tensor in our layout (see the module docstring)."""
    if layout == "conv":
        nd = array.ndim
        array = np.transpose(array, (*range(2, nd), 1, 0))
    elif layout == "linear":
        array = array.T
    elif layout == "flat":
        array = array.reshape(-1)
    return np.ascontiguousarray(array).reshape(shape)


# --------------------------------------------------------------------------
# Convolutions and linears
# --------------------------------------------------------------------------

class Conv2d(nnx.Module):
    """torch `nn.Conv2d` (stride 1, zero padding `padding`), NHWC; kernel `[kh, kw, in, out]`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, padding: int = 0,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        k = kernel_size
        self.padding = padding
        self.kernel = param(rngs, (k, k, in_channels, out_channels), dtype, torch_leaf="weight",
                            torch_shape=(out_channels, in_channels, k, k), torch_layout="conv")
        self.bias = param(rngs, (out_channels,), dtype, torch_leaf="bias", torch_shape=(out_channels,),
                          torch_layout="same", init="zeros")

    def __call__(self, x):
        return conv2d(x, self.kernel[...], self.bias[...], self.padding)


def conv2d(x, kernel, bias, padding: int):
    """NHWC convolution, stride 1, zero padding `padding` on each spatial side (any leading
    dims before H, W are folded into the batch)."""
    x, pads = spread.halo(x, padding)  # in a spread decode: the neighbours' rows (vae/spread.py)
    lead = x.shape[:-3]
    x = x.reshape((-1,) + x.shape[-3:])
    y = jax.lax.conv_general_dilated(
        x, kernel.astype(x.dtype), window_strides=(1, 1), padding=pads,
        dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=fp32(x.dtype))
    y = (y + bias.astype(y.dtype)).astype(x.dtype)  # accumulate and add the bias in float32, round once
    return y.reshape(lead + y.shape[1:])


class Linear(nnx.Module):
    """torch `nn.Linear`: `y = x @ kernel + bias`, kernel `[in, out]`."""

    def __init__(self, in_features: int, out_features: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.kernel = param(rngs, (in_features, out_features), dtype, torch_leaf="weight",
                            torch_shape=(out_features, in_features), torch_layout="linear")
        self.bias = param(rngs, (out_features,), dtype, torch_leaf="bias", torch_shape=(out_features,),
                          torch_layout="same", init="zeros")

    def __call__(self, x):
        return x @ self.kernel[...].astype(x.dtype) + self.bias[...].astype(x.dtype)


def silu(x):
    """SiLU in float32, rounded once to x's dtype (as torch's bfloat16 kernel)."""
    xf = x.astype(fp32(x.dtype))
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)


def upsample_nearest2x(x):
    """torch `F.interpolate(scale_factor=2, mode="nearest")` on NHWC (also "nearest-exact":
    for an integer factor both read source pixel `i // 2`)."""
    *lead, h, w, c = x.shape
    x = jnp.broadcast_to(x[..., :, None, :, None, :], (*lead, h, 2, w, 2, c))
    return x.reshape(*lead, 2 * h, 2 * w, c)


# --------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------

class GroupNorm(nnx.Module):
    """torch `nn.GroupNorm(num_groups, num_channels, eps)` on channels-last input: statistics
    per sample and group over every position and the group's channels, in float32."""

    def __init__(self, num_groups: int, num_channels: int, *, eps: float = 1e-6, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels {num_channels} is not a multiple of "
                             f"num_groups {num_groups}")
        self.num_groups, self.eps = num_groups, eps
        self.scale = param(rngs, (num_channels,), dtype, torch_leaf="weight", torch_shape=(num_channels,),
                           torch_layout="same", init="ones")
        self.bias = param(rngs, (num_channels,), dtype, torch_leaf="bias", torch_shape=(num_channels,),
                          torch_layout="same", init="zeros")

    def __call__(self, x):
        b, c = x.shape[0], x.shape[-1]
        g = self.num_groups
        # in a spread decode (vae/spread.py) each rank sums its real rows and psum adds the ranks'
        xf = spread.mask(x.astype(fp32(x.dtype)))
        count = spread.size(xf) // (b * g)
        xg = xf.reshape(b, -1, g, c // g)
        mean = spread.psum(jnp.sum(xg, axis=(1, 3), keepdims=True)) / count
        centred = spread.mask((xg - mean).reshape(x.shape)).reshape(xg.shape)
        var = spread.psum(jnp.sum(jnp.square(centred), axis=(1, 3), keepdims=True)) / count  # two-pass, as torch
        y = ((xg - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        y = y * self.scale[...].astype(y.dtype) + self.bias[...].astype(y.dtype)
        return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """diffusers `QwenImageRMS_norm` / `WanRMS_norm` (channel_first, no bias) on channels-last
    input: `F.normalize(x, dim=channels) * sqrt(C) * gamma`, i.e. x over its L2 norm
    across channels (floored at 1e-12), in float32. torch's `gamma` is `[C, 1, 1]`
    (`images=True`) or `[C, 1, 1, 1]`; ours is `[C]`."""

    def __init__(self, dim: int, *, images: bool = True, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.dim = dim
        torch_shape = (dim, 1, 1) if images else (dim, 1, 1, 1)
        self.gamma = param(rngs, (dim,), dtype, torch_leaf="gamma", torch_shape=torch_shape,
                           torch_layout="flat", init="ones")

    def __call__(self, x):
        xf = x.astype(fp32(x.dtype))
        norm = jnp.sqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
        y = xf / jnp.maximum(norm, 1e-12) * math.sqrt(self.dim)
        return (y * self.gamma[...].astype(y.dtype)).astype(x.dtype)


# --------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------

# Query rows per step of `attention`: its float32 scores are [B, QUERY_CHUNK, N]
# (64 MiB per sample for the 16384 tokens of a 1024 x 1024 image's mid block).
QUERY_CHUNK = 1024


def attention(q, k, v, *, query_chunk: int | None = None, causal_block: int | tuple[int, int] | None = None):
    """Single-head softmax attention `softmax(q k^T / sqrt(d)) v` over `[B, N, d]`, scores,
    softmax and the weighted sum in float32 (torch SDPA; diffusers' `upcast_softmax`).

    Memory-safe: the queries go `query_chunk` (default `QUERY_CHUNK`) rows at a time
    (`lax.map`), each row's softmax over all N keys exactly, so the largest intermediate
    is `[B, query_chunk, N]`, never the `[B, N, N]` score matrix (1 GiB per sample in
    float32 at N = 16384). The queries are zero-padded to a multiple of the chunk; the
    padded rows are dropped.

    `causal_block`: tokens come in blocks of this many (a video's frames); a query sees the
    keys of its own block and the blocks before (diffusers' HunyuanVideo
    `prepare_causal_attention_mask`); a pair (query block, key block) when they differ (a
    spread decode's local queries against every rank's keys).
    """
    query_chunk = query_chunk or QUERY_CHUNK
    b, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    acc = fp32(q.dtype)
    q_block, k_block = causal_block if isinstance(causal_block, tuple) else (causal_block, causal_block)
    key_block = None if causal_block is None else jnp.arange(k.shape[1]) // k_block

    def rows(qc, start):
        s = jnp.einsum("bqd,bkd->bqk", qc, k, preferred_element_type=acc) * scale
        if key_block is not None:
            query_block = (start + jnp.arange(qc.shape[1])) // q_block
            s = jnp.where(key_block[None, None, :] <= query_block[None, :, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bqk,bkd->bqd", p, v.astype(acc)).astype(q.dtype)

    if n <= query_chunk:
        return rows(q, 0)
    chunks = -(-n // query_chunk)
    qp = jnp.pad(q, ((0, 0), (0, chunks * query_chunk - n), (0, 0)))
    qp = qp.reshape(b, chunks, query_chunk, d).transpose(1, 0, 2, 3)
    out = jax.lax.map(lambda a: rows(*a), (qp, jnp.arange(chunks) * query_chunk))  # [chunks, B, chunk, d]
    return out.transpose(1, 0, 2, 3).reshape(b, chunks * query_chunk, d)[:, :n]
