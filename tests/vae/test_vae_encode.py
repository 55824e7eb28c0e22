"""The causal-3D VAE encoder (difflet_tpu.vae.encoder3d via AutoencoderKLCausal3D.encode)
against diffusers' float32 `vae.encode(video).latent_dist.mean` (tests/fixtures/vae/*/encode.npz,
made by tests/fixtures/vae/generate.py), the image-to-video pipelines' normalisation
(`scale`), loading the encoder only on request, and the input checks."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import load_file, save_file

from difflet_tpu import vae
from difflet_tpu.vae import WeightsError
from difflet_tpu.vae.encoder3d import patchify
from difflet_tpu.vae.loading import ENCODER_PREFIXES, WEIGHTS_NAME

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vae"
MAX_ABS = 1e-5  # the means are O(1) (|mean| <= 0.92): float32 rounding differences only
REL_L2 = 1e-5

# case -> the encode.npz calls it stores
CALLS = {
    "qwen_image_vae": ("encode_image",),
    "wan_vae": ("encode_video", "encode_b2"),
    "wan22_vae": ("encode_video", "encode_image"),
}
CASE_CALLS = [(case, call) for case, calls in CALLS.items() for call in calls]


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_close(got, want, what, max_abs=MAX_ABS, rel=REL_L2):
    got = np.asarray(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err, r = float(np.abs(got - want).max()), rel_l2(got, want)
    assert err <= max_abs and r <= rel, f"{what}: max abs {err:.3g}, rel L2 {r:.3g}"


_MODELS = {}


def load(case, dtype=jnp.float32, mesh=None):
    key = (case, jnp.dtype(dtype).name, mesh is not None)
    if key not in _MODELS:
        _MODELS[key] = vae.from_pretrained(FIXTURES / case / "vae", dtype=dtype, mesh=mesh, encoder=True)
    return _MODELS[key]


def data(case):
    return np.load(FIXTURES / case / "encode.npz")


def param_count(model) -> int:
    return sum(int(np.prod(v.get_value().shape)) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))


def meta(case):
    return json.loads((FIXTURES / case / "meta.json").read_text())


@pytest.mark.parametrize("case,call", CASE_CALLS)
def test_encode_matches_diffusers(case, call):
    """`encode(video)` is diffusers' `vae.encode(video).latent_dist.mean` (== `.mode()`)."""
    d = data(case)
    got = load(case).encode(d[f"{call}.video"])
    assert got.dtype == jnp.float32
    assert_close(got, d[f"{call}.mean"], f"{case} {call}")


@pytest.mark.parametrize("case,call", CASE_CALLS)
def test_scale_matches_pipeline(case, call):
    """`scale` is WanImageToVideoPipeline's `(mean - latents_mean) * (1 / latents_std)`, and
    `unscale` undoes it."""
    d, model = data(case), load(case)
    got = model.scale(d[f"{call}.mean"])
    assert_close(got, d[f"{call}.latents"], f"{case} {call} scale", max_abs=1e-6, rel=1e-6)
    assert_close(model.unscale(got), d[f"{call}.mean"], f"{case} {call} unscale", max_abs=1e-6, rel=1e-6)


@pytest.mark.parametrize("case,call", [("wan_vae", "encode_b2"), ("wan22_vae", "encode_image")])
def test_encode_batch_sharded(case, call):
    """Batch 2 over a 2-device mesh (parameters replicated): the same means."""
    d = data(case)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    got = load(case, mesh=mesh).encode(d[f"{call}.video"])
    assert len(got.sharding.device_set) == 2
    assert_close(got, d[f"{call}.mean"], f"{case} {call} sharded")


@pytest.mark.parametrize("case", ["wan_vae", "wan22_vae"])
def test_latent_frame0_reads_frame0_only(case):
    """The I2V condition (frame 0, zeros after): latent frame 0 is the encode of frame 0
    alone (causal), the later latent frames come from the scanned chunks."""
    video = data(case)["encode_video.video"]
    cond = np.concatenate([video[:, :, :1], np.zeros_like(video[:, :, 1:])], axis=2)
    model = load(case)
    full, first = np.asarray(model.encode(cond)), np.asarray(model.encode(cond[:, :, :1]))
    assert full.shape[2] == 3 and first.shape[2] == 1
    np.testing.assert_allclose(full[:, :, :1], first, rtol=0, atol=1e-6)
    assert np.abs(full[:, :, 1:] - full[:, :, :1]).max() > 1e-2  # the zero chunks differ from frame 0


# rel L2 of diffusers' own bfloat16 encode (model and video bf16) to its float32 means,
# encode_video: wan_vae 1.9e-2, wan22_vae 6.2e-2 (measured once); ours: 1.8e-2, 5.8e-2
BF16_REL_L2 = {"wan_vae": 2.5e-2, "wan22_vae": 7.5e-2}


