"""Qwen-Image's RoPE tables, on the host, as diffusers computes them.

diffusers' `QwenEmbedRope` (and `QwenEmbedLayer3DRope`, transformer_qwenimage.py)
keeps complex tables `polar(1, outer(index, 1 / theta ** (arange(0, d, 2) / d)))`
for positions 0..4095 and -4096..-1, per axis (frame, height, width), and the
attention multiplies q and k as complex pairs (2i, 2i+1) by them
(`apply_rotary_emb_qwen(use_real=False)`):

* image shape `idx` of an item's `img_shapes` (frame, height, width): frame
  positions idx .. idx + frame - 1 (the Layer3D variant puts the last shape, the
  condition image, at frame -1); height and width centred (`scale_rope=True`):
  -(h - h//2) .. h//2 - 1; tokens in (frame, height, width) order, the shapes
  concatenated;
* text token j: position `max_vid_index + j` on all three axes, where
  `max_vid_index = max(h//2, w//2)` over the shapes (Layer3D: at least the
  layer count), for every token of the text (masked ones too).

The tables are `layers.rope.segment_tables`; what is Qwen-Image's own is which
positions each token takes (`image_positions`). Numerics as torch's float32: the inverse frequencies `1 / pow(theta, k / d)`
and the angles `position * inv` are float32 products (bit-equal to torch's);
cos and sin are taken in float64 and rounded to float32 (torch's differ from
that by at most one ulp). The joint table is `[text | text pad | image | image
pad]` (pad rows cos 1, sin 0), each pair's value repeated on its two channels
(interleaved), or permuted to split-halves order when the model's q/k are
(`config.split_rope`).
"""

from __future__ import annotations

import numpy as np

from difflet_tpu.layers.rope import axes as rope
from difflet_tpu.layers.rope import RopeLayout

from .config import ROPE_TABLE, ROPE_THETA, QwenImageConfig


def image_positions(shapes, layer3d: bool = False):
    """(positions `[N, 3]` int64 (frame, height, width) of the image tokens, max_vid_index)."""
    out, max_vid = [], 0
    last = len(shapes) - 1
    for idx, (f, h, w) in enumerate(shapes):
        if layer3d and idx == last:  # the condition image: frame -1 (its table's last negative row)
            frames = np.full((f,), -1)
        else:
            frames = idx + np.arange(f)
        heights = np.arange(-(h - h // 2), h // 2)
        widths = np.arange(-(w - w // 2), w // 2)
        grid = np.stack(np.meshgrid(frames, heights, widths, indexing="ij"), axis=-1)
        out.append(grid.reshape(-1, 3))
        max_vid = max(max_vid, h // 2, w // 2)
    if layer3d:
        max_vid = max(max_vid, last)
    return np.concatenate(out).astype(np.int64), max_vid


def check_shapes(shapes, n_txt: int, layer3d: bool = False):
    """The table limits of diffusers' RoPE for one item's shapes and `n_txt` text tokens
    (torch would index past its 4096 rows, or fail to view the condition frames)."""
    _, max_vid = image_positions(shapes, layer3d)
    if max_vid + n_txt > ROPE_TABLE:
        raise ValueError(f"img_shapes {list(shapes)} and {n_txt} text tokens: text positions run to "
                         f"{max_vid + n_txt - 1}, past diffusers' {ROPE_TABLE}-row RoPE table")
    for idx, (f, h, w) in enumerate(shapes):
        if idx + f > ROPE_TABLE or h - h // 2 > ROPE_TABLE or w - w // 2 > ROPE_TABLE:
            raise ValueError(f"img_shapes: shape {idx} = {(f, h, w)} runs past diffusers' {ROPE_TABLE}-row "
                             f"RoPE table")
    if layer3d and shapes[-1][0] != 1:
        raise ValueError(f"img_shapes: the condition image (the last shape, Layer3D RoPE) must have 1 frame, "
                         f"got {tuple(shapes[-1])}")


def angles(positions, axes_dim) -> np.ndarray:
    """float32 angles `[S, sum(axes_dim) / 2]`: per axis `position * inv` (`rope.rope_inv_freqs`)."""
    positions = np.asarray(positions)
    return np.concatenate([rope.angles_f32(positions[:, i], d, ROPE_THETA) for i, d in enumerate(axes_dim)], axis=1)


def joint_tables(c: QwenImageConfig, shapes, n_txt: int, n_txt_pad: int, n_img_pad: int):
    """cos, sin `[n_txt_pad + n_img_pad, head_dim]` float32 for [text | pad | image | pad]."""
    img_pos, max_vid = image_positions(shapes, c.use_layer3d_rope)
    txt_pos = np.repeat((max_vid + np.arange(n_txt))[:, None], 3, axis=1)
    cos, sin = rope.segment_tables(((0, txt_pos), (n_txt_pad, img_pos)), n_txt_pad + n_img_pad, c.axes_dims_rope,
                                   ROPE_THETA)
    layout = RopeLayout(c.num_attention_heads, c.attention_head_dim, c.split_rope)
    return np.ascontiguousarray(layout.table(cos)), np.ascontiguousarray(layout.table(sin))
