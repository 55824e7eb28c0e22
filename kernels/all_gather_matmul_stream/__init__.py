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

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import _common
from .kernel import _kernel
from .planning import ACTIVATIONS, COLLECTIVE_ID, Heads, heads_reason, plan, unsupported_reason

__all__ = ["ACTIVATIONS", "COLLECTIVE_ID", "Heads", "all_gather_matmul_stream", "heads_reason", "plan",
           "unsupported_reason"]


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
