"""The shared argument checks (difflet_tpu.arguments) on the pipeline call: the bounds of one
table, types as a user passes them (jax scalars, bfloat16 latents), arguments diffusers
accepts or refuses, and non-finite values named at the stage they appear."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import arguments as A
from difflet_tpu.checks import NonFiniteError
from difflet_tpu.config import Config
from difflet_tpu.pipeline.diffusion import DiffusionPipeline, PipelineError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
SMALL = dict(height=32, width=32, num_inference_steps=1, output_type="latent")


@functools.lru_cache(maxsize=None)
def pipeline(name):
    return DiffusionPipeline.from_pretrained(FIXTURES / name, dtype=jnp.float32, config=Config(),
                                             runner_options=dict(compiler_options={"xla_backend_optimization_level": 0}))


def refused(name, match, **kwargs):
    pipe = pipeline(name)
    stages = []
    pipe.on_stage = lambda stage, info: stages.append(stage)
    try:
        with pytest.raises(PipelineError, match=match) as e:
            pipe(**dict(dict(prompt="a cat", **SMALL), **kwargs))
    finally:
        pipe.on_stage = None
    assert stages == [], "refused after the work started"
    return str(e.value)


@pytest.mark.parametrize("name,kwargs,match", [
    # one table of bounds (arguments.LIMITS), the same as the bench's and generate's
    ("flux_schnell", dict(seed=2**32), r"`seed` must be <= 4294967295, got 4294967296"),
    ("flux_schnell", dict(seed=-1), r"`seed` must be >= 0, got -1"),
    ("flux_schnell", dict(num_images_per_prompt=10**9), r"num_images_per_prompt` must be <= 1024"),
    ("flux_schnell", dict(prompt=["a cat"] * 40, num_images_per_prompt=40), r"images per call.*<= 1024, got 1600"),
    ("flux_schnell", dict(num_inference_steps=10**7), r"num_inference_steps` must be <= 10000"),
    ("qwen_image", dict(height=2**20), r"`height` must be a positive multiple of 16 up to 16384, got 1048576"),
    # types: readable values, no bool as an int, None where a number is needed
    ("flux_schnell", dict(max_sequence_length=True), r"max_sequence_length` must be an int, got True"),
    ("flux_schnell", dict(max_sequence_length=513), r"cannot be greater than 512 .*got 513"),
    ("qwen_image", dict(max_sequence_length=1025), r"cannot be greater than 1024 .*got 1025"),
    ("flux_schnell", dict(num_inference_steps=jnp.int32(0)), r"num_inference_steps` must be >= 1, got 0$"),
    ("flux_schnell", dict(num_inference_steps=2.0), r"must be an int, got 2.0 \(float\)"),
    ("flux_schnell", dict(true_cfg_scale=None), r"true_cfg_scale` must be a finite real number, got None"),
    ("qwen_image", dict(true_cfg_scale=None), r"true_cfg_scale` must be a finite real number, got None"),
    ("flux_dev", dict(guidance_scale=None), r"guidance_scale` must be a finite real number, got None"),
    ("flux_schnell", dict(guidance_scale=jnp.float32(jnp.nan)), r"guidance_scale` must be a finite real number, "
                                                               r"got nan"),
    # an invalid negative prompt is refused even when guidance would not read it
    ("flux_schnell", dict(negative_prompt=5), r"negative_prompt` must be a non-empty string.*got 5"),
    ("qwen_image", dict(negative_prompt=5, true_cfg_scale=1.0), r"negative_prompt` must be a non-empty string"),
    ("flux_schnell", dict(negative_prompt_2=[None]), r"negative_prompt_2`\[0\] must be a string, got None"),
    ("flux_schnell", dict(latents=np.full((1, 4, 16), np.nan, jnp.bfloat16)), r"`latents`: 64 NaN .*bfloat16.*must be finite"),
    ("flux_schnell", dict(latents=np.zeros((1, 4, 16), np.int32)), r"latents` must be floating-point.*int32"),
])
def test_call_refusals(name, kwargs, match):
    msg = refused(name, match, **kwargs)
    assert "Array(" not in msg


def test_the_bounds_are_one_table():
    from difflet_tpu.bench import cli as bench_cli

    assert bench_cli.LIMITS is A.LIMITS


def test_jax_scalars_and_bfloat16_latents_run_as_their_numbers():
    pipe = pipeline("flux_schnell")
    latents = np.asarray(np.random.default_rng(0).standard_normal((1, 4, 16)), np.float32)
    want = pipe(prompt="a cat", latents=latents, **SMALL).images
    got = pipe(prompt="a cat", latents=jnp.asarray(latents, jnp.bfloat16), height=jnp.int32(32), width=np.int64(32),
               num_inference_steps=jnp.int32(1), guidance_scale=jnp.float32(3.5), max_sequence_length=jnp.int32(512),
               output_type="latent").images
    # the same call on the bfloat16-rounded latents: bfloat16 is accepted, not refused or cast twice
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() > 0  # bfloat16 rounding really went in


def test_seed_is_not_wrapped():
    pipe = pipeline("flux_schnell")
    top = pipe(prompt="a cat", seed=2**32 - 1, **SMALL).images
    zero = pipe(prompt="a cat", seed=0, **SMALL).images
    assert not np.allclose(np.asarray(top), np.asarray(zero))


def test_flux_empty_negative_prompt_runs_true_cfg_as_diffusers():
    """diffusers' FluxPipeline accepts negative_prompt="" (and so does QwenImagePipeline here)."""
    pipe = pipeline("flux_schnell")
    latents = np.asarray(np.random.default_rng(1).standard_normal((1, 4, 16)), np.float32)
    plain = np.asarray(pipe(prompt="a cat", latents=latents, **SMALL).images)
    cfg = np.asarray(pipe(prompt="a cat", negative_prompt="", true_cfg_scale=4.0, latents=latents, **SMALL).images)
    assert np.isfinite(cfg).all() and not np.allclose(plain, cfg)  # the empty prompt's prediction was used


