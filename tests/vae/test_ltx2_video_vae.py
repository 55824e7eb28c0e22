"""LTX-2's video VAE decoder (difflet_tpu/vae/ltx2_video.py) against diffusers'
`AutoencoderKLLTX2Video` (tests/fixtures/vae/ltx2_video_vae: reflect padding, non-causal, as
released; ltx2_video_vae_causal: zero padding, causal), LTX2Pipeline's denormalisation included,
on one device and with the batch sharded over a 4-device mesh."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from difflet_tpu import vae
from difflet_tpu.vae.ltx2_video import AutoencoderKLLTX2Video, LTX2VideoVAEConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vae"
CASES = ["ltx2_video_vae", "ltx2_video_vae_causal"]


def check(got, ref, *, rel=1e-5, abs=1e-4, what=""):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    max_abs = float(np.abs(got - ref).max())
    rel_l2 = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel_l2 <= rel and max_abs <= abs, f"{what}: max abs {max_abs:.3e}, rel L2 {rel_l2:.3e}"


@pytest.mark.parametrize("case", CASES)
def test_decode_video_parity(case):
    model = vae.from_pretrained(FIXTURES / case / "vae", dtype=jnp.float32)
    assert isinstance(model, AutoencoderKLLTX2Video)
    data = np.load(FIXTURES / case / "io.npz")
    check(model.decode_video(data["in.latents"]), data["out.sample"], what=case)
    assert (model.spatial_compression_ratio, model.temporal_compression_ratio) == (16, 4)


def test_the_causal_flag_matters():
    data = np.load(FIXTURES / "ltx2_video_vae" / "io.npz")
    model = vae.from_pretrained(FIXTURES / "ltx2_video_vae" / "vae", dtype=jnp.float32)
    model.decoder.causal = True
    out = np.asarray(model(jnp.asarray(data["in.z"])))
    assert np.abs(out - data["out.sample"]).max() > 1e-2


def test_batch_sharded_over_4_devices():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    model = vae.from_pretrained(FIXTURES / "ltx2_video_vae" / "vae", dtype=jnp.float32, mesh=mesh)
    data = np.load(FIXTURES / "ltx2_video_vae" / "io.npz")
    latents = np.concatenate([data["in.latents"]] * 2)  # batch 4: one sample a device
    out = model.decode_video(latents)
    check(out[:2], data["out.sample"], what="sharded")
    check(out[2:], data["out.sample"], what="sharded copy")


def test_unimplemented_flags_refused_by_name():
    cfg = json.loads((FIXTURES / "ltx2_video_vae" / "vae" / "config.json").read_text())
    with pytest.raises(ValueError, match="timestep_conditioning"):
        LTX2VideoVAEConfig.from_dict({**cfg, "timestep_conditioning": True})
    with pytest.raises(ValueError, match="decoder_inject_noise"):
        LTX2VideoVAEConfig.from_dict({**cfg, "decoder_inject_noise": [True, False, False, False]})
    with pytest.raises(ValueError, match="unknown config field"):
        LTX2VideoVAEConfig.from_dict({**cfg, "new_flag": 1})


def test_bad_latents_refused():
    model = vae.from_pretrained(FIXTURES / "ltx2_video_vae" / "vae", dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"expected \[batch, 8, frames, height, width\]"):
        model.decode_video(np.zeros((1, 7, 2, 2, 2), np.float32))
