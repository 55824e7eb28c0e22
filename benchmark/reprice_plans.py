"""Re-prices the committed prompt -> image plans (benchmark/results/pipeline_plan/*.json)
with today's calibration constants, without recompiling.

    python benchmark/reprice_plans.py            # rewrite the JSONs' estimates, print each plan
    python benchmark/reprice_plans.py --check    # exit 1 if a JSON is not priced by today's constants

A plan stage keeps the raw replay of its compiled schedule (`breakdown_raw`, or for
plans priced before the per-kind calibration, the breakdown the old single factor k
scaled: its non-matmul ops' unscaled time is recorded as `invalid_unscaled_ms`, so
raw = scaled + (1 - k) * invalid, exactly, for these programs whose collectives are
synchronous). The expected time is `calibration.expected_ms(raw, CALIBRATION[chip])`,
as the bench prices a step. Everything is an ESTIMATE.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLANS = ROOT / "benchmark" / "results" / "pipeline_plan"


def raw_breakdown(stage: dict, old_k: float | None) -> dict:
    if "breakdown_raw" in stage:
        return stage["breakdown_raw"]
    b = dict(stage["breakdown"])
    if old_k is not None:  # undo the old factor on the ops it scaled (they count as nonmatmul + other)
        extra = (1.0 - old_k) * b["invalid_unscaled_ms"]
        b["nonmatmul_ms"] = round(b["nonmatmul_ms"] + extra, 6)
        b["step_ms"] = round(b["step_ms"] + extra, 6)
    return b


def reprice(report: dict) -> dict:
    from difflet_tpu.tools.calibration import CALIBRATION, Factors, expected_ms

    chip = report["chip"]["name"]
    factors = CALIBRATION.get(chip, Factors())
    old = report.get("calibration", {})
    old_k = old.get("nonmatmul") if "matmul" not in old else None  # a one-factor plan
    for s in report["stages"]:
        raw = raw_breakdown(s, old_k)
        if s.get("placement") == "segments":  # one segment's program, run P times, plus the hops
            s["segment_ms"] = round(expected_ms(raw, factors), 3)
            s["estimate_ms"] = round(s["segments"] * s["segment_ms"] + (s["segments"] - 1) * s["hop_ms"], 3)
        else:
            s["estimate_ms"] = round(expected_ms(raw, factors), 3)
        s.pop("breakdown", None)
        s["breakdown_raw"] = raw
    report["calibration"] = dict(factors.as_dict(), band=list(factors.band), source=factors.source)
    # the totals: the chosen encoder placement, each transformer mode
    names = {s["stage"]: s for s in report["stages"]}
    for plan in report["plans"]:
        transformer = next(s for s in report["stages"] if s["stage"].startswith(f"transformer {plan['mode']} "))
        enc = [s for s in report["stages"] if s.get("chosen") and s["stage"] != "vae decode"]
        encode_ms = (sum(s["calls_per_image"] * s["estimate_ms"] for s in enc)
                     + plan["encoder_offload"]["host_to_device_ms"])
        denoise_ms = plan["steps"] * plan["calls_per_step"] * transformer["estimate_ms"]
        decode_ms = names["vae decode"]["estimate_ms"]
        share = (encode_ms + decode_ms) / denoise_ms
        plan.update(encode_ms=round(encode_ms, 3), denoise_ms=round(denoise_ms, 3), decode_ms=decode_ms,
                    total_ms=round(encode_ms + denoise_ms + decode_ms, 3), encode_decode_share=round(share, 4),
                    within_10_percent=share <= 0.10)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed plan is not priced by today's constants")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from difflet_tpu.bench.pipeline_plan import print_plan

    stale = []
    for path in sorted(PLANS.glob("*.json")):
        before = json.loads(path.read_text())
        after = reprice(json.loads(path.read_text()))
        if args.check:
            if after != before:
                stale.append(path.name)
            continue
        path.write_text(json.dumps(after, indent=1) + "\n")
        print_plan(after)
        print()
    if stale:
        print(f"not priced by today's constants: {', '.join(stale)} (python benchmark/reprice_plans.py)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
