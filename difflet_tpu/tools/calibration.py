"""The estimate's calibration: factors per kind of work, fit on measured TPU times.

Every figure the bench, the README and docs/benchmarks.md call "expected on a
TPU (estimate)" is `expected_ms(breakdown, CALIBRATION[chip])`, with the
constants here and only these.

The estimator (difflet_tpu.tools.estimate) splits a modelled program into
kinds of work; `Factors` scales each kind by how far the estimator was from
measured times on it:

  matmul     XLA fusions that contain a dot (priced by the compiler's cycles)
  nonmatmul  other XLA work: elementwise / norm / reduction fusions, copies
  transfer   ICI time the compute stream waits for: synchronous collectives
             (TP's all-reduces) and exposed ring / kernel transfers
  pallas     Pallas kernels (the collective matmuls, splash attention),
             priced at their MXU / HBM rooflines

`fit` finds them by least squares on relative errors over measured points
(`Point`: a step or one collective-matmul call, its measured ms and the
estimator's raw breakdown of the same program), holding the schedule's
overlap fixed: a factor scales the time of a kind of work, not when it runs.
The points today are the reference PR's v5e-4 measurements
(`reference_points`); `python -m difflet_tpu.tools.calibration --from-check
REPORT` refits them from a `python -m difflet_tpu.check` report of a real TPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Iterable

TERMS = ("matmul", "nonmatmul", "transfer", "pallas")


@dataclasses.dataclass(frozen=True)
class Factors:
    """Scales per kind of work (`TERMS`); 1.0 = the raw estimate. `band`: the fit's
    smallest and largest relative residual (expected / measured - 1) on its points."""

    matmul: float = 1.0
    nonmatmul: float = 1.0
    transfer: float = 1.0
    pallas: float = 1.0
    band: tuple = (0.0, 0.0)
    source: str = "uncalibrated"

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in TERMS}


# The fitted factors per chip. `python -m difflet_tpu.tools.calibration` refits them from the
# committed compile results (benchmark/results) and the reference PR's measurements below, and
# prints this entry; tests/test_calibration.py fails when it is stale. docs/benchmarks.md
# ("Calibration per kind of work") has every point and its residual.
CALIBRATION: dict = {
    "v5e": Factors(matmul=0.952, nonmatmul=0.504, transfer=0.686, pallas=1.253, band=(-0.208, 0.137),
                   source="least squares on the reference PR's v5e-4 TP, ring SP and kernel SP steps and its "
                          "op-level reduce-scatter pairs (18 points), against benchmark/results"),
}

# Measured v5e-4 step times of the reference PR (ms per denoise step, batch 1):
# family -> (shape, TP, SP with JAX rings, SP with the PR's defaults). HunyuanVideo's
# ring column is the PR's dual-stream-only SP (its single-stream ring SP: 500.7).
# The PR's own LTX-2 default was its ring.
REFERENCE_PR = {
    "wan": ("480x832x9", 360.7, 292.4, 249.2),
    "flux": ("1024x1024", 175.2, 156.5, 140.6),
    "hunyuan_video": ("320x512x61", 549.9, 516.1, 478.0),
    "ltx2": ("480x704x49", 218.0, 192.1, 192.1),
}

# The reference PR's op-level reduce-scatter measurements on a v5e-4 (ms per call, ring / kernel
# of this design), at our bench sites (per-rank x [B, S, k_i] and w [k_i, N] per pair; Wan FFN
# down with aligned rows): docs/kernels.md ("Which reduce-scatter runs").
REFERENCE_PR_OPS = {
    "wan attention out": ((((1, 4736, 1280),), ((1280, 5120),)), 0.518, 0.504),
    "ltx2 attention out": ((((1, 2432, 1024),), ((1024, 4096),)), 0.214, 0.212),
    "wan ffn down": ((((1, 4736, 3456),), ((3456, 5120),)), 0.917, 0.964),
    "flux single-block pair": ((((1, 4608, 768), (1, 4608, 3072)), ((768, 3072), (3072, 3072))), 0.627, 0.649),
}

# Which of the PR's steps are the same kind of program as ours (the others are shown, not fit):
# HunyuanVideo's ring SP was dual-stream only; LTX-2's default SP was its ring, not a kernel.
NOT_FIT = {("hunyuan_video", "sp"): "the PR's ring SP was dual-stream only",
           ("ltx2", "sp-pallas"): "the PR's LTX-2 default was its ring, not a kernel"}


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured program: `kind` (tp step, ring sp step, kernel sp step, op ring,
    op kernel, ...), its measured ms, the estimator's raw breakdown (`estimate.summarize`)
    and whether the fit uses it (`why_not` otherwise)."""

    name: str
    kind: str
    measured_ms: float
    breakdown: dict
    fit: bool = True
    why_not: str = ""


