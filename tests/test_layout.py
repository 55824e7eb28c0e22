import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import layers
from difflet_tpu.parallel import padding
from difflet_tpu.layers.rope import RopeLayout, heads_permutation, rope_permutation


def test_pad_and_unpad_numpy_and_jax():
    x = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
    p, n = padding.pad_tokens(x, 8, axis=1)
    assert p.shape == (2, 8, 3) and n == 3 and not p[:, 5:].any()
    np.testing.assert_array_equal(padding.unpad(p, 5, axis=1), x)
    pj, nj = padding.pad_tokens(jnp.asarray(x), 4, axis=1)
    assert pj.shape == (2, 8, 3) and nj == 3
    same, zero = padding.pad_tokens(x, 5, axis=1)
    assert same is x and zero == 0
    np.testing.assert_array_equal(padding.key_mask(5, 8), [1, 1, 1, 1, 1, 0, 0, 0])
    assert padding.key_mask(5, 8, batch=2).shape == (2, 8)


def test_permutation():
    np.testing.assert_array_equal(rope_permutation(8), [0, 2, 4, 6, 1, 3, 5, 7])
    np.testing.assert_array_equal(heads_permutation(2, 4), [0, 2, 1, 3, 4, 6, 5, 7])
    np.testing.assert_array_equal(heads_permutation(1, 6, rope_dim=4), [0, 2, 1, 3, 4, 5])
    with pytest.raises(ValueError):
        rope_permutation(5)


def _interleaved_tables(S, D, rng):
    ang = rng.uniform(-50, 50, size=(S, D // 2))
    return np.repeat(np.cos(ang), 2, axis=1), np.repeat(np.sin(ang), 2, axis=1)


def test_split_rope_gives_the_interleaved_attention_scores_float64():
    rng = np.random.default_rng(0)
    B, S, H, D, K = 2, 7, 3, 8, 5
    with jax.enable_x64(True):
        x = rng.standard_normal((B, S, K))
        wq = rng.standard_normal((K, H * D))
        wk = rng.standard_normal((K, H * D))
        bq = rng.standard_normal(H * D)
        cos, sin = _interleaved_tables(S, D, rng)
        heads = lambda t: t.reshape(B, S, H, D)
        q = heads(x @ wq + bq)
        k = heads(x @ wk)
        qi = layers.apply_rotary_emb(jnp.asarray(q), cos[:, None], sin[:, None], split=False)
        ki = layers.apply_rotary_emb(jnp.asarray(k), cos[:, None], sin[:, None], split=False)
        ref = jnp.einsum("bqhd,bkhd->bhqk", qi, ki)

        rope = RopeLayout(H, D)  # one object permutes the weights and the tables
        assert rope.qk_channels == tuple(heads_permutation(H, D))
        wq_p = np.take(wq, rope.qk_channels, axis=1)
        wk_p = np.take(wk, rope.qk_channels, axis=1)
        bq_p = np.take(bq, rope.qk_channels)
        cs, ss = rope.table(cos), rope.table(sin)
        qs = layers.apply_rotary_emb(jnp.asarray(heads(x @ wq_p + bq_p)), cs[:, None], ss[:, None], split=True)
        ks = layers.apply_rotary_emb(jnp.asarray(heads(x @ wk_p)), cs[:, None], ss[:, None], split=True)
        got = jnp.einsum("bqhd,bkhd->bhqk", qs, ks)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-12, atol=1e-12)
        # The rotated q is the permuted interleaved q, channel for channel.
        np.testing.assert_allclose(np.asarray(qs), np.asarray(qi)[..., rope_permutation(D)], atol=1e-12)
        # Without permuting the weights the scores differ: the test can fail.
        bad = jnp.einsum("bqhd,bkhd->bhqk",
                         layers.apply_rotary_emb(jnp.asarray(q), cs[:, None], ss[:, None], split=True),
                         layers.apply_rotary_emb(jnp.asarray(k), cs[:, None], ss[:, None], split=True))
        assert np.abs(np.asarray(bad) - np.asarray(ref)).max() > 1e-3


def test_interleaved_matches_diffusers_formula():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 4, 2, 6))
    cos, sin = _interleaved_tables(4, 6, rng)
    with jax.enable_x64(True):
        got = np.asarray(layers.apply_rotary_emb(jnp.asarray(x), cos[:, None], sin[:, None], split=False))
    # diffusers: x_real, x_imag = x.reshape(..., -1, 2).unbind(-1); rotated = stack([-imag, real]).flatten
    xr = x.reshape(1, 4, 2, 3, 2)
    rot = np.stack([-xr[..., 1], xr[..., 0]], axis=-1).reshape(x.shape)
    np.testing.assert_allclose(got, x * cos[:, None] + rot * sin[:, None], atol=1e-12)
