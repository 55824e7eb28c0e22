"""All-gather + matmul as one Pallas TPU kernel: a bidirectional ring, each half streamed in row chunks.

Called inside `jax.shard_map` over a ring axis of size P (`tp`). Every rank
holds `x`, its s = S/P rows of the sequence, and column shards of one or more
weights; it returns, per weight, every row of the sequence times its columns.
The ring is `difflet_tpu.parallel.collective_matmul._ag_ring`'s: the shard splits into
a forward half (rows [0, h), h = s/2) and a backward half (rows [h, s)); at
hop j rank r holds the forward half of rank r-j and the backward half of rank
r+j, multiplies both by every weight, and meanwhile forwards them one more
hop, VMEM to VMEM by remote DMA. Here each half moves in C chunks through a
window of W VMEM slots (one chunk a half wherever the halves fit, which is
every released shape but the long videos), and the steps are one runtime
loop, so the kernel's code is one step's. Only the products touch HBM, each
product tile written once at its final rows.

    x        [B, s, K]      this rank's rows (leading dims folded into B)
    w_i      [L, K, n_i]    column shards (read at layer `layer`), n_i multiples of 128
    bias_i   [n_i] or [L, n_i]  optional, per weight
    out_i    [B, S, n_i]    rows in global order, act_i(x @ w_i + bias_i)
    ssq_i    [B, 2PC, 1, hc] optional (`sum_squares`): float32 row sums of squares
                            of out_i over this rank's columns; slab (2q + d) C + c
                            holds chunk c of rank q's half d (the wrapper puts
                            them in row order, dropping the overlap below)

Layout and tiling (per rank; h = s/2 rows a half, hc rows a chunk, W slots):

    VMEM  xbuf  [W slots, 2 B hc, K]          a step's rows in flight (own, received, forwarded)
          wbuf  [2, K, tn]                     weight tiles, double-buffered; or, with the
                                               weights held (below), [sum n_i / tn, K, tn]
          obuf  [2, 2 B hc, tn]                product tiles on their way to HBM
          bbuf_i [L_i, n_i]                    weight i's bias rows (only if it has one)
          sbuf  [2, 2 dirs, B, 1, hc] f32      row sums of squares (only with sum_squares)
          abuf  [2 B hc, tn] f32               depth-chunk sums (only if tk < K)
    HBM   x, w_i, bias_i (inputs), out_i, ssq_i (outputs); memory_space ANY, explicit DMA
    SMEM  tables int32[2 + 2P]  (scalar prefetch: neighbours, shard rows of hop j; _common.ring_tables)
          layer  int32[1]
          slabs  int32[2 + 2P]  (ring_tables with 2C slabs a shard: (2q) C for the shards of hop j)
          sems   recv DMA [2, W] (per direction, slot: own chunk loaded or neighbour's arrived),
                 send DMA [2], credit REGULAR [2] (free slots downstream), w [2], o [2, 2],
                 b [#bias], s [2, 2]

A step's rows are flat: segment g = d B + b of xbuf[slot] (and of obuf[par],
abuf) holds direction d's chunk of batch b, hc rows at [g hc, (g+1) hc); hc
is a multiple of the dtype's sublane rows, so every segment boundary is
sublane-aligned. An own chunk loads as B DMAs (one per batch, into its
segments, on the direction's receive semaphore, each waited); direction d's
B segments are contiguous, so its forward send is one remote DMA of
xbuf[slot, d B hc : (d+1) B hc] to the same rows of the neighbour's next
slot; a product tile goes out as B DMAs per direction (one per segment, to
out_i[b, its rows, its columns], each waited). The multiply
(`_multiply_rows`) takes all 2 B hc rows, both directions and every batch,
as ONE M operand in static row tiles over the flat rows
(`_common.row_tiles(2 B hc, row_tile_limit)`): a dot is (tm, tk) x (tk, tn)
whatever segments its rows span. Why: fewer, larger dots than one per
(direction, batch, row tile), so each weight block pushed into the MXU is
used for more rows (not measured on a TPU), and fewer dots are unrolled. The
generated code is about the same size: Mosaic's code grows with the rows
times depth times columns the dots cover, hardly with their number (v5e,
Wan q/k/v: 4 dots of 304/288 rows or 3 of 400/384 or 2 of 592, 1.03 MiB
each; one of 1184, 0.95 MiB; docs/kernels.md). The
sums of squares keep their per-(direction, batch) slabs: a row tile that
straddles segments is cut at their static boundaries, each piece's row sums
laid out lane-major at its segment's offset in sbuf. The VMEM plan is this
module's own `_vmem_plan` (the buffers above, and what Mosaic materialises
per dot).

Chunks: the plan (`_common.StreamPlan`, from a validated `_common.StreamBlocks`)
cuts each half into C chunks of hc rows (a multiple of the dtype's sublane
rows); chunk c starts at row min(c hc, h - hc) of its half, so when hc does not
divide h the last chunk is shifted back and overlaps the one before (those rows
are computed and written twice, with the same values). The plan prefers
chunks that tile the half exactly (`_common.fit_stream`): Wan 480x832x81's
4096-row halves go as 4 chunks of 1024 rows.

Steps: t = c P + j, t = 0 .. PC-1 (one `lax.fori_loop`; c, j, slots and rows are
runtime values of t). At step t rank r holds chunk c of the forward half of rank
r-j and of the backward half of rank r+j, in slot t % W of each direction; j = 0
is its own chunk, DMA'd from HBM during step t-1 (or before the loop); j >= 1
arrived from upstream (r-1 forward, r+1 backward), sent by it at its step t-1.
Chunk-major order keeps the ring a pipeline: what a rank receives at step t is
what its upstream held at step t-1, so a chunk never waits a whole half for
its next hop, and the window needs no more slots as C grows.

    step t:  per direction d: wait slot t%W (own load or arrival), then at once
                              [j < P-1] wait credit, send slot -> downstream slot (t+1)%W
                                                   ┬─ [j = P-1] load own chunk c+1 -> slot (t+1)%W
                                                   └─ for (weight, column tile): multiply the step's rows (both
                                                      directions, one M operand), epilogue, DMA out (the weight
                                                      stream runs on across steps)
             [j < P-1] wait send; signal a credit upstream if slot t%W is next filled by upstream

Credits (why a sender never overwrites a slot in use). Slot t % W is read by
step t (the multiplies and the forward send), then next filled for step t + W.
If that step's j >= 1, upstream fills it, at ITS step t + W - 1. A REGULAR
semaphore `credit[d]` on the sender counts the slots its downstream (in
direction d) has freed: the receiver signals it remotely
(`pl.semaphore_signal(..., device_id=upstream)`) after step u iff step u + W
is upstream-filled (u + W < PC and (u + W) % P != 0); the sender waits one
credit before its send at step s iff s + 1 - W >= 0 (its send fills the
receiver's step s + 1, whose slot's previous user was step s + 1 - W). The two
conditions pair up one to one (u = s + 1 - W) and both sides go in step order,
so every wait meets the signal of exactly the step it needs, and every
semaphore is zero at exit. Within one chunk the bidirectional coupling alone
would bound the skew (with one chunk a half, three slots would do), but at a
chunk boundary it does not: step (c+1, 0) waits for nobody, so upstream can start
sending chunk c+1 while this rank still reads chunk c's last slots. A window of
W >= 2 cannot deadlock: the credit a sender waits for is the receiver's step
s + 1 - W <= s - 1, earlier than its own. Own chunks load into the same slots
(a local DMA on the same receive semaphore), during step t-1 when its slot's
previous user t - W <= t - 2 is done. `_skip_credit_at` (tests only) removes
one credit: the sender sends at that step without waiting for it, and the
receiver does not signal it (so the counts still balance); at the step P (the
first send of chunk 1, where nothing else orders the receiver's reads before
the write) the race detector flags the overwrite (tests/kernels/test_interpret.py).
(Assuming a window of W + 1 in the bookkeeping would be one credit too few as
well, but the detector merges the clocks of every signal a semaphore has
received by the time of a wait, so whether it sees that overwrite depends on
the threads' timing.)

Few rows a step (2 B hc < `_common.FEW_ROWS`, e.g. FLUX's text stream): a
weight tile's HBM read then takes longer than its products, and the stream
would read every weight P C times a call. The plan then holds every tile in
VMEM (`StreamPlan.weights_in_vmem`, when they fit; `StreamBlocks.weights_in_vmem`
forces it either way): step 0 loads them in stream order into a slot each
(tile u+1 loading while tile u multiplies, as before), later steps read them
in place, and the call is named `..._wvmem` so the estimate prices one read.

A barrier with both neighbours at entry keeps anyone from writing (a chunk or a
credit) into a kernel instance that has not started.

Weights. Tiles are DMA'd from `w_i.at[layer, :, cols]` (the layer index is a
scalar-prefetch value): a block scan passes the whole stack, so no
weight-sized copy of the layer is made before the call. One weight-tile
stream runs over every (step, weight, column tile): tile u+1 loads (HBM ->
wbuf[(u+1) % 2]) while tile u multiplies the step's rows; the products go out
(obuf[u % 2] -> out_i) while tile u+1 computes, each waited two tiles later.
A column tile tn (a multiple of 128 dividing every n_i) is common to all
weights (`StreamBlocks.col_tile_limit`, or per site from a measured table:
kernels/tiles.py). The depth K goes in chunks of tk (a multiple of
128 dividing K, at most `StreamBlocks.depth_tile_limit`) in a `fori_loop`,
summed in float32 in abuf, so the dots Mosaic unrolls into straight-line code
are (tm, tk) x (tk, tn). The weights stream once per step, i.e. P C times a
call (hidden under the MXU work at Wan's shapes by the estimate), unless held.

Epilogue (per weight, static): each product tile leaves the MXU as float32;
the bias row's columns are added in float32, then the activation (None or
"gelu_tanh": `jax.nn.gelu(approximate=True)`) is applied in float32, and only
then is the tile cast to x's dtype and written out. So a bias/GELU costs no
pass over the output in HBM; for float32 x the result is the unfused
`act(x @ w + bias)` computed in the same order. The bias is small (a stacked
[L, n_i] of bf16 is L n_i 2 bytes, ~0.3 MiB for Wan's FFN), so the whole array
is DMA'd into bbuf_i once at entry and the row `layer` picked in registers
per column tile (a masked sum over the L_i rows, exact): a DMA of one row at
a traced index would not be aligned to HBM's (sublane, lane) tiles, which
Mosaic refuses.

Sum of squares (per weight, static, `sum_squares`): after the cast, the tile
is read back as float32 (the output AS ROUNDED, so the sum equals the unfused
`sum(y.astype(f32) ** 2)` up to summation order), squared and summed over its
columns; the (tm, 1) column of row sums is relaid out to a lane-major (1, tm)
row and accumulated over the weight's column tiles in sbuf (the first tile
writes, the others add); after the last column tile the step's sums go to
HBM, each (direction, chunk) to its slab. Why slabs: the rows of an arriving
chunk start at a multiple of 8 or 16 rows, not of 128, so a lane-major [B, S]
output could not be written at its rows by an aligned DMA, and a
sublane-major [B, S, 1] one is padded to 128 lanes in VMEM and HBM (512 bytes
a row); a (1, hc) slab row is one DMA at a dynamic leading index, padded to 8
sublanes (32 bytes a row). sbuf is double-buffered over successive (step, ssq
weight) pairs. The ssq is this rank's columns only: the caller sums it over
ranks (one psum) for a norm across all columns (Wan's / LTX-2's q, k).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from difflet_tpu.layers.rope.rotate import rotate as rope_rotate

from . import _common

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


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

def _bias_tile(bias_rows, col, tn: int, stacked: bool, layer):
    """Column tile `col` of a bias held in VMEM (`bias_rows` [L, n]), float32 [1, tn]; a
    stacked bias's row `layer` as a masked sum (exact: one term is non-zero)."""
    c0 = pl.multiple_of(col * tn, tn)
    rows = bias_rows[:, pl.ds(c0, tn)].astype(jnp.float32)
    if not stacked:
        return rows
    pick = lax.broadcasted_iota(jnp.int32, rows.shape, 0) == layer[0]
    return jnp.sum(jnp.where(pick, rows, 0.0), axis=0, keepdims=True)


