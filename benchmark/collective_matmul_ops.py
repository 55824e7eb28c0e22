"""Collective matmuls at model shapes: Pallas kernel vs JAX ring vs XLA's own
collective matmul vs unfused all_gather / psum_scatter + dot.

Variants (all inside `jax.shard_map` over a 4-way `tp` ring):
  kernel   difflet_tpu.parallel.collective_matmul with impl="pallas" (difflet_tpu.kernels)
  ring     impl="jax": the bidirectional ring of collective-permutes in plain JAX
  xla-cm   impl="xla" (lax.all_gather + dot, dot + lax.psum_scatter) compiled with
           xla_tpu_{all_gather,reduce_scatter}_collective_matmul_mode=POST_SPMD,
           which lets XLA decompose it into its own collective matmul
  unfused  impl="xla" with default options: one collective, then one dot

On a TPU:        python benchmark/collective_matmul_ops.py [--iters 50]
  times each variant (median ms per call over --iters calls, after warm-up).
Without a TPU:   python benchmark/collective_matmul_ops.py --compile-only [--topology v5e:2x2]
  compiles every variant deviceless for the topology and prints, per variant,
  the sum of the compiler's per-op `estimated_cycles` (XLA ops only: a Pallas
  kernel carries none) with the async collectives it contains, and, for the
  kernel, its VMEM buffer plan next to what Mosaic reports using.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

XLA_CM_OPTIONS = {
    "xla_tpu_all_gather_collective_matmul_mode": "POST_SPMD",
    "xla_tpu_reduce_scatter_collective_matmul_mode": "POST_SPMD",
}
VARIANTS = ("kernel", "ring", "xla-cm", "unfused")
P_RING = 4

# name: (kind, S, K, per-rank widths, N). ag: x [S, K] gathered, weights [K, 4*w] split by columns.
# rs: per-rank x_i [S, k_i] (k_i in widths), w_i [k_i, N].
SHAPES = {
    "wan-attn-qkv": ("ag", 4736, 5120, [1280, 1280, 1280], 0),
    "wan-ffn-up": ("ag", 4736, 5120, [3456], 0),
    "wan-attn-out": ("rs", 4736, 0, [1280], 5120),
    "wan-ffn-down": ("rs", 4736, 0, [3456], 5120),
    "flux-single-qkv-mlp": ("ag", 4608, 3072, [768, 768, 768, 3072], 0),
    "flux-single-out-2pairs": ("rs", 4608, 0, [768, 3072], 3072),
}


def build(name, variant, mesh):
    """(jitted function, abstract or concrete args factory) for one shape and variant."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from difflet_tpu.parallel import collective_matmul as cm

    kind, S, K, widths, N = SHAPES[name]
    impl = {"kernel": "pallas", "ring": "jax", "xla-cm": "xla", "unfused": "xla"}[variant]
    n = len(widths)
    if kind == "ag":
        fn = lambda x, *w: cm.all_gather_matmul(x, list(w), impl=impl)
        in_specs = (P("tp", None),) + (P(None, "tp"),) * n
        out_specs = [P(None, "tp")] * n
        shapes = [(S, K)] + [(K, P_RING * w) for w in widths]
    else:
        fn = lambda *a: cm.matmul_reduce_scatter(list(zip(a[:n], a[n:])), impl=impl)
        in_specs = (P(None, "tp"),) * n + (P("tp", None),) * n
        out_specs = P("tp", None)
        shapes = [(S, P_RING * k) for k in widths] + [(P_RING * k, N) for k in widths]
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    shardings = [NamedSharding(mesh, s) for s in in_specs]
    abstract = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh) for s, sh in zip(shapes, shardings)]
    return f, abstract


def flops(name):
    kind, S, K, widths, N = SHAPES[name]
    if kind == "ag":
        return 2 * S * K * sum(widths)
    return 2 * S * sum(widths) * N


