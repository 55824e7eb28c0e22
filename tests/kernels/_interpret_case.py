"""One kernel case in TPU interpret mode on 4 CPU devices, in a process of its own.

Usage: python _interpret_case.py '<json spec>'. Prints the case's result as
one JSON line prefixed with `RESULT ` and exits through os._exit (a failed
interpret-mode call leaves effect tokens that jax's atexit handler would
re-raise). The race detector is always on. Spec keys:

  kind:    "ag" | "rs" | "ag_fallback" | "rs_fallback" | "ag_dispatch" | "rs_dispatch"
  dtype:   "float32" | "bfloat16"
  batch:   [] | [B] | ...             leading dims of x
  S, K:    sequence rows, contraction width (ag: K per rank is K)
  widths:  ag: per-rank widths of the weights; rs: per-rank k_i of each pair
  N:       rs: output width
  chunk_rows, window, col_tile, row_tile, depth_tile, weights_in_vmem: the
           kernels' `StreamBlocks` (optional; defaults: the largest chunk that
           fits, 3 slots, 512-column and 512-row tiles, 1024-column depth
           chunks, weights streamed: these small cases would hold them by the
           plan's rule, and the plan must agree)
  skip_credit: a step whose send goes without its credit (the racy variant)
  layers, at: stacked weights [layers, ...] read at each layer index in `at`
           (a runtime argument: one compile), against numpy's x @ w[layer];
           "ag"/"rs" pass the stack and `layer=` to the kernel, the dispatch
           kinds pass `LayerWeight`s (optional)

  kind "ag_epi": the all-gather kernel with epilogues; keys bias (per weight,
           true/false), act (per weight, null or "gelu_tanh"), dispatch (true:
           through collective_matmul with `Epilogue`s, and `LayerWeight`s when
           stacked; the bias then a LayerWeight of a [layers, n] stack too),
           layers/at as above (the biases stacked [layers, n] as well).
           Reports rel_err against float64 numpy act(x @ w + b) and
           unfused_err: the fused result against the kernel without
           epilogues followed by the same epilogue as an XLA pass.
           ssq (per weight, true/false, optional): that weight also returns
           its rows' sums of squares over each rank's columns; reported per
           such weight: ssq_err (against float64 numpy sums of the returned
           output's squares: only the kernel's float32 summation differs),
           ssq_ref_err (against float64 sums of the float64 reference's
           squares: includes the output's rounding) and ssq_unfused_err
           (against collective_matmul.row_sum_squares of the unfused output),
           each max over rows of |ssq - ref| / max(ref_row, 1).
  kind "ag_heads": the all-gather kernel writing some weights head-major (head_dim
           128); keys heads (per weight null or [norm, rope, scale] flags), act;
           every weight has a bias. Through the dispatch (`Epilogue(heads=HeadsOut)`),
           or the kernel itself with the spec's blocks when chunk_rows or
           skip_credit is given. Reports rel_err (against float64 numpy),
           unfused_err (against the kernel's products + `HeadsOut` as XLA passes)
           and kernel_heads (the heads the dispatch's kernel call wrote, per call).
  ring:    ring size P (2 or 4; default 4) on the 4 CPU devices
  vmem_capacity: the chip VMEM bytes the plans assume (default 128 MiB): a small one
           makes the dispatch's plan cut the halves into chunks ("ag_dispatch" /
           "rs_dispatch" report the plan's "chunks" a half)
  bias:    kind "rs": true adds a bias [N] of small integers, passed to the kernel
           and added to both references

Kinds "ag", "ag_epi" (not through the dispatch) and "rs" call the kernels
(kernels/all_gather_matmul_stream/, kernels/matmul_reduce_scatter_stream.py)
with the spec's blocks and report the plan's "chunks" a half.

Float32 cases use small integer values, so every product is exact and the
kernel must equal numpy bit for bit; bf16 cases use normal values and a
tolerance.
"""

import json
import os
import sys
import traceback

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import logging  # noqa: E402

import numpy as np  # noqa: E402

P_RING = 4


def inputs(spec, rng):
    dtype = spec["dtype"]
    batch = tuple(spec.get("batch", []))
    S = spec["S"]
    stack = (spec["layers"],) if "layers" in spec else ()

    def make(shape):
        if dtype == "float32":
            return rng.integers(-3, 4, size=shape).astype(np.float32)
        import ml_dtypes

        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float32)

    if spec["kind"].startswith("ag"):
        K = spec["K"]
        x = make(batch + (S, K))
        ws = [make(stack + (K, P_RING * n)) for n in spec["widths"]]
        return x, ws
    N = spec["N"]
    xs = [make(batch + (S, P_RING * k)) for k in spec["widths"]]
    ws = [make(stack + (P_RING * k, N)) for k in spec["widths"]]
    return xs, ws


