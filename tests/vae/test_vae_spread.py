"""The causal-3D decode spread over 4 CPU devices (difflet_tpu/vae/spread.py): each video's
rows (or columns) split over the ranks with one-row halos, against diffusers' float32
fixtures (tests/fixtures/vae/) and the one-device decode; the uint8 frames against numpy.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from difflet_tpu import config, vae
from difflet_tpu.vae import loading, spread

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vae"
CASES = ("wan_vae", "wan22_vae")
MAX_ABS = 2e-5  # against diffusers' float32 sample, as tests/vae/test_vae_parity.py
ONE_DEVICE_ATOL = 1e-5  # float32: other shapes per device may take other CPU convolution kernels


def load(case, mesh=None):
    return vae.from_pretrained(FIXTURES / case / "vae", dtype=jnp.float32, mesh=mesh)


def io(case):
    return np.load(FIXTURES / case / "io.npz")


def assert_close(got, want, what):
    got = np.asarray(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.abs(got - want).max() <= MAX_ABS, f"{what}: max abs {np.abs(got - want).max():.3g}"


@pytest.fixture(scope="module")
def mesh4():
    return Mesh(np.array(jax.devices()[:4]), ("data",))


@pytest.fixture(scope="module")
def mesh2x2():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("cfg", "tp"))


def spread_over(out, dim: int) -> int:
    """How many devices hold different slices of `out` along `dim`."""
    spec = out.sharding.spec
    assert len(spec) > dim and spec[dim] is not None, out.sharding
    return len({idx[dim].start for idx in out.sharding.devices_indices_map(out.shape).values()})


@pytest.mark.parametrize("axis", spread.AXES)
@pytest.mark.parametrize("case", CASES)
def test_spread_fixture_video_matches_diffusers(case, axis, mesh4):
    """The fixture's video (Wan 2.1: 3 x 4 latents, so 3 rows over 4 ranks pad one;
    Wan 2.2: 2 x 2, patch_size 2) spread over 4 devices is diffusers' sample."""
    model, data = load(case, mesh4), io(case)
    got = model.decode_video(data["video.latents"], spread="on", axis=axis)
    assert spread_over(got, 3 if axis == "height" else 4) > 1
    assert_close(got, data["video.sample"], f"{case} spread by {axis}")


# latents [B, C, T, H, W] with several latent rows per rank: even (8 rows, 2 per rank) and
# uneven (7 rows: 2, 2, 2, 1 and 5 columns: 2, 2, 1, 0), 2 frames (the first chunk, then
# one scan step reading the causal cache)
SHAPES = {"even": (1, 2, 8, 6), "uneven": (1, 2, 7, 5)}


@pytest.mark.parametrize("case,shape", [("wan_vae", "even"), ("wan_vae", "uneven"), ("wan22_vae", "uneven")])
def test_spread_equals_one_device(case, shape, mesh4):
    """Random latents: the spread decode by height and by width equals the one-device decode."""
    one, model = load(case), load(case, mesh4)
    b, t, h, w = SHAPES[shape]
    lat = np.random.default_rng(0).standard_normal((b, one.config.z_dim, t, h, w)).astype(np.float32)
    want = np.asarray(one.decode_video(lat))
    for axis in spread.AXES:
        got = model.decode_video(lat, spread="on", axis=axis)
        assert spread_over(got, 3 if axis == "height" else 4) > 1
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=ONE_DEVICE_ATOL, err_msg=f"{case} {shape} {axis}")


def test_spread_over_a_2x2_mesh(mesh2x2):
    """Over both axes of a 2x2 mesh (ranks numbered over the axis tuple), batch 2: the fixture."""
    model, data = load("wan_vae", mesh2x2), io("wan_vae")
    got = model.decode_video(data["video_b2.latents"], spread="on", axis="height")
    assert spread_over(got, 3) > 1
    assert_close(got, data["video_b2.sample"], "wan_vae batch 2 over a 2x2 mesh")


