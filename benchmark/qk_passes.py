"""The q/k path of self-attention (norm -> RoPE -> splash), compiled deviceless: ESTIMATES.

`python benchmark/qk_passes.py [--variant wan|flux|all] [--sumsq-given] [--topology v5e:2x2]`

Compiles, for one chip of a `tp`-way mesh (v5e:2x2: tp=4) inside `shard_map`,
the piece of one self-attention layer after the all-gather matmuls: q, k, v
`[1, S, H_local * D]` in bf16 (every row, this rank's heads), the q/k norms
of the shared layers in the ports' call order, split-halves RoPE, and the
splash attention call (`layers.attention.attend`, impl "splash"). Variants:

* wan:  Wan2.1-14B 480x832x9 (S 4736, 40 heads x 128, 10 per chip): RMSNorm over
  all heads (`rms_norm_across_heads`, the per-row sum of squares psum'd over tp);
* flux: FLUX.1 1024x1024 (S 4608, 24 heads x 128, 6 per chip): per-head RMSNorm.

`--sumsq-given` (wan): the per-row partial sum of squares of q and k comes in as
an input (as if the matmul kernel emitted it), so only the psum and the
elementwise passes remain.

Prints the estimator's price (difflet_tpu.tools.estimate, uncalibrated and with the
v5e factor) of every priced op of the compiled module in schedule order, and the
sum of the ops that are not the attention kernel, also without the piece's
boundary ops: an [input] relayout copy of a parameter (XLA picks the layout of
the q/k reduction and copies the default-layout input into it; inside a model
the producing matmul is laid out instead, or copies the same way) and the
[output] op (attention output back to `[B, S, H * D]`, present in a model too).
That remainder is the q/k path of one layer. ~5 s of compile per variant.

Caveats of a piece this small: its intermediates fit in VMEM (`S(1)` layouts),
and the compiler prices some layout-changing copies at a fixed ~1900 cycles
whatever their size; a full step (`python -m difflet_tpu.bench --compile-only`)
is the check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

VARIANTS = {  # name -> (rows S, heads total, head_dim, norm)
    "wan": (4736, 40, 128, "across"),
    "flux": (4608, 24, 128, "per_head"),
}


def build(variant: str, tp: int, sumsq_given: bool):
    """(function, abstract inputs, in_specs) of the per-chip piece."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from difflet_tpu.layers.attention import attend, merge_heads, split_heads
    from difflet_tpu.layers.rope import apply_rotary_emb
    from difflet_tpu.layers.normalization import rms_norm, rms_norm_across_heads
    from difflet_tpu.parallel.mesh import TP
    from difflet_tpu.parallel.modes import Parallel

    S, heads, D, norm = VARIANTS[variant]
    dim = heads * D
    eps = 1e-6
    par = Parallel(mode="sp", size=tp, attn_impl="splash")
    bf16, f32 = jnp.bfloat16, jnp.float32
    act = jax.ShapeDtypeStruct((1, S, dim), bf16)
    table = jax.ShapeDtypeStruct((S, D), f32)
    cols = P(None, None, TP)
    if norm == "across":
        w = jax.ShapeDtypeStruct((dim,), bf16)
        w_spec = P(TP)
    else:
        w = jax.ShapeDtypeStruct((D,), bf16)
        w_spec = P()
    args = [act, act, act, table, table, w, w]
    specs = [cols, cols, cols, P(), P(), w_spec, w_spec]
    if sumsq_given:
        if norm != "across":
            raise ValueError("--sumsq-given prices the across-heads norm (wan)")
        ss = jax.ShapeDtypeStruct((1, S, tp), f32)  # each rank's partial, one column per rank
        args += [ss, ss]
        specs += [P(None, None, TP), P(None, None, TP)]

    def piece(q, k, v, cos, sin, wq, wk, ssq=None, ssk=None):
        if norm == "across":  # WanAttention.self_attention
            q = rms_norm_across_heads(par, q, wq, eps, dim, sum_sq=ssq)
            k = rms_norm_across_heads(par, k, wk, eps, dim, sum_sq=ssk)
            q, k = split_heads(q, D), split_heads(k, D)
        else:  # per head (FLUX, HunyuanVideo), unfused
            q = rms_norm(split_heads(q, D), wq, eps)
            k = rms_norm(split_heads(k, D), wk, eps)
        v = split_heads(v, D)
        q = apply_rotary_emb(q, cos[:, None], sin[:, None], True)
        k = apply_rotary_emb(k, cos[:, None], sin[:, None], True)
        return merge_heads(attend(par, q, k, v))

    return piece, args, specs, cols


