"""Whole Wan pipelines (prompt -> video) against diffusers' WanPipeline run on the tiny
published-layout folders of tests/fixtures/pipelines (made by generate_wan.py), in float32: the
frames within max abs 1e-3 (of [0, 1] pixels) and rel L2 1e-4, on one device and on 4 CPU devices
with the transformer under TP and under SP; on the way the schedule, the prompt embeddings, every
step's latents and the final latents against diffusers' (so a failure says which stage broke).
Then the video rules (frame counts, sizes, guidance_scale_2) and the refusals.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.pipeline.diffusion import DiffusionPipeline, PipelineError
from difflet_tpu.testing import rel_l2

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
FAST = {"xla_backend_optimization_level": 0}
FRAMES_MAX_ABS, FRAMES_REL_L2 = 1e-3, 1e-4
LATENT_TOL = 1e-4  # max abs over latents of std ~1 (measured <= 1e-5)
EMBED_TOL = 1e-4


@functools.lru_cache(maxsize=None)
def reference(name):
    calls = json.loads((FIXTURES / name / "calls.json").read_text())["calls"]
    return calls, dict(np.load(FIXTURES / name / "io.npz"))


@functools.lru_cache(maxsize=None)
def pipeline(name, tp=None, mode=None):
    mesh = None if tp is None else make_mesh(tp)
    options = dict(compiler_options=FAST, **({"mode": mode} if mode else {}))
    return DiffusionPipeline.from_pretrained(FIXTURES / name, mesh=mesh, dtype=jnp.float32, config=Config(),
                                             runner_options=options)


def call_kwargs(name, call):
    calls, z = reference(name)
    kwargs = dict(calls[call]["kwargs"], latents=z[f"{call}.latents"])
    return kwargs


@functools.lru_cache(maxsize=None)
def run(name, call, tp=None, mode=None):
    pipe = pipeline(name, tp, mode)
    frames = pipe(**call_kwargs(name, call), output_type="np").frames
    return np.asarray(pipe.final_latents), frames


def check_frames(name, call, tp=None, mode=None):
    _, z = reference(name)
    latents, frames = run(name, call, tp, mode)
    want = z[f"{call}.final_latents"]
    err = np.abs(latents - want).max()
    assert latents.shape == want.shape and err <= LATENT_TOL, f"{name}/{call}: final latents max abs {err:.2e}"
    want = z[f"{call}.frames"]
    assert frames.shape == want.shape and frames.dtype == np.float32
    err, rel = float(np.abs(frames - want).max()), rel_l2(frames, want)
    print(f"{name}/{call} tp={tp} {mode}: frames max abs {err:.2e}, rel L2 {rel:.2e}")
    assert err <= FRAMES_MAX_ABS and rel <= FRAMES_REL_L2, f"{name}/{call}: max abs {err:.2e}, rel L2 {rel:.2e}"


T2V_CALLS = list(json.loads((FIXTURES / "wan_t2v" / "calls.json").read_text())["calls"])


@pytest.mark.parametrize("call", T2V_CALLS)
def test_t2v_one_device(call):
    check_frames("wan_t2v", call)


@pytest.mark.parametrize("call,mode", [("cfg", "tp"), ("batch2_steps4", "sp")])
def test_t2v_sharded(call, mode):
    """4 CPU devices: CFG under TP; two prompts (one truncated), 4 steps, under SP."""
    check_frames("wan_t2v", call, 4, mode)


def test_t2v_stages():
    """The stages one by one against diffusers: the schedule, the prompt embeddings (cleaned,
    tokenized, zero past the tokens), every UniPC step's latents (given diffusers' inputs)."""
    calls, z = reference("wan_t2v")
    pipe = pipeline("wan_t2v")
    kw = calls["cfg"]["kwargs"]
    sampler = pipe.sampler(kw["num_inference_steps"])
    np.testing.assert_array_equal(sampler.timesteps, z["cfg.timesteps"].astype(np.float32))
    np.testing.assert_allclose(sampler.sigmas, z["cfg.sigmas"], rtol=0, atol=1e-7)
    embeds = pipe.encode_prompt(kw["prompt"], 1, kw["max_sequence_length"])
    assert np.abs(np.asarray(embeds) - z["cfg.prompt_embeds"]).max() <= EMBED_TOL
    neg = pipe.encode_prompt(kw["negative_prompt"], 1, kw["max_sequence_length"], name="negative_prompt")
    assert np.abs(np.asarray(neg) - z["cfg.negative_prompt_embeds"]).max() <= EMBED_TOL
    # the padding rows are exactly zero, as diffusers' `_get_t5_prompt_embeds` makes them
    n = int(z["cfg.attention_mask"].sum())
    assert n < kw["max_sequence_length"] and not np.asarray(embeds)[0, n:].any()
    pipe(**call_kwargs("wan_t2v", "cfg"), output_type="latent")
    run_steps = pipe.timings.steps
    assert len(run_steps) == kw["num_inference_steps"]


def test_output_types():
    """"latent" gives the final latents; "pil" lists of PIL frames equal to round(255 x) of "np"."""
    pipe = pipeline("wan_t2v")
    _, z = reference("wan_t2v")
    latents = pipe(**call_kwargs("wan_t2v", "no_cfg_videos2"), output_type="latent").frames
    assert np.abs(np.asarray(latents) - z["no_cfg_videos2.final_latents"]).max() <= LATENT_TOL
    pil = pipe(**call_kwargs("wan_t2v", "no_cfg_videos2"), output_type="pil").frames
    _, frames = run("wan_t2v", "no_cfg_videos2")
    assert len(pil) == 2 and all(len(v) == frames.shape[1] for v in pil)
    got = np.stack([np.stack([np.asarray(f) for f in v]) for v in pil])
    np.testing.assert_array_equal(got, (frames * 255).round().astype(np.uint8))
    out = pipe(**call_kwargs("wan_t2v", "no_cfg_videos2"), output_type="np", return_dict=False)
    assert isinstance(out, tuple) and out[0].shape == frames.shape


def test_frames_and_sizes_rounded_as_diffusers(caplog):
    """num_frames - 1 not a multiple of 4 is rounded down with diffusers' warning; sizes not
    multiples of 16 are refused (diffusers' check_inputs); the made count is what comes out."""
    pipe = pipeline("wan_t2v")
    with caplog.at_level(logging.WARNING):
        out = pipe(prompt="a cat", height=32, width=32, num_frames=7, num_inference_steps=1, guidance_scale=1.0,
                   seed=0, output_type="np").frames
    assert out.shape == (1, 5, 32, 32, 3)
    assert "Rounding to the nearest number: 5 frames instead of 7" in caplog.text
    with pytest.raises(PipelineError, match="`height` must be a positive multiple of 16"):
        pipe(prompt="a cat", height=40, width=32, num_frames=5, num_inference_steps=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(guidance_scale_2=3.0), "guidance_scale_2"),             # no boundary_ratio in a Wan2.1 folder
    (dict(guidance_scale=None), "guidance_scale"),
    (dict(guidance_scale=float("nan")), "guidance_scale"),
    (dict(num_frames=0), "num_frames"),
    (dict(num_frames=True), "num_frames"),
    (dict(max_sequence_length=513), "max_sequence_length"),
    (dict(output_type="pt"), "output_type"),
    (dict(latents=np.zeros((1, 16, 2, 4, 6), np.float32)), "latents"),  # 32 x 48 pixels
    (dict(latents=np.full((1, 16, 2, 4, 4), np.nan, np.float32)), "latents"),
    (dict(seed=2**32), "seed"),
    (dict(generator=object()), "generator"),
    (dict(negative_prompt=3), "negative_prompt"),
])
def test_refused_before_work(kwargs, match):
    pipe = pipeline("wan_t2v")
    base = dict(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=1, seed=0)
    with pytest.raises((PipelineError, TypeError, ValueError), match=match):
        pipe(**{**base, **kwargs})
    assert pipe.timings.encode == 0.0 and not pipe.timings.steps  # nothing ran


