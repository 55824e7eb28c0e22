"""Latency and throughput of `python -m difflet_tpu.serve` against client concurrency, with
and without batching (the figures of docs/benchmarks.md, "Serving").

    python benchmark/serve_load.py [--pipeline tests/fixtures/pipelines/flux_schnell]
        [--max-batch 1,4] [--concurrency 1,4,16] [--requests 96] [--steps 2] [--size 32x32]
        [--json benchmark/results/serve_load.json]

For each --max-batch a server is started on 127.0.0.1 (one device, float32, the size warmed up,
a compile cache in a temporary folder), then for each concurrency `--requests` requests (distinct
prompts and seeds, one image each) are posted by that many concurrent httpx clients. Latency is
per request, from the client's send to its answer; throughput is requests over the wall time of
the whole run. Measured where it runs (this repository's figures: CPU, see the doc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(pipeline: str, max_batch: int, size: str, cache: str, log: Path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFLET_TPU_", "XLA_FLAGS"))}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.Popen([sys.executable, "-m", "difflet_tpu.serve", pipeline, "--port", str(port),
                             "--dtype", "float32", "--max-batch", str(max_batch), "--queue", "256",
                             "--warmup", size, "--compile-cache", cache], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not get ready")


def calls(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^difflet_pipeline_calls_total\{[^}]*\} (\S+)$", text, re.M))


def load(url: str, concurrency: int, n: int, steps: int, size: str, offset: int) -> dict:
    async def run():
        sem = asyncio.Semaphore(concurrency)
        lat = []
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as c:
            async def one(i):
                async with sem:
                    t0 = time.perf_counter()
                    r = await c.post(url + "/v1/images/generations", json=dict(
                        prompt=f"prompt {i % 13}", seed=offset + i, size=size, num_inference_steps=steps))
                    lat.append(time.perf_counter() - t0)
                    return r.status_code
            t0 = time.perf_counter()
            codes = await asyncio.gather(*(one(i) for i in range(n)))
            return codes, lat, time.perf_counter() - t0

    before = calls(url)
    codes, lat, wall = asyncio.run(run())
    if any(c != 200 for c in codes):
        raise RuntimeError(f"answers other than 200: {sorted(set(codes))}")
    return {"concurrency": concurrency, "requests": n, "p50_s": float(np.percentile(lat, 50)),
            "p99_s": float(np.percentile(lat, 99)), "throughput_rps": n / wall, "wall_s": wall,
            "pipeline_calls": int(calls(url) - before)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipeline", default=str(ROOT / "tests/fixtures/pipelines/flux_schnell"))
    ap.add_argument("--max-batch", default="1,4")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--size", default="32x32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        for mb in [int(x) for x in args.max_batch.split(",")]:
            proc, url = start(args.pipeline, mb, args.size, tmp + "/cache", Path(tmp) / f"server-{mb}.txt")
            try:
                load(url, 4, 16, args.steps, args.size, 10**6)  # first-request effects out of the figures
                for c in [int(x) for x in args.concurrency.split(",")]:
                    row = {"max_batch": mb, **load(url, c, args.requests, args.steps, args.size, 1000 * c)}
                    rows.append(row)
                    print(f"max_batch {mb:2d}  concurrency {c:3d}: p50 {row['p50_s'] * 1e3:7.1f} ms  "
                          f"p99 {row['p99_s'] * 1e3:7.1f} ms  {row['throughput_rps']:6.1f} req/s  "
                          f"{row['pipeline_calls']} calls for {row['requests']} requests", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    if args.json:
        shown = os.path.relpath(args.pipeline, ROOT) if Path(args.pipeline).resolve().is_relative_to(ROOT) \
            else args.pipeline
        Path(args.json).write_text(json.dumps({"pipeline": shown, "steps": args.steps, "size": args.size,
                                               "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
