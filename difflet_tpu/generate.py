"""Prompt -> PNG or MP4 from a diffusers pipeline folder (FLUX.1, Qwen-Image; Wan 2.x, HunyuanVideo, LTX-2).

    python -m difflet_tpu.generate PATH --prompt "a cat holding a sign" --out cat.png \\
        [--negative-prompt ...] [--height 1024 --width 1024] [--steps N] [--guidance 3.5]
        [--true-cfg 4.0] [--seed 0] [--batch 1] [--max-sequence-length 512]
        [--json timings.json] [--dtype bfloat16|float32] [--cpu-devices N]
    python -m difflet_tpu.generate WAN_PATH --prompt "a corgi on a beach" --frames 81 --out clip.mp4 \\
        [--image first.png [--last-image last.png]] [--guidance 5.0] [--guidance-2 ...] [--fps 16]
    python -m difflet_tpu.generate LTX2_PATH --prompt "a dog barking" --frames 121 --out clip.mp4 \\
        [--audio-out sound.wav] [--fps 24]

A video pipeline's folder (WanPipeline, WanImageToVideoPipeline) writes an H.264 MP4 at the model's
frame rate (or `--fps`); `--image` makes it image-to-video (an image-to-video folder needs it, a
text-to-video one refuses it; Wan2.2 TI2V-5B's folder takes both). `--frames` that is not 1 + 4k
is rounded down as diffusers does, with a warning that says the count made. A pipeline that
makes sound (LTX2Pipeline) gets its waveform muxed into the MP4 as an AAC track (pipeline/audio.py);
`--audio-out sound.wav` also writes it alone as a 16-bit PCM WAV (refused for a pipeline without
sound); `--fps` is then the call's `frame_rate`, so the sound lasts as long as the video.

PATH is the folder with model_index.json. Everything that can be checked is checked before
anything is loaded: the arguments against the shared bounds (difflet_tpu.arguments: seed in
[0, 2**32), steps, batch, size in multiples of 2 x the VAE's scale factor, finite scales,
max_sequence_length within the text encoder's limit), the folder's components, files and
configs (diffusion.check_configs), and every output path (checks.check_outputs: not an input,
not the other output, a writable regular file). The images and the report are written
together at the end, or not at all. Progress per stage goes to stderr; `--json` writes the tokenize / encode / each
denoise step / decode timings, the load time and, when the backend reports it, the peak device
memory. `--batch N` writes `out-0.png` ... `out-{N-1}.png`. Unset arguments take the pipeline's
defaults (diffusers': FLUX 28 steps and guidance 3.5, Qwen-Image 50 steps and true CFG 4.0 with a
negative prompt); `--seed` defaults to 0 (latents from `jax.random`).

On a TPU VM the transformer runs on every chip (TP, or SP with DIFFLET_TPU_SP=1). Without a TPU
it runs on one CPU device unless `--cpu-devices N` asks for N virtual ones (then TP/SP over them).
Step caching (docs/caching.md): `--cache first-block:threshold=0.08,warmup=2,max_skips=3` skips the
middle transformer blocks on steps whose first blocks barely changed; `--quality-gate PSNR_DB` also
runs the uncached trajectory from the same seed and reports PSNR and SSIM of the final pixels and
the transformer calls saved (in `--json`, with every step's decision and relative L1 change);
`--cache-plot PNG` plots that change per step against the threshold (needs matplotlib).

Exit status 0 on success; 1 on an error, a refusal of a value before loading included (the message
on stderr; no output file is left); 2 for a command line argparse cannot parse (an unknown flag, a
number that is not one); 3 when the quality gate's PSNR is below its floor (the outputs and the
report are written).
"""

from __future__ import annotations

import argparse
import glob
import inspect
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
    ap.add_argument("--frames", type=int, help="num_frames of a video pipeline (1 + 4k; default the pipeline's, 81)")
    ap.add_argument("--image", help="image-to-video: the first frame (an image file)")
    ap.add_argument("--last-image", help="image-to-video: the last frame (Wan2.2 I2V-A14B)")
    ap.add_argument("--guidance-2", type=float, help="guidance_scale_2 (Wan2.2 A14B's low-noise expert)")
    ap.add_argument("--fps", type=float, help="the MP4's frame rate (default: the model's)")
    ap.add_argument("--out", required=True, help="the PNG (image pipelines) or MP4 (video pipelines) to write")
    ap.add_argument("--audio-out", help="the waveform alone as a 16-bit PCM WAV (pipelines with sound: LTX-2); "
                                        "the MP4 has it as an AAC track either way")
    ap.add_argument("--json", help="write the timings here")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on TPU, float32 on CPU")
    ap.add_argument("--cpu-devices", type=int, help="virtual CPU devices when there is no TPU (default 1)")
    ap.add_argument("--cache", metavar="OPTIONS", help="step caching, e.g. first-block:threshold=0.08,warmup=2,"
                    "max_skips=3 (default: DIFFLET_TPU_STEP_CACHE, else off; docs/caching.md)")
    ap.add_argument("--quality-gate", type=float, metavar="PSNR_DB",
                    help="with --cache: also run uncached, report PSNR / SSIM of the cached output against it and "
                         "the transformer calls saved; exit status 3 when PSNR is below PSNR_DB")
    ap.add_argument("--cache-plot", metavar="PNG", help="with --cache: a plot of each step's relative L1 change "
                    "against the threshold (matplotlib)")
    ap.add_argument("--attention", metavar="SPEC", help="block-sparse video attention (Wan, HunyuanVideo, "
                    "LTX-2): dense (default), sta, "
                    "sta:window=T,H,W,full_steps=N, radial:decay=F,full_steps=N (docs/sparse-attention.md); "
                    "--quality-gate then compares with the dense run")
    return ap


