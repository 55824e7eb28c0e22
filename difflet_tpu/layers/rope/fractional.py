"""LTX-2's RoPE on the host: fractional coordinates and cos/sin tables, exactly as
diffusers' `LTX2AudioVideoRotaryPosEmbed` computes them.

The angles reach ~1.6e4 rad, so the order of operations matters: coordinates
and angles are float32, the frequency powers float64 (`rope_double_precision`)
cast to float32, then one float32 multiply. Forming the angle in float64 gives
~1e-3 error in cos/sin. Everything here is numpy, run once per shape (the
Runner caches the placed tables); the compiled step only rotates
(`rotate.GroupedRope`).

Table layouts handed to the step (last axis sharded over `tp`, whole heads per rank):

* ``"half"`` `[B, N, dim/2]`: one cos (sin) per rotation pair, grouped by
  head: group g holds pairs (i, i + g_size/2) of channels
  `[g*g_size, (g+1)*g_size)`. Native split RoPE (groups = the RoPE module's
  heads, diffusers' `(B, H, T, D/2)` tables flattened head-major) and
  interleaved checkpoints whose q/k were permuted to split halves at load
  (groups = the attention's heads).
* ``"interleaved"`` `[B, N, dim]`: diffusers' interleaved tables
  (c0, c0, c1, c1, ...), for interleaved checkpoints without the permutation.
"""

from __future__ import annotations

import math

import numpy as np


def torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """float64 `torch.linspace` (its CPU kernel fills the two halves from either end)."""
    if steps == 1:
        return np.array([start], np.float64)
    step = (end - start) / (steps - 1)
    i = np.arange(steps, dtype=np.float64)
    half = steps // 2
    return np.where(i < half, start + step * i, end - step * (steps - 1 - i))


def video_coords(batch: int, num_frames: int, height: int, width: int, fps: float, *, patch_size: int,
                 patch_size_t: int, scale_factors, causal_offset: int) -> np.ndarray:
    """`prepare_video_coords`: `[B, 3, N, 2]` float32 patch bounds (seconds, pixels, pixels)."""
    f32 = np.float32
    gf = np.arange(0, num_frames, patch_size_t, dtype=f32)
    gh = np.arange(0, height, patch_size, dtype=f32)
    gw = np.arange(0, width, patch_size, dtype=f32)
    grid = np.stack(np.meshgrid(gf, gh, gw, indexing="ij"), axis=0)  # [3, F, H, W]
    ends = grid + np.array([patch_size_t, patch_size, patch_size], f32).reshape(3, 1, 1, 1)
    latent = np.stack([grid, ends], axis=-1).reshape(3, -1, 2)  # [3, N, 2]
    pixel = latent * np.array(scale_factors, f32).reshape(3, 1, 1)
    t = pixel[0]
    t = np.maximum((t + f32(causal_offset)) - f32(scale_factors[0]), f32(0))
    pixel[0] = t / f32(fps)
    return np.broadcast_to(pixel[None], (batch, *pixel.shape)).astype(f32)


def audio_coords(batch: int, num_frames: int, *, patch_size_t: int, scale_factor: int, causal_offset: int,
                 hop_length: int, sampling_rate: int, shift: int = 0) -> np.ndarray:
    """`prepare_audio_coords`: `[B, 1, N, 2]` float32 start/end seconds."""
    f32 = np.float32
    gf = np.arange(shift, num_frames + shift, patch_size_t, dtype=f32)
    sf = f32(scale_factor)
    start = np.maximum(gf * sf + f32(causal_offset) - sf, f32(0))
    start_s = start * f32(hop_length) / f32(sampling_rate)
    end = np.maximum((gf + f32(patch_size_t)) * sf + f32(causal_offset) - sf, f32(0))
    end_s = end * f32(hop_length) / f32(sampling_rate)
    c = np.stack([start_s, end_s], axis=-1)  # [N, 2]
    return np.broadcast_to(c[None, None], (batch, 1, *c.shape)).astype(f32)


def angles(coords: np.ndarray, *, dim: int, max_positions, theta: float, double_precision: bool) -> np.ndarray:
    """`forward` steps 1-4: float32 angles `[B, N, dim // (2 n_axes) * n_axes]`, axes interleaved per frequency."""
    f32 = np.float32
    coords = np.asarray(coords, f32)
    n_axes = coords.shape[1]
    if coords.ndim == 4:
        coords = (coords[..., 0] + coords[..., 1]) / f32(2.0)  # [B, n_axes, N]
    grid = np.stack([coords[:, i] / f32(max_positions[i]) for i in range(n_axes)], axis=-1)  # [B, N, n_axes]
    steps = dim // (2 * n_axes)
    lin = torch_linspace(0.0, 1.0, steps)
    if double_precision:
        pow_indices = np.power(np.float64(theta), lin)
        freqs = (pow_indices * math.pi / 2.0).astype(f32)
    else:
        pow_indices = np.power(f32(theta), lin.astype(f32))
        freqs = (pow_indices * f32(math.pi) / f32(2.0)).astype(f32)
    a = (grid[..., None] * f32(2) - f32(1)) * freqs  # [B, N, n_axes, steps], float32
    return np.swapaxes(a, -1, -2).reshape(a.shape[0], a.shape[1], -1)


def split_tables(a: np.ndarray, dim: int):
    """Native split layout: cos/sin front-padded (1 / 0) to dim/2 -> `[B, N, dim/2]` ("half")."""
    pad = dim // 2 - a.shape[-1]
    cos, sin = np.cos(a), np.sin(a)
    if pad:
        cos = np.concatenate([np.ones_like(cos[..., :pad]), cos], axis=-1)
        sin = np.concatenate([np.zeros_like(sin[..., :pad]), sin], axis=-1)
    return cos.astype(np.float32), sin.astype(np.float32)


def interleaved_tables(a: np.ndarray, dim: int, n_axes: int):
    """diffusers' interleaved layout `[B, N, dim]`: repeat_interleave(2), front-padded by dim % (2 n_axes)."""
    cos, sin = np.repeat(np.cos(a), 2, axis=-1), np.repeat(np.sin(a), 2, axis=-1)
    pad = dim % (2 * n_axes)
    if pad:
        cos = np.concatenate([np.ones_like(cos[..., :pad]), cos], axis=-1)
        sin = np.concatenate([np.zeros_like(sin[..., :pad]), sin], axis=-1)
    return cos.astype(np.float32), sin.astype(np.float32)


def interleaved_as_half(table: np.ndarray) -> np.ndarray:
    """An interleaved table `[B, N, dim]` as "half" tables grouped by the
    attention's heads, for q/k permuted per head to [0, 2, ..., 1, 3, ...]:
    pair (2i, 2i+1) becomes (i, i + head_dim/2) and keeps its angle."""
    return np.ascontiguousarray(table[..., 0::2])


def tables(coords: np.ndarray, *, dim: int, max_positions, theta: float, double_precision: bool,
           rope_type: str, split_rope: bool):
    """cos, sin float32 in the step's layout ("half" unless interleaved without split_rope)."""
    a = angles(coords, dim=dim, max_positions=max_positions, theta=theta, double_precision=double_precision)
    if rope_type == "split":
        return split_tables(a, dim)
    cos, sin = interleaved_tables(a, dim, coords.shape[1])
    if split_rope:
        return interleaved_as_half(cos), interleaved_as_half(sin)
    return cos, sin
