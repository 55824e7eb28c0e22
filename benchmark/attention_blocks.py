"""Splash-attention block sizes at the ports' sequence lengths: deviceless compiles of the splash call alone.

    python benchmark/attention_blocks.py run [--topology v5e:2x2] [--only wan_81,hunyuan_720p] [--candidates all]
    python benchmark/attention_blocks.py table [--topology v5e:2x2]

`run` compiles, for every case below (one fresh process per case: deviceless
compiles need their own libtpu), difflet_tpu.layers.sdpa's splash call (one
chip, `[1, S, heads per rank, 128]` bf16 with a key mask) with the block sizes
`splash_blocks` chooses, with the previous rule's (`previous_blocks`), and for
the `--candidates` cases with every candidate (block_q, block_kv in
512/1024/2048, block_kv_compute in 256/512/1024 dividing block_kv; a block
longer than the 128-rounded axis becomes that axis). Per compile it records:
whether Mosaic accepted it, the VMEM the kernel requests (the compiler's
`used_scoped_memory_configs`), the program's HBM (`memory_analysis`), and the
project estimator's price (difflet_tpu.tools.estimate: splash by a roofline of its
padded shapes, the pads and transposes around it by the compiler's cycles).
`table` adds what the block sizes alone determine (grid steps, padding, the
kernel's HBM bytes with k and v fetched once per row of q blocks, the estimate
with splash re-priced by that roofline, the per-grid-step cost above which the
chosen blocks beat the previous ones) and prints the markdown of
docs/benchmarks.md ("Attention at long sequences"). Everything is an ESTIMATE;
nothing ran on a TPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> (what, queries, keys, heads per rank under tp=4, head dim). Token counts from each
# port's latent rule: Wan (frames-1)/4+1 latent frames of (H/16)(W/16) tokens; HunyuanVideo
# the same + 256 text tokens (joint attention); FLUX (H/16)(W/16) + 512 T5 tokens; Qwen-Image
# (H/16)(W/16) + 128 prompt tokens (example_inputs); LTX-2 ((frames-1)/8+1)(H/32)(W/32)
# video tokens (frames 8k+1), 1024 text tokens in its cross-attention.
CASES = {
    "flux_1024": ("FLUX.1 1024^2 joint", 4096 + 512, 4096 + 512, 24 // 4, 128),
    "qwen_1024": ("Qwen-Image 1024^2 joint", 4096 + 128, 4096 + 128, 24 // 4, 128),
    "qwen_1328": ("Qwen-Image 1328^2 joint", 83 * 83 + 128, 83 * 83 + 128, 24 // 4, 128),
    "ltx2_49": ("LTX-2 480x704x49 video self", 7 * 15 * 22, 7 * 15 * 22, 32 // 4, 128),
    "ltx2_121": ("LTX-2 480x704x121 video self", 16 * 15 * 22, 16 * 15 * 22, 32 // 4, 128),
    "ltx2_121_text": ("LTX-2 480x704x121 video-text cross", 16 * 15 * 22, 1024, 32 // 4, 128),
    "wan_9": ("Wan2.1 480x832x9 self", 3 * 30 * 52, 3 * 30 * 52, 40 // 4, 128),
    "hunyuan_61": ("HunyuanVideo 320x512x61 joint", 16 * 20 * 32 + 256, 16 * 20 * 32 + 256, 24 // 4, 128),
    "wan_81": ("Wan2.1 480x832x81 self", 21 * 30 * 52, 21 * 30 * 52, 40 // 4, 128),
    "wan_81_text": ("Wan2.1 480x832x81 text cross", 21 * 30 * 52, 512, 40 // 4, 128),
    "hunyuan_544p": ("HunyuanVideo 544x960x129 joint", 33 * 34 * 60 + 256, 33 * 34 * 60 + 256, 24 // 4, 128),
    "wan_720p": ("Wan2.1 720x1280x81 self", 21 * 45 * 80, 21 * 45 * 80, 40 // 4, 128),
    "hunyuan_720p": ("HunyuanVideo 720x1280x129 joint", 33 * 45 * 80 + 256, 33 * 45 * 80 + 256, 24 // 4, 128),
}


def candidates(sq, skv):
    from difflet_tpu.layers.sdpa import LANE, SplashBlocks, _round_up

    out = []
    for bq in (512, 1024, 2048):
        bq = min(bq, _round_up(sq, LANE))
        for bkv in (512, 1024, 2048):
            bkv = min(bkv, _round_up(skv, LANE))
            for c in (256, 512, 1024):
                if c > bkv or bkv % c:
                    continue
                b = SplashBlocks(bq, bkv, c, _round_up(sq, bq), _round_up(skv, bkv))
                if b not in out:
                    out.append(b)
    return out


def previous_blocks(sq, skv):
    """The rule before this table (main up to 32322eb): pad to 128 rows (512 when there are
    more than 65536 pairs of 128-row blocks), block_q = block_kv = block_kv_compute = the
    largest of 512/256/128 dividing the padded length."""
    from difflet_tpu.layers.sdpa import SplashBlocks, _round_up

    unit = 512 if -(-sq // 128) * -(-skv // 128) > 65536 else 128
    psq, pskv = _round_up(sq, unit), _round_up(skv, unit)
    bq, bkv = (next(b for b in (512, 256, 128) if n % b == 0) for n in (psq, pskv))
    return SplashBlocks(bq, bkv, bkv, psq, pskv)


def analytic(b, sq, skv, heads, d, chip):
    """What the block sizes alone determine (per call, one chip)."""
    nq, nkv = b.grid
    flops = 4 * heads * b.sq * b.skv * d
    # q and out once; k and v once per q block (their block index changes every grid step, so the
    # pipeline fetches them again for every row of q blocks), once in all when there is one kv block
    hbm = heads * d * 2 * (2 * b.sq + 2 * (nq if nkv > 1 else 1) * b.skv)
    from difflet_tpu.tools.estimate import CHIPS

    c = CHIPS[chip]
    return dict(grid_steps=heads * nq * nkv, pad_flops_pct=100 * (b.sq * b.skv / (sq * skv) - 1),
                kv_reread_gb=round(hbm / 1e9, 3), intensity_flops_per_byte=round(flops / hbm, 1),
                roofline_ms=round(1e3 * max(flops / c.bf16_flops, hbm / c.hbm_bw), 3),
                smem_metadata_bytes=b.smem_metadata_bytes())


_CHILD = r"""
import json, re, sys, time
from difflet_tpu.tools import deviceless
import jax, jax.numpy as jnp
from difflet_tpu.tools import estimate as E
from difflet_tpu.layers.sdpa import SplashBlocks, _splash
sq, skv, H, D, chip, blocks = json.loads(sys.argv[1])
dev = deviceless.topology_devices(%(topology)r)[0]
s = jax.sharding.SingleDeviceSharding(dev)
q = jax.ShapeDtypeStruct((1, sq, H, D), jnp.bfloat16, sharding=s)
kv = jax.ShapeDtypeStruct((1, skv, H, D), jnp.bfloat16, sharding=s)
m = jax.ShapeDtypeStruct((1, skv), jnp.bool_, sharding=s)
rows = []
for b in blocks:
    b = SplashBlocks(*b)
    row = dict(blocks=list(b.__dict__.values()))
    try:
        t = time.time()
        c = jax.jit(lambda q, k, v, m: _splash(q, k, v, m, False, b, check=False)).trace(q, kv, kv, m).lower().compile()
        row["compile_s"] = round(time.time() - t, 2)
        text = c.as_text()
        sizes = [int(x) for x in re.findall(r'"used_scoped_memory_configs":\[\{[^\]]*?"size":"(\d+)"', text)]
        row["kernel_vmem_bytes"] = max(sizes) if sizes else None
        row["kernel_cycles"] = None  # Pallas custom calls carry no estimated_cycles
        for line in text.splitlines():
            if "tpu_custom_call" in line and "estimated_cycles" in line.split("custom_call_config")[0]:
                row["kernel_cycles"] = "present"
        row["hbm"] = deviceless.memory_report(c)
        est = E.estimate(text, chip)
        summ = E.summarize(est)
        row["estimate_ms"] = round(1e3 * est.total, 3)
        row["estimate_splash_ms"] = round(1e3 * sum(v for k, v in est.pallas_kernels.items()), 3)
        row["estimate_warnings"] = est.warnings[:3]
    except Exception as e:  # Mosaic rejects (VMEM) or splash rejects
        row["error"] = (type(e).__name__ + ": " + str(e))[:300]
    rows.append(row)