def priced_ops(text: str, chip, calibration):
    """[(name, op, category, seconds, output type, boundary)] in schedule order, and the
    Estimate. `boundary`: "input" for a relayout copy of an entry parameter (the
    piece's inputs arrive in the default layout; in a model the producing matmul
    decides), "output" for the op writing the result (attention output back to
    `[B, S, H * D]` for the out projection), else ""."""
    from difflet_tpu.tools import estimate as E

    class Recorder(E.Simulator):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.rows = []

        def compute_cost(self, comp, o):
            cat, s = super().compute_cost(comp, o)
            if cat != "free":
                self.rows.append([o, cat, s])
            return cat, s

        def transfer(self, comp, o, kind):
            dur, nbytes, res = super().transfer(comp, o, kind)
            self.rows.append([o, "collective:" + kind, dur])
            return dur, nbytes, res

    module = E.parse(text)
    sim = Recorder(module, chip, calibration, E.num_partitions(text))
    sim.run()
    sim.est.total = max([sim.t] + [f for f, _, _ in sim.pending.values()])
    entry = module.computations[module.entry]
    from_param = set()
    for o in entry:  # parameters and their async copies / bitcasts
        if o.op == "parameter" or (o.op in ("copy-start", "copy-done", "bitcast")
                                   and any(n in from_param for n in o.operands)):
            from_param.add(o.name)
    by_name = {o.name: o for o in entry}
    out = set()
    root = next((o for o in entry if o.text.lstrip().startswith("ROOT")), entry[-1] if entry else None)
    todo = [root.name] if root is not None else []
    while todo:  # the root's producers through bitcasts / tuples
        n = todo.pop()
        o = by_name.get(n)
        if o is None or n in out:
            continue
        out.add(n)
        if o.op in ("bitcast", "tuple", "get-tuple-element"):
            todo += o.operands
    rows = []
    for o, cat, s in sim.rows:
        boundary = ("input" if o.op == "copy" and any(n in from_param for n in o.operands)
                    else "output" if o.name in out else "")
        rows.append((o.name, o.op, cat, s, o.type.split("{")[0][:80], boundary))
    return rows, sim.est


def run(variant: str, topology: str, sumsq_given: bool, dump: str | None):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from difflet_tpu.tools import deviceless
    from difflet_tpu.tools import calibration, estimate as E

    _, dims = deviceless.parse_topology(topology)
    tp = 1
    for d in dims:
        tp *= d
    mesh = deviceless.topology_mesh(topology, tp)
    piece, args, specs, out_spec = build(variant, tp, sumsq_given)
    fn = jax.shard_map(piece, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    t0 = time.perf_counter()
    compiled = jax.jit(fn).trace(*args).lower().compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    if dump:
        with open(dump, "w") as f:
            f.write(text)
    chip = E.chip_for(topology)
    # this ablation prices op by op with the replay's non-matmul knob, at today's non-matmul factor
    factors = calibration.CALIBRATION.get(chip.name, calibration.Factors())
    cal = calibration.Calibration(nonmatmul=factors.nonmatmul, source=factors.source)
    rows, est = priced_ops(text, chip, E.Calibration())
    rows_cal, est_cal = priced_ops(text, chip, cal)
    name = variant + (" (sum of squares given)" if sumsq_given else "")
    print(f"\n== {name}: {topology}, compiled in {compile_s:.1f} s; us per op (raw / x{cal.nonmatmul} calibrated)")
    total = total_cal = qk = qk_cal = 0.0
    for (n, op, cat, s, ty, boundary), row_cal in zip(rows, rows_cal):
        sc = row_cal[3]
        attn = cat == "pallas"
        tag = " [attention]" if attn else f" [{boundary}]" if boundary else ""
        print(f"  {1e6 * s:8.1f} {1e6 * sc:8.1f}  {cat:22s} {op:12s} {n:40s} {ty}{tag}")
        if not attn:
            total += s
            total_cal += sc
            if not boundary:
                qk += s
                qk_cal += sc
    print(f"  non-attention ops: {1e6 * total:.1f} us raw, {1e6 * total_cal:.1f} us calibrated; without "
          f"[input]/[output]: {1e6 * qk:.1f} / {1e6 * qk_cal:.1f} us "
          f"(module {1e6 * est.total:.1f} / {1e6 * est_cal.total:.1f} us)")
    return dict(variant=name, compile_s=round(compile_s, 1), non_attention_us=round(1e6 * total, 1),
                non_attention_calibrated_us=round(1e6 * total_cal, 1), qk_path_us=round(1e6 * qk, 1),
                qk_path_calibrated_us=round(1e6 * qk_cal, 1), module_us=round(1e6 * est.total, 1),
                ops=[dict(name=n, op=op, category=cat, us=round(1e6 * s, 2), type=ty, boundary=b)
                     for n, op, cat, s, ty, b in rows])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="all", choices=[*VARIANTS, "all"])
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--sumsq-given", action="store_true", help="wan: the per-row sum of squares is an input")
    ap.add_argument("--dump-hlo", help="write the compiled HLO text here (one variant)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    from difflet_tpu.tools import deviceless

    deviceless.setup_process(args.topology)
    runs = [(v, False) for v in VARIANTS] + [("wan", True)] if args.variant == "all" else \
        [(args.variant, args.sumsq_given)]
    results = [run(v, args.topology, s, args.dump_hlo) for v, s in runs]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
