"""`--compile-only`: the real config compiled for a TPU topology (deviceless), HBM and an ESTIMATE."""

from __future__ import annotations

import os
import sys
import time
from difflet_tpu.bench.cases import BenchError, build_config, guidance_for, mesh_axes_for, shape_for
from difflet_tpu.bench.report import ms, print_compile_table, write_json
from difflet_tpu.bench.run import XLA_CM_FLAGS


COMPILE_VARIANTS = {  # compile-only: mode -> (parallel mode, Config overrides)
    "tp": ("tp", {}),
    "sp": ("sp", {"sp_kernel": "jax"}),
    "sp-pallas": ("sp", {"sp_kernel": "pallas"}),
    "sp-xla": ("sp-xla", {}),
}


def expert_memory(mem: dict, other: int, setting: str, chip) -> tuple[dict, dict]:
    """--compile-only HBM per chip of a two-expert model and its offload report.

    `other`: the other expert's parameter bytes per chip (the experts have the same
    shapes). Off (or "auto" when both fit `chip.hbm_bytes`): it is resident, added to
    the total as `other_experts`. On: it waits in host memory (`host_experts`, not in
    the total), each switch copies it in, estimated at `runtime.H2D_BYTES_PER_S` (an
    assumption, cited there); once both experts have been offloaded the host keeps a
    copy of each (`host_bytes_per_chip`), so a switch back costs one copy too."""
    from difflet_tpu import runtime

    both = mem["total"] + other
    enabled = setting == "on" or (setting == "auto" and both > chip.hbm_bytes)
    report = dict(setting=setting, enabled=enabled, all_resident_bytes=both)
    if not enabled:
        return dict(mem, other_experts=other, total=both), report
    bw = runtime.H2D_BYTES_PER_S.get(chip.name)
    report.update(idle_expert_bytes_per_chip=other, host_bytes_per_chip=2 * other, h2d_bytes_per_s=bw,
                  swap_ms_estimate=None if bw is None else ms(other / bw),
                  h2d_source="assumption: PCIe ~1.5e10 B/s per chip (v6e 3.2e10), "
                             "https://jax-ml.github.io/scaling-book/tpus/")
    return dict(mem, other_experts=0, host_experts=other), report


def abstract_trace(spec, cfg, inputs, mesh, config, mode, dtype):
    """(Runner, traced step) of the model with abstract weights (no memory) on `mesh`
    for `inputs` (arrays stand in as ShapeDtypeStructs): a deviceless compile's input,
    and the tile sweep's walk over the kernel sites."""
    import jax
    import numpy as np
    from flax import nnx

    from difflet_tpu import runtime
    from difflet_tpu.runner import Runner

    model = runtime.abstract_model(lambda: spec.build(cfg, dtype=dtype, rngs=nnx.Rngs(0)), mesh, spec.plan)
    runner = Runner(model, mesh, config, mode=mode)
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) if isinstance(v, np.ndarray) else v
                for k, v in inputs.items()}
    return runner, runner.trace(**abstract)


