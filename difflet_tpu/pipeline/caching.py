"""The pipelines' denoise loop with step caching, and the quality gate (`DiffusionPipeline`'s mixin).

Every pipeline call takes two arguments beyond diffusers' (added to each pipeline's
`__call__` by `CachedLoop.__init_subclass__`, so no port repeats them):

- `cache`: None (the `Config.step_cache` default, itself off by default), "off", or
  "first-block:threshold=0.08,warmup=2,max_skips=3" (`difflet_tpu.config.parse_step_cache`,
  checked before any work): the loop's transformer calls go through a
  `difflet_tpu.step_cache.StepCache`.
- `quality_gate`: a PSNR floor in dB: the call also runs the uncached trajectory from the same
  latents (a drawn `seed` when neither `seed` nor `latents` is given) and reports PSNR and SSIM
  of the final pixels (difflet_tpu.pipeline.quality) and the transformer calls saved, in
  `out.stats["quality_gate"]` (`passed` false below the floor; `difflet_tpu.generate` then exits
  nonzero). It returns the cached run's output.

- `attention`: block-sparse video self-attention ("dense" by default; "sta:...", "radial:...":
  `difflet_tpu.layers.sparse_masks`, docs/sparse-attention.md) for the pipelines whose
  transformer takes it (Wan, HunyuanVideo, LTX-2); its first `full_steps` steps run dense. A sparse step's cache
  slot is its own (the tokens' order differs), so the cache starts over where the mask begins.
  With `quality_gate`, the reference run is dense and uncached.

`out.stats` (and `pipeline.stats`, also with `return_dict=False`): `transformer_calls` (full
transformer passes; a cached call, which ran only its first and last blocks, is not one),
`cached_calls`, `steps`, and per call the decision (`decisions`: step, slot, why, the relative L1
change, skipped). A port's loop calls the transformer through `run_transformer(runner, slot,
**kwargs)`; `slot` names a call of its own per step (FLUX's true CFG: "cond" and "uncond").
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from typing import Callable

import jax
import numpy as np

from difflet_tpu.arguments import ArgumentError
from difflet_tpu.config import ConfigError, parse_step_cache

logger = logging.getLogger(__name__)

_UNSET = object()


def check_cache(cache):
    """The call's `cache=` parsed (None: off); a bad option is an ArgumentError before any work."""
    try:
        return parse_step_cache(cache, "cache")
    except ConfigError as e:
        raise ArgumentError(str(e)) from None


def check_attention(pipe, attention):
    """The call's `attention=` parsed (`sparse_masks.SparseAttention`); a bad option, or a sparse
    one for a transformer that does not take it, is an ArgumentError before any work."""
    from difflet_tpu.layers import sparse_masks

    try:
        option = sparse_masks.parse(attention)
    except sparse_masks.SparsityError as e:
        raise ArgumentError(str(e)) from None
    spec = getattr(getattr(pipe, "transformer", None), "spec", None)
    if not option.dense and (spec is None or "attention" not in spec.extra_kwargs):
        raise ArgumentError(f"attention={attention!r}: block-sparse attention is not available for "
                            f"{type(pipe).__name__}'s transformer yet (Wan's, HunyuanVideo's and LTX-2's have it); "
                            f"use attention='dense'")
    return option


def check_gate(quality_gate, options, output_type, attention=None) -> float | None:
    if quality_gate is None:
        return None
    if isinstance(quality_gate, bool) or not isinstance(quality_gate, (int, float)) or not np.isfinite(quality_gate):
        raise ArgumentError(f"`quality_gate` must be a PSNR floor in dB (a finite number), got {quality_gate!r}")
    if options is None and (attention is None or attention.dense):
        raise ArgumentError("`quality_gate` compares a cached (or sparse-attention) run with the plain one: give "
                            "`cache=` (e.g. cache='first-block:threshold=0.08') or `attention=` too")
    if output_type == "latent":
        raise ArgumentError("`quality_gate` measures the final pixels: output_type='latent' has none")
    return float(quality_gate)


