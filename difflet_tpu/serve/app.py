"""The HTTP side: FastAPI routes in OpenAI's shapes, over the engine's queue.

- POST /v1/images/generations: OpenAI's image request (model, prompt, n, size "WxH",
  response_format "b64_json") plus diffusers' names (negative_prompt, num_inference_steps,
  guidance_scale, true_cfg_scale, seed); answers {created, data: [{b64_json}]} (PNG), with the
  call's stage `timings`, the `seed` used and the `batch` it ran in.
- POST /v1/videos (JSON or the openai client's multipart form: model, prompt, seconds, size,
  plus num_frames, negative_prompt, num_inference_steps, guidance_scale, seed); GET
  /v1/videos/{id} (OpenAI's video object); GET /v1/videos/{id}/content (the MP4; the job is
  forgotten once fetched, or `job_ttl` seconds after it finished); DELETE /v1/videos/{id}.
- GET /v1/models, GET /health (503 until the warm-up is done), GET /metrics (Prometheus).

Errors are OpenAI's {"error": {message, type, param, code}}: 422 for bad JSON or a bad field
(`param` names it), 429 with Retry-After when the queue is full, 503 while shutting down, 400
when the pipeline refuses the call, 500 when it fails (a non-finite image, say).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import secrets
import threading
import time
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from difflet_tpu.arguments import LIMITS  # the bounds every entry point shares (difflet_tpu.arguments)
from difflet_tpu.pipeline.diffusion import PipelineError
from difflet_tpu.serve.engine import Dropped, NotAccepting, QueueFull, Work

MAX_N = 16  # images per request (a server's policy: one request cannot take the slice's whole batch)
STEPS, SEED, FRAMES = LIMITS["steps"], LIMITS["seed"], LIMITS["frames"]
POLL_S = 0.2  # how often a waiting handler checks that its client is still there


class ImageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    size: str | None = Field(None, pattern=r"^\d+x\d+$")
    response_format: Literal["b64_json"] = "b64_json"
    output_format: Literal["png"] = "png"
    user: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=STEPS[0], le=STEPS[1])
    guidance_scale: float | None = Field(None, allow_inf_nan=False)
    true_cfg_scale: float | None = Field(None, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED[0], le=SEED[1])


class VideoRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = None
    seconds: float | None = Field(None, gt=0, le=600)
    size: str | None = Field(None, pattern=r"^\d+x\d+$")
    num_frames: int | None = Field(None, ge=FRAMES[0], le=FRAMES[1])
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=STEPS[0], le=STEPS[1])
    guidance_scale: float | None = Field(None, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED[0], le=SEED[1])


def error(status: int, message: str, *, type: str, param: str | None = None, code: str | None = None,
          headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status, headers=headers)


def invalid(message: str, param: str) -> JSONResponse:
    return error(422, message, type="invalid_request_error", param=param, code="invalid_value")


def create_app(engine, *, model_id: str, defaults: dict, size_multiple: int, fps: int = 16,
               job_ttl: float = 3600.0, metrics=None, ready: threading.Event | None = None,
               on_shutdown=None) -> FastAPI:
    """`defaults`: height, width (and num_frames for video) when a request gives none;
    `size_multiple`: what height and width must divide by; `on_shutdown`: run (in a thread) when
    uvicorn shuts down, after the in-flight requests are answered."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="difflet-tpu", docs_url=None, redoc_url=None, lifespan=lifespan)
    kind = engine.backend.kind
    ready = ready or threading.Event()
    jobs: dict[str, dict] = {}
    jobs_lock = threading.Lock()

    def count(outcome: str, k: str = kind) -> None:
        if metrics is not None:
            metrics.requests.labels(k, outcome).inc()

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc.errors(), count)

    def check_common(body, wanted: str):
        """(height, width) or a 422 response naming the field."""
        if kind != wanted:
            return invalid(f"this server runs {model_id}, a {kind} pipeline: use the {kind} endpoint", "model")
        if body.model is not None and body.model != model_id:
            return invalid(f"model {body.model!r} is not served here; this server runs {model_id!r}", "model")
        if body.size is None:
            return defaults["height"], defaults["width"]
        width, height = (int(v) for v in body.size.split("x"))
        top_h, top_w = LIMITS["height"][1], LIMITS["width"][1]
        if not (0 < width <= top_w and 0 < height <= top_h) or width % size_multiple or height % size_multiple:
            return invalid(f"size {body.size!r}: width and height must be positive multiples of {size_multiple} "
                           f"(at most {top_w}x{top_h})", "size")
        return height, width

    def submit(work: Work):
        try:
            engine.submit(work)
        except QueueFull as e:
            count("rejected", work.kind)
            return error(429, str(e), type="rate_limit_error", code="queue_full",
                         headers={"Retry-After": str(e.retry_after)})
        except NotAccepting as e:
            count("unavailable", work.kind)
            return error(503, str(e), type="server_error", code="shutting_down")
        return None

    # ---- images ----------------------------------------------------------------------

    @app.post("/v1/images/generations")
    async def generate_images(body: ImageRequest, request: Request):
        size = check_common(body, "image")
        if isinstance(size, JSONResponse):
            count("invalid")
            return size
        params = body.model_dump(include={"prompt", "n", "negative_prompt", "num_inference_steps", "guidance_scale",
                                          "true_cfg_scale", "seed"})
        params.update(height=size[0], width=size[1])
        if params["seed"] is None:
            params["seed"] = secrets.randbelow(2**32)
        work = Work("image", params)
        refused = submit(work)
        if refused is not None:
            return refused
        fut = asyncio.wrap_future(work.future)
        while not fut.done():
            await asyncio.wait([fut], timeout=POLL_S)
            if not fut.done() and not work.cancelled and await request.is_disconnected():
                work.cancelled = True  # dropped by the worker if it has not started
        try:
            result = fut.result()
        except Exception as e:  # noqa: BLE001
            return failure(e)
        data = [{"b64_json": base64.b64encode(_png(x)).decode("ascii"), "revised_prompt": None}
                for x in result["images"]]
        return {"created": int(time.time()), "data": data, "seed": params["seed"], "timings": result["timings"],
                "batch": {"requests": result["batch_requests"], "rows": result["batch_rows"]}}

    def failure(e: Exception) -> JSONResponse:
        if isinstance(e, Dropped):
            return error(499, str(e), type="server_error", code="client_closed")
        if isinstance(e, (PipelineError, TypeError)):
            return error(400, str(e), type="invalid_request_error", code="pipeline_refused")
        return error(500, f"{type(e).__name__}: {e}", type="server_error", code="pipeline_failed")

    # ---- videos ------------------------------------------------------------------------

    @app.post("/v1/videos")
    async def create_video(request: Request):
        body = await _video_body(request)
        if isinstance(body, JSONResponse):
            count("invalid")
            return body
        size = check_common(body, "video")
        if isinstance(size, JSONResponse):
            count("invalid")
            return size
        if body.num_frames is not None:
            frames = body.num_frames
        elif body.seconds is not None:
            frames = 4 * max(1, round(body.seconds * fps / 4)) + 1
        else:
            frames = defaults["num_frames"]
        params = body.model_dump(include={"prompt", "negative_prompt", "num_inference_steps", "guidance_scale",
                                          "seed"})
        params.update(height=size[0], width=size[1], num_frames=frames)
        if params["seed"] is None:
            params["seed"] = secrets.randbelow(2**32)
        now = int(time.time())
        job = {"id": "video_" + secrets.token_hex(12), "object": "video", "model": model_id, "status": "queued",
               "progress": 0, "created_at": now, "completed_at": None, "expires_at": None,
               "size": f"{size[1]}x{size[0]}", "seconds": str(round((frames - 1) / fps, 3)), "quality": "standard",
               "remixed_from_video_id": None, "error": None, "num_frames": frames, "seed": params["seed"]}
        work = Work("video", params)
        work.on_start = lambda: job.update(status="in_progress")
        work.on_progress = lambda p: job.update(progress=int(p * 100))
        refused = submit(work)
        if refused is not None:
            return refused
        with jobs_lock:
            purge()
            jobs[job["id"]] = {"job": job, "mp4": None}
        work.future.add_done_callback(lambda f: finish_video(job["id"], f))
        return public(job)

    def finish_video(job_id: str, fut) -> None:
        with jobs_lock:
            entry = jobs.get(job_id)
        if entry is None:
            return
        job = entry["job"]
        now = int(time.time())
        try:
            result = fut.result()
            from difflet_tpu.pipeline import mp4

            entry["mp4"] = _mp4_bytes(result["frames"], result["fps"], mp4)
            job.update(status="completed", progress=100, timings=result["timings"])
        except Exception as e:  # noqa: BLE001 - the job's answer
            job.update(status="failed", error={"code": "pipeline_failed", "message": f"{type(e).__name__}: {e}"})
        job.update(completed_at=now, expires_at=now + int(job_ttl))

    def purge() -> None:
        now = time.time()
        for k in [k for k, v in jobs.items() if v["job"]["expires_at"] is not None and v["job"]["expires_at"] < now]:
            del jobs[k]

    def public(job: dict) -> dict:
        return {k: v for k, v in job.items() if k != "num_frames"}

    def find(video_id: str):
        with jobs_lock:
            purge()
            entry = jobs.get(video_id)
        if entry is None:
            return error(404, f"no video {video_id!r} (unknown, expired, or its content was already fetched)",
                         type="invalid_request_error", param="video_id", code="not_found")
        return entry

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str):
        entry = find(video_id)
        return entry if isinstance(entry, JSONResponse) else public(entry["job"])

    @app.get("/v1/videos/{video_id}/content")
    async def get_video_content(video_id: str, variant: str = "video"):
        entry = find(video_id)
        if isinstance(entry, JSONResponse):
            return entry
        if variant != "video":
            return invalid(f"variant {variant!r}: only 'video' (the MP4) is served", "variant")
        if entry["job"]["status"] != "completed":
            return error(409, f"video {video_id} is {entry['job']['status']}", type="invalid_request_error",
                         param="video_id", code="not_ready")
        with jobs_lock:
            jobs.pop(video_id, None)  # fetched: forgotten
        return Response(entry["mp4"], media_type="video/mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        entry = find(video_id)
        if isinstance(entry, JSONResponse):
            return entry
        with jobs_lock:
            jobs.pop(video_id, None)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    # ---- the rest ----------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "difflet-tpu"}]}

    @app.get("/health")
    async def health():
        if not ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ready", "queue_depth": engine.depth(), "model": model_id}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _video_body(request: Request):
    """The video request from JSON or a form (the openai client posts multipart/form-data)."""
    ctype = request.headers.get("content-type", "")
    try:
        if ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
            form = await request.form()
            if "input_reference" in form:
                return invalid("input_reference (image to video) is not served: this server runs text to video",
                               "input_reference")
            raw = {k: v for k, v in form.items()}
        else:
            import json

            try:
                raw = json.loads(await request.body())
            except ValueError as e:
                return invalid(f"the body is not valid JSON ({e})", "body")
        return VideoRequest.model_validate(raw)
    except ValidationError as e:
        return _validation_error(e.errors(), None)


def _validation_error(errors: list, count) -> JSONResponse:
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or "body"
    if count is not None:
        count("invalid")
    message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors)
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": "invalid_value"},
                         "detail": [{k: e.get(k) for k in ("loc", "msg", "type")} for e in errors]},
                        status_code=422)


def _png(x: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(x).save(buf, format="PNG")
    return buf.getvalue()


def _mp4_bytes(frames: np.ndarray, fps, mp4) -> bytes:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="difflet-serve-") as d:
        path = mp4.write_mp4(frames, Path(d) / "video.mp4", fps)
        return path.read_bytes()