def test_spread_without_halos_differs(mesh4, monkeypatch):
    """The cases above exercise the halos: with the neighbours' rows replaced by zeros
    (the exchange broken) the spread decode is far from the one-device decode. A shape of
    its own, so no program compiled by another case is reused."""
    one, model = load("wan_vae"), load("wan_vae", mesh4)
    lat = np.random.default_rng(0).standard_normal((1, 16, 2, 8, 7)).astype(np.float32)
    want = np.asarray(one.decode_video(lat))
    monkeypatch.setattr(jax.lax, "ppermute", lambda x, axis_name, perm: jax.numpy.zeros_like(x))
    try:
        got = np.asarray(model.decode_video(lat, spread="on", axis="height"))
    finally:
        loading._apply_jit.clear_cache()  # drop the broken program
    assert np.abs(got - want).max() > 1e-2


def test_auto_spreads_when_the_batch_does_not_split(mesh4, monkeypatch):
    """`spread="auto"` (the default, `DIFFLET_TPU_VAE_SPREAD`): a batch of 4 is sharded over the 4
    devices, a batch of 1 or 2 spread by rows; "off" never spreads; one device never spreads."""
    model = load("wan_vae", mesh4)
    monkeypatch.delenv("DIFFLET_TPU_VAE_SPREAD", raising=False)
    assert model.spread_axis((4, 16, 3, 8, 6)) is None
    assert model.spread_axis((1, 16, 3, 6, 8)) == "width"
    assert model.spread_axis((2, 16, 3, 8, 6)) == "height"  # 6 columns do not divide over 4, 8 rows do
    assert model.spread_axis((1, 16, 3, 7, 5)) == "width"  # neither divides: the width, padded
    assert model.spread_axis((1, 16, 3, 8, 6), "off") is None
    assert model.spread_axis((4, 16, 3, 6, 8), "on") == "width"
    assert load("wan_vae").spread_axis((1, 16, 3, 8, 6), "on") is None
    monkeypatch.setenv("DIFFLET_TPU_VAE_SPREAD", "off")
    assert model.spread_axis((1, 16, 3, 8, 6)) is None
    data = io("wan_vae")  # video_b2: latents 2 x 3, the width padded
    assert model.decode_video(data["video_b2.latents"]).sharding.is_fully_replicated
    assert spread_over(model.decode_video(data["video_b2.latents"], spread="auto"), 4) > 1  # the argument wins
    monkeypatch.delenv("DIFFLET_TPU_VAE_SPREAD")
    got = model.decode_video(data["video_b2.latents"])
    assert spread_over(got, 4) > 1
    assert_close(got, data["video_b2.sample"], "wan_vae batch 2 spread by auto")


def test_bad_spread_arguments(mesh4):
    model = load("wan_vae", mesh4)
    lat = io("wan_vae")["video.latents"]
    with pytest.raises(ValueError, match="spread"):
        model.decode_video(lat, spread="yes")
    with pytest.raises(ValueError, match="axis"):
        model.decode_video(lat, spread="on", axis="time")
    with pytest.raises(config.ConfigError, match="DIFFLET_TPU_VAE_SPREAD"):
        config.Config.from_env({"DIFFLET_TPU_VAE_SPREAD": "1"})


def numpy_uint8(x):
    """diffusers' VaeImageProcessor.denormalize + numpy_to_pil, in numpy float32."""
    y = np.clip(np.asarray(x, np.float32) * np.float32(0.5) + np.float32(0.5), 0, 1)
    return (y * np.float32(255)).round().astype(np.uint8)


def test_to_uint8_against_numpy():
    """Every float32 in [-1.1, 1.1] on a fine grid (and the half-level ties) as numpy rounds it."""
    x = np.concatenate([np.linspace(-1.1, 1.1, 200_001, dtype=np.float32),
                        (np.arange(256, dtype=np.float32) + 0.5) / 255 * 2 - 1])
    got = np.asarray(jax.jit(loading.to_uint8)(x))
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, numpy_uint8(x))


