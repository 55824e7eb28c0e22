"""Attention pieces shared by the ports: heads, the head-major q/k/v epilogue, the
attention call. RoPE is `layers.rope`; the across-heads attention of Wan and LTX-2
is `layers.across_heads`.

The q/k norms are `normalization.rms_norm` (per head: FLUX, HunyuanVideo) or
`normalization.rms_norm_across_heads` (Wan, LTX-2).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from difflet_tpu.layers.sdpa import attention, reference_attention

from .normalization import rms_norm
from .rope import apply_rotary_emb


def split_heads(t, head_dim: int):
    """`[..., H * head_dim]` -> `[..., H, head_dim]` (H: this rank's heads)."""
    return t.reshape(*t.shape[:-1], t.shape[-1] // head_dim, head_dim)


def merge_heads(t):
    """`[..., H, head_dim]` -> `[..., H * head_dim]`."""
    return t.reshape(*t.shape[:-2], -1)


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


def attend(par, q, k, v, kv_mask=None, bias=None, head_major=False, q_scaled=False, sparse=None):
    """softmax(q k^T / sqrt(D)) v over `[B, S, H, D]` (this rank's heads).

    kv_mask: bool `[Skv]` or `[B, Skv]`, False for keys to drop (pad rows);
    bias: diffusers' additive key bias `(B, 1, Skv)` (LTX-2's text masks),
    run with XLA's attention. float64 runs a plain float64 softmax: XLA's
    attention takes its softmax in float32, and the float64 mechanism tests
    need every step in float64.

    head_major: q, k, v are `[B, H, S, D]` (`HeadsOut`; splash takes them as they
    are); q_scaled: q is already multiplied by 1/sqrt(D) (`HeadsOut.scale_q`);
    sparse: a block-sparse self-attention mask (`layers.sparse_masks.BlockSparsity`).
    The result is `[B, S, H, D]` either way.
    """
    if sparse is not None and bias is not None:
        raise ValueError("a block-sparse mask and an additive bias do not combine (LTX-2's text bias is "
                         "for cross-attention)")
    if q.dtype == jnp.float64 or bias is not None:
        if head_major:
            q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
        scale = 1.0 if q_scaled else None
        if q.dtype == jnp.float64:
            return reference_attention(q, k, v, kv_mask, bias, scale=scale, sparse=sparse)
        return jax.nn.dot_product_attention(q, k, v, bias=bias[:, None].astype(q.dtype), scale=scale,
                                            implementation="xla")
    return attention(q, k, v, kv_mask, impl=par.attn_impl, interpret=par.interpret, head_major=head_major,
                     q_scaled=q_scaled, sparse=sparse)
