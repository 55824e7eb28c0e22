"""Compile-only estimates of the four models on a TPU slice, and the table of docs/benchmarks.md.

    python benchmark/estimates.py run [--topology v5e:2x2] [--only wan,flux] [--out benchmark/results]
    python benchmark/estimates.py ops          # the PR's op-level sites, compiled (reference_ops_v5e.json)
    python benchmark/estimates.py table [--from-check REPORT] [--write | --check]
    python benchmark/estimates.py calibration [--from-check REPORT]
    python benchmark/estimates.py readme [--check]   # the results table and the bigger slices

`run` calls `python -m difflet_tpu.bench --compile-only` once per case (one
process each: deviceless compiles need a fresh libtpu) and keeps its JSON.
`table` prints the results table with every row's expected time on a TPU:
the raw estimate calibrated per kind of work by
`difflet_tpu.tools.calibration.CALIBRATION` (or by the factors refit on a
`python -m difflet_tpu.check` report with `--from-check`); `--write` puts it
in docs/benchmarks.md ("Results"), `--check` exits 1 if that differs. `calibration`
prints the fit's points and residuals; `readme` rewrites the README's
headline table from the same constants (`--check`: exit 1 if it differs).
Everything here is an ESTIMATE from the compiled schedule, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# name -> (model, bench flags, modes). Batch 1 (guidance 1) as the reference PR's step rows.
CASES = {
    "wan": ("wan:Wan2.1-T2V-14B", ["--height", "480", "--width", "832", "--frames", "9", "--guidance", "1"], "all"),
    "flux": ("flux:flux.1-dev", ["--height", "1024", "--width", "1024"], "all"),
    "hunyuan_video": ("hunyuan_video:hunyuan-video", ["--height", "320", "--width", "512", "--frames", "61"], "all"),
    "ltx2": ("ltx2:ltx-2.0", ["--height", "480", "--width", "704", "--frames", "49", "--guidance", "1"], "all"),
    # the long shapes (issue 14): TP and SP side by side, HBM per chip for each. Whole-model
    # compiles of 5-30 minutes each on a 2-core machine: run them with --only.
    "wan_81": ("wan:Wan2.1-T2V-14B", ["--height", "480", "--width", "832", "--frames", "81", "--guidance", "1"],
               "tp,sp,sp-pallas"),
    "wan_720p_81": ("wan:Wan2.1-T2V-14B", ["--height", "720", "--width", "1280", "--frames", "81", "--guidance", "1"],
                    "tp,sp,sp-pallas"),
    "hunyuan_video_544p": ("hunyuan_video:hunyuan-video", ["--height", "544", "--width", "960", "--frames", "129"],
                           "tp,sp,sp-pallas"),
    "hunyuan_video_720p": ("hunyuan_video:hunyuan-video", ["--height", "720", "--width", "1280", "--frames", "129"],
                           "tp,sp,sp-pallas"),
    # LTX-2's frames are 8k+1; 121 is its pipeline's default clip (5 s at 24 fps)
    "ltx2_121": ("ltx2:ltx-2.0", ["--height", "480", "--width", "704", "--frames", "121", "--guidance", "1"],
                 "tp,sp,sp-pallas"),
    # the loop's actual step with classifier-free guidance: one batch-2 call
    "wan_cfg": ("wan:Wan2.1-T2V-14B", ["--height", "480", "--width", "832", "--frames", "9"], "tp,sp-pallas"),
    "ltx2_cfg": ("ltx2:ltx-2.0", ["--height", "480", "--width", "704", "--frames", "49"], "tp,sp-pallas"),
    # Qwen-Image (issue 16): not in calibration.REFERENCE_PR, so not in the calibration fit
    "qwen_image": ("qwen_image:qwen-image", ["--height", "1024", "--width", "1024", "--guidance", "1"], "all"),
    "qwen_image_1328": ("qwen_image:qwen-image", ["--height", "1328", "--width", "1328", "--guidance", "1"],
                        "tp,sp,sp-pallas"),
}


HLO_DIR = "/tmp/difflet_hlo"  # compiled HLO texts (large; not committed)


def command(name, topology, out_dir, hlo_dir=HLO_DIR):
    model, flags, modes = CASES[name]
    return [sys.executable, "-m", "difflet_tpu.bench", "--compile-only", "--topology", topology, "--model", model,
            *flags, "--mode", modes, "--calibrated", "no", "--json", str(pathlib.Path(out_dir) / f"{name}.json"),
            "--dump-hlo", str(pathlib.Path(hlo_dir) / name)]


def reestimate(args):
    """Recomputes every JSON's estimates from the dumped HLO (after an estimator change, no recompile)."""
    from difflet_tpu.tools import estimate as E

    for name in CASES:
        p = pathlib.Path(args.out) / f"{name}.json"
        if not p.exists():
            continue
        data = json.loads(p.read_text())
        chip = E.CHIPS[data["chip"]["name"]]
        for r in data["results"]:
            if "error" in r:
                continue
            h = pathlib.Path(HLO_DIR) / name / f"{r['family']}-{r['preset']}-{r['mode']}.hlo.txt"
            if not h.exists():
                print("no HLO for", name, r["mode"], file=sys.stderr)
                continue
            text = h.read_text()
            est = E.estimate(text, chip)
            r["breakdown_raw"] = r["breakdown"] = E.summarize(est)
            r["estimate_raw_ms"] = r["estimate_ms"] = round(1e3 * est.total, 3)
            r["schedule_overlap"] = E.schedule_overlap(text)
        p.write_text(json.dumps(data, indent=1))
        print("re-estimated", name)


