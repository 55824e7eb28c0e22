"""Matmul + reduce-scatter as one Pallas TPU kernel: a bidirectional ring, partial sums streamed in row chunks.

Called inside `jax.shard_map` over a ring axis of size P (`tp`). Every rank
holds one or two pairs whose products are partial sums over the ring (two:
FLUX's and HunyuanVideo's single-block `proj_out`, attention and MLP halves,
summed without concatenating their inputs); it returns its own rows of the
total. Each direction's partial sums move tile by tile, VMEM to VMEM by
remote DMA, in row chunks through a window of W slots (one chunk a half
wherever the accumulators fit: every released shape but the long videos);
the steps are one runtime loop. No partial product or concatenation reaches
HBM; `out` is written once. Weight tiles are DMA'd from `w_i.at[layer, :,
cols]` (a block scan passes the whole stack and its layer index, so no
weight-sized copy of the layer is made before the call).

    x_i      [B, S, k_i]    every row, this rank's k_i columns (leading dims folded into B)
    w_i      [L, k_i, N]    row shards (read at layer `layer`), N a multiple of 128
    bias     [N] or [L, N]  optional: added once, to the finished sums (the dispatch
                            passes none: a row-parallel bias is added after the call)
    out      [B, s, N]      rows [r s, (r+1) s) of sum_i x_i @ w_i (+ bias), summed over ranks

Layout and tiling (per rank; s = S/P, h = s/2 rows a half, hc rows a chunk,
W slots, NT = N / tn column tiles):

    VMEM  xbuf_i [2 parities, 2 B hc, k_i]    this step's and the next step's rows of x_i, flat:
                                               segment g = d B + b (direction d, batch b) holds
                                               rows [g hc, (g+1) hc), one DMA each
          wbuf_i [2, k_i, tn]                  weight tiles, double-buffered
          acc    [2 dirs, W slots, NT, B, hc, tn]  partial sums in flight: received from
                                               upstream, accumulated in place, sent on
          prod   [2 B hc, tn] f32              one column tile's products, summed over the pairs
          bbuf   [L_b, N]                      the bias rows (only with a bias)
    HBM   x_i, w_i, bias (inputs), out (output); memory_space ANY, explicit DMA
    SMEM  tables int32[2 + 2P]  (scalar prefetch: neighbours, shard rows; _common.ring_tables)
          layer  int32[1]
          sems   x DMA [pairs, 2 dirs, 2 parities] (B descriptors each, each waited), w DMA
                 [pairs, 2], recv DMA [2, W, NT] (per direction, slot, tile), send DMA [2],
                 out DMA [2], credit REGULAR [2] (free slots downstream), bias DMA [1]

The products take both directions' rows of every batch as ONE M operand: row
tiles (`_common.row_tiles(2 B hc, row_tile_limit, unit)`, in the plan's
`row_tiles`) run over the flat 2 B hc rows, one dot per (pair, row tile) per
column tile, so a tile may straddle a segment boundary (hc is a multiple of
the sublane rows, so every boundary is tile-aligned). The flat rows are split
at the segment boundaries only where the sums are added and stored into `acc`.

Ring (as `difflet_tpu.parallel.collective_matmul._rs_ring`): at hop j rank r adds its partial product for
the forward half of rank r-1-j and the backward half of rank r+1+j to the
sums that arrived from upstream and sends them on; at hop P-1 both are its
own rows and go to `out`. Here every half is cut into C chunks of hc rows
(`_common.StreamPlan` from a validated `_common.StreamBlocks`, fitted by
`_common.fit_stream`); chunk c starts at row min(c hc, h - hc) of its half,
so a ragged last chunk is shifted back and overlaps the one before (those
rows are reduced twice, in the same order: the same values, written twice).

Steps: t = c P + j, t = 0 .. PC-1 (one `lax.fori_loop`; c, j, slots and rows
are runtime values of t). Step t works on chunk c at hop j in slot t % W of
each direction:

    step t:  wait x rows of step t; load step t+1's
             [j < P-1, t+1-W >= 0] wait one credit per direction
             for column tile col (the weight stream runs on across steps):
               prod = sum_i xbuf_i (all 2 B hc rows) @ w_i tile, f32, one dot per (pair, row tile)
               per direction: [j > 0] wait tile col of slot t%W (sent by upstream at its step t-1)
                              acc[slot, col] = prod rows of d (+ acc[slot, col] if j > 0)
                                               (+ bias at j = P-1), f32, rounded once
                              [j < P-1] send acc[slot, col] -> downstream's acc[(t+1)%W, col]
                              [j = P-1] DMA acc[slot, col] -> out rows of chunk c
             wait this step's sends / out writes; signal a credit upstream if upstream fills slot t%W next

Why the products come first: they need only this rank's rows and the weight
tile, not the upstream sums, so they run while upstream's tile col is still
arriving, and the wait comes after them; only the adds, the rounding and the
send wait on it. What it changes: the forward direction's send of tile col
now starts after BOTH directions' dots (before, it started after the forward
dots only, and the backward dots overlapped it); the backward send starts
where it did. In exchange each column tile is one M operand of 2 B hc rows
per pair (fewer, taller dots, not split per direction and batch) and the
receive waits move behind the MXU work (not measured on a TPU).

Sums are formed in f32 and rounded to the dtype once per hop, as the JAX
ring does: the pairs' products are summed in f32 into
`prod`, then the received value (j > 0) and the bias (j = P-1) are added in
f32 and the result is rounded once (the float32 tests, on small integers, are
exact).

Credits (why a sender never overwrites a slot in use), as
kernels/all_gather_matmul_stream/: slot t % W is read and rewritten by step
t, then next filled for step t + W; if that step has j >= 1, upstream fills
it at its step t + W - 1 (if j = 0 this rank fills it itself, at step t + W,
in order). The receiver signals a REGULAR semaphore `credit[d]` on its
upstream (`pl.semaphore_signal(..., device_id=upstream)`) after step u iff
u + W < PC and (u + W) % P != 0; the sender waits one credit before the
first send of step s iff s + 1 - W >= 0. These pair up one to one (u = s + 1
- W) and both sides go in step order, so every semaphore is zero at exit. A
chunk boundary needs them: step (c+1, 0) waits for nobody, so a rank can
start sending chunk c+1's sums while its downstream still reads chunk c's.
W >= 2 cannot deadlock: the credit a sender waits for at step s is the
receiver's step s + 1 - W <= s - 1. Each (direction, slot, tile) has its own
receive semaphore (tiles of a slot arrive one by one; a later tile's bytes
must not satisfy an earlier tile's wait). `_skip_credit_at` (tests only)
removes one credit (the sender sends at that step without waiting, the
receiver does not signal it); at step P (chunk 1's first send) the race
detector flags the overwrite (tests/kernels/test_interpret.py). A barrier with both neighbours at entry
keeps anyone from writing (a tile or a credit) into a kernel instance that
has not started.

The weights stream once per step, i.e. P C times a call; x rows load once per
step (each rank reads 2 hc rows of every other rank's rows), one DMA per
(pair, direction, batch).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _common

COLLECTIVE_ID = 10  # each kernel its own barrier semaphore id (all_gather_matmul_stream: 9)


# --------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------

def _check(x_shapes, w_shapes, dtype, axis_size, bias):
    """(B, s, ks, N, unit, dtype) or one sentence why these shapes do not run."""
    dtype = jnp.dtype(dtype)
    reason = _common.dtype_reason(dtype)
    if reason:
        return reason
    x_shapes = [tuple(int(d) for d in s) for s in x_shapes]
    w_shapes = [tuple(int(d) for d in s) for s in w_shapes]
    if not 1 <= len(x_shapes) <= 2 or len(x_shapes) != len(w_shapes):
        return f"one or two (x, w) pairs, got {len(x_shapes)} x and {len(w_shapes)} w"
    if axis_size < 2:
        return "the ring needs at least 2 ranks"
    lead, rows = x_shapes[0][:-2], x_shapes[0][-2]
    N = w_shapes[0][-1]
    for xs, ws in zip(x_shapes, w_shapes):
        if len(xs) < 2 or xs[:-2] != lead or xs[-2] != rows or len(ws) != 2 or ws != (xs[-1], N):
            return f"pairs x {x_shapes}, w {w_shapes} do not share rows, batch and width"
    unit = _common.sublane_rows(dtype)
    if rows % (2 * axis_size) or (rows // (2 * axis_size)) % unit:
        return (f"each half of a rank's rows ({rows} / {2 * axis_size}) must be a whole multiple of "
                f"{unit} rows for {dtype.name} (pad the sequence to a multiple of {2 * unit * axis_size})")
    ks = [xs[-1] for xs in x_shapes]
    if any(k % _common.LANES for k in ks):
        return f"contraction widths {ks} are not all multiples of 128"
    if N % _common.LANES:
        return f"output width N = {N} is not a multiple of 128"
    if bias is not None and (not isinstance(bias[0], int) or bias[0] < 1):
        return f"bias rows {bias[0]!r} must be a positive int"
    B = 1
    for d in lead:
        B *= d
    return B, rows // axis_size, ks, N, unit, dtype


def plan(x_shapes, w_shapes, dtype, axis_size, *, blocks: _common.StreamBlocks | None = None, bias=None):
    """(reason, StreamPlan): reason None if the streaming kernel runs for these shapes.

    x_shapes [..., S, k_i] and w_shapes [k_i, N] per pair; bias: None or (rows,
    dtype) of the bias operand ([N]: 1 row; [L, N]: L); blocks: the block sizes
    asked (default `StreamBlocks()`: the largest chunk that fits, a window of 3)."""
    blocks = blocks or _common.StreamBlocks()
    checked = _check(x_shapes, w_shapes, dtype, axis_size, bias)
    if isinstance(checked, str):
        return checked, None
    B, s, ks, N, unit, dtype = checked

    def candidates(hc):
        for tn in _common.column_tile_candidates([N], blocks.col_tile_limit):
            # both directions' rows of every batch as one M operand: 2 B segments of hc rows
            tiles = _common.row_tiles(2 * B * hc, blocks.row_tile_limit, unit)
            tm = max(sz for _, sz in tiles)
            bufs = [_common.buffer(f"xbuf_{i}", (2, 2 * B * hc, k), dtype) for i, k in enumerate(ks)]
            bufs += [_common.buffer(f"wbuf_{i}", (2, k, tn), dtype) for i, k in enumerate(ks)]
            bufs.append(_common.buffer("acc", (2, blocks.window, N // tn, B, hc, tn), dtype))
            bufs.append(_common.buffer("prod", (2 * B * hc, tn), jnp.float32))
            if bias is not None:
                bufs.append(_common.buffer("bbuf", (bias[0], N), bias[1]))
            tks = [_common.depth_tile(k, blocks.depth_tile_limit) for k in ks]
            bufs += [
                # values Mosaic materialises per dot: x row pieces, weight tiles, f32 products and sum
                _common.buffer("dot operands", (sum(tm * tk + tk * tn for tk in tks),), dtype),
                _common.buffer("f32 acc", (2, tm, tn), jnp.float32),
            ]
            yield _common.VmemPlan(tuple(bufs)), (tn, tiles)

    return _common.fit_stream(s // 2, unit, blocks, candidates,
                              f"full-width partial sums in {blocks.window} slots per direction")


def ici_bound(k: int, itemsize: int, chip) -> bool:
    """Whether a ring hop of this kernel waits on ICI rather than on the MXU on `chip`
    (a `difflet_tpu.parallel.chips.Chip`), for pairs of total width `k` (sum of k_i).

    Per hop the kernel multiplies both halves, 2 * B * s * k * N flops, while each
    direction sends one half's sums, B * h * N * itemsize bytes over one link
    (h = s/2): the hop is ICI-bound when 4 k / peak < itemsize / link bandwidth,
    i.e. bf16 k < 2189 on v5e (Wan's attention outputs, k = 1280 per chip at P = 4;
    not its FFN down, k = 3456). The reference PR measured its kernel on a v5e-4
    faster than the JAX ring there (Wan attention out 0.518 -> 0.504 ms) and slower
    where compute-bound (Wan FFN down 0.928 -> 1.040 ms), so `Config.sp_rs_kernel`
    "auto" takes the kernel exactly where this is True.
    """
    return 4 * k / chip.bf16_flops < itemsize / chip.ici_link_bw


def unsupported_reason(x_shapes, w_shapes, dtype, axis_size, *, blocks=None, bias=None) -> str | None:
    """None if `matmul_reduce_scatter_stream` runs for these shapes, else one sentence why not."""
    return plan(x_shapes, w_shapes, dtype, axis_size, blocks=blocks, bias=bias)[0]


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

def _kernel(tables, layer, *refs, axis_name, P, B, h, hc, C, W, npairs, nt, tn, tks, tiles, unit, bias_stacked,
            skip_credit_at):
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]
    has_bias = bias_stacked is not None
    x_hbm, w_hbm, b_hbm = take(npairs), take(npairs), take(int(has_bias))
    (out_hbm,) = take(1)
    xbuf, wbuf = take(npairs), take(npairs)
    acc, prod = take(2)
    bbuf = take(int(has_bias))
    x_sem, w_sem, recv_sem, send_sem, o_sem, credit, b_sem = refs
    T = P * C
    nbr = (tables[0], tables[1])  # downstream per direction: forward r+1, backward r-1
    upstream = (tables[1], tables[0])

    def chunk0(c):  # first row of chunk c within its half (the last one shifted back to end at h)
        return jnp.minimum(c * hc, h - hc)

    def src_row(t, d):  # first row of x for step t's chunk in direction d
        j, c = t % P, t // P
        if d == 0:  # forward: rank r-1-j's half [0, h)
            return pl.multiple_of(tables[2 + (j + 1) % P] + chunk0(c), unit)
        return pl.multiple_of(tables[2 + P + (j + 1) % P] + h + chunk0(c), unit)  # backward: rank r+1+j's [h, s)

    def x_copies(i, t, d):  # step t's rows of x_i in direction d: one DMA per batch b, into segment d B + b
        row = src_row(t, d)
        return [pltpu.make_async_copy(x_hbm[i].at[b, pl.ds(row, hc)],
                                      xbuf[i].at[t % 2, pl.ds((d * B + b) * hc, hc)], x_sem.at[i, d, t % 2])
                for b in range(B)]

    # The flat row tiles cut at the segment boundaries, per direction: (b, first row in the
    # segment, first flat row, rows), static; each piece lies in one segment.
    pieces = [[], []]
    for r0, tm in tiles:
        for g in range(2 * B):
            lo, hi = max(r0, g * hc), min(r0 + tm, (g + 1) * hc)
            if lo < hi:
                pieces[g // B].append((g % B, lo - g * hc, lo, hi - lo))

    def w_copy(i, col, par):
        c0 = pl.multiple_of(col * tn, tn)
        return pltpu.make_async_copy(w_hbm[i].at[layer[0], :, pl.ds(c0, tn)], wbuf[i].at[par], w_sem.at[i, par])

    def send(t, d, col):  # step t's tile col -> the downstream neighbour's slot (t + 1) % W (its step t + 1)
        return pltpu.make_async_remote_copy(acc.at[d, t % W, col], acc.at[d, (t + 1) % W, col], send_sem.at[d],
                                            recv_sem.at[d, (t + 1) % W, col], device_id={axis_name: nbr[d]})

    def o_copy(t, d, col):  # a finished tile (j = P-1) -> this rank's rows of chunk t // P in half d
        row = pl.multiple_of(d * h + chunk0(t // P), unit)
        c0 = pl.multiple_of(col * tn, tn)
        return pltpu.make_async_copy(acc.at[d, t % W, col], out_hbm.at[:, pl.ds(row, hc), pl.ds(c0, tn)],
                                     o_sem.at[d])

    # Step 0's rows, the bias rows and the first weight tiles, at once.
    bias_rows = [pltpu.make_async_copy(b_hbm[0], bbuf[0], b_sem.at[0])] if has_bias else []
    for i in range(npairs):
        for d in (0, 1):
            for cp in x_copies(i, 0, d):
                cp.start()
        w_copy(i, 0, 0).start()
    for cp in bias_rows:
        cp.start()

    _common.neighbour_barrier(axis_name, nbr)
    for cp in bias_rows:
        cp.wait()

    def step(t, carry):
        j = t % P
        slot = t % W
        xpar = t % 2
        for i in range(npairs):
            for d in (0, 1):
                for cp in x_copies(i, t, d):
                    cp.wait()

        @pl.when(t + 1 < T)  # the next step's rows load during this one (their buffer's user, t-1, is done)
        def _():
            for i in range(npairs):
                for d in (0, 1):
                    for cp in x_copies(i, t + 1, d):
                        cp.start()

        @pl.when((j < P - 1) & _common.credit_needed(t, W, skip_credit_at))
        def _():
            for d in (0, 1):
                pl.semaphore_wait(credit.at[d], 1)

        def body(col, carry):
            u = t * nt + col  # the weight stream's global tile index
            par = u % 2
            for i in range(npairs):
                w_copy(i, col, par).wait()

            @pl.when((col + 1 < nt) | (t + 1 < T))
            def _():
                for i in range(npairs):
                    w_copy(i, (col + 1) % nt, 1 - par).start()

            # This rank's products first, both directions' rows and every batch as one M
            # operand (they need only local rows, so they overlap the upstream tile's
            # arrival), summed over the pairs and the depth chunks in f32 in prod, kept
            # in f32 until the hop's sum. A pair's depth k_i goes in chunks of tk_i
            # (a fori_loop: one chunk's dots are the code, not every (tm, k_i) dot).
            for i in range(npairs):
                def depth_chunk(kk, carry, i=i):
                    k0 = pl.multiple_of(kk * tks[i], tks[i])
                    w = wbuf[i][par, pl.ds(k0, tks[i]), :]
                    for r0, tm in tiles:
                        p = jnp.dot(xbuf[i][xpar, pl.ds(r0, tm), pl.ds(k0, tks[i])], w,
                                    preferred_element_type=jnp.float32)
                        first = (kk == 0) if i == 0 else False  # the first product a column tile writes
                        prod[pl.ds(r0, tm), :] = jnp.where(first, p, prod[pl.ds(r0, tm), :] + p)
                    return carry

                n_chunks = xbuf[i].shape[-1] // tks[i]
                if n_chunks == 1:
                    depth_chunk(0, 0)
                else:
                    lax.fori_loop(0, n_chunks, depth_chunk, 0)

            bias = None
            if has_bias:  # this column tile of the bias row, float32 [1, tn], at the last hop only
                c0 = pl.multiple_of(col * tn, tn)
                rows = bbuf[0][:, pl.ds(c0, tn)].astype(jnp.float32)
                if bias_stacked:  # row `layer`: a masked sum (exact: one term is non-zero)
                    pick = lax.broadcasted_iota(jnp.int32, rows.shape, 0) == layer[0]
                    rows = jnp.sum(jnp.where(pick, rows, 0.0), axis=0, keepdims=True)
                bias = jnp.where(j == P - 1, rows, 0.0)
            for d in (0, 1):
                @pl.when(j > 0)
                def _():
                    send(t - 1, d, col).wait_recv()

                for b, lo, f0, n in pieces[d]:
                    y = prod[pl.ds(f0, n), :]
                    prev = acc[d, slot, col, b, pl.ds(lo, n), :].astype(jnp.float32)
                    y = y + jnp.where(j > 0, prev, 0.0)  # j = 0: the slot holds an old chunk
                    if bias is not None:
                        y = y + bias
                    acc[d, slot, col, b, pl.ds(lo, n), :] = y.astype(acc.dtype)  # rounded once a hop

                @pl.when(j < P - 1)
                def _():
                    send(t, d, col).start()

                @pl.when(j == P - 1)
                def _():
                    o_copy(t, d, col).start()
            return carry

        lax.fori_loop(0, nt, body, 0)

        # This step's tiles are out (waits count bytes: one per tile, any tile's descriptor).
        @pl.when(j < P - 1)
        def _():
            def wait_sends(col, carry):
                for d in (0, 1):
                    send(t, d, 0).wait_send()
                return carry

            lax.fori_loop(0, nt, wait_sends, 0)

        @pl.when(j == P - 1)
        def _():
            def wait_out(col, carry):
                for d in (0, 1):
                    o_copy(t, d, 0).wait()
                return carry

            lax.fori_loop(0, nt, wait_out, 0)

        # Slot t % W is free (read, rewritten, sent): a credit upstream if upstream fills it next.
        _common.signal_credit(t, W, T, P, credit, upstream, axis_name, skip_credit_at)
        return carry

    lax.fori_loop(0, T, step, 0)


def matmul_reduce_scatter_stream(pairs, *, layer=None, bias=None, axis_name="tp",
                                 blocks: _common.StreamBlocks | None = None, interpret=False,
                                 _skip_credit_at=None):
    """This rank's rows of `sum_i x_i @ w_i`, reduced over `axis_name`.

    Args:
      pairs: one or two `(x_i [..., S, K_i/P], w_i [K_i/P, N])`; with `layer`,
        w_i stacked `[L, K_i/P, N]`.
      layer: the layer to read from stacked weights (an int32 scalar, may be
        traced, e.g. a block scan's index); None for `[K_i/P, N]` weights.
      bias: None, `[N]`, or with `layer` a stacked `[L, N]` read at `layer`:
        added once, to the finished sums.
      blocks: the block sizes asked (chunk rows, window, tile limits),
        validated and fitted to VMEM (`plan`); default `StreamBlocks()`.
      interpret: False (Mosaic), True (TPU interpret mode) or a
        `pltpu.InterpretParams` (e.g. with detect_races=True).
      _skip_credit_at: tests only: a step whose send goes without its credit
        (the deliberately racy variant; see the module docstring).

    Returns:
      `[..., S/P, N]`.
    """
    pairs = [(x, w) for x, w in pairs]
    xs, ws = [x for x, _ in pairs], [w for _, w in pairs]
    stacked_layer = layer is not None
    if layer is None:
        ws, layer = [w[None] for w in ws], 0
    if any(w.ndim != 3 for w in ws) or len({w.shape[0] for w in ws}) != 1:
        raise ValueError(f"matmul_reduce_scatter_stream kernel: stacked weights [L, k_i, N] of one L, got "
                         f"{[w.shape for w in ws]}")
    dtype = xs[0].dtype
    if any(a.dtype != dtype for a in xs + ws):
        raise ValueError("matmul_reduce_scatter_stream kernel: all inputs must share one dtype")
    N = ws[0].shape[-1]
    bias_stacked = None
    if bias is not None:
        if bias.ndim == 1 and bias.shape == (N,):
            bias_stacked = False
        elif stacked_layer and bias.ndim == 2 and bias.shape[1] == N:
            bias_stacked = True
        else:
            raise ValueError(f"matmul_reduce_scatter_stream kernel: bias {bias.shape} for width {N}")
    P = lax.axis_size(axis_name)
    blocks = blocks or _common.StreamBlocks()
    reason, sp = plan([x.shape for x in xs], [w.shape[1:] for w in ws], dtype, P, blocks=blocks,
                      bias=None if bias is None else (bias.size // N, bias.dtype))
    if reason:
        raise ValueError(f"matmul_reduce_scatter_stream kernel: {reason}")
    B, lead = _common.fold_batch(xs[0].shape)
    S = xs[0].shape[-2]
    s = S // P
    h, hc, C, W, tn = s // 2, sp.chunk_rows, sp.chunks, sp.window, sp.col_tile
    nt = N // tn
    ks = [x.shape[-1] for x in xs]
    x3 = [x.reshape(B, S, x.shape[-1]) for x in xs]
    ws = [_common.in_hbm(w) for w in ws]
    bias_ops = [] if bias is None else [bias.reshape(-1, N)]
    tables = _common.ring_tables(axis_name, s)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    npairs = len(pairs)
    itemsize = jnp.dtype(dtype).itemsize
    rows = 2 * C * hc  # rows a rank reduces per hop (the overlap included)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, axis_name=axis_name, P=P, B=B, h=h, hc=hc, C=C, W=W, npairs=npairs,
                               nt=nt, tn=tn, tks=tuple(_common.depth_tile(k, blocks.depth_tile_limit) for k in ks),
                               tiles=sp.row_tiles, unit=_common.sublane_rows(dtype),
                               bias_stacked=bias_stacked, skip_credit_at=_skip_credit_at)
    cost = pl.CostEstimate(
        flops=2 * B * P * rows * sum(ks) * N + B * P * rows * N * npairs,
        transcendentals=0,
        # every step's rows of x once, every weight tile once per step, this rank's rows of out once
        bytes_accessed=itemsize * (B * P * rows * sum(ks) + P * C * sum(ks) * N + B * rows * N),
    )
    out = pl.pallas_call(
        kernel,
        out_shape=_common.out_struct((B, s, N), dtype, xs[0]),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            in_specs=[any_spec] * (2 * npairs + len(bias_ops)),
            out_specs=any_spec,
            scratch_shapes=[
                *[pltpu.VMEM((2, 2 * B * hc, k), dtype) for k in ks],    # xbuf_i: parity, segment d B + b
                *[pltpu.VMEM((2, k, tn), dtype) for k in ks],             # wbuf_i
                pltpu.VMEM((2, W, nt, B, hc, tn), dtype),                 # acc: the window of partial sums
                pltpu.VMEM((2 * B * hc, tn), jnp.float32),                # prod: a column tile's products
                *[pltpu.VMEM(b.shape, b.dtype) for b in bias_ops],        # bbuf
                pltpu.SemaphoreType.DMA((npairs, 2, 2)),                  # x_sem: pair, dir, parity
                pltpu.SemaphoreType.DMA((npairs, 2)),                     # w_sem: pair, buffer
                pltpu.SemaphoreType.DMA((2, W, nt)),                      # recv_sem: dir, slot, tile
                pltpu.SemaphoreType.DMA((2,)),                            # send_sem per direction
                pltpu.SemaphoreType.DMA((2,)),                            # o_sem per direction
                pltpu.SemaphoreType.REGULAR((2,)),                        # credit: slots freed downstream
                pltpu.SemaphoreType.DMA((1,)),                            # b_sem
            ],
        ),
        compiler_params=pltpu.CompilerParams(collective_id=COLLECTIVE_ID, vmem_limit_bytes=sp.vmem.limit),
        cost_estimate=cost,
        interpret=_common.interpret_params(interpret),
        name=f"matmul_reduce_scatter_stream_{C}chunks_{hc}rows",  # difflet_tpu.tools.estimate prices it by steps
    )(tables, layer, *x3, *ws, *bias_ops)
    return out.reshape(*lead, s, N)
