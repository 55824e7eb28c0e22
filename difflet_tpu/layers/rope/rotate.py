"""RoPE in the step: the rotation `x cos + rot(x) sin` of q and k, in XLA.

`rotate` is the one formula: `apply_rotary_emb` (XLA), `rms_norm_rope` (the
across-heads norm folded in), `GroupedRope.apply` (LTX-2's flat rows) and the
Pallas all-gather kernel's head epilogue (`kernels.all_gather_matmul_stream`,
whose `rot(x)` is a lane roll) all end in it. `rot(x)` is split halves
`[-x2, x1]` (q/k permuted at load, `layout.RopeLayout`) or diffusers'
interleaved pairs `(-x_{2i+1}, x_{2i})`; for bfloat16 it is the exact 0/+-1
`rotation_matrix` matmul, which XLA fuses with the cast back and splash's
relayout (benchmark/qk_passes.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from difflet_tpu.layers import nn


def rotate(x, rot, cos, sin):
    """RoPE's formula on float32 operands: `x cos + rot(x) sin` (`rot` = rot(x), the pairs'
    other channels with a sign). Every path rotates through it, in this order, so each
    rounds alike (the kernel's epilogue too)."""
    return x * cos + rot * sin


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
    the tables permuted per head to split halves at load (`RopeLayout`; the
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
    return rotate(xf, rot, cos, sin).astype(x.dtype)


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
    return rotate(xn.astype(f), rn.astype(f), cos, sin).astype(x.dtype)


MAX_FLAT_ROTATION = 1024  # widest (this rank's) q/k whose grouped rotation is one block-diagonal matmul


class HeadRope(NamedTuple):
    """Tables `[S, D]` that rotate every head of `[B, S, H, D]` alike (Wan, FLUX,
    HunyuanVideo, Qwen-Image): interleaved, or split halves when `split`."""

    cos: jax.Array
    sin: jax.Array
    split: bool


class GroupedRope(NamedTuple):
    """LTX-2's tables of one RoPE over flat rows `[B, N, C]`, this rank's channels;
    `groups` = global rotation groups of the "half" layout (`fractional.tables`),
    None: interleaved tables `[B, N, C]`."""

    cos: jax.Array
    sin: jax.Array
    groups: int | None

    def apply(self, par, x):
        """Rotates this rank's channels `[B, N, C]` of q or k (float32 math, cast back)."""
        if self.groups is None:  # diffusers' interleaved pairs (2i, 2i+1)
            return apply_rotary_emb(x, self.cos, self.sin, split=False)
        # split halves within each group (diffusers' split, or permuted interleaved); the
        # "half" tables hold one angle per pair
        b, n, c = x.shape
        g = self.groups // par.size
        cos = self.cos.reshape(self.cos.shape[0], n, g, -1)
        sin = self.sin.reshape(self.sin.shape[0], n, g, -1)
        if x.dtype != jnp.bfloat16 or c > MAX_FLAT_ROTATION:
            return apply_rotary_emb(x.reshape(b, n, g, c // g), cos, sin, split=True).reshape(b, n, c)
        # bf16: the rotation matmul over the flat rows, with the group matrices on a block
        # diagonal, so x is not relaid as [n * g, c / g] rows for it (exact, as there: one
        # non-zero product per output, accumulated in float32)
        f = nn.fp32(x.dtype)
        full = lambda t: (t if t.shape[-1] == c // g else jnp.concatenate([t, t], axis=-1)).reshape(t.shape[0], n, c)
        r = np.kron(np.eye(g, dtype=np.float32), rotation_matrix(c // g, True))
        rot = jnp.einsum("...c,ce->...e", x, jnp.asarray(r, x.dtype), preferred_element_type=f)
        return rotate(x.astype(f), rot, full(cos).astype(f), full(sin).astype(f)).astype(x.dtype)
