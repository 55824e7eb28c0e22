"""Sweeps the collective-matmul kernels' column tile at every site of a model's SP step.

    python -m difflet_tpu.tools.sweep_tiles --model wan:Wan2.1-T2V-14B --height 480 --width 832 \\
        --frames 9 --out tiles-v5e.json
    DIFFLET_TPU_KERNEL_TILES=tiles-v5e.json python -m difflet_tpu.bench ...

1. Traces the model's SP step (abstract weights, the TPU's kernel choices; off
   TPU both kernels forced) and records every kernel call (`kernel_tiles.recording`).
2. At each distinct site, for each column tile (multiples of 128 dividing its
   widths, up to --max-col-tile, whose plan fits VMEM): the kernel alone, called
   through the dispatch as the model calls it, on random inputs of the site's
   shapes, timed: the median of --repeats calls after one warm-up call.
3. Writes the table (`kernel_tiles.save`): per site the fastest tile, every
   candidate's time, and the default's.

Off TPU the kernels run in interpret mode on CPU devices: that checks the
mechanism, and its times say nothing about a TPU. `--compile-only --topology
v5e:2x2` compiles each candidate deviceless instead and records its VMEM and
code size; nothing is timed there, so the table ranks nothing (col_tile null)
and the dispatch keeps its default (docs/kernels.md, "Column tiles").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time


def parser():
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.tools.sweep_tiles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="port, port:preset or a released preset (as the bench's)")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (CFG doubles the rows)")
    ap.add_argument("--guidance", type=float, help="guidance scale (default: the pipeline's; 1 turns CFG off)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--out", required=True, help="the table (JSON) to write")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per candidate (median)")
    ap.add_argument("--max-col-tile", type=int, default=2048, help="the largest column tile tried")
    ap.add_argument("--compile-only", action="store_true",
                    help="deviceless compiles for --topology: VMEM and code size per candidate, no times")
    ap.add_argument("--topology", help="TPU topology for --compile-only, e.g. v5e:2x2")
    ap.add_argument("--cpu-devices", type=int, default=4, help="virtual CPU devices when there is no TPU")
    return ap


def validate(args, ap):
    if args.compile_only != bool(args.topology):
        ap.error("--compile-only and --topology go together")
    if args.repeats < 1 or args.max_col_tile < 128 or args.batch < 1 or args.cpu_devices < 2:
        ap.error("--repeats and --batch must be >= 1, --max-col-tile >= 128, --cpu-devices >= 2")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        ap.error(f"--out {args.out}: {out_dir} is not a writable directory")


# --------------------------------------------------------------------------
# Sites of a model's step
# --------------------------------------------------------------------------

def model_sites(spec, preset, shape, batch, mesh, dtype):
    """The distinct kernel sites of the model's SP step on `mesh`, in trace order, with
    how often each was called while tracing (a block scan traces its body once)."""
    from difflet_tpu.bench import cases, compile_only
    from difflet_tpu.kernels import tiles as kernel_tiles
    from difflet_tpu.config import Config

    cfg = cases.build_config(spec, preset)
    config = Config.from_env(sp=True, compile_cache=None, kernel_tiles=None)
    if mesh.devices.flat[0].platform != "tpu":  # off TPU the defaults are the JAX rings
        config = dataclasses.replace(config, sp_kernel="pallas", sp_rs_kernel="pallas")
    inputs = spec.example_inputs(cfg, **shape, batch=batch, seed=0, dtype=dtype)
    with kernel_tiles.recording() as seen:
        compile_only.abstract_trace(spec, cfg, inputs, mesh, config, "sp", dtype)
    counts: dict = {}
    for site, _ in seen:
        counts[site] = counts.get(site, 0) + 1
    return list(counts.items())


def site_heads(site):
    """The site's per-weight `Heads` of the all-gather kernel (None: none at all)."""
    from difflet_tpu.kernels import all_gather_matmul_stream as ags

    return [None if h is None else ags.Heads(*h) for h in site.heads] if site.heads else None


def candidates(site, max_col_tile):
    """(column tile, StreamPlan) for every tile the streaming kernel's plan takes as asked."""
    from difflet_tpu.kernels import _common
    from difflet_tpu.parallel import site_plan

    out = []
    for tn in _common.column_tile_candidates(site.widths, max_col_tile):
        reason, plan = site_plan.kernel_plan(site, _common.StreamBlocks(col_tile_limit=tn))
        if reason is None and plan.col_tile == tn:
            out.append((tn, plan))
    return out


# --------------------------------------------------------------------------
# One site, one tile: the kernel alone, through the dispatch
# --------------------------------------------------------------------------

