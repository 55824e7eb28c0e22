"""Compile-only ESTIMATES of a video VAE decode: one chip vs spread over a slice.

    python benchmark/vae_spread.py run [--model wan21] [--topology v5e:2x2] [--only 720p]
                                       [--placements one,width] [--out benchmark/results]
    python benchmark/vae_spread.py table [--out benchmark/results]

`run` compiles, deviceless (difflet_tpu/tools/deviceless.py), the decode the pipeline calls
(`decode_video` -> `loading._apply_jit`, uint8 frames out) with abstract bfloat16 weights of
the released VAE config (`--model`: wan21, the Wan 2.1 VAE; hunyuan_video,
`AutoencoderKLHunyuanVideo`'s defaults, the published config; ltx2, `AutoencoderKLLTX2Video`'s
defaults), once per case in a process of its own (a fresh libtpu each): on one chip of the
topology, and spread over all of its chips by height and by width (difflet_tpu/vae/spread.py).
It keeps the HBM per chip (`memory_analysis()`) and the estimate (difflet_tpu/tools/estimate.py,
calibrated per kind of work by difflet_tpu/tools/calibration.py) in vae_spread_<chip>.json
(wan21) or vae_spread_<model>_<chip>.json. `table` prints the markdown table of
docs/benchmarks.md ("VAE decode spread over the chips"). Everything here is an ESTIMATE from
the compiled schedule, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# the released Wan 2.1 VAE (Wan-AI/Wan2.1-T2V-14B-Diffusers vae/config.json)
WAN21_VAE = dict(class_name="AutoencoderKLWan", base_dim=96, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                 temperal_downsample=(False, True, True))
SHAPES = {"720p": (720, 1280, 81), "480p": (480, 832, 81)}
# per model: its shapes (height, width, frames) and (latent channels, temporal, spatial factor)
MODELS = {"wan21": (SHAPES, (16, 4, 8)),
          "hunyuan_video": ({"720p": (720, 1280, 129)}, (16, 4, 8)),
          "ltx2": ({"480p": (480, 704, 49)}, (128, 8, 32))}
PLACEMENTS = ("one", "height", "width")  # one chip; spread by rows; spread by columns


def build(model: str):
    """The abstract bfloat16 VAE of `model` (see the module docstring)."""
    import jax.numpy as jnp

    from difflet_tpu import vae

    if model == "wan21":
        return vae.AutoencoderKLCausal3D(vae.Causal3DConfig(**WAN21_VAE), dtype=jnp.bfloat16)
    if model == "hunyuan_video":
        from difflet_tpu.vae.hunyuan_video import AutoencoderKLHunyuanVideo, HunyuanVideoVAEConfig

        return AutoencoderKLHunyuanVideo(HunyuanVideoVAEConfig(), dtype=jnp.bfloat16)
    from difflet_tpu.vae.ltx2_video import AutoencoderKLLTX2Video, LTX2VideoVAEConfig

    return AutoencoderKLLTX2Video(LTX2VideoVAEConfig(), dtype=jnp.bfloat16)


def compile_case(topology: str, shape: str, placement: str, uint8: bool = True, model_name: str = "wan21") -> dict:
    """In a fresh process: compile one case, return its row."""
    from difflet_tpu.tools import deviceless

    devices, chip, calibration = deviceless.compile_target(topology)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from difflet_tpu import runtime
    from difflet_tpu.tools import estimate as E
    from difflet_tpu.tools.calibration import expected_ms
    from difflet_tpu.vae import loading as VL

    shapes, (channels, ft, fs) = MODELS[model_name]
    height, width, frames = shapes[shape]
    mesh = Mesh(np.array(devices[:1] if placement == "one" else devices), ("tp",))
    model = nnx.eval_shape(lambda: build(model_name))
    model.mesh = mesh
    graphdef, state = nnx.split(model)
    replicated = NamedSharding(mesh, PartitionSpec())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    latents = jax.ShapeDtypeStruct((1, channels, (frames - 1) // ft + 1, height // fs, width // fs), jnp.bfloat16,
                                   sharding=replicated)
    axis = None if placement == "one" else placement
    t0 = time.perf_counter()
    compiled = VL._apply_jit.trace(graphdef, state, "decode_video_latents", latents, (("spread_axis", axis),),
                                   uint8).lower().compile()
    compile_s = time.perf_counter() - t0
    raw = E.estimate(compiled.as_text(), chip)
    breakdown = E.summarize(raw)
    return dict(model=model_name, shape=shape, height=height, width=width, frames=frames, latents=list(latents.shape),
                placement=placement, chips=mesh.size, output="uint8" if uint8 else "float32",
                hbm=runtime.memory_report(compiled), estimate_ms=round(expected_ms(breakdown, calibration), 1),
                estimate_raw_ms=round(1e3 * raw.total, 1), band=list(calibration.band),
                collectives=breakdown["collectives"], compile_s=round(compile_s, 1))


def run(args) -> int:
    out = pathlib.Path(args.out)
    shapes = args.only.split(",") if args.only else list(MODELS[args.model][0])
    placements = args.placements.split(",") if args.placements else PLACEMENTS
    rows = []
    for shape in shapes:
        for placement in placements:
            cmd = [sys.executable, __file__, "one", "--model", args.model, "--topology", args.topology,
                   "--shape", shape, "--placement", placement]
            print("+", " ".join(cmd[1:]), file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode:
                rows.append(dict(shape=shape, placement=placement, error=proc.stderr.strip().splitlines()[-1:]))
                print(proc.stderr[-3000:], file=sys.stderr)
                continue
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    chip = args.topology.split(":")[0]
    path = out / (f"vae_spread_{chip}.json" if args.model == "wan21" else f"vae_spread_{args.model}_{chip}.json")
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    keep = [r for r in old if (r["shape"], r["placement"]) not in {(r2["shape"], r2["placement"]) for r2 in rows}]
    path.write_text(json.dumps(dict(topology=args.topology, rows=keep + rows), indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def table(args) -> int:
    gib = 2 ** 30
    for path in sorted(pathlib.Path(args.out).glob("vae_spread_*.json")):
        data = json.loads(path.read_text())
        model = data["rows"][0].get("model", "wan21") if data["rows"] else "wan21"
        print(f"| {model}, {data['topology']} | placement | HBM GiB/chip (temporaries) | estimate s (raw) | compile s |")
        print("|---|---|---|---|---|")
        for r in sorted(data["rows"], key=lambda r: (r["shape"], PLACEMENTS.index(r["placement"]))):
            if "error" in r:
                print(f"| {r['shape']} | {r['placement']} | error: {r['error']} | | |")
                continue
            where = "1 chip" if r["placement"] == "one" else f"{r['chips']} chips, by {r['placement']}"
            print(f"| {r['height']}x{r['width']}x{r['frames']} | {where} | {r['hbm']['total'] / gib:.2f} "
                  f"({r['hbm']['temporaries'] / gib:.2f}) | {r['estimate_ms'] / 1e3:.2f} "
                  f"({r['estimate_raw_ms'] / 1e3:.2f}) | {r['compile_s']:.0f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("run", "table", "one"))
    ap.add_argument("--model", choices=tuple(MODELS), default="wan21")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--only", help="comma-separated shapes of the model's (wan21: " + ",".join(SHAPES) + ")")
    ap.add_argument("--placements", help="comma-separated placements of " + ",".join(PLACEMENTS) + " (default all)")
    ap.add_argument("--shape")
    ap.add_argument("--placement", choices=PLACEMENTS)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results"))
    args = ap.parse_args(argv)
    if args.command == "one":
        print(json.dumps(compile_case(args.topology, args.shape, args.placement, model_name=args.model)))
        return 0
    return run(args) if args.command == "run" else table(args)


if __name__ == "__main__":
    sys.exit(main())
