"""python -m difflet_tpu.check [--json r.json] [--md r.md] [--mesh AXIS=SIZE,...] [--only SECTIONS] [--quick]
                              [--compile-only --topology v5e:2x2]

Sections (`--only`, comma list; default all): ports (tiny presets, one device /
TP / SP, float32 and bf16, against float64), streaming (the streaming kernels at
1-3 chunks), sites (both kernels at every collective-matmul site of the bench
cases against the plain collectives; timed on a TPU), steps (one denoise step per
released model, timed on a TPU), pr-ops (the reference PR's four op-level
reduce-scatter sites, ring and kernel; also part of `sites` on a 4-chip ring).

Exit status: 0 every row passed, 1 a row failed (the report says which), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from difflet_tpu.check.steps import SITE_CASES  # light: no jax

SECTIONS = ("ports", "streaming", "sites", "steps", "pr-ops")
NO_TPU = ("No TPU was found: the ports and the kernels ran on CPU devices (the kernels in Pallas interpret "
          "mode) and NOTHING WAS TIMED; every number below that is not an error is a numerical check. "
          "Run the same command on a TPU VM for timings.")
DEVICELESS = ("Deviceless compile for {topology}: every kernel site and step the TPU path would run was "
              "compiled for the chip and priced by the estimator; NOTHING RAN AND NOTHING WAS TIMED.")
ON_TPU = ("Ran on a TPU: numerical checks against float64 / the plain collectives, and measured times (median "
          "of --iters calls, each waited on) beside the estimator's price of the same compiled program.")


def parser():
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="the report as JSON (its directory must exist)")
    ap.add_argument("--md", help="the report as Markdown (default: the --json path with .md)")
    ap.add_argument("--mesh", help="device mesh AXIS=SIZE,... over cfg, data, tp (default: one tp ring)")
    ap.add_argument("--only", help="comma list of " + ", ".join(SECTIONS))
    ap.add_argument("--ports", help="comma list of ports for `ports` (default: every port)")
    ap.add_argument("--cases", help="comma list of bench cases for `sites` and `steps` (default: every one)")
    ap.add_argument("--max-sites", type=int, help="check at most this many sites (first found)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: one port (wan) in float32, two sites, three streaming cases")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per site (steps: a quarter, at least 3)")
    ap.add_argument("--compile-only", action="store_true", help="deviceless compiles for --topology, nothing run")
    ap.add_argument("--topology", help="TPU topology for --compile-only, e.g. v5e:2x2")
    ap.add_argument("--cpu-devices", type=int, default=4, help="virtual CPU devices without a TPU")
    return ap


def validate(args, ap):
    from difflet_tpu import models

    if args.compile_only != bool(args.topology):
        ap.error("--compile-only and --topology go together (e.g. --compile-only --topology v5e:2x2)")
    from difflet_tpu import arguments as A, checks
    from difflet_tpu.config import Config, ConfigError

    try:
        A.integer("--iters", args.iters, limit="iters")
        if args.max_sites is not None:
            A.integer("--max-sites", args.max_sites, minimum=1)
        A.integer("--cpu-devices", args.cpu_devices, minimum=2, limit="cpu_devices")
    except A.ArgumentError as e:
        ap.error(str(e))
    if args.topology:
        from difflet_tpu.tools import deviceless, estimate as E

        try:
            deviceless.accelerator_type(args.topology)
            deviceless.parse_topology(args.topology)
            E.chip_for(args.topology)
        except ValueError as e:
            ap.error(f"--topology {args.topology}: {e}")
    try:  # every DIFFLET_TPU_* toggle, though a section may not read it: a typo is never a pass
        Config.from_env()
    except ConfigError as e:
        ap.error(str(e))
    args.sections = args.only.split(",") if args.only else [s for s in SECTIONS if s != "pr-ops"]
    for s in args.sections:
        if s not in SECTIONS:
            ap.error(f"--only: unknown section {s!r}; sections: {', '.join(SECTIONS)}")
    args.port_list = args.ports.split(",") if args.ports else (["wan"] if args.quick else list(models.PORTS))
    for p in args.port_list:
        if p not in models.PORTS:
            ap.error(f"--ports: unknown port {p!r}; ports: {', '.join(models.PORTS)}")
    args.case_list = args.cases.split(",") if args.cases else None
    for c in args.case_list or []:
        if c not in SITE_CASES:
            ap.error(f"--cases: unknown case {c!r}; cases: {', '.join(SITE_CASES)}")
    args.md_path = args.md if args.md is not None else (
        os.path.splitext(args.json)[0] + ".md" if args.json else None)
    try:  # the two reports: writable, not the same file, not under /proc or /sys, not '' (checks.py)
        checks.check_outputs([("--json", args.json), ("--md", args.md_path)])
    except ValueError as e:
        ap.error(str(e))
    args.mesh_axes = None
    if args.mesh:
        from difflet_tpu.parallel.mesh import parse_mesh

        try:
            args.mesh_axes = parse_mesh(args.mesh)
        except ValueError as e:
            ap.error(f"--mesh: {e}")


def setup(args):
    """(mode, devices, chip): "compile" (deviceless), "tpu" or "cpu"; before jax initialises."""
    from difflet_tpu.bench.cases import has_tpu

    if args.compile_only:
        from difflet_tpu.tools import deviceless

        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        deviceless.setup_process(args.topology)
        from difflet_tpu.tools import estimate as E

        return "compile", deviceless.topology_devices(args.topology), E.chip_for(args.topology)
    if has_tpu():
        import jax

        from difflet_tpu.tools import estimate as E

        if jax.process_count() > 1:
            raise SystemExit("error: the check runs in one process (a single-host slice, e.g. a v5e-4); "
                             f"this run has {jax.process_count()}")
        return "tpu", jax.devices(), E.chip_for_device(jax.devices()[0])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from difflet_tpu.parallel.mesh import use_cpu_devices

    use_cpu_devices(args.cpu_devices)
    import jax

    return "cpu", jax.devices()[: args.cpu_devices], None


def site_list(args, mode, mesh, log):
    """[(Site, [case names], PR op name or None)] for this run."""
    import jax.numpy as jnp

    from difflet_tpu.check import sites
    from difflet_tpu.kernels import tiles as kernel_tiles
    from difflet_tpu.tools import calibration

    out = []
    if "sites" in args.sections:
        names = args.case_list or (["wan"] if args.quick else list(SITE_CASES))
        found = sites.discover({n: SITE_CASES[n] for n in names}, mesh, jnp.bfloat16, log)
        if mode == "cpu":  # the bench sites' structure at 128 rows x 128 columns, interpret mode
            small: dict = {}
            for s, c in found:
                small.setdefault(sites.shrink(s), []).extend(c)
            found = list(small.items())
        limit = 2 if args.quick and args.max_sites is None else args.max_sites
        out += [(s, c, None) for s, c in found[:limit]]
    if "pr-ops" in args.sections or ("sites" in args.sections and mode != "cpu" and not args.case_list):
        if mesh.shape["tp"] == 4:
            for name, ((xs, ws), _, _) in calibration.REFERENCE_PR_OPS.items():
                out.append((kernel_tiles.Site("rs", xs, ws, "bfloat16", 4), ["the reference PR"], name))
        else:
            log(f"pr-ops: the PR's op sites are on a ring of 4; this mesh's tp is {mesh.shape['tp']}: skipped")
    return out


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    validate(args, ap)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    mode, devices, chip = setup(args)

    from difflet_tpu.check import numerics, report as R, sites, steps
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.tools import calibration

    factors = calibration.CALIBRATION.get(chip.name if chip else "", calibration.Factors())
    note = {"cpu": NO_TPU, "compile": DEVICELESS.format(topology=args.topology), "tpu": ON_TPU}[mode]
    rep = dict(kind="difflet-tpu check", platform={"cpu": "cpu (no TPU found)", "compile": "deviceless",
                                                   "tpu": "tpu"}[mode],
               timed=mode == "tpu", note=note, topology=args.topology,
               devices=f"{len(devices)} x {devices[0].device_kind}" if mode != "cpu" else f"{len(devices)} CPU devices",
               chip=chip.to_dict() if chip else None, versions=R.versions(),
               calibration=calibration.describe(factors) if mode != "cpu" else "not used (nothing timed)",
               factors=factors.as_dict(), command="python -m difflet_tpu.check " + " ".join(argv or sys.argv[1:]))
    if "ports" in args.sections:
        if mode == "compile":
            rep["ports_note"] = "not compiled deviceless (they need concrete values): run on the TPU"
        else:
            dtypes = ("float32",) if args.quick else ("float32", "bfloat16")
            rep["ports"] = [r for p in args.port_list for r in numerics.check_port(p, args.mesh_axes, dtypes, log=log)]
    if {"streaming", "sites", "pr-ops"} & set(args.sections):
        tp = (args.mesh_axes or {}).get("tp") or 4
        if len(devices) < tp:
            raise SystemExit(f"error: the kernel sections need a ring of {tp} devices; there are {len(devices)}")
        ring = make_mesh(devices=devices[:tp], tp=tp)
        if "streaming" in args.sections:
            cases = sites.STREAMING[::2] if args.quick else sites.STREAMING
            rep["streaming"] = sites.check_streaming(ring, mode, cases)
            log(f"streaming: {sum('error' not in r for r in rep['streaming'])}/{len(rep['streaming'])} passed")
        rep["sites"] = []
        for site, where, pr_op in site_list(args, mode, ring, log):
            rows = sites.check_site(site, ring, mode=mode, chip=chip, iters=args.iters,
                                    name=f"{pr_op} {sites.describe(site)}" if pr_op else None)
            for r in rows:
                r["cases"] = where
                if pr_op:
                    r["pr_op"] = pr_op
            log(f"site {sites.describe(site)}: " + "; ".join(f"{r['impl']} {r.get('error', 'ok')}" for r in rows))
            rep["sites"] += rows
    if "steps" in args.sections:
        if mode == "cpu":
            rep["steps_note"] = "no TPU: the released models' steps were not run (--compile-only compiles them)"
        else:
            names = [n for n in (args.case_list or list(steps.CASES)) if n in steps.CASES]
            rep["steps"] = [r for n in names for r in steps.check_step(
                n, args.mesh_axes, devices, mode=mode, chip=chip, iters=max(3, args.iters // 4), log=log)]
    R.annotate(rep, factors)
    fails = R.failures(rep)
    rep["passed"] = not fails
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    md = R.markdown(rep)
    from difflet_tpu import checks

    outputs = [(args.md_path, md, "--md")] if args.md_path else []
    if args.json:
        outputs.append((args.json, json.dumps(rep, indent=1, default=str, allow_nan=False), "--json"))
    try:
        checks.write_all_atomic(outputs)  # both reports or neither
    except checks.WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(md)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
