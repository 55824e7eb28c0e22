"""Prompt -> PNG from a diffusers pipeline folder (FLUX.1-dev / -schnell, Qwen-Image).

    python -m difflet_tpu.generate PATH --prompt "a cat holding a sign" --out cat.png \\
        [--negative-prompt ...] [--height 1024 --width 1024] [--steps N] [--guidance 3.5]
        [--true-cfg 4.0] [--seed 0] [--batch 1] [--max-sequence-length 512]
        [--json timings.json] [--dtype bfloat16|float32] [--cpu-devices N]

PATH is the folder with model_index.json. Everything that can be checked is checked before
anything is loaded: the folder's components and files, the prompt, the size (multiples of
2 x the VAE's scale factor, 16 for the published models), the output path (its folder must be
writable). Progress per stage goes to stderr; `--json` writes the tokenize / encode / each
denoise step / decode timings, the load time and, when the backend reports it, the peak device
memory. `--batch N` writes `out-0.png` ... `out-{N-1}.png`. Unset arguments take the pipeline's
defaults (diffusers': FLUX 28 steps and guidance 3.5, Qwen-Image 50 steps and true CFG 4.0 with a
negative prompt); `--seed` defaults to 0 (latents from `jax.random`).

On a TPU VM the transformer runs on every chip (TP, or SP with DIFFLET_TPU_SP=1). Without a TPU
it runs on one CPU device unless `--cpu-devices N` asks for N virtual ones (then TP/SP over them).
Exit status 0 on success, 1 on an error (the message on stderr; no output file is left), 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from pathlib import Path

from difflet_tpu import checks


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.generate", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a diffusers pipeline folder (model_index.json, scheduler/, text_encoder/, ...)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--negative-prompt", help="enables true CFG with --true-cfg > 1 (Qwen-Image's default 4.0)")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--steps", type=int, help="num_inference_steps (default: the pipeline's)")
    ap.add_argument("--guidance", type=float, help="guidance_scale (FLUX.1-dev's embedded guidance)")
    ap.add_argument("--true-cfg", type=float, help="true_cfg_scale (with --negative-prompt)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="num_images_per_prompt")
    ap.add_argument("--max-sequence-length", type=int)
    ap.add_argument("--lora", action="append", default=[], metavar="FILE[:SCALE]",
                    help="a LoRA safetensors (diffusers/PEFT, or FLUX's kohya format) at SCALE (default 1.0), "
                         "fused into the transformer; repeat to combine adapters")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--json", help="write the timings here")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on TPU, float32 on CPU")
    ap.add_argument("--cpu-devices", type=int, help="virtual CPU devices when there is no TPU (default 1)")
    return ap


def has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def log(msg: str) -> None:
    print(f"[generate] {msg}", file=sys.stderr, flush=True)


def check_arguments(args) -> None:
    """Refusals before anything is loaded (ValueError with the reason)."""
    from difflet_tpu.encoders.tokenizers import as_prompt_list
    from difflet_tpu.pipeline import diffusion as D
    from difflet_tpu.pipeline import images

    from difflet_tpu.pipeline.lora import parse_lora_arg

    as_prompt_list(args.prompt)
    args.loras = [parse_lora_arg(text) for text in args.lora]
    for name in ("steps", "batch", "cpu_devices", "max_sequence_length"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("guidance", "true_cfg"):
        try:
            D.DiffusionPipeline.check_scale(f"--{name.replace('_', '-')}", getattr(args, name))
        except D.PipelineError as e:
            raise ValueError(str(e)) from None
    images.check_writable(args.out)
    if args.batch > 1:
        stem = Path(args.out)
        for i in range(args.batch):
            images.check_writable(stem.with_name(f"{stem.stem}-{i}{stem.suffix}"))
    if args.json:
        j = Path(args.json)
        if j.is_dir() or not j.parent.is_dir() or not os.access(j.parent if str(j.parent) else ".", os.W_OK):
            raise ValueError(f"--json {j}: cannot write there (the folder must exist and be writable)")
    path = Path(args.path)
    index = D.read_model_index(path)
    cls = D.pipeline_class(path, index)
    D.check_folder(path, index, cls.components)
    factor = D.folder_vae_scale_factor(path)
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None and (v <= 0 or v % (2 * factor)):
            raise ValueError(f"--{name} must be a positive multiple of {2 * factor} (the VAE's {factor}x and the "
                             f"2x2 latent packing), got {v}")


def peak_device_memory(devices) -> int | None:
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory stats (CPU)
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def load(args):
    """The pipeline at `args.path` on every device (one CPU device unless `--cpu-devices`), as
    `generate` and the bench's `--end-to-end` run it: (pipeline, mesh or None, device count, dtype, mode)."""
    tpu = has_tpu()
    if not tpu:
        from difflet_tpu.parallel.mesh import use_cpu_devices

        # a process that already asked for more virtual devices (main() called in-process, e.g.
        # by the tests) keeps them: the run uses the first `--cpu-devices` of them
        asked = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
        if asked is None or int(asked.group(1)) < (args.cpu_devices or 1):
            use_cpu_devices(args.cpu_devices or 1)
    import jax
    import jax.numpy as jnp

    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.pipeline import diffusion as D

    n = jax.device_count() if tpu else min(args.cpu_devices or 1, jax.device_count())
    mesh = make_mesh(n, jax.devices()[:n]) if n > 1 else None
    config = Config.from_env()
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype or ("bfloat16" if tpu else "float32")]
    mode = "one device" if mesh is None else f"{'SP' if config.sp else 'TP'} on {n} devices"
    log(f"loading {args.path} ({jnp.dtype(dtype).name}, {mode})")
    pipe = D.DiffusionPipeline.from_pretrained(args.path, mesh=mesh, dtype=dtype, config=config)
    return pipe, mesh, n, dtype, mode