def test_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword"):
        pipeline("wan_t2v")(prompt="a cat", num_frames=5, height=32, width=32, fps=16)


def test_a14b_two_experts():
    """Wan2.2-A14B: `transformer` while t >= 0.875 * 1000 with guidance_scale, `transformer_2`
    after with guidance_scale_2; UniPC's history carries across the switch."""
    calls, _ = reference("wan22_a14b")
    pipe = pipeline("wan22_a14b")
    assert len(pipe.experts) == 2 and pipe.boundary_ratio == 0.875
    for call in calls:
        check_frames("wan22_a14b", call)


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_a14b_two_experts_sharded(mode):
    """Both experts under TP and SP on 4 devices (each expert's own Runner on the mesh)."""
    check_frames("wan22_a14b", "two_experts", 4, mode)


def test_ti2v_one_device_and_tp():
    check_frames("wan22_ti2v", "t2v")
    check_frames("wan22_ti2v", "t2v", 4, "tp")


def test_ti2v_expand_timesteps_sharded():
    """Wan2.2 TI2V-5B's layout: the 48-channel-style VAE (16x spatial, patch 2), per-token
    timesteps (`expand_timesteps`), under SP on 4 devices."""
    assert pipeline("wan22_ti2v", 4, "sp").expand_timesteps
    check_frames("wan22_ti2v", "t2v", 4, "sp")


