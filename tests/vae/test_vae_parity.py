"""VAE decoders (difflet_tpu.vae) against the diffusers float32 fixtures
(tests/fixtures/vae/, made by tests/fixtures/vae/generate.py): one device and a
4-CPU-device mesh (batch sharded, parameters replicated), the raw decoder
(`vae.decode(z).sample`) and the pipelines' decode of denoised latents.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from difflet_tpu import vae
from difflet_tpu.vae import layers

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vae"
MAX_ABS = 2e-5
REL_L2 = 1e-5

# case -> the io.npz calls it stores
CALLS = {
    "flux_vae": ("image",),
    "sd_vae": ("image",),
    "qwen_image_vae": ("image", "video"),
    "wan_vae": ("video", "video_b2"),
    "wan22_vae": ("image", "video"),
    "hunyuan_video_vae": ("video", "tiled", "tiled3"),
}


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_close(got, want, what):
    got = np.asarray(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err, rel = float(np.abs(got - want).max()), rel_l2(got, want)
    assert err <= MAX_ABS and rel <= REL_L2, f"{what}: max abs {err:.3g}, rel L2 {rel:.3g}"


def load(case, mesh=None):
    return vae.from_pretrained(FIXTURES / case / "vae", dtype=jnp.float32, mesh=mesh)


def io(case):
    return np.load(FIXTURES / case / "io.npz")


def pipeline_decode(model, case, latents):
    """The decode the case's pipeline does: QwenImagePipeline keeps frame 0, the Wan and
    HunyuanVideo pipelines every frame, FluxPipeline the image."""
    if case == "qwen_image_vae" and latents.shape[2] == 1:
        return model.decode(latents)[:, :, None]
    if isinstance(model, (vae.AutoencoderKLCausal3D, vae.AutoencoderKLHunyuanVideo)):
        return model.decode_video(latents)
    return model.decode(latents)


@pytest.fixture(scope="module")
def mesh4():
    return Mesh(np.array(jax.devices()[:4]), ("data",))


@pytest.mark.parametrize("case", sorted(CALLS))
def test_decoder_matches_diffusers(case):
    """`model(z)` is diffusers' `vae.decode(z).sample`."""
    model, data = load(case), io(case)
    for call in CALLS[case]:
        got = jax.jit(model.__call__)(jnp.asarray(data[f"{call}.z"]))
        assert_close(got, data[f"{call}.sample"], f"{case} {call}")


@pytest.mark.parametrize("case", sorted(CALLS))
def test_pipeline_decode_matches_diffusers(case):
    """`decode` / `decode_video` of the denoised latents (the pipeline's un-scaling, then the
    decode) give the fixture's sample, float32."""
    model, data = load(case), io(case)
    for call in CALLS[case]:
        got = pipeline_decode(model, case, data[f"{call}.latents"])
        assert got.dtype == jnp.float32
        assert_close(got, data[f"{call}.sample"], f"{case} {call}")


def test_qwen_image_decode_is_frame_zero_of_the_video():
    """QwenImagePipeline decodes all frames and keeps frame 0; `decode` decodes latent frame 0
    alone (causal): the same image from multi-frame latents."""
    model, data = load("qwen_image_vae"), io("qwen_image_vae")
    got = model.decode(data["video.latents"])
    assert_close(got, data["video.sample"][:, :, 0], "qwen frame 0")


