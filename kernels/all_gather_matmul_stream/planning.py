"""Host-side planning of the streaming all-gather + matmul kernel: the shapes it takes, its
chunks, VMEM budget and tiles (`plan`), and the head-major epilogue's description (`Heads`).
The design: this package's docstring."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _common

COLLECTIVE_ID = 9  # each kernel its own barrier semaphore id (matmul_reduce_scatter_stream: 10)

# Epilogue activations, applied to the float32 tile (after the bias).
ACTIVATIONS = {"gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True)}


class Heads(NamedTuple):
    """A weight's head-major epilogue (static): its output written `[B, n / D, S, D]`,
    each head of D channels (optionally) RMS-normalised with a `[D]` weight, rotated by
    split-halves RoPE from the call's `[S, D]` float32 tables, and multiplied by
    `scale` (q's 1/sqrt(D) for splash attention), each rounded to x's dtype in
    that order, as `layers.attention.HeadsOut` computes them unfused."""

    head_dim: int
    norm: bool = False
    eps: float = 1e-6
    rope: bool = False
    scale: float | None = None

    @property
    def transforms(self) -> bool:
        """Whether the epilogue changes values (else it only writes the heads where they go)."""
        return self.norm or self.rope or self.scale is not None


def heads_reason(head_dim: int, split: bool = True) -> str | None:
    """None if the kernel writes heads of `head_dim` channels (with split-halves RoPE
    when `split`), else one sentence why not: a head must be whole 128-lane tiles
    (its DMA to the head-major output and its rotation by one lane roll)."""
    if head_dim % _common.LANES:
        return f"head_dim {head_dim} is not a multiple of 128"
    if not split:
        return "interleaved RoPE (the kernel rotates split halves)"
    return None


# --------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------

def _check(x_shape, widths, dtype, axis_size, biases, activations, sum_squares, heads=None):
    """The shape / dtype / epilogue rules: one sentence why not, or
    (B, s, K, unit, dtype, activations, sum_squares, bias VMEM buffers, heads)."""
    dtype = jnp.dtype(dtype)
    reason = _common.dtype_reason(dtype)
    if reason:
        return reason
    if len(x_shape) < 2:
        return f"x must be [..., rows, K], got {tuple(x_shape)}"
    if axis_size < 2:
        return "the ring needs at least 2 ranks"
    B, _ = _common.fold_batch(x_shape)
    s, K = int(x_shape[-2]), int(x_shape[-1])
    unit = _common.sublane_rows(dtype)
    if s % 2 or (s // 2) % unit:
        return (f"each half of this rank's {s} rows must be a multiple of {unit} rows for {dtype.name} "
                f"(pad the sequence to a multiple of {2 * unit * axis_size})")
    if K % _common.LANES:
        return f"K = {K} is not a multiple of 128"
    if not widths or any(int(n) % _common.LANES or int(n) <= 0 for n in widths):
        return f"weight widths {list(widths)} are not all positive multiples of 128"
    biases = list(biases) if biases is not None else [None] * len(widths)
    activations = list(activations) if activations is not None else [None] * len(widths)
    sum_squares = [bool(q) for q in sum_squares] if sum_squares is not None else [False] * len(widths)
    heads = list(heads) if heads is not None else [None] * len(widths)
    if (len(biases) != len(widths) or len(activations) != len(widths) or len(sum_squares) != len(widths)
            or len(heads) != len(widths)):
        return "one bias, one activation (or None), one sum_squares flag and one heads (or None) per weight"
    for n, hd, q in zip(widths, heads, sum_squares):
        if hd is None:
            continue
        reason = heads_reason(hd.head_dim)
        if reason or int(n) % hd.head_dim:
            return reason or f"width {n} is not whole heads of {hd.head_dim}"
        if q:
            return "a weight written head-major has no sum of squares"
    if len({hd.head_dim for hd in heads if hd is not None and hd.rope}) > 1:
        return "the weights rotated by RoPE share one table: one head_dim"
    bad = [a for a in activations if a is not None and a not in ACTIVATIONS]
    if bad:
        return f"activations {bad} are not among {sorted(ACTIVATIONS)}"
    for b in biases:
        if b is not None and _common.dtype_reason(b[1]):
            return "bias: " + _common.dtype_reason(b[1])
    # biases in VMEM: all rows, padded by Mosaic to whole sublane tiles of their dtype
    pad = lambda rows, bd: -(-int(rows) // _common.sublane_rows(bd)) * _common.sublane_rows(bd)
    bias_bufs = [_common.buffer(f"bias {i}", (pad(*b), n), b[1])
                 for i, (b, n) in enumerate(zip(biases, widths)) if b is not None]
    return B, s, K, unit, dtype, activations, sum_squares, bias_bufs, heads


def _vmem_plan(B, hc, K, tn, tiles, dtype, W, activations, sum_squares, bias_bufs, tk, w_tiles=2, heads=()):
    """The VMEM this kernel allocates (its scratch buffers, flat: one step's 2 B hc rows)
    and what Mosaic materialises per dot, for chunks of hc rows in W slots per direction,
    column tile tn, row tiles `tiles` over the 2 B hc rows, depth chunks of tk, and
    `w_tiles` weight tiles (2: double-buffered; every tile when held in VMEM)."""
    rows = 2 * B * hc
    tm = max(sz for _, sz in tiles)
    rope_dim = max([hd.head_dim for hd in heads if hd is not None and hd.rope] + [0])
    return _common.VmemPlan((
        _common.buffer("xbuf", (W, rows, K), dtype),
        _common.buffer("wbuf", (w_tiles, K, tn), dtype),
        _common.buffer("obuf", (2, rows, tn), dtype),
        # values Mosaic materialises per dot: the x row tile, the weight tile, the f32 result
        _common.buffer("dot operands", (tm * tk + tk * tn,), dtype),
        _common.buffer("f32 result", (tm, tn), jnp.float32),
        # the float32 sums over depth chunks (only if K is cut: tk < K)
        *([_common.buffer("acc", (rows, tn), jnp.float32)] if tk < K else []),
        # the epilogue's float32 temporaries (bias added, GELU's inner terms;
        # the rounded tile read back and squared for a sum of squares)
        *([_common.buffer("f32 epilogue", (2, tm, tn), jnp.float32)]
          if any(a is not None for a in activations) or any(sum_squares) or any(heads) else []),
        *bias_bufs,
        # head-major epilogue: norm weights [1, D] (padded to a sublane tile), the step's
        # RoPE rows [cos / sin, 2 B hc, D] f32 (flat, as the step's rows)
        *[_common.buffer("norm weight", (_common.sublane_rows(dtype), hd.head_dim), dtype)
          for hd in heads if hd is not None and hd.norm],
        *([_common.buffer("rope rows", (2, rows, rope_dim), jnp.float32)] if rope_dim else []),
        # row sums of squares: [2, 2, B, 1, hc] f32, (1, hc) padded to (8, 128k)
        *([_common.buffer("ssq", (2, 2, B, 8, -(-hc // _common.LANES) * _common.LANES), jnp.float32)]
          if any(sum_squares) else []),
    ))


def plan(x_shape, widths, dtype, axis_size, *, blocks: _common.StreamBlocks | None = None, biases=None,
         activations=None, sum_squares=None, heads=None):
    """(reason, StreamPlan): reason None if the streaming kernel runs for these shapes.

    biases / activations / sum_squares: per weight, None (no bias) or the bias's
    (rows, dtype), rows 1 for [n_i] and L for a stacked [L, n_i]; the activation
    name or None; a bool; a `Heads` or None, as `all_gather_matmul_stream` takes them. blocks: the
    block sizes asked (default `StreamBlocks()`: the largest chunk that fits, a
    window of 3)."""
    blocks = blocks or _common.StreamBlocks()
    widths = list(widths)
    checked = _check(x_shape, widths, dtype, axis_size, biases, activations, sum_squares, heads)
    if isinstance(checked, str):
        return checked, None
    B, s, K, unit, dtype, activations, sum_squares, bias_bufs, heads = checked
    head_dims = [hd.head_dim for hd in heads if hd is not None]
    # unrolled bodies for the code budget: one per weight, half one per head-major epilogue that
    # normalises, rotates or scales (FLUX's single-block group: 1.84 -> 2.00 MiB with q's and k's)
    bodies = len(widths) + 0.5 * sum(1 for hd in heads if hd is not None and hd.transforms)
    if not blocks.row_tile_limit:
        return "row_tile_limit must be positive", None
    tk = _common.depth_tile(K, blocks.depth_tile_limit)

    def candidates(hc):
        hold = blocks.weights_in_vmem
        holds = [True, False] if hold is None and 2 * B * hc < _common.FEW_ROWS else [bool(hold)]
        for tn in _common.column_tile_candidates(widths, blocks.col_tile_limit):
            if any(tn % d for d in head_dims):  # a column tile holds whole heads
                continue
            if not _common.dot_code_fits(bodies, 2 * B * hc, tk, tn):
                continue  # the code would pass 2 MiB: a narrower tile (or, at 128 columns, smaller chunks)
            tiles = _common.row_tiles(2 * B * hc, blocks.row_tile_limit, unit)  # over a step's flat rows
            for held in holds:
                w_tiles = sum(widths) // tn if held else 2
                yield (_vmem_plan(B, hc, K, tn, tiles, dtype, blocks.window, activations, sum_squares, bias_bufs,
                                  tk, w_tiles, tuple(heads)), (tn, tiles, held))

    return _common.fit_stream(s // 2, unit, blocks, candidates, f"chunks in {blocks.window} slots per direction")


def unsupported_reason(x_shape, widths, dtype, axis_size, *, blocks=None, biases=None, activations=None,
                       sum_squares=None, heads=None) -> str | None:
    """None if `all_gather_matmul_stream` runs for these shapes, else one sentence why not."""
    return plan(x_shape, widths, dtype, axis_size, blocks=blocks, biases=biases, activations=activations,
                sum_squares=sum_squares, heads=heads)[0]

