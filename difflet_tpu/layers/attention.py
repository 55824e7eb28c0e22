"""Attention pieces shared by the ports: heads, RoPE, the attention call.

The q/k norms are `normalization.rms_norm` (per head: FLUX, HunyuanVideo) or
`normalization.rms_norm_across_heads` (Wan, LTX-2).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from difflet_tpu.layers import nn
from difflet_tpu.layers.sdpa import attention, reference_attention

from .normalization import rms_norm


def split_heads(t, head_dim: int):
    """`[..., H * head_dim]` -> `[..., H, head_dim]` (H: this rank's heads)."""
    return t.reshape(*t.shape[:-1], t.shape[-1] // head_dim, head_dim)


def merge_heads(t):
    """`[..., H, head_dim]` -> `[..., H * head_dim]`."""
    return t.reshape(*t.shape[:-2], -1)


LANE = 128
MAX_ROTATION_MATMUL = 256  # widest rotation done as a matmul (its FLOPs grow with the width)


def rotation_matrix(d: int, split: bool) -> np.ndarray:
    """The `[d, d]` matrix R of RoPE's rotation `rot(x) = x @ R` (entries 0 and +-1):
    split halves `rot(x) = [-x2, x1]`, interleaved pairs `rot(x)_{2i, 2i+1} =
    (-x_{2i+1}, x_{2i})`."""
    r = np.zeros((d, d), np.float32)
    if split:
        half = d // 2
        for i in range(half):
            r[i + half, i] = -1.0
            r[i, i + half] = 1.0
    else:
        for i in range(0, d, 2):
            r[i + 1, i] = -1.0
            r[i, i + 1] = 1.0
    return r


def _full_tables(cos, sin, d: int, split: bool, f):
    """cos / sin as float32 tables of width d (half-width tables: one angle per rotated pair)."""
    cos, sin = cos.astype(f), sin.astype(f)
    if cos.shape[-1] != d:
        cos, sin = (jnp.concatenate([t, t], axis=-1) if split else jnp.repeat(t, 2, axis=-1)
                    for t in (cos, sin))
    return cos, sin


def _rotation_block(d: int, split: bool) -> int:
    """The width the rotation matmul works on: interleaved pairs never cross a 128-lane
    block, so wide interleaved rows rotate block by block; split halves whole."""
    return LANE if not split and d > LANE and d % LANE == 0 else d


def _rotate_matmul(x, block: int, split: bool, f):
    """`rot(x)` of bf16 x as the 0/+-1 `rotation_matrix` matmul per `block` channels,
    accumulated in float32 (exact: one non-zero product per output)."""
    d = x.shape[-1]
    xb = x.reshape(*x.shape[:-1], d // block, block)
    return jnp.einsum("...d,de->...e", xb, jnp.asarray(rotation_matrix(block, split), x.dtype),
                      preferred_element_type=f).reshape(x.shape)


def apply_rotary_emb(x, cos, sin, split: bool):
    """diffusers' `apply_rotary_emb(use_real=True)` on x `[..., D]` in float32, cast back;
    cos / sin broadcast against x (e.g. `[S, 1, D]` for x `[B, S, H, D]`).

    `split=False`: diffusers' interleaved pairs (2i, 2i+1), `x cos + rot(x) sin` with
    `rot(x)` = (-x[2i+1], x[2i]) (`use_real_unbind_dim=-1`). `split=True`: q/k and
    the tables permuted per head to split halves at load (`layout.RopeLayout`; the
    tables' two halves are equal, and half-width tables work too), the rotation
    `[x1 c - x2 s, x2 c + x1 s]` on the halves.

    Both are `x cos + rot(x) sin` with the same products and sums (`a - b` as
    `a + (-b)`, which rounds identically). For bfloat16 x, `rot(x)` is one matmul
    with the 0/+-1 `rotation_matrix` accumulated in float32 (exact: one nonzero
    product per output, and bf16 values are exact in float32), so XLA fuses the
    whole rotation, the cast back and a following relayout (splash attention's
    head-major q/k) into the matmul's fusion instead of slicing and concatenating
    the lane axis (benchmark/qk_passes.py). Interleaved rows wider than 128 rotate
    per 128-channel block; split halves wider than MAX_ROTATION_MATMUL and other
    dtypes rotate elementwise.
    (A non-finite x would spread NaN over its row's D channels through the zero
    products of the matmul; q/k after their norms are finite.)
    """
    f = nn.fp32(x.dtype)
    d = x.shape[-1]
    xf = x.astype(f)
    cos, sin = _full_tables(cos, sin, d, split, f)
    block = _rotation_block(d, split)
    if x.dtype == jnp.bfloat16 and block <= MAX_ROTATION_MATMUL:
        rot = _rotate_matmul(x, block, split, f)
    elif split:
        half = d // 2
        rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    else:
        xr = xf.reshape(*xf.shape[:-1], -1, 2)
        rot = jnp.stack([-xr[..., 1], xr[..., 0]], axis=-1).reshape(xf.shape)
    return (xf * cos + rot * sin).astype(x.dtype)


def rotation_source(d: int, split: bool) -> np.ndarray:
    """`j` with `rot(x)_i = +-x_{j[i]}` for `rotation_matrix(d, split)`: the channel each
    rotated channel comes from (split halves: the other half; interleaved: the pair's other)."""
    i = np.arange(d)
    return (i + d // 2) % d if split else i ^ 1


def rms_norm_rope(x, row_scale, weight, cos, sin, split: bool):
    """`apply_rotary_emb(rms_norm(x), cos, sin, split)` with the RMSNorm given as its
    factors, bit-identical to normalising first, without the normalised x in between.

    x `[..., H, D]` (e.g. `[B, S, H, D]`, not normalised); row_scale: float32
    `rsqrt(mean of squares + eps)` broadcastable against x (`[B, S, 1, 1]`); weight:
    the norm's channel weight `[H, D]` (an across-heads norm's `[H * D]` reshaped).
    The normalised x is `xn = ((x * row_scale) * weight)` rounded to x's dtype, as
    `normalization.rms_norm` computes it. For bf16 x the rotated part is the 0/+-1
    rotation matmul of x itself (exact), scaled after it by row_scale and the weight
    permuted like the rotation: `rot(xn)_i = +-xn_j` and `(+-x_j * r) * w_j` rounds to
    exactly `+-xn_j` (IEEE rounding is sign-symmetric), so the result is the same
    bits, while the matmul reads the product rows as they are and XLA can fuse the
    norm's scaling into the RoPE fusion (for splash's relayout) instead of writing
    the normalised q / k in a pass of its own. Other dtypes and widths: normalise,
    then `apply_rotary_emb`.
    """
    f = nn.fp32(x.dtype)
    d = x.shape[-1]
    w = weight.astype(f)
    xn = ((x.astype(f) * row_scale) * w).astype(x.dtype)
    block = _rotation_block(d, split)
    if x.dtype != jnp.bfloat16 or block > MAX_ROTATION_MATMUL:
        return apply_rotary_emb(xn, cos, sin, split)
    cos, sin = _full_tables(cos, sin, d, split, f)
    src = (np.arange(d).reshape(d // block, block)[:, rotation_source(block, split)]).reshape(d)
    rot = _rotate_matmul(x, block, split, f)
    rn = ((rot * row_scale) * w[..., src]).astype(x.dtype)  # == rot(xn), exactly
    return (xn.astype(f) * cos + rn.astype(f) * sin).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class HeadsOut:
    """A q/k/v projection's output as attention takes it, head-major: `y [..., S, H * D]`
    -> `[..., H, S, D]`, with (each optional, in this order, each rounded to y's
    dtype) the per-head RMSNorm of weight `norm` `[D]` (`normalization.rms_norm`),
    RoPE `(cos, sin, split)` of tables `[S, D]` (`apply_rotary_emb`), and splash's
    `1/sqrt(D)` on q (`scale_q`; attend it with `q_scaled=True`).

    Given to `nn.column(..., heads_out=...)`: under SP the Pallas all-gather kernel
    does it on its float32 product tile and writes each head to its rows
    (`kernels.all_gather_matmul_stream.Heads`), so no pass over q/k/v (and no
    relayout for splash) follows the kernel; every other path calls this on the
    assembled product, where XLA fuses it as before (one fusion per tensor).
    """

    head_dim: int
    norm: object = None
    eps: float = 1e-6
    rope: tuple | None = None
    scale_q: bool = False

    @property
    def scale(self) -> float | None:
        return 1.0 / math.sqrt(self.head_dim) if self.scale_q else None

    def __call__(self, y):
        t = split_heads(y, self.head_dim)
        if self.norm is not None:
            t = rms_norm(t, self.norm, self.eps)
        if self.rope is not None:
            cos, sin, split = self.rope
            t = apply_rotary_emb(t, cos[:, None], sin[:, None], split)
        if self.scale_q:
            t = (t * self.scale).astype(t.dtype)
        return jnp.swapaxes(t, -3, -2)


def attend(par, q, k, v, kv_mask=None, bias=None, head_major=False, q_scaled=False):
    """softmax(q k^T / sqrt(D)) v over `[B, S, H, D]` (this rank's heads).

    kv_mask: bool `[Skv]` or `[B, Skv]`, False for keys to drop (pad rows);
    bias: diffusers' additive key bias `(B, 1, Skv)` (LTX-2's text masks),
    run with XLA's attention. float64 runs a plain float64 softmax: XLA's
    attention takes its softmax in float32, and the float64 mechanism tests
    need every step in float64.

    head_major: q, k, v are `[B, H, S, D]` (`HeadsOut`; splash takes them as they
    are); q_scaled: q is already multiplied by 1/sqrt(D) (`HeadsOut.scale_q`).
    The result is `[B, S, H, D]` either way.
    """
    if q.dtype == jnp.float64 or bias is not None:
        if head_major:
            q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
        scale = 1.0 if q_scaled else None
        if q.dtype == jnp.float64:
            return reference_attention(q, k, v, kv_mask, bias, scale=scale)
        return jax.nn.dot_product_attention(q, k, v, bias=bias[:, None].astype(q.dtype), scale=scale,
                                            implementation="xla")
    return attention(q, k, v, kv_mask, impl=par.attn_impl, interpret=par.interpret, head_major=head_major,
                     q_scaled=q_scaled)