def test_flux_warns_about_an_unused_negative_prompt(caplog):
    pipe = pipeline("flux_schnell")
    with caplog.at_level(logging.WARNING):
        pipe(prompt="a cat", negative_prompt="a dog", **SMALL)
    assert "negative_prompt is passed but true CFG is not enabled" in caplog.text


def test_non_finite_text_embeddings_named_at_the_encode(monkeypatch):
    from difflet_tpu.encoders import runtime

    pipe = pipeline("qwen_image")
    real = runtime.encode
    monkeypatch.setattr(runtime, "encode", lambda *a, **k: real(*a, **k) * jnp.nan)
    stages = []
    pipe.on_stage = lambda stage, info: stages.append(stage)
    try:
        with pytest.raises(NonFiniteError, match="prompt embeddings of text_encoder \\(the text encode\\).*NaN"):
            pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="np")
    finally:
        pipe.on_stage = None
    assert stages == ["encode"]  # not blamed on the VAE after the whole denoise


def test_non_finite_latents_named_after_the_denoise(monkeypatch):
    pipe = pipeline("flux_schnell")
    stages = []
    pipe.on_stage = lambda stage, info: stages.append(stage)
    real = pipe.transformer.__class__.__call__

    class Nan:
        def __init__(self, out):
            self.sample = out.sample * jnp.nan

    monkeypatch.setattr(pipe.transformer.__class__, "__call__", lambda self, **kw: Nan(real(self, **kw)))
    try:
        with pytest.raises(NonFiniteError, match="latents after the denoise"):
            pipe(prompt="a cat", height=32, width=32, num_inference_steps=1, output_type="np")
    finally:
        pipe.on_stage = None
    assert "decode" not in stages


@pytest.mark.parametrize("value,want", [(7, 7), (np.int64(7), 7), (jnp.int32(7), 7), (np.array(7), 7)])
def test_integer_accepts_int_kinds(value, want):
    assert A.integer("n", value) == want and type(A.integer("n", value)) is int


@pytest.mark.parametrize("value,match", [
    (True, "must be an int, got True"), (7.0, r"got 7.0 \(float\)"), ("7", "got '7'"),
    (jnp.float32(7), r"got 7.0"), (np.array([7]), r"got array\(\[7\]\)")])
def test_integer_refusals(value, match):
    with pytest.raises(A.ArgumentError, match=match):
        A.integer("n", value)


def test_num_frames_is_one_plus_4k():
    assert [A.num_frames(f) for f in (1, 5, 81)] == [1, 5, 81]
    with pytest.raises(A.ArgumentError, match=r"`num_frames` must be 1 \+ a multiple of 4.*got 80; e.g. 77 or 81"):
        A.num_frames(80)
    with pytest.raises(A.ArgumentError, match="<= 4097"):
        A.num_frames(4101)
