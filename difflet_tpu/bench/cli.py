"""`python -m difflet_tpu.bench`: the denoise benchmark, TP vs SP, and compile-only estimates.

With no arguments on a machine without a TPU it sets up 4 virtual CPU
devices and runs every port's tiny preset for a few steps under TP and
SP (float32), printing a table: step times, the final latents' sha256, and
SP vs TP relative L2 / PSNR. On a TPU VM the same command runs the ports'
released presets at their benchmark shapes.

`--compile-only --topology v5e:2x2` needs neither a TPU nor weights: it
compiles the real config's step for that slice (deviceless) per mode and
reports HBM per chip, FLOPs, collectives and a schedule-based ESTIMATE of the
step time (difflet_tpu.tools.estimate; docs/benchmarks.md has the model and its
constants).

Meshes: `--mesh cfg=2,tp=4` (or DIFFLET_TPU_MESH) splits classifier-free
guidance's [unconditional | conditional] rows over two `cfg` groups, each a
`tp` ring; `data` splits more rows (`--batch` prompts). Default: one `tp`
ring over every device when the heads divide it, else the largest ring that
divides them with `cfg` / `data` groups for the rest.

Multi-host (`--distributed`, or `--coordinator/--num-processes/--process-id`):
every process runs the same command on the global mesh (difflet_tpu.parallel.distributed);
process 0 prints the table and writes the JSON, and the final latents' sha256
of every process must agree.

Two-expert models (Wan2.2 A14B): `--expert-offload` / DIFFLET_TPU_EXPERT_OFFLOAD
keeps the idle expert in host memory (difflet_tpu/config.py); --compile-only
then leaves it out of HBM per chip and estimates the swap, the timed run
measures it.

Prompt to image (`--compile-only --pipeline flux|qwen_image --topology v5e:2x2`): every
stage of the released pipeline compiled deviceless (text encoders, the transformer per
`--mode`, default tp and sp-pallas, the VAE decode), HBM per chip, ESTIMATED ms, where the
text encoders live between prompts (`--encoder-offload`) and the end-to-end estimate
(difflet_tpu/bench/pipeline_plan.py; docs/benchmarks.md). Prompt to video: `--pipeline wan`
(`--model wan:<preset>`, `--frames`; difflet_tpu/bench/video_plan.py), `--pipeline hunyuan_video`
and `--pipeline ltx2` (also `--guidance`; difflet_tpu/bench/av_plan.py).

Modes: tp, sp (JAX rings or Pallas kernels per the config / model default),
sp-xla (plain all_gather / psum_scatter with XLA's collective-matmul
decomposition switched on), all. Default: DIFFLET_TPU_SP (1 -> sp, 0 -> tp),
unset -> tp and sp. Under --compile-only: tp, sp (the JAX rings), sp-pallas
(the Pallas all-gather kernel), sp-xla; default and `all` = all four.
"""

from __future__ import annotations

import argparse
import pathlib
import math
import os
import sys
from difflet_tpu import arguments as A
from difflet_tpu.bench.cases import BenchError, MODES
from difflet_tpu.bench.compile_only import COMPILE_VARIANTS, run_compile_only
from difflet_tpu.bench.run import run_bench


