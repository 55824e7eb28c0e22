"""The collective-matmul sites: both kernels against the plain collectives, timed and estimated.

A site is one call of the dispatch (`kernels.tiles.Site`: kind, per-rank
shapes, epilogues), found by tracing a bench case's SP step with both kernels
forced (`tools.sweep_tiles.model_sites`). Each site runs as three programs on
random data (`tools.sweep_tiles.site_call`): the Pallas kernel (`impl="pallas"`;
compiled for the chip on a TPU, interpret mode on CPU), the JAX ring
(`"jax"`) and the plain collectives (`"xla"`; on a TPU with XLA's
collective-matmul decomposition, as the sp-xla mode). The kernel and the ring
must match the plain collectives; on a TPU each is timed (median of `iters`
calls) beside the estimator's price of the same compiled program.

`streaming_cases` drive the streaming kernels' credit and semaphore paths at
1, 2 and 3 chunks a half (small float32 integers: exact products), against
numpy; on CPU with the interpret mode's race detector.
"""

from __future__ import annotations

import time

IMPLS = {"kernel": "pallas", "ring": "jax", "sp-xla": "xla"}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max |out - ref| / max |ref| against the plain collectives


def discover(cases, mesh, dtype, log=print) -> list:
    """[(Site, [case names])] of every bench case's SP step on `mesh`, in first-seen order."""
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.tools import sweep_tiles

    seen: dict = {}
    for name, (model, shape, guidance) in cases.items():
        spec, preset = PL.resolve_model(model)
        batch = 2 if guidance is not None and guidance > 1 and spec.pipeline.guidance_mode == "cfg" else 1
        t = time.perf_counter()
        for site, _ in sweep_tiles.model_sites(spec, preset, shape, batch, mesh, dtype):
            seen.setdefault(site, []).append(name)
        log(f"sites: traced {name} ({time.perf_counter() - t:.1f} s), {len(seen)} distinct so far")
    return list(seen.items())


def shrink(site, rows: int = 128, cols: int = 128):
    """The site at `rows` token rows (all ranks together), a depth of 2 x `cols` and `cols`
    columns per weight and rank: the CPU path runs the bench sites' structure (weights,
    pairs, epilogues, ring) in interpret mode at a size it can afford."""
    import dataclasses

    if site.kind == "ag":
        (x,) = site.x_shapes
        return dataclasses.replace(site, x_shapes=((*x[:-2], rows // site.ring, 2 * cols),),
                                   w_shapes=tuple((2 * cols, cols) for _ in site.w_shapes))
    return dataclasses.replace(site, x_shapes=tuple((*x[:-2], rows, cols) for x in site.x_shapes),
                               w_shapes=tuple((cols, 2 * cols) for _ in site.w_shapes))


def describe(site) -> str:
    if site.kind == "ag":
        return f"all_gather_matmul x{list(site.x_shapes[0])} -> n={'+'.join(str(w[1]) for w in site.w_shapes)}"
    return (f"matmul_reduce_scatter x{[list(x) for x in site.x_shapes]} -> N={site.w_shapes[0][1]}"
            .replace("[[", "[").replace("]]", "]"))


def _compile(fn, shapes, impl, on_tpu):
    from difflet_tpu.bench.run import XLA_CM_FLAGS

    opts = dict(XLA_CM_FLAGS) if impl == "xla" and on_tpu else None
    lowered = fn.trace(*shapes).lower()
    return lowered.compile(compiler_options=opts) if opts else lowered.compile()


def rel_err(out, ref) -> float:
    import jax
    import numpy as np

    worst = 0.0
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        if not np.isfinite(o).all():
            return float("inf")
        worst = max(worst, float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30)))
    return worst


def check_site(site, mesh, *, mode, chip=None, iters=20, name=None, seed=0) -> list:
    """Rows (one per impl) for one site. mode: "cpu" (interpret mode, compared, not timed),
    "tpu" (compiled, compared, timed, estimated) or "compile" (deviceless: compiled and
    estimated only)."""
    from difflet_tpu.tools import estimate as E, sweep_tiles

    on_tpu = mode != "cpu"
    rows, outs = [], {}
    for label, impl in IMPLS.items():
        row = dict(what="site", name=name or describe(site), site=describe(site), impl=label,
                   dtype=site.dtype, measured_ms=None)
        try:
            fn, shapes = sweep_tiles.site_call(site, None, mesh, interpret=not on_tpu, impl=impl)
            compiled = _compile(fn, shapes, impl, on_tpu)
            if on_tpu:
                est = E.estimate(compiled.as_text(), chip)
                row["breakdown_raw"] = E.summarize(est)
                row["estimate_raw_ms"] = round(1e3 * est.total, 4)
                if label == "kernel" and not est.kernel_sites:
                    row["note"] = "the dispatch fell back to the ring here (the kernel does not take this site)"
            if mode != "compile":
                args = sweep_tiles.random_args(shapes, seed, scale=0.5)
                outs[label] = compiled(*args)
                if mode == "tpu":
                    row["measured_ms"] = round(1e3 * sweep_tiles.time_call(compiled, args, iters), 4)
        except Exception as e:  # noqa: BLE001 - one failed impl is a failed row, the others still run
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
    if "sp-xla" in outs:
        for row in rows:
            if row["impl"] in outs and row["impl"] != "sp-xla":
                err = rel_err(outs[row["impl"]], outs["sp-xla"])
                row["rel_err_vs_plain"] = err
                row["tol"] = TOL.get(site.dtype, 2e-2)
                if not err <= row["tol"]:  # NaN and inf fail too
                    row["error"] = f"differs from the plain collectives: rel. error {err:.3g} > {row['tol']}"
    return rows


