"""A resident server for one pipeline folder, in OpenAI's API shapes.

    python -m difflet_tpu.serve PATH [--host 127.0.0.1 --port 8000] [--mesh one|tp|sp[:N]]
        [--max-batch 4] [--queue 64] [--warmup 1024x1024,...] [--warmup-frames 81]
        [--compile-cache DIR] [--model-name NAME] [--job-ttl 3600] [--dtype bfloat16|float32]
        [--cpu-devices N] [--coordinator HOST:PORT --num-processes N --process-id I]

Loads PATH once (a diffusers pipeline folder: FLUX.1, Qwen-Image, Wan text-to-video), starts
HTTP at once (GET /health answers 503 until ready), compiles the --warmup shapes for every
batch size it may use (through the persistent compilation cache with --compile-cache), then
reports ready and serves. A shape not warmed up compiles on its first request (counted in
/metrics), it is not refused. On a multi-host slice every process runs this command (with
--coordinator ... or, on a TPU VM slice, --multi-host for cluster detection): process 0 serves
HTTP, the others run every call with it (difflet_tpu.serve.distributed). SIGTERM (or Ctrl-C)
stops accepting, answers everything accepted, then exits 0. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger("difflet_tpu.serve")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.serve", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a diffusers pipeline folder (model_index.json, ...)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--mesh", default=None, help="one | tp | sp, optionally :N devices (default: tp over all "
                                                 "devices when there are several)")
    ap.add_argument("--max-batch", type=int, default=4, help="rows (images) per pipeline call at most")
    ap.add_argument("--queue", type=int, default=64, help="requests waiting at most (then 429)")
    ap.add_argument("--warmup", default="", help="sizes WxH,WxH compiled before ready")
    ap.add_argument("--warmup-frames", type=int, default=None, help="video: num_frames of the warm-up")
    ap.add_argument("--compile-cache", default=None, help="JAX's persistent compilation cache directory")
    ap.add_argument("--model-name", default=None, help="the model id clients name (default: the folder's name)")
    ap.add_argument("--job-ttl", type=float, default=3600.0, help="seconds a finished video is kept")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on TPU, float32 on CPU")
    ap.add_argument("--cpu-devices", type=int, help="virtual CPU devices when there is no TPU")
    ap.add_argument("--coordinator", help="multi-host: process 0's HOST:PORT for jax.distributed")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--multi-host", action="store_true", help="jax.distributed by cluster detection (TPU VM slice)")
    return ap


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'1024x768,512x512' -> [(height, width), ...] (OpenAI's sizes are width x height)."""
    sizes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)", item)
        if not m:
            raise ValueError(f"--warmup: {item!r} is not WxH")
        sizes.append((int(m.group(2)), int(m.group(1))))
    return sizes


def parse_mesh(text: str | None, devices: int) -> tuple[str, int]:
    if text is None:
        return ("tp", devices) if devices > 1 else ("one", 1)
    m = re.fullmatch(r"(one|tp|sp)(?::(\d+))?", text)
    if not m:
        raise ValueError(f"--mesh {text!r}: expected one, tp, sp, tp:N or sp:N")
    mode, n = m.group(1), int(m.group(2) or (1 if m.group(1) == "one" else devices))
    if mode == "one" and n != 1 or not 1 <= n <= devices:
        raise ValueError(f"--mesh {text!r}: {n} devices, {devices} available")
    return mode, n


def load(args):
    """(pipeline, process index, process count, mode) with jax.distributed started when asked."""
    from difflet_tpu.generate import has_tpu

    multi = args.coordinator is not None or args.multi_host
    if multi:
        from difflet_tpu.parallel import distributed

        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               cpu_devices=None if has_tpu() else (args.cpu_devices or 1))
    elif not has_tpu():
        from difflet_tpu.parallel.mesh import use_cpu_devices

        asked = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
        if asked is None or int(asked.group(1)) < (args.cpu_devices or 1):
            use_cpu_devices(args.cpu_devices or 1)
    import dataclasses

    import jax
    import jax.numpy as jnp

    from difflet_tpu import runtime
    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.pipeline import diffusion as D

    if args.compile_cache:
        runtime.enable_compile_cache(args.compile_cache)
    runtime.compile_stats()  # count every compile from here
    mode, n = parse_mesh(args.mesh, jax.device_count())
    mesh = make_mesh(n, jax.devices()[:n]) if mode != "one" else None
    config = dataclasses.replace(Config.from_env(), sp=mode == "sp")
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype or ("bfloat16" if has_tpu() else "float32")]
    logger.info("loading %s (%s, %s on %d devices, process %d of %d)", args.path, jnp.dtype(dtype).name, mode, n,
                jax.process_index(), jax.process_count())
    pipe = D.DiffusionPipeline.from_pretrained(args.path, mesh=mesh, dtype=dtype, config=config)
    return pipe, jax.process_index(), jax.process_count(), f"{mode} on {n} device(s)"


