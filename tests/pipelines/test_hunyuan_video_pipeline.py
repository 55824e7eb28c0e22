"""The whole HunyuanVideoPipeline (prompt -> video) against diffusers' run on the tiny
published-layout folder tests/fixtures/pipelines/hunyuan_video (made by generate_hunyuan.py), in
float32: the frames within max abs 1e-3 (of [0, 1] pixels) and rel L2 1e-4, on one device and on
4 CPU devices with the transformer under TP and under SP; on the way the schedule, the prompt
embeddings (Llama hidden_states[-3] cropped, CLIP pooled, the mask), every step's latents and the
final latents. Then the refusals (before any work).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.pipeline.diffusion import DiffusionPipeline, PipelineError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
NAME = "hunyuan_video"
FAST = {"xla_backend_optimization_level": 0}
FRAMES_MAX_ABS, FRAMES_REL_L2 = 1e-3, 1e-4
LATENT_TOL = 1e-4
EMBED_TOL = 1e-4
CALLS = list(json.loads((FIXTURES / NAME / "calls.json").read_text())["calls"])


def rel_l2(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@functools.lru_cache(maxsize=None)
def reference():
    calls = json.loads((FIXTURES / NAME / "calls.json").read_text())["calls"]
    return calls, dict(np.load(FIXTURES / NAME / "io.npz"))


@functools.lru_cache(maxsize=None)
def pipeline(tp=None, mode=None):
    mesh = None if tp is None else make_mesh(tp)
    options = dict(compiler_options=FAST, **({"mode": mode} if mode else {}))
    return DiffusionPipeline.from_pretrained(FIXTURES / NAME, mesh=mesh, dtype=jnp.float32, config=Config(),
                                             runner_options=options)


def call_kwargs(call):
    calls, z = reference()
    return dict(calls[call]["kwargs"], latents=z[f"{call}.latents"])


def check_frames(call, tp=None, mode=None):
    _, z = reference()
    pipe = pipeline(tp, mode)
    frames = pipe(**call_kwargs(call), output_type="np").frames
    want = z[f"{call}.final_latents"]
    err = float(np.abs(np.asarray(pipe.final_latents) - want).max())
    assert pipe.final_latents.shape == want.shape and err <= LATENT_TOL, f"{call}: final latents max abs {err:.2e}"
    want = z[f"{call}.frames"]
    assert frames.shape == want.shape and frames.dtype == np.float32
    err, rel = float(np.abs(frames - want).max()), rel_l2(frames, want)
    print(f"{NAME}/{call} tp={tp} {mode}: frames max abs {err:.2e}, rel L2 {rel:.2e}")
    assert err <= FRAMES_MAX_ABS and rel <= FRAMES_REL_L2, f"{call}: max abs {err:.2e}, rel L2 {rel:.2e}"


@pytest.mark.parametrize("call", CALLS)
def test_one_device(call):
    check_frames(call)


@pytest.mark.parametrize("call,mode", [("true_cfg", "tp"), ("embedded", "sp")])
def test_sharded(call, mode):
    """4 CPU devices: true CFG (two prompts, the VAE's temporal tiles) under TP; embedded
    guidance under SP. The decode is spread over the 4 devices (the default, vae/spread.py)."""
    _, z = reference()
    assert pipeline(4, mode).vae.spread_axis(z[f"{call}.latents"].shape) is not None
    check_frames(call, 4, mode)


def test_pil_frames_from_the_spread_decode():
    """output_type="pil" under SP: the spread decode's uint8 frames (converted on the devices) are
    diffusers' frames as its `numpy_to_pil` rounds them (within one level: the float frames agree
    to 1e-3)."""
    _, z = reference()
    frames = pipeline(4, "sp")(**call_kwargs("embedded"), output_type="pil").frames
    got = np.stack([np.stack([np.asarray(f) for f in video]) for video in frames])
    want = np.round(z["embedded.frames"] * 255).astype(np.uint8)
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.abs(got.astype(int) - want).max() <= 1


def start(pipe, call):
    """The checked call of the fixture's kwargs (`HunyuanVideoPipeline.__call__`'s defaults)."""
    import inspect

    defaults = {k: v.default for k, v in inspect.signature(type(pipe).__call__).parameters.items()
                if v.default is not inspect.Parameter.empty and k != "return_dict"}
    return pipe.start_hunyuan_call({}, **{**defaults, **call_kwargs(call)})


def predict(pipe, c, x, t, conds):
    """One step's model output as the pipeline's loop computes it (true CFG on the two rows)."""
    from difflet_tpu.pipeline import diffusion as D

    out = pipe.transformer(**pipe.step_kwargs(c, x, t, conds), return_dict=False)[0]
    if not c.do_true_cfg:
        return out
    neg, pos = jnp.split(out, 2)
    return D.true_cfg(pos, neg, jnp.float32(c.true_cfg_scale))


@pytest.mark.parametrize("call", ["true_cfg", "sigmas_videos2"])
def test_stages(call):
    """The class from model_index.json; the schedule (linspace or the given sigmas, shift 7),
    the encoders' outputs and each step's latents (from diffusers' initial latents) against
    diffusers'."""
    from difflet_tpu.models.hunyuan_video.pipeline import HunyuanVideoPipeline

    _, z = reference()
    pipe = pipeline()
    assert type(pipe) is HunyuanVideoPipeline
    c = start(pipe, call)
    np.testing.assert_allclose(c.sampler.timesteps, z[f"{call}.timesteps"], rtol=1e-6)
    np.testing.assert_allclose(c.sampler.sigmas, z[f"{call}.sigmas"], rtol=0, atol=1e-7)
    embeds, pooled, mask = pipe.encode_prompt(c.prompts, c)
    for got, key in ((embeds, "prompt_embeds"), (pooled, "pooled_prompt_embeds")):
        err = float(np.abs(np.asarray(got) - z[f"{call}.{key}"]).max())
        assert got.shape == z[f"{call}.{key}"].shape and err <= EMBED_TOL, f"{call} {key}: {err:.2e}"
    np.testing.assert_array_equal(mask, z[f"{call}.prompt_attention_mask"])
    if call == "true_cfg":
        assert c.do_true_cfg
        n_embeds, n_pooled, n_mask = pipe.encode_prompt(c.negatives, c, name="negative_prompt")
        assert float(np.abs(np.asarray(n_embeds) - z[f"{call}.negative_prompt_embeds"]).max()) <= EMBED_TOL
        assert float(np.abs(np.asarray(n_pooled) - z[f"{call}.negative_pooled_prompt_embeds"]).max()) <= EMBED_TOL
        np.testing.assert_array_equal(n_mask, z[f"{call}.negative_prompt_attention_mask"])
    else:  # a negative prompt without true_cfg_scale > 1 is not used
        assert not c.do_true_cfg and c.negatives is None
    conds = pipe.encode_call(c)
    x = c.latents
    for i, t in enumerate(c.sampler.timesteps):
        x = c.sampler.step(i, predict(pipe, c, x, t, conds), x)
        err = float(np.abs(np.asarray(x) - z[f"{call}.step_latents"][i]).max())
        assert err <= LATENT_TOL, f"{call} step {i}: {err:.2e}"


def test_prompt_2_has_no_effect_as_in_diffusers():
    """diffusers 0.42.1 sends `prompt` (not `prompt_2`) to CLIP: the fixture's call with
    prompt_2="a cat" equals the same call without it."""
    pipe = pipeline()
    kw = call_kwargs("sigmas_videos2")
    with_2 = pipe(**kw, output_type="latent").frames
    kw.pop("prompt_2")
    np.testing.assert_array_equal(np.asarray(pipe(**kw, output_type="latent").frames), np.asarray(with_2))


def test_guidance_scale_is_embedded():
    """guidance_scale changes the result without true CFG (the transformer's guidance input)."""
    pipe = pipeline()
    kw = call_kwargs("embedded")
    base = np.asarray(pipe(**kw, output_type="latent").frames)
    other = np.asarray(pipe(**{**kw, "guidance_scale": 1.0}, output_type="latent").frames)
    assert np.abs(base - other).max() > 1e-3


@pytest.mark.parametrize("kwargs,match", [
    (dict(height=40), "`height` must be a positive multiple of 16"),
    (dict(guidance_scale=float("nan")), "guidance_scale"),
    (dict(true_cfg_scale=None), "true_cfg_scale"),
    (dict(num_frames=0), "num_frames"),
    (dict(output_type="pt"), "output_type"),
    (dict(prompt_template="x"), "prompt_template"),
    (dict(prompt_template={"crop_start": 3}), "key `template`"),
    (dict(prompt_template={"template": "{}"}), "crop_start"),
    (dict(prompt_template={"template": "no slot", "crop_start": 0}), "'{}'"),
    (dict(max_sequence_length=0), "max_sequence_length"),
    (dict(sigmas=[]), "sigmas"),
    (dict(latents=np.zeros((1, 4, 2, 4, 6), np.float32)), "latents"),
    (dict(negative_prompt=["a", "b"], true_cfg_scale=2.0), "negative_prompt"),
    (dict(prompt_2=3), "prompt_2"),
    (dict(generator=object()), "generator"),
    (dict(prompt_embeds=np.zeros((1, 4, 24))), "prompt_embeds"),
    (dict(callback_on_step_end=print), "callback_on_step_end"),
    (dict(attention_kwargs={"scale": 1.0}), "attention_kwargs"),
])
def test_refused_before_work(kwargs, match):
    pipe = pipeline()
    pipe.timings.encode, pipe.timings.steps = 0.0, []
    base = dict(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=1, seed=0,
                prompt_template=reference()[0]["embedded"]["kwargs"]["prompt_template"])
    with pytest.raises((PipelineError, TypeError, ValueError), match=match):
        pipe(**{**base, **kwargs})
    assert pipe.timings.encode == 0.0 and not pipe.timings.steps  # nothing ran


def test_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword"):
        pipeline()(prompt="a cat", num_frames=5, height=32, width=32, fps=16)


def test_default_prompt_template_is_diffusers():
    """The port's DEFAULT_PROMPT_TEMPLATE is diffusers' text (the fixture calls pass diffusers'
    template with the tiny tokenizer's crop_start); crop_start 95 is the published tokenizer's."""
    from difflet_tpu.models.hunyuan_video.pipeline import DEFAULT_PROMPT_TEMPLATE

    calls, _ = reference()
    assert all(c["kwargs"]["prompt_template"]["template"] == DEFAULT_PROMPT_TEMPLATE["template"]
               for c in calls.values())
    assert DEFAULT_PROMPT_TEMPLATE["crop_start"] == 95
