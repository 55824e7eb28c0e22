"""RoPE tables over position axes, on the host (numpy), as diffusers forms them
for FLUX, Wan, HunyuanVideo and Qwen-Image: each axis (frame, height, width, or
FLUX's id columns) rotates its own `axes_dim[i]` channels by `position * inv_freq`.

The models differ only in the precision of each step, kept here as each
diffusers module takes it (the angles reach ~4e3 rad: an angle formed in another
precision is another table):

* FLUX (`FluxPosEmbed`), Wan (`WanRotaryPosEmbed`): positions cast to float32,
  frequencies, angles, cos and sin in float64, rounded to float32 at the end;
* HunyuanVideo (`get_1d_rotary_pos_embed(use_real=True)`): the inverse
  frequencies rounded to float32 as torch rounds them (`layout.rope_inv_freqs`),
  float32 angles, float32 cos and sin;
* Qwen-Image (`QwenEmbedRope`): float32 angles as HunyuanVideo's, cos and sin
  taken in float64 and rounded (torch's differ by at most one ulp).

Every table is interleaved (each pair's value on its two channels, diffusers'
order); `layout.RopeLayout.table` permutes it to split halves. Rows past the
positions (padding, text without RoPE) get the identity: cos 1, sin 0.
"""

from __future__ import annotations

import numpy as np

from .layout import rope_inv_freqs


def angles_f64(positions, dim: int, theta: float) -> np.ndarray:
    """float64 angles `[N, dim/2]`: `position * 1 / theta ** (arange(0, dim, 2) / dim)`."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return np.outer(np.asarray(positions, np.float64), freqs)


def angles_f32(positions, dim: int, theta: float) -> np.ndarray:
    """float32 angles `[N, dim/2]`: float32 positions times torch's float32 inverse frequencies."""
    return (np.asarray(positions).astype(np.float32)[:, None] * rope_inv_freqs(dim, theta)[None, :]).astype(np.float32)


def interleaved(t: np.ndarray) -> np.ndarray:
    """One value per pair -> the pair's two channels (`repeat_interleave(2)`)."""
    return np.repeat(t, 2, axis=-1)


def pad_identity(cos, sin, rows: int):
    """cos, sin with identity rotations (cos 1, sin 0) appended up to `rows` rows."""
    n = rows - cos.shape[0]
    if n == 0:
        return cos, sin
    return (np.concatenate([cos, np.ones((n, cos.shape[1]), cos.dtype)]),
            np.concatenate([sin, np.zeros((n, sin.shape[1]), sin.dtype)]))


def position_tables(positions, axes_dim, theta: float):
    """FLUX's `FluxPosEmbed(ids)`: interleaved cos, sin `[N, sum(axes_dim)]` float32 of
    `positions [N, n_axes]`, cast to float32, then everything in float64."""
    pos = np.asarray(positions, np.float32).astype(np.float64)
    cos_out, sin_out = [], []
    for i, dim in enumerate(axes_dim):
        a = angles_f64(pos[:, i], dim, theta)
        cos_out.append(interleaved(np.cos(a)).astype(np.float32))
        sin_out.append(interleaved(np.sin(a)).astype(np.float32))
    return np.concatenate(cos_out, axis=-1), np.concatenate(sin_out, axis=-1)


def grid_tables(sizes, axes_dim, theta: float, *, float64: bool):
    """Interleaved cos, sin `[F*H*W, sum(axes_dim)]` float32 over the (F, H, W) grid,
    tokens in (frame, height, width) order; each axis' table formed once and broadcast.
    `float64`: Wan's precision (float64 angles, cos, sin); else HunyuanVideo's
    (float32 throughout)."""
    angles = angles_f64 if float64 else angles_f32
    cos_parts, sin_parts = [], []
    for axis, (dim, n) in enumerate(zip(axes_dim, sizes)):
        a = angles(np.arange(n), dim, theta)
        shape = [1, 1, 1, dim]
        shape[axis] = n
        for parts, fn in ((cos_parts, np.cos), (sin_parts, np.sin)):
            t = interleaved(fn(a)).astype(np.float32)
            parts.append(np.broadcast_to(t.reshape(shape), (*sizes, dim)))
    n = int(np.prod(sizes))
    return (np.concatenate(cos_parts, axis=-1).reshape(n, -1), np.concatenate(sin_parts, axis=-1).reshape(n, -1))


def segment_tables(segments, rows: int, axes_dim, theta: float):
    """Qwen-Image's joint table: interleaved cos, sin `[rows, sum(axes_dim)]` float32 with
    each `(start, positions [n, n_axes])` segment's rotations at rows start .. start + n - 1
    (float32 angles, cos and sin in float64) and the identity on every other row."""
    theta_rows = np.zeros((rows, sum(axes_dim) // 2), np.float32)
    valid = np.zeros(rows, bool)
    for start, positions in segments:
        positions = np.asarray(positions)
        theta_rows[start:start + len(positions)] = np.concatenate(
            [angles_f32(positions[:, i], d, theta) for i, d in enumerate(axes_dim)], axis=1)
        valid[start:start + len(positions)] = True
    theta_rows = theta_rows.astype(np.float64)
    cos = interleaved(np.cos(theta_rows).astype(np.float32))
    sin = interleaved(np.sin(theta_rows).astype(np.float32))
    cos[~valid], sin[~valid] = 1.0, 0.0
    return cos, sin
