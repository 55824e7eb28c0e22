"""Attention pieces shared by the ports: heads, RoPE, the attention call.

The q/k norms are `normalization.rms_norm` (per head: FLUX, HunyuanVideo) or
`normalization.rms_norm_across_heads` (Wan, LTX-2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from difflet_tpu import nn
from difflet_tpu.attention import attention, reference_attention


def split_heads(t, head_dim: int):
    """`[..., H * head_dim]` -> `[..., H, head_dim]` (H: this rank's heads)."""
    return t.reshape(*t.shape[:-1], t.shape[-1] // head_dim, head_dim)


def merge_heads(t):
    """`[..., H, head_dim]` -> `[..., H * head_dim]`."""
    return t.reshape(*t.shape[:-2], -1)


def apply_rotary_emb(x, cos, sin, split: bool):
    """diffusers' `apply_rotary_emb(use_real=True)` on x `[..., D]` in float32, cast back;
    cos / sin broadcast against x (e.g. `[S, 1, D]` for x `[B, S, H, D]`).

    `split=False`: diffusers' interleaved pairs (2i, 2i+1), `x cos + rot(x) sin` with
    `rot(x)` = (-x[2i+1], x[2i]) (`use_real_unbind_dim=-1`). `split=True`: q/k and
    the tables permuted per head to split halves at load (`layout.RopeLayout`; the
    tables' two halves are equal, and half-width tables work too), the rotation
    `[x1 c - x2 s, x2 c + x1 s]` on the halves: the same products and sums as the
    pairwise form in one elementwise pass, without a minor-axis relayout or a
    rotated copy of x.
    """
    f = nn.fp32(x.dtype)
    xf, cos, sin = x.astype(f), cos.astype(f), sin.astype(f)
    if split:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:
        xr = xf.reshape(*xf.shape[:-1], -1, 2)
        out = xf * cos + jnp.stack([-xr[..., 1], xr[..., 0]], axis=-1).reshape(xf.shape) * sin
    return out.astype(x.dtype)


def attend(par, q, k, v, kv_mask=None, bias=None):
    """softmax(q k^T / sqrt(D)) v over `[B, S, H, D]` (this rank's heads).

    kv_mask: bool `[Skv]` or `[B, Skv]`, False for keys to drop (pad rows);
    bias: diffusers' additive key bias `(B, 1, Skv)` (LTX-2's text masks),
    run with XLA's attention. float64 runs a plain float64 softmax: XLA's
    attention takes its softmax in float32, and the float64 mechanism tests
    need every step in float64.
    """
    if q.dtype == jnp.float64:
        return reference_attention(q, k, v, kv_mask, bias)
    if bias is not None:
        return jax.nn.dot_product_attention(q, k, v, bias=bias[:, None].astype(q.dtype), implementation="xla")
    return attention(q, k, v, kv_mask, impl=par.attn_impl, interpret=par.interpret)
