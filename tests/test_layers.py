"""The shared layers (difflet_tpu/layers) against independent numpy references,
and their TP / SP forms against one device."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from difflet_tpu import layers, testing
from difflet_tpu.layers.rope import rope_permutation
from difflet_tpu.layers import mmdit
from difflet_tpu.parallel.mesh import TP, make_mesh
from difflet_tpu.parallel.modes import COLUMN, ROW, Parallel
from difflet_tpu.testing import rel_l2


def f64(x):
    return np.asarray(x, np.float64)


def ulps(a, b):
    return np.abs(np.asarray(a, np.float32).view(np.int32).astype(np.int64) - np.asarray(b, np.float32).view(np.int32))


def run(module, fn, mode, *inputs, tp=2, plan=None, rows_axis=None):
    """`fn(module, par, *inputs)` on one device (mode "single") or over `tp` devices, parameters
    placed by `plan`; under SP the inputs with `rows_axis` are sharded on it (and the output)."""
    if mode == "single":
        step, state = testing.compile_step(module, fn, Parallel())
        return step(state, *inputs)
    mesh = make_mesh(tp)
    par = Parallel(mode=mode, size=tp, interpret=True)
    rows = P(*([None] * rows_axis + [TP])) if mode != "tp" and rows_axis is not None else P()
    step, state = testing.compile_step(module, fn, par, mesh, plan or {}, in_specs=tuple(rows for _ in inputs),
                                       out_specs=rows)
    return step(state, *inputs)


# --------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------

def _exact_freqs(half):
    e = (np.float32(-math.log(10000.0)) * np.arange(half, dtype=np.float32)) / np.float32(half)
    return np.exp(e.astype(np.float64)).astype(np.float32)  # correctly rounded


def test_timestep_frequencies_are_torch_bits():
    """The 128 frequencies of the 256-channel sinusoid are torch's float32 exp: within an
    ulp of the correctly rounded values, one ulp above them at exactly i = 12 and 106
    (this pins every bit); other sizes are correctly rounded."""
    table = layers.timestep_frequencies(128)
    diff = table.view(np.int32).astype(np.int64) - _exact_freqs(128).view(np.int32)
    assert list(np.nonzero(diff)[0]) == [12, 106] and set(diff[[12, 106]]) == {1}
    np.testing.assert_array_equal(layers.timestep_frequencies(8), _exact_freqs(8))


def test_timestep_embedding_policy():
    """float32 angles t * f (as torch), cos / sin within an ulp of the correctly rounded
    float64 values; any leading shape; float32 whatever the input dtype."""
    t = np.array([[0.0, 1.0, 500.0], [750.0, 1000.0, 6000.0]], np.float32)
    got = np.asarray(layers.get_timestep_embedding(t))
    assert got.shape == (2, 3, 256) and got.dtype == np.float32
    ang = (t[..., None] * layers.timestep_frequencies(128)).astype(np.float32).astype(np.float64)
    want = np.concatenate([np.cos(ang), np.sin(ang)], -1).astype(np.float32)
    assert ulps(got, want).max() <= 1
    with jax.enable_x64(True):  # float64 timesteps: still the float32 sinusoid, as diffusers' `.float()`
        assert jax.jit(layers.get_timestep_embedding)(jnp.asarray(t, jnp.float64)).dtype == jnp.float32


def test_timestep_embedding_and_text_projection():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    te = layers.TimestepEmbedding(16, 8, dtype=jnp.float32, rngs=nnx.Rngs(0))
    silu = lambda a: a / (1 + np.exp(-a))
    lin = lambda l, a: a @ f64(l.kernel[...]) + f64(l.bias[...])
    np.testing.assert_allclose(te(x), lin(te.linear_2, silu(lin(te.linear_1, f64(x)))), rtol=1e-5, atol=1e-6)
    gelu_tanh = lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))
    for act_fn, act in (("gelu_tanh", gelu_tanh), ("silu", silu)):
        proj = layers.PixArtAlphaTextProjection(16, 8, act_fn=act_fn, dtype=jnp.float32, rngs=nnx.Rngs(1))
        np.testing.assert_allclose(proj(x), lin(proj.linear_2, act(lin(proj.linear_1, f64(x)))), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_text_projection_parallel(mode):
    """`parallel`: linear_1 column, linear_2 row on replicated rows: a psum in every mode."""
    proj = layers.PixArtAlphaTextProjection(16, 8, dtype=jnp.float32, rngs=nnx.Rngs(1))
    x = np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32)
    plan = {"linear_1": COLUMN, "linear_2": ROW}
    got = run(proj, lambda m, par, a: m.parallel(par, a), mode, x, plan=plan)
    assert rel_l2(got, proj(x)) <= 1e-6


# --------------------------------------------------------------------------
# Normalization
# --------------------------------------------------------------------------

def test_layer_norm_and_rms_norm():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 5, 32)) * 3 + 1).astype(np.float32)
    scale, bias = rng.standard_normal(32).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    xd = f64(x)
    ln = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-5) * scale + bias
    np.testing.assert_allclose(layers.layer_norm(x, scale, bias, 1e-5), ln, rtol=1e-5, atol=1e-5)
    affine = layers.LayerNorm(32, 1e-5, dtype=jnp.float32)
    affine.scale[...], affine.bias[...] = scale, bias
    np.testing.assert_allclose(affine(x), ln, rtol=1e-5, atol=1e-5)
    rms = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(layers.rms_norm(x, scale, 1e-6), rms, rtol=1e-5, atol=1e-5)
    bf = layers.rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(scale))
    assert bf.dtype == jnp.bfloat16 and rel_l2(bf.astype(jnp.float32), rms) < 1e-2  # float32 statistics
    norm = layers.RMSNorm(32, 1e-6, elementwise_affine=False, dtype=jnp.float32)
    np.testing.assert_allclose(norm(x), rms / scale, rtol=1e-5, atol=1e-5)


def test_layer_norm_with_given_moments():
    """`row_moments` are a LayerNorm's float32 (E[x], E[x^2]) (numpy float64), and
    `layer_norm` / `modulate` with them given (as a scan carries them) are bit-equal to
    reducing x themselves, bf16 under jit too; another x's moments give another result."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 7, 256)) * 2 + 0.5).astype(np.float32)
    shift, scale = (rng.standard_normal((2, 1, 256)).astype(np.float32) for _ in range(2))
    mean, mean_sq = layers.row_moments(x)
    np.testing.assert_allclose(mean, f64(x).mean(-1, keepdims=True), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mean_sq, (f64(x) ** 2).mean(-1, keepdims=True), rtol=1e-6)
    for xs in (x, jnp.asarray(x, jnp.bfloat16)):
        # the moments reduced in the jitted function that writes x, as the scan carries them
        given = jax.jit(lambda a: layers.modulate(a, shift, scale, 1e-6, layers.row_moments(a)))(xs)
        np.testing.assert_array_equal(np.asarray(given, np.float32),
                                      np.asarray(jax.jit(lambda a: layers.modulate(a, shift, scale, 1e-6))(xs),
                                                 np.float32))
    np.testing.assert_array_equal(layers.layer_norm(x, eps=1e-5, moments=(mean, mean_sq)),
                                  layers.layer_norm(x, eps=1e-5))
    xd = f64(x)
    ln = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(layers.layer_norm(x, eps=1e-5, moments=(mean, mean_sq)), ln, rtol=1e-4, atol=1e-4)
    assert rel_l2(layers.layer_norm(x, eps=1e-5, moments=layers.row_moments(x * 2 + 1)), ln) > 0.1


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_rms_norm_rope_is_normalise_then_rope(split, D):
    """`rms_norm_rope` (the norm's factors applied around the rotation matmul of the raw
    x) gives the bits of `rms_norm_across_heads` then `apply_rotary_emb` in bf16 under
    jit and in float32, and matches numpy float64; a wrong weight permutation fails."""
    rng = np.random.default_rng(7)
    H, S, eps = 3, 24, 1e-6
    x = (rng.standard_normal((1, S, H * D)) * 4).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(H * D)).astype(np.float32)
    ang = rng.uniform(0, 6, (S, D // 2)).astype(np.float32)
    ang = np.concatenate([ang, ang], -1) if split else np.repeat(ang, 2, -1)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    par = Parallel()

    def fused(x, w):
        r = layers.rms_scale_across_heads(par, jnp.sum(jnp.square(x.astype(jnp.float32)), -1, keepdims=True),
                                          eps, H * D)[..., None]
        return layers.rms_norm_rope(layers.split_heads(x, D), r, w.reshape(H, D), cos, sin, split)

    def plain(x, w):
        ssq = jnp.sum(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
        xn = layers.rms_norm_across_heads(par, x, w, eps, H * D, sum_sq=ssq)
        return layers.apply_rotary_emb(layers.split_heads(xn, D), cos, sin, split)

    for dt in (jnp.bfloat16, jnp.float32):
        xs, ws = jnp.asarray(x, dt), jnp.asarray(w, dt)
        a, b = jax.jit(fused)(xs, ws), jax.jit(plain)(xs, ws)
        assert a.dtype == dt
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # numpy float64: normalise, then rotate
    xd = f64(x)
    xn = (xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + eps) * f64(w)).reshape(1, S, H, D)
    if split:
        rot = np.concatenate([-xn[..., D // 2:], xn[..., :D // 2]], -1)
    else:
        rot = np.stack([-xn[..., 1::2], xn[..., 0::2]], -1).reshape(xn.shape)
    ref = xn * cos + rot * sin
    np.testing.assert_allclose(np.asarray(jax.jit(fused)(x, w)), ref, rtol=1e-5, atol=1e-5)
    got = np.asarray(jax.jit(fused)(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)), np.float32)
    assert rel_l2(got, ref) < 1e-2
    # mechanism removed: the weight not permuted with the rotation
    r = jnp.asarray(1 / np.sqrt((xd ** 2).mean(-1, keepdims=True)[..., None] + eps), jnp.float32)
    xb = layers.split_heads(jnp.asarray(x, jnp.bfloat16), D)
    bad = layers.rms_norm_rope(xb, r, jnp.asarray(w, jnp.bfloat16).reshape(H, D)[:, ::-1], cos, sin, split)
    assert rel_l2(np.asarray(bad, np.float32), ref) > 1e-2


def _rms_norm_previous(x, scale, eps):
    """`layers.rms_norm` before its mean of squares read x through an optimization barrier."""
    xf = jnp.asarray(x).astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * jnp.asarray(scale).astype(jnp.float32)
    return y.astype(x.dtype)


def test_rms_norm_then_rope_bit_parity_and_float64():
    """The per-head q/k path (FLUX's `JointAttention._norm` then split-halves RoPE), jitted
    as the model runs it: float32 and bfloat16 bit-identical to the previous layers
    (elementwise rotation, no barrier), float32 close to a float64 numpy reference."""
    rng = np.random.default_rng(2)
    S, H, D = 11, 3, 128
    x = (rng.standard_normal((1, S, H * D)) * rng.uniform(0.1, 4.0, H * D)).astype(np.float32)
    scale = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    ang = rng.uniform(-30, 30, (S, D // 2))
    cos = np.concatenate([np.cos(ang)] * 2, -1).astype(np.float32)
    sin = np.concatenate([np.sin(ang)] * 2, -1).astype(np.float32)

    def new(t, w):
        return layers.apply_rotary_emb(layers.rms_norm(layers.split_heads(t, D), w, 1e-6),
                                       cos[:, None], sin[:, None], True)

    def old(t, w):
        return _rope_previous(_rms_norm_previous(layers.split_heads(t, D), w, 1e-6), cos[:, None], sin[:, None], True)

    for dtype in (jnp.float32, jnp.bfloat16):
        xt, wt = jnp.asarray(x, dtype), jnp.asarray(scale, dtype)
        got, want = new(xt, wt), old(xt, wt)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        got, want = (np.asarray(jax.jit(fn)(xt, wt), np.float32) for fn in (new, old))
        if dtype == jnp.float32:
            np.testing.assert_array_equal(got, want)
        else:  # jitted, XLA may sum the float32 squares in another order: a bf16 rounding flips rarely
            diff = got != want
            assert diff.mean() < 1e-3
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=0)
    xd = f64(x).reshape(1, S, H, D)
    nd = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6) * f64(scale)
    ref = nd * f64(cos)[:, None] + np.concatenate([-nd[..., D // 2:], nd[..., :D // 2]], -1) * f64(sin)[:, None]
    np.testing.assert_allclose(np.asarray(jax.jit(new)(jnp.asarray(x), jnp.asarray(scale)), np.float64), ref,
                               rtol=1e-5, atol=1e-5)


def test_heads_out_and_head_major_attention_match_float64_and_the_row_major_path():
    """`HeadsOut` (the per-head q/k norm, split-halves RoPE and q's 1/sqrt(D), head-major:
    what the all-gather kernel writes under SP) against float64 numpy; attention on its
    head-major, pre-scaled q/k/v equals attention on the row-major path's, in float64
    (the float64 reference softmax) and float32 (XLA's attention)."""
    rng = np.random.default_rng(5)
    B, S, H, D = 2, 12, 3, 16
    x = [rng.standard_normal((B, S, H * D)) for _ in range(3)]
    w = [1 + 0.2 * rng.standard_normal(D) for _ in range(2)]
    ang = rng.uniform(-3, 3, (S, D // 2))
    cos, sin = (np.concatenate([t(ang)] * 2, -1) for t in (np.cos, np.sin))
    for dtype, tol in ((jnp.float64, 1e-12), (jnp.float32, 1e-5)):
        with jax.enable_x64(dtype == jnp.float64):
            t = lambda a: jnp.asarray(a, dtype)
            rope = (t(cos), t(sin), True)
            hq = layers.attention.HeadsOut(D, t(w[0]), 1e-6, rope, scale_q=True)
            hk = layers.attention.HeadsOut(D, t(w[1]), 1e-6, rope)
            q, k, v = hq(t(x[0])), hk(t(x[1])), layers.attention.HeadsOut(D)(t(x[2]))
            assert q.shape == (B, H, S, D) and q.dtype == dtype

            def ref(a, wt, scale=1.0):
                a = a.reshape(B, S, H, D)
                a = a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * wt
                a = a * cos[:, None] + np.concatenate([-a[..., D // 2:], a[..., :D // 2]], -1) * sin[:, None]
                return np.swapaxes(a * scale, 1, 2)

            np.testing.assert_allclose(np.asarray(q, np.float64), ref(x[0], w[0], D ** -0.5), rtol=tol, atol=tol)
            np.testing.assert_allclose(np.asarray(k, np.float64), ref(x[1], w[1]), rtol=tol, atol=tol)
            np.testing.assert_array_equal(np.asarray(v), np.swapaxes(np.asarray(t(x[2])).reshape(B, S, H, D), 1, 2))
            mask = jnp.asarray(np.arange(S) < S - 2)
            got = layers.attend(Parallel(), q, k, v, mask, head_major=True, q_scaled=True)
            row = lambda a: jnp.swapaxes(a, 1, 2)
            want = layers.attend(Parallel(), row(hq.__class__(D, hq.norm, 1e-6, rope)(t(x[0]))), row(k), row(v), mask)
            assert got.shape == (B, S, H, D)
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                       rtol=10 * tol, atol=10 * tol)


@pytest.mark.parametrize("C", [64, 1024])
def test_rms_norm_across_heads_sharded_float64(C):
    """Channels sharded over 2 and 4 ranks (TP and SP): the sum of squares is summed over
    ranks, so every slice equals the full-width numpy norm; normalising each slice
    alone (no reduction) does not. C=1024: 128-channel blocks per rank (1 to 4);
    given per-rank sums of squares, the same."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 24, C)) * rng.uniform(0.1, 3.0, C)
        scale = 1 + 0.1 * rng.standard_normal(C)
        ref = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale
        one = layers.rms_norm_across_heads(Parallel(), jnp.asarray(x), jnp.asarray(scale), 1e-6, C)
        assert np.abs(np.asarray(one) - ref).max() < 1e-13
        for tp in (2, 4):
            for par, ok in ((Parallel(mode="tp", size=tp), True), (Parallel(mode="sp", size=tp), True),
                            (Parallel(), False)):  # Parallel(): no reduction over ranks
                for given in (False, True):
                    def norm(a, s, par=par, given=given):
                        ss = jnp.sum(a * a, axis=-1, keepdims=True) if given else None
                        return layers.rms_norm_across_heads(par, a, s, 1e-6, C, sum_sq=ss)

                    fn = jax.shard_map(norm, mesh=make_mesh(tp), in_specs=(P(None, None, TP), P(TP)),
                                       out_specs=P(None, None, TP), check_vma=False)
                    err = np.abs(np.asarray(fn(jnp.asarray(x), jnp.asarray(scale))) - ref).max()
                    assert (err < 1e-13) if ok else (err > 1e-2), (tp, par.mode, given, err)


def test_rms_norm_across_heads_parity_with_previous_layers():
    """float32: within 1e-6 relative of the previous flat form (mean of squares over the
    flat channels, no barrier), jitted, sharded over 4 ranks; bfloat16 within a bf16
    rounding of it on rare elements (the float32 sum of squares may be added in
    another order)."""
    rng = np.random.default_rng(3)
    C = 2048
    x = (rng.standard_normal((1, 40, C)) * rng.uniform(0.1, 4.0, C)).astype(np.float32)
    scale = (1 + 0.2 * rng.standard_normal(C)).astype(np.float32)

    def previous(par, a, s):
        af = a.astype(jnp.float32)
        ss = par.sum_over_ranks(jnp.sum(af * af, axis=-1, keepdims=True))
        return (af * jax.lax.rsqrt(ss / C + 1e-6) * s.astype(jnp.float32)).astype(a.dtype)

    par = Parallel(mode="sp", size=4)
    outs = {}
    for name, fn in (("new", lambda a, s: layers.rms_norm_across_heads(par, a, s, 1e-6, C)),
                     ("old", lambda a, s: previous(par, a, s))):
        sm = jax.shard_map(fn, mesh=make_mesh(4), in_specs=(P(None, None, TP), P(TP)),
                           out_specs=P(None, None, TP), check_vma=False)
        outs[name] = {dt: np.asarray(jax.jit(sm)(jnp.asarray(x, dt), jnp.asarray(scale, dt)), np.float32)
                      for dt in (jnp.float32, jnp.bfloat16)}
    np.testing.assert_allclose(outs["new"][jnp.float32], outs["old"][jnp.float32], rtol=1e-6, atol=1e-7)
    new, old = outs["new"][jnp.bfloat16], outs["old"][jnp.bfloat16]
    assert (new != old).mean() < 1e-3
    np.testing.assert_allclose(new, old, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("mode", ["single", "tp"])
def test_adaln_modulate_and_token_replace(mode):
    """AdaLN chunks = split(linear(silu(emb))) (column-parallel, gathered); modulate =
    LayerNorm(x) * (1 + scale) + shift; token_replace rows take the second embedding's."""
    ada = layers.AdaLN(16, 3, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    emb, emb2 = rng.standard_normal((2, 2, 16)).astype(np.float32)
    rows = np.array([True, True, False, False, False])
    w, b = f64(ada.linear.kernel[...]), f64(ada.linear.bias[...])
    chunks = lambda e: np.split((f64(e) / (1 + np.exp(-f64(e)))) @ w + b, 3, axis=-1)
    got = run(ada, lambda m, par, e, e2, r: (m(par, e), m(par, e, (r, e2))), mode, emb, emb2, rows,
              plan={"linear": COLUMN})
    for g, c in zip(got[0], chunks(emb)):
        assert g.shape == (2, 1, 16)
        np.testing.assert_allclose(g[:, 0], c, rtol=1e-5, atol=1e-5)
    for g, c, c2 in zip(got[1], chunks(emb), chunks(emb2)):
        assert g.shape == (2, 5, 16)
        np.testing.assert_allclose(g, np.where(rows[None, :, None], c2[:, None], c[:, None]), rtol=1e-5, atol=1e-5)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    shift, scale = got[0][0], got[0][1]
    xd = f64(x)
    want = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-6) * (1 + f64(scale)) \
        + f64(shift)
    np.testing.assert_allclose(layers.modulate(x, shift, scale), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------

def _rope_numpy(x, angles):
    """Interleaved pairs (2i, 2i+1) rotated by `angles` [S, D/2], as complex numbers."""
    z = x[..., 0::2] + 1j * x[..., 1::2]
    r = z * np.exp(1j * angles)[None, :, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = r.real, r.imag
    return out


def test_rotary_emb_interleaved_and_split_halves():
    """Interleaved RoPE equals the complex rotation; split halves on q permuted per head
    ([0, 2, ..., 1, 3, ...]) with the permuted tables is the same rotation, permuted."""
    rng = np.random.default_rng(0)
    S, H, D = 7, 3, 16
    x = rng.standard_normal((2, S, H, D)).astype(np.float32)
    ang = rng.uniform(-30, 30, (S, D // 2))
    cos, sin = np.repeat(np.cos(ang), 2, -1).astype(np.float32), np.repeat(np.sin(ang), 2, -1).astype(np.float32)
    want = _rope_numpy(f64(x), ang)
    inter = layers.apply_rotary_emb(x, cos[:, None], sin[:, None], split=False)
    np.testing.assert_allclose(inter, want, rtol=1e-5, atol=1e-5)
    perm = rope_permutation(D)
    split = layers.apply_rotary_emb(x[..., perm], cos[:, None, perm], sin[:, None, perm], split=True)
    np.testing.assert_allclose(split, want[..., perm], rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(split) - np.asarray(inter)[..., perm]).max() < 1e-6  # same products and sums
    bf = layers.apply_rotary_emb(jnp.asarray(x, jnp.bfloat16), cos[:, None], sin[:, None], split=False)
    assert bf.dtype == jnp.bfloat16


def _rope_previous(x, cos, sin, split):
    """The elementwise RoPE the layers computed before the matmul rotation (slices and a
    concatenate of the halves / a stacked pair swap), for bit parity."""
    xf, cos, sin = (jnp.asarray(t).astype(jnp.float32) for t in (x, cos, sin))
    if split:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:
        xr = xf.reshape(*xf.shape[:-1], -1, 2)
        out = xf * cos + jnp.stack([-xr[..., 1], xr[..., 0]], axis=-1).reshape(xf.shape) * sin
    return out.astype(x.dtype)


@pytest.mark.parametrize("split,D", [(True, 128), (False, 128), (True, 512), (False, 512)])
def test_rotary_emb_matmul_rotation_is_bit_exact(split, D):
    """bfloat16 q/k rotate by a 0/+-1 matmul accumulated in float32 (wide interleaved rows
    per 128-channel block, wide split halves elementwise): bit-identical to the
    elementwise form (float32 as well, which rotates elementwise), close to float64
    numpy, with full- or half-width tables."""
    rng = np.random.default_rng(1)
    S, H = 9, 4
    x = rng.standard_normal((2, S, H, D)).astype(np.float32) * 3
    ang = rng.uniform(-30, 30, (S, D // 2))
    if split:
        cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
    else:
        cos, sin = np.repeat(np.cos(ang), 2, -1), np.repeat(np.sin(ang), 2, -1)
    cos, sin = cos.astype(np.float32), sin.astype(np.float32)
    half_cos, half_sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    # float64 reference: x cos + rot(x) sin with rot from the halves / pairs
    xd = f64(x)
    if split:
        rot = np.concatenate([-xd[..., D // 2:], xd[..., :D // 2]], -1)
    else:
        rot = np.stack([-xd[..., 1::2], xd[..., 0::2]], -1).reshape(xd.shape)
    want = xd * f64(cos)[:, None] + rot * f64(sin)[:, None]
    r = layers.rope.rotation_matrix(D, split).astype(np.float64)
    np.testing.assert_array_equal(xd @ r, rot)  # a signed permutation: one +-1 per row and column
    assert (np.abs(r).sum(0) == 1).all() and (np.abs(r).sum(1) == 1).all()
    for dtype in (jnp.float32, jnp.bfloat16):
        xt = jnp.asarray(x, dtype)
        got = layers.apply_rotary_emb(xt, cos[:, None], sin[:, None], split)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(_rope_previous(xt, cos[:, None], sin[:, None], split), np.float32))
        got_half = layers.apply_rotary_emb(xt, half_cos[:, None], half_sin[:, None], split)
        np.testing.assert_array_equal(np.asarray(got_half, np.float32), np.asarray(got, np.float32))
        if dtype == jnp.float32:
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-5)
        else:  # float32 math on the bf16 values, one rounding at the end
            ref = f64(np.asarray(xt, np.float32))
            rot_b = np.concatenate([-ref[..., D // 2:], ref[..., :D // 2]], -1) if split else \
                np.stack([-ref[..., 1::2], ref[..., 0::2]], -1).reshape(ref.shape)
            want_b = ref * f64(cos)[:, None] + rot_b * f64(sin)[:, None]
            np.testing.assert_allclose(np.asarray(got, np.float64), want_b, rtol=1e-2, atol=1e-2)


def _attention_numpy(q, k, v, mask=None, bias=None):
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias[:, None]
    if mask is not None:
        s = np.where(mask[:, None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def test_attend_mask_bias_and_float64():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 6, 2, 8)) for _ in range(3))
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]], bool)
    bias = np.where(mask, 0.0, -10000.0)[:, None, :]
    par = Parallel()
    want = _attention_numpy(q, k, v, mask)
    np.testing.assert_allclose(layers.attend(par, *(a.astype(np.float32) for a in (q, k, v)), mask), want,
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(layers.attend(par, *(a.astype(np.float32) for a in (q, k, v)),
                                             bias=bias.astype(np.float32)),
                               _attention_numpy(q, k, v, bias=bias), rtol=2e-5, atol=2e-5)
    with jax.enable_x64(True):  # float64 runs a float64 softmax (XLA's takes it in float32)
        for m, b in ((mask, None), (None, bias)):
            got = layers.attend(par, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), m, b)
            assert got.dtype == jnp.float64
            assert np.abs(np.asarray(got) - _attention_numpy(q, k, v, m, b)).max() < 1e-12


# --------------------------------------------------------------------------
# Feed-forward
# --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_feedforward_parallel(mode):
    """net.0.proj column-parallel with the activation in the epilogue, net.2 row-parallel:
    TP and SP on 2 devices equal one device, which equals numpy."""
    ff = layers.FeedForward(16, dim_out=12, mult=2, activation_fn="gelu", dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    lin = lambda l, a: a @ f64(l.kernel[...]) + f64(l.bias[...])
    h = lin(ff.net["0"]["proj"], f64(x))
    want = lin(ff.net["2"], 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2))))
    one = run(ff, lambda m, par, a: m(par, a), "single", x)
    assert rel_l2(one, want) <= 1e-6
    plan = {"net.0.proj": COLUMN, "net.2": ROW}
    assert rel_l2(run(ff, lambda m, par, a: m(par, a), mode, x, plan=plan, rows_axis=1), one) <= 1e-6
    with pytest.raises(ValueError, match="activation_fn"):
        layers.FeedForward(16, activation_fn="geglu", dtype=jnp.float32, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------
# MMDiT blocks
# --------------------------------------------------------------------------

def _double(context_first):
    return mmdit.DoubleStreamBlock(32, 4, 8, 64, context_first=context_first, dtype=jnp.float32, rngs=nnx.Rngs(0))


def _double_inputs():
    rng = np.random.default_rng(0)
    img, txt = rng.standard_normal((2, 8, 32)).astype(np.float32), rng.standard_normal((2, 4, 32)).astype(np.float32)
    temb = rng.standard_normal((2, 32)).astype(np.float32)
    ang = rng.uniform(-3, 3, (12, 4))
    cos, sin = (np.repeat(f(ang), 2, -1).astype(np.float32) for f in (np.cos, np.sin))
    return img, txt, temb, cos, sin


def _double_fn(block, par, img, txt, temb, cos, sin):
    return block(par, img, txt, temb, (cos, sin, False), None)


def test_double_block_stream_order_does_not_change_the_output():
    """[text | image] (FLUX) and [image | text] (HunyuanVideo) joint sequences with the
    same weights and per-row tables: attention is over the same keys, so the outputs agree."""
    img, txt, temb, cos, sin = _double_inputs()  # tables: [text (4) | image (8)] rows
    a = _double_fn(_double(True), Parallel(), img, txt, temb, cos, sin)
    cos_b, sin_b = np.concatenate([cos[4:], cos[:4]]), np.concatenate([sin[4:], sin[:4]])  # [image | text]
    b = _double_fn(_double(False), Parallel(), img, txt, temb, cos_b, sin_b)
    for x, y in zip(a, b):
        assert rel_l2(x, y) <= 1e-6


@pytest.mark.parametrize("context_first", [True, False])
@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_double_block_parallel(mode, context_first):
    """TP / SP on 2 devices equal one device, for both stream orders (under SP attention
    runs once per stream's queries, each with its rows of the joint tables)."""
    block = _double(context_first)
    inputs = _double_inputs()
    one = run(block, _double_fn, "single", *inputs)
    mesh = make_mesh(2)
    par = Parallel(mode=mode, size=2, interpret=True)
    rows = P(None, TP) if mode == "sp" else P()
    step, state = testing.compile_step(block, _double_fn, par, mesh, mmdit_plan("transformer_blocks"),
                                       in_specs=(rows, rows, P(), P(), P()), out_specs=(rows, rows))
    for got, want in zip(step(state, *inputs), one):
        assert rel_l2(got, want) <= 1e-6


def mmdit_plan(prefix):
    """The MMDiT PLAN's rows of one block kind, relative to the block."""
    return {k[len(prefix) + 1:]: v for k, v in mmdit.PLAN.items() if k.startswith(prefix + ".")}


class _Single(mmdit.SingleStreamBlock):
    def __init__(self, rngs):
        self.eps, self.clip_fp16 = 1e-6, True
        self.norm = layers.AdaLN(32, 3, dtype=jnp.float32, rngs=rngs)
        self.proj_mlp = mmdit.nn.Linear(32, 64, rngs=rngs)
        self.proj_out = mmdit.PackedProjOut(32, 64, 32, dtype=jnp.float32, rngs=rngs)
        self.attn = mmdit.JointAttention(32, 4, 8, pre_only=True, dtype=jnp.float32, rngs=rngs)


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_single_block_parallel_and_packed_proj_out(mode):
    """TP / SP on 2 devices equal one device; proj_out's two kernels are the packed
    Linear over cat([attn, mlp]) (numpy)."""
    block = _Single(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x, temb = rng.standard_normal((2, 12, 32)).astype(np.float32), rng.standard_normal((2, 32)).astype(np.float32)
    ang = rng.uniform(-3, 3, (12, 4))
    cos, sin = (np.repeat(f(ang), 2, -1).astype(np.float32) for f in (np.cos, np.sin))
    fn = lambda m, par, h, t, c, s: m(par, h, t, (c, s, False), None)
    one = run(block, fn, "single", x, temb, cos, sin)
    mesh = make_mesh(2)
    par = Parallel(mode=mode, size=2, interpret=True)
    rows = P(None, TP) if mode == "sp" else P()
    step, state = testing.compile_step(block, fn, par, mesh, mmdit_plan("single_transformer_blocks"),
                                       in_specs=(rows, P(), P(), P()), out_specs=rows)
    assert rel_l2(step(state, x, temb, cos, sin), one) <= 1e-6

    po = block.proj_out
    a, m = rng.standard_normal((3, 32)).astype(np.float32), rng.standard_normal((3, 64)).astype(np.float32)
    packed = np.concatenate([f64(po.attn.kernel[...]), f64(po.mlp.kernel[...])])  # torch's weight.T
    want = np.concatenate([a, m], -1) @ packed + f64(po.mlp.bias[...])
    np.testing.assert_allclose(po(Parallel(), a, m), want, rtol=1e-5, atol=1e-5)