# The streaming kernels' credit / semaphore paths: (kind, rows S, K or N, per-rank widths,
# chunk rows, chunks a half on a ring of P = 4). float32 small integers: exact.
STREAMING = (
    ("ag", 256, 256, (128, 256), 32, 1),
    ("ag", 256, 256, (128, 256), 16, 2),
    ("ag", 320, 256, (128, 384), 16, 3),
    ("rs", 256, 256, (128,), 32, 1),
    ("rs", 256, 256, (128, 256), 16, 2),
    ("rs", 320, 256, (128,), 16, 3),
)


def streaming_fn(case, mesh, mode):
    """(jitted fn, host inputs, their PartitionSpecs, float64 references, the plan's refusal
    or None, the plan) of one streaming case."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from difflet_tpu.kernels import _common, all_gather_matmul_stream as ags, matmul_reduce_scatter_stream as rss

    kind, S, KN, widths, chunk_rows, _ = case
    R = mesh.shape["tp"]
    rng = np.random.default_rng(0)
    ints = lambda shape: rng.integers(-3, 4, size=shape).astype(np.float32)
    blocks = _common.StreamBlocks(chunk_rows=chunk_rows, col_tile_limit=128, row_tile_limit=8)
    interpret = False
    if mode == "cpu":
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.InterpretParams(detect_races=True)
    if kind == "ag":
        x = ints((S, KN))
        ws = [ints((KN, R * n)) for n in widths]
        reason, plan = ags.plan((S // R, KN), list(widths), jnp.float32, R, blocks=blocks)
        kernel = functools.partial(ags.all_gather_matmul_stream, blocks=blocks, interpret=interpret)
        specs = (P("tp", None),) + (P(None, "tp"),) * len(ws)
        fn = jax.jit(jax.shard_map(lambda x, *w: kernel(x, list(w)), mesh=mesh, in_specs=specs,
                                   out_specs=[P(None, "tp")] * len(ws)))
        return fn, [x] + ws, specs, [x.astype(np.float64) @ w for w in ws], reason, plan
    xs = [ints((S, R * k)) for k in widths]
    ws = [ints((R * k, KN)) for k in widths]
    reason, plan = rss.plan([(S, k) for k in widths], [(k, KN) for k in widths], jnp.float32, R, blocks=blocks)
    kernel = functools.partial(rss.matmul_reduce_scatter_stream, blocks=blocks, interpret=interpret)
    n = len(xs)
    specs = (P(None, "tp"),) * n + (P("tp", None),) * n
    fn = jax.jit(jax.shard_map(lambda *a: kernel(list(zip(a[:n], a[n:]))), mesh=mesh, in_specs=specs,
                               out_specs=P("tp", None)))
    return fn, xs + ws, specs, [sum(a.astype(np.float64) @ w for a, w in zip(xs, ws))], reason, plan


def check_streaming(mesh, mode, cases=STREAMING) -> list:
    """One row per streaming case: the plan's chunks, exact against numpy (cpu / tpu), or
    compiled only (compile)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    rows = []
    for case in cases:
        kind, S, KN, widths, chunk_rows, chunks = case
        row = dict(what="streaming", kind=kind, rows=S, widths=list(widths), chunk_rows=chunk_rows,
                   chunks_expected=chunks)
        try:
            fn, args, specs, refs, reason, plan = streaming_fn(case, mesh, mode)
            if reason is not None:
                raise ValueError(f"the kernel's plan refused the case: {reason}")
            row["chunks"] = plan.chunks
            if plan.chunks != chunks:
                row["error"] = f"the plan cut {plan.chunks} chunks a half, expected {chunks}"
            if mode == "compile":
                fn.trace(*[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, sp))
                           for a, sp in zip(args, specs)]).lower().compile()
            else:
                outs = jax.tree.leaves(fn(*args))
                err = max(float(np.abs(np.asarray(o, np.float64) - r).max()) for o, r in zip(outs, refs))
                row["max_abs_err"] = err
                if not err == 0.0:
                    row["error"] = f"not exact: max |out - numpy| = {err}"
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
    return rows