EXIT_GATE_FAILED = 3


def has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def log(msg: str) -> None:
    print(f"[generate] {msg}", file=sys.stderr, flush=True)


def quiet_start() -> None:
    """A first run shows only the project's own lines: without a TPU, jax is kept off libtpu (whose
    probe prints a TPU_WORKER_HOSTNAMES error on a machine without one), and transformers' notice
    that PyTorch was not found is silenced (the tokenizers never use torch). Before jax and
    transformers are imported; a variable already set is kept."""
    if not has_tpu():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def audio_paths(args) -> list[Path]:
    """`--audio-out`, or `stem-0.wav` ... beside it for `--batch N` (as the videos); [] without it."""
    from difflet_tpu.pipeline import audio

    return [] if args.audio_out is None else audio.wav_paths(args.audio_out, args.batch)


def makes_audio(cls) -> bool:
    """The pipeline's output has a waveform (`.audio`, `.audio_sample_rate`): LTX2Pipeline."""
    return bool(getattr(cls, "makes_audio", False))


def image_paths(args) -> list[Path]:
    """`--out`, or `stem-0.png` ... `stem-{N-1}.png` (`.mp4`) beside it for `--batch N`."""
    from difflet_tpu.pipeline import images, mp4

    return (mp4.mp4_paths if Path(args.out).suffix.lower() == ".mp4" else images.png_paths)(args.out, args.batch)


def pipeline_for(path: Path, index: dict, image: bool):
    """The pipeline class to run: the folder's, or its image-to-video sibling when `--image` is
    given to a folder that has one (Wan2.2 TI2V-5B's WanPipeline folder); `--image` to a
    text-to-video folder and no `--image` for an image-to-video one are refused."""
    from difflet_tpu.pipeline import diffusion as D

    cls = D.pipeline_class(path, index)
    i2v = getattr(cls, "vae_encoder", False)
    if image and not i2v:
        sibling = getattr(__import__(cls.__module__, fromlist=["PIPELINES"]), "PIPELINES", {})
        if index.get("expand_timesteps") and "WanImageToVideoPipeline" in sibling:
            return sibling["WanImageToVideoPipeline"]
        raise ValueError(f"--image: {path} is a text-to-{'video' if is_video(cls) else 'image'} pipeline "
                         f"({index['_class_name']}); give an image-to-video folder, or leave --image out")
    if i2v and not image:
        raise ValueError(f"{path} is an image-to-video pipeline ({index['_class_name']}): give the first frame "
                         f"with --image")
    return cls


def is_video(cls) -> bool:
    from difflet_tpu.pipeline.video import VideoPipeline

    return issubclass(cls, VideoPipeline)


