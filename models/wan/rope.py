"""Wan RoPE tables on the host, as diffusers' `WanRotaryPosEmbed` computes them
(`diffusers/src/diffusers/models/transformers/transformer_wan.py`).

Numpy, run once per token grid (the Runner caches and places the tables:
`Runner.constant`); the compiled step only rotates (`model.apply_rotary_emb`).
"""

from __future__ import annotations

import numpy as np

from difflet_tpu.layers.rope import RopeLayout

from .config import WanConfig


def rope_tables(config: WanConfig, grid, rows: int | None = None, split: bool | None = None):
    """cos/sin `[rows, head_dim]` float32 for the (f, h, w) token grid.

    As diffusers' WanRotaryPosEmbed: per axis (t/h/w = head_dim - 2*(head_dim//6),
    2*(head_dim//6), ...) the angles pos * 10000^(-2i/d_axis) in float64, cos/sin
    interleaved (repeat 2) and stored as float32, axes concatenated. Rows past
    the grid (padding) get the identity rotation (cos 1, sin 0). `split`
    (default: the config's) permutes the channels to split-halves order.
    """
    split = config.split_rope if split is None else split
    F, H, W = grid
    n = F * H * W
    rows = n if rows is None else rows
    parts_cos, parts_sin = [], []
    for dim, size, axis in zip(config.rope_dims, (F, H, W), range(3)):
        freqs = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        ang = np.outer(np.arange(size, dtype=np.float64), freqs)
        c = np.repeat(np.cos(ang), 2, axis=1).astype(np.float32)
        s = np.repeat(np.sin(ang), 2, axis=1).astype(np.float32)
        shape = [1, 1, 1, dim]
        shape[axis] = size
        parts_cos.append(np.broadcast_to(c.reshape(shape), (F, H, W, dim)))
        parts_sin.append(np.broadcast_to(s.reshape(shape), (F, H, W, dim)))
    cos = np.ones((rows, config.attention_head_dim), np.float32)
    sin = np.zeros((rows, config.attention_head_dim), np.float32)
    cos[:n] = np.concatenate(parts_cos, axis=-1).reshape(n, -1)
    sin[:n] = np.concatenate(parts_sin, axis=-1).reshape(n, -1)
    rope = RopeLayout(config.num_attention_heads, config.attention_head_dim, split)
    return rope.table(cos), rope.table(sin)
