"""All-gather + matmul as one Pallas TPU kernel (bidirectional ring, VMEM resident).

Called inside `jax.shard_map` over a ring axis of size P (`tp`). Every rank
holds `x`, its `s = S/P` rows of the sequence, and column shards of one or more
weights; it returns, per weight, every row of the sequence times its columns:

    x        [B, s, K]      this rank's rows (leading dims folded into B)
    w_i      [L, K, n_i]    column shards of L stacked layers (a plain [K, n_i]
                            is L = 1), n_i multiples of 128, widths may differ;
                            the kernel reads layer `layer` only
    bias_i   [n_i] or [L, n_i]  optional, per weight (a stack is read at `layer`)
    out_i    [B, S, n_i]    rows in global order (rank q's rows at [q*s, (q+1)*s)),
                            act_i(x @ w_i + bias_i) with the epilogue below
    ssq_i    [B, 2P, 1, h]  optional, per weight (`sum_squares`): float32 sum over
                            this rank's n_i columns of out_i's squares, per row;
                            half-slab g = 2q + d holds rank q's half d (rows
                            [g*h, (g+1)*h) in global order), so the wrapper's
                            reshape to [B, S, 1] is row order (see below)

Ring (as `difflet_tpu.collective_matmul._ag_ring`): the shard splits into a
forward half (rows [0, h), h = s/2) and a backward half (rows [h, s)). At hop
j = 0..P-1 rank r holds the forward half of rank r-j and the backward half of
rank r+j, multiplies both by every weight, and meanwhile forwards them one
more hop. The halves travel VMEM to VMEM by remote DMA; only the products
touch HBM, each product tile written once at its final rows.

Layout and tiling (per rank; isz = itemsize):

    VMEM  xbuf  [2 dirs, R slots, B, h, K]   received halves, R = 3 (see below)
          wbuf  [2, K, tn]                    weight tiles, double-buffered
          obuf  [2, 2 dirs, B, h, tn]         product tiles on their way to HBM
          bbuf_i [L_i, n_i]                   weight i's bias, all its L_i rows (1 unless
                                              stacked; only if it has one)
          sbuf  [2, 2 dirs, B, 1, h] f32      row sums of squares on their way to HBM
                                              (only if some weight has sum_squares)
          abuf  [2 dirs, B, h, tn] f32        products summed over depth chunks of tk
                                              columns of x (only if tk < K)
    HBM   x, w_i, bias_i (inputs), out_i (outputs); memory_space ANY (w_i kept
          in HBM, `_common.in_hbm`), moved by explicit DMA
    SMEM  tables int32[2 + 2P] (scalar prefetch, see _common.ring_tables)
          layer  int32[1]       (scalar prefetch: weight tiles come from w_i.at[layer])
          slabs  int32[2 + 2P]  (scalar prefetch: ring_tables with 2 rows a shard, i.e.
                                 2q for the shards of hop j; ssq half-slab = 2q + d)

Sum of squares (per weight, static, `sum_squares`): after the cast, the
tile is read back as float32 (the output AS ROUNDED, so the sum equals the
unfused `sum(y.astype(f32) ** 2)` up to summation order), squared and summed
over its columns; the (tm, 1) column of row sums is relaid out to a lane-major
(1, tm) row and accumulated over the weight's column tiles in sbuf (the first
tile writes, the others add). After the last column tile of hop j, sbuf's two
halves go to HBM by DMA, each to the half-slab of the rows it holds. Why this
layout: the rows of an arriving half start at a multiple of 8 or 16 rows, not
of 128, so a lane-major [B, S] output could not be written at its rows by an
aligned DMA, and a sublane-major [B, S, 1] one is padded to 128 lanes in VMEM
and HBM (512 bytes a row); a [B, 2P, 1, h] slab is one DMA at a dynamic
leading index of whole (1, h) rows, padded to 8 sublanes (32 bytes a row,
about 1% of a bf16 output row of 1280 columns). sbuf is double-buffered over
successive (hop, ssq weight) steps k: step k waits for step k-2's DMA before
its first tile writes. The ssq is this rank's columns only: the caller sums
it over ranks (one psum) for a norm across all columns (Wan's / LTX-2's q, k).

Weight tiles are DMA'd from `w_i.at[layer, :, cols]`: a block scan passes
the whole stack and its layer index, so no weight-sized copy of the layer is
made before the call.

Long sequences run in row chunks: when the buffers above (sized by the half,
h rows) do not fit VMEM, the shard splits into C near-equal chunks of whole
tiles (`_common.row_chunks`, the fewest C that fit) and the ring runs once per
chunk, one call each: call c gathers rows [row0_c, row0_c + 2 h_c) of every
rank's shard and writes them at their rows of out_i (rank q's at q*s + row0_c),
the previous call's outputs passed in and aliased (`input_output_aliases`),
so nothing is copied; its sums of squares come out per call and are put in
row order by a small concatenation. Each call streams the weights P times
again (C x the weight traffic, hidden under the MXU work at Wan 480x832x81
by the estimate) and starts with its own barrier.
The dispatch (difflet_tpu.collective_matmul.ag_kernel_choice) runs
kernels/all_gather_matmul_stream.py instead by default, at every shape: one
call, its steps a runtime loop (this kernel unrolls its P hops, so its code is
P times as long), the halves streamed chunk by chunk through a window of VMEM
slots guarded by credits (one chunk a half when they fit).

Epilogue (per weight, static): each product tile leaves the MXU as float32;
the bias row's columns are added in float32, then the activation
(None or "gelu_tanh": `jax.nn.gelu(approximate=True)`) is applied in
float32, and only then is the tile cast to x's dtype and written out. So a
bias/GELU costs no pass over the output in HBM; for float32 x the result is
the unfused `act(x @ w + bias)` computed in the same order. The bias is small
(a stacked [L, n_i] of bf16 is L * n_i * 2 bytes, ~0.3 MiB for Wan's FFN), so
the whole array is DMA'd into bbuf_i once at entry and the row `layer` picked
in registers per column tile (a masked sum over the L_i rows, exact): a DMA
of one row at a traced index would not be aligned to HBM's (sublane, lane)
tiles, which Mosaic refuses.

One weight-tile stream runs over every (hop, weight, column tile) step t: tile
t+1 loads (HBM -> wbuf[(t+1)%2]) while tile t is multiplied with both halves;
the products go out (obuf[t%2] -> out_i) while step t+1 computes. A column
tile tn (a multiple of 128 dividing every n_i) is common to all weights. The depth K
goes in chunks of tk (a multiple of 128 dividing K, at most
`DEFAULT_DEPTH_TILE_LIMIT`) in a `fori_loop`, summed in float32 in abuf, so
the dots Mosaic unrolls into straight-line code are (tm, tk) x (tk, tn). Row
tiles: each half is multiplied in a few static row pieces (multiples of the
dtype's sublane count, at most `max_row_tile` rows) to bound the f32 results.

    hop j:  wait recv(j) ─┬─ send slot j -> neighbours' slot j+1 (remote DMA) ─┐
                          └─ for (weight, column tile):                         │
                               wait w tile, prefetch next w tile,              │
                               obuf <- act(xbuf[., slot j] @ wbuf + b), DMA out │
            wait send(j) <──────────────────────────────────────────────────────┘

Receive slots (R = 3) and why a neighbour cannot overwrite a slot in use.
Hop j lives in slot j % R. A hop's order is fixed: (1) wait both halves of
hop j, (2) send both on, (3) multiply, (4) wait both sends. Our upstream U
sends our hop-(j+1) forward half at the start of ITS hop j, i.e. after step (1)
of its hop j, which waited for the backward half we sent it at the start of OUR
hop j-1. Our hop j-1 started only after our hop j-2 ended (its multiplies read
slot j-2, its step (4) saw our sends out of slot j-2 done). So the earliest U
can write slot (j+1) % R, we may still be reading slot j-1 (hop j-1's
multiplies and sends) and receiving slot j; (j+1), j and j-1 must be distinct
mod R, hence R = 3, and the same holds mirrored for the backward direction.
With R = 2 U's write lands in slot j-1 while we read it: the race detector
flags that (tests/kernels; `_recv_slots` is a private knob for that test).
Every DMA semaphore is per (direction, slot), so two outstanding arrivals are
never confused. A barrier with both neighbours at entry makes sure nobody
writes into a kernel instance that has not started.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _common

RECV_SLOTS = 3
DEFAULT_COLUMN_TILE_LIMIT = 512
DEFAULT_ROW_TILE_LIMIT = 512
DEFAULT_DEPTH_TILE_LIMIT = 1024
COLLECTIVE_ID = 7

# Epilogue activations, applied to the float32 tile (after the bias).
ACTIVATIONS = {"gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True)}


# --------------------------------------------------------------------------
# Plan: tiles and the VMEM each buffer takes
# --------------------------------------------------------------------------

def _check(x_shape, widths, dtype, axis_size, biases, activations, sum_squares):
    """The shape / dtype / epilogue rules shared by the resident and streaming plans
    (kernels/all_gather_matmul_stream.py): one sentence why not, or
    (B, s, K, unit, dtype, activations, sum_squares, bias VMEM buffers)."""
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
    if len(biases) != len(widths) or len(activations) != len(widths) or len(sum_squares) != len(widths):
        return "one bias, one activation (or None) and one sum_squares flag per weight"
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
    return B, s, K, unit, dtype, activations, sum_squares, bias_bufs


def _vmem_plan(B, h, K, tn, tiles, dtype, slots, activations, sum_squares, bias_bufs, tk, w_tiles=2):
    """The VMEM buffers of h-row halves (resident) or h-row chunks (streaming) in `slots`
    slots per direction, column tile tn, row pieces `tiles`, depth chunks of tk, and
    `w_tiles` weight tiles (2: double-buffered; every tile when held in VMEM)."""
    tm = max(sz for _, sz in tiles)
    return _common.VmemPlan((
        _common.buffer("xbuf", (2, slots, B, h, K), dtype),
        _common.buffer("wbuf", (w_tiles, K, tn), dtype),
        _common.buffer("obuf", (2, 2, B, h, tn), dtype),
        # values Mosaic materialises per dot: the x row piece, the weight tile, the f32 result
        _common.buffer("dot operands", (tm * tk + tk * tn,), dtype),
        _common.buffer("f32 result", (tm, tn), jnp.float32),
        # the float32 sums over depth chunks (only if K is cut: tk < K)
        *([_common.buffer("acc", (2, B, h, tn), jnp.float32)] if tk < K else []),
        # the epilogue's float32 temporaries (bias added, GELU's inner terms;
        # the rounded tile read back and squared for a sum of squares)
        *([_common.buffer("f32 epilogue", (2, tm, tn), jnp.float32)]
          if any(a is not None for a in activations) or any(sum_squares) else []),
        *bias_bufs,
        # row sums of squares: [2, 2, B, 1, h] f32, (1, h) padded to (8, 128k)
        *([_common.buffer("ssq", (2, 2, B, 8, -(-h // _common.LANES) * _common.LANES), jnp.float32)]
          if any(sum_squares) else []),
    ))


def _plan(x_shape, widths, dtype, axis_size, *, recv_slots=RECV_SLOTS,
          col_tile_limit=DEFAULT_COLUMN_TILE_LIMIT, row_tile_limit=DEFAULT_ROW_TILE_LIMIT,
          depth_tile_limit=DEFAULT_DEPTH_TILE_LIMIT, biases=None, activations=None, sum_squares=None,
          chunks=None):
    """(reason, tn, row_tiles, VmemPlan, row chunks): reason is None if the kernel can run.

    biases / activations / sum_squares: per weight, None (no bias) or the
    bias's (rows, dtype), rows 1 for [n_i] and L for a stacked [L, n_i]; the
    activation name or None; a bool, as `all_gather_matmul` takes them.
    chunks: how many row chunks of the shard (one kernel call each,
    `_common.row_chunks`); None takes the fewest whose buffers fit VMEM. The
    buffers and `row_tiles` are the largest chunk's."""
    checked = _check(x_shape, widths, dtype, axis_size, biases, activations, sum_squares)
    if isinstance(checked, str):
        return checked, None, None, None, None
    B, s, K, unit, dtype, activations, sum_squares, bias_bufs = checked
    tk = _common.depth_tile(K, depth_tile_limit)

    def candidates(h):
        for tn in _common.column_tile_candidates(widths, col_tile_limit):
            tiles = _common.row_tiles(h, row_tile_limit, unit)
            yield (_vmem_plan(B, h, K, tn, tiles, dtype, recv_slots, activations, sum_squares, bias_bufs, tk),
                   (tn, tiles))

    reason, extra, plan, pieces = _common.fit_chunks(
        s, unit, chunks, candidates, f"halves resident in {recv_slots} slots per direction")
    tn, tiles = extra or (None, None)
    return reason, tn, tiles, plan, pieces