@pytest.mark.parametrize("case", sorted(BF16_REL_L2))
def test_encode_bfloat16_near_float32(case):
    """dtype=bfloat16 stays as close to diffusers' float32 means as diffusers' bf16 encode."""
    d = data(case)
    got = load(case, dtype=jnp.bfloat16).encode(d["encode_video.video"])
    assert got.dtype == jnp.float32
    assert rel_l2(got, d["encode_video.mean"]) < BF16_REL_L2[case]


def test_encode_compiled_once_per_shape():
    """Repeated encodes of one shape reuse one compiled program."""
    model, video = load("wan_vae"), data("wan_vae")["encode_b2.video"]
    jitted = vae.loading._apply_jit
    model.encode(video)
    n = jitted._cache_size()
    for _ in range(2):
        model.encode(video * 0.5)
    assert jitted._cache_size() == n


def test_patchify_is_unpatchify_inverse():
    from difflet_tpu.vae.causal3d import unpatchify

    x = np.random.default_rng(0).standard_normal((2, 3, 4, 6, 3)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(unpatchify(patchify(x, 2), 2)), x)


# --------------------------------------------------------------------------
# Loading the encoder only on request
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CALLS))
def test_encoder_loaded_only_when_asked(case):
    """Without `encoder=True` no encoder parameter exists (diffusers' decoder-only count);
    with it, every parameter of the checkpoint is loaded (diffusers' full count)."""
    plain = vae.from_pretrained(FIXTURES / case / "vae", dtype=jnp.float32)
    assert plain.encoder is None and plain.quant_conv is None
    paths = [".".join(map(str, p)) for p, v in nnx.iter_graph(plain) if isinstance(v, nnx.Param)]
    assert not [p for p in paths if p.startswith(ENCODER_PREFIXES)]
    assert param_count(plain) == meta(case)["num_decoder_parameters"]
    assert param_count(load(case)) == meta(case)["num_parameters"]
    with pytest.raises(ValueError, match=r"without its encoder.*encoder=True"):
        plain.encode(data(case)[f"{CALLS[case][0]}.video"])


def test_missing_encoder_key_named(tmp_path):
    src, dst = FIXTURES / "wan_vae" / "vae", tmp_path / "wan_vae"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / WEIGHTS_NAME)
    key = "encoder.down_blocks.5.time_conv.weight"
    assert key in tensors
    del tensors[key]
    save_file(tensors, dst / WEIGHTS_NAME)
    vae.from_pretrained(dst, dtype=jnp.float32)  # decoder only: the encoder half is not read
    with pytest.raises(WeightsError, match=rf"missing {key} \(expected shape \[8, 8, 3, 1, 1\]\).*encoder=True"):
        vae.from_pretrained(dst, dtype=jnp.float32, encoder=True)


def test_encoder_not_for_autoencoder_kl():
    with pytest.raises(ValueError, match=r"AutoencoderKL encoder is not implemented"):
        vae.from_pretrained(FIXTURES / "flux_vae" / "vae", dtype=jnp.float32, encoder=True)


def test_attn_scales_refused():
    config = vae.Causal3DConfig(base_dim=4, dim_mult=(1, 2, 2, 2), attn_scales=(1.0,))
    with pytest.raises(ValueError, match=r"attn_scales \[1.0\] is not supported"):
        nnx.eval_shape(lambda: vae.AutoencoderKLCausal3D(config, rngs=None, encoder=True))


def test_qwen_input_channels_is_in_channels():
    config = vae.Causal3DConfig.from_dict({"_class_name": "AutoencoderKLQwenImage", "input_channels": 4})
    assert (config.in_channels, config.out_channels) == (4, 4)


# --------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case,shape,dtype,match", [
    ("wan_vae", (1, 4, 5, 16, 16), np.float32, r"shape \(1, 4, 5, 16, 16\), expected \[batch, 3, frames"),
    ("wan_vae", (1, 3, 16, 16), np.float32, r"shape \(1, 3, 16, 16\), expected"),
    ("wan_vae", (1, 3, 6, 16, 16), np.float32, r"6 frames, expected 1 \+ 4 k"),
    ("wan_vae", (1, 3, 5, 12, 16), np.float32, r"height 12 and width 16 must be multiples of 8"),
    ("wan22_vae", (1, 3, 1, 16, 24), np.float32, r"height 16 and width 24 must be multiples of 16"),
    ("wan22_vae", (1, 12, 1, 16, 16), np.float32, r"expected \[batch, 3, frames"),
    ("wan_vae", (1, 3, 5, 16, 16), np.int32, r"dtype int32, expected a floating dtype"),
])
def test_bad_video_refused(case, shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        load(case).encode(np.zeros(shape, dtype))