def parser():
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="port (" + ", ".join(_port_names()) + "), port:preset "
                    "(wan:tiny, wan:Wan2.2-T2V-A14B) or a released preset name; repeatable; default: every "
                    "port (tiny presets on CPU)")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--steps", type=int, help="denoise steps (default: 4 on CPU, the pipeline's default on TPU)")
    ap.add_argument("--mode", help="tp | sp | sp-xla | all, or a comma list (default: from DIFFLET_TPU_SP)")
    ap.add_argument("--weights", help="a diffusers transformer directory (random init otherwise)")
    ap.add_argument("--embeddings", help="precomputed text embeddings (.safetensors / .npz, diffusers argument names)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per expert before the timed loop (>= 1)")
    ap.add_argument("--guidance", type=float, help="guidance scale (default: the pipeline's; 1 turns CFG off)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: float32 on CPU, bfloat16 on TPU")
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--profile", help="jax.profiler trace of the timed steps into DIR/<model>-<mode> (written "
                    "beside it and renamed when the run succeeds; a failed run leaves none)")
    ap.add_argument("--dump-hlo", help="write each compiled step's HLO text into DIR")
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="JAX's persistent compilation cache in DIR (created if missing): a second run loads "
                    "the compiled steps instead of compiling (default: DIFFLET_TPU_COMPILE_CACHE, else off)")
    ap.add_argument("--compile-only", action="store_true", help="deviceless compile + estimate for --topology")
    ap.add_argument("--topology", help="TPU topology for --compile-only, e.g. v5e:2x2, v5e:2x4, v6e:2x2")
    ap.add_argument("--pipeline", choices=PLAN_PIPELINES,
                    help="--compile-only: plan every stage of a prompt -> image pipeline (text encoders, "
                    "transformer, VAE) instead of a transformer step; wan, hunyuan_video, ltx2: prompt -> video "
                    "(--model <pipeline>:<preset>, --frames; hunyuan_video and ltx2 also --guidance)")
    ap.add_argument("--decode-rows", metavar="JSON",
                    help="--pipeline wan: take the VAE decode rows of this shape from a benchmark/vae_spread.py "
                         "result (the same program, compiled for the same topology) instead of compiling them")
    ap.add_argument("--reuse-stages", metavar="JSON",
                    help="--pipeline wan | hunyuan_video | ltx2: take every stage that compiled in this earlier plan "
                         "JSON of the same model, "
                         "shape and topology instead of compiling it again (each reused row names its source)")
    ap.add_argument("--end-to-end", metavar="PIPELINE_DIR",
                    help="time one prompt -> image call of a diffusers pipeline folder stage by stage (tokenize, "
                    "text encode, each denoise step, decode), cold and warm (difflet_tpu/bench/end_to_end.py)")
    ap.add_argument("--prompt", help="--end-to-end: the prompt (default: a fixed one)")
    ap.add_argument("--lora", action="append", default=[], metavar="FILE[:SCALE]",
                    help="--end-to-end: a LoRA safetensors at SCALE (default 1.0) fused into the transformer; "
                         "repeat to combine adapters")
    ap.add_argument("--encoder-offload", choices=("auto", "on", "off"),
                    help="--pipeline: where the text encoders live between prompts (default: "
                    "DIFFLET_TPU_ENCODER_OFFLOAD, else auto: host memory only when the stages do not fit together)")
    ap.add_argument("--calibrated", choices=("yes", "no"),
                    help="--compile-only: apply the estimator's fitted factors (default yes; both are reported)")
    ap.add_argument("--mesh", help="device mesh AXIS=SIZE,... over cfg, data, tp, e.g. cfg=2,tp=4 (default: "
                    "DIFFLET_TPU_MESH, else one tp ring over every device when the heads divide it)")
    ap.add_argument("--attention", metavar="SPEC",
                    help="block-sparse video self-attention on every step (docs/sparse-attention.md): dense "
                         "(default), sta (a window of tiles; sta:window=T,H,W,tile=T,H,W) or radial "
                         "(radial:decay=F,sink=0|1); Wan, HunyuanVideo and LTX-2; --compile-only prices it "
                         "by its active blocks")
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (CFG doubles the rows; default 1)")
    ap.add_argument("--cache", metavar="OPTIONS",
                    help="step caching of the timed loop, e.g. first-block:threshold=0.08,warmup=2,max_skips=3 "
                    "(default: DIFFLET_TPU_STEP_CACHE, else off; docs/caching.md); the row reports its decisions")
    ap.add_argument("--expert-offload", choices=("auto", "on", "off"),
                    help="where a two-expert model (Wan2.2 A14B) keeps its idle expert: host memory (on), the "
                    "devices (off), or auto: host memory only when both experts do not fit the device memory "
                    "(default: DIFFLET_TPU_EXPERT_OFFLOAD, else auto; docs in difflet_tpu/config.py)")
    dist = ap.add_argument_group("multi-host (jax.distributed; docs/multi-host.md)")
    dist.add_argument("--distributed", action="store_true",
                      help="join a multi-process run found from the environment (a TPU VM slice: run the same "
                      "command on every worker)")
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (explicit multi-process run)")
    dist.add_argument("--num-processes", type=int)
    dist.add_argument("--process-id", type=int)
    dist.add_argument("--cpu-devices", type=int, help="virtual CPU devices in this process (no TPU; default 4)")
    dist.add_argument("--init-timeout", type=int, default=300,
                      help="seconds to wait for the coordinator and every process (default 300)")
    dist.add_argument("--heartbeat-timeout", type=int, default=100,
                      help="seconds after which a silent process is declared dead (default 100)")
    return ap