def _segment_pieces(r0, tm, hc):
    """The (segment g, first row, last row + 1) pieces of flat rows [r0, r0 + tm) cut at the
    hc-row segment boundaries (static)."""
    return [(g, max(r0, g * hc), min(r0 + tm, (g + 1) * hc)) for g in range(r0 // hc, (r0 + tm - 1) // hc + 1)]


HEAD_ROW_BLOCK = 64  # rows of the head epilogue's loop body (8 float32 vregs a value)


def _head_row_block(rows: int, unit: int) -> int:
    """The head epilogue's row block: the largest multiple of the sublane rows `unit`
    at most HEAD_ROW_BLOCK that divides the step's `rows`."""
    return max(b for b in range(unit, HEAD_ROW_BLOCK + 1, unit) if rows % b == 0)


def _write_heads(tn, head: Heads, norm_w, rbuf, obuf, par, *, unit):
    """The head-major epilogue of the column tile in obuf[par] [2 B hc, tn] (already
    rounded to x's dtype, as the unfused path's projection output), in place: RMSNorm
    in float32 (`rsqrt(mean(t^2) + eps) * w`, rounded), split-halves RoPE
    `t cos + rot(t) sin` (`layers.rope.rotate`, the XLA paths' formula; rot(t) =
    [-t2, t1]: one lane roll by D/2 and a sign, exact; rounded), then `scale` (rounded), the order and roundings of
    `layers.attention.HeadsOut`. Per head a runtime loop over row blocks, so the
    code is one block's per head (Mosaic unrolls a value's vregs: code grows with the
    rows a body covers); the RoPE rows come from rbuf [cos / sin, 2 B hc, D], the step's
    rows in the same flat order."""
    f = jnp.float32
    D = head.head_dim
    dt = obuf.dtype
    rows = obuf.shape[1]
    rb = _head_row_block(rows, unit)
    nblk = rows // rb
    # loop invariants: the norm weight row, rot's sign per lane, the scale as rounded to x's dtype
    w = norm_w[pl.ds(0, 1), :].astype(f) if head.norm else None
    sign = jnp.where(lax.broadcasted_iota(jnp.int32, (1, D), 1) < D // 2, -1.0, 1.0).astype(f) if head.rope else None
    scale = jnp.asarray(head.scale, dt).astype(f) if head.scale is not None else None

    def block(u, carry, lanes):
        r = pl.ds(pl.multiple_of(u * rb, rb), rb)
        t = obuf[par, r, lanes].astype(f)
        if head.norm:
            ms = jnp.sum(t * t, axis=-1, keepdims=True) / D
            t = ((t * lax.rsqrt(ms + head.eps)) * w).astype(dt).astype(f)
        if head.rope:
            rot = pltpu.roll(t, D // 2, 1) * sign
            t = rope_rotate(t, rot, rbuf[0, r, :], rbuf[1, r, :]).astype(dt).astype(f)
        if scale is not None:
            t = t * scale
        obuf[par, r, lanes] = t.astype(dt)
        return carry

    for hh in range(tn // D):  # static lane offsets (a dynamic one costs code per lane tile)
        lax.fori_loop(0, nblk, functools.partial(block, lanes=pl.ds(hh * D, D)), 0)


def _multiply_rows(xbuf, slot, wref, bias, act, obuf, par, sbuf, sp, col, *, B, hc, tiles, ssq: bool, tk, acc,
                   head=None, norm_w=None, rbuf=None, unit=8):
    """A step's rows, both directions and every batch as ONE M operand, times the weight
    tile `wref` [K, tn]: xbuf[slot] [2 B hc, K] (segment g = d B + b: direction d's chunk
    of batch b, hc rows) in the static row tiles `tiles` over all 2 B hc rows, each a
    (tm, tk) x (tk, tn) dot whatever segments it spans; the epilogue on the float32
    product (bias, activation, cast) written to obuf[par] [2 B hc, tn]. Fewer, larger
    dots than one per (direction, batch, row tile): the MXU's weight pushes are
    amortised over more rows, and fewer dots are unrolled (the code size stays about
    the same: it follows the rows the dots cover, not their number; module docstring).

    With tk < K the depth goes in K / tk chunks, a `fori_loop` summing each chunk's
    products into the float32 accumulator `acc` [2 B hc, tn] (one loop body of dots
    is the kernel's code, not every (tm, K) x (K, tn) dot unrolled).

    With `ssq`, the rounded tile's squares summed over its columns into sbuf[sp]
    [2 dirs, B, 1, hc] (column tile 0 writes, the others add): a row tile that
    straddles segments is cut at their (static, sublane-aligned) boundaries, and
    each piece's (rows,) sums relaid out to a lane-major (1, rows) row at its
    segment's static lane offset."""
    K = wref.shape[0]
    if tk < K:
        def depth_chunk(k, carry):
            k0 = pl.multiple_of(k * tk, tk)
            w = wref[pl.ds(k0, tk), :]
            for r0, tm in tiles:
                p = jnp.dot(xbuf[slot, pl.ds(r0, tm), pl.ds(k0, tk)], w, preferred_element_type=jnp.float32)
                prev = acc[pl.ds(r0, tm), :]
                acc[pl.ds(r0, tm), :] = jnp.where(k == 0, p, prev + p)
            return carry

        lax.fori_loop(0, K // tk, depth_chunk, 0)
    else:
        w = wref[...]
    for r0, tm in tiles:
        if tk < K:
            y = acc[pl.ds(r0, tm), :]
        else:
            y = jnp.dot(xbuf[slot, pl.ds(r0, tm), :], w, preferred_element_type=jnp.float32)
        if bias is not None:
            y = y + bias
        if act is not None:
            y = act(y)
        y = y.astype(obuf.dtype)
        obuf[par, pl.ds(r0, tm), :] = y
        if ssq:  # the rounded output's squares, summed over this tile's columns, per segment piece
            yf = y.astype(jnp.float32)
            for g, a, e in _segment_pieces(r0, tm, hc):
                piece = yf[a - r0:e - r0] if (a, e) != (r0, r0 + tm) else yf
                part = jnp.sum(piece * piece, axis=-1).reshape(1, e - a)
                d, b = divmod(g, B)
                rows = pl.ds(a - g * hc, e - a)
                prev = sbuf[sp, d, b, :, rows]
                sbuf[sp, d, b, :, rows] = jnp.where(col > 0, prev + part, part)
    if head is not None and head.transforms:
        _write_heads(obuf.shape[2], head, norm_w, rbuf, obuf, par, unit=unit)


def _kernel(tables, layer, slabs, x_hbm, *refs, axis_name, P, B, h, hc, C, W, K, widths, tn, tk, tiles, unit,
            bias_stacked, activations, sum_squares, heads, held, skip_credit_at):
    nw = len(widths)
    has_bias = [st is not None for st in bias_stacked]
    has_norm = [hd is not None and hd.norm for hd in heads]
    rope = any(hd is not None and hd.rope for hd in heads)
    nb, ns, nn = sum(has_bias), sum(sum_squares), sum(has_norm)
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]
    w_hbm, b_hbm, n_hbm, rope_hbm = take(nw), take(nb), take(nn), take(2 if rope else 0)
    out_hbm, ssq_hbm = take(nw), take(ns)
    xbuf, wbuf, obuf = take(3)
    bbuf, nbuf = take(nb), take(nn)
    sbuf = take(1)[0] if ns else None
    abuf = take(1)[0] if tk < K else None
    rbuf = take(1)[0] if rope else None
    recv_sem, send_sem, credit, w_sem, o_sem, b_sem, s_sem, r_sem = refs
    bias_of, ssq_of, norm_of, kb, ks, kn = [], [], [], 0, 0, 0  # weight i -> its bias / ssq / norm slot
    for hb, q, hn in zip(has_bias, sum_squares, has_norm):
        bias_of.append(kb if hb else None)
        ssq_of.append(ks if q else None)
        norm_of.append(kn if hn else None)
        kb, ks, kn = kb + hb, ks + q, kn + hn
    ncols = [n // tn for n in widths]
    per_step = sum(ncols)  # weight tiles a step
    T = P * C
    nbr = (tables[0], tables[1])  # downstream per direction: forward r+1, backward r-1
    upstream = (tables[1], tables[0])

    def chunk0(c):  # first row of chunk c within its half (the last one shifted back to end at h)
        return pl.multiple_of(jnp.minimum(c * hc, h - hc), unit)

    def out_row(t, d):  # first output row of the chunk held at step t in direction d
        j, c = t % P, t // P
        base = tables[2 + j] if d == 0 else tables[2 + P + j] + h
        return pl.multiple_of(base + chunk0(c), unit)

    def seg(d, b):  # the rows of segment d B + b (direction d's chunk of batch b) in a flat step buffer
        return pl.ds((d * B + b) * hc, hc)

    def load(t, d):  # own chunk t // P of half d, HBM -> slot t % W: one DMA per batch, one semaphore
        return [pltpu.make_async_copy(x_hbm.at[b, pl.ds(d * h + chunk0(t // P), hc)], xbuf.at[t % W, seg(d, b)],
                                      recv_sem.at[d, t % W]) for b in range(B)]

    def send(t, d):  # direction d's B segments (contiguous) of slot t % W -> the same rows of the
        # downstream neighbour's slot (t + 1) % W (its step t + 1)
        rows = pl.ds(d * B * hc, B * hc)
        return pltpu.make_async_remote_copy(xbuf.at[t % W, rows], xbuf.at[(t + 1) % W, rows], send_sem.at[d],
                                            recv_sem.at[d, (t + 1) % W], device_id={axis_name: nbr[d]})

    def w_copy(i, col, par, dst=None):  # weight i's column tile col -> wbuf[dst] (default: par)
        c0 = pl.multiple_of(col * tn, tn)
        return pltpu.make_async_copy(w_hbm[i].at[layer[0], :, pl.ds(c0, tn)],
                                     wbuf.at[par if dst is None else dst], w_sem.at[par])

    def o_copy(i, t, d, col, par):  # direction d's B segments of obuf[par] -> their rows: B DMAs, one semaphore
        # (head-major outputs: one DMA per segment and head, to out[b, head, rows, :]; the same bytes)
        if heads[i] is not None:
            D = heads[i].head_dim
            nh = tn // D
            return [pltpu.make_async_copy(obuf.at[par, seg(d, b), pl.ds(hh * D, D)],
                                          out_hbm[i].at[b, col * nh + hh, pl.ds(out_row(t, d), hc)],
                                          o_sem.at[par, d])
                    for b in range(B) for hh in range(nh)]
        c0 = pl.multiple_of(col * tn, tn)
        return [pltpu.make_async_copy(obuf.at[par, seg(d, b)],
                                      out_hbm[i].at[b, pl.ds(out_row(t, d), hc), pl.ds(c0, tn)], o_sem.at[par, d])
                for b in range(B)]

    def r_copy(t, k, d, b):  # RoPE table k's rows of the chunk at step t, direction d -> rbuf[k, segment (d, b)]
        return pltpu.make_async_copy(rope_hbm[k].at[pl.ds(out_row(t, d), hc)], rbuf.at[k, seg(d, b)], r_sem.at[k])

    def s_copy(k, t, d, sp):  # ssq output k, step t, direction d: sbuf[sp, d] -> its slab
        j, c = t % P, t // P
        slab = slabs[2 + j] + c if d == 0 else slabs[2 + P + j] + C + c
        return pltpu.make_async_copy(sbuf.at[sp, d], ssq_hbm[k].at[:, slab], s_sem.at[sp, d])

    # Own chunk 0 of both halves into slot 0, the bias rows and the first weight tile, at once.
    bias_rows = ([pltpu.make_async_copy(b_hbm[k], bbuf[k], b_sem.at[k]) for k in range(nb)]
                 + [pltpu.make_async_copy(n_hbm[k], nbuf[k], b_sem.at[nb + k]) for k in range(nn)])
    for d in (0, 1):
        for cp in load(0, d):
            cp.start()
    for cp in bias_rows:
        cp.start()
    w_copy(0, 0, 0).start()

    _common.neighbour_barrier(axis_name, nbr)
    for cp in bias_rows:
        cp.wait()

    def step(t, carry):
        j = t % P
        slot = t % W

        for d in (0, 1):  # per direction: wait for the chunk, forward it at once
            @pl.when(j == 0)
            def _():
                for cp in load(t, d):
                    cp.wait()

            @pl.when(j > 0)
            def _():
                send(t - 1, d).wait_recv()

            @pl.when(j < P - 1)
            def _():
                @pl.when(_common.credit_needed(t, W, skip_credit_at))
                def _():
                    pl.semaphore_wait(credit.at[d], 1)

                send(t, d).start()

        @pl.when((j == P - 1) & (t + 1 < T))  # the next step is this rank's next own chunk
        def _():
            for d in (0, 1):
                for cp in load(t + 1, d):
                    cp.start()

        if rope:  # this step's RoPE rows (the last step's epilogues are done with rbuf)
            copies = [r_copy(t, k, d, b) for k in (0, 1) for d in (0, 1) for b in range(B)]
            for cp in copies:
                cp.start()
            for cp in copies:
                cp.wait()

        for i in range(nw):
            base = sum(ncols[:i])
            last_weight = i + 1 == nw
            kstep = t * ns + (ssq_of[i] or 0)  # this (step, ssq weight)'s sbuf parity
            sp = kstep % 2

            def body(col, carry, i=i, base=base, last_weight=last_weight, kstep=kstep, sp=sp):
                u = t * per_step + base + col  # the weight stream's global tile index
                par = u % 2
                # held: every tile has a slot of its own (its index in the step), loaded
                # during step 0 only; else two slots by parity, loaded every step
                tile = base + col
                slot_of = (lambda k: k) if held else (lambda k: None)

                @pl.when((t == 0) if held else True)
                def _():
                    w_copy(i, col, par, slot_of(tile)).wait()

                    @pl.when(col + 1 < ncols[i])
                    def _():
                        w_copy(i, col + 1, 1 - par, slot_of(tile + 1)).start()

                    if not (held and last_weight):  # the next weight's first tile (next step's if last)
                        @pl.when((col + 1 == ncols[i]) & ((t + 1 < T) if last_weight else True))
                        def _():
                            w_copy(0 if last_weight else i + 1, 0, 1 - par, slot_of(base + ncols[i])).start()

                wref = wbuf.at[tile if held else par]

                @pl.when(u >= 2)  # obuf[par] was sent out two tiles ago
                def _():
                    for d in (0, 1):
                        for cp in o_copy(i, t, d, col, par):
                            cp.wait()

                bias = (None if bias_of[i] is None
                        else _bias_tile(bbuf[bias_of[i]], col, tn, bias_stacked[i], layer))
                act = ACTIVATIONS[activations[i]] if activations[i] is not None else None
                ssq = ssq_of[i] is not None
                if ssq:
                    @pl.when((col == 0) & (kstep >= 2))  # sbuf[sp] went out two ssq steps ago
                    def _():
                        for d in (0, 1):
                            s_copy(0, 0, d, sp).wait()
                _multiply_rows(xbuf, slot, wref, bias, act, obuf, par, sbuf, sp, col, B=B, hc=hc, tiles=tiles,
                               ssq=ssq, tk=tk, acc=abuf, head=heads[i],
                               norm_w=None if norm_of[i] is None else nbuf[norm_of[i]], rbuf=rbuf, unit=unit)
                for d in (0, 1):
                    for cp in o_copy(i, t, d, col, par):
                        cp.start()
                if ssq:
                    @pl.when(col + 1 == ncols[i])  # this step's row sums are complete
                    def _():
                        for d in (0, 1):
                            s_copy(ssq_of[i], t, d, sp).start()
                return carry

            lax.fori_loop(0, ncols[i], body, 0)

        @pl.when(j < P - 1)
        def _():
            for d in (0, 1):
                send(t, d).wait_send()

        # Slot t % W is free (multiplied, forwarded): a credit upstream if upstream fills it next.
        _common.signal_credit(t, W, T, P, credit, upstream, axis_name, skip_credit_at)
        return carry

    lax.fori_loop(0, T, step, 0)

    # Drain the last two tiles' output DMAs and the last two ssq steps' (waits count bytes only).
    for u in range(max(0, T * per_step - 2), T * per_step):
        for d in (0, 1):
            for cp in o_copy(0, 0, d, 0, u % 2):
                cp.wait()
    for k in range(max(0, T * ns - 2), T * ns):
        for d in (0, 1):
            s_copy(0, 0, d, k % 2).wait()


def all_gather_matmul_stream(x, weights, *, layer=None, biases=None, activations=None, sum_squares=None,
                             heads=None, norms=None, rope=None, axis_name="tp",
                             blocks: _common.StreamBlocks | None = None, interpret=False, _skip_credit_at=None):
    """Gathers `x` over `axis_name` while multiplying it by each weight.

    Args:
      x: this rank's rows `[..., S/P, K]`.
      weights: column shards `[K, N_i/P]`; with `layer`, stacked `[L, K, N_i/P]`.
      layer: the layer to read from stacked weights (an int32 scalar, may be
        traced, e.g. a block scan's index); None for `[K, N_i/P]` weights.
      biases: optional, per weight None, `[N_i/P]` or (with `layer`) a stacked
        `[L, N_i/P]` read at `layer`; added to the float32 product.
      activations: optional, per weight None or a name in `ACTIVATIONS`
        ("gelu_tanh"), applied after the bias, before the cast.
      sum_squares: optional, per weight a bool: also return the float32 sum
        over this rank's columns of the output's squares (as rounded to x's
        dtype), per row. No sum over ranks.
      heads: optional, per weight None or a `Heads`: that output is written
        head-major `[..., n_i/D, S, D]`, each head normalised / rotated /
        scaled on the float32 tile (`Heads`, `_write_heads`).
      norms: per weight with `Heads.norm`, its RMSNorm weight `[D]` (x's dtype).
      rope: with any `Heads.rope`, the float32 `(cos, sin)` tables `[S, D]`
        (full width, split-halves order) of the gathered rows, in global order.
      blocks: the block sizes asked (chunk rows, window, tile limits),
        validated and fitted to VMEM (`plan`); default `StreamBlocks()`.
      interpret: False (Mosaic), True (TPU interpret mode) or a
        `pltpu.InterpretParams` (e.g. with detect_races=True).
      _skip_credit_at: tests only: a step whose send goes without its credit
        (the deliberately racy variant; see the module docstring).

    Returns:
      One `[..., S, N_i/P]` array per weight, rows in global order:
      `act_i(x_all @ w_i + bias_i)`; for a weight with `sum_squares`, the
      pair `(y_i, ssq_i)` with ssq_i `[..., S, 1]` float32; for a weight with
      `heads`, `[..., N_i/P/D, S, D]`.
    """
    weights = list(weights)
    heads = list(heads) if heads is not None else [None] * len(weights)
    norms = list(norms) if norms is not None else [None] * len(weights)
    if len(heads) != len(weights) or len(norms) != len(weights):
        raise ValueError("all_gather_matmul_stream kernel: one heads (or None) and one norm (or None) per weight")
    for hd, nw_ in zip(heads, norms):
        want = hd is not None and hd.norm
        if want != (nw_ is not None) or (want and (nw_.shape != (hd.head_dim,) or nw_.dtype != x.dtype)):
            raise ValueError(f"all_gather_matmul_stream kernel: a [head_dim] norm weight of x's dtype for each "
                             f"Heads(norm=True) and none otherwise, got {getattr(nw_, 'shape', None)} for {hd}")
    rope_dim = next((hd.head_dim for hd in heads if hd is not None and hd.rope), None)
    biases = list(biases) if biases is not None else [None] * len(weights)
    activations = list(activations) if activations is not None else [None] * len(weights)
    sum_squares = [bool(q) for q in sum_squares] if sum_squares is not None else [False] * len(weights)
    if len(biases) != len(weights) or len(activations) != len(weights) or len(sum_squares) != len(weights):
        raise ValueError("all_gather_matmul_stream kernel: one bias, one activation (or None) and one "
                         "sum_squares flag per weight")
    stacked_layer = layer is not None
    if layer is None:
        weights, layer = [w[None] for w in weights], 0
    if any(w.ndim != 3 for w in weights) or len({w.shape[0] for w in weights}) != 1:
        raise ValueError(f"all_gather_matmul_stream kernel: stacked weights [L, K, n_i] of one L, got "
                         f"{[w.shape for w in weights]}")
    widths = [int(w.shape[2]) for w in weights]
    bias_stacked = []
    for b, n in zip(biases, widths):
        if b is None:
            bias_stacked.append(None)
        elif b.ndim == 1 and b.shape == (n,):
            bias_stacked.append(False)
        elif stacked_layer and b.ndim == 2 and b.shape[1] == n:
            bias_stacked.append(True)
        else:
            raise ValueError(f"all_gather_matmul_stream kernel: bias {b.shape} for a weight of width {n}")
    P = lax.axis_size(axis_name)
    blocks = blocks or _common.StreamBlocks()
    reason, sp = plan(x.shape, widths, x.dtype, P, blocks=blocks,
                      biases=[None if b is None else (b.size // b.shape[-1], b.dtype) for b in biases],
                      activations=activations, sum_squares=sum_squares, heads=heads)
    if reason:
        raise ValueError(f"all_gather_matmul_stream kernel: {reason}")
    S_all = x.shape[-2] * P
    if (rope_dim is None) != (rope is None) or (rope is not None and any(
            t.shape != (S_all, rope_dim) or t.dtype != jnp.float32 for t in rope)):
        raise ValueError(f"all_gather_matmul_stream kernel: RoPE tables (cos, sin) float32 [{S_all}, {rope_dim}] "
                         f"with a Heads(rope=True) and none otherwise, got "
                         f"{None if rope is None else [(t.shape, t.dtype) for t in rope]}")
    for w in weights:
        if w.shape[1] != x.shape[-1] or w.dtype != x.dtype:
            raise ValueError(f"all_gather_matmul_stream kernel: weight {w.shape} {w.dtype} does not take "
                             f"x {x.shape} {x.dtype}")
    B, lead = _common.fold_batch(x.shape)
    s, K = x.shape[-2], x.shape[-1]
    S, h, hc, C, W, tn, held = s * P, s // 2, sp.chunk_rows, sp.chunks, sp.window, sp.col_tile, sp.weights_in_vmem
    tk = _common.depth_tile(K, blocks.depth_tile_limit)
    x3 = x.reshape(B, s, K)
    tables = _common.ring_tables(axis_name, s)
    slabs = _common.ring_tables(axis_name, 2 * C)  # (2q) C: the first ssq slab of each hop's shard
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    ns = sum(sum_squares)
    bias_ops = [b.reshape(-1, b.shape[-1]) for b in biases if b is not None]
    norm_ops = [n.reshape(1, -1) for n in norms if n is not None]
    rope_ops = list(rope) if rope is not None else []
    ws = [_common.in_hbm(w) for w in weights]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    n_total = sum(widths)
    itemsize = jnp.dtype(x.dtype).itemsize
    rows = 2 * C * hc  # rows a rank multiplies per hop (the overlap included)
    kernel = functools.partial(_kernel, axis_name=axis_name, P=P, B=B, h=h, hc=hc, C=C, W=W, K=K,
                               widths=tuple(widths), tn=tn, tk=tk, tiles=sp.row_tiles, unit=_common.sublane_rows(x.dtype),
                               bias_stacked=tuple(bias_stacked), activations=tuple(activations),
                               sum_squares=tuple(sum_squares), heads=tuple(heads), held=held,
                               skip_credit_at=_skip_credit_at)
    cost = pl.CostEstimate(
        flops=2 * B * P * rows * K * n_total,
        transcendentals=B * P * rows * (sum(n for n, a in zip(widths, activations) if a is not None)
                                        + sum(n // hd.head_dim for n, hd in zip(widths, heads) if hd and hd.norm)),
        # this rank's rows once, every weight tile once per step (once a call if held), every product once
        bytes_accessed=itemsize * (B * rows * K + (1 if held else P * C) * K * n_total + B * P * rows * n_total),
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=([_common.out_struct((B, S, n) if hd is None else (B, n // hd.head_dim, S, hd.head_dim),
                                       x.dtype, x) for n, hd in zip(widths, heads)]
                   + [_common.out_struct((B, 2 * P * C, 1, hc), jnp.float32, x)] * ns),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            in_specs=[any_spec] * (1 + len(ws) + len(bias_ops) + len(norm_ops) + len(rope_ops)),
            out_specs=[any_spec] * (len(ws) + ns),
            scratch_shapes=[
                pltpu.VMEM((W, 2 * B * hc, K), x.dtype),           # xbuf: the window of steps' rows
                pltpu.VMEM((n_total // tn if held else 2, K, tn), x.dtype),  # wbuf: 2 tiles, or every tile
                pltpu.VMEM((2, 2 * B * hc, tn), x.dtype),          # obuf
                *[pltpu.VMEM(b.shape, b.dtype) for b in bias_ops],  # bbuf
                *[pltpu.VMEM(n.shape, n.dtype) for n in norm_ops],  # nbuf
                *([pltpu.VMEM((2, 2, B, 1, hc), jnp.float32)] if ns else []),  # sbuf
                *([pltpu.VMEM((2 * B * hc, tn), jnp.float32)] if tk < K else []),  # abuf: depth-chunk sums
                *([pltpu.VMEM((2, 2 * B * hc, rope_dim), jnp.float32)]  # rbuf: the step's RoPE rows, flat
                  if rope_ops else []),
                pltpu.SemaphoreType.DMA((2, W)),                   # recv_sem per direction, slot
                pltpu.SemaphoreType.DMA((2,)),                     # send_sem per direction
                pltpu.SemaphoreType.REGULAR((2,)),                 # credit: slots freed downstream
                pltpu.SemaphoreType.DMA((2,)),                     # w_sem
                pltpu.SemaphoreType.DMA((2, 2)),                   # o_sem
                pltpu.SemaphoreType.DMA((max(1, len(bias_ops) + len(norm_ops)),)),  # b_sem (biases, norms)
                pltpu.SemaphoreType.DMA((2, 2)),                   # s_sem
                pltpu.SemaphoreType.DMA((2,)),                     # r_sem (cos, sin)
            ],
        ),
        compiler_params=pltpu.CompilerParams(collective_id=COLLECTIVE_ID, vmem_limit_bytes=sp.vmem.limit),
        cost_estimate=cost,
        interpret=_common.interpret_params(interpret),
        # difflet_tpu.tools.estimate prices it by steps ("_wvmem": the weights read once a call)
        name=f"all_gather_matmul_stream_{C}chunks_{hc}rows" + ("_wvmem" if held else ""),
    )(tables, layer, slabs, x3, *ws, *bias_ops, *norm_ops, *rope_ops)
    ys = [o.reshape(*lead, *o.shape[1:]) for o in outs[:len(ws)]]
    rem = h - (C - 1) * hc  # rows of the last chunk not in the one before

    def ssq_rows(o):  # [B, 2PC, 1, hc] -> [B, P, 2, C, hc] -> each half's h rows -> [..., S, 1]
        o = o.reshape(B, P, 2, C, hc)
        o = jnp.concatenate([o[..., :C - 1, :].reshape(B, P, 2, (C - 1) * hc), o[..., C - 1, hc - rem:]], axis=-1)
        return o.reshape(*lead, S, 1)

    ssqs = iter([ssq_rows(o) for o in outs[len(ws):]])
    return [(y, next(ssqs)) if q else y for y, q in zip(ys, sum_squares)]
