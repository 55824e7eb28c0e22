"""The one padding helper every port's `prepare` uses: `Runner.pad_stream` (a token
stream padded to the Runner's rule, and its length), `padding.pad_to` (another input
of the same stream) and `Runner.pad_key_mask` (the mask over several streams, or None)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from difflet_tpu.config import Config
from difflet_tpu.parallel import padding
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.runner import Runner
from difflet_tpu.testing import ToyConfig, ToyModel


def test_pad_to_numpy_and_jax():
    x = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3) + 1
    p = padding.pad_to(x, 8)
    assert isinstance(p, np.ndarray) and p.shape == (2, 8, 3)
    np.testing.assert_array_equal(p[:, :5], x)
    assert not p[:, 5:].any()
    pj = padding.pad_to(jnp.asarray(x), 7, axis=1)
    assert pj.shape == (2, 7, 3) and not np.asarray(pj[:, 5:]).any()
    assert padding.pad_to(x, 5) is x
    t = np.ones((2, 5), np.float32)  # per-token timesteps: tokens on axis 1 as well
    assert padding.pad_to(t, 8).shape == (2, 8)
    with pytest.raises(ValueError, match="cannot pad 5 entries on axis 1 to 4"):
        padding.pad_to(x, 4)


@pytest.fixture(scope="module")
def model():
    return ToyModel(ToyConfig(), nnx.Rngs(0))


def test_pad_stream_follows_the_runners_rule(model):
    x = np.random.default_rng(0).standard_normal((2, 13, 8)).astype(np.float32)
    sp = Runner(model, make_mesh(4), Config(), mode="sp")  # CPU: the JAX rings, 2P = 8
    padded, rows = sp.pad_stream(x, "image tokens")
    assert rows == 16 and padded.shape == (2, 16, 8)
    np.testing.assert_array_equal(padded[:, :13], x)
    assert not padded[:, 13:].any()
    kernel = Runner(model, make_mesh(4), Config(sp_kernel="pallas"), mode="sp")  # + f32 sublane tiles: 64
    assert kernel.pad_stream(x)[1] == 64
    tp = Runner(model, make_mesh(4), Config(), mode="tp")
    same, rows = tp.pad_stream(x)
    assert same is x and rows == 13
    strict = Runner(model, make_mesh(4), Config(), mode="sp", pad=False)
    with pytest.raises(ValueError, match="SP cannot split 13 image tokens over tp=4"):
        strict.pad_stream(x, "image tokens")


def test_pad_key_mask_over_streams(model):
    sp = Runner(model, make_mesh(4), Config(), mode="sp")
    mask = sp.pad_key_mask((5, 8), (13, 16))
    expect = np.array([1] * 5 + [0] * 3 + [1] * 13 + [0] * 3, bool)
    np.testing.assert_array_equal(mask, expect)
    assert sp.pad_key_mask((5, 8), (13, 16)) is mask  # made once per geometry
    assert sp.pad_key_mask((8, 8), (16, 16)) is None  # nothing padded
    sp.mask_pad_keys = False
    assert sp.pad_key_mask((5, 8)) is None