def check_arguments(args) -> None:
    """Refusals before anything is loaded (ValueError with the reason): the shared argument
    checks and bounds (difflet_tpu.arguments), every output path (checks.check_outputs), the
    folder and everything its configs say (diffusion.check_configs)."""
    from difflet_tpu import arguments as A
    from difflet_tpu.pipeline import diffusion as D
    from difflet_tpu.pipeline import audio, images, mp4

    from difflet_tpu.pipeline.lora import parse_lora_arg

    A.prompts(args.prompt, "--prompt")
    args.loras = [parse_lora_arg(text) for text in args.lora]
    A.negative_prompt(args.negative_prompt, "--negative-prompt")
    A.seed(args.seed, "--seed")
    args.batch = A.count("--batch", args.batch, "batch")  # bounded before a name is made per image
    for flag, limit in (("--steps", "steps"), ("--cpu-devices", "cpu_devices")):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            A.count(flag, value, limit)
    A.scale("--guidance", args.guidance, required=False)
    A.scale("--guidance-2", args.guidance_2, required=False)
    A.scale("--true-cfg", args.true_cfg, required=False)
    if args.frames is not None:
        A.count("--frames", args.frames, "frames")
    if args.fps is not None:
        mp4.check_fps(args.fps)
    for flag, value in (("--image", args.image), ("--last-image", args.last_image)):
        if value is not None:
            images.open_image(value, flag)  # readable as an image, before anything loads
    if args.last_image is not None and args.image is None:
        raise ValueError("--last-image needs --image (the first frame)")
    check_cache_arguments(args)
    path = Path(args.path)
    index = D.read_model_index(path)
    cls = pipeline_for(path, index, args.image is not None)
    video = is_video(cls)
    want = ".mp4" if video else ".png"
    if Path(args.out).suffix.lower() != want:
        raise ValueError(f"--out {args.out}: {index['_class_name']} makes {'a video' if video else 'an image'}: "
                         f"the output must be a {want} file")
    for flag, value in (("--frames", args.frames), ("--guidance-2", args.guidance_2), ("--fps", args.fps)):
        if value is not None and not video:
            raise ValueError(f"{flag}: {index['_class_name']} makes images, not videos")
    if args.true_cfg is not None and video:
        raise ValueError(f"--true-cfg: {index['_class_name']} guides with --guidance (classifier-free guidance)")
    if args.guidance_2 is not None and "guidance_scale_2" not in inspect.signature(cls.__call__).parameters:
        raise ValueError(f"--guidance-2: {index['_class_name']} has no second guidance scale (Wan 2.2 A14B's)")
    if args.audio_out is not None and not makes_audio(cls):
        raise ValueError(f"--audio-out: {index['_class_name']} makes no sound (LTX2Pipeline does); leave "
                         f"--audio-out out")
    targets, sounds = image_paths(args), audio_paths(args)
    for t in targets:
        (mp4 if video else images).check_writable(t)
    for t in sounds:
        audio.check_wav_writable(t)
    inputs = {"PATH": args.path, "--image": args.image, "--last-image": args.last_image}
    checks.check_outputs([("--out", t) for t in targets] + [("--audio-out", t) for t in sounds] +
                         [("--json", args.json), ("--cache-plot", args.cache_plot)],
                         {k: v for k, v in inputs.items() if v is not None})
    D.check_folder(path, index, cls.folder_components(index))
    D.check_configs(path, index, cls)
    if args.max_sequence_length is not None:
        A.max_sequence_length(args.max_sequence_length, cls.max_sequence_limit, "--max-sequence-length")
    factor = D.folder_vae_scale_factor(path)
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None:
            A.size(f"--{name}", v, 2 * factor, limit=name)


def check_cache_arguments(args) -> None:
    """--cache parsed (config.parse_step_cache), --quality-gate and --cache-plot only with it."""
    import math

    from difflet_tpu.config import ConfigError, parse_step_cache

    try:
        args.cache_options = parse_step_cache(args.cache if args.cache is not None else
                                              os.environ.get("DIFFLET_TPU_STEP_CACHE"), "--cache")
    except ConfigError as e:
        raise ValueError(str(e)) from None
    from difflet_tpu.layers import sparse_masks

    try:
        args.attention_option = sparse_masks.parse(getattr(args, "attention", None))
    except sparse_masks.SparsityError as e:
        raise ValueError(f"--attention: {e}") from None
    sparse = not args.attention_option.dense
    if args.quality_gate is not None and args.cache_options is None and not sparse:
        raise ValueError("--quality-gate needs --cache (e.g. --cache first-block:threshold=0.08) or --attention")
    if args.cache_plot is not None and args.cache_options is None:
        raise ValueError("--cache-plot needs --cache (e.g. --cache first-block:threshold=0.08)")
    if args.quality_gate is not None and not math.isfinite(args.quality_gate):
        raise ValueError(f"--quality-gate {args.quality_gate}: a PSNR floor in dB (a finite number)")
    if args.cache_plot is not None:
        if Path(args.cache_plot).suffix.lower() != ".png":
            raise ValueError(f"--cache-plot {args.cache_plot}: the plot is a .png file")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--cache-plot needs matplotlib (pip install 'difflet-tpu[plot]')") from None


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
    path = Path(args.path)
    cls = pipeline_for(path, D.read_model_index(path), getattr(args, "image", None) is not None)
    pipe = cls.from_pretrained(args.path, mesh=mesh, dtype=dtype, config=config)
    return pipe, mesh, n, dtype, mode


def call_kwargs(args, video: bool = False) -> dict:
    """The pipeline call's arguments from the command line (diffusers' names; `cache` and
    `quality_gate`: difflet_tpu.pipeline.caching)."""
    kwargs = _call_kwargs(args, video)
    sparse = getattr(args, "attention_option", None)
    sparse = sparse if sparse is not None and not sparse.dense else None
    if sparse is not None:
        kwargs["attention"] = sparse.spec()
    if getattr(args, "cache_options", None) is not None:
        kwargs["cache"] = args.cache_options
    if (kwargs.get("cache") is not None or sparse is not None) and getattr(args, "quality_gate", None) is not None:
        kwargs["quality_gate"] = args.quality_gate
    return kwargs