def unsupported_reason(x_shape, widths, dtype, axis_size, *, biases=None,
                       activations=None, sum_squares=None) -> str | None:
    """None if `all_gather_matmul` runs for these shapes, else one sentence why not."""
    return _plan(x_shape, list(widths), dtype, axis_size, biases=biases, activations=activations,
                 sum_squares=sum_squares)[0]


def vmem_plan(x_shape, widths, dtype, axis_size, *, biases=None,
              activations=None, sum_squares=None) -> _common.VmemPlan | None:
    """The VMEM buffer plan (and requested scoped limit) for these shapes."""
    return _plan(x_shape, list(widths), dtype, axis_size, biases=biases, activations=activations,
                 sum_squares=sum_squares)[3]


def chunks(x_shape, widths, dtype, axis_size, *, biases=None, activations=None, sum_squares=None) -> int | None:
    """How many row chunks of the shard (kernel calls) the plan takes for these shapes."""
    pieces = _plan(x_shape, list(widths), dtype, axis_size, biases=biases, activations=activations,
                   sum_squares=sum_squares)[4]
    return None if pieces is None else len(pieces)


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


def _multiply_tile(xbuf, slot, wref, bias, act, obuf, par, sbuf, sp, col, *, B, tiles, ssq: bool, tk, acc):
    """Both directions' rows in `slot` of xbuf times the weight tile `wref` [K, tn], the
    epilogue on the float32 product (bias, activation, cast) written to obuf[par]; with
    `ssq`, the rounded tile's squares summed over its columns into sbuf[sp] (column tile
    0 writes, the others add). Shared by the resident and the streaming kernel.

    With tk < K the depth goes in K / tk chunks, a `fori_loop` summing each chunk's
    products into the float32 accumulator `acc` [2, B, h, tn]: one loop body of
    (tm, tk) x (tk, tn) dots is the kernel's code, instead of every (tm, K) x (K, tn)
    dot unrolled (Mosaic emits straight-line MXU code per dot: a 592 x 5120 x 256 dot
    is ~0.5 MB of it, a 592 x 1024 x 256 one ~0.1 MB; docs/kernels.md)."""
    K = wref.shape[0]
    if tk < K:
        def depth_chunk(k, carry):
            k0 = pl.multiple_of(k * tk, tk)
            w = wref[pl.ds(k0, tk), :]
            for d in (0, 1):
                for b in range(B):
                    for r0, tm in tiles:
                        p = jnp.dot(xbuf[d, slot, b, pl.ds(r0, tm), pl.ds(k0, tk)], w,
                                    preferred_element_type=jnp.float32)
                        prev = acc[d, b, pl.ds(r0, tm), :]
                        acc[d, b, pl.ds(r0, tm), :] = jnp.where(k == 0, p, prev + p)
            return carry

        lax.fori_loop(0, K // tk, depth_chunk, 0)
    else:
        w = wref[...]
    for d in (0, 1):
        for b in range(B):
            for r0, tm in tiles:
                if tk < K:
                    y = acc[d, b, pl.ds(r0, tm), :]
                else:
                    y = jnp.dot(xbuf[d, slot, b, pl.ds(r0, tm), :], w, preferred_element_type=jnp.float32)
                if bias is not None:
                    y = y + bias
                if act is not None:
                    y = act(y)
                y = y.astype(obuf.dtype)
                obuf[par, d, b, pl.ds(r0, tm), :] = y
                if ssq:  # the rounded output's squares, summed over this tile's columns
                    yf = y.astype(jnp.float32)
                    part = jnp.sum(yf * yf, axis=-1).reshape(1, tm)
                    prev = sbuf[sp, d, b, :, pl.ds(r0, tm)]
                    sbuf[sp, d, b, :, pl.ds(r0, tm)] = jnp.where(col > 0, prev + part, part)


def _kernel(tables, layer, slabs, x_hbm, *refs, axis_name, P, B, h, row0, K, widths, tn, tk, tiles, slots, unit,
            bias_stacked, activations, sum_squares, aliased):
    nw = len(widths)
    has_bias = [st is not None for st in bias_stacked]
    nb = sum(has_bias)
    ns = sum(sum_squares)
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]
    w_hbm, b_hbm = take(nw), take(nb)
    take(nw if aliased else 0)  # the previous chunk's outputs, aliased to out_hbm
    out_hbm, ssq_hbm = take(nw), take(ns)
    xbuf, wbuf, obuf = take(3)
    bbuf = take(nb)
    sbuf = take(1)[0] if ns else None
    abuf = take(1)[0] if tk < K else None
    x_sem, recv_sem, send_sem, w_sem, o_sem, b_sem, s_sem = refs
    bias_of, k = [], 0  # weight i -> its bias slot (None: no bias)
    for hb in has_bias:
        bias_of.append(k if hb else None)
        k += hb
    ssq_of, k = [], 0  # weight i -> its ssq output (None: no sum of squares)
    for q in sum_squares:
        ssq_of.append(k if q else None)
        k += q
    ncols = [n // tn for n in widths]
    steps_per_hop = sum(ncols)
    total_steps = P * steps_per_hop
    nbr = (tables[0], tables[1])  # forward (r+1), backward (r-1)

    def row(j, d):  # first output row of the half held at hop j in direction d (this call's chunk)
        if d == 0:
            return pl.multiple_of(tables[2 + j] + row0, unit)
        return pl.multiple_of(tables[2 + P + j] + row0 + h, unit)

    def send(j, d):  # hop j's half in direction d -> the neighbour's slot for hop j+1
        src = x_hbm.at[:, pl.ds(row0 + d * h, h)] if j == 0 else xbuf.at[d, j % slots]
        return pltpu.make_async_remote_copy(
            src, xbuf.at[d, (j + 1) % slots], send_sem.at[d], recv_sem.at[d, (j + 1) % slots],
            device_id={axis_name: nbr[d]})

    def w_copy(i, c, par):
        col = pl.multiple_of(c * tn, tn)
        return pltpu.make_async_copy(w_hbm[i].at[layer[0], :, pl.ds(col, tn)], wbuf.at[par], w_sem.at[par])

    def o_copy(i, j, d, c, par):
        col = pl.multiple_of(c * tn, tn)
        return pltpu.make_async_copy(obuf.at[par, d], out_hbm[i].at[:, pl.ds(row(j, d), h), pl.ds(col, tn)],
                                     o_sem.at[par, d])

    def s_copy(k, j, d, sp):  # ssq output k's half d of hop j: sbuf[sp, d] -> its half-slab
        slab = slabs[2 + j] if d == 0 else slabs[2 + P + j] + 1
        return pltpu.make_async_copy(sbuf.at[sp, d], ssq_hbm[k].at[:, slab], s_sem.at[sp, d])

    # Own halves into slot 0 (local DMA), the bias rows and the first weight tile, at once.
    local = [pltpu.make_async_copy(x_hbm.at[:, pl.ds(row0 + d * h, h)], xbuf.at[d, 0], x_sem.at[d])
             for d in (0, 1)]
    bias_rows = [pltpu.make_async_copy(b_hbm[k], bbuf[k], b_sem.at[k]) for k in range(nb)]
    for cp in local + bias_rows:
        cp.start()
    w_copy(0, 0, 0).start()

    # Nobody may write into a neighbour's VMEM before that neighbour's kernel runs.
    barrier = pltpu.get_barrier_semaphore()
    for d in (0, 1):
        pl.semaphore_signal(barrier, 1, device_id={axis_name: nbr[d]})
    pl.semaphore_wait(barrier, 2)

    for j in range(P):
        slot = j % slots
        if j == 0:
            for cp in local + bias_rows:
                cp.wait()
        else:
            for d in (0, 1):
                send(j - 1, d).wait_recv()
        if j < P - 1:
            for d in (0, 1):
                send(j, d).start()

        for i in range(nw):
            base = j * steps_per_hop + sum(ncols[:i])
            if i + 1 < nw:
                nxt = i + 1
            elif j + 1 < P:
                nxt = 0
            else:
                nxt = None

            # the (hop, ssq weight) step of this weight's sums of squares, and its sbuf parity
            step = j * ns + (ssq_of[i] if ssq_of[i] is not None else 0)
            sp = step % 2

            def body(c, carry, i=i, base=base, nxt=nxt, slot=slot, j=j, step=step, sp=sp):
                t = base + c
                par = t % 2
                w_copy(i, c, par).wait()

                @pl.when(c + 1 < ncols[i])
                def _():
                    w_copy(i, c + 1, 1 - par).start()

                if nxt is not None:
                    @pl.when(c + 1 == ncols[i])
                    def _():
                        w_copy(nxt, 0, 1 - par).start()

                @pl.when(t >= 2)  # obuf[par] was sent out two steps ago
                def _():
                    for d in (0, 1):
                        o_copy(i, j, d, c, par).wait()

                bias = (None if bias_of[i] is None
                        else _bias_tile(bbuf[bias_of[i]], c, tn, bias_stacked[i], layer))
                act = ACTIVATIONS[activations[i]] if activations[i] is not None else None
                ssq = ssq_of[i] is not None
                if ssq and step >= 2:
                    @pl.when(c == 0)  # sbuf[sp] went out two ssq steps ago
                    def _():
                        for d in (0, 1):
                            s_copy(0, 0, d, sp).wait()
                _multiply_tile(xbuf, slot, wbuf.at[par], bias, act, obuf, par, sbuf, sp, c, B=B, tiles=tiles,
                               ssq=ssq, tk=tk, acc=abuf)
                for d in (0, 1):
                    o_copy(i, j, d, c, par).start()
                if ssq:
                    @pl.when(c + 1 == ncols[i])  # this hop's row sums are complete
                    def _():
                        for d in (0, 1):
                            s_copy(ssq_of[i], j, d, sp).start()
                return carry

            lax.fori_loop(0, ncols[i], body, 0)

        if j < P - 1:
            for d in (0, 1):
                send(j, d).wait_send()

    # Drain the last two steps' output DMAs (waits only count bytes: any tile of that size).
    for t in range(max(0, total_steps - 2), total_steps):
        for d in (0, 1):
            o_copy(0, 0, d, 0, t % 2).wait()
    for step in range(max(0, P * ns - 2), P * ns):  # ... and the last two ssq steps'
        for d in (0, 1):
            s_copy(0, 0, d, step % 2).wait()


def all_gather_matmul(x, weights, *, layer=None, biases=None, activations=None, sum_squares=None,
                      axis_name="tp", interpret=False,
                      _recv_slots=RECV_SLOTS, _col_tile_limit=DEFAULT_COLUMN_TILE_LIMIT,
                      _row_tile_limit=DEFAULT_ROW_TILE_LIMIT, _depth_tile_limit=DEFAULT_DEPTH_TILE_LIMIT,
                      _chunks=None):
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
      interpret: False (Mosaic), True (TPU interpret mode) or a
        `pltpu.InterpretParams` (e.g. with detect_races=True).

    Returns:
      One `[..., S, N_i/P]` array per weight, rows in global order:
      `act_i(x_all @ w_i + bias_i)`; for a weight with `sum_squares`, the
      pair `(y_i, ssq_i)` with ssq_i `[..., S, 1]` float32.
    """
    weights = list(weights)
    biases = list(biases) if biases is not None else [None] * len(weights)
    activations = list(activations) if activations is not None else [None] * len(weights)
    sum_squares = [bool(q) for q in sum_squares] if sum_squares is not None else [False] * len(weights)
    if len(biases) != len(weights) or len(activations) != len(weights) or len(sum_squares) != len(weights):
        raise ValueError("all_gather_matmul kernel: one bias, one activation (or None) and one "
                         "sum_squares flag per weight")
    stacked_layer = layer is not None
    if layer is None:  # one layer: [K, n] -> [1, K, n], a free reshape
        weights, layer = [w[None] for w in weights], 0
    if any(w.ndim != 3 for w in weights) or len({w.shape[0] for w in weights}) != 1:
        raise ValueError(f"all_gather_matmul kernel: stacked weights [L, K, n_i] of one L, got "
                         f"{[w.shape for w in weights]}")
    widths = [int(w.shape[2]) for w in weights]
    bias_stacked = []  # per weight: None (no bias), False ([n]), True ([L, n] read at `layer`)
    for b, n in zip(biases, widths):
        if b is None:
            bias_stacked.append(None)
        elif b.ndim == 1 and b.shape == (n,):
            bias_stacked.append(False)
        elif stacked_layer and b.ndim == 2 and b.shape[1] == n:
            bias_stacked.append(True)
        else:
            raise ValueError(f"all_gather_matmul kernel: bias {b.shape} for a weight of width {n} "
                             f"(want [{n}]{', or [L, %d] with layer' % n if stacked_layer else ''})")
    P = lax.axis_size(axis_name)
    reason, tn, _, plan, pieces = _plan(x.shape, widths, x.dtype, P, recv_slots=_recv_slots,
                                        col_tile_limit=_col_tile_limit, row_tile_limit=_row_tile_limit,
                                        depth_tile_limit=_depth_tile_limit, biases=[None if b is None else (b.size // b.shape[-1], b.dtype)
                                                for b in biases],
                                        activations=activations, sum_squares=sum_squares, chunks=_chunks)
    if reason:
        raise ValueError(f"all_gather_matmul kernel: {reason}")
    for w in weights:
        if w.shape[1] != x.shape[-1] or w.dtype != x.dtype:
            raise ValueError(f"all_gather_matmul kernel: weight {w.shape} {w.dtype} does not take x {x.shape} {x.dtype}")
    B, lead = _common.fold_batch(x.shape)
    s, K = x.shape[-2], x.shape[-1]
    S = s * P
    tk = _common.depth_tile(K, _depth_tile_limit)
    x3 = x.reshape(B, s, K)
    tables = _common.ring_tables(axis_name, s)
    slabs = _common.ring_tables(axis_name, 2)  # 2q: the first half-slab of each hop's shard
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    ns = sum(sum_squares)
    unit = _common.sublane_rows(x.dtype)
    # biases as [L, n] (a stack, as given) or [1, n]: the kernel DMAs all rows into VMEM
    bias_ops = [b.reshape(-1, b.shape[-1]) for b in biases if b is not None]
    ws = [_common.in_hbm(w) for w in weights]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    n_total = sum(widths)
    itemsize = jnp.dtype(x.dtype).itemsize
    nw, n_in = len(weights), 1 + len(weights) + len(bias_ops)
    ys, ssq_parts = None, []
    for row0, cs in pieces:
        # One call per row chunk (one, unless a long sequence's halves would not fit
        # VMEM): rows [row0, row0 + cs) of every rank's shard, halves of h rows, written
        # at their rows of out_i, the previous call's outputs passed in and aliased.
        h = cs // 2
        aliased = ys is not None
        kernel = functools.partial(_kernel, axis_name=axis_name, P=P, B=B, h=h, row0=row0, K=K,
                                   widths=tuple(widths), tn=tn, tk=tk, tiles=_common.row_tiles(h, _row_tile_limit, unit),
                                   slots=_recv_slots, unit=unit, bias_stacked=tuple(bias_stacked),
                                   activations=tuple(activations), sum_squares=tuple(sum_squares),
                                   aliased=aliased)
        cost = pl.CostEstimate(
            flops=2 * B * P * cs * K * n_total,
            transcendentals=B * P * cs * sum(n for n, a in zip(widths, activations) if a is not None),
            # the chunk's rows of x once, every weight tile once per hop, every product once
            # (bias rows and sums of squares: negligible).
            bytes_accessed=itemsize * (B * cs * K + P * K * n_total + B * P * cs * n_total),
        )
        outs = pl.pallas_call(
            kernel,
            out_shape=([_common.out_struct((B, S, n), x.dtype, x) for n in widths]
                       + [_common.out_struct((B, 2 * P, 1, h), jnp.float32, x)] * ns),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3,
                in_specs=[any_spec] * (n_in + (nw if aliased else 0)),
                out_specs=[any_spec] * (nw + ns),
                scratch_shapes=[
                    pltpu.VMEM((2, _recv_slots, B, h, K), x.dtype),   # xbuf
                    pltpu.VMEM((2, K, tn), x.dtype),                  # wbuf
                    pltpu.VMEM((2, 2, B, h, tn), x.dtype),            # obuf
                    *[pltpu.VMEM(b.shape, b.dtype) for b in bias_ops],  # bbuf: biases (all rows)
                    *([pltpu.VMEM((2, 2, B, 1, h), jnp.float32)] if ns else []),  # sbuf: row sums of squares
                    *([pltpu.VMEM((2, B, h, tn), jnp.float32)] if tk < K else []),  # abuf: depth-chunk sums
                    pltpu.SemaphoreType.DMA((2,)),                    # x_sem: own halves -> slot 0
                    pltpu.SemaphoreType.DMA((2, _recv_slots)),        # recv_sem per direction, slot
                    pltpu.SemaphoreType.DMA((2,)),                    # send_sem per direction
                    pltpu.SemaphoreType.DMA((2,)),                    # w_sem per weight buffer
                    pltpu.SemaphoreType.DMA((2, 2)),                  # o_sem per obuf, direction
                    pltpu.SemaphoreType.DMA((max(1, len(bias_ops)),)),  # b_sem per bias row
                    pltpu.SemaphoreType.DMA((2, 2)),                  # s_sem per sbuf, direction
                ],
            ),
            # inputs count the 3 scalar-prefetch operands first
            input_output_aliases={3 + n_in + i: i for i in range(nw)} if aliased else {},
            compiler_params=pltpu.CompilerParams(collective_id=COLLECTIVE_ID, vmem_limit_bytes=plan.limit),
            cost_estimate=cost,
            interpret=_common.interpret_params(interpret),
            name="all_gather_matmul" if len(pieces) == 1 else f"all_gather_matmul_{len(pieces)}chunks",
        )(tables, layer, slabs, x3, *ws, *bias_ops, *(ys if aliased else []))
        ys = list(outs[:nw])
        # [B, 2P, 1, h]: half-slab 2q + d = rank q's half d of this chunk -> [B, P, 2h]
        ssq_parts.append([o.reshape(B, P, 2 * h) for o in outs[nw:]])
    ys = [o.reshape(*lead, S, o.shape[-1]) for o in ys]
    # each rank's rows: its chunks in order -> [B, P, s] -> global row order [B, S, 1]
    ssqs = iter([jnp.concatenate([part[k] for part in ssq_parts], axis=-1).reshape(*lead, S, 1)
                 for k in range(ns)])
    return [(y, next(ssqs)) if q else y for y, q in zip(ys, sum_squares)]