print(json.dumps(rows))
"""


def run(args):
    from difflet_tpu.tools import deviceless
    from difflet_tpu.layers.sdpa import splash_blocks

    chip = args.topology.split(":")[0]
    out = pathlib.Path(args.out or ROOT / "benchmark" / "results" / f"attention_blocks_{chip}.json")
    data = json.loads(out.read_text()) if out.exists() else {}
    data.setdefault("topology", args.topology)
    cases = data.setdefault("cases", {})
    for name in (args.only.split(",") if args.only else CASES):
        what, sq, skv, heads, d = CASES[name]
        try:
            chosen = [splash_blocks(sq, skv)]
        except ValueError as e:
            print("  splash_blocks:", e, flush=True)
            chosen = []
        prev = previous_blocks(sq, skv)
        full = args.candidates == "all" or name in args.candidates.split(",")
        cands = [prev] + (candidates(sq, skv) if full else [])
        blocks = chosen + [b for i, b in enumerate(cands) if b not in chosen and b not in cands[:i]]
        if args.skip_compiled:  # only what earlier runs did not compile
            done = [r["blocks"] for r in cases.get(name, {}).get("rows", [])]
            blocks = [b for b in blocks if list(b.__dict__.values()) not in done]
        print(f"{name}: {what}, {sq} x {skv} tokens, {heads} heads: {len(blocks)} compiles", flush=True)
        if not blocks:
            continue
        code = _CHILD % dict(topology=args.topology)
        payload = json.dumps([sq, skv, heads, d, chip, [list(b.__dict__.values()) for b in blocks]])
        code = f"import sys; sys.argv = ['x', {payload!r}]\n" + code
        rows = deviceless.run_python(code, topology=args.topology, timeout=3600)
        for r in rows:
            from difflet_tpu.layers.sdpa import SplashBlocks

            r.update(analytic(SplashBlocks(*r["blocks"]), sq, skv, heads, d, chip))
        # keep the rows of earlier runs (other candidates) that this run did not recompile
        old = [r for r in cases.get(name, {}).get("rows", []) if r["blocks"] not in [x["blocks"] for x in rows]]
        rows += old
        for r in rows:
            r["chosen"] = bool(chosen) and r["blocks"] == list(chosen[0].__dict__.values())
            r["previous"] = r["blocks"] == list(prev.__dict__.values())
        rows.sort(key=lambda r: (not r["chosen"], not r["previous"]))
        cases[name] = dict(what=what, sq=sq, skv=skv, heads=heads, head_dim=d, rows=rows)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
    print("wrote", out)


def fmt_blocks(b):
    return f"{b[0]}/{b[1]}/{b[2]}"


def break_even_ns(chosen, other):
    """The per-grid-step overhead (ns) above which `chosen` is faster than `other`: the
    difference of their estimates with k/v re-reads over the grid steps saved. None:
    chosen has no more steps and no higher estimate (better at any overhead)."""
    d_ms = chosen["reread_ms"] - other["reread_ms"]
    d_steps = other["grid_steps"] - chosen["grid_steps"]
    if d_ms <= 0 and d_steps >= 0:
        return None
    if d_steps <= 0:
        return float("inf")
    return 1e6 * d_ms / d_steps


def table(args):
    chip = args.topology.split(":")[0]
    out = pathlib.Path(args.out or ROOT / "benchmark" / "results" / f"attention_blocks_{chip}.json")
    data = json.loads(out.read_text())
    from difflet_tpu.layers.sdpa import SplashBlocks

    from difflet_tpu.layers.sdpa import splash_blocks

    for c in data["cases"].values():  # flags and block-size arithmetic recomputed, compiled fields kept
        chosen = list(splash_blocks(c["sq"], c["skv"]).__dict__.values())
        prev = list(previous_blocks(c["sq"], c["skv"]).__dict__.values())
        for r in c["rows"]:
            r["chosen"], r["previous"] = r["blocks"] == chosen, r["blocks"] == prev
            r.update(analytic(SplashBlocks(*r["blocks"]), c["sq"], c["skv"], c["heads"], c["head_dim"], chip))
            if "error" not in r:  # the project's estimate with splash re-priced: roofline with k/v re-reads
                r["reread_ms"] = r["estimate_ms"] - r["estimate_splash_ms"] + r["roofline_ms"]
    lines = ["| case (per rank, tp=4) | heads | q x kv tokens | chosen bq/bkv/bkv_c (padded) | grid steps | "
             "pad FLOPs | est. ms/call | est. with k/v re-reads | kernel VMEM MiB | HBM temp MB | "
             "previous rule (padded): steps, est. / with re-reads ms | chosen wins if a grid step costs more than |",
             "|" + "---|" * 12]
    full = []
    for name, c in sorted(data["cases"].items(), key=lambda kv: (kv[1]["sq"], kv[1]["skv"])):
        rows = c["rows"]
        ch = next((r for r in rows if r.get("chosen")), None)
        prev = next((r for r in rows if r.get("previous")), None)
        if ch is None or "error" in ch:
            lines.append(f"| {c['what']} | {c['heads']} | {c['sq']} x {c['skv']} | FAILED: "
                         f"{(ch or {}).get('error', 'no choice')[:80]} |" + " |" * 8)
            continue
        b = ch["blocks"]
        if prev is None or prev is ch:
            pv, be = "same", ""
        else:
            pb = prev["blocks"]
            pv = (f"{fmt_blocks(pb)} ({pb[3]} x {pb[4]}): {prev['grid_steps']}, {prev['estimate_ms']:.3f} / "
                  f"{prev['reread_ms']:.3f}")
            x = break_even_ns(ch, prev)
            be = "any overhead" if x is None else ("never" if x == float("inf") else f"{x:.1f} ns")
        lines.append(
            f"| {c['what']} | {c['heads']} | {c['sq']} x {c['skv']} | {fmt_blocks(b)} ({b[3]} x {b[4]}) | "
            f"{ch['grid_steps']} | {ch['pad_flops_pct']:+.1f}% | {ch['estimate_ms']:.3f} | {ch['reread_ms']:.3f} | "
            f"{(ch['kernel_vmem_bytes'] or 0) / 2**20:.1f} | {ch['hbm']['temporaries'] / 1e6:.0f} | {pv} | {be} |")
        if len(rows) > 3:
            full.append((name, c))
    for name, c in full:
        lines += ["", f"{c['what']} ({c['sq']} x {c['skv']} tokens, {c['heads']} heads), every candidate:", "",
                  "| bq/bkv/bkv_c | padded | grid steps | pad FLOPs | est. ms/call | est. with k/v re-reads | "
                  "kernel HBM GB | kernel VMEM MiB |", "|" + "---|" * 8]
        for r in c["rows"]:
            b = r["blocks"]
            tag = " (chosen)" if r.get("chosen") else (" (previous)" if r.get("previous") else "")
            if "error" in r:
                why = "VMEM OOM" if "Vmem" in r["error"] or "vmem" in r["error"] else r["error"][:60]
                lines.append(f"| {fmt_blocks(b)}{tag} | {b[3]} x {b[4]} | {r['grid_steps']} | "
                             f"{r['pad_flops_pct']:+.1f}% | rejected: {why} | | | |")
                continue
            lines.append(f"| {fmt_blocks(b)}{tag} | {b[3]} x {b[4]} | {r['grid_steps']} | {r['pad_flops_pct']:+.1f}% | "
                         f"{r['estimate_ms']:.3f} | {r['reread_ms']:.3f} | {r['kv_reread_gb']:.2f} | "
                         f"{(r['kernel_vmem_bytes'] or 0) / 2**20:.1f} |")
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--only", help="comma list of " + ", ".join(CASES))
    ap.add_argument("--candidates", default="flux_1024,wan_9,wan_81,hunyuan_720p",
                    help="cases (comma list, or 'all') that also compile every candidate; the others compile "
                    "the chosen and the previous rule's blocks only (default: %(default)s)")
    ap.add_argument("--skip-compiled", action="store_true",
                    help="keep the JSON's rows and compile only block sizes it does not have yet")
    ap.add_argument("--out", help="JSON (default benchmark/results/attention_blocks_<chip>.json)")
    args = ap.parse_args(argv)
    dict(run=run, table=table)[args.what](args)


if __name__ == "__main__":
    main()