def site_call(site, tn, mesh, interpret, impl="pallas"):
    """(fn, argument shapes and shardings) calling the dispatch at `site` with column tile tn
    (None: the kernel's default), through `impl` ("pallas"; "jax" / "xla" for the ring and the
    plain collectives at the same site, as difflet_tpu.check compares them).

    Global arrays whose `tp` shards are the site's per-rank operands; a stacked
    bias (rows L > 1) is read at layer 0 through a `LayerWeight`, as a block scan
    passes it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from difflet_tpu.parallel import collective_matmul as cm
    from difflet_tpu.kernels import tiles as kernel_tiles
    from difflet_tpu.parallel.mesh import TP

    table = kernel_tiles.KernelTiles("", ((site.key(), tn),) if tn else ())
    dtype = jnp.dtype(site.dtype)
    R = site.ring
    struct = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    if site.kind == "ag":
        (xs,), n = site.x_shapes, len(site.w_shapes)
        lead = (None,) * (len(xs) - 2)
        L = max([b[0] for b in site.biases if b is not None] + [1])  # the stack a scan would pass
        args = [struct((*xs[:-2], R * xs[-2], xs[-1]), dtype, P(*lead, TP, None))]
        args += [struct((L, K, R * w), dtype, P(None, None, TP)) for K, w in site.w_shapes]
        bias_at = []
        for b, (_, w) in zip(site.biases, site.w_shapes):
            if b is not None:
                bias_at.append(len(args))
                rows, bd = b
                args.append(struct((R * w,), bd, P(TP)) if rows == 1 else struct((rows, R * w), bd, P(None, TP)))
            else:
                bias_at.append(None)
        in_specs = tuple(a.sharding.spec for a in args) + (P(),)
        heads = site_heads(site) or [None] * n
        out_specs = [(P(*lead, None, TP), P(*lead, None, TP)) if q else
                     P(*lead, None, TP) if h is None else P(*lead, TP, None, None)  # head-major [..., H, S, D]
                     for q, h in zip(site.sum_squares, heads)]
        S = R * xs[-2]

        def body(*a):
            from difflet_tpu.layers.attention import HeadsOut

            layer = a[-1]
            bias = lambda i: None if i is None else (a[i] if a[i].ndim == 1 else cm.LayerWeight(a[i], layer))
            # the head-major epilogues with unit norm weights and one pair of flat tables (values do
            # not change the kernel's time; the call's RoPE weights share the pair, as in a model)
            D = next((h.head_dim for h in heads if h is not None), 0)
            rope = (jnp.ones((S, D), jnp.float32), jnp.zeros((S, D), jnp.float32), True)
            hs = [None if h is None else HeadsOut(h.head_dim, jnp.ones((h.head_dim,), dtype) if h.norm else None,
                                                  h.eps, rope if h.rope else None, h.scale is not None)
                  for h in heads]
            epilogues = [cm.Epilogue(bias(i), act, q, h)
                         for i, act, q, h in zip(bias_at, site.activations, site.sum_squares, hs)]
            weights = [cm.LayerWeight(w, layer) for w in a[1:1 + n]]
            return cm.all_gather_matmul(a[0], weights, impl=impl, epilogues=epilogues,
                                        interpret=interpret, tiles=table)
    else:
        n = len(site.x_shapes)
        args = [struct((*x[:-1], R * x[-1]), dtype, P(*(None,) * (len(x) - 1), TP)) for x in site.x_shapes]
        args += [struct((R * k, N), dtype, P(TP, None)) for k, N in site.w_shapes]
        lead = (None,) * (len(site.x_shapes[0]) - 2)
        in_specs = tuple(a.sharding.spec for a in args) + (P(),)
        out_specs = P(*lead, TP, None)

        def body(*a):
            return cm.matmul_reduce_scatter(list(zip(a[:n], a[n:2 * n])), impl=impl, interpret=interpret,
                                            tiles=table)

    args.append(jax.ShapeDtypeStruct((), jnp.int32))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)), args


def random_args(shapes, seed=0, scale=0.05):
    """Arguments for `site_call`'s `shapes`: N(0, scale^2) arrays placed with their
    shardings, 0 for the scalar (the layer index)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        if s.shape == ():
            out.append(np.int32(0))
            continue
        a = rng.standard_normal(s.shape, dtype=np.float32) * scale
        out.append(jax.device_put(a.astype(s.dtype), s.sharding))
    return out