def run(args):
    os.makedirs(args.out, exist_ok=True)
    names = args.only.split(",") if args.only else list(CASES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "DIFFLET_TPU_"))}
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    for name in names:
        cmd = command(name, args.topology, args.out)
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, env=env, cwd=ROOT, check=False)


def ops(args):
    """The reference PR's op-level sites, ring and kernel, compiled deviceless and priced."""
    out = pathlib.Path(args.out) / "reference_ops_v5e.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "DIFFLET_TPU_"))}
    subprocess.run([sys.executable, "-m", "difflet_tpu.check", "--compile-only", "--topology", args.topology,
                    "--only", "pr-ops", "--json", str(out), "--md", os.devnull], env=env, cwd=ROOT, check=True)


def factors_for(args):
    """The constants, or the factors refit on `--from-check REPORT`."""
    from difflet_tpu.tools import calibration

    if not getattr(args, "from_check", None):
        return calibration.CALIBRATION["v5e"]
    report = json.loads(pathlib.Path(args.from_check).read_text())
    return calibration.fit(calibration.check_points(report), f"refit on {args.from_check}")


def calibration_table(args):
    from difflet_tpu.tools import calibration

    f = factors_for(args)
    pts = calibration.load_reference_points(args.out)
    print("\n".join(calibration.table(pts, f)))
    print(f"\nfactors: {calibration.describe(f)}")


# README: the headline rows (results file, label) and the PR's measured TP / SP beside them.
README_ROWS = (("wan", "Wan2.1-14B 480x832x9"), ("flux", "FLUX.1-dev 1024x1024"),
               ("hunyuan_video", "HunyuanVideo 320x512x61"), ("ltx2", "LTX-2 480x704x49"),
               ("qwen_image", "Qwen-Image 1024x1024 (128 prompt tokens)"),
               ("wan_81", "Wan2.1-14B 480x832x81 (32,760 tokens)"),
               ("hunyuan_video_720p", "HunyuanVideo 720x1280x129 (118,800 tokens)"))
README_PR = {"qwen_image": (236.3, 178.0)}  # the PR's Qwen-Image line (no shape given): not fit
README_BEGIN = "<!-- results table: python benchmark/estimates.py readme -->"
README_END = "<!-- end of results table -->"


