"""Wan's RoPE tables on the host, as diffusers' `WanRotaryPosEmbed` computes them
(`transformer_wan.py`): `layers.rope.grid_tables` in float64 over the (f, h, w)
token grid. The Runner caches and places them (`Runner.constant`); the compiled
step only rotates (`layers.rope.rms_norm_rope`)."""

from __future__ import annotations

from difflet_tpu.layers.rope import RopeLayout, grid_tables, pad_identity

from .config import WanConfig

THETA = 10000.0  # WanRotaryPosEmbed(theta=10000.0), not a config key


def rope_tables(config: WanConfig, grid, rows: int | None = None, split: bool | None = None):
    """cos/sin `[rows, head_dim]` float32 for the (f, h, w) token grid; rows past the grid
    (padding) the identity. Per axis (t/h/w = head_dim - 2*(head_dim//6), 2*(head_dim//6),
    ...). `split` (default: the config's) permutes the channels to split-halves order."""
    split = config.split_rope if split is None else split
    cos, sin = grid_tables(grid, config.rope_dims, THETA, float64=True)
    cos, sin = pad_identity(cos, sin, cos.shape[0] if rows is None else rows)
    rope = RopeLayout(config.num_attention_heads, config.attention_head_dim, split)
    return rope.table(cos), rope.table(sin)
