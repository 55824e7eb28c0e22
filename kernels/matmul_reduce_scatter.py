"""Matmul + reduce-scatter as one Pallas TPU kernel (bidirectional ring, tile by tile).

Called inside `jax.shard_map` over a ring axis of size P (`tp`). Every rank
holds one or two pairs whose products are partial sums over the ring; it
returns its own rows of the total:

    x_i      [B, S, k_i]    every row, this rank's k_i = K_i/P columns (leading dims -> B)
    w_i      [L, k_i, N]    row shards of L stacked layers (a plain [k_i, N] is
                            L = 1), N a multiple of 128; the kernel reads layer
                            `layer` only
    out      [B, s, N]      rows [r*s, (r+1)*s) of sum_i x_i @ w_i summed over ranks, s = S/P

Ring (as `difflet_tpu.collective_matmul._rs_ring`): rank r's rows split into
a forward half [0, h) and a backward half [h, s), h = s/2. At hop j = 0..P-1
rank r computes the forward partial sum for rank r-1-j (its rows [0, h)) and
the backward one for rank r+1+j (rows [h, s)), adds the accumulator that
arrived from upstream, and sends the sum on; at hop P-1 both are for r itself
and go straight to `out`. Sums are formed in f32 and rounded to the dtype
once per hop, as the JAX ring does.

Tile by tile: every (hop, column tile) step multiplies the hop's rows by one
column tile of each weight, adds the upstream accumulator's same tile in the
epilogue, and sends that tile on at once (remote DMA, VMEM to VMEM), so the
transfers of a hop overlap its own remaining tiles. No partial product and
no concatenation reaches HBM; `out` is written once.

Layout and tiling (per rank):

    VMEM  xrows_i [2 dirs, 2 hops, B, h, k_i]   this hop's and the next hop's rows of x_i
          wbuf_i  [2, k_i, tn]                  weight tiles, double-buffered per step
          recv    [2 dirs, R slots, NT, B, h, tn]  accumulators from upstream, R = 3
          sbuf    [2 dirs, 2, B, h, tn]         sums on their way out (send or `out`)
    HBM   x_i, w_i (inputs), out; memory_space ANY (w_i kept in HBM,
          `_common.in_hbm`), moved by explicit DMA
    SMEM  tables int32[2 + 2P] (scalar prefetch, see _common.ring_tables)
          layer  int32[1]       (scalar prefetch: weight tiles come from w_i.at[layer])

    step (j, c):  wait w tiles c, prefetch tiles of step+1
                  fwd: wait recv[f, j-1, c]; sbuf = sum_i xrows_i[f] @ w_i + recv; send -> r+1
                  bwd: wait recv[b, j-1, c]; sbuf = sum_i xrows_i[b] @ w_i + recv; send -> r-1
                  (hop P-1: sbuf -> out rows [0,h) / [h,s) instead of a send)

Weight tiles are DMA'd from `w_i.at[layer, :, cols]`: a block scan passes
the whole stack and its layer index, so no weight-sized copy of the layer is
made before the call.

Long sequences run in row chunks: when the buffers above (sized by the half,
h rows) do not fit VMEM, every rank's shard splits into C near-equal chunks
of whole tiles (`_common.row_chunks`, the fewest C that fit) and the ring
runs once per chunk, one call each: call c reduces rows [row0_c, row0_c +
2 h_c) of every rank's shard (x rows read at rank offset + row0_c) and writes
those rows of `out`, the previous call's output buffer passed in and aliased
(`input_output_aliases`), so no partial output is copied. Each call streams
the weight P times again (C x the weight traffic; at Wan 480x832x81, C = 3,
hidden under the MXU work by the estimate) and starts with its own barrier.
(The dispatch runs kernels/matmul_reduce_scatter_stream.py at every shape
instead, unless `collective_matmul.RS_KERNEL = "resident"`.)

Receive slots (R = 3): why a neighbour may run two hops ahead in one direction.
Upstream U's hop-j' tile c lands in our slot j' % R, tile c; we read it at
our step (j'+1, c). Within a step the forward half goes first, then the
backward half. U's forward send at (j', c) comes after U's backward wait at
its previous step, (j', c-1), i.e. after our backward send of (j'-1, c-1):
by then we have finished step (j'-2, *) for tile c and earlier, but may not
yet have read the forward tile c of step (j'-1, c), which sits in slot
(j'-2) % R. So slots j', j'-1 and j'-2 must be distinct: R = 3. Mirrored, our
downstream D's backward send at (j', c) follows D's forward wait at (j', c),
i.e. our forward send of (j'-1, c), made before we read the backward tile c of
step (j'-1, c) from slot (j'-2) % R: again three slots. Tiles of one slot
arrive one by one, so each (direction, slot, tile) has its own DMA semaphore:
a later tile's bytes can never satisfy an earlier tile's wait. With R = 2 the
race detector flags the overwrite (tests/kernels; `_recv_slots` is a private
knob for that test). A barrier with both neighbours at entry makes sure nobody
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
COLLECTIVE_ID = 8


# --------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------

def _plan(x_shapes, w_shapes, dtype, axis_size, *, recv_slots=RECV_SLOTS,
          col_tile_limit=DEFAULT_COLUMN_TILE_LIMIT, row_tile_limit=DEFAULT_ROW_TILE_LIMIT, chunks=None):
    """(reason, tn, row_tiles, VmemPlan, row chunks): reason is None if the kernel can run.

    `chunks`: how many row chunks per rank (one kernel call each,
    `_common.row_chunks`); None takes the fewest whose buffers fit VMEM. The
    buffers are sized for the largest chunk; `row_tiles` are its."""
    dtype = jnp.dtype(dtype)
    reason = _common.dtype_reason(dtype)
    if reason:
        return reason, None, None, None, None
    x_shapes = [tuple(int(d) for d in s) for s in x_shapes]
    w_shapes = [tuple(int(d) for d in s) for s in w_shapes]
    if not 1 <= len(x_shapes) <= 2 or len(x_shapes) != len(w_shapes):
        return f"one or two (x, w) pairs, got {len(x_shapes)} x and {len(w_shapes)} w", None, None, None, None
    if axis_size < 2:
        return "the ring needs at least 2 ranks", None, None, None, None
    lead, rows = x_shapes[0][:-2], x_shapes[0][-2]
    N = w_shapes[0][-1]
    for xs, ws in zip(x_shapes, w_shapes):
        if len(xs) < 2 or xs[:-2] != lead or xs[-2] != rows or len(ws) != 2 or ws != (xs[-1], N):
            return f"pairs x {x_shapes}, w {w_shapes} do not share rows, batch and width", None, None, None, None
    unit = _common.sublane_rows(dtype)
    if rows % (2 * axis_size) or (rows // (2 * axis_size)) % unit:
        return (f"each half of a rank's rows ({rows} / {2 * axis_size}) must be a whole multiple of "
                f"{unit} rows for {dtype.name} (pad the sequence to a multiple of {2 * unit * axis_size})"), \
            None, None, None, None
    ks = [xs[-1] for xs in x_shapes]
    if any(k % _common.LANES for k in ks):
        return f"contraction widths {ks} are not all multiples of 128", None, None, None, None
    if N % _common.LANES:
        return f"output width N = {N} is not a multiple of 128", None, None, None, None
    B = 1
    for d in lead:
        B *= d

    def candidates(h):
        for tn in _common.column_tile_candidates([N], col_tile_limit):
            nt = N // tn
            tiles = _common.row_tiles(h, row_tile_limit, unit)
            tm = max(sz for _, sz in tiles)
            bufs = [_common.buffer(f"xrows_{i}", (2, 2, B, h, k), dtype) for i, k in enumerate(ks)]
            bufs += [_common.buffer(f"wbuf_{i}", (2, k, tn), dtype) for i, k in enumerate(ks)]
            bufs += [
                _common.buffer("recv", (2, recv_slots, nt, B, h, tn), dtype),
                _common.buffer("sbuf", (2, 2, B, h, tn), dtype),
                # values Mosaic materialises per dot: x row pieces, weight tiles, f32 products and sum
                _common.buffer("dot operands", (sum(tm * k + k * tn for k in ks),), dtype),
                _common.buffer("f32 acc", (2, tm, tn), jnp.float32),
            ]
            yield _common.VmemPlan(tuple(bufs)), (tn, tiles)

    reason, extra, plan, pieces = _common.fit_chunks(
        rows // axis_size, unit, chunks, candidates, f"full-width accumulators in {recv_slots} slots per direction")
    tn, tiles = extra or (None, None)
    return reason, tn, tiles, plan, pieces


def unsupported_reason(x_shapes, w_shapes, dtype, axis_size) -> str | None:
    """None if `matmul_reduce_scatter` runs for these shapes, else one sentence why not."""
    return _plan(x_shapes, w_shapes, dtype, axis_size)[0]


def ici_bound(k: int, itemsize: int, chip) -> bool:
    """Whether a ring hop of this kernel waits on ICI rather than on the MXU on `chip`
    (a `difflet_tpu.estimate.Chip`), for pairs of total width `k` (sum of k_i).

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


