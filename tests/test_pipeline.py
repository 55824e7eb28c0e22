"""Schedules against diffusers' arrays, the Euler loop, CFG and the compile-once rule."""

import json
import pathlib

import numpy as np
import pytest

from difflet_tpu.models.flux import schedule as flux
from difflet_tpu.models.hunyuan_video import schedule as hunyuan_video
from difflet_tpu.models.ltx2 import schedule as ltx2
from difflet_tpu.models.wan import schedule as wan
from difflet_tpu.pipeline import schedules as S

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "schedulers" / "schedules.json"


def _ours(case):
    name, steps = case["name"], case["steps"]
    kind, arg = name.split("_")[0], name.split("_")[-1]
    if kind == "flux":
        return flux.schedule(steps, int(arg))
    if kind == "wan":  # FlowMatchEuler with Wan's shifts (Wan's folders ship UniPC: tests/test_unipc.py)
        return S.flow_match_euler(S.SchedulerConfig(shift=float(arg)), steps)
    if kind == "hunyuan":
        return hunyuan_video.schedule(steps)
    if kind == "ltx2":
        return ltx2.schedule(steps, int(arg))
    return S.flow_match_euler(S.SchedulerConfig(**case["config"]), steps,
                              sigmas=np.linspace(1.0, 1 / steps, steps), mu=case["mu"])


@pytest.mark.parametrize("case", json.loads(FIXTURE.read_text())["cases"], ids=lambda c: c["name"])
def test_schedules_match_diffusers(case):
    ours = _ours(case)
    np.testing.assert_allclose(ours.timesteps, case["timesteps"], rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(ours.sigmas, case["sigmas"], rtol=1e-6, atol=1e-7)
    assert len(ours) == case["steps"] and ours.sigmas[-1] == 0


def test_wan22_expert_switch_at_the_boundary():
    sch = wan.schedule(40, 12.0)
    experts = [wan.expert(t, 0.875) for t in sch.timesteps]
    k = experts.index(1)
    assert experts == [0] * k + [1] * (40 - k)  # one switch, high noise first
    assert sch.timesteps[k - 1] >= 875 > sch.timesteps[k]
    assert all(wan.expert(t, None) == 0 for t in sch.timesteps)


# --------------------------------------------------------------------------
# The loop on the toy port (4 CPU devices)
# --------------------------------------------------------------------------

def _toy_denoiser(mode="tp", steps=3, pipeline=None, guidance=1.0, runners=None, boundary=None):
    import jax.numpy as jnp
    from flax import nnx

    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.runner import Runner
    from difflet_tpu.testing import register_toy_port

    port = register_toy_port()
    cfg = port.config_from_diffusers(port.presets["tiny"])
    fam = pipeline or port.pipeline
    inputs = port.example_inputs(cfg, batch=1, seed=0)
    cfg_inputs = None
    if fam.guidance_mode == "cfg":
        cfg_inputs = port.example_inputs(cfg, batch=2, seed=1)
        cfg_inputs["hidden_states"] = np.concatenate([inputs["hidden_states"]] * 2)
    mesh = make_mesh(4)
    if runners is None:
        runners = [Runner(port.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(e)), mesh, Config(), mode=mode)
                   for e in range(2 if boundary else 1)]
    sched = fam.schedule(steps, inputs, "tiny")
    return PL.Denoiser(fam, runners, inputs, sched, guidance=guidance, cfg_inputs=cfg_inputs,
                       boundary=boundary, dtype=jnp.float32)


def test_the_step_compiles_once_and_the_timestep_is_a_runtime_value():
    from difflet_tpu.pipeline import denoise as PL

    den = _toy_denoiser(steps=5)
    den.warmup(2)
    before = PL.CompileCounter.count()
    final, times = den.run()
    assert PL.CompileCounter.count() == before, "a denoise step recompiled"
    assert len(times) == 5 and np.isfinite(final["hidden_states"]).all()
    # five different timesteps went through the same executable
    assert len(set(den.schedule.timesteps.tolist())) == 5


def test_euler_update_matches_numpy_and_cfg_is_one_batch2_call():
    import dataclasses


    calls = []

    class Fake:
        def __call__(self, hidden_states, timestep, return_dict=True):
            assert return_dict is False  # the loop asks for diffusers' tuple
            calls.append((hidden_states.shape, np.asarray(timestep).copy()))
            b = hidden_states.shape[0] // 2
            h = np.asarray(hidden_states)
            return (np.concatenate([h[:b] * 0.5, h[b:] * 2.0]) if b else h * 0.5,)

    from difflet_tpu.testing import register_toy_port

    pipe = dataclasses.replace(register_toy_port().pipeline, guidance_mode="cfg")
    den = _toy_denoiser(pipeline=pipe, guidance=3.0, steps=2, runners=[Fake()])
    x0 = den.latents0["hidden_states"]
    out = den.step(den.initial(), 0)["hidden_states"]
    assert calls[0][0][0] == 2 * x0.shape[0]            # one call, batch 2
    np.testing.assert_allclose(calls[0][1], den.schedule.timesteps[0])
    u, c = 0.5 * x0, 2.0 * x0
    want = x0 + den.schedule.dt(0) * (u + 3.0 * (c - u))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_wan22_denoiser_switches_expert_once():

    used = []

    class Fake:
        def __init__(self, k):
            self.k = k

        def __call__(self, hidden_states, timestep, return_dict=True):
            used.append(self.k)
            return (np.zeros(hidden_states.shape, np.float32),)

    from difflet_tpu import models

    spec = models.spec("wan")
    preset = "Wan2.2-T2V-A14B"
    den = _toy_denoiser(steps=10, pipeline=spec.pipeline, runners=[Fake(0), Fake(1)], boundary=spec.experts[preset])
    den.schedule = spec.pipeline.schedule(10, {}, preset)
    den.run()
    k = used.index(1)
    assert used == [0] * k + [1] * (10 - k) and 0 < k < 10


