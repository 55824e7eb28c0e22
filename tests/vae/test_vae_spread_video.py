"""HunyuanVideo's and LTX-2's video decodes spread over 4 CPU devices (difflet_tpu/vae/spread.py,
the mechanism the causal-3D decode uses, tests/vae/test_vae_spread.py): each video's rows (or
columns) split over the ranks, against the one-device decode (float32: max abs 1e-5; float64: equal)
and diffusers' float32 samples (tests/fixtures/vae/). What these decoders add to the
mechanism is exercised: edge-copied (HunyuanVideo) and reflected (LTX-2) padding at the image's
edges, GroupNorm statistics summed over the ranks and HunyuanVideo's frame-causal attention
over every frame's tokens (with temporal tiles), on even and uneven (padded) splits.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from difflet_tpu import vae
from difflet_tpu.vae import loading, spread

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vae"
ATOL = {"float32": 1e-5, "float64": 1e-12}  # the spread decode against the one-device decode
MAX_ABS = 1e-4  # against diffusers' float32 sample, as tests/vae/test_ltx2_video_vae.py
# (fixture, its io.npz latents, diffusers' sample of them); HunyuanVideo's 6 latent frames decode
# in diffusers' temporal tiles (`lax.map` over the full tiles, a shorter tail)
SAMPLES = {"hunyuan_video_vae": ("tiled.latents", "tiled.sample"),
           "ltx2_video_vae": ("in.latents", "out.sample"),
           "ltx2_video_vae_causal": ("in.latents", "out.sample")}
SMALL = {**SAMPLES, "hunyuan_video_vae": ("video.latents", "video.sample")}  # 3 latent frames: no tiles


def load(case, mesh=None, dtype=jnp.float32):
    return vae.from_pretrained(FIXTURES / case / "vae", dtype=dtype, mesh=mesh)


@pytest.fixture(scope="module")
def mesh4():
    return Mesh(np.array(jax.devices()[:4]), ("data",))


def spread_over(out, dim: int) -> int:
    """How many devices hold different slices of `out` along `dim`."""
    spec = out.sharding.spec
    assert len(spec) > dim and spec[dim] is not None, out.sharding
    return len({idx[dim].start for idx in out.sharding.devices_indices_map(out.shape).values()})


def latents(model, shape, seed=0):
    b, t, h, w = shape
    channels = model.config.latent_channels
    return np.random.default_rng(seed).standard_normal((b, channels, t, h, w)).astype(np.float32)


def check_spread(case, lat, mesh, dtype="float32"):
    """The spread decode by height and by width against the one-device decode, in `dtype`."""
    with jax.enable_x64(dtype == "float64"):
        one, model = load(case, dtype=dtype), load(case, mesh, dtype=dtype)
        lat = lat.astype(dtype)
        want = np.asarray(one.decode_video(lat))
        for axis in spread.AXES:
            got = model.decode_video(lat, spread="on", axis=axis)
            assert spread_over(got, 3 if axis == "height" else 4) > 1
            err = float(np.abs(np.asarray(got) - want).max())
            print(f"{case} {lat.shape} {dtype} by {axis}: max abs {err:.3g}")
            assert got.shape == want.shape and err <= ATOL[dtype], f"{case} {dtype} by {axis}: max abs {err:.3g}"


# Latents [B, T, h, w] whose split is even on one axis and uneven on the other: 8 rows (2 a rank)
# and 6 columns (2, 2, 2, 0: a whole rank of padding); 7 rows (2, 2, 2, 1) and 4 columns (1 a rank).
# float64: only a wrong row could differ by more than rounding (they are equal to the bit). float32:
# HunyuanVideo within 1e-5; the tiny LTX-2 decoders are ill-conditioned (per-pixel RMS norms over 4
# channels), their one-device float32 decode is itself up to 2.7e-5 from the float64 one and the
# spread float32 decode differs from it by up to 1e-4, so LTX-2 is checked in float64 here and
# against diffusers' float32 samples below.
@pytest.mark.parametrize("case,shape,dtype", [
    ("hunyuan_video_vae", (1, 2, 8, 6), "float32"),
    ("hunyuan_video_vae", (1, 2, 8, 6), "float64"),
    ("ltx2_video_vae", (1, 2, 7, 4), "float64"),
])
def test_spread_equals_one_device(case, shape, dtype, mesh4):
    check_spread(case, latents(load(case), shape), mesh4, dtype)


@pytest.mark.parametrize("case", SAMPLES)
def test_spread_fixture_matches_diffusers(case, mesh4):
    """The fixtures' videos (2 x 2 and 2 x 3 latents: 2 rows over 4 ranks pad two) spread over 4
    devices by height and width are diffusers' samples (HunyuanVideo's in temporal tiles, and
    within 1e-5 of the one-device decode)."""
    model, data = load(case, mesh4), np.load(FIXTURES / case / "io.npz")
    key, sample = SAMPLES[case]
    one = np.asarray(load(case).decode_video(data[key])) if case.startswith("hunyuan") else None
    for axis in spread.AXES:
        got = model.decode_video(data[key], spread="on", axis=axis)
        assert spread_over(got, 3 if axis == "height" else 4) > 1
        err = float(np.abs(np.asarray(got) - data[sample]).max())
        assert err <= MAX_ABS, f"{case} by {axis}: max abs {err:.3g}"
        if one is not None:
            err = float(np.abs(np.asarray(got) - one).max())
            assert err <= ATOL["float32"], f"{case} by {axis}: max abs {err:.3g} from the one-device decode"


def broken_decode(case, mesh, monkeypatch, name, replacement):
    """The fixture's spread decode (by height, batch 2) with `spread.<name>` replaced: its max abs difference
    from diffusers' sample. The compiled programs are dropped before (so the replacement is traced)
    and after (so no later test gets the broken one)."""
    model, data = load(case, mesh), np.load(FIXTURES / case / "io.npz")
    key, sample = SMALL[case]
    loading._apply_jit.clear_cache()
    monkeypatch.setattr(spread, name, replacement)
    try:
        got = np.asarray(model.decode_video(data[key], spread="on", axis="height"))
    finally:
        loading._apply_jit.clear_cache()
    return float(np.abs(got - data[sample]).max())


@pytest.mark.parametrize("case", ["hunyuan_video_vae", "ltx2_video_vae"])
def test_spread_without_edge_padding_differs(case, mesh4, monkeypatch):
    """The edge rows the mechanism copies (edge / reflect) matter: left as the halo exchange's
    zeros, the spread decode is far from diffusers' (so the cases above exercise them)."""
    assert broken_decode(case, mesh4, monkeypatch, "_pad_rows", lambda window, *args: window) > 1e-2


