"""`python -m difflet_tpu.bench --end-to-end PATH`: one prompt -> image call, timed stage by stage.

The pipeline folder loads as `python -m difflet_tpu.generate` loads it (every stage on the
devices; DIFFLET_TPU_SP picks SP for the transformer). It is called twice with the same
arguments: the first ("cold") compiles every stage, the second ("warm") is the steady state a
server sees. The table gives tokenize, text encode, each denoise step, decode and the devices'
peak memory. These are measurements of wherever it runs: on CPU devices they time the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time

from difflet_tpu.bench.report import write_json

DEFAULT_PROMPT = "a photograph of a red fox standing in fresh snow, morning light"


def generate_args(args) -> argparse.Namespace:
    """The `generate` arguments of a bench `--end-to-end` run."""
    return argparse.Namespace(path=args.end_to_end, prompt=args.prompt or DEFAULT_PROMPT, negative_prompt=None,
                              height=args.height, width=args.width, steps=args.steps, guidance=args.guidance,
                              true_cfg=None, seed=args.seed, batch=args.batch, max_sequence_length=None,
                              dtype=args.dtype, cpu_devices=args.cpu_devices)


def print_stages(runs: dict, out=None) -> None:
    out = out or sys.stdout
    print(f"{'stage':17} " + " ".join(f"{name + ' s':>10}" for name in runs), file=out)
    rows = [("tokenize", "tokenize_s"), ("text encode", "encode_s"), ("denoise", "denoise_s"),
            ("decode", "decode_s"), ("encoder moves", "encoder_moves_s"),
            ("transformer moves", "transformer_moves_s"), ("encoder stream", "encoder_stream_s"),
            ("whole call", "call_s")]
    for label, key in rows:
        print(f"{label:17} " + " ".join(f"{r[key]:10.3f}" for r in runs.values()), file=out)
    warm = runs["warm"]
    steps = warm["denoise_steps_s"]
    if steps:
        print(f"denoise steps (warm): {len(steps)}, median {sorted(steps)[len(steps) // 2] * 1e3:.1f} ms, "
              f"min {min(steps) * 1e3:.1f} ms", file=out)
    share = (warm["encode_s"] + warm["decode_s"]) / warm["denoise_s"] if warm["denoise_s"] else float("nan")
    print(f"text encode + decode / denoise (warm): {100 * share:.1f}%", file=out)


def run_end_to_end(args) -> int:
    import jax
    import jax.numpy as jnp

    from difflet_tpu import generate

    g = generate_args(args)
    start = time.perf_counter()
    pipe, mesh, n, dtype, mode = generate.load(g)
    load_s = time.perf_counter() - start
    from difflet_tpu.pipeline.lora import apply_lora_args

    start = time.perf_counter()
    apply_lora_args(pipe, getattr(args, "loras", []))
    lora_s = time.perf_counter() - start
    kwargs = generate.call_kwargs(g)
    runs = {}
    for name in ("cold", "warm"):
        start = time.perf_counter()
        images = pipe(**kwargs).images  # non-finite images are refused inside
        call_s = time.perf_counter() - start
        runs[name] = dict(pipe.timings.as_dict(), call_s=call_s)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    report = dict(kind="end-to-end", path=str(args.end_to_end), pipeline=type(pipe).__name__, devices=n,
                  mode=mode, dtype=jnp.dtype(dtype).name, platform=devices[0].platform, prompt=kwargs["prompt"],
                  image_shape=list(images.shape), load_s=load_s, runs=runs,
                  loras=[[p, s] for p, s in getattr(args, "loras", [])], lora_fuse_s=lora_s,
                  peak_device_memory_bytes=generate.peak_device_memory(devices),
                  note="measured on " + devices[0].platform + (" (not a TPU)" if devices[0].platform != "tpu" else ""))
    print(f"{report['pipeline']} from {args.end_to_end}: {mode}, {report['dtype']}, "
          f"image {'x'.join(map(str, report['image_shape']))}, load {load_s:.1f} s; {report['note']}")
    print_stages(runs)
    if args.json:
        write_json(args.json, report)
    return 0