def readme_block(out_dir) -> str:
    from difflet_tpu.tools import calibration

    f = calibration.CALIBRATION["v5e"]
    res = load(out_dir)
    lines = [README_BEGIN, "",
             "| model, shape | TP: expected on a TPU (estimate), ms | SP: expected on a TPU (estimate), ms | SP/TP | "
             "ideal ms | reference PR measured TP / SP |",
             "|---|---|---|---|---|---|"]
    for fam, label in README_ROWS:
        tp, sp = res[fam]["tp"], res[fam]["sp-pallas"]
        e_tp, e_sp = (calibration.expected_ms(r["breakdown_raw"], f) for r in (tp, sp))
        ref = calibration.REFERENCE_PR.get(fam)
        pr = f"{ref[1]} / {ref[3]}" if ref else ("{} / {}".format(*README_PR[fam]) if fam in README_PR else "")
        lines.append(f"| {label} | {e_tp:.0f} | {e_sp:.0f} | {e_sp / e_tp:.2f} | {sp['ideal_ms']:.0f} | {pr} |")
    lo, hi = (100 * b for b in f.band)
    lines += ["", f"Expected on a TPU (estimate): the raw estimate with each kind of work scaled by its factor "
              f"(`difflet_tpu.tools.calibration.CALIBRATION`: XLA matmul fusions x{f.matmul}, other XLA work "
              f"x{f.nonmatmul}, ICI waits x{f.transfer}, Pallas kernels x{f.pallas}), fit on the reference PR's "
              f"measured steps and op-level reduce-scatters; on those points the fit's residuals span "
              f"{lo:+.0f}% .. {hi:+.0f}%, the error band to read these figures with.", "", README_END]
    return "\n".join(lines)


SLICES_BEGIN = "<!-- bigger slices: python benchmark/estimates.py readme -->"
SLICES_END = "<!-- end of bigger slices -->"


def mesh_ms(mesh_dir, name: str, mode: str) -> tuple[float, dict]:
    """(expected ms per step, the row) of a committed bigger-slice plan (benchmark/meshes.py),
    re-priced from its raw replay with today's per-kind factors of its chip (no recompile);
    a chip without fitted factors (v6e) gets the raw replay (`Factors()`, all 1.0)."""
    from difflet_tpu.tools import calibration

    data = json.loads((pathlib.Path(mesh_dir) / f"{name}.json").read_text())
    row = next(r for r in data["results"] if r["mode"] == mode and "error" not in r)
    chip = data["topology"].split(":")[0]
    return calibration.expected_ms(row["breakdown_raw"], calibration.CALIBRATION.get(chip, calibration.Factors())), row


def slices_block(mesh_dir) -> str:
    import textwrap

    from difflet_tpu.tools import calibration

    cfg, _ = mesh_ms(mesh_dir, "wan9_v5e2x4_cfg2tp4", "sp-pallas")
    ring, _ = mesh_ms(mesh_dir, "wan9_v5e2x4_tp8", "sp-pallas")
    v5e4, _ = mesh_ms(mesh_dir, "wan9_v5e2x2_cfgb2", "sp-pallas")
    (tp81, r_tp), (sp81, r_sp) = (mesh_ms(mesh_dir, "wan81_v5e4x4", m) for m in ("tp", "sp-pallas"))
    gib = sorted(r["hbm"]["total"] / 2**30 for r in (r_tp, r_sp))
    lo, hi = (100 * b for b in calibration.CALIBRATION["v5e"].band)
    text = (f"Expected on a TPU (estimate; deviceless compiles of the committed plans in "
            f"`benchmark/results/meshes/`, re-priced from their raw replays with the per-kind factors of the "
            f"results table below, fitted band {lo:+.0f}% .. {hi:+.0f}%; nothing measured): Wan2.1-14B "
            f"480x832x9 with CFG is {cfg:.0f} ms per step on a v5e-8 as `cfg=2,tp=4`, {cfg / v5e4:.2f}x the "
            f"v5e-4 step ({v5e4:.0f} ms), where one 8-ring would take {ring:.0f} ms; 81 frames fit a v5e-16 "
            f"as `cfg=2,tp=8` ({gib[0]:.1f}-{gib[1]:.1f} GiB per chip, {sp81:.0f} ms per step with the Pallas "
            f"kernels, {tp81:.0f} ms under TP). Per slice and model: `docs/benchmarks.md` (\"Bigger slices\").")
    return "\n".join([SLICES_BEGIN, "", textwrap.fill(text, 76, break_on_hyphens=False), "", SLICES_END])