def call_kwargs(args) -> dict:
    """The pipeline call's arguments from the command line (diffusers' names)."""
    kwargs = dict(prompt=args.prompt, num_images_per_prompt=args.batch, seed=args.seed, output_type="np")
    optional = dict(negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                    num_inference_steps=args.steps, guidance_scale=args.guidance, true_cfg_scale=args.true_cfg,
                    max_sequence_length=args.max_sequence_length)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from difflet_tpu.pipeline import images

    start = time.perf_counter()
    pipe, mesh, n, dtype, mode = load(args)
    load_s = time.perf_counter() - start
    log(f"loaded {type(pipe).__name__} in {load_s:.1f} s")
    from difflet_tpu.pipeline.lora import apply_lora_args

    for name, (path, scale) in zip(apply_lora_args(pipe, getattr(args, "loras", [])), getattr(args, "loras", [])):
        log(f"LoRA {path} at {scale} fused ({name})")

    def on_stage(stage, info):
        if stage == "step":
            log(f"denoise step {info['index'] + 1}/{info['total']}: {info['seconds']:.2f} s")
        else:
            log(stage + (f" ({info['steps']} steps)" if "steps" in info else ""))

    pipe.on_stage = on_stage
    image = pipe(**call_kwargs(args)).images
    written = images.save_pngs(image, args.out)
    for p in written:
        log(f"wrote {p}")
    devices = mesh.devices.flat if mesh is not None else jax.devices()[:1]
    report = dict(path=str(args.path), pipeline=type(pipe).__name__, devices=n, mode=mode,
                  dtype=jnp.dtype(dtype).name, loras=[[p, s] for p, s in getattr(args, "loras", [])],
                  images=[str(p) for p in written],
                  image_shape=list(image.shape), load_s=load_s, **pipe.timings.as_dict(),
                  peak_device_memory_bytes=peak_device_memory(list(devices)))
    if args.json:
        checks.write_atomic(args.json, json.dumps(report, indent=2) + "\n", "--json")
        log(f"timings in {args.json}")
    return report


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        check_arguments(args)
        run(args)
    except (ValueError, TypeError, FileNotFoundError, FloatingPointError, OSError, checks.WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