def roofline_us(name, chip):
    """Lower bounds for one call per chip: MXU time at peak, HBM bytes (the kernel's
    own CostEstimate terms), ICI time (P-1 hops of one half each way, per link)."""
    kind, S, K, widths, N = SHAPES[name]
    h = S // P_RING // 2
    if kind == "ag":
        hbm = 2 * (S // P_RING * K + P_RING * K * sum(widths) + S * sum(widths))
        ici = (P_RING - 1) * h * K * 2
    else:
        hbm = 2 * (S * sum(widths) + P_RING * sum(widths) * N + S // P_RING * N)
        ici = (P_RING - 1) * h * N * 2
    return dict(mxu=flops(name) / chip.bf16_flops * 1e6, hbm=hbm / chip.hbm_bw * 1e6,
                ici=ici / chip.ici_link_bw * 1e6)


def compile_variant(f, abstract, variant):
    lowered = f.trace(*abstract).lower()
    opts = XLA_CM_OPTIONS if variant == "xla-cm" else None
    return lowered.compile(compiler_options=opts) if opts else lowered.compile()


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


def _trip_count(module, cond, body):
    """Iterations of a `counter < N` while loop whose body adds a constant step
    to the counter (XLA's decomposed collective matmuls, unrolled by 2, count
    0, 2, ...): ceil(N / step). Assumes the counter starts at 0; 1 if the
    pattern is not found."""

    def consts(comp):
        out = {}
        for ins in module.computations.get(comp, []):
            m = re.search(r"constant\((\d+)\)", ins.text)
            if ins.op == "constant" and m:
                out[ins.name] = int(m.group(1))
        return out

    def index_of(comp, name):
        for ins in module.computations.get(comp, []):
            if ins.name == name and ins.op == "get-tuple-element":
                m = re.search(r"index=(\d+)", ins.text)
                return int(m.group(1)) if m else None
        return None

    cc = consts(cond)
    bound = idx = None
    for ins in module.computations.get(cond, []):
        if ins.op == "compare" and "direction=LT" in ins.text:
            ops = ins.operands
            if len(ops) == 2 and ops[1] in cc:
                bound, idx = cc[ops[1]], index_of(cond, ops[0])
    if bound is None:
        return 1
    bc = consts(body)
    counters = {ins.name for ins in module.computations.get(body, [])
                if ins.op == "get-tuple-element" and re.search(r"index=%d\b" % idx, ins.text)}
    for _ in range(3):  # the counter may reach its add through copies
        counters |= {ins.name for ins in module.computations.get(body, [])
                     if ins.op in ("copy", "bitcast") and counters & set(ins.operands)}
    steps = [bc[o] for ins in module.computations.get(body, []) if ins.op == "add"
             for o in ins.operands if o in bc and counters & set(ins.operands)]
    step = max(steps) if steps else 1
    return max(1, -(-bound // step))


def cycle_report(text):
    """Sum of estimated_cycles over the scheduled ops of the entry computation
    and of every while body (counted trip-count times; a fusion's own estimate
    covers its body), and the async collectives / Pallas kernels run."""
    from difflet_tpu.tools import hlo

    module = hlo.parse(text)
    weight = {module.entry: 1}
    order = [module.entry]
    while order:
        comp = order.pop()
        for ins in module.computations.get(comp, []):
            if ins.op != "while":
                continue
            body = re.search(r"body=%?([\w.\-]+)", ins.text)
            cond = re.search(r"condition=%?([\w.\-]+)", ins.text)
            if body and body.group(1) not in weight:
                weight[body.group(1)] = weight[comp] * (_trip_count(module, cond.group(1), body.group(1)) if cond else 1)
                order.append(body.group(1))
    total, n_ops, collectives, kernels = 0, 0, {}, 0
    for comp, w in weight.items():
        for ins in module.computations.get(comp, []):
            m = _CYCLES.search(ins.text)
            if m:
                total += w * int(m.group(1))
                n_ops += w
            if ins.op in ("collective-permute-start", "all-gather-start", "reduce-scatter-start",
                          "all-reduce-start", "all-gather", "reduce-scatter", "all-reduce", "collective-permute"):
                collectives[ins.op] = collectives.get(ins.op, 0) + w
            if ins.op == "custom-call" and "tpu_custom_call" in ins.text:
                kernels += w
            elif ins.op == "fusion":  # e.g. XLA's reduce-scatter as an all-reduce inside a fusion
                for c in ins.calls:
                    for sub in module.computations.get(c, []):
                        if sub.op in ("all-reduce", "all-gather", "reduce-scatter"):
                            collectives[sub.op] = collectives.get(sub.op, 0) + w
    return dict(cycles=total, ops_with_estimate=n_ops, collectives=collectives, pallas_kernels=kernels,
                while_trip_counts={c: w for c, w in weight.items() if c != module.entry})


def kernel_plan(name):
    import jax.numpy as jnp

    from difflet_tpu.kernels import all_gather_matmul_stream as agk
    from difflet_tpu.kernels import matmul_reduce_scatter_stream as rsk

    kind, S, K, widths, N = SHAPES[name]
    if kind == "ag":
        reason, plan = agk.plan((S // P_RING, K), widths, jnp.bfloat16, P_RING)
    else:
        reason, plan = rsk.plan([(S, k) for k in widths], [(k, N) for k in widths], jnp.bfloat16, P_RING)
    return reason, None if plan is None else plan.vmem


def compile_only(args):
    from difflet_tpu.tools import deviceless
    from difflet_tpu.tools.estimate import CHIPS
    from difflet_tpu.kernels import _common

    mesh = deviceless.topology_mesh(args.topology)
    chip = CHIPS.get(deviceless.parse_topology(args.topology)[0])  # None: no roofline for this generation
    clock = chip.clock_hz if chip else 1.5e9
    print(f"# deviceless compile for {args.topology}, tp={P_RING}, bf16; "
          f"estimated_cycles summed over XLA ops, us at {clock / 1e9:.2f} GHz")
    print(f"# (serial sum of per-op estimates: ignores overlap and collective transfer time; a Pallas kernel "
          f"has no estimate)")
    results = {}
    for name in args.shapes:
        kind, S, K, widths, N = SHAPES[name]
        desc = (f"x [{S}, {K}] gathered, per-rank widths {widths}" if kind == "ag"
                else f"per-rank x_i [{S}, k_i], k_i {widths}, N {N}")
        print(f"\n## {name} ({'all-gather' if kind == 'ag' else 'reduce-scatter'}: {desc}; "
              f"{flops(name) / 1e9:.1f} GFLOP per rank)")
        results[name] = {}
        for variant in args.variants:
            f, abstract = build(name, variant, mesh)
            t = time.time()
            try:
                compiled = compile_variant(f, abstract, variant)
            except Exception as e:  # report and go on
                print(f"  {variant:<8} compile FAILED: {type(e).__name__}: {str(e)[:300]}")
                continue
            secs = time.time() - t
            text = compiled.as_text()
            rep = cycle_report(text)
            mem = deviceless.memory_report(compiled)
            line = (f"  {variant:<8} est {rep['cycles']:>10,} cycles = {rep['cycles'] / clock * 1e6:8.1f} us"
                    f" over {rep['ops_with_estimate']:3d} ops; collectives {rep['collectives'] or '-'}")
            if rep["while_trip_counts"]:
                line += f"; loop x{max(rep['while_trip_counts'].values())}"
            if rep["pallas_kernels"]:
                line += f"; pallas kernels {rep['pallas_kernels']}"
            line += f"; HBM temp {mem['temporaries'] / 2**20:.1f} MiB; compile {secs:.1f}s"
            print(line)
            rec = dict(rep, temp_bytes=mem["temporaries"], compile_s=round(secs, 1))
            if variant == "kernel":
                reason, plan = kernel_plan(name)
                vm = [k for k in _common.kernel_vmem_from_hlo(text)]
                rec["vmem"] = vm
                if reason:
                    print(f"           kernel unsupported ({reason}): the dispatch compiled the ring instead")
                else:
                    print("           kernel VMEM plan:")
                    print("         " + plan.describe().replace("\n", "\n         "))
                    if chip:
                        r = roofline_us(name, chip)
                        rec["roofline_us"] = r
                        print(f"           kernel roofline: MXU {r['mxu']:.0f} us, HBM {r['hbm']:.0f} us, "
                              f"ICI {r['ici']:.0f} us (one half per hop each way) -> >= {max(r.values()):.0f} us")
                    for k in vm:
                        print(f"           Mosaic: requested {k['requested'] / 2**20:.2f} MiB, "
                              f"used {k['used'] / 2**20:.2f} MiB ({k['name']})")
            results[name][variant] = rec
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


def timed(args):
    import jax
    import numpy as np

    from difflet_tpu.parallel.mesh import make_mesh

    if jax.default_backend() != "tpu":
        sys.exit("no TPU here: use --compile-only for compiler estimates")
    mesh = make_mesh(P_RING)
    print(f"# {jax.devices()[0].device_kind} x{P_RING}, bf16, median ms per call over {args.iters} calls")
    print(f"{'shape':<24}" + "".join(f"{v:>10}" for v in args.variants) + "   kernel TFLOP/s per chip")
    for name in args.shapes:
        row = {}
        for variant in args.variants:
            f, abstract = build(name, variant, mesh)
            compiled = compile_variant(f, abstract, variant)
            rng = np.random.default_rng(0)
            xs = [jax.device_put((rng.standard_normal(a.shape) * 0.1).astype(a.dtype), a.sharding)
                  for a in abstract]
            for _ in range(3):
                jax.block_until_ready(compiled(*xs))
            ts = []
            for _ in range(args.iters):
                t = time.perf_counter()
                jax.block_until_ready(compiled(*xs))
                ts.append(time.perf_counter() - t)
            row[variant] = statistics.median(ts) * 1e3
        tf = flops(name) / (row["kernel"] * 1e-3) / 1e12 if "kernel" in row else float("nan")
        print(f"{name:<24}" + "".join(f"{row[v]:>10.3f}" for v in args.variants) + f"   {tf:.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true", help="deviceless compile, print compiler estimates")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, from: " + ", ".join(SHAPES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", help="also write the compile-only results here")
    args = ap.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    for s in args.shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}")
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}")
    if args.compile_only:
        from difflet_tpu.tools import deviceless

        deviceless.setup_process(args.topology)  # before jax initialises
        compile_only(args)
    else:
        timed(args)


if __name__ == "__main__":
    main()