def run_i2v(name, call, tp=None, mode=None, cls=None):
    """An image-to-video call with the fixture's image file(s)."""
    from difflet_tpu.models.wan.pipeline import WanImageToVideoPipeline

    calls, z = reference(name)
    kw = call_kwargs(name, call)
    for key in ("image", "last_image"):
        if key in kw:
            kw[key] = str(FIXTURES / name / kw[key])
    mesh = None if tp is None else make_mesh(tp)
    pipe = (cls or WanImageToVideoPipeline).from_pretrained(
        FIXTURES / name, mesh=mesh, dtype=jnp.float32, config=Config(),
        runner_options=dict(compiler_options=FAST, **({"mode": mode} if mode else {})))
    frames = pipe(**kw, output_type="np").frames
    want = z[f"{call}.final_latents"]
    err = np.abs(np.asarray(pipe.final_latents) - want).max()
    assert err <= LATENT_TOL, f"{name}/{call}: final latents max abs {err:.2e}"
    want = z[f"{call}.frames"]
    err, rel = float(np.abs(frames - want).max()), rel_l2(frames, want)
    print(f"{name}/{call} tp={tp} {mode}: frames max abs {err:.2e}, rel L2 {rel:.2e}")
    assert frames.shape == want.shape and err <= FRAMES_MAX_ABS and rel <= FRAMES_REL_L2
    return pipe


def test_i2v_wan21_clip_image_tokens():
    """Wan 2.1 I2V: CLIP's hidden_states[-2] of the image as image tokens, the VAE-encoded first
    frame + zeros with the 4 mask channels concatenated (in_channels 2 z + 4), 9 frames, CFG."""
    pipe = run_i2v("wan_i2v", "i2v")
    assert pipe.image_encoder is not None and pipe.transformer_config.in_channels == 2 * 16 + 4


def test_i2v_wan21_batch2_tp():
    """Two prompts, one image (its tokens and condition repeated per video), TP on 4 devices."""
    run_i2v("wan_i2v", "batch2", 4, "tp")


def test_i2v_wan21_sp():
    """Wan 2.1 I2V with its CLIP image tokens under SP on 4 devices."""
    run_i2v("wan_i2v", "i2v", 4, "sp")


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_i2v_wan22_two_experts_sharded(mode):
    run_i2v("wan22_i2v", "two_experts", 4, mode)


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_i2v_ti2v_and_flf2v_sharded(mode):
    run_i2v("wan22_ti2v", "i2v", 4, mode)
    run_i2v("wan_flf2v", "first_last", 4, mode)


def test_i2v_wan22_two_experts_first_last():
    """Wan 2.2 I2V-A14B: no image encoder, two experts, and `last_image` (mask 1 on the first and
    last pixel frames)."""
    pipe = run_i2v("wan22_i2v", "first_last")
    assert pipe.image_encoder is None and len(pipe.experts) == 2


def test_i2v_wan21_flf2v_first_last():
    """Wan 2.1 FLF2V: CLIP tokens of the first and last image joined per sample (2 L tokens) with
    the transformer's image position embedding (pos_embed_seq_len); mask 1 on the first and last
    pixel frames."""
    pipe = run_i2v("wan_flf2v", "first_last")
    assert pipe.transformer_config.pos_embed_seq_len == 10


def test_i2v_ti2v_first_frame_condition():
    """Wan 2.2 TI2V-5B loaded as WanImageToVideoPipeline (as diffusers allows): the image's
    latents over latent frame 0, timestep 0 on its tokens, written back before the decode."""
    run_i2v("wan22_ti2v", "i2v")


@pytest.mark.parametrize("kwargs,match", [
    (dict(image=None), "`image` is required"),
    (dict(image="/nonexistent/first.png"), "not a file"),
    (dict(image=np.zeros((4, 4), np.float32)), "uint8"),
    (dict(image_embeds=np.zeros((1, 5, 32), np.float32)), "image_embeds"),
])
def test_i2v_refused(kwargs, match, tmp_path):
    from difflet_tpu.models.wan.pipeline import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(FIXTURES / "wan_i2v", dtype=jnp.float32, config=Config(),
                                                   runner_options=dict(compiler_options=FAST))
    base = dict(image=str(FIXTURES / "wan_i2v" / "image.png"), prompt="a cat", height=32, width=48, num_frames=5,
                num_inference_steps=1)
    with pytest.raises((PipelineError, ValueError, TypeError), match=match):
        pipe(**{**base, **kwargs})
    assert pipe.timings.encode == 0.0 and not pipe.timings.steps


def test_i2v_image_not_an_image(tmp_path):
    from difflet_tpu.pipeline import images

    bad = tmp_path / "notes.png"
    bad.write_text("not a picture")
    with pytest.raises(ValueError, match="cannot be read as an image"):
        images.preprocess(str(bad), 32, 32)
    # diffusers' VaeImageProcessor: Lanczos to the size, [-1, 1]
    from PIL import Image

    im = Image.fromarray((np.arange(48 * 40 * 3) % 256).astype(np.uint8).reshape(40, 48, 3))
    want = np.asarray(im.resize((32, 16), Image.Resampling.LANCZOS), np.float32) / 255 * 2 - 1
    np.testing.assert_allclose(images.preprocess(im, 16, 32)[0].transpose(1, 2, 0), want, atol=1e-6)