def with_cache(call: Callable) -> Callable:
    """A pipeline's `__call__` with `cache=` and `quality_gate=` (module docstring)."""
    output_default = inspect.signature(call).parameters.get("output_type")
    output_default = None if output_default is None else output_default.default

    @functools.wraps(call)
    def wrapped(self, *args, cache=_UNSET, quality_gate=None, attention=None, **kwargs):
        if getattr(self, "_calling", False):  # a subclass's __call__ calling its parent's: set up already
            if cache is not _UNSET or quality_gate is not None or attention is not None:
                raise TypeError("cache= / quality_gate= / attention= go to the outermost pipeline call")
            return call(self, *args, **kwargs)
        options = check_cache(getattr(self, "default_cache", None) if cache is _UNSET else cache)
        sparse = check_attention(self, attention)
        floor = check_gate(quality_gate, options, kwargs.get("output_type", output_default), sparse)
        if floor is None:
            return self.run_call(call, args, kwargs, options, sparse)
        return quality_gate_call(self, call, args, kwargs, options, floor, sparse)

    wrapped.cached_loop = True
    return wrapped


def images_of(out):
    return out.images if hasattr(out, "images") else out.frames


def quality_gate_call(pipe, call, args, kwargs, options, floor: float, sparse=None):
    """The uncached (and dense) run, then the cached (and sparse) one from the same latents; PSNR /
    SSIM of their pixels."""
    from difflet_tpu.pipeline import quality

    kwargs = dict(kwargs)
    return_dict = kwargs.pop("return_dict", True)
    if kwargs.get("latents") is None and kwargs.get("seed") is None:  # both runs from the same noise
        kwargs["seed"] = int(np.random.SeedSequence().generate_state(1)[0])
    reference = pipe.run_call(call, args, kwargs, None)
    uncached_calls = pipe.stats["transformer_calls"]
    out = pipe.run_call(call, args, kwargs, options, sparse)
    want, got = quality.as_pixels(images_of(reference)), quality.as_pixels(images_of(out))
    p = quality.psnr(got, want)
    report = {"psnr_db": None if p == float("inf") else p, "identical": p == float("inf"),
              "ssim": quality.ssim(got, want), "floor_db": floor, "passed": p >= floor,
              "transformer_calls": out.stats["transformer_calls"], "uncached_transformer_calls": uncached_calls,
              "calls_saved": uncached_calls - out.stats["transformer_calls"]}
    out.stats["quality_gate"] = report
    pipe.stats = out.stats
    if not report["passed"]:
        logger.warning("quality gate: PSNR %.2f dB of the cached run against the uncached one is below the floor "
                       "%.2f dB (SSIM %.4f)", p, floor, report["ssim"])
    return out if return_dict else (images_of(out),)


