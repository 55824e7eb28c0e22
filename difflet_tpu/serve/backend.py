"""One pipeline folder, loaded once, run for batches of requests.

`PipelineBackend(pipe)` turns a batch of checked requests into ONE pipeline call along the
batch axis and splits the result back per request:

- each request's rows get their own initial latents, drawn from its own seed exactly as the
  pipeline draws them alone (`initial_latents` / `initial_video_latents` with its `n`), and are
  passed as `latents=`; prompts and negative prompts go one per row;
- only requests with the same `key` share a call: size, frames, steps and the guidance scales
  (the pipelines take one guidance per call), and whether a negative prompt is given;
- the rows are padded to the next batch size in `buckets` by repeating the last row (the padded
  outputs are dropped), so a server compiles a few batch sizes, not every one up to --max-batch.

A request's output in a batch equals its output alone up to the float reordering of a different
batch size (tests/serve measure it). `execute(kind, params)` is a plain function of JSON-able
arguments, so every process of a multi-host slice can run the same call
(difflet_tpu.serve.distributed).
"""

from __future__ import annotations

import inspect
import logging

import numpy as np

from difflet_tpu.pipeline import diffusion as D

logger = logging.getLogger(__name__)

IMAGE_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale")
VIDEO_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a server compiles: powers of two below `max_batch`, and `max_batch`."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class PipelineBackend:
    def __init__(self, pipe, *, max_batch: int = 1, metrics=None, publish=None):
        from difflet_tpu.pipeline.video import VideoPipeline

        self.pipe = pipe
        self.kind = "video" if isinstance(pipe, VideoPipeline) else "image"
        if self.kind == "video" and "image" in inspect.signature(pipe.__call__).parameters:
            raise ValueError(f"{type(pipe).__name__}: the server runs text-to-video pipelines only (WanPipeline)")
        self.buckets = buckets(max_batch)
        self.metrics = metrics
        self.publish = publish  # multi-host: hands each call to the other processes first

    # ---- what can share a call -------------------------------------------------------

    def key(self, work) -> tuple:
        p = work.params
        names = IMAGE_KEYS if work.kind == "image" else VIDEO_KEYS
        return (work.kind, p.get("negative_prompt") is None) + tuple(p.get(k) for k in names)

    def run(self, batch) -> list:
        payload = {"kind": batch[0].kind, "params": [w.params for w in batch]}

        def on_stage(stage, info):
            if stage == "step":
                for w in batch:
                    if getattr(w, "on_progress", None) is not None:
                        w.on_progress((info["index"] + 1) / info["total"])

        self.pipe.on_stage = on_stage
        if self.publish is not None:
            self.publish(payload)
        return self.execute(**payload)

    # ---- the call --------------------------------------------------------------------

    def execute(self, kind: str, params: list) -> list:
        """The outputs of one pipeline call for the requests `params` (same key):
        image: {"images": uint8 [n, H, W, 3]}, video: {"frames": uint8 [F, H, W, 3], "fps"};
        each with the call's stage timings and how many requests shared it."""
        if kind != self.kind:
            raise D.PipelineError(f"this server runs a {type(self.pipe).__name__}: {kind} requests are not served")
        rows = [p.get("n", 1) for p in params]
        total = sum(rows)
        size = next(b for b in self.buckets + [total] if b >= total)
        out = self._images(params, size) if kind == "image" else self._videos(params, size)
        timings = self.pipe.timings.as_dict()
        self._observe(timings)
        results, start = [], 0
        for n in rows:
            shared = {"timings": timings, "batch_requests": len(params), "batch_rows": total}
            if kind == "image":
                results.append({"images": _to_uint8(out[start:start + n]), **shared})
            else:
                results.append({"frames": _to_uint8(out[start]), "fps": self.pipe.fps, **shared})
            start += n
        return results

    def _images(self, params: list, size: int):
        pipe = self.pipe
        p0 = params[0]
        vsf = pipe.vae_scale_factor
        h, w = 2 * (p0["height"] // (vsf * 2)), 2 * (p0["width"] // (vsf * 2))
        channels = pipe.transformer_config.in_channels // 4
        prompts, negatives, latents = [], [], []
        for p in params:
            n = p.get("n", 1)
            prompts += [p["prompt"]] * n
            negatives += [p.get("negative_prompt")] * n
            latents.append(np.asarray(D.DiffusionPipeline.initial_latents(None, p["seed"], n, channels, h, w,
                                                                          pipe.dtype)))
        latents = _pad(np.concatenate(latents), size)
        prompts, negatives = _pad_list(prompts, size), _pad_list(negatives, size)
        kw = dict(prompt=prompts, height=p0["height"], width=p0["width"], latents=latents, output_type="np")
        kw.update({k: p0[k] for k in ("num_inference_steps", "guidance_scale", "true_cfg_scale")
                   if p0.get(k) is not None})
        if negatives[0] is not None:
            kw["negative_prompt"] = negatives
        return pipe(**kw).images

    def _videos(self, params: list, size: int):
        pipe = self.pipe
        p0 = params[0]
        z = D.vae_latent_channels(pipe.vae)
        num_frames = pipe.check_frames(p0["num_frames"])
        latents = [np.asarray(pipe.initial_video_latents(None, p["seed"], pipe.latent_shape(
            1, z, num_frames, p0["height"], p0["width"]))) for p in params]
        negatives = [p.get("negative_prompt") for p in params]
        kw = dict(prompt=_pad_list([p["prompt"] for p in params], size), height=p0["height"], width=p0["width"],
                  num_frames=num_frames, latents=_pad(np.concatenate(latents), size), output_type="np")
        kw.update({k: p0[k] for k in ("num_inference_steps", "guidance_scale") if p0.get(k) is not None})
        if negatives[0] is not None:
            kw["negative_prompt"] = _pad_list(negatives, size)
        return pipe(**kw).frames

    def _observe(self, timings: dict) -> None:
        if self.metrics is None:
            return
        for stage in ("tokenize", "encode", "denoise", "decode"):
            self.metrics.stage_seconds.labels(stage).observe(timings[f"{stage}_s"])
        for s in timings["denoise_steps_s"]:
            self.metrics.step_seconds.observe(s)

    # ---- warm-up ---------------------------------------------------------------------

    def warmup(self, sizes: list[tuple[int, int]], num_frames: int | None = None) -> None:
        """One call per (size, batch bucket), so those programs are compiled (or loaded from the
        persistent cache) before the server says it is ready. Two steps: the programs do not
        depend on the step count (one step is refused by Qwen-Image's terminal shift)."""
        for height, width in sizes:
            for b in self.buckets:
                params = {"prompt": "warm-up", "seed": 0, "height": height, "width": width,
                          "num_inference_steps": 2}
                if self.kind == "video":
                    params["num_frames"] = num_frames or 5
                logger.info("warm-up: %dx%d, batch %d", width, height, b)
                self.run([_Warm(self.kind, dict(params, n=1)) for _ in range(b)])


class _Warm:
    def __init__(self, kind, params):
        self.kind, self.params = kind, params


def _pad(x: np.ndarray, size: int) -> np.ndarray:
    return x if len(x) >= size else np.concatenate([x, np.repeat(x[-1:], size - len(x), axis=0)])


def _pad_list(xs: list, size: int) -> list:
    return xs + [xs[-1]] * (size - len(xs))


def _to_uint8(x) -> np.ndarray:
    """[0, 1] floats -> uint8 (`round(255 x)`, as diffusers' numpy_to_pil); non-finite is an error."""
    x = np.asarray(x, np.float32)
    if not np.isfinite(x).all():
        raise FloatingPointError(f"the output has {int((~np.isfinite(x)).sum())} non-finite values")
    return np.round(np.clip(x, 0, 1) * 255).astype(np.uint8)
