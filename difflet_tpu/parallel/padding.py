"""Token padding, done eagerly before the compiled step.

A sequence-parallel ring needs S to be a multiple of 2P (times a tile, for
the kernels). Inputs are padded eagerly, outside the compiled step, so every
rank compiles one identical program; the pad keys are masked in attention and
the output is cut back, also eagerly. `Runner.rows` says the multiple.
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


def pad_to(x, rows: int, axis: int = 1):
    """`x` zero-padded along `axis` to `rows` entries (`x` itself when it has them).
    Runs eagerly (numpy or jax arrays); every port's `prepare` pads through this
    (`Runner.pad_stream`)."""
    n = x.shape[axis]
    if rows < n:
        raise ValueError(f"cannot pad {n} entries on axis {axis} to {rows}")
    if rows == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, rows - n)
    lib = np if isinstance(x, np.ndarray) else jnp
    return lib.pad(x, widths)


def pad_tokens(x, multiple: int, axis: int = 1):
    """Pads `x` along `axis` with zeros to a multiple of `multiple`.

    Returns `(padded, pad_count)`. Runs eagerly (numpy or jax arrays).
    """
    n = x.shape[axis]
    rows = padded_length(n, multiple)
    return pad_to(x, rows, axis), rows - n


def patchify(x, patch_size):
    """A Conv3d patch embedding's input as token rows (Wan, HunyuanVideo; numpy or jax):
    `[B, C, F, H, W]` -> `[B, F'H'W', C*pt*ph*pw]`, features (c, pt, ph, pw), tokens (f, h, w)."""
    B, C, F, H, W = x.shape
    pt, ph, pw = patch_size
    x = x.reshape(B, C, F // pt, pt, H // ph, ph, W // pw, pw)
    x = (np if isinstance(x, np.ndarray) else jnp).transpose(x, (0, 2, 4, 6, 1, 3, 5, 7))
    return x.reshape(B, (F // pt) * (H // ph) * (W // pw), C * pt * ph * pw)


def key_mask(n_valid: int, n_padded: int, batch: int | None = None):
    """Boolean key-validity mask `[n_padded]` (or `[batch, n_padded]`): True for real tokens."""
    m = np.arange(n_padded) < n_valid
    return m if batch is None else np.broadcast_to(m, (batch, n_padded)).copy()


def unpad(x, n: int, axis: int = 1):
    """The first `n` entries of `x` along `axis`."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, n)
    return x[tuple(index)]