def vmem_plan(x_shapes, w_shapes, dtype, axis_size) -> _common.VmemPlan | None:
    """The VMEM buffer plan (and requested scoped limit) for these shapes."""
    return _plan(x_shapes, w_shapes, dtype, axis_size)[3]


def chunks(x_shapes, w_shapes, dtype, axis_size) -> int | None:
    """How many row chunks per rank (kernel calls) the plan takes for these shapes."""
    pieces = _plan(x_shapes, w_shapes, dtype, axis_size)[4]
    return None if pieces is None else len(pieces)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

def _kernel(tables, layer, *refs, axis_name, P, B, h, row0, npairs, tn, nt, tiles, slots, unit, aliased):
    x_hbm = refs[:npairs]
    w_hbm = refs[npairs:2 * npairs]
    out_hbm = refs[2 * npairs + aliased]  # (the aliased input is the same buffer)
    scratch = refs[2 * npairs + 1 + aliased:]
    xrows = scratch[:npairs]
    wbuf = scratch[npairs:2 * npairs]
    recv, sbuf, x_sem, w_sem, recv_sem, s_sem = scratch[2 * npairs:]
    nbr = (tables[0], tables[1])  # forward (r+1), backward (r-1)
    total = P * nt

    def src_row(j, d):  # first row of x for hop j's half in direction d (this call's chunk)
        if d == 0:  # rank r-1-j, chunk rows [row0, row0 + h)
            return pl.multiple_of(tables[2 + (j + 1) % P] + row0, unit)
        return pl.multiple_of(tables[2 + P + (j + 1) % P] + row0 + h, unit)  # rank r+1+j, [row0 + h, row0 + 2h)

    def x_copy(i, j, d):
        return pltpu.make_async_copy(x_hbm[i].at[:, pl.ds(src_row(j, d), h)], xrows[i].at[d, j % 2],
                                     x_sem.at[i, d, j % 2])

    def w_copy(i, c, par):
        col = pl.multiple_of(c * tn, tn)
        return pltpu.make_async_copy(w_hbm[i].at[layer[0], :, pl.ds(col, tn)], wbuf[i].at[par],
                                     w_sem.at[i, par])

    def send(j, d, c, par):  # hop j's tile c in direction d -> neighbour's slot j
        return pltpu.make_async_remote_copy(sbuf.at[d, par], recv.at[d, j % slots, c], s_sem.at[d, par],
                                            recv_sem.at[d, j % slots, c], device_id={axis_name: nbr[d]})

    def o_copy(d, c, par):
        col = pl.multiple_of(c * tn, tn)
        return pltpu.make_async_copy(sbuf.at[d, par], out_hbm.at[:, pl.ds(row0 + d * h, h), pl.ds(col, tn)],
                                     s_sem.at[d, par])

    def wait_out(t, d, c, par):  # waits for sbuf[d, par]'s DMA of step t (a send, or the write to out)
        if t // nt < P - 1:
            send(t // nt, d, c, par).wait_send()
        else:
            o_copy(d, c, par).wait()

    for i in range(npairs):
        for d in (0, 1):
            x_copy(i, 0, d).start()
        w_copy(i, 0, 0).start()

    barrier = pltpu.get_barrier_semaphore()
    for d in (0, 1):
        pl.semaphore_signal(barrier, 1, device_id={axis_name: nbr[d]})
    pl.semaphore_wait(barrier, 2)

    for j in range(P):
        for i in range(npairs):
            for d in (0, 1):
                x_copy(i, j, d).wait()
        if j + 1 < P:  # next hop's rows load during this hop
            for i in range(npairs):
                for d in (0, 1):
                    x_copy(i, j + 1, d).start()

        def body(c, carry, j=j):
            t = j * nt + c
            par = t % 2
            for i in range(npairs):
                w_copy(i, c, par).wait()
            nxt = (c + 1) % nt if j + 1 < P else c + 1

            @pl.when(t + 1 < total)
            def _():
                for i in range(npairs):
                    w_copy(i, nxt, 1 - par).start()

            # sbuf[., par] went out two steps ago: in this hop (c >= 2; the last hop writes `out`)
            # or an earlier one (always a send).
            @pl.when(c >= 2)
            def _():
                for d in (0, 1):
                    wait_out(j * nt, d, c, par)

            if j > 0:
                @pl.when((c < 2) & (t >= 2))
                def _():
                    for d in (0, 1):
                        wait_out(0, d, c, par)

            for d in (0, 1):
                if j > 0:
                    send(j - 1, d, c, par).wait_recv()
                for b in range(B):
                    for r0, tm in tiles:
                        acc = None
                        for i in range(npairs):
                            y = jnp.dot(xrows[i][d, j % 2, b, pl.ds(r0, tm), :], wbuf[i][par],
                                        preferred_element_type=jnp.float32)
                            acc = y if acc is None else acc + y
                        if j > 0:
                            acc = acc + recv[d, (j - 1) % slots, c, b, pl.ds(r0, tm), :].astype(jnp.float32)
                        sbuf[d, par, b, pl.ds(r0, tm), :] = acc.astype(sbuf.dtype)
                if j < P - 1:
                    send(j, d, c, par).start()
                else:
                    o_copy(d, c, par).start()
            return carry

        lax.fori_loop(0, nt, body, 0)

    for t in range(max(0, total - 2), total):
        for d in (0, 1):
            wait_out(t, d, t % nt, t % 2)


def matmul_reduce_scatter(pairs, *, layer=None, axis_name="tp", interpret=False,
                          _recv_slots=RECV_SLOTS, _col_tile_limit=DEFAULT_COLUMN_TILE_LIMIT,
                          _row_tile_limit=DEFAULT_ROW_TILE_LIMIT, _chunks=None):
    """This rank's rows of `sum_i x_i @ w_i`, reduced over `axis_name`.

    Args:
      pairs: one or two `(x_i [..., S, K_i/P], w_i [K_i/P, N])`; with `layer`,
        w_i stacked `[L, K_i/P, N]`.
      layer: the layer to read from stacked weights (an int32 scalar, may be
        traced, e.g. a block scan's index); None for `[K_i/P, N]` weights.
      interpret: False (Mosaic), True (TPU interpret mode) or a
        `pltpu.InterpretParams` (e.g. with detect_races=True).

    Returns:
      `[..., S/P, N]`.
    """
    pairs = [(x, w) for x, w in pairs]
    xs, ws = [x for x, _ in pairs], [w for _, w in pairs]
    if layer is None:  # one layer: [k, N] -> [1, k, N], a free reshape
        ws, layer = [w[None] for w in ws], 0
    if any(w.ndim != 3 for w in ws) or len({w.shape[0] for w in ws}) != 1:
        raise ValueError(f"matmul_reduce_scatter kernel: stacked weights [L, k_i, N] of one L, got "
                         f"{[w.shape for w in ws]}")
    dtype = xs[0].dtype
    if any(a.dtype != dtype for a in xs + ws):
        raise ValueError("matmul_reduce_scatter kernel: all inputs must share one dtype")
    P = lax.axis_size(axis_name)
    reason, tn, _, plan, pieces = _plan([x.shape for x in xs], [w.shape[1:] for w in ws], dtype, P,
                                        recv_slots=_recv_slots, col_tile_limit=_col_tile_limit,
                                        row_tile_limit=_row_tile_limit, chunks=_chunks)
    if reason:
        raise ValueError(f"matmul_reduce_scatter kernel: {reason}")
    B, lead = _common.fold_batch(xs[0].shape)
    S, N = xs[0].shape[-2], ws[0].shape[-1]
    s = S // P
    nt = N // tn
    ks = [x.shape[-1] for x in xs]
    x3 = [x.reshape(B, S, x.shape[-1]) for x in xs]
    ws = [_common.in_hbm(w) for w in ws]
    tables = _common.ring_tables(axis_name, s)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    npairs = len(pairs)
    unit = _common.sublane_rows(dtype)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    itemsize = jnp.dtype(dtype).itemsize
    out = None
    for row0, cs in pieces:
        # One call per row chunk (one, unless a long sequence's buffers would not fit
        # VMEM): rows [row0, row0 + cs) of every rank's shard, halves of h rows; the
        # call writes those rows of `out`, the previous call's output passed in and
        # aliased (no copy).
        h = cs // 2
        aliased = int(out is not None)
        cost = pl.CostEstimate(
            flops=2 * B * P * cs * sum(ks) * N + B * P * cs * N * (npairs - 1) + B * (P - 1) * cs * N,
            transcendentals=0,
            # the chunk's rows of x once, every weight tile once per hop, its rows of out once.
            bytes_accessed=itemsize * (B * P * cs * sum(ks) + P * sum(ks) * N + B * cs * N),
        )
        scratch = [
            *[pltpu.VMEM((2, 2, B, h, k), dtype) for k in ks],         # xrows_i
            *[pltpu.VMEM((2, k, tn), dtype) for k in ks],              # wbuf_i
            pltpu.VMEM((2, _recv_slots, nt, B, h, tn), dtype),         # recv
            pltpu.VMEM((2, 2, B, h, tn), dtype),                       # sbuf
            pltpu.SemaphoreType.DMA((npairs, 2, 2)),                   # x_sem: pair, dir, hop parity
            pltpu.SemaphoreType.DMA((npairs, 2)),                      # w_sem: pair, buffer
            pltpu.SemaphoreType.DMA((2, _recv_slots, nt)),             # recv_sem: dir, slot, tile
            pltpu.SemaphoreType.DMA((2, 2)),                           # s_sem: dir, sbuf
        ]
        kernel = functools.partial(_kernel, axis_name=axis_name, P=P, B=B, h=h, row0=row0, npairs=npairs,
                                   tn=tn, nt=nt, tiles=_common.row_tiles(h, _row_tile_limit, unit),
                                   slots=_recv_slots, unit=unit, aliased=aliased)
        out = pl.pallas_call(
            kernel,
            out_shape=_common.out_struct((B, s, N), dtype, xs[0]),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                in_specs=[any_spec] * (2 * npairs + aliased),
                out_specs=any_spec,
                scratch_shapes=scratch,
            ),
            input_output_aliases={2 + 2 * npairs: 0} if aliased else {},
            compiler_params=pltpu.CompilerParams(collective_id=COLLECTIVE_ID, vmem_limit_bytes=plan.limit),
            cost_estimate=cost,
            interpret=_common.interpret_params(interpret),
            name="matmul_reduce_scatter" if len(pieces) == 1 else f"matmul_reduce_scatter_{len(pieces)}chunks",
        )(tables, layer, *x3, *ws, *([out] if aliased else []))
    return out.reshape(*lead, s, N)