def defaults(pipe) -> tuple[dict, int]:
    """(default height / width / num_frames, the multiple sizes must have)."""
    from difflet_tpu.pipeline.video import VideoPipeline

    if isinstance(pipe, VideoPipeline):
        fs = pipe.vae_scale_factor_spatial
        patch = pipe.transformer_config.patch_size[1:]
        multiple = max(16, fs * max(patch))
        return {"height": 480, "width": 832, "num_frames": 81}, multiple
    side = pipe.default_sample_size * pipe.vae_scale_factor
    return {"height": side, "width": side}, pipe.vae_scale_factor * 2


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="[serve] %(asctime)s %(message)s", stream=sys.stderr)
    args = parser().parse_args(argv)
    try:
        sizes = parse_sizes(args.warmup)
        if args.max_batch < 1 or args.queue < 1:
            raise ValueError("--max-batch and --queue must be >= 1")
        from difflet_tpu.pipeline import diffusion as D

        D.read_model_index(Path(args.path))  # a wrong folder is refused before jax starts
        pipe, index, count, mode = load(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from difflet_tpu.serve import distributed as SD
    from difflet_tpu.serve.backend import PipelineBackend
    from difflet_tpu.serve.metrics import Metrics

    metrics = Metrics()
    publish = SD.Publisher() if count > 1 and index == 0 else None
    backend = PipelineBackend(pipe, max_batch=args.max_batch, metrics=metrics, publish=publish)
    if index != 0:
        # the warm-up calls, like every call, come from process 0
        calls = SD.follow(backend)
        logger.info("process %d: %d calls run; exiting", index, calls)
        return 0
    return serve(args, pipe, backend, metrics, sizes, mode, publish)


def serve(args, pipe, backend, metrics, sizes, mode, publish) -> int:
    import uvicorn

    from difflet_tpu.serve.app import create_app
    from difflet_tpu.serve.engine import Engine

    engine = Engine(backend, max_batch=args.max_batch, queue_size=args.queue, metrics=metrics)
    ready = threading.Event()
    model_id = args.model_name or Path(args.path).resolve().name
    dflt, multiple = defaults(pipe)

    def warm_then_serve():
        start = time.monotonic()
        try:
            backend.warmup(sizes, args.warmup_frames)
        except Exception as e:  # noqa: BLE001 - a warm-up that fails is reported; the server still serves
            logger.error("warm-up failed: %s: %s", type(e).__name__, e)
        metrics.set_ready()
        ready.set()
        logger.info("ready (%s; warm-up %.1f s, %d compiles so far)", mode, time.monotonic() - start,
                    metrics.compiles())
        engine.start()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.stop_accepting()  # SIGTERM: no new work; what was accepted is answered
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once shut down; after a full drain SIGTERM exits 0
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    def drain():
        ready.wait()  # the worker starts after the warm-up
        logger.info("shutting down: answering %d queued requests", engine.depth())
        engine.drain()
        if publish is not None:
            publish.stop()

    app = create_app(engine, model_id=model_id, defaults=dflt, size_multiple=multiple, fps=getattr(pipe, "fps", 16),
                     job_ttl=args.job_ttl, metrics=metrics, ready=ready, on_shutdown=drain)
    threading.Thread(target=warm_then_serve, name="difflet-serve-warmup", daemon=True).start()
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=None))
    server.run()
    logger.info("stopped after %d pipeline calls", engine.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
