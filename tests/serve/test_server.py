"""The resident server, live: `python -m difflet_tpu.serve` on 127.0.0.1 with the tiny pipelines
of tests/fixtures/pipelines, driven by the official `openai` client and by httpx.

Every server is a subprocess with a bounded start (conftest.START_TIMEOUT) and a bounded stop;
every client call has a timeout. The images are checked against the pipeline called directly
in this process (same seed, one device: equal; TP / SP: within 1 of 255 per pixel); batched
answers against the same requests run alone.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"

TIMEOUT = 120  # seconds for one client call
TINY = dict(size="32x32", num_inference_steps=2)


def png_pixels(b64: str) -> np.ndarray:
    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert img.format == "PNG" and img.mode == "RGB"
    return np.asarray(img)


@functools.lru_cache(maxsize=None)
def direct_pipeline(name):
    import jax.numpy as jnp

    from difflet_tpu.pipeline import diffusion as D

    return D.DiffusionPipeline.from_pretrained(FIXTURES / name, dtype=jnp.float32)


def direct_image(name, prompt, seed, **kw) -> np.ndarray:
    """The pipeline's own call (one device), as uint8 [H, W, 3]."""
    from difflet_tpu.serve.backend import _to_uint8

    out = direct_pipeline(name)(prompt=prompt, height=32, width=32, seed=seed, output_type="np", **kw).images
    return _to_uint8(out)[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("compile-cache"))


@pytest.fixture(scope="module")
def flux(tmp_path_factory, cache, live_server):
    """FLUX.1-schnell tiny, one device, batches of up to 4 requests, 32x32 warmed up."""
    live = live_server("flux_schnell", tmp_path_factory.mktemp("flux") / "stderr.txt", "--max-batch", "4", "--queue", "64",
                "--warmup", "32x32", "--compile-cache", cache, "--model-name", "flux-tiny")
    yield live
    assert live.stop() == 0, live.stderr()


def openai_client(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


# ---- the openai client gets a PNG ----------------------------------------------------------


def test_openai_client_png_equals_the_pipeline(flux):
    client = openai_client(flux)
    assert [m.id for m in client.models.list().data] == ["flux-tiny"]
    r = client.images.generate(model="flux-tiny", prompt="a cat holding a sign", size="32x32", n=2,
                               response_format="b64_json", extra_body={"num_inference_steps": 2, "seed": 7})
    assert len(r.data) == 2 and r.created > 0
    got = np.stack([png_pixels(d.b64_json) for d in r.data])
    assert got.shape == (2, 32, 32, 3)
    want = direct_pipeline("flux_schnell")(prompt="a cat holding a sign", height=32, width=32, seed=7,
                                           num_inference_steps=2, num_images_per_prompt=2, output_type="np").images
    from difflet_tpu.serve.backend import _to_uint8

    np.testing.assert_array_equal(got, _to_uint8(want))
    extra = r.model_extra
    assert extra["seed"] == 7 and len(extra["timings"]["denoise_steps_s"]) == 2


# ---- bad input, failures, the next request --------------------------------------------------


@pytest.mark.parametrize("body,param", [
    ({"size": "32x32"}, "prompt"),
    ({"prompt": "a", "size": "33x32"}, "size"),
    ({"prompt": "a", "size": "big"}, "size"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "response_format": "url"}, "response_format"),
    ({"prompt": "a", "num_inference_steps": "many"}, "num_inference_steps"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "guidance_scale": "nan"}, "guidance_scale"),
    ({"prompt": "a", "colour": "red"}, "colour"),
    ({"prompt": "a", "model": "dall-e-3"}, "model"),
])
def test_bad_fields_get_422_naming_the_field(flux, body, param):
    r = httpx.post(flux.url + "/v1/images/generations", json=body, timeout=TIMEOUT)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_bad_json_gets_422(flux):
    r = httpx.post(flux.url + "/v1/images/generations", content=b'{"prompt": "a",', timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_a_failing_request_answers_an_error_and_the_server_serves_the_next(flux):
    """true CFG at 1e38 overflows to a non-finite image: that request gets a 500 naming it, the
    one sent with it and the next are served (a failing batch re-run one by one:
    tests/serve/test_engine.py)."""
    async def both():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            bad = dict(prompt="a cat", negative_prompt="a dog", true_cfg_scale=1e38, seed=1, **TINY)
            good = dict(prompt="a cat", negative_prompt="a dog", true_cfg_scale=1.0 + 1e-3, seed=1, **TINY)
            return await asyncio.gather(c.post(flux.url + "/v1/images/generations", json=bad),
                                        c.post(flux.url + "/v1/images/generations", json=good))

    bad, good = asyncio.run(both())
    assert bad.status_code == 500 and "NonFiniteError" in bad.json()["error"]["message"], bad.text
    assert good.status_code == 200, good.text
    r = httpx.post(flux.url + "/v1/images/generations", json=dict(prompt="a cat", seed=2, **TINY), timeout=TIMEOUT)
    assert r.status_code == 200 and png_pixels(r.json()["data"][0]["b64_json"]).shape == (32, 32, 3)


def test_health_models_and_metrics(flux):
    assert httpx.get(flux.url + "/health", timeout=10).json()["status"] == "ready"
    assert flux.metric("difflet_ready") == 1
    assert flux.metric("difflet_compiles") > 0  # the warm-up compiled
    for name in ("difflet_queue_depth", "difflet_step_seconds_count", "difflet_compiles_after_ready"):
        flux.metric(name)  # present


def test_a_size_not_warmed_up_compiles_on_its_first_request(flux):
    before = flux.metric("difflet_compiles_after_ready")
    r = httpx.post(flux.url + "/v1/images/generations", json=dict(prompt="a", seed=1, size="48x32",
                                                                  num_inference_steps=2), timeout=TIMEOUT)
    assert r.status_code == 200 and png_pixels(r.json()["data"][0]["b64_json"]).shape == (32, 48, 3)
    assert flux.metric("difflet_compiles_after_ready") > before


# ---- load: nothing lost, fewer calls than requests, batched == alone ------------------------------


def test_load_every_request_answered_batched_and_equal_alone(flux):
    n, concurrency = 200, 16
    calls_before = flux.metric("difflet_pipeline_calls_total")
    compiles_before = flux.metric("difflet_compiles")
    bodies = [dict(prompt=f"prompt number {i % 7}", seed=1000 + i, **TINY) for i in range(n)]

    async def run():
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=concurrency)) as c:
            async def one(b):
                async with sem:
                    return await c.post(flux.url + "/v1/images/generations", json=b)
            return await asyncio.gather(*(one(b) for b in bodies))

    answers = asyncio.run(run())
    assert [r.status_code for r in answers] == [200] * n
    calls = flux.metric("difflet_pipeline_calls_total") - calls_before
    assert calls < n
    assert flux.metric("difflet_compiles") == compiles_before  # every batch size was warmed up
    shared = [i for i, r in enumerate(answers) if r.json()["batch"]["requests"] > 1]
    assert shared, "no request shared a call"
    # the same requests alone (one at a time, so each is a call of its own)
    for i in shared[:3]:
        alone = httpx.post(flux.url + "/v1/images/generations", json=bodies[i], timeout=TIMEOUT).json()
        assert alone["batch"]["requests"] == 1
        np.testing.assert_array_equal(png_pixels(alone["data"][0]["b64_json"]),
                                      png_pixels(answers[i].json()["data"][0]["b64_json"]))