def run(spec):
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import PartitionSpec as P

    from difflet_tpu.parallel import collective_matmul as cm
    from difflet_tpu.kernels import all_gather_matmul_stream as agk
    from difflet_tpu.kernels import matmul_reduce_scatter_stream as rsk
    from difflet_tpu.parallel.mesh import make_mesh

    global P_RING, AG_KERNEL, RS_KERNEL
    P_RING = spec.get("ring", 4)
    mesh = make_mesh(P_RING)
    dt = jnp.dtype(spec["dtype"])
    rng = np.random.default_rng(spec.get("seed", 0))
    params = pltpu.InterpretParams(detect_races=True)
    if "vmem_capacity" in spec:
        from difflet_tpu.kernels import _common

        _common.vmem_capacity_bytes = lambda: spec["vmem_capacity"]
    kind = spec["kind"]
    chunks = None
    if kind == "rs":
        RS_KERNEL, chunks = rs_stream_kernel(spec, P_RING, dt)
    elif kind == "ag" or (kind == "ag_epi" and not spec.get("dispatch")) or (
            kind == "ag_heads" and ("chunk_rows" in spec or "skip_credit" in spec)):
        AG_KERNEL, chunks = stream_kernel(spec, P_RING, dt)
    elif kind == "ag_epi":  # the dispatch's fused path; the unfused one runs the kernel with default blocks
        AG_KERNEL = agk.all_gather_matmul_stream
    nb = len(spec.get("batch", []))
    lead = (None,) * nb
    warnings = []

    class Count(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("difflet_tpu.parallel.site_plan").addHandler(Count(level=logging.WARNING))
    result = {}
    if chunks is not None:
        result["chunks"] = chunks
    if kind == "ag_heads":
        result.update(heads_case(spec, params, mesh, dt, rng, lead))
        result["warnings"] = warnings
        return result
    if kind == "ag_epi":
        result.update(epilogues(spec, params, mesh, dt, rng, lead))
        result["warnings"] = warnings
        return result
    if "layers" in spec:
        result["rel_err"] = stacked(spec, kind, params, mesh, dt, rng, lead)
        result["warnings"] = warnings
        return result

    if kind.startswith("ag"):
        x, ws = inputs(spec, rng)
        nw = len(ws)
        if kind == "ag":
            f = lambda x, *w: AG_KERNEL(x, list(w), interpret=params)
        else:  # the dispatch in difflet_tpu.parallel.collective_matmul (kernel, or the ring on fallback)
            f = lambda x, *w: cm.all_gather_matmul(x, list(w), impl="pallas", interpret=params)
        g = lambda: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(*lead, "tp", None),) + (P(None, "tp"),) * nw,
                                          out_specs=[P(*lead, None, "tp")] * nw))
        args = [jnp.asarray(x, dt)] + [jnp.asarray(w, dt) for w in ws]
        outs = g()(*args)
        if kind == "ag_fallback":  # tracing the same shape again must not warn again
            outs = g()(*args)
        reason, plan = agk.plan(x.shape[:-2] + (x.shape[-2] // P_RING, x.shape[-1]),
                                [w.shape[1] // P_RING for w in ws], dt, P_RING)
        result["reason"] = reason
        if kind == "ag_dispatch":
            result["chunks"] = plan.chunks
        errs = []
        for o, w in zip(outs, ws):
            ref = x @ w
            o = np.asarray(o.astype(jnp.float32))
            errs.append(float(np.abs(o - ref).max() / max(1.0, np.abs(ref).max())))
        result["rel_err"] = errs
        if kind == "ag":  # the one plain reference (collective_matmul's, the sp-xla path), against numpy too
            r = jax.jit(jax.shard_map(lambda x, *w: cm.all_gather_matmul_reference(x, list(w)), mesh=mesh,
                                      in_specs=(P(*lead, "tp", None),) + (P(None, "tp"),) * nw,
                                      out_specs=[P(*lead, None, "tp")] * nw))(*args)
            result["ref_err"] = [float(np.abs(np.asarray(o.astype(jnp.float32)) - x @ w).max()
                                       / max(1.0, np.abs(x @ w).max())) for o, w in zip(r, ws)]
    else:
        xs, ws = inputs(spec, rng)
        n = len(xs)
        bias = None
        if spec.get("bias"):  # the streaming kernel's bias [N], added once to the finished sums
            bias = rng.integers(-3, 4, size=(spec["N"],)).astype(np.float32)
        if kind == "rs":
            if bias is None:
                f = lambda *a: RS_KERNEL(list(zip(a[:n], a[n:])), interpret=params)
            else:
                f = lambda *a: RS_KERNEL(list(zip(a[:n], a[n:2 * n])), bias=a[2 * n], interpret=params)
        else:
            f = lambda *a: cm.matmul_reduce_scatter(list(zip(a[:n], a[n:])), impl="pallas", interpret=params)
        bspecs = () if bias is None else (P(),)
        g = lambda: jax.jit(jax.shard_map(f, mesh=mesh,
                                          in_specs=(P(*lead, None, "tp"),) * n + (P("tp", None),) * n + bspecs,
                                          out_specs=P(*lead, "tp", None)))
        args = [jnp.asarray(a, dt) for a in xs + ws]
        out = g()(*args, *([] if bias is None else [jnp.asarray(bias, dt)]))
        if kind == "rs_fallback":  # tracing the same shape again must not warn again
            out = g()(*args)
        reason, plan = rsk.plan([a.shape[:-1] + (a.shape[-1] // P_RING,) for a in xs],
                                [(w.shape[0] // P_RING, w.shape[1]) for w in ws], dt, P_RING)
        result["reason"] = reason
        if kind == "rs_dispatch":
            result["chunks"] = plan.chunks
        ref = sum(a @ w for a, w in zip(xs, ws))
        if bias is not None:
            ref = ref + bias
        o = np.asarray(out.astype(jnp.float32))
        result["rel_err"] = [float(np.abs(o - ref).max() / max(1.0, np.abs(ref).max()))]
        if kind == "rs":  # the one plain reference, as above
            r = jax.jit(jax.shard_map(lambda *a: cm.matmul_reduce_scatter_reference(list(zip(a[:n], a[n:]))),
                                      mesh=mesh,
                                      in_specs=(P(*lead, None, "tp"),) * n + (P("tp", None),) * n,
                                      out_specs=P(*lead, "tp", None)))(*args)
            if bias is not None:
                r = r + jnp.asarray(bias, dt)
            result["ref_err"] = [float(np.abs(np.asarray(r.astype(jnp.float32)) - ref).max()
                                       / max(1.0, np.abs(ref).max()))]
    result["warnings"] = warnings
    return result


def stacked(spec, kind, params, mesh, dt, rng, lead):
    """Stacked weights read at runtime layer indices: one rel. error per (index, output)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from difflet_tpu.parallel import collective_matmul as cm

    if kind.startswith("ag"):
        x, ws = inputs(spec, rng)
        nw = len(ws)
        if kind == "ag":
            f = lambda x, layer, *w: AG_KERNEL(x, list(w), layer=layer, interpret=params)
        else:
            f = lambda x, layer, *w: cm.all_gather_matmul(x, [cm.LayerWeight(a, layer) for a in w],
                                                          impl="pallas", interpret=params)
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(*lead, "tp", None), P()) + (P(None, None, "tp"),) * nw,
                                  out_specs=[P(*lead, None, "tp")] * nw))
        args = [jnp.asarray(w, dt) for w in ws]
        refs = lambda l: [x @ w[l] for w in ws]
        run = lambda l: g(jnp.asarray(x, dt), jnp.int32(l), *args)
    else:
        xs, ws = inputs(spec, rng)
        n = len(xs)
        if kind == "rs":
            f = lambda layer, *a: RS_KERNEL(list(zip(a[:n], a[n:])), layer=layer, interpret=params)
        else:
            f = lambda layer, *a: cm.matmul_reduce_scatter([(x, cm.LayerWeight(w, layer)) for x, w in zip(a[:n], a[n:])],
                                                           impl="pallas", interpret=params)
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(),) + (P(*lead, None, "tp"),) * n + (P(None, "tp", None),) * n,
                                  out_specs=P(*lead, "tp", None)))
        args = [jnp.asarray(a, dt) for a in xs + ws]
        refs = lambda l: [sum(a @ w[l] for a, w in zip(xs, ws))]
        run = lambda l: [g(jnp.int32(l), *args)]
    errs = []
    for l in spec["at"]:
        for o, ref in zip(run(l), refs(l)):
            o = np.asarray(o.astype(jnp.float32))
            errs.append(float(np.abs(o - ref).max() / max(1.0, np.abs(ref).max())))
    return errs


AG_KERNEL = None  # the all-gather kernel with the spec's blocks (a partial)
RS_KERNEL = None  # the reduce-scatter kernel with the spec's blocks (a partial)


def spec_blocks(spec):
    """The kernels' `StreamBlocks` from the spec's keys (weights_in_vmem: the all-gather's
    only; default False, so these small cases stream their weights)."""
    from difflet_tpu.kernels import _common

    return _common.StreamBlocks(chunk_rows=spec.get("chunk_rows"), window=spec.get("window", 3),
                                col_tile_limit=spec.get("col_tile", 512), row_tile_limit=spec.get("row_tile", 512),
                                depth_tile_limit=spec.get("depth_tile", 1024),
                                weights_in_vmem=spec.get("weights_in_vmem", False))


def stream_kernel(spec, ring, dt):
    """(the all-gather kernel with the spec's blocks, the plan's chunks a half)."""
    import functools

    from difflet_tpu.kernels import all_gather_matmul_stream as ags

    blocks = spec_blocks(spec)
    S, K = spec["S"], spec["K"]
    reason, plan = ags.plan(tuple(spec.get("batch", [])) + (S // ring, K), spec["widths"], dt, ring, blocks=blocks)
    assert reason is None, reason
    assert plan.weights_in_vmem == bool(spec.get("weights_in_vmem", False)), plan
    return functools.partial(ags.all_gather_matmul_stream, blocks=blocks,
                             _skip_credit_at=spec.get("skip_credit")), plan.chunks


def rs_stream_kernel(spec, ring, dt):
    """(the reduce-scatter kernel with the spec's blocks, the plan's chunks a half)."""
    import functools

    from difflet_tpu.kernels import matmul_reduce_scatter_stream as rss

    blocks = spec_blocks(spec)
    lead, S, N = tuple(spec.get("batch", [])), spec["S"], spec["N"]
    reason, plan = rss.plan([lead + (S, k) for k in spec["widths"]], [(k, N) for k in spec["widths"]], dt, ring,
                            blocks=blocks, bias=(1, dt) if spec.get("bias") else None)
    assert reason is None, reason
    return functools.partial(rss.matmul_reduce_scatter_stream, blocks=blocks,
                             _skip_credit_at=spec.get("skip_credit")), plan.chunks


def gelu_tanh64(y):
    return 0.5 * y * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (y + 0.044715 * y ** 3)))


def epilogues(spec, params, mesh, dt, rng, lead):
    """The kernel's fused bias/GELU against float64 numpy and against the unfused path."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from difflet_tpu.parallel import collective_matmul as cm

    x, ws = inputs(dict(spec, kind="ag"), rng)
    nw = len(ws)
    stack = (spec["layers"],) if "layers" in spec else ()
    has_b, acts = spec["bias"], spec["act"]
    ssqs = spec.get("ssq", [False] * nw)
    bs = [rng.integers(-3, 4, size=stack + (w.shape[-1],)).astype(np.float32) if hb else None
          for w, hb in zip(ws, has_b)]
    if dt == jnp.bfloat16:
        import ml_dtypes

        bs = [None if b is None else (b / 4).astype(ml_dtypes.bfloat16).astype(np.float32) for b in bs]
    bidx = [i for i, b in enumerate(bs) if b is not None]
    stacked = bool(stack)
    dispatch = spec.get("dispatch", False)

    def split(a):
        w, b = list(a[:nw]), list(a[nw:])
        full = [None] * nw
        for i, v in zip(bidx, b):
            full[i] = v
        return w, full

    def fused(x, layer, *a):
        w, b = split(a)
        if dispatch:
            wrap = (lambda v: cm.LayerWeight(v, layer)) if stacked else (lambda v: v)
            eps = [cm.Epilogue(None if bb is None else wrap(bb), ac, q) for bb, ac, q in zip(b, acts, ssqs)]
            return cm.all_gather_matmul(x, [wrap(v) for v in w], impl="pallas", epilogues=eps, interpret=params)
        return AG_KERNEL(x, w, layer=layer if stacked else None, biases=b, activations=acts,
                         sum_squares=ssqs, interpret=params)

    def unfused(x, layer, *a):  # the kernel's bare products, then the epilogue as an XLA pass
        w, b = split(a)
        ys = AG_KERNEL(x, w, layer=layer if stacked else None, interpret=params)
        out = []
        for y, bb, ac, q in zip(ys, b, acts, ssqs):
            if bb is not None:
                y = y + (bb[layer] if stacked else bb)
            y = y if ac is None else cm.KERNEL_ACTIVATIONS[ac](y)
            out.append((y, cm.row_sum_squares(y)) if q else y)
        return out

    wspec = P(None, None, "tp") if stacked else P(None, "tp")
    bspec = P(None, "tp") if stacked else P("tp")
    specs = (P(*lead, "tp", None), P()) + (wspec,) * nw + (bspec,) * len(bidx)
    # a sum of squares is [..., S, 1] per rank: concatenated over ranks, [..., S, P] (column r: rank r's)
    ospec = P(*lead, None, "tp")
    out_specs = [(ospec, ospec) if q else ospec for q in ssqs]
    g = {k: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out_specs))
         for k, f in (("fused", fused), ("unfused", unfused))}
    args = [jnp.asarray(w, dt) for w in ws] + [jnp.asarray(bs[i], dt) for i in bidx]
    rel, unf, s_err, s_ref, s_unf, s_dtype = [], [], [], [], [], []

    def per_rank_ssq(y):  # float64 [..., S, P]: each rank's columns' sums of squares
        return np.stack([np.sum(c * c, axis=-1) for c in np.split(y, P_RING, axis=-1)], axis=-1)

    def ssq_rel(a, ref):
        return float(np.max(np.abs(a - ref) / np.maximum(ref, 1.0)))

    for l in (spec["at"] if stacked else [0]):
        outs = g["fused"](jnp.asarray(x, dt), jnp.int32(l), *args)
        base = g["unfused"](jnp.asarray(x, dt), jnp.int32(l), *args)
        for i, (o, u) in enumerate(zip(outs, base)):
            if ssqs[i]:
                (o, so), (u, su) = o, u
                s_dtype.append(str(so.dtype))
                so = np.asarray(so).astype(np.float64)
                su = np.asarray(su).astype(np.float64)
                assert so.shape == o.shape[:-1] + (P_RING,), (so.shape, o.shape)
            w = ws[i][l] if stacked else ws[i]
            ref = x.astype(np.float64) @ w.astype(np.float64)
            if bs[i] is not None:
                ref = ref + (bs[i][l] if stacked else bs[i]).astype(np.float64)
            if acts[i] is not None:
                ref = gelu_tanh64(ref)
            o = np.asarray(o.astype(jnp.float32)).astype(np.float64)
            u = np.asarray(u.astype(jnp.float32)).astype(np.float64)
            scale = max(1.0, np.abs(ref).max())
            rel.append(float(np.abs(o - ref).max() / scale))
            unf.append(float(np.abs(o - u).max() / scale))
            if ssqs[i]:
                s_err.append(ssq_rel(so, per_rank_ssq(o)))
                s_ref.append(ssq_rel(so, per_rank_ssq(ref)))
                s_unf.append(ssq_rel(so, su))
    return dict(rel_err=rel, unfused_err=unf, ssq_err=s_err, ssq_ref_err=s_ref, ssq_unfused_err=s_unf,
                ssq_dtype=s_dtype)


def heads_case(spec, params, mesh, dt, rng, lead):
    """The all-gather kernel writing q/k/v head-major (`Heads`: per-head RMSNorm, split-halves
    RoPE, q's scale) against float64 numpy and against the unfused path (the kernel's
    products with their biases, then `layers.attention.HeadsOut` as XLA passes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from difflet_tpu.parallel import collective_matmul as cm
    from difflet_tpu.kernels import tiles as kernel_tiles
    from difflet_tpu.kernels import all_gather_matmul_stream as ags
    from difflet_tpu.layers.attention import HeadsOut

    D, eps = 128, 1e-6
    x, ws = inputs(dict(spec, kind="ag"), rng)
    nw = len(ws)
    flags = spec["heads"]  # per weight None or [norm, rope, scale]
    acts = spec.get("act", [None] * nw)
    S = x.shape[-2]
    bs = [(rng.integers(-3, 4, size=(w.shape[-1],)) / 4).astype(np.float32) for w in ws]
    norms = [(1 + rng.integers(-2, 3, size=(D,)) / 8).astype(np.float32) if f and f[0] else None for f in flags]
    ang = rng.uniform(-3, 3, size=(S, D // 2))
    cos, sin = (np.concatenate([t(ang)] * 2, axis=-1).astype(np.float32) for t in (np.cos, np.sin))
    nidx = [i for i, n in enumerate(norms) if n is not None]
    direct = "chunk_rows" in spec or "skip_credit" in spec

    def heads_outs(a_norm, c, s_):
        nv = dict(zip(nidx, a_norm))
        return [None if f is None else HeadsOut(D, nv.get(i), eps, (c, s_, True) if f[1] else None, bool(f[2]))
                for i, f in enumerate(flags)]

    def fused(x, *a):
        w, b, nrm, (c, s_) = a[:nw], a[nw:2 * nw], a[2 * nw:2 * nw + len(nidx)], a[-2:]
        hs = heads_outs(nrm, c, s_)
        if direct:  # the kernel itself, with the spec's blocks (and the racy variant's skipped credit)
            kh = [None if h is None else ags.Heads(D, h.norm is not None, eps, h.rope is not None, h.scale)
                  for h in hs]
            return AG_KERNEL(x, list(w), biases=list(b), activations=acts, heads=kh,
                             norms=[None if h is None else h.norm for h in hs],
                             rope=(c, s_) if any(h is not None and h.rope for h in hs) else None, interpret=params)
        return cm.all_gather_matmul(x, list(w), impl="pallas", interpret=params,
                                    epilogues=[cm.Epilogue(bb, ac, False, h) for bb, ac, h in zip(b, acts, hs)])

    def unfused(x, *a):
        w, b, nrm, (c, s_) = a[:nw], a[nw:2 * nw], a[2 * nw:2 * nw + len(nidx)], a[-2:]
        ys = ags.all_gather_matmul_stream(x, list(w), biases=list(b), activations=acts, interpret=params)
        return [y if h is None else h(y) for y, h in zip(ys, heads_outs(nrm, c, s_))]

    specs = (P(*lead, "tp", None),) + (P(None, "tp"),) * nw + (P("tp"),) * nw + (P(),) * (len(nidx) + 2)
    out_specs = [P(*lead, None, "tp") if f is None else P(*lead, "tp", None, None) for f in flags]
    args = ([jnp.asarray(x, dt)] + [jnp.asarray(w, dt) for w in ws] + [jnp.asarray(b, dt) for b in bs]
            + [jnp.asarray(norms[i], dt) for i in nidx] + [jnp.asarray(cos), jnp.asarray(sin)])
    with kernel_tiles.recording() as seen:
        outs = jax.jit(jax.shard_map(fused, mesh=mesh, in_specs=specs, out_specs=out_specs))(*args)
    base = jax.jit(jax.shard_map(unfused, mesh=mesh, in_specs=specs, out_specs=out_specs))(*args)
    rows = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32)).astype(np.float64)
    rel, unf = [], []
    for i, (o, u) in enumerate(zip(outs, base)):
        ref = rows(args[0]) @ rows(args[1 + i]) + rows(args[1 + nw + i])
        if acts[i] is not None:
            ref = gelu_tanh64(ref)
        f = flags[i]
        if f is not None:
            ref = ref.reshape(*ref.shape[:-1], -1, D)  # [..., S, H, D]
            if f[0]:
                ref = ref / np.sqrt(np.mean(ref * ref, axis=-1, keepdims=True) + eps) * rows(norms[i].astype(dt))
            if f[1]:
                rot = np.concatenate([-ref[..., D // 2:], ref[..., :D // 2]], axis=-1)
                ref = ref * cos.astype(np.float64)[:, None] + rot * sin.astype(np.float64)[:, None]
            if f[2]:
                ref = ref / np.sqrt(D)
            ref = np.swapaxes(ref, -3, -2)
        o, u = rows(o), rows(u)
        assert o.shape == ref.shape, (o.shape, ref.shape)
        scale = max(1.0, np.abs(ref).max())
        rel.append(float(np.abs(o - ref).max() / scale))
        unf.append(float(np.abs(o - u).max() / scale))
    return dict(rel_err=rel, unfused_err=unf,
                kernel_heads=[[list(h) if h is not None else None for h in site.heads] for site, _ in seen])


def main():
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
        result["ok"] = True
    except Exception as e:  # reported to the test, which decides
        result = dict(ok=False, error_type=type(e).__name__, error=str(e)[-4000:],
                      traceback=traceback.format_exc()[-4000:])
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
