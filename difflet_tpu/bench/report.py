"""The bench's tables and its JSON (written to a temporary file and renamed)."""

from __future__ import annotations

import json
import math
import numbers
import sys


def ms(x):
    return None if x is None else round(1e3 * x, 3)


def json_safe(obj):
    """`obj` with every non-finite float replaced (NaN -> None, inf -> "inf" / "-inf"), so the
    report is valid JSON (`json.dump` would write bare NaN / Infinity)."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, numbers.Integral):  # ints, numpy ints, bools
        return obj if isinstance(obj, (bool, int)) else int(obj)
    if isinstance(obj, numbers.Real):  # floats, numpy floats
        f = float(obj)
        if math.isnan(f):
            return None
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return f
    return obj


def write_json(path, data):
    """`data` as strict JSON at `path`, through a temporary file and a rename (checks.write_atomic):
    a full disk is a WriteError and leaves no partial report."""
    from difflet_tpu import checks

    text = json.dumps(json_safe(data), indent=1, default=str, allow_nan=False)
    checks.write_atomic(path, text, "--json")


def print_table(results, out=None):
    out = out or sys.stdout
    hdr = (f"{'model':28} {'mode':7} {'mesh':16} {'load s':>7} {'compile s':>9} {'step ms med':>11} {'min':>8} {'max':>8} "
           f"{'denoise s':>9} {'peak GiB':>8} {'sha256':>12} {'rel L2 vs TP':>12} {'PSNR dB':>8} {'SP/TP':>6}")
    print(hdr, file=out)
    for r in results:
        if "error" in r:
            print(f"{r['model']:28} {r.get('mode', '-'):7} ERROR: {r['error']}", file=out)
            continue
        v = r.get("vs_tp", {})
        peak = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f}"
        print(f"{r['model']:28} {r['mode']:7} {r['mesh']:16} {r['load_s']:7.2f} {r['compile_s']:9.2f} "
              f"{r['step_ms']['median']:11.2f} {r['step_ms']['min']:8.2f} {r['step_ms']['max']:8.2f} "
              f"{r['denoise_s']:9.2f} {peak:>8} {r['sha256'][:12]:>12} "
              f"{('%.2e' % v['rel_l2']) if v else '-':>12} {('%.1f' % v['psnr_db']) if v else '-':>8} "
              f"{('%.3f' % v['step_ratio']) if v else '-':>6}", file=out)
    for r in results:
        o = r.get("expert_offload")
        if "error" in r or not o or not o["enabled"]:
            continue
        swaps = ", ".join(f"{1e3 * s:.1f}" for s in o["swap_s"]) or "none"
        print(f"  {r['model']} {r['mode']}: idle expert in host memory ({o['setting']}; "
              f"{o['host_bytes_per_chip'] / 2**30:.2f} GiB/chip), measured expert swaps ms: {swaps} "
              f"(not in the step times; in denoise s)", file=out)


def print_compile_table(results, topology, chip, calibration, out=None):
    from difflet_tpu.tools.calibration import describe

    out = out or sys.stdout
    gib = lambda b: b / 2**30
    print(f"compile-only ESTIMATES for {topology} ({chip.name}: {chip.bf16_flops / 1e12:.0f} TFLOP/s, "
          f"HBM {gib(chip.hbm_bytes):.0f} GiB at {chip.hbm_bw / 1e9:.0f} GB/s, ICI {chip.ici_link_bw / 1e9:.0f} GB/s/link; "
          f"calibration: {describe(calibration)}; `est ms` = expected on a TPU, `raw ms` = uncalibrated)", file=out)
    print(f"{'model':28} {'mode':9} {'mesh':16} {'args GiB':>8} {'temp GiB':>8} {'out GiB':>7} {'HBM GiB':>7} {'fits':>4} "
          f"{'TF/chip xla':>11} {'TF/chip an.':>11} {'ideal ms':>8} {'est ms':>8} {'raw ms':>8} {'x TP':>5} "
          f"{'matmul':>7} {'nonmm':>7} {'pallas':>7} {'exposed':>7} {'sync':>7}  collectives (count/bytes per chip/overlapped)",
          file=out)
    for r in results:
        if "error" in r:
            print(f"{r['model']:28} {r['mode']:9} ERROR: {r['error']}", file=out)
            continue
        h, b = r["hbm"], r["breakdown"]
        coll = "; ".join(f"{k} {v['count']}/{v['bytes_per_chip'] / 1e9:.2f}GB/{v['overlapped']}"
                         for k, v in b["collectives"].items())
        xla = r["flops"]["xla_per_chip"]
        print(f"{r['model']:28} {r['mode']:9} {r['mesh']:16} {gib(h['arguments']):8.2f} {gib(h['temporaries']):8.2f} "
              f"{gib(h['outputs']):7.2f} {gib(h['total']):7.2f} {'yes' if h['fits'] else 'NO':>4} "
              f"{(xla or 0) / 1e12:11.2f} {r['flops']['analytic_per_chip'] / 1e12:11.2f} {r['ideal_ms']:8.1f} "
              f"{r['estimate_ms']:8.1f} {r['estimate_raw_ms']:8.1f} {r.get('ratio_vs_tp', 1.0):5.2f} "
              f"{b['matmul_ms']:7.1f} {b['nonmatmul_ms']:7.1f} {b['pallas_ms']:7.1f} "
              f"{b['exposed_transfer_ms']:7.1f} {b['sync_collective_ms']:7.1f}  {coll}", file=out)
    print_offload_notes(results, out)


def print_offload_notes(results, out=None):
    """One line per two-expert compile-only row: where the idle expert is, and the estimated swap."""
    out = out or sys.stdout
    gib = lambda b: b / 2**30
    for r in results:
        o = r.get("expert_offload")
        if "error" in r or not o:
            continue
        if o["enabled"]:
            bw = "an unknown bandwidth" if o["h2d_bytes_per_s"] is None else f"{o['h2d_bytes_per_s'] / 1e9:.0f} GB/s"
            swap = "-" if o["swap_ms_estimate"] is None else f"{o['swap_ms_estimate']:.0f}"
            print(f"  {r['model']} {r['mode']}: idle expert offloaded ({o['setting']}): "
                  f"{gib(o['idle_expert_bytes_per_chip']):.2f} GiB/chip not in HBM, "
                  f"{gib(o['host_bytes_per_chip']):.2f} GiB/chip in host memory (both experts' copies; all resident: "
                  f"{gib(o['all_resident_bytes']):.2f} GiB); ESTIMATED swap {swap} ms per expert switch at {bw} "
                  f"host-to-device per chip (assumed, scaling-book)", file=out)
        else:
            print(f"  {r['model']} {r['mode']}: both experts resident ({o['setting']}): HBM includes the other "
                  f"expert's {gib(r['hbm']['other_experts']):.2f} GiB/chip", file=out)
