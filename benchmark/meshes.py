"""Compile-only plans for slices larger than a v5e-4: CFG-parallel vs one ring, per mesh.

    python benchmark/meshes.py run [--only wan9_v5e2x4_cfg2tp4,...] [--out benchmark/results/meshes]
    python benchmark/meshes.py table [--out benchmark/results/meshes]

`run` calls `python -m difflet_tpu.bench --compile-only` once per case, one at a
time (deviceless compiles of the released configs take minutes each), and keeps
its JSON; `table` prints the markdown table of docs/benchmarks.md ("Bigger
slices"): HBM per chip, the estimated step (calibrated, the bench's default),
and the best mesh per model and slice. Every number is an ESTIMATE from the
compiled schedule (difflet_tpu.tools.estimate), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
WAN = ["--model", "wan:Wan2.1-T2V-14B", "--height", "480", "--width", "832"]
LTX = ["--model", "ltx2:ltx-2.0", "--height", "480", "--width", "704", "--frames", "49"]

# name -> (topology, flags, modes), in the order they were run. Guidance on (the
# pipelines' defaults: Wan 5.0, LTX-2 3.0): every step is one batch-2 call.
CASES = {
    "wan9_v5e2x4_cfg2tp4": ("v5e:2x4", [*WAN, "--frames", "9", "--mesh", "cfg=2,tp=4"], "tp,sp-pallas"),
    "wan9_v5e2x4_tp8": ("v5e:2x4", [*WAN, "--frames", "9", "--mesh", "tp=8"], "tp,sp-pallas"),
    "wan9_v5e2x2_cfgb2": ("v5e:2x2", [*WAN, "--frames", "9"], "tp,sp-pallas"),
    "wan81_v5e4x4": ("v5e:4x4", [*WAN, "--frames", "81"], "tp,sp-pallas"),  # default mesh: cfg=2,tp=8
    "ltx2_v5e2x4_cfg2tp4": ("v5e:2x4", [*LTX, "--mesh", "cfg=2,tp=4"], "sp-pallas"),
    "ltx2_v5e2x4_tp8": ("v5e:2x4", [*LTX, "--mesh", "tp=8"], "sp-pallas"),
    "ltx2_v5e2x2_cfgb2": ("v5e:2x2", [*LTX], "sp-pallas"),
    "wan9_v5e4x4_cfg2data2tp4": ("v5e:4x4", [*WAN, "--frames", "9", "--batch", "2", "--mesh", "cfg=2,data=2,tp=4"],
                                 "sp-pallas"),
    "wan9_v6e2x4_cfg2tp4": ("v6e:2x4", [*WAN, "--frames", "9", "--mesh", "cfg=2,tp=4"], "sp-pallas"),
    "wan9_v6e2x4_tp8": ("v6e:2x4", [*WAN, "--frames", "9", "--mesh", "tp=8"], "sp-pallas"),
    "wan9_v6e2x2_cfg2tp2": ("v6e:2x2", [*WAN, "--frames", "9", "--mesh", "cfg=2,tp=2"], "sp-pallas"),
    "wan9_v6e2x2_tp4": ("v6e:2x2", [*WAN, "--frames", "9", "--mesh", "tp=4"], "sp-pallas"),
    "ltx2_v6e2x4_cfg2tp4": ("v6e:2x4", [*LTX, "--mesh", "cfg=2,tp=4"], "sp-pallas"),
    "ltx2_v6e2x4_tp8": ("v6e:2x4", [*LTX, "--mesh", "tp=8"], "sp-pallas"),
    "ltx2_v6e2x2_cfg2tp2": ("v6e:2x2", [*LTX, "--mesh", "cfg=2,tp=2"], "sp-pallas"),
    "ltx2_v6e2x2_tp4": ("v6e:2x2", [*LTX, "--mesh", "tp=4"], "sp-pallas"),
    "wan81_v5e2x4_cfg2tp4": ("v5e:2x4", [*WAN, "--frames", "81", "--mesh", "cfg=2,tp=4"], "sp-pallas"),
    "wan81_v5e2x4_tp8": ("v5e:2x4", [*WAN, "--frames", "81", "--mesh", "tp=8"], "sp-pallas"),
}


def command(name, out_dir):
    topology, flags, modes = CASES[name]
    return [sys.executable, "-m", "difflet_tpu.bench", "--compile-only", "--topology", topology, *flags,
            "--mode", modes, "--json", str(pathlib.Path(out_dir) / f"{name}.json")]


def run(args):
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(CASES)
    for name in names:
        cmd = command(name, out)
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=False)


def rows(out_dir):
    for name in CASES:
        p = pathlib.Path(out_dir) / f"{name}.json"
        if not p.exists():
            continue
        data = json.loads(p.read_text())
        for r in data["results"]:
            if "error" in r:
                continue
            yield name, data["topology"], r


def table(args):
    gib = 2 ** 30
    got = list(rows(args.out))
    print("| slice | model (shape) | rows per call | mesh | mode | HBM GiB/chip | est. ms/step | ideal ms | raw ms "
          "| exposed transfer ms | non-matmul ms | Pallas ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, topo, r in got:
        s = r["shape"]
        b = r["breakdown"]
        shape = f"{s['height']}x{s['width']}x{s.get('frames', 1)}"
        print(f"| {topo} | {r['model']} ({shape}) | {r['batch']} | `{r['mesh']}` | {r['mode']} | "
              f"{r['hbm']['total'] / gib:.2f} | {r['estimate_ms']:.1f} | {r['ideal_ms']:.1f} | "
              f"{r['estimate_raw_ms']:.1f} | {b['exposed_transfer_ms'] + b['sync_collective_ms']:.1f} | "
              f"{b['nonmatmul_ms']:.1f} | {b['pallas_ms']:.1f} |")
    print()
    best = {}
    for name, topo, r in got:
        s = r["shape"]
        key = (topo, r["model"], f"{s['height']}x{s['width']}x{s.get('frames', 1)}", r["batch"])
        if key not in best or r["estimate_ms"] < best[key]["estimate_ms"]:
            best[key] = r
    print("| slice | model (shape, rows) | best mesh, mode | est. ms/step |")
    print("|---|---|---|---|")
    for (topo, model, shape, batch), r in best.items():
        print(f"| {topo} | {model} ({shape}, {batch}) | `{r['mesh']}` {r['mode']} | {r['estimate_ms']:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--only")
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "meshes"))
    args = ap.parse_args()
    (run if args.what == "run" else table)(args)


if __name__ == "__main__":
    main()
