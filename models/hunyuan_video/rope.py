"""HunyuanVideo RoPE tables on the host (numpy), as diffusers'
`HunyuanVideoRotaryPosEmbed` (`transformer_hunyuan_video.py`) forms them with
`get_1d_rotary_pos_embed(use_real=True)`, axis by axis (frames, height, width),
in float32: the frequency powers rounded to float32 as torch rounds them, then
float32 angles, cos and sin.

The Runner builds them once per geometry (`Runner.constant`) and places them
once; the compiled step only rotates (`model.apply_rope`). Layout handed to the
step: `[n_joint, head_dim]` over the joint `[image | image pad | text | text
pad]` rows, the image rows' rotations first and the identity (cos 1, sin 0) on
every other row; in split-halves order when the q/k projections were permuted
at load (`config.split_rope`).
"""

from __future__ import annotations

import numpy as np

from difflet_tpu.layers.rope import RopeLayout, rope_inv_freqs

from .config import HunyuanVideoConfig


def rope_tables(c: HunyuanVideoConfig, frames: int, height: int, width: int):
    """`HunyuanVideoRotaryPosEmbed`: interleaved cos/sin `[F'*H'*W', head_dim]`, float32,
    formed as `get_1d_rotary_pos_embed(use_real=True)` forms them, axis by axis."""
    cos_parts, sin_parts = [], []
    sizes = (frames, height, width)
    for i, (dim, n) in enumerate(zip(c.rope_axes_dim, sizes)):
        ang = np.arange(n, dtype=np.float32)[:, None] * rope_inv_freqs(dim, c.rope_theta)[None, :]
        shape = [1, 1, 1, dim // 2]
        shape[i] = n
        cos_parts.append(np.broadcast_to(np.cos(ang).reshape(shape), (*sizes, dim // 2)))
        sin_parts.append(np.broadcast_to(np.sin(ang).reshape(shape), (*sizes, dim // 2)))
    cos = np.concatenate(cos_parts, axis=-1).reshape(-1, c.attention_head_dim // 2)
    sin = np.concatenate(sin_parts, axis=-1).reshape(-1, c.attention_head_dim // 2)
    return np.repeat(cos, 2, axis=1), np.repeat(sin, 2, axis=1)  # repeat_interleave(2)


def pad_rope(cos, sin, rows: int):
    """Appends identity rotations (cos 1, sin 0) up to `rows` rows (pad / text rows)."""
    n = rows - cos.shape[0]
    if n == 0:
        return cos, sin
    return (np.concatenate([cos, np.ones((n, cos.shape[1]), cos.dtype)]),
            np.concatenate([sin, np.zeros((n, sin.shape[1]), sin.dtype)]))


def joint_tables(c: HunyuanVideoConfig, frames: int, height: int, width: int, n_joint: int):
    """cos, sin `[n_joint, head_dim]` float32 of the step's joint rows: the image rows'
    tables (split-halves order if `c.split_rope`), identity on the rest."""
    cos, sin = rope_tables(c, frames, height, width)
    rope = RopeLayout(c.num_attention_heads, c.attention_head_dim, c.split_rope)
    return pad_rope(rope.table(cos), rope.table(sin), n_joint)
