"""Step cache estimates for a TPU topology, deviceless (docs/caching.md, docs/benchmarks.md).

    python -m difflet_tpu.tools.step_cache_estimate [--model flux] [--topology v5e:2x2]
        [--mode sp] [--first 1] [--last 0] [--steps 28] [--json out.json]

Compiles, for the model's released preset at its bench shape (abstract weights, no memory):
the plain step, the cached step as it runs (one program, the decision by `lax.cond` at run
time), and that program with the decision compiled in (a full pass; a cached call), and prices
each with the schedule estimator (difflet_tpu.tools.estimate, calibrated). The loop time as a
function of the cached fraction r of the steps is then `steps x ((1 - r) full + r cached)`.
Every number is an estimate, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.tools.step_cache_estimate", description=__doc__)
    ap.add_argument("--model", default="flux")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--mode", default="sp", choices=("tp", "sp"))
    ap.add_argument("--first", type=int, default=1)
    ap.add_argument("--last", type=int, default=0)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from difflet_tpu.tools import deviceless

    devices, chip, calibration = deviceless.compile_target(args.topology)
    import jax.numpy as jnp

    from difflet_tpu import step_cache as SC
    from difflet_tpu.bench.compile_only import COMPILE_VARIANTS, abstract_trace
    from difflet_tpu.bench.cases import build_config
    from difflet_tpu.config import Config, StepCacheOptions
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.tools import estimate as E
    from difflet_tpu.tools.calibration import expected_ms

    spec, preset = PL.resolve_model(args.model)
    cfg = build_config(spec, preset)
    mesh = make_mesh(devices=devices)
    pmode, overrides = COMPILE_VARIANTS[args.mode]
    config = Config.from_env(compile_cache=None, **overrides)
    inputs = spec.example_inputs(cfg, **spec.bench_shape, batch=1, seed=0, dtype=jnp.bfloat16)
    options = StepCacheOptions(first=args.first, last=args.last)

    def priced(name, traced):
        t0 = time.perf_counter()
        compiled = traced.lower().compile()
        text = compiled.as_text()
        ms = expected_ms(E.summarize(E.estimate(text, chip)), calibration)
        mem = deviceless.memory_report(compiled)
        row = dict(program=name, estimate_ms=round(ms, 2), compile_s=round(time.perf_counter() - t0, 1),
                   hbm_total_bytes=mem["total"], temporaries_bytes=mem["temporaries"])
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    import jax
    import numpy as np

    runner, plain = abstract_trace(spec, cfg, inputs, mesh, config, pmode, jnp.bfloat16)

    kw = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) if isinstance(v, np.ndarray) else v
          for k, v in inputs.items()}
    rows = [priced("plain step", plain),
            priced("cached step (lax.cond, decided at run time)", SC.trace_cached(runner, options, **kw)),
            priced("  its full pass (decision compiled in)", SC.trace_cached(runner, options, SC.FULL, **kw)),
            priced("  its cached call (decision compiled in)", SC.trace_cached(runner, options, SC.CACHED, **kw))]
    full, cached = rows[2]["estimate_ms"], rows[3]["estimate_ms"]
    loop = {f"{r:.2f}": round(args.steps * ((1 - r) * full + r * cached), 1) for r in (0, 0.25, 0.5, 0.6, 0.75)}
    report = dict(model=f"{spec.name}:{preset}", shape=spec.bench_shape, topology=args.topology, mode=args.mode,
                  options=options.spec(), cache_bytes_per_device=SC.cache_bytes(runner, options, **kw),
                  programs=rows, steps=args.steps, loop_ms_by_cached_fraction=loop,
                  note="estimates from the compiled schedules (difflet_tpu.tools.estimate), not measurements")
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