PLAN_PIPELINES = ("flux", "qwen_image", "wan", "hunyuan_video", "ltx2")
# flags a --pipeline plan does not take: it compiles the released pipeline at batch 1 on one tp mesh
PLAN_REFUSED = ("model", "frames", "mesh", "guidance", "expert_offload", "dump_hlo")
# the video plans: which model (default the released one), how many frames; HunyuanVideo, LTX-2: the guidance
VIDEO_PLAN_TAKES = {"wan": ("model", "frames"), "hunyuan_video": ("model", "frames", "guidance"),
                    "ltx2": ("model", "frames", "guidance")}


def _port_names():
    from difflet_tpu.models import PORTS

    return PORTS


def parse_modes(value: str | None) -> list[str]:
    if value is None:
        env = os.environ.get("DIFFLET_TPU_SP")
        if env is None:
            return ["tp", "sp"]
        if env.strip() not in ("0", "1"):
            raise BenchError(f"DIFFLET_TPU_SP={env!r} is not allowed; use 0 or 1")
        return ["sp"] if env.strip() == "1" else ["tp"]
    out = []
    for m in value.split(","):
        m = m.strip()
        if m == "all":
            out += [x for x in MODES if x not in out]
        elif m in MODES or m == "sp-pallas":
            if m not in out:
                out.append(m)
        else:
            raise BenchError(f"--mode {value!r}: unknown mode {m!r}; use tp, sp, sp-xla or all")
    return out


# The bounds are the shared table (difflet_tpu.arguments.LIMITS): generate and the pipelines refuse
# the same values.
LIMITS = A.LIMITS
BOUNDED = ("steps", "warmup", "batch", "height", "width", "frames", "cpu_devices", "seed")