@pytest.mark.parametrize("spread_mode", ["off", "on"])
def test_decode_video_uint8(spread_mode, mesh4):
    """`uint8=True`: the float decode's frames as uint8, channels last `[B, F, H, W, 3]`."""
    model, data = load("wan_vae", mesh4), io("wan_vae")
    lat = data["video.latents"]
    want = numpy_uint8(np.moveaxis(np.asarray(model.decode_video(lat, spread=spread_mode)), 1, -1))
    got = model.decode_video(lat, spread=spread_mode, uint8=True)
    assert got.dtype == np.uint8 and got.shape == (1, 9, 24, 32, 3)
    np.testing.assert_array_equal(np.asarray(got), want)
    image = model.decode(lat, uint8=True)
    assert image.shape == (1, 24, 32, 3)
    np.testing.assert_array_equal(np.asarray(image), want[:, 0])


@pytest.mark.parametrize("spread_mode", ["off", "on"])
def test_decode_video_uint8_refuses_non_finite(spread_mode, mesh4):
    """A NaN only in the last latent frame's last column (decoded in the scan, on the last rank
    when spread, converted chunk by chunk) is still refused, not turned into pixels."""
    model, data = load("wan_vae", mesh4), io("wan_vae")
    lat = np.array(data["video.latents"])
    lat[0, :, -1, -1, -1] = np.nan
    with pytest.raises(FloatingPointError, match="non-finite"):
        model.decode_video(lat, spread=spread_mode, uint8=True)


def test_decode_video_uint8_never_holds_the_float_video():
    """`uint8=True` converts each chunk as it is decoded: the lowered program has the uint8
    frames `[1, 9, 24, 32, 3]` and no float32 video of that size in either layout."""
    from flax import nnx

    model = load("wan_vae")
    lat = jnp.asarray(io("wan_vae")["video.latents"])
    graphdef, state = nnx.split(model)
    text = loading._apply_jit.trace(graphdef, state, "decode_video_latents", lat, (("spread_axis", None),),
                                    True).lower().as_text()
    assert "tensor<1x9x24x32x3xui8>" in text
    assert "tensor<1x9x24x32x3xf32>" not in text and "tensor<1x3x9x24x32xf32>" not in text


DEVICELESS = r"""
import json, sys
from difflet_tpu.tools import deviceless
devices, chip, calibration = deviceless.compile_target("v5e:2x2")
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from difflet_tpu.vae import AutoencoderKLCausal3D, Causal3DConfig, loading
cfg = Causal3DConfig(class_name="AutoencoderKLWan", base_dim=8, dim_mult=(1, 2, 2, 2))
model = nnx.eval_shape(lambda: AutoencoderKLCausal3D(cfg, dtype=jnp.bfloat16))
mesh = Mesh(np.array(devices), ("tp",))
model.mesh = mesh
graphdef, state = nnx.split(model)
rep = NamedSharding(mesh, PartitionSpec())
state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
lat = jax.ShapeDtypeStruct((1, 16, 3, 10, 12), jnp.bfloat16, sharding=rep)
text = loading._apply_jit.trace(graphdef, state, "decode_video_latents", lat, (("spread_axis", "height"),),
                                True).lower().compile().as_text()
print(json.dumps(dict(permutes=text.count("collective-permute"), gathers=text.count("all-gather"))))
"""


@pytest.mark.slow
def test_spread_decode_compiles_for_v5e():
    """The spread decode (uneven: 10 latent rows over 4 chips) compiles deviceless for a
    v5e:2x2 slice, its halos as collective-permutes and the mid-block K/V as all-gathers."""
    from difflet_tpu.tools import deviceless

    out = deviceless.run_python(DEVICELESS, "v5e:2x2", timeout=600)
    assert out["permutes"] > 0 and out["gathers"] > 0, out