def test_embeddings_file_replaces_conditioning(tmp_path):
    from difflet_tpu.pipeline import denoise as PL

    inputs = {"hidden_states": np.zeros((2, 4, 3), np.float32), "timestep": np.zeros(2, np.float32),
              "encoder_hidden_states": np.zeros((2, 5, 6), np.float32),
              "encoder_attention_mask": np.ones((2, 5), np.float32)}
    pos = np.random.default_rng(0).standard_normal((1, 5, 6)).astype(np.float32)
    neg = np.ones((5, 6), np.float32)
    path = tmp_path / "emb.npz"
    np.savez(path, prompt_embeds=pos, negative_prompt_embeds=neg)
    out = PL.apply_embeddings(inputs, PL.read_embeddings(str(path)), cfg_batch=True)
    np.testing.assert_array_equal(out["encoder_hidden_states"][1], pos[0])   # conditional second
    np.testing.assert_array_equal(out["encoder_hidden_states"][0], neg)
    np.testing.assert_array_equal(out["encoder_attention_mask"], inputs["encoder_attention_mask"])
    np.savez(path, encoder_hidden_states=np.zeros((1, 7, 6), np.float32))
    with pytest.raises(ValueError, match="encoder_hidden_states has shape"):
        PL.apply_embeddings(inputs, PL.read_embeddings(str(path)), cfg_batch=True)
    np.savez(path, clip_embeds=pos)
    with pytest.raises(ValueError, match="unknown arrays"):
        PL.apply_embeddings(inputs, PL.read_embeddings(str(path)), cfg_batch=False)


def test_a_ports_own_pipeline_argument_names_reach_its_transformer(tmp_path):
    # LTX2Pipeline's `audio_prompt_embeds` is the transformer's `audio_encoder_hidden_states`:
    # the port's Pipeline.arg_names says so; without them the array is unknown
    from difflet_tpu import models
    from difflet_tpu.pipeline import denoise as PL

    inputs = {"hidden_states": np.zeros((2, 4, 3), np.float32), "timestep": np.zeros(2, np.float32),
              "encoder_hidden_states": np.zeros((2, 5, 6), np.float32),
              "audio_encoder_hidden_states": np.zeros((2, 3, 2), np.float32)}
    audio = np.random.default_rng(1).standard_normal((1, 3, 2)).astype(np.float32)
    path = tmp_path / "emb.npz"
    np.savez(path, audio_prompt_embeds=audio, negative_audio_prompt_embeds=audio + 1)
    emb = PL.read_embeddings(str(path))
    out = PL.apply_embeddings(inputs, emb, cfg_batch=True, arg_names=models.spec("ltx2").pipeline.arg_names)
    np.testing.assert_array_equal(out["audio_encoder_hidden_states"], np.concatenate([audio + 1, audio]))
    np.testing.assert_array_equal(out["encoder_hidden_states"], inputs["encoder_hidden_states"])
    with pytest.raises(ValueError, match="unknown arrays"):
        PL.apply_embeddings(inputs, emb, cfg_batch=True, arg_names=models.spec("flux").pipeline.arg_names)


def test_true_cfg_rescale_matches_qwen_image_pipeline_in_float64():
    """QwenImagePipeline's true CFG (diffusers pipeline_qwenimage.py):
    comb = neg + g (pos - neg); comb * ||pos|| / ||comb||, norms over the last dim."""
    import dataclasses

    from difflet_tpu.models import spec
    from difflet_tpu.testing import register_toy_port

    assert spec("qwen_image").pipeline.cfg_rescale  # the port asks for it; no other port does
    assert not any(spec(n).pipeline.cfg_rescale for n in ("flux", "wan", "hunyuan_video", "ltx2"))
    rng = np.random.default_rng(0)

    class Fake:  # a velocity whose two halves differ in direction and size per token
        def __call__(self, hidden_states, timestep, return_dict=True):
            b = hidden_states.shape[0] // 2
            self.out = rng.standard_normal(hidden_states.shape).astype(np.float32)
            self.out[b:] *= np.linspace(0.5, 3.0, hidden_states.shape[-1], dtype=np.float32)
            return (self.out,)

    fake = Fake()
    pipe = dataclasses.replace(register_toy_port().pipeline, guidance_mode="cfg", cfg_rescale=True)
    den = _toy_denoiser(pipeline=pipe, guidance=4.0, steps=2, runners=[fake])
    x0 = den.latents0["hidden_states"]
    got = np.asarray(den.step(den.initial(), 0)["hidden_states"], np.float64)
    neg, pos = fake.out[:1].astype(np.float64), fake.out[1:].astype(np.float64)
    comb = neg + 4.0 * (pos - neg)
    comb = comb * (np.linalg.norm(pos, axis=-1, keepdims=True) / np.linalg.norm(comb, axis=-1, keepdims=True))
    want = x0.astype(np.float64) + float(den.schedule.dt(0)) * comb
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    plain = x0 + den.schedule.dt(0) * (neg + 4.0 * (pos - neg))
    assert np.abs(plain - want).max() > 1e-2  # the rescale changes this step (the test can fail)
