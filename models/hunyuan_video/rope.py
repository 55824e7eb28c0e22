"""HunyuanVideo's RoPE tables on the host, as diffusers' `HunyuanVideoRotaryPosEmbed`
(`transformer_hunyuan_video.py`) forms them: `layers.rope.grid_tables` in float32
(frames, height, width).

The Runner builds them once per geometry (`Runner.constant`); the compiled step
only rotates. Layout handed to the step: `[n_joint, head_dim]` over the joint
`[image | image pad | text | text pad]` rows, the image rows' rotations first
and the identity (cos 1, sin 0) on every other row; in split-halves order when
the q/k projections were permuted at load (`config.split_rope`).
"""

from __future__ import annotations

import numpy as np

from difflet_tpu.layers.rope import RopeLayout, grid_tables, pad_identity

from .config import HunyuanVideoConfig


def rope_tables(c: HunyuanVideoConfig, frames: int, height: int, width: int):
    """`HunyuanVideoRotaryPosEmbed`: interleaved cos/sin `[F'*H'*W', head_dim]`, float32."""
    return grid_tables((frames, height, width), c.rope_axes_dim, c.rope_theta, float64=False)


def joint_tables(c: HunyuanVideoConfig, frames: int, height: int, width: int, n_joint: int, order=None):
    """cos, sin `[n_joint, head_dim]` float32 of the step's joint rows: the image rows'
    tables (split-halves order if `c.split_rope`), identity on the rest. `order`: the
    image rows' frame-major tokens (block-sparse tile order, -1 a pad row: identity)."""
    cos, sin = rope_tables(c, frames, height, width)
    rope = RopeLayout(c.num_attention_heads, c.attention_head_dim, c.split_rope)
    cos, sin = rope.table(np.asarray(cos)), rope.table(np.asarray(sin))
    if order is not None:
        keep = (order >= 0)[:, None]
        cos = np.where(keep, cos[np.maximum(order, 0)], np.float32(1))
        sin = np.where(keep, sin[np.maximum(order, 0)], np.float32(0))
    return pad_identity(cos, sin, n_joint)