def test_hunyuan_spread_without_group_norm_sums_differs(mesh4, monkeypatch):
    """GroupNorm's statistics span the whole frame: with each rank's own sums (no psum over the
    ranks) the spread decode is far from diffusers'."""
    assert broken_decode("hunyuan_video_vae", mesh4, monkeypatch, "psum", lambda x: x * 4) > 1e-2
@pytest.mark.parametrize("case", ["hunyuan_video_vae", "ltx2_video_vae"])
def test_auto_and_uint8(case, mesh4, monkeypatch):
    """`spread=None` follows `DIFFLET_TPU_VAE_SPREAD` ("auto": a batch the 4 devices do not divide
    is spread, a batch of 4 sharded; "off" never spreads); `uint8=True` gives the frames channels
    last as diffusers' postprocess rounds its float32 sample (within one level: the samples agree
    to 1e-4, a tie may round either way)."""
    model, data = load(case, mesh4), np.load(FIXTURES / case / "io.npz")
    key, sample = SMALL[case]
    lat = data[key]
    monkeypatch.delenv("DIFFLET_TPU_VAE_SPREAD", raising=False)
    assert model.spread_axis(lat.shape) == "width" and model.spread_axis((4,) + lat.shape[1:]) is None
    got = model.decode_video(lat, uint8=True)
    assert got.dtype == np.uint8 and spread_over(got, 3) > 1  # [B, F, H, W, 3]: spread by the width
    floats = np.moveaxis(data[sample], 1, -1)
    want = np.round(np.clip(floats * np.float32(0.5) + np.float32(0.5), 0, 1) * np.float32(255)).astype(np.uint8)
    assert got.shape == want.shape and np.abs(np.asarray(got).astype(int) - want).max() <= 1
    monkeypatch.setenv("DIFFLET_TPU_VAE_SPREAD", "off")
    assert model.spread_axis(lat.shape) is None