def validate(args, ap):
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    for name in BOUNDED:
        v = getattr(args, name)
        if v is not None and (v > LIMITS[name][1] or name == "seed"):  # lower bounds: their own messages
            try:
                A.integer(f"--{name.replace('_', '-')}", v, limit=name)
            except A.ArgumentError as e:
                ap.error(str(e))
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first call compiles; timed steps never include it)")
    for name in ("height", "width", "frames"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name} must be positive")
    if args.guidance is not None and not (math.isfinite(args.guidance) and args.guidance >= 0):
        ap.error(f"--guidance {args.guidance}: must be a finite number >= 0")
    if args.compile_only:
        if not args.topology:
            ap.error("--compile-only needs --topology (e.g. v5e:2x2)")
        for flag in ("weights", "embeddings", "profile"):
            if getattr(args, flag):
                ap.error(f"--{flag} cannot be combined with --compile-only (nothing runs)")
        if args.compile_cache:  # jax 0.12 writes entries but cannot load them without a TPU client
            ap.error("--compile-cache cannot be combined with --compile-only (a deviceless compile "
                     "cannot load cached executables)")
    elif args.topology or args.calibrated:
        ap.error(f"--{'topology' if args.topology else 'calibrated'} only applies to --compile-only")
    args.calibrated = args.calibrated or "yes"
    if args.weights and not os.path.isdir(args.weights):
        ap.error(f"--weights {args.weights}: not a directory")
    if args.weights and args.model and len(args.model) > 1:
        ap.error("--weights loads one transformer: give one --model")
    if args.embeddings and not os.path.isfile(args.embeddings):
        ap.error(f"--embeddings {args.embeddings}: no such file")
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    from difflet_tpu.config import Config, ConfigError
    from difflet_tpu.parallel.mesh import parse_mesh

    if args.mesh is not None:
        try:
            args.mesh_axes = parse_mesh(args.mesh)
        except ValueError as e:
            ap.error(f"--mesh: {e}")
    else:
        try:
            args.mesh_axes = Config.from_env().mesh_axes()
        except ConfigError as e:
            ap.error(str(e))
    try:
        args.offload = args.expert_offload or Config.from_env().expert_offload
        from difflet_tpu.config import parse_step_cache

        args.cache = parse_step_cache(args.cache if args.cache is not None else Config.from_env().step_cache,
                                      "--cache")
    except ConfigError as e:
        ap.error(str(e))
    if args.cache is not None and (args.compile_only or args.end_to_end):
        ap.error("--cache applies to the timed denoise loop (not --compile-only / --end-to-end)")
    explicit = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if any(explicit) and not all(explicit):
        ap.error("--coordinator, --num-processes and --process-id go together")
    if all(explicit) and args.num_processes == 1:  # it would serve a one-process run others could join by mistake
        ap.error(f"--num-processes 1 with --coordinator {args.coordinator}: one process needs no coordinator (drop "
                 f"--coordinator / --num-processes / --process-id); if other processes use this coordinator, start "
                 f"every process with the same --num-processes (their count)")
    args.multi = args.distributed or all(explicit)
    if args.compile_only and (args.multi or args.cpu_devices):
        ap.error("--compile-only compiles deviceless in one process: no --distributed / --coordinator / "
                 "--cpu-devices")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        ap.error("--cpu-devices must be >= 1")
    if args.init_timeout < 1 or args.heartbeat_timeout < 1:
        ap.error("--init-timeout and --heartbeat-timeout must be >= 1 (seconds)")
    try:
        args.modes = parse_modes(args.mode)
    except BenchError as e:
        ap.error(str(e))
    if args.compile_only:
        if args.mode is None or "all" in args.mode.split(","):
            args.modes = list(COMPILE_VARIANTS)
    elif "sp-pallas" in args.modes:
        ap.error("--mode sp-pallas is a --compile-only variant; on a device set DIFFLET_TPU_SP_KERNEL=pallas")
    if args.pipeline or args.encoder_offload:
        validate_pipeline_plan(args, ap)
    if args.attention is not None:
        from difflet_tpu.layers import sparse_masks

        try:
            args.attention_option = sparse_masks.parse(args.attention)
        except sparse_masks.SparsityError as e:
            ap.error(f"--attention: {e}")
        if args.pipeline or args.end_to_end:
            ap.error("--attention applies to the transformer's steps (the timed loop or --compile-only), not "
                     "--pipeline / --end-to-end plans; pipeline calls take attention=")
    if args.lora and not args.end_to_end:
        ap.error("--lora only applies to --end-to-end (the pipeline's transformer takes the adapters)")
    if args.end_to_end or args.prompt is not None:
        validate_end_to_end(args, ap)
    # Outputs are checked before any work (a run must not end in a traceback over its report).
    from difflet_tpu import checks

    try:
        inputs = {"--embeddings": args.embeddings, "--weights": args.weights, "--end-to-end": args.end_to_end}
        checks.check_outputs([("--json", args.json)], inputs)
        for flag in ("profile", "dump_hlo"):
            if getattr(args, flag):
                checks.not_an_input(getattr(args, flag), inputs, "--" + flag.replace("_", "-"))
                checks.writable_dir(getattr(args, flag), "--" + flag.replace("_", "-"))
    except ValueError as e:
        ap.error(str(e))
    args.embedding_arrays = None
    if args.embeddings:
        from difflet_tpu.pipeline.denoise import read_embeddings

        try:
            args.embedding_arrays = read_embeddings(args.embeddings)
        except ValueError as e:
            ap.error(str(e))


END_TO_END_REFUSED = ("model", "weights", "embeddings", "frames", "mesh", "mode", "expert_offload", "dump_hlo",
                      "profile", "pipeline", "topology")