def terms(b: dict) -> dict:
    """The kinds of work of a raw breakdown (`estimate.summarize`), ms; `fixed` is not scaled."""
    return dict(matmul=b["matmul_ms"], nonmatmul=b["nonmatmul_ms"] + b["other_ms"],
                transfer=b["sync_collective_ms"] + b["exposed_transfer_ms"], pallas=b["pallas_ms"],
                fixed=b.get("exposed_dma_ms", 0.0))


def expected_ms(b: dict, f: Factors) -> float:
    """The calibrated estimate (ms) of a program from its raw breakdown."""
    t = terms(b)
    return sum(getattr(f, k) * t[k] for k in TERMS) + t["fixed"]


def fit(points: Iterable[Point], source: str = "") -> Factors:
    """Least squares on relative errors: minimises sum over the fit points of
    (expected / measured - 1)^2. A kind of work no point has stays at 1.0; factors are
    clipped to [0.1, 10] (a clipped factor shows in its points' residuals)."""
    import numpy as np

    pts = [p for p in points if p.fit]
    if not pts:
        raise ValueError("calibration.fit: no measured points to fit")
    for p in pts:
        if not (p.measured_ms > 0):
            raise ValueError(f"calibration.fit: {p.name}: measured {p.measured_ms!r} ms is not a positive time")
    A = np.array([[terms(p.breakdown)[k] / p.measured_ms for k in TERMS] for p in pts])
    y = np.array([1.0 - terms(p.breakdown)["fixed"] / p.measured_ms for p in pts])
    used = [j for j in range(len(TERMS)) if np.abs(A[:, j]).max() > 0]
    sol = np.ones(len(TERMS))
    x, *_ = np.linalg.lstsq(A[:, used], y, rcond=None)
    sol[used] = np.clip(x, 0.1, 10.0)
    f = Factors(**{k: round(float(v), 3) for k, v in zip(TERMS, sol)})
    res = [residual(p, f) for p in pts]
    return dataclasses.replace(f, band=(round(min(res), 3), round(max(res), 3)),
                               source=source or f"least squares on {len(pts)} measured points")


def residual(p: Point, f: Factors) -> float:
    """expected / measured - 1 for one point."""
    return expected_ms(p.breakdown, f) / p.measured_ms - 1.0


def reference_points(steps: dict, ops: dict) -> list:
    """The reference PR's points: `steps` = {family: {mode: raw breakdown}} of our compiled bench
    cases (modes tp, sp = JAX rings, sp-pallas = kernels), `ops` = {(op name, impl): raw breakdown}
    of our compiled op-level sites (impl "ring" / "kernel")."""
    pts = []
    for fam, (shape, tp, ring, kernel) in REFERENCE_PR.items():
        for mode, kind, meas in (("tp", "tp step", tp), ("sp", "ring sp step", ring),
                                 ("sp-pallas", "kernel sp step", kernel)):
            b = steps.get(fam, {}).get(mode)
            if b is None:
                continue
            why = NOT_FIT.get((fam, mode), "")
            pts.append(Point(f"{fam} {shape} {mode}", kind, meas, b, fit=not why, why_not=why))
    for name, (_, ring, kernel) in REFERENCE_PR_OPS.items():
        for impl, meas in (("ring", ring), ("kernel", kernel)):
            b = ops.get((name, impl))
            if b is not None:
                pts.append(Point(f"{name} ({impl})", f"op {impl}", meas, b))
    return pts


OPS_FILE = "reference_ops_v5e.json"  # the op-level sites' raw estimates, beside the step results


def load_reference_points(results_dir: str) -> list:
    """`reference_points` from the committed compile results: `<family>.json` (bench
    --compile-only, `breakdown_raw` per mode) and OPS_FILE (a `python -m difflet_tpu.check
    --compile-only` report of the PR's op sites)."""
    import os

    steps = {}
    for fam in REFERENCE_PR:
        path = os.path.join(results_dir, f"{fam}.json")
        if os.path.exists(path):
            with open(path) as fh:
                rows = json.load(fh)["results"]
            steps[fam] = {r["mode"]: r["breakdown_raw"] for r in rows if "error" not in r}
    ops = {}
    path = os.path.join(results_dir, OPS_FILE)
    if os.path.exists(path):
        with open(path) as fh:
            for r in json.load(fh)["sites"]:
                if r.get("pr_op") and r.get("breakdown_raw"):
                    ops[(r["pr_op"], r["impl"])] = r["breakdown_raw"]
    if not steps:
        raise ValueError(f"no compile results in {results_dir} (benchmark/estimates.py run writes them)")
    return reference_points(steps, ops)