def test_a_client_that_went_away_is_dropped_before_it_runs(flux):
    slow = dict(prompt="slow", seed=3, size="32x32", num_inference_steps=800)
    calls_before = flux.metric("difflet_pipeline_calls_total")
    dropped_before = flux.metric("difflet_requests_total", outcome="dropped")

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            first = asyncio.create_task(c.post(flux.url + "/v1/images/generations", json=slow))
            deadline = time.monotonic() + 60
            while flux.metric("difflet_pipeline_calls_total") == calls_before and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # until the first runs (800 steps: seconds)
            with pytest.raises(httpx.TimeoutException):
                await c.post(flux.url + "/v1/images/generations", timeout=0.5,
                             json=dict(slow, num_inference_steps=801))  # another key: never batched with it
            return await first

    assert asyncio.run(run()).status_code == 200
    deadline = time.monotonic() + 30
    while flux.metric("difflet_requests_total", outcome="dropped") == dropped_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert flux.metric("difflet_requests_total", outcome="dropped") == dropped_before + 1
    assert flux.metric("difflet_pipeline_calls_total") == calls_before + 1


# ---- a bounded queue, SIGTERM ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def narrow(tmp_path_factory, cache, live_server):
    """One request per call, one waiting at most."""
    live = live_server("flux_schnell", tmp_path_factory.mktemp("narrow") / "stderr.txt", "--max-batch", "1", "--queue", "1",
                "--warmup", "32x32", "--compile-cache", cache)
    yield live
    live.kill()


def slow_posts(live, k, steps=40, seed=0):
    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            return await asyncio.gather(*(c.post(live.url + "/v1/images/generations", json=dict(
                prompt="a", seed=seed + i, size="32x32", num_inference_steps=steps)) for i in range(k)),
                return_exceptions=True)
    return asyncio.run(run())


def test_queue_full_gets_429_with_retry_after(narrow):
    answers = slow_posts(narrow, 6)
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 1, codes
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"


