"""Token padding and the split-halves RoPE layout, done before the compiled step.

Padding: a sequence-parallel ring needs S to be a multiple of 2P (times a
tile, for the kernels). Inputs are padded eagerly, outside the compiled step,
so every rank compiles one identical program; the pad keys are masked in
attention and the output is cut back, also eagerly.

Split-halves RoPE: diffusers' interleaved RoPE rotates channel pairs
(2i, 2i+1) of each head, which on TPU is a minor-dimension relayout of every
q and k. q . k is invariant under one channel permutation applied to both, so
each head's q/k projection rows (and biases, and q/k norm weights) are
permuted once at load to [0, 2, 4, ..., 1, 3, 5, ...]; the cos/sin tables are
permuted the same way, and the rotation becomes split halves: a slice and a
concat. V and everything after attention are untouched.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp


# --------------------------------------------------------------------------
# Padding
# --------------------------------------------------------------------------

def padded_length(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def pad_tokens(x, multiple: int, axis: int = 1):
    """Pads `x` along `axis` with zeros to a multiple of `multiple`.

    Returns `(padded, pad_count)`. Runs eagerly (numpy or jax arrays).
    """
    n = x.shape[axis]
    pad = padded_length(n, multiple) - n
    if pad == 0:
        return x, 0
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    lib = np if isinstance(x, np.ndarray) else jnp
    return lib.pad(x, widths), pad


def key_mask(n_valid: int, n_padded: int, batch: int | None = None):
    """Boolean key-validity mask `[n_padded]` (or `[batch, n_padded]`): True for real tokens."""
    m = np.arange(n_padded) < n_valid
    return m if batch is None else np.broadcast_to(m, (batch, n_padded)).copy()


def unpad(x, n: int, axis: int = 1):
    """The first `n` entries of `x` along `axis`."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, n)
    return x[tuple(index)]


# --------------------------------------------------------------------------
# Split-halves RoPE
# --------------------------------------------------------------------------

def rope_permutation(head_dim: int) -> np.ndarray:
    """Per-head channel order `[0, 2, 4, ..., 1, 3, 5, ...]`."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def heads_permutation(num_heads: int, head_dim: int, rope_dim: int | None = None) -> np.ndarray:
    """The permutation of `num_heads * head_dim` channels, head by head.

    `rope_dim` (default head_dim) is how many leading channels of each head
    RoPE rotates; the rest keep their place.
    """
    rope_dim = head_dim if rope_dim is None else rope_dim
    per_head = np.concatenate([rope_permutation(rope_dim), np.arange(rope_dim, head_dim)])
    return (np.arange(num_heads)[:, None] * head_dim + per_head[None, :]).reshape(-1)


def permute_heads(a, num_heads: int, head_dim: int, axis: int = -1, rope_dim: int | None = None):
    """Permutes the head-major channel axis of `a` (a kernel's output axis,
    a bias, or a norm weight) to split-halves order, on the host."""
    perm = heads_permutation(num_heads, head_dim, rope_dim)
    if a.shape[axis] != perm.size:
        raise ValueError(f"permute_heads: axis {axis} of {a.shape} is not {num_heads}x{head_dim}")
    return np.take(np.asarray(a), perm, axis=axis)


def interleaved_to_split_table(table):
    """An interleaved cos/sin table `[..., D]` (c0, c0, c1, c1, ...) in
    split-halves order (c0, c1, ..., c0, c1, ...)."""
    return jnp.take(table, rope_permutation(table.shape[-1]), axis=-1)


def apply_rope_interleaved(x, cos, sin):
    """diffusers' `apply_rotary_emb(use_real_unbind_dim=-1)`: rotates pairs
    (2i, 2i+1). x `[B, S, H, D]`, cos/sin `[S, D]` (or broadcastable)."""
    xr = x.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-xr[..., 1], xr[..., 0]], axis=-1).reshape(x.shape)
    return x * cos + rotated * sin


def apply_rope_split(x, cos, sin):
    """Split-halves rotation: x `[..., D]` in split order, cos/sin in split order."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