def time_call(fn, args, repeats):
    """Median seconds of `repeats` calls after one warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def traced_at(fn, shapes, site, tn):
    """`fn` traced for `shapes`, checked to call the kernel at `site` with column tile tn
    (a site key that drifted from the dispatch's would time the default tile instead)."""
    from difflet_tpu.kernels import tiles as kernel_tiles

    with kernel_tiles.recording() as seen:
        traced = fn.trace(*shapes)
    used = [blocks for s, blocks in seen if s == site]
    if not used or used[0] is None or used[0].col_tile_limit != tn:
        raise RuntimeError(f"the dispatch did not run {site.kind} x {site.x_shapes} w {site.w_shapes} at column "
                           f"tile {tn}: it recorded {seen}")
    return traced


def compile_report(traced):
    from difflet_tpu.kernels import _common

    t = time.perf_counter()
    compiled = traced.lower().compile()
    kernels = [k for k in _common.kernel_vmem_from_hlo(compiled.as_text())
               if k["name"].startswith(("all_gather_matmul", "matmul_reduce_scatter"))]
    return dict(compile_s=round(time.perf_counter() - t, 2),
                code_bytes=compiled.memory_analysis().generated_code_size_in_bytes, kernels=kernels)


def sweep(sites, mesh, *, repeats, max_col_tile, compile_only, interpret, log=print):
    """Table rows: per site every candidate's time (or compile report) and the fastest tile."""
    rows = []
    for i, (site, calls) in enumerate(sites):
        cands = candidates(site, max_col_tile)
        default = candidates(site, 512)[:1]
        row = dict(site=dataclasses.asdict(site), calls=calls, col_tile=None,
                   default_col_tile=default[0][0] if default else None, candidates=[])
        for tn, plan in cands:
            fn, shapes = site_call(site, tn, mesh, interpret)
            traced = traced_at(fn, shapes, site, tn)
            c = dict(col_tile=tn, chunks=plan.chunks, chunk_rows=plan.chunk_rows,
                     weights_in_vmem=plan.weights_in_vmem, vmem_limit=plan.vmem.limit)
            if compile_only:
                c.update(compile_report(traced))
            else:
                c["seconds"] = time_call(fn, random_args(shapes), repeats)
            row["candidates"].append(c)
            log(f"site {i + 1}/{len(sites)} {site.kind} x {site.x_shapes} w {site.w_shapes}: tn {tn}: "
                + (f"{c['code_bytes'] / 2**20:.2f} MiB code" if compile_only else f"{c['seconds'] * 1e6:.1f} us"))
        timed = [c for c in row["candidates"] if "seconds" in c]
        if timed:
            row["col_tile"] = min(timed, key=lambda c: (c["seconds"], -c["col_tile"]))["col_tile"]
        rows.append(row)
    return rows


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    validate(args, ap)
    if args.compile_only:
        from difflet_tpu.tools import deviceless

        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        deviceless.setup_process(args.topology)
        import jax

        devices = deviceless.topology_devices(args.topology)
    else:
        from difflet_tpu.bench import cases
        from difflet_tpu.parallel.mesh import use_cpu_devices

        if not cases.has_tpu():
            use_cpu_devices(args.cpu_devices)
        import jax

        devices = jax.devices()
    import jax.numpy as jnp

    from difflet_tpu.bench import cases
    from difflet_tpu.kernels import tiles as kernel_tiles
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.parallel.mesh import make_mesh

    if jax.process_count() > 1:  # the sweep's inputs are device_put from this process
        ap.error("the sweep runs in one process (a single-host slice, e.g. a v5e-4); "
                 f"this run has {jax.process_count()}")
    spec, preset = PL.resolve_model(args.model)
    cfg = cases.build_config(spec, preset)
    shape = cases.shape_for(spec, preset, args)
    _, guided = cases.guidance_for(spec, args)
    batch = args.batch * (2 if guided else 1)
    mesh = make_mesh(devices=devices, **cases.mesh_axes_for(spec, cfg, len(devices), batch, None, guided))
    dtype = jnp.dtype(args.dtype)
    sites = model_sites(spec, preset, shape, batch, mesh, dtype)
    print(f"{spec.name}:{preset} {shape} batch {batch}: {len(sites)} kernel sites", file=sys.stderr, flush=True)
    on_tpu = devices[0].platform == "tpu"
    rows = sweep(sites, mesh, repeats=args.repeats, max_col_tile=args.max_col_tile, compile_only=args.compile_only,
                 interpret=not on_tpu, log=lambda s: print(s, file=sys.stderr, flush=True))
    kind = devices[0].device_kind
    kernel_tiles.save(args.out, kind, rows, model=f"{spec.name}:{preset}", shape=shape, batch=batch,
                      mesh=dict(mesh.shape), measured=not args.compile_only,
                      note=("deviceless compiles: no times, no choice" if args.compile_only else
                            "median kernel times on these devices" + ("" if on_tpu else
                                                                      " (interpret mode: not a TPU measurement)")))
    for r in rows:
        print(f"{r['site']['kind']} x {r['site']['x_shapes']} w {r['site']['w_shapes']}: "
              f"tile {r['col_tile']} (default {r['default_col_tile']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