def test_sigterm_answers_what_was_accepted_then_exits(narrow):
    import threading

    results = {}
    calls = narrow.metric("difflet_pipeline_calls_total")

    def wait_for(what, value):
        deadline = time.monotonic() + 60
        while narrow.metric(what) < value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert narrow.metric(what) == value, what

    threads = [threading.Thread(target=lambda i=i: results.update({i: slow_posts(narrow, 1, steps=400, seed=i)[0]}))
               for i in range(2)]
    threads[0].start()
    wait_for("difflet_pipeline_calls_total", calls + 1)  # the first runs
    threads[1].start()
    wait_for("difflet_queue_depth", 1)  # the second waits
    narrow.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert [results[i].status_code for i in range(2)] == [200, 200], results
    assert narrow.proc.wait(timeout=60) == 0, narrow.stderr()
    with pytest.raises(httpx.ConnectError):
        httpx.post(narrow.url + "/v1/images/generations", json=dict(prompt="a", **TINY), timeout=5)


# ---- every pipeline under one device, TP and SP ------------------------------------------------------


IMAGE_MODES = [("flux_schnell", "tp"), ("flux_schnell", "sp"), ("qwen_image", "one"), ("qwen_image", "tp"),
               ("qwen_image", "sp")]


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", IMAGE_MODES)
def test_openai_client_png_every_pipeline_and_mode(tmp_path, cache, live_server, name, mode):
    live = live_server(name, tmp_path / "stderr.txt", "--mesh", mode, "--cpu-devices", "1" if mode == "one" else "4",
                "--compile-cache", cache)
    try:
        r = openai_client(live).images.generate(prompt="a red circle", size="32x32", response_format="b64_json",
                                                extra_body={"num_inference_steps": 2, "seed": 5})
        got = png_pixels(r.data[0].b64_json)
    finally:
        assert live.stop() == 0, live.stderr()
    want = direct_image(name, "a red circle", 5, num_inference_steps=2)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= (0 if mode == "one" else 1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one", "tp", "sp"])
def test_openai_client_mp4_wan(tmp_path, cache, live_server, mode):
    from difflet_tpu.pipeline import mp4

    live = live_server("wan_t2v", tmp_path / "stderr.txt", "--mesh", mode, "--cpu-devices", "1" if mode == "one" else "4",
                "--compile-cache", cache)
    try:
        client = openai_client(live)
        video = client.videos.create(prompt="a cat walking", size="32x32",
                                     extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 3})
        assert video.status in ("queued", "in_progress")
        deadline = time.monotonic() + 300
        while video.status in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.5)
            video = client.videos.retrieve(video.id)
        assert video.status == "completed", video
        assert video.progress == 100 and video.completed_at >= video.created_at and video.size == "32x32"
        content = client.videos.download_content(video.id).read()
        (tmp_path / "v.mp4").write_bytes(content)
        frames, fps = mp4.read_mp4(tmp_path / "v.mp4")
        assert frames.shape == (5, 32, 32, 3) and fps == 16
        r = httpx.get(live.url + f"/v1/videos/{video.id}", timeout=10)
        assert r.status_code == 404  # fetched: forgotten
        bad = httpx.post(live.url + "/v1/videos", json={"prompt": "a", "size": "30x32"}, timeout=10)
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "size"
    finally:
        assert live.stop() == 0, live.stderr()


# ---- two processes (jax.distributed on localhost): process 0 serves, both run every call ---------------


def test_two_process_server(tmp_path, cache, live_server):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    common = ["--cpu-devices", "2", "--mesh", "tp:4", "--coordinator", coordinator, "--num-processes", "2",
              "--max-batch", "2", "--compile-cache", cache]
    live = live_server("flux_schnell", tmp_path / "stderr.txt", *common, "--process-id", "0",
                       extra=[[*common, "--process-id", "1"]])
    try:
        r = openai_client(live).images.generate(prompt="a red circle", size="32x32", response_format="b64_json",
                                                extra_body={"num_inference_steps": 2, "seed": 5})
        got = png_pixels(r.data[0].b64_json)
        bad = httpx.post(live.url + "/v1/images/generations", timeout=TIMEOUT,
                         json=dict(prompt="a", negative_prompt="b", true_cfg_scale=1e38, **TINY))
        assert bad.status_code == 500 and "NonFiniteError" in bad.json()["error"]["message"]
        again = httpx.post(live.url + "/v1/images/generations", json=dict(prompt="a red circle", seed=5, **TINY),
                           timeout=TIMEOUT)
        assert again.status_code == 200
        np.testing.assert_array_equal(png_pixels(again.json()["data"][0]["b64_json"]), got)
    finally:
        rc = live.stop()
        follower = live.extra[0].wait(timeout=60)
    assert rc == 0 and follower == 0, live.stderr() + "\n--- process 1:\n" + (tmp_path / "stderr.txt.1").read_text()[-3000:]
    want = direct_image("flux_schnell", "a red circle", 5, num_inference_steps=2)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert "call 1 failed here too" in (tmp_path / "stderr.txt.1").read_text()