def replace_block(text: str, begin: str, end: str, block: str, where: str) -> str:
    """`text` with what stands from `begin` to `end` (markers included) replaced by `block`."""
    if begin not in text or end not in text:
        sys.exit(f"{where} has no {begin} ... {end} block")
    a, rest = text.split(begin, 1)
    _, b = rest.split(end, 1)
    return a + block + b


def rewrite_blocks(name: str, blocks, *, check: bool, what: str, command: str) -> None:
    """Replaces each `(begin, end, block)` of the repo file `name`; with `check`, writes
    nothing and exits 1 when the file differs from what `command` generates."""
    path = ROOT / name
    text = new = path.read_text()
    for begin, end, block in blocks:
        new = replace_block(new, begin, end, block, name)
    if check:
        if new != text:
            print(f"{name}'s {what} differ from `{command}`", file=sys.stderr)
            sys.exit(1)
        return
    path.write_text(new)
    print(f"{name}: {what} rewritten")


def readme(args):
    rewrite_blocks("README.md", [(README_BEGIN, README_END, readme_block(args.out)),
                                 (SLICES_BEGIN, SLICES_END, slices_block(pathlib.Path(args.out) / "meshes"))],
                   check=args.check, what="generated blocks (results table, bigger slices)",
                   command="python benchmark/estimates.py readme")


def load(out_dir):
    res = {}
    for name in CASES:
        p = pathlib.Path(out_dir) / f"{name}.json"
        if p.exists():
            res[name] = {r["mode"]: r for r in json.loads(p.read_text())["results"] if "error" not in r}
    return res


def fit(res):
    """The calibration factor from TP rows only; returns (k, rows)."""
    from difflet_tpu.tools import calibration, estimate as E

    rows = []
    for fam, (_, tp_ms, _, _) in calibration.REFERENCE_PR.items():
        r = res.get(fam, {}).get("tp")
        if r is None:
            continue
        b = r.get("breakdown_raw", r["breakdown"])
        rows.append((E.Estimate(total=b["step_ms"] / 1e3, invalid=b.get("invalid_unscaled_ms", b["nonmatmul_ms"]) / 1e3),
                     tp_ms / 1e3))
    return (calibration.fit_nonmatmul_scale(rows) if rows else 1.0), rows


_EXACT: dict = {}


def calibrated_ms(r, k, name=None):
    """Step estimate with non-matmul fusions scaled by k: re-simulated from the dumped HLO when it
    is there (exact, exposed waits included); otherwise exposed waits held fixed (an approximation
    for SP, where shorter compute can expose more transfer)."""
    b = r.get("breakdown_raw", r["breakdown"])
    if name is not None:
        key = (name, r["mode"], k)
        h = pathlib.Path(HLO_DIR) / name / f"{r['family']}-{r['preset']}-{r['mode']}.hlo.txt"
        if key not in _EXACT and h.exists():
            from difflet_tpu.tools import estimate as E

            _EXACT[key] = E.summarize(E.estimate(h.read_text(), "v5e", E.Calibration(nonmatmul=k)))
        if key in _EXACT:
            return _EXACT[key]["step_ms"]
    return b["step_ms"] - (1 - k) * b.get("invalid_unscaled_ms", b["nonmatmul_ms"])


