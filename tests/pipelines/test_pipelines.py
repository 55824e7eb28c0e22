"""Whole pipelines (prompt -> image) against diffusers' FluxPipeline / QwenImagePipeline run on
the tiny published-layout folders of tests/fixtures/pipelines, in float32: the images within
max abs 1e-3 (of [0, 1] pixels) and rel L2 1e-4, on one device and on 4 CPU devices with the
transformer under TP and under SP; on the way the schedule, the text embeddings and the final
latents against diffusers' (so a failure says which stage broke). Then the folder checks and
the refused arguments.

Compiles use XLA's CPU optimisation level 0 (the Runner's compiler_options) to keep the file
fast; the transformer tests show the numbers do not depend on it.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.pipeline import diffusion as D
from difflet_tpu.pipeline.diffusion import DiffusionPipeline, PipelineError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
FAST = {"xla_backend_optimization_level": 0}
IMAGE_MAX_ABS, IMAGE_REL_L2 = 1e-3, 1e-4
LATENT_TOL = 1e-4  # max abs over latents of std ~1 (measured ~4e-5)
EMBED_TOL = 1e-4  # max abs over embeddings of std ~1 (T5 over 512 tokens: ~3e-5)


def rel_l2(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


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


@functools.lru_cache(maxsize=None)
def run(name, call, tp=None, mode=None):
    pipe = pipeline(name, tp, mode)
    calls, z = reference(name)
    images = pipe(**calls[call]["kwargs"], latents=z[f"{call}.latents"], output_type="np").images
    return np.asarray(pipe.final_latents), images


def check_images(name, call, tp=None, mode=None):
    _, z = reference(name)
    latents, images = run(name, call, tp, mode)
    want = z[f"{call}.final_latents"]
    assert latents.shape == want.shape
    err = np.abs(latents - want).max()
    assert err <= LATENT_TOL, f"{name}/{call}: final latents max abs {err:.2e} (the denoise loop)"
    want = z[f"{call}.images"]
    assert images.shape == want.shape and images.dtype == np.float32
    err, rel = float(np.abs(images - want).max()), rel_l2(images, want)
    print(f"{name}/{call} tp={tp} {mode}: images max abs {err:.2e}, rel L2 {rel:.2e}")
    assert err <= IMAGE_MAX_ABS and rel <= IMAGE_REL_L2, f"{name}/{call}: max abs {err:.2e}, rel L2 {rel:.2e}"


ALL_CALLS = [(n, c) for n in ("flux_dev", "flux_schnell", "qwen_image")
             for c in json.loads((FIXTURES / n / "calls.json").read_text())["calls"]]
# on 4 devices: FLUX.1-dev-like (batch 2, truncation), schnell-like, Qwen-Image with true CFG
SHARDED_CALLS = [("flux_dev", "batch2"), ("flux_schnell", "steps2"), ("qwen_image", "true_cfg")]


@pytest.mark.parametrize("name,call", ALL_CALLS)
def test_schedule_matches_diffusers(name, call):
    pipe = pipeline(name)
    calls, z = reference(name)
    kw = calls[call]["kwargs"]
    f = pipe.vae_scale_factor * 2
    s = pipe.schedule(kw["num_inference_steps"], (kw["height"] // f) * (kw["width"] // f), kw.get("sigmas"))
    np.testing.assert_allclose(s.timesteps, z[f"{call}.timesteps"], rtol=1e-6)
    np.testing.assert_allclose(s.sigmas, z[f"{call}.sigmas"], rtol=1e-6)


@pytest.mark.parametrize("name,call", [c for c in ALL_CALLS if c[0] != "qwen_image"])
def test_flux_text_embeddings_match_diffusers(name, call):
    pipe = pipeline(name)
    calls, z = reference(name)
    kw = calls[call]["kwargs"]
    npip, msl = kw.get("num_images_per_prompt", 1), kw.get("max_sequence_length", 512)
    embeds, pooled, text_ids = pipe.encode_prompt(kw["prompt"], None, npip, msl)
    np.testing.assert_allclose(np.asarray(embeds), z[f"{call}.prompt_embeds"], atol=EMBED_TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), z[f"{call}.pooled_prompt_embeds"], atol=EMBED_TOL, rtol=0)
    np.testing.assert_array_equal(text_ids, z[f"{call}.text_ids"])
    f = pipe.vae_scale_factor * 2
    np.testing.assert_array_equal(pipe.prepare_latent_image_ids(kw["height"] // f, kw["width"] // f),
                                  z[f"{call}.latent_image_ids"])
    if "negative_prompt" in kw:
        embeds, pooled, _ = pipe.encode_prompt(kw["negative_prompt"], None, npip, msl, name="negative_prompt")
        np.testing.assert_allclose(np.asarray(embeds), z[f"{call}.negative_prompt_embeds"], atol=EMBED_TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(pooled), z[f"{call}.negative_pooled_prompt_embeds"], atol=EMBED_TOL,
                                   rtol=0)


@pytest.mark.parametrize("call", ["true_cfg", "no_cfg_batch2"])
def test_qwen_image_text_embeddings_match_diffusers(call):
    pipe = pipeline("qwen_image")
    calls, z = reference("qwen_image")
    kw = calls[call]["kwargs"]
    sides = [("", kw["prompt"])] + ([("negative_", kw["negative_prompt"])] if "negative_prompt" in kw else [])
    for pre, prompt in sides:
        embeds, mask = pipe.encode_prompt(prompt, name=pre + "prompt")
        np.testing.assert_allclose(np.asarray(embeds), z[f"{call}.{pre}prompt_embeds"], atol=EMBED_TOL, rtol=0)
        assert (mask is not None) == bool(z[f"{call}.{pre}prompt_embeds_mask_passed"])
        if mask is not None:
            np.testing.assert_array_equal(mask, z[f"{call}.{pre}prompt_embeds_mask"])


@pytest.mark.parametrize("name,call", ALL_CALLS)
def test_images_one_device(name, call):
    check_images(name, call)


@pytest.mark.parametrize("mode", ["tp", "sp"])
@pytest.mark.parametrize("name,call", SHARDED_CALLS)
def test_images_tp_sp_4_devices(name, call, mode):
    check_images(name, call, tp=4, mode=mode)
    pipe = pipeline(name, 4, mode)
    assert pipe.transformer.par.size == 4 and pipe.transformer.par.seq_sharded == (mode == "sp")


def test_pil_output_and_return_dict():
    pipe = pipeline("flux_schnell")
    calls, z = reference("flux_schnell")
    kw = calls["steps2"]["kwargs"]
    (images,) = pipe(**kw, latents=z["steps2.latents"], return_dict=False)  # output_type "pil" by default
    assert len(images) == 1 and images[0].size == (kw["width"], kw["height"]) and images[0].mode == "RGB"
    want = (z["steps2.images"][0] * 255).round().astype(np.uint8)  # diffusers' numpy_to_pil
    assert np.abs(np.asarray(images[0]).astype(int) - want).max() <= 1


def test_seed_latents_reproducible_and_distinct():
    pipe = pipeline("flux_schnell")
    kw = dict(prompt="a cat", height=32, width=32, num_inference_steps=1, output_type="latent")
    a, b, c = (np.asarray(pipe(**kw, seed=s).images) for s in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (1, 4, 16) and np.abs(a - c).max() > 0.1


# --------------------------------------------------------------------------
# Refusals before the work
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=["a cat", "  "]), r"prompt`\[1\] is empty"),
    (dict(prompt="a cat", height=30), "height.*multiple of 16.*30"),
    (dict(prompt="a cat", width=72), "width.*multiple of 16.*72"),
    (dict(prompt="a cat", num_inference_steps=0), "num_inference_steps"),
    (dict(prompt="a cat", max_sequence_length=513), "max_sequence_length"),
    (dict(prompt="a cat", output_type="pt"), "output_type"),
    (dict(prompt="a cat", sigmas=[1.0, 0.5]), "sigmas"),
    (dict(prompt="a cat", latents=np.zeros((1, 3, 16), np.float32)), r"latents.*\(1, 4, 16\)"),
    (dict(prompt="a cat", latents=np.full((1, 4, 16), np.nan, np.float32)), "finite"),
    (dict(prompt="a cat", ip_adapter_image=np.zeros((8, 8, 3))), "ip_adapter_image"),
    (dict(prompt="a cat", prompt_embeds=np.zeros((1, 4, 32))), "prompt_embeds"),
    (dict(prompt="a cat", callback_on_step_end=print), "callback_on_step_end"),
    (dict(prompt="a cat", guidance_scale=float("nan")), "guidance_scale.*finite.*nan"),
    (dict(prompt="a cat", guidance_scale="3.5"), "guidance_scale.*finite real number.*'3.5'"),
    (dict(prompt="a cat", negative_prompt="a dog", true_cfg_scale=float("inf")), "true_cfg_scale.*finite"),
])
def test_flux_call_refusals(kwargs, match):
    pipe = pipeline("flux_schnell")
    stages = []
    pipe.on_stage = lambda stage, info: stages.append(stage)
    kwargs = dict(dict(height=32, width=32, num_inference_steps=1, output_type="latent"), **kwargs)
    with pytest.raises((PipelineError, ValueError), match=match):
        pipe(**kwargs)
    assert stages == []  # refused before the work: no stage started


def test_qwen_image_guidance_scales_are_checked_before_the_work():
    pipe = pipeline("qwen_image")
    stages = []
    pipe.on_stage = lambda stage, info: stages.append(stage)
    with pytest.raises(PipelineError, match="true_cfg_scale.*finite.*nan"):
        pipe(prompt="a cat", negative_prompt="a dog", true_cfg_scale=float("nan"), height=32, width=32,
             num_inference_steps=2, output_type="latent")
    with pytest.raises(PipelineError, match="guidance_scale.*finite"):
        pipe(prompt="a cat", guidance_scale=float("-inf"), height=32, width=32, num_inference_steps=2)
    assert stages == []


def test_unknown_argument_and_defaults_accepted():
    pipe = pipeline("qwen_image")
    with pytest.raises(TypeError, match="unexpected keyword arguments.*'nonsense'"):
        pipe(prompt="a cat", nonsense=1)
    with pytest.raises(PipelineError, match="attention_kwargs"):
        pipe(prompt="a cat", attention_kwargs={"scale": 0.5}, height=32, width=32)
    with pytest.raises(PipelineError, match="num_inference_steps=1.*not finite"):  # shift_terminal's 0 / 0
        pipe(prompt="a cat", height=32, width=32, num_inference_steps=1)
    # diffusers' defaults passed explicitly change nothing and are accepted
    pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="latent", generator=None,
         callback_on_step_end_tensor_inputs=["latents"], seed=0)


@pytest.mark.parametrize("dtype", ["float33", "int8", jnp.int32])
def test_from_pretrained_refuses_a_dtype_that_is_not_floating(dtype):
    with pytest.raises(PipelineError, match="dtype must be a floating-point dtype.*got"):
        DiffusionPipeline.from_pretrained(FIXTURES / "flux_schnell", dtype=dtype)


def _copy(tmp_path, name="flux_schnell"):
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def test_folder_errors_name_every_missing_part(tmp_path):
    d = _copy(tmp_path)
    shutil.rmtree(d / "text_encoder_2")
    (d / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    (d / "tokenizer" / "merges.txt").unlink()
    with pytest.raises(PipelineError) as e:
        DiffusionPipeline.from_pretrained(d, dtype=jnp.float32)
    msg = str(e.value)
    assert "text_encoder_2/ is missing" in msg
    assert "vae/ has no diffusion_pytorch_model.safetensors" in msg
    assert "tokenizer/: missing the vocabulary files of a CLIPTokenizer" in msg and "merges.txt" in msg


def test_folder_not_a_pipeline(tmp_path):
    with pytest.raises(PipelineError, match="single FluxTransformer2DModel folder, not a pipeline.*model_index.json"):
        DiffusionPipeline.from_pretrained(FIXTURES / "flux_dev" / "transformer")
    with pytest.raises(PipelineError, match="no model_index.json"):
        DiffusionPipeline.from_pretrained(tmp_path)
    with pytest.raises(PipelineError, match="no such folder"):
        DiffusionPipeline.from_pretrained(tmp_path / "nope")
    d = _copy(tmp_path)
    index = json.loads((d / "model_index.json").read_text())
    (d / "model_index.json").write_text(json.dumps(dict(index, _class_name="StableDiffusionPipeline")))
    with pytest.raises(PipelineError, match="'StableDiffusionPipeline'; supported"):
        DiffusionPipeline.from_pretrained(d)
    (d / "model_index.json").write_text(json.dumps(dict(index, text_encoder=["transformers", "CLIPVisionModel"])))
    with pytest.raises(PipelineError, match="text_encoder is 'CLIPVisionModel'"):
        DiffusionPipeline.from_pretrained(d)


def test_scheduler_options_not_implemented_are_refused(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "scheduler" / "scheduler_config.json").read_text())
    (d / "scheduler" / "scheduler_config.json").write_text(json.dumps(dict(cfg, use_karras_sigmas=True)))
    with pytest.raises(PipelineError, match="use_karras_sigmas"):
        DiffusionPipeline.from_pretrained(d, dtype=jnp.float32)


def test_components_must_fit(tmp_path, monkeypatch):
    """Components that load but do not fit each other (a T5 of another width, a VAE of other
    latent channels): refused from the configs, before any weight is read."""
    from difflet_tpu.encoders import loading as encoder_loading
    from difflet_tpu.loading import Checkpoint

    d = _copy(tmp_path, "flux_dev")
    t5 = json.loads((d / "text_encoder_2" / "config.json").read_text())
    (d / "text_encoder_2" / "config.json").write_text(json.dumps(dict(t5, d_model=64)))
    vae = json.loads((d / "vae" / "config.json").read_text())
    (d / "vae" / "config.json").write_text(json.dumps(dict(vae, latent_channels=8)))

    def no_read(*a, **k):
        raise AssertionError("a weight was read before the error")

    monkeypatch.setattr(Checkpoint, "read", no_read)
    monkeypatch.setattr(encoder_loading.Checkpoint, "read", no_read)
    with pytest.raises(PipelineError, match="joint_attention_dim 32 != text_encoder_2 d_model 64.*in_channels 16 != "
                                            "4 x the VAE's latent channels 8"):
        DiffusionPipeline.from_pretrained(d, dtype=jnp.float32)


def test_pack_unpack_roundtrip():
    x = np.arange(2 * 4 * 6 * 8, dtype=np.float32).reshape(2, 4, 6, 8)
    packed = D.pack_latents(x)
    assert packed.shape == (2, 12, 16)
    # diffusers' layout: channel-major within each 2x2 patch
    np.testing.assert_array_equal(packed[0, 0], x[0, :, :2, :2].reshape(-1))
    np.testing.assert_array_equal(D.unpack_latents(packed, 48, 64, 8), x)
