"""The streaming all-gather + matmul kernel's body (`_kernel`) and its epilogue helpers: one
ring step's DMAs, multiplies and product writes. The design: this package's docstring;
what a call may ask for: `planning.plan`."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from difflet_tpu.layers.rope.rotate import rotate as rope_rotate

from .. import _common
from .planning import ACTIVATIONS, Heads


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