def table(args):
    from difflet_tpu.tools import calibration

    res = load(args.out)
    f = factors_for(args)
    k = f.nonmatmul
    calibrated_ms = lambda r, k, name=None: calibration.expected_ms(r.get("breakdown_raw", r["breakdown"]), f)
    lines = [f"calibration: {calibration.describe(f)}", ""]
    hdr = ("| model (shape) | mode | est. raw ms | expected ms | ideal ms | PR measured ms | "
           "expected vs PR | x TP (exp.) | HBM GiB/chip | exposed transfer ms | non-matmul ms (raw) | matmul ms | "
           "attention ms |")
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for fam in ("wan", "flux", "hunyuan_video", "ltx2", "wan_81", "wan_720p_81", "hunyuan_video_544p",
                "hunyuan_video_720p", "ltx2_121", "wan_cfg", "ltx2_cfg", "qwen_image", "qwen_image_1328"):
        modes = res.get(fam, {})
        ref = calibration.REFERENCE_PR.get(fam)
        tp_cal = calibrated_ms(modes["tp"], k, fam) if "tp" in modes else None
        for mode in ("tp", "sp", "sp-pallas", "sp-xla"):
            r = modes.get(mode)
            if r is None:
                continue
            b = r.get("breakdown_raw", r["breakdown"])
            cal = calibrated_ms(r, k, fam)
            meas = None
            if ref:
                meas = {"tp": ref[1], "sp": ref[2], "sp-pallas": ref[3]}.get(mode)
            shape = "x".join(str(r["shape"][x]) for x in ("height", "width", "frames") if x in r["shape"])
            if r.get("batch", 1) > 1:
                shape += f", CFG batch {r['batch']}"
            lines.append(
                f"| {r['model']} ({shape}) | {mode} | {b['step_ms']:.1f} | {cal:.1f} | {r['ideal_ms']:.1f} | "
                f"{'' if meas is None else meas} | {'' if meas is None else f'{100 * (cal / meas - 1):+.1f}%'} | "
                f"{'' if tp_cal is None else f'{cal / tp_cal:.2f}'} | {r['hbm']['total'] / 2**30:.2f} | "
                f"{b['exposed_transfer_ms'] + b['sync_collective_ms']:.1f} | {b['nonmatmul_ms'] + b['other_ms']:.1f} | "
                f"{b['matmul_ms'] + sum(v for n, v in b['pallas_kernels_ms'].items() if 'matmul' in n):.1f} | "
                f"{sum(v for n, v in b['pallas_kernels_ms'].items() if 'splash' in n or 'flash' in n):.1f} |")
    lines += ["", "Where the best SP variant's expected step goes beyond the ideal (ms, raw breakdown):", "",
              "| model | best SP | est. ms | ideal ms | gap | matmul + attention beyond ideal | non-matmul | exposed transfer |",
              "|---|---|---|---|---|---|---|---|"]
    for fam in ("wan", "flux", "hunyuan_video", "ltx2", "qwen_image"):
        modes = res.get(fam, {})
        sps = [m for m in ("sp", "sp-pallas") if m in modes]
        if not sps:
            continue
        best = min(sps, key=lambda m: calibrated_ms(modes[m], k, fam))
        r = modes[best]
        b = r.get("breakdown_raw", r["breakdown"])
        cal = calibrated_ms(r, k, fam)
        compute = b["matmul_ms"] + b["pallas_ms"]
        lines.append(f"| {r['model']} | {best} | {cal:.1f} | {r['ideal_ms']:.1f} | {cal - r['ideal_ms']:.1f} | "
                     f"{compute - r['ideal_ms']:.1f} | {b['nonmatmul_ms'] + b['other_ms']:.1f} | "
                     f"{b['exposed_transfer_ms'] + b['sync_collective_ms'] + b['exposed_dma_ms']:.1f} |")
    block = "\n".join([RESULTS_BEGIN, "", *lines, "", RESULTS_END])
    if not (args.check or args.write):
        print("\n".join(lines))
        return
    if getattr(args, "from_check", None):
        sys.exit("table --check / --write: docs/benchmarks.md holds the constants' table, not a --from-check refit")
    rewrite_blocks("docs/benchmarks.md", [(RESULTS_BEGIN, RESULTS_END, block)], check=args.check,
                   what="results table", command="python benchmark/estimates.py table")


RESULTS_BEGIN = "<!-- results: python benchmark/estimates.py table --write -->"
RESULTS_END = "<!-- end of results -->"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("run", "table", "reestimate", "ops", "calibration", "readme"))
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--only", help="comma list of " + ", ".join(CASES))
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results"))
    ap.add_argument("--from-check", metavar="REPORT", help="table / calibration: factors refit on a "
                    "`python -m difflet_tpu.check --json` report of a TPU run instead of the constants")
    ap.add_argument("--check", action="store_true", help="readme / table: exit 1 if README.md / docs/benchmarks.md "
                    "differs, write nothing")
    ap.add_argument("--write", action="store_true", help="table: rewrite docs/benchmarks.md's results block")
    args = ap.parse_args(argv)
    dict(run=run, table=table, reestimate=reestimate, ops=ops, calibration=calibration_table,
         readme=readme)[args.what](args)


if __name__ == "__main__":
    main()