def compile_one(spec, preset, cfg, shape, variant, mesh, chip, calibration, args, batch):
    import jax.numpy as jnp

    from difflet_tpu.tools import deviceless
    from difflet_tpu.tools import estimate as E
    from difflet_tpu.config import Config

    fam = spec.name
    from difflet_tpu.parallel.mesh import _coords, format_mesh, ring_hops, tp_groups

    pmode, overrides = COMPILE_VARIANTS[variant]
    # no compile cache: a deviceless compile writes entries it can never load
    config = Config.from_env(compile_cache=None, **overrides)
    P = mesh.devices.size
    inputs = spec.example_inputs(cfg, **shape, batch=batch, seed=0, dtype=jnp.bfloat16)
    analytic = float(spec.flops(cfg, inputs))
    attention = getattr(args, "attention", None)
    if attention is not None:
        if "attention" not in spec.extra_kwargs:
            raise BenchError(f"--attention: {fam} has no block-sparse attention yet (Wan, HunyuanVideo and LTX-2 have)")
        inputs = dict(inputs, attention=attention)
    t0 = time.perf_counter()
    runner, traced = abstract_trace(spec, cfg, inputs, mesh, config, pmode, jnp.bfloat16)
    lowered = traced.lower()
    compiled = lowered.compile(compiler_options=dict(XLA_CM_FLAGS) if pmode == "sp-xla" else None)
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    if args.dump_hlo:
        from difflet_tpu import checks

        os.makedirs(args.dump_hlo, exist_ok=True)
        checks.write_atomic(os.path.join(args.dump_hlo, f"{fam}-{preset}-{variant}.hlo.txt"), text, "--dump-hlo")
    mem = deviceless.memory_report(compiled)
    # a two-expert model (Wan2.2 A14B): the other expert has this one's shapes and shardings,
    # resident beside the step's or, offloaded, in host memory
    offload = None
    if spec.experts.get(preset) is not None:
        mem, offload = expert_memory(mem, runner.param_bytes(), args.offload, chip)  # the Runner's plan
    cost = compiled.cost_analysis() or {}
    from difflet_tpu.tools.calibration import expected_ms

    raw = E.estimate(text, chip)
    breakdown = E.summarize(raw)
    expected = expected_ms(breakdown, calibration)  # the raw estimate calibrated per kind of work
    ideal = analytic / (P * chip.bf16_flops)
    sp_kernel = config.ag_kernel("pallas", "tpu") if pmode == "sp" else None
    rs_kernel = config.rs_kernel("tpu", chip) if pmode == "sp" else None
    coords = {d.id: _coords(d)[:3] for d in mesh.devices.flat}
    hops = [ring_hops(g, coords) for g in tp_groups(mesh)]
    return dict(
        model=f"{fam}:{preset}", family=fam, preset=preset, mode=variant, parallel_mode=pmode,
        attention=attention or "dense",
        **({"attention_density": float(next(iter(breakdown["attention_density"])))}
           if len(breakdown.get("attention_density", {})) == 1 else {}),
        ag_impl=sp_kernel, rs_impl=rs_kernel, shape=shape, batch=batch, chips=P, mesh=format_mesh(dict(mesh.shape)),
        tp_ring_max_hops=max(max(h) for h in hops), compile_s=round(compile_s, 2),
        hbm=dict(mem, capacity=chip.hbm_bytes, fits=mem["total"] <= chip.hbm_bytes),
        flops=dict(xla_per_chip=cost.get("flops"), analytic_total=analytic, analytic_per_chip=analytic / P),
        ideal_ms=ms(ideal), estimate_ms=round(expected if args.calibrated == "yes" else 1e3 * raw.total, 3),
        estimate_raw_ms=ms(raw.total), estimate_calibrated_ms=round(expected, 3), calibration=calibration.as_dict(),
        breakdown=breakdown, breakdown_raw=breakdown, schedule_overlap=E.schedule_overlap(text),
        compiler_options=XLA_CM_FLAGS if pmode == "sp-xla" else {},
        **({} if offload is None else dict(expert_offload=offload)),
    )


def run_compile_only(args):
    """Deviceless compiles for `--topology`: HBM per chip, FLOPs, collectives, estimated step time."""
    from difflet_tpu.tools import deviceless

    try:
        devices, chip, calibration = deviceless.compile_target(args.topology)
    except ValueError as e:
        raise BenchError(str(e)) from None
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.parallel.mesh import format_mesh, make_mesh
    if args.model:
        models = [PL.resolve_model(m) for m in args.model]
    else:
        from difflet_tpu.models import specs

        models = [(s, s.released) for s in specs().values()]
    results, failed = [], False
    for spec, preset in models:
        cfg = build_config(spec, preset)
        shape = shape_for(spec, preset, args)
        _, guided = guidance_for(spec, args)
        batch = args.batch * (2 if guided else 1)
        try:
            axes = mesh_axes_for(spec, cfg, len(devices), batch, args.mesh_axes, guided)
        except BenchError as e:
            failed = True
            results.append(dict(model=f"{spec.name}:{preset}", mode="-", mesh=args.mesh or "-", error=str(e)))
            continue
        mesh = make_mesh(devices=devices, **axes)
        for variant in args.modes:
            name = f"{spec.name}:{preset}"
            print(f"compiling {name} {variant} on {format_mesh(dict(mesh.shape))} for {args.topology} ...",
                  file=sys.stderr, flush=True)
            try:
                results.append(compile_one(spec, preset, cfg, shape, variant, mesh, chip, calibration, args, batch))
            except Exception as e:  # noqa: BLE001
                failed = True
                results.append(dict(model=name, mode=variant, mesh=format_mesh(dict(mesh.shape)),
                                    error=f"{type(e).__name__}: {str(e)[:400]}"))
    for r in results:
        if "error" in r:
            continue
        tp = next((x for x in results if x.get("model") == r["model"] and x.get("mesh") == r["mesh"]
                   and x.get("mode") == "tp" and "error" not in x), None)
        if tp and r["mode"] != "tp":
            r["ratio_vs_tp"] = round(r["estimate_ms"] / tp["estimate_ms"], 3)
    print_compile_table(results, args.topology, chip, calibration)
    if args.json:
        from difflet_tpu.config import Config

        write_json(args.json, dict(kind="compile-only", topology=args.topology, chip=chip.to_dict(),
                                   calibration=dict(calibration.as_dict(), band=calibration.band,
                                                    source=calibration.source), kernel_tiles=Config.from_env().kernel_tiles,
                                   note="estimates from the compiled schedule, not measurements", results=results))
    return 1 if failed else 0
