"""All-gather + matmul as one Pallas TPU kernel (bidirectional ring, VMEM resident).

Called inside `jax.shard_map` over a ring axis of size P (`tp`). Every rank
holds `x`, its `s = S/P` rows of the sequence, and column shards of one or more
weights; it returns, per weight, every row of the sequence times its columns:

    x        [B, s, K]      this rank's rows (leading dims folded into B)
    w_i      [L, K, n_i]    column shards of L stacked layers (a plain [K, n_i]
                            is L = 1), n_i multiples of 128, widths may differ;
                            the kernel reads layer `layer` only
    out_i    [B, S, n_i]    rows in global order (rank q's rows at [q*s, (q+1)*s))

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
    HBM   x, w_i (inputs), out_i (outputs); memory_space ANY (w_i kept in HBM,
          `_common.in_hbm`), moved by explicit DMA
    SMEM  tables int32[2 + 2P] (scalar prefetch, see _common.ring_tables)
          layer  int32[1]       (scalar prefetch: weight tiles come from w_i.at[layer])

Weight tiles are DMA'd from `w_i.at[layer, :, cols]`: a block scan passes
the whole stack and its layer index, so no weight-sized copy of the layer is
made before the call.

One weight-tile stream runs over every (hop, weight, column tile) step t: tile
t+1 loads (HBM -> wbuf[(t+1)%2]) while tile t is multiplied with both halves;
the products go out (obuf[t%2] -> out_i) while step t+1 computes. A column
tile tn (a multiple of 128 dividing every n_i) is common to all weights. Row
tiles: each half is multiplied in a few static row pieces (multiples of the
dtype's sublane count, at most `max_row_tile` rows) to bound the f32 results.

    hop j:  wait recv(j) ─┬─ send slot j -> neighbours' slot j+1 (remote DMA) ─┐
                          └─ for (weight, column tile):                         │
                               wait w tile, prefetch next w tile,              │
                               obuf <- xbuf[., slot j] @ wbuf, DMA -> out rows  │
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
COLLECTIVE_ID = 7


# --------------------------------------------------------------------------
# Plan: tiles and the VMEM each buffer takes
# --------------------------------------------------------------------------

def _plan(x_shape, widths, dtype, axis_size, *, recv_slots=RECV_SLOTS,
          col_tile_limit=DEFAULT_COLUMN_TILE_LIMIT, row_tile_limit=DEFAULT_ROW_TILE_LIMIT):
    """(reason, tn, row_tiles, VmemPlan): reason is None if the kernel can run."""
    dtype = jnp.dtype(dtype)
    reason = _common.dtype_reason(dtype)
    if reason:
        return reason, None, None, None
    if len(x_shape) < 2:
        return f"x must be [..., rows, K], got {tuple(x_shape)}", None, None, None
    if axis_size < 2:
        return "the ring needs at least 2 ranks", None, None, None
    B, _ = _common.fold_batch(x_shape)
    s, K = int(x_shape[-2]), int(x_shape[-1])
    unit = _common.sublane_rows(dtype)
    if s % 2 or (s // 2) % unit:
        return (f"each half of this rank's {s} rows must be a multiple of {unit} rows for {dtype.name} "
                f"(pad the sequence to a multiple of {2 * unit * axis_size})"), None, None, None
    if K % _common.LANES:
        return f"K = {K} is not a multiple of 128", None, None, None
    if not widths or any(int(n) % _common.LANES or int(n) <= 0 for n in widths):
        return f"weight widths {list(widths)} are not all positive multiples of 128", None, None, None
    h = s // 2
    cap = _common.vmem_capacity_bytes()
    plan = None
    for tn in _common.column_tile_candidates(widths, col_tile_limit):
        tiles = _common.row_tiles(h, row_tile_limit, unit)
        tm = max(sz for _, sz in tiles)
        plan = _common.VmemPlan((
            _common.buffer("xbuf", (2, recv_slots, B, h, K), dtype),
            _common.buffer("wbuf", (2, K, tn), dtype),
            _common.buffer("obuf", (2, 2, B, h, tn), dtype),
            # values Mosaic materialises per dot: the x row piece, the weight tile, the f32 result
            _common.buffer("dot operands", (tm * K + K * tn,), dtype),
            _common.buffer("f32 result", (tm, tn), jnp.float32),
        ))
        if plan.limit <= cap:
            return None, tn, tiles, plan
    return (f"VMEM budget exceeded: {plan.limit / 2**20:.1f} MiB needed (halves resident in "
            f"{recv_slots} slots per direction) > {cap / 2**20:.0f} MiB on this chip"), None, None, plan


def unsupported_reason(x_shape, widths, dtype, axis_size) -> str | None:
    """None if `all_gather_matmul` runs for these shapes, else one sentence why not."""
    return _plan(x_shape, list(widths), dtype, axis_size)[0]


def vmem_plan(x_shape, widths, dtype, axis_size) -> _common.VmemPlan | None:
    """The VMEM buffer plan (and requested scoped limit) for these shapes."""
    return _plan(x_shape, list(widths), dtype, axis_size)[3]


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

def _kernel(tables, layer, x_hbm, *refs, axis_name, P, B, h, K, widths, tn, tiles, slots, unit):
    nw = len(widths)
    w_hbm, out_hbm = refs[:nw], refs[nw:2 * nw]
    xbuf, wbuf, obuf, x_sem, recv_sem, send_sem, w_sem, o_sem = refs[2 * nw:]
    ncols = [n // tn for n in widths]
    steps_per_hop = sum(ncols)
    total_steps = P * steps_per_hop
    nbr = (tables[0], tables[1])  # forward (r+1), backward (r-1)

    def row(j, d):  # first output row of the half held at hop j in direction d
        if d == 0:
            return pl.multiple_of(tables[2 + j], unit)
        return pl.multiple_of(tables[2 + P + j] + h, unit)

    def send(j, d):  # hop j's half in direction d -> the neighbour's slot for hop j+1
        src = x_hbm.at[:, pl.ds(d * h, h)] if j == 0 else xbuf.at[d, j % slots]
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

    # Own halves into slot 0 (local DMA) and the first weight tile, at once.
    local = [pltpu.make_async_copy(x_hbm.at[:, pl.ds(d * h, h)], xbuf.at[d, 0], x_sem.at[d]) for d in (0, 1)]
    for cp in local:
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
            for cp in local:
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

            def body(c, carry, i=i, base=base, nxt=nxt, slot=slot, j=j):
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

                w = wbuf[par]
                for d in (0, 1):
                    for b in range(B):
                        for r0, tm in tiles:
                            y = jnp.dot(xbuf[d, slot, b, pl.ds(r0, tm), :], w,
                                        preferred_element_type=jnp.float32)
                            obuf[par, d, b, pl.ds(r0, tm), :] = y.astype(obuf.dtype)
                for d in (0, 1):
                    o_copy(i, j, d, c, par).start()
                return carry

            lax.fori_loop(0, ncols[i], body, 0)

        if j < P - 1:
            for d in (0, 1):
                send(j, d).wait_send()

    # Drain the last two steps' output DMAs (waits only count bytes: any tile of that size).
    for t in range(max(0, total_steps - 2), total_steps):
        for d in (0, 1):
            o_copy(0, 0, d, 0, t % 2).wait()


def all_gather_matmul(x, weights, *, layer=None, axis_name="tp", interpret=False,
                      _recv_slots=RECV_SLOTS, _col_tile_limit=DEFAULT_COLUMN_TILE_LIMIT,
                      _row_tile_limit=DEFAULT_ROW_TILE_LIMIT):
    """Gathers `x` over `axis_name` while multiplying it by each weight.

    Args:
      x: this rank's rows `[..., S/P, K]`.
      weights: column shards `[K, N_i/P]`; with `layer`, stacked `[L, K, N_i/P]`.
      layer: the layer to read from stacked weights (an int32 scalar, may be
        traced, e.g. a block scan's index); None for `[K, N_i/P]` weights.
      interpret: False (Mosaic), True (TPU interpret mode) or a
        `pltpu.InterpretParams` (e.g. with detect_races=True).

    Returns:
      One `[..., S, N_i/P]` array per weight, rows in global order.
    """
    weights = list(weights)
    if layer is None:  # one layer: [K, n] -> [1, K, n], a free reshape
        weights, layer = [w[None] for w in weights], 0
    if any(w.ndim != 3 for w in weights) or len({w.shape[0] for w in weights}) != 1:
        raise ValueError(f"all_gather_matmul kernel: stacked weights [L, K, n_i] of one L, got "
                         f"{[w.shape for w in weights]}")
    widths = [int(w.shape[2]) for w in weights]
    P = lax.axis_size(axis_name)
    reason, tn, tiles, plan = _plan(x.shape, widths, x.dtype, P, recv_slots=_recv_slots,
                                    col_tile_limit=_col_tile_limit, row_tile_limit=_row_tile_limit)
    if reason:
        raise ValueError(f"all_gather_matmul kernel: {reason}")
    for w in weights:
        if w.shape[1] != x.shape[-1] or w.dtype != x.dtype:
            raise ValueError(f"all_gather_matmul kernel: weight {w.shape} {w.dtype} does not take x {x.shape} {x.dtype}")
    B, lead = _common.fold_batch(x.shape)
    s, K = x.shape[-2], x.shape[-1]
    h = s // 2
    S = s * P
    x3 = x.reshape(B, s, K)
    tables = _common.ring_tables(axis_name, s)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))

    kernel = functools.partial(_kernel, axis_name=axis_name, P=P, B=B, h=h, K=K, widths=tuple(widths),
                               tn=tn, tiles=tiles, slots=_recv_slots,
                               unit=_common.sublane_rows(x.dtype))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    n_total = sum(widths)
    itemsize = jnp.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * B * S * K * n_total,
        transcendentals=0,
        # x once, every weight tile once per hop, every product once.
        bytes_accessed=itemsize * (B * s * K + P * K * n_total + B * S * n_total),
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=[_common.out_struct((B, S, n), x.dtype, x) for n in widths],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            in_specs=[any_spec] * (1 + len(weights)),
            out_specs=[any_spec] * len(weights),
            scratch_shapes=[
                pltpu.VMEM((2, _recv_slots, B, h, K), x.dtype),   # xbuf
                pltpu.VMEM((2, K, tn), x.dtype),                  # wbuf
                pltpu.VMEM((2, 2, B, h, tn), x.dtype),            # obuf
                pltpu.SemaphoreType.DMA((2,)),                    # x_sem: own halves -> slot 0
                pltpu.SemaphoreType.DMA((2, _recv_slots)),        # recv_sem per direction, slot
                pltpu.SemaphoreType.DMA((2,)),                    # send_sem per direction
                pltpu.SemaphoreType.DMA((2,)),                    # w_sem per weight buffer
                pltpu.SemaphoreType.DMA((2, 2)),                  # o_sem per obuf, direction
            ],
        ),
        compiler_params=pltpu.CompilerParams(collective_id=COLLECTIVE_ID, vmem_limit_bytes=plan.limit),
        cost_estimate=cost,
        interpret=_common.interpret_params(interpret),
        name="all_gather_matmul",
    )(tables, layer, x3, *[_common.in_hbm(w) for w in weights])
    return [o.reshape(*lead, S, o.shape[-1]) for o in outs]