def _call_kwargs(args, video: bool) -> dict:
    if video:  # frames for a file leave the devices as uint8 ("pil")
        kwargs = dict(prompt=args.prompt, num_videos_per_prompt=args.batch, seed=args.seed, output_type="pil")
        optional = dict(negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                        num_frames=args.frames, num_inference_steps=args.steps, guidance_scale=args.guidance,
                        guidance_scale_2=args.guidance_2, max_sequence_length=args.max_sequence_length,
                        image=args.image, last_image=args.last_image)
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs
    kwargs = dict(prompt=args.prompt, num_images_per_prompt=args.batch, seed=args.seed, output_type="np")
    optional = dict(negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                    num_inference_steps=args.steps, guidance_scale=args.guidance, true_cfg_scale=args.true_cfg,
                    max_sequence_length=args.max_sequence_length)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

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
    video = is_video(type(pipe))
    targets = image_paths(args)
    devices = mesh.devices.flat if mesh is not None else jax.devices()[:1]
    if video:
        from difflet_tpu.pipeline import audio, mp4

        kwargs = call_kwargs(args, video=True)
        if makes_audio(type(pipe)) and args.fps is not None:
            kwargs["frame_rate"] = args.fps  # the sound's length follows the video's rate
        out = pipe(**kwargs)
        frames, fps = out.frames, args.fps or pipe.fps
        shape = [len(frames), len(frames[0]), frames[0][0].height, frames[0][0].width, 3]
        extra = dict(videos=[str(p) for p in targets], video_shape=shape, fps=fps)
        if makes_audio(type(pipe)):  # one waveform per video: an AAC track in its MP4 (and a WAV if asked)
            sound, rate = np.asarray(out.audio), out.audio_sample_rate
            outputs = [(t, mp4.mp4_writer(v, fps, a, rate), "video") for t, v, a in zip(targets, frames, sound)]
            outputs += [(t, audio.wav_writer(a, rate), "--audio-out") for t, a in zip(audio_paths(args), sound)]
            extra.update(audio=[str(p) for p in audio_paths(args)], audio_shape=list(sound.shape),
                         audio_sample_rate=rate)
        else:
            outputs = [(t, mp4.mp4_writer(v, fps), "video") for t, v in zip(targets, frames)]
    else:
        image = pipe(**call_kwargs(args)).images
        # the images and the report all or none: no image is left without the report asked for
        outputs = [(t, images.png_writer(x), "image") for t, x in zip(targets, images.to_pil(image))]
        extra = dict(images=[str(p) for p in targets], image_shape=list(image.shape))
    report = dict(path=str(args.path), pipeline=type(pipe).__name__, devices=n, mode=mode,
                  dtype=jnp.dtype(dtype).name, loras=[[p, s] for p, s in getattr(args, "loras", [])],
                  **extra, load_s=load_s, **pipe.timings.as_dict(),
                  peak_device_memory_bytes=peak_device_memory(list(devices)), stats=pipe.stats)
    gate = pipe.stats.get("quality_gate")
    if gate is not None:
        psnr = "inf (identical)" if gate["identical"] else f"{gate['psnr_db']:.2f} dB"
        log(f"quality gate: PSNR {psnr}, "
            f"SSIM {gate['ssim']:.4f}, floor {gate['floor_db']} dB: {'passed' if gate['passed'] else 'FAILED'}; "
            f"transformer calls {gate['transformer_calls']} of {gate['uncached_transformer_calls']} "
            f"({gate['calls_saved']} saved)")
    if getattr(args, "cache_plot", None) is not None:
        from difflet_tpu.pipeline.caching import plot_changes

        outputs.append((args.cache_plot, lambda f: plot_changes(pipe.stats, f), "--cache-plot"))
    if args.json is not None:
        outputs.append((args.json, json.dumps(report, indent=2) + "\n", "--json"))
    checks.write_all_atomic(outputs)
    for p in targets + audio_paths(args):
        log(f"wrote {p}")
    if args.json is not None:
        log(f"timings in {args.json}")
    return report


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    quiet_start()
    try:
        check_arguments(args)
        report = run(args)
    except (ValueError, TypeError, FileNotFoundError, FloatingPointError, OSError, checks.WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    gate = report["stats"].get("quality_gate")
    if gate is not None and not gate["passed"]:
        print(f"error: the quality gate failed: PSNR {gate['psnr_db']:.2f} dB < {gate['floor_db']} dB",
              file=sys.stderr)
        return EXIT_GATE_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
