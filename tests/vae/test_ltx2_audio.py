"""LTX-2's audio VAE decoder and vocoder (difflet_tpu/vae/ltx2_audio.py, ltx2_vocoder.py) against
diffusers' `AutoencoderKLLTX2Audio` and `LTX2Vocoder` (tests/fixtures/vae/ltx2_audio: LTX2Pipeline's
audio decode: denormalise, unpack, decode to a mel spectrogram, vocode), on one device and with
the batch sharded over 2 of a 4-device mesh."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from difflet_tpu import vae
from difflet_tpu.vae.ltx2_audio import AutoencoderKLLTX2Audio, LTX2AudioVAEConfig
from difflet_tpu.vae.ltx2_vocoder import LTX2Vocoder, LTX2VocoderConfig

CASE = Path(__file__).resolve().parents[1] / "fixtures" / "vae" / "ltx2_audio"


def check(got, ref, *, rel=1e-5, abs=1e-4, what=""):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    max_abs = float(np.abs(got - ref).max())
    rel_l2 = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel_l2 <= rel and max_abs <= abs, f"{what}: max abs {max_abs:.3e}, rel L2 {rel_l2:.3e}"


@pytest.fixture(scope="module")
def data():
    return dict(np.load(CASE / "io.npz"))


def test_audio_vae_parity(data):
    model = vae.from_pretrained(CASE / "audio_vae", dtype=jnp.float32)
    assert isinstance(model, AutoencoderKLLTX2Audio)
    check(model.decode_audio(data["in.latents"]), data["out.mel"], what="mel from packed latents")
    check(model(jnp.asarray(data["in.z"])), data["out.mel"], what="mel from z")


def test_vocoder_parity(data):
    model = vae.from_pretrained(CASE / "vocoder", dtype=jnp.float32)
    assert isinstance(model, LTX2Vocoder) and model.sample_rate == 24000
    check(model.vocode(data["out.mel"]), data["out.waveform"], what="waveform")


def test_mesh_batch_sharded(data):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    audio_vae = vae.from_pretrained(CASE / "audio_vae", dtype=jnp.float32, mesh=mesh)
    vocoder = vae.from_pretrained(CASE / "vocoder", dtype=jnp.float32, mesh=mesh)
    latents = np.concatenate([data["in.latents"]] * 2)
    mel = audio_vae.decode_audio(latents)
    check(mel[2:], data["out.mel"], what="mel on the mesh")
    check(vocoder.vocode(mel)[:2], data["out.waveform"], what="waveform on the mesh")


def test_unimplemented_flags_refused_by_name():
    a = json.loads((CASE / "audio_vae" / "config.json").read_text())
    with pytest.raises(ValueError, match="attention blocks"):
        LTX2AudioVAEConfig.from_dict({**a, "mid_block_add_attention": True})
    v = json.loads((CASE / "vocoder" / "config.json").read_text())
    with pytest.raises(ValueError, match="act_fn='snakebeta'"):
        LTX2VocoderConfig.from_dict({**v, "act_fn": "snakebeta"})
    with pytest.raises(ValueError, match="antialias=True"):
        LTX2VocoderConfig.from_dict({**v, "antialias": True})


def test_bad_inputs_refused(data):
    model = vae.from_pretrained(CASE / "audio_vae", dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"expected packed \[batch, frames, 8\]"):
        model.decode_audio(np.zeros((1, 3, 6), np.float32))
    vocoder = vae.from_pretrained(CASE / "vocoder", dtype=jnp.float32)
    with pytest.raises(ValueError, match="expected 32 in all"):
        vocoder.vocode(np.zeros((1, 2, 5, 8), np.float32))