_CHECK_KINDS = {"tp": "tp step", "sp": "ring sp step", "sp-pallas": "kernel sp step", "sp-xla": "sp-xla step",
                "kernel": "op kernel", "ring": "op ring", "sp-xla op": "op sp-xla"}


def check_points(report: dict) -> list:
    """Points from a `python -m difflet_tpu.check` report: every timed step and op site with
    its raw breakdown (a report without a TPU has none: an error says so)."""
    if not isinstance(report, dict) or report.get("kind") != "difflet-tpu check":
        raise ValueError("not a `python -m difflet_tpu.check` report (its \"kind\" is not \"difflet-tpu check\")")
    pts = []
    for r in report.get("sites", []) + report.get("steps", []):
        if not r.get("measured_ms") or r.get("breakdown_raw") is None or "error" in r:
            continue
        impl = r["impl"] if r["what"] == "step" or r["impl"] != "sp-xla" else "sp-xla op"
        pts.append(Point(f"{r['name']} ({r['impl']})", _CHECK_KINDS.get(impl, impl), float(r["measured_ms"]),
                         r["breakdown_raw"]))
    if not pts:
        where = report.get("platform", "?")
        raise ValueError(f"the check report has no timed points (platform {where!r}: "
                         f"{'no TPU was found, nothing was timed' if where != 'tpu' else 'no timings section'})")
    return pts


def table(points: list, f: Factors) -> list:
    """Markdown rows: each point, measured, raw and calibrated estimate, residual."""
    raw = Factors()
    lines = ["| point | kind | measured ms | est. raw ms | expected ms | residual | in fit |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p.name} | {p.kind} | {p.measured_ms:g} | {expected_ms(p.breakdown, raw):.3f} | "
                     f"{expected_ms(p.breakdown, f):.3f} | {100 * residual(p, f):+.1f}% | "
                     f"{'yes' if p.fit else 'no: ' + p.why_not} |")
    return lines


def describe(f: Factors) -> str:
    return (f"matmul {f.matmul}, non-matmul {f.nonmatmul}, transfer {f.transfer}, Pallas {f.pallas}; "
            f"residuals {100 * f.band[0]:+.1f}% .. {100 * f.band[1]:+.1f}%")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The simulator's own knob (ablations, tests): scales the compiler's cycle estimate
    of non-matmul fusions (`COST_MODEL_TYPE_INVALID`) inside the replay. The reported
    calibration is `Factors`, applied to the raw breakdown; this stays 1.0 there."""

    nonmatmul: float = 1.0
    source: str = "uncalibrated"


def fit_nonmatmul_scale(rows: Iterable[tuple], chip=None) -> float:
    """The one factor `k` on the time of ops the compiler prices with its
    non-matmul cost model (`Estimate.invalid`) that makes `total - (1 - k) *
    invalid` match measured step times (least squares over `(estimate at
    k=1, measured seconds)` rows), clipped to [0.2, 1.5]. The earlier, single-factor
    calibration; kept for the ablation tables of docs/ablations.md."""
    rows = list(rows)
    num = sum(e.invalid * (meas - (e.total - e.invalid)) for e, meas in rows)
    den = sum(e.invalid ** 2 for e, _ in rows)
    if den == 0:
        return 1.0
    return float(min(1.5, max(0.2, num / den)))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.tools.calibration", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-check", metavar="REPORT",
                    help="refit on a `python -m difflet_tpu.check --json` report of a TPU run")
    ap.add_argument("--results", default="benchmark/results",
                    help="without --from-check: the committed compile results to pair with the PR's numbers")
    args = ap.parse_args(argv)
    try:
        if args.from_check:
            try:
                with open(args.from_check) as fh:
                    report = json.load(fh)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"--from-check {args.from_check}: cannot read it ({e})") from None
            pts = check_points(report)
            source = f"least squares on {len(pts)} points of {args.from_check} ({report.get('chip', {}).get('name')})"
        else:
            pts = load_reference_points(args.results)
            source = ""
        f = fit(pts, source)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(table(pts, f)))
    print()
    print(f"factors: {describe(f)}")
    print(f"    Factors(matmul={f.matmul}, nonmatmul={f.nonmatmul}, transfer={f.transfer}, pallas={f.pallas}, "
          f"band={f.band},")
    return 0


if __name__ == "__main__":
    sys.exit(main())