@pytest.mark.parametrize("case", sorted(CALLS))
def test_mesh_batch_sharded_equals_one_device(case, mesh4):
    """On 4 devices (parameters replicated, batch 4 sharded over them) the decode equals the
    fixture and the one-device result (to 1e-5: per-device batch 1 vs 4 changes the CPU
    convolution kernels); a batch of 2 (not divisible) runs replicated, or for the causal-3D VAE
    spread by rows (`DIFFLET_TPU_VAE_SPREAD=auto`, tests/vae/test_vae_spread.py)."""
    one, sharded, data = load(case), load(case, mesh4), io(case)
    for key, var in vae.loading.param_keys(sharded).items():
        sharding = var.get_value().sharding
        assert sharding.is_fully_replicated and len(sharding.device_set) == 4, key
    call = CALLS[case][0]
    lat, want = data[f"{call}.latents"], data[f"{call}.sample"]
    reps = 4 // lat.shape[0]
    lat4, want4 = np.concatenate([lat] * reps), np.concatenate([want] * reps)
    got = pipeline_decode(sharded, case, lat4)
    assert got.sharding.spec[0] is not None and len(got.sharding.device_set) == 4, got.sharding
    assert_close(got, want4, f"{case} {call} on 4 devices")
    np.testing.assert_allclose(np.asarray(got), np.asarray(pipeline_decode(one, case, lat4)), rtol=0, atol=1e-5)
    if lat.shape[0] == 2:
        assert_close(pipeline_decode(sharded, case, lat), want, f"{case} {call} batch 2 on 4 devices")


def test_hunyuan_video_tiles_and_causal_attention(monkeypatch):
    """HunyuanVideo: 3 latent frames decode whole, 6 and 8 in temporal tiles (diffusers'
    default framewise decode); the frame-causal mid-block attention in query chunks of 7
    (over 2 x 3 tokens a frame: chunks cross frame boundaries) gives the same decode. (The
    decode is not causal as a whole: GroupNorm's statistics span every frame.)"""
    model, data = load("hunyuan_video_vae"), io("hunyuan_video_vae")
    monkeypatch.setattr(layers, "QUERY_CHUNK", 7)
    z = jnp.asarray(data["video.z"])
    assert_close(jax.jit(model.__call__)(z), data["video.sample"], "hunyuan chunked attention")


@pytest.mark.parametrize("case", ["flux_vae", "qwen_image_vae"])
def test_chunked_mid_block_attention(case, monkeypatch):
    """The mid-block attention in query chunks (with a padded last chunk) gives the same
    decode: 6 x 8 = 48 (FLUX) and 4 x 6 = 24 (Qwen) tokens in chunks of 7."""
    monkeypatch.setattr(layers, "QUERY_CHUNK", 7)
    model, data = load(case), io(case)
    got = jax.jit(model.__call__)(jnp.asarray(data["image.z"]))
    assert_close(got, data["image.sample"], f"{case} chunked attention")


def test_attention_against_float64():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 37, 16)) for _ in range(3))
    s = q @ k.transpose(0, 2, 1) / 4.0
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    for chunk in (5, 37, 64):
        got = layers.attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), query_chunk=chunk)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


# rel L2 of diffusers' own bfloat16 decode (torch 2.13 CPU) against the float32 fixture:
# flux_vae 1.1e-2, qwen_image_vae 4.2e-2 (measured once); ours: 1.0e-2, 4.0e-2
BF16_REL_L2 = {"flux_vae": 1.5e-2, "qwen_image_vae": 5e-2}


@pytest.mark.parametrize("case", sorted(BF16_REL_L2))
def test_bfloat16_decode_near_float32(case):
    """dtype=bfloat16: parameters and activations bf16, norm statistics, conv accumulation and
    attention float32; as close to the float32 reference as diffusers' bf16 decode."""
    model, data = vae.from_pretrained(FIXTURES / case / "vae", dtype=jnp.bfloat16), io(case)
    assert {v.get_value().dtype for v in vae.loading.param_keys(model).values()} == {jnp.dtype(jnp.bfloat16)}
    got = pipeline_decode(model, case, data["image.latents"])
    assert got.dtype == jnp.float32
    assert rel_l2(got, data["image.sample"]) < BF16_REL_L2[case]


def test_decode_compiled_once_per_shape():
    """Repeated decodes of one shape reuse one compiled program; a new shape adds one."""
    model, data = load("sd_vae"), io("sd_vae")
    lat = data["image.latents"]
    jitted = vae.loading._apply_jit
    model.decode(lat)
    n = jitted._cache_size()
    for _ in range(3):
        model.decode(lat + 1.0)
    assert jitted._cache_size() == n
    model.decode(lat[:1])
    assert jitted._cache_size() == n + 1