def validate_end_to_end(args, ap):
    if not args.end_to_end:
        ap.error("--prompt only applies to --end-to-end")
    if args.compile_only:
        ap.error("--end-to-end runs the pipeline; to plan it deviceless use --compile-only --pipeline flux|qwen_image")
    for flag in END_TO_END_REFUSED:
        if getattr(args, flag, None) is not None:
            ap.error(f"--{flag.replace('_', '-')} cannot be combined with --end-to-end (the folder's pipeline runs "
                     f"on every device; DIFFLET_TPU_SP picks SP)")
    if args.prompt is not None and not args.prompt.strip():
        ap.error("--prompt is empty")
    from difflet_tpu.pipeline.lora import parse_lora_arg

    try:
        args.loras = [parse_lora_arg(text) for text in args.lora]
    except ValueError as e:
        ap.error(str(e))
    if not (pathlib.Path(args.end_to_end) / "model_index.json").is_file():
        ap.error(f"--end-to-end {args.end_to_end}: no model_index.json (expected a diffusers pipeline folder)")
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None and (v < 16 or v % 16):
            ap.error(f"--{name} {v}: must be a positive multiple of 16 (the VAE's 8x and the 2x2 latent packing)")


def validate_pipeline_plan(args, ap):
    if not args.pipeline:
        ap.error("--encoder-offload only applies to --pipeline")
    if not args.compile_only:
        ap.error("--pipeline plans deviceless (--compile-only --topology T); to run a pipeline on a TPU use "
                 "python -m difflet_tpu.generate")
    for flag in PLAN_REFUSED:
        if getattr(args, flag) is not None and flag not in VIDEO_PLAN_TAKES.get(args.pipeline, ()):
            ap.error(f"--{flag.replace('_', '-')} cannot be combined with --pipeline (it plans the released "
                     f"pipeline at batch 1 on one tp mesh)")
    if args.batch != 1:
        ap.error("--pipeline plans batch 1 (--batch must be 1)")
    if args.decode_rows and args.pipeline != "wan":
        ap.error("--decode-rows only applies to --pipeline wan")
    if args.reuse_stages and args.pipeline not in VIDEO_PLAN_TAKES:
        ap.error("--reuse-stages only applies to --pipeline wan | hunyuan_video | ltx2")
    if args.reuse_stages and not pathlib.Path(args.reuse_stages).is_file():
        ap.error(f"--reuse-stages {args.reuse_stages}: no such file (an earlier plan JSON)")
    if args.decode_rows and not pathlib.Path(args.decode_rows).is_file():
        ap.error(f"--decode-rows {args.decode_rows}: no such file (a benchmark/vae_spread.py result)")
    if args.pipeline in VIDEO_PLAN_TAKES and args.model and len(args.model) > 1:
        ap.error(f"--pipeline {args.pipeline} plans one model: give one --model (e.g. wan:Wan2.2-T2V-A14B)")
    if args.mode is None:
        args.modes = ["tp", "sp-pallas"]
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None and v % 16:
            ap.error(f"--{name} {v}: must be a multiple of 16 (the VAE's 8x and the 2x2 latent packing)")
    from difflet_tpu.config import Config, ConfigError

    try:
        args.encoder_offload = args.encoder_offload or Config.from_env().encoder_offload
        args.encoder_stream = Config.from_env().encoder_stream  # the video plans follow it as the runtime does
    except ConfigError as e:
        ap.error(str(e))


def main(argv=None):
    """`python -m difflet_tpu.bench` (see the module docstring and `--help`)."""
    ap = parser()
    args = ap.parse_args(argv)
    validate(args, ap)
    from difflet_tpu.checks import WriteError

    try:
        if args.end_to_end:
            from difflet_tpu.bench.end_to_end import run_end_to_end

            return run_end_to_end(args)
        if args.compile_only and args.pipeline == "wan":
            from difflet_tpu.bench.video_plan import run_video_plan

            return run_video_plan(args)
        if args.compile_only and args.pipeline in ("hunyuan_video", "ltx2"):
            from difflet_tpu.bench.av_plan import run_av_plan

            return run_av_plan(args)
        if args.compile_only and args.pipeline:
            from difflet_tpu.bench.pipeline_plan import run_pipeline_plan

            return run_pipeline_plan(args)
        if args.compile_only:
            return run_compile_only(args)
        return run_bench(args)
    except WriteError as e:  # after the work: the run's report or dump could not be written
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad --model names, shapes the port refuses
        print(f"error: {e}", file=sys.stderr)
        return 2
