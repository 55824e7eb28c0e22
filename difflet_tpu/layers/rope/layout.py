"""RoPE: the split-halves layout, its permutations and frequencies.

Split-halves RoPE: diffusers' interleaved RoPE rotates channel pairs
(2i, 2i+1) of each head, which on TPU is a minor-dimension relayout of every
q and k. q . k is invariant under one channel permutation applied to both, so
each head's q/k projection rows (and biases, and q/k norm weights) are
permuted once at load to [0, 2, 4, ..., 1, 3, 5, ...]; the cos/sin tables are
permuted the same way, and the rotation becomes split halves: a slice and a
concat (`rotate.apply_rotary_emb`). V and everything after attention are untouched.

`rope_inv_freqs` gives RoPE's frequencies as torch rounds them.
"""

from __future__ import annotations

import dataclasses

import numpy as np


# --------------------------------------------------------------------------
# Split-halves RoPE
# --------------------------------------------------------------------------

def rope_inv_freqs(dim: int, theta: float) -> np.ndarray:
    """RoPE's inverse frequencies `1 / theta ** (arange(0, dim, 2) / dim)` in float32 as torch
    forms them (`1.0 / torch.pow(theta, torch.arange(0, dim, 2).float().div(dim))`): the power
    rounded to float32, then the reciprocal (HunyuanVideo's and Qwen-Image's tables)."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return np.float32(1.0) / np.power(np.float64(theta), exponent.astype(np.float64)).astype(np.float32)


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


@dataclasses.dataclass(frozen=True)
class RopeLayout:
    """The split-halves RoPE layout of one attention's heads: the one object that
    says how the checkpoint's q/k weights and the step's cos/sin tables are
    permuted, so the two can never disagree.

    `split=False` is the checkpoint's own (interleaved) order: nothing is permuted
    and the rotation pairs (2i, 2i+1). `split=True`: each head's q/k channels
    (projection rows, biases, q/k norm weights) are permuted once at load by
    `heads_permutation`, the tables by `rope_permutation`, and the step rotates
    split halves (`rotate.apply_rotary_emb(..., split=True)`).
    """

    heads: int
    head_dim: int
    split: bool = True

    @property
    def qk_channels(self):
        """The permutation of q/k's `heads * head_dim` output channels (None: keep)."""
        return tuple(int(i) for i in heads_permutation(self.heads, self.head_dim)) if self.split else None

    @property
    def head_channels(self):
        """The permutation of one head's channels, for per-head q/k norm weights (None: keep)."""
        return tuple(int(i) for i in rope_permutation(self.head_dim)) if self.split else None

    def permute_keys(self, key_map: dict, qk=(), head_norms=()) -> dict:
        """`key_map` with the q/k parameters `qk` (kernels, biases, across-heads norm
        weights: `heads * head_dim` channels) and the per-head norm weights
        `head_norms` (`head_dim` channels) given this layout's permutation."""
        if not self.split:
            return key_map
        for paths, perm in ((qk, self.qk_channels), (head_norms, self.head_channels)):
            for path in paths:
                if path in key_map:
                    key_map[path] = dataclasses.replace(key_map[path], perm=perm)
        return key_map

    def table(self, t: np.ndarray) -> np.ndarray:
        """An interleaved cos/sin table `[..., head_dim]` (host) in this layout's order."""
        return np.ascontiguousarray(np.asarray(t)[..., rope_permutation(t.shape[-1])]) if self.split else t
