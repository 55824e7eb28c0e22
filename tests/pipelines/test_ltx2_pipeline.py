"""The whole LTX2Pipeline (prompt -> video + audio) against diffusers' LTX2Pipeline run on the tiny
folder tests/fixtures/pipelines/ltx2 (made by generate_ltx2.py), in float32, with the fixture's
latents and audio latents: the frames and the vocoder's waveform within max abs 1e-3 and rel L2
1e-4, on one device and on 4 CPU devices with the transformer under TP and under SP. Call 0 runs
every guidance diffusers runs by default (CFG, STG, modality isolation, rescale); call 1 none,
with use_cross_timestep=False at 25 fps. Then the refusals.
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

FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines" / "ltx2"
FAST = {"xla_backend_optimization_level": 0}
MAX_ABS, REL_L2 = 1e-3, 1e-4


def rel_l2(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@functools.lru_cache(maxsize=None)
def reference():
    return json.loads((FOLDER / "calls.json").read_text()), dict(np.load(FOLDER / "io.npz"))


@functools.lru_cache(maxsize=None)
def pipeline(tp=None, mode=None, text_trim=False):
    mesh = None if tp is None else make_mesh(tp)
    options = dict(compiler_options=FAST, **({"mode": mode} if mode else {}))
    return DiffusionPipeline.from_pretrained(FOLDER, mesh=mesh, dtype=jnp.float32, config=Config(text_trim=text_trim),
                                             runner_options=options)


def kwargs(i, **extra):
    calls, z = reference()
    return {**calls[i], "latents": z["in.latents"], "audio_latents": z["in.audio_latents"], "output_type": "np",
            **extra}


@pytest.mark.parametrize("tp,mode", [(None, None), (4, "tp"), (4, "sp")])
@pytest.mark.parametrize("call", [0, 1])
def test_frames_and_audio_match_diffusers(call, tp, mode):
    pipe = pipeline(tp, mode)
    if tp:  # the video decode is spread over the 4 devices (the default, vae/spread.py)
        assert pipe.vae.spread_axis(reference()[1]["in.latents"].shape) is not None
    out = pipe(**kwargs(call))
    _, z = reference()
    frames, audio = np.asarray(out.frames), np.asarray(out.audio)
    want_frames, want_audio = z[f"c{call}.out.frames"], z[f"c{call}.out.audio"]
    assert frames.shape == want_frames.shape and audio.shape == want_audio.shape
    assert out.audio_sample_rate == 24000  # the vocoder's output_sampling_rate
    for what, got, want in (("frames", frames, want_frames), ("audio", audio, want_audio)):
        err = float(np.abs(got - want).max())
        assert err <= MAX_ABS and rel_l2(got, want) <= REL_L2, f"{what}: max abs {err:.2e}, rel L2 " \
                                                                f"{rel_l2(got, want):.2e}"


@pytest.mark.parametrize("call", [0, 1])
def test_text_trim_matches_diffusers(call):
    """Config(text_trim=True): Gemma-3 on the real tokens only (8 of 16 columns here), the same
    outputs within the same bounds (models/ltx2/text.py; tests/models/test_ltx2_text_trim.py)."""
    pipe = pipeline(text_trim=True)
    assert pipe.text_trim and not pipeline().text_trim
    out = pipe(**kwargs(call))
    _, z = reference()
    for what, got, want in (("frames", out.frames, z[f"c{call}.out.frames"]),
                            ("audio", out.audio, z[f"c{call}.out.audio"])):
        err = float(np.abs(np.asarray(got) - want).max())
        assert err <= MAX_ABS and rel_l2(got, want) <= REL_L2, f"{what}: max abs {err:.2e}, rel L2 " \
                                                                f"{rel_l2(got, want):.2e}"


@pytest.mark.parametrize("call", [0, 1])
def test_latent_output_matches_diffusers(call):
    """output_type="latent": both denormalised latents, [B, C, T, h, w] and [B, C, L, M]."""
    out = pipeline()(**kwargs(call, output_type="latent"))
    _, z = reference()
    for what, got, want in (("latents", out.frames, z[f"c{call}.out.latents"]),
                            ("audio latents", out.audio, z[f"c{call}.out.audio_latents"])):
        got = np.asarray(got)
        assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
        err = float(np.abs(got - want).max())
        assert err <= 1e-4 and rel_l2(got, want) <= REL_L2, f"{what}: max abs {err:.2e}, rel L2 {rel_l2(got, want):.2e}"


def test_audio_length_mismatch_refused():
    pipe = pipeline()
    _, z = reference()
    with pytest.raises(PipelineError, match=r"audio_latents.*5 audio latent frames.*num_frames=9.*9 audio"):
        pipe(**kwargs(0, num_frames=9, latents=np.zeros((1, 8, 3, 2, 4), np.float32)))


@pytest.mark.parametrize("name,value", [("noise_scale", 0.5), ("generator", object()), ("sigmas", [1.0, 0.5]),
                                        ("prompt_embeds", np.zeros((1, 4, 256))), ("enable_prompt_enhancement", True),
                                        ("decode_noise_scale", 0.1), ("attention_kwargs", {"scale": 1.0})])
def test_unimplemented_arguments_refused_by_name(name, value):
    with pytest.raises(PipelineError, match=name):
        pipeline()(**kwargs(1, **{name: value}))


@pytest.mark.parametrize("name,value", [("decode_timestep", "0.05"), ("use_cross_timestep", 1),
                                        ("frame_rate", 0.0), ("height", 48)])
def test_bad_values_refused(name, value):
    with pytest.raises(Exception, match=name):
        pipeline()(**kwargs(1, **{name: value}))


def test_stg_without_blocks_refused():
    with pytest.raises(PipelineError, match="spatio_temporal_guidance_blocks"):
        pipeline()(**{**kwargs(0), "spatio_temporal_guidance_blocks": None})