class CachedLoop:
    """The shared denoise loop (`denoise`), the transformer calls through the step cache
    (`run_transformer`) and the `cache=` / `quality_gate=` / `attention=` arguments of every
    pipeline call."""

    default_cache = None  # Config.step_cache, set at load
    step_cache = None     # the call's difflet_tpu.step_cache.StepCache while its loop runs
    cache_options = None
    attention = None      # the call's sparse_masks.SparseAttention (None: dense)
    sparse_calls = 0
    step_index = 0
    transformer_calls = 0
    stats: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        call = cls.__dict__.get("__call__")
        if call is not None and not getattr(call, "cached_loop", False):
            cls.__call__ = with_cache(call)

    def run_call(self, call, args, kwargs, options, attention=None):
        """`call` with the cache `options` (None: off) and block-sparse `attention` (None: dense);
        `self.stats` and `out.stats` after it."""
        self._calling = True
        self.cache_options, self.step_cache, self.transformer_calls = options, None, 0
        self.attention = None if attention is None or attention.dense else attention
        self.sparse_calls = 0
        try:
            out = call(self, *args, **kwargs)
        finally:
            self._calling = False
        cache = self.step_cache
        self.step_cache = None
        stats = cache.stats() if cache is not None else {"cache": None, "transformer_calls": self.transformer_calls,
                                                         "cached_calls": 0, "decisions": []}
        self.stats = {"steps": len(self.timings.steps), **stats}
        if self.attention is not None:
            self.stats.update(attention=self.attention.spec(), sparse_calls=self.sparse_calls)
        if hasattr(out, "stats"):
            out.stats = dict(self.stats)
        return out

    def check_attention_grid(self, grid, sparse_plan) -> None:
        """The call's block-sparse attention planned for its latent grid `(t, h, w)` (after the
        patch) now, by the port's `sparse_plan(option, grid)`, so a window or tile the video
        cannot take is an error before any work."""
        if self.attention is None:
            return
        from difflet_tpu.layers.sparse_masks import SparsityError
        from difflet_tpu.pipeline.diffusion import PipelineError

        try:
            sparse_plan(self.attention, tuple(grid))
        except SparsityError as e:
            raise PipelineError(f"attention={self.attention.spec()!r}: {e}") from None

    def run_transformer(self, runner, slot: str = "cond", **kwargs):
        """`runner(**kwargs)` in the denoise loop: through the call's step cache when it has one
        (`slot`: which of the step's calls this is, each with its own cache), with the call's
        block-sparse attention after its dense `full_steps`."""
        if self.attention is not None and not self.attention.dense_at(self.step_index):
            kwargs["attention"] = self.attention
            slot = f"{slot}:sparse"  # its rows in another order: a cache of its own
            self.sparse_calls += 1
        if self.step_cache is None:
            self.transformer_calls += 1
            return runner(**kwargs)
        return self.step_cache(runner, self.step_index, slot, kwargs)

    def start_step_cache(self) -> None:
        """The loop's `StepCache` when the call has `cache=` (a port's own loop calls this before
        its steps and sets `step_index` in each)."""
        from difflet_tpu.step_cache import StepCache

        if self.cache_options is not None and self.step_cache is None:
            self.step_cache = StepCache(self.cache_options)

    def denoise(self, latents, sampler, predict: Callable):
        """The loop: `predict(latents, i, t)` -> the model's output at step i (timestep `t` as the
        scheduler gives it), then the sampler's step (difflet_tpu.pipeline.samplers; a
        `schedules.Schedule` steps by Euler). With `cache=` the transformer calls `predict` makes
        through `run_transformer` go through one `StepCache` for the loop."""
        from difflet_tpu.pipeline import samplers

        sampler = samplers.as_sampler(sampler)
        self.timings.steps = []
        self.start_step_cache()
        for i, t in enumerate(sampler.timesteps):
            start = time.perf_counter()
            self.step_index = i
            latents = jax.block_until_ready(sampler.step(i, predict(latents, i, t), latents))
            self.timings.steps.append(time.perf_counter() - start)
            self._stage("step", index=i, total=len(sampler), seconds=self.timings.steps[-1])
        return latents


def plot_changes(stats: dict, path) -> None:
    """A PNG of each call's relative L1 change against the threshold (matplotlib), cached calls marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise ArgumentError("the cache plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for slot in sorted({r["slot"] for r in stats["decisions"]}):
        rows = [r for r in stats["decisions"] if r["slot"] == slot and r["change"] is not None]
        ax.plot([r["step"] for r in rows], [r["change"] for r in rows], marker="o", label=f"{slot}: change")
        cached = [r for r in rows if r["skipped"]]
        ax.scatter([r["step"] for r in cached], [r["change"] for r in cached], s=80, facecolors="none",
                   edgecolors="red", label=f"{slot}: cached", zorder=3)
    ax.axhline(stats["threshold"], color="gray", linestyle="--", label=f"threshold {stats['threshold']}")
    ax.set_xlabel("denoise step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("relative L1 change")
    ax.set_title("first blocks' residual against the last full pass", fontsize=9)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
