"""FLUX's RoPE tables on the host (diffusers' `FluxPosEmbed` in `transformer_flux.py`),
permuted to split-halves order by `layout.RopeLayout` where the checkpoint was (`port.py`)."""

from __future__ import annotations

import numpy as np

from .config import ROPE_THETA


def rope_tables(ids, axes_dim, theta: float = ROPE_THETA):
    """diffusers' `FluxPosEmbed(ids)`: cos, sin `[S, sum(axes_dim)]` float32, interleaved.

    ids `[S, n_axes]` (numpy). As diffusers: positions cast to float32, then
    frequencies, products, cos and sin in float64, cast to float32 at the end.
    """
    pos = np.asarray(ids, np.float32).astype(np.float64)
    cos_out, sin_out = [], []
    for i, dim in enumerate(axes_dim):
        freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        angles = np.outer(pos[:, i], freqs)
        cos_out.append(np.repeat(np.cos(angles), 2, axis=1).astype(np.float32))
        sin_out.append(np.repeat(np.sin(angles), 2, axis=1).astype(np.float32))
    return np.concatenate(cos_out, axis=-1), np.concatenate(sin_out, axis=-1)
