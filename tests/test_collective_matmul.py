"""The JAX rings against numpy on 2 and 4 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from difflet_tpu.parallel import collective_matmul as cm
from difflet_tpu.parallel.mesh import TP, make_mesh
from difflet_tpu.testing import rel_l2


rel = rel_l2


def run_ag(mesh, x, ws, batch, **kw):
    row = P(None, TP, None) if batch else P(TP, None)
    col = P(None, None, TP) if batch else P(None, TP)

    def f(x, *ws):
        return tuple(cm.all_gather_matmul(x, ws, **kw))

    g = jax.shard_map(f, mesh=mesh, in_specs=(row, *[P(None, TP)] * len(ws)),
                      out_specs=tuple([col] * len(ws)), check_vma=False)
    return jax.jit(g)(x, *ws)


def run_rs(mesh, pairs, batch, **kw):
    full_col = P(None, None, TP) if batch else P(None, TP)
    out = P(None, TP, None) if batch else P(TP, None)

    def f(*flat):
        return cm.matmul_reduce_scatter(list(zip(flat[::2], flat[1::2])), **kw)

    specs = []
    for _ in pairs:
        specs += [full_col, P(TP, None)]
    g = jax.shard_map(f, mesh=mesh, in_specs=tuple(specs), out_specs=out, check_vma=False)
    return jax.jit(g)(*[a for p in pairs for a in p])


WIDTHS = {1: [32], 2: [32, 64], 3: [16, 48, 32], 4: [32, 16, 64, 48]}


@pytest.mark.parametrize("P_", [2, 4])
@pytest.mark.parametrize("nw", [1, 2, 3, 4])
@pytest.mark.parametrize("assemble", ["concat", "dus"])
@pytest.mark.parametrize("batch", [False, True])
def test_all_gather_matmul_float32(P_, nw, assemble, batch):
    rng = np.random.default_rng(nw * 10 + P_)
    S, K = 8 * P_, 24
    x = rng.standard_normal((2, S, K) if batch else (S, K)).astype(np.float32)
    ws = [rng.standard_normal((K, n * P_ // 4 * 2)).astype(np.float32) for n in WIDTHS[nw]]
    outs = run_ag(make_mesh(P_), x, ws, batch, assemble=assemble)
    for o, w in zip(outs, ws):
        assert o.shape == x.shape[:-1] + (w.shape[1],)
        assert rel(o, x.astype(np.float64) @ w) <= 1e-5


@pytest.mark.parametrize("P_", [2, 4])
@pytest.mark.parametrize("npairs", [1, 2])
@pytest.mark.parametrize("batch", [False, True])
def test_matmul_reduce_scatter_float32(P_, npairs, batch):
    rng = np.random.default_rng(npairs * 10 + P_)
    S, N = 8 * P_, 40
    Ks = [16, 32][:npairs]
    pairs = [(rng.standard_normal((2, S, k) if batch else (S, k)).astype(np.float32),
              rng.standard_normal((k, N)).astype(np.float32)) for k in Ks]
    got = run_rs(make_mesh(P_), pairs, batch)
    ref = sum(x.astype(np.float64) @ w for x, w in pairs)
    assert got.shape == ref.shape
    assert rel(got, ref) <= 1e-5


@pytest.mark.parametrize("assemble", ["concat", "dus"])
def test_rings_bf16_within_rounding(assemble):
    rng = np.random.default_rng(3)
    S, K, N = 32, 64, 64
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    mesh = make_mesh(4)
    (o,) = run_ag(mesh, jnp.asarray(x, jnp.bfloat16), [jnp.asarray(w, jnp.bfloat16)], False, assemble=assemble)
    assert o.dtype == jnp.bfloat16
    ref = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) @ np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)
    assert rel(o, ref) <= 2 ** -8
    got = run_rs(mesh, [(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))], False)
    assert got.dtype == jnp.bfloat16 and rel(got, ref) <= 2 ** -7


def test_reference_paths_agree_with_numpy():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    mesh = make_mesh(4)
    (o,) = run_ag(mesh, x, [w], False, impl="xla")
    assert rel(o, x @ w) <= 1e-5
    pairs = [(rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 6)).astype(np.float32))]
    assert rel(run_rs(mesh, pairs, False, impl="xla"), pairs[0][0] @ pairs[0][1]) <= 1e-5


def test_epilogues_apply_per_chunk():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    mesh = make_mesh(4)

    def f(x, w, b):
        return cm.all_gather_matmul(x, [w], epilogues=[lambda y: jax.nn.gelu(y + b)])[0]

    g = jax.shard_map(f, mesh=mesh, in_specs=(P(TP, None), P(None, TP), P(TP)), out_specs=P(None, TP),
                      check_vma=False)
    got = jax.jit(g)(x, w, b)
    ref = jax.nn.gelu(x @ w + b)
    assert rel(got, ref) <= 1e-5


def test_epilogue_description_is_validated_and_computes_the_unfused_epilogue():
    b = jnp.arange(8, dtype=jnp.float32)
    y = jnp.linspace(-3, 3, 16 * 8, dtype=jnp.float32).reshape(16, 8)
    assert (cm.Epilogue(b, "gelu_tanh")(y) == jax.nn.gelu(y + b, approximate=True)).all()
    assert (cm.Epilogue(b)(y) == y + b).all()
    assert (cm.Epilogue(None, "gelu_tanh")(y) == jax.nn.gelu(y, approximate=True)).all()
    stack = jnp.stack([b, 2 * b, 3 * b])
    assert (cm.Epilogue(cm.LayerWeight(stack, jnp.int32(2)))(y) == y + 3 * b).all()
    with pytest.raises(ValueError, match="activation"):
        cm.Epilogue(b, "silu")
    with pytest.raises(ValueError, match="bias must be"):
        cm.Epilogue(jnp.zeros((2, 8)))


@pytest.mark.parametrize("impl,assemble", [("jax", "concat"), ("jax", "dus"), ("xla", "concat")])
def test_head_major_epilogue_follows_the_assembled_rows(impl, assemble):
    # Epilogue(heads=HeadsOut): the ring adds the bias per chunk and writes heads once the rows
    # are in global order (RoPE rows, the head-major transpose): equal to HeadsOut on x @ w + b
    from difflet_tpu.layers.attention import HeadsOut

    rng = np.random.default_rng(8)
    S, K, D, H = 32, 16, 8, 8  # 2 heads per rank on 4 ranks
    x = rng.standard_normal((2, S, K)).astype(np.float32)
    w = rng.standard_normal((K, H * D)).astype(np.float32)
    b = rng.standard_normal(H * D).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    ang = rng.uniform(-3, 3, (S, D // 2))
    cos, sin = (np.concatenate([t(ang)] * 2, -1).astype(np.float32) for t in (np.cos, np.sin))

    def f(x, w, b, nw, c, s_):
        h = HeadsOut(D, nw, 1e-6, (c, s_, True), scale_q=True)
        return cm.all_gather_matmul(x, [w], impl=impl, assemble=assemble, epilogues=[cm.Epilogue(b, None, False, h)])[0]

    g = jax.shard_map(f, mesh=make_mesh(4), in_specs=(P(None, TP, None), P(None, TP), P(TP), P(), P(), P()),
                      out_specs=P(None, TP, None, None))
    got = jax.jit(g)(x, w, b, nw, cos, sin)
    want = HeadsOut(D, jnp.asarray(nw), 1e-6, (jnp.asarray(cos), jnp.asarray(sin), True), scale_q=True)(
        jnp.asarray(x @ w + b))
    assert got.shape == (2, H, S, D)
    assert rel(got, want) <= 1e-6
    with pytest.raises(ValueError, match="heads or sums squares"):
        cm.Epilogue(jnp.asarray(b), None, True, HeadsOut(D))


def test_nn_epilogue_is_a_kernel_epilogue_for_bias_and_gelu_tanh_only():
    from flax import nnx

    from difflet_tpu.layers import nn
    from difflet_tpu.layers.feedforward import ACTIVATIONS, gelu_tanh

    lin = nn.Linear(8, 16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert isinstance(nn.epilogue(lin), cm.Epilogue) and nn.epilogue(lin).activation is None
    e = nn.epilogue(lin, gelu_tanh)
    assert isinstance(e, cm.Epilogue) and e.activation == "gelu_tanh"
    assert nn.epilogue(lin, ACTIVATIONS["gelu-approximate"]).activation == "gelu_tanh"
    for other in (ACTIVATIONS["gelu"], ACTIVATIONS["linear-silu"]):  # applied after the kernel, as before
        assert not isinstance(nn.epilogue(lin, other), cm.Epilogue)
    assert nn.epilogue(nn.Linear(8, 16, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0))) is None
    with pytest.raises(ValueError, match="no activation"):
        nn.epilogue(lin, gelu_tanh, heads=object())


def test_errors_before_compilation():
    mesh = make_mesh(4)
    x = np.zeros((12, 8), np.float32)  # 3 rows per rank: halves do not split
    w = np.zeros((8, 8), np.float32)
    with pytest.raises(ValueError, match="multiple of 2\\*P = 8"):
        run_ag(mesh, x, [w], False)
    with pytest.raises(ValueError, match="multiple of 2\\*P = 8"):
        run_rs(mesh, [(np.zeros((12, 8), np.float32), w)], False)
    with pytest.raises(ValueError, match="does not take"):
        run_ag(mesh, np.zeros((16, 8), np.float32), [np.zeros((4, 8), np.float32)], False)
    with pytest.raises(ValueError, match="impl"):
        run_ag(mesh, np.zeros((16, 8), np.float32), [w], False, impl="cuda")
    with pytest.raises(ValueError, match="assemble"):
        run_ag(mesh, np.zeros((16, 8), np.float32), [w], False, assemble="stack")


def _run_ag_ssq(mesh, x, ws, bs, ssq, batch, **kw):
    """all_gather_matmul with Epilogue(bias, None, ssq_i); ssq outputs concatenated
    over ranks on the last axis ([..., S, P]: column r is rank r's columns)."""
    row = P(None, TP, None) if batch else P(TP, None)
    col = P(None, None, TP) if batch else P(None, TP)

    def f(x, *a):
        n = len(ws)
        return tuple(cm.all_gather_matmul(x, list(a[:n]), epilogues=[cm.Epilogue(b, None, q)
                                                                     for b, q in zip(a[n:], ssq)], **kw))

    g = jax.shard_map(f, mesh=mesh, in_specs=(row, *[P(None, TP)] * len(ws), *[P(TP)] * len(bs)),
                      out_specs=tuple((col, col) if q else col for q in ssq), check_vma=False)
    return jax.jit(g)(x, *ws, *bs)


def _per_rank_ssq(y, P_):
    y = np.asarray(y, np.float64)
    return np.stack([np.sum(c * c, axis=-1) for c in np.split(y, P_, axis=-1)], axis=-1)


@pytest.mark.parametrize("P_", [1, 2, 4])
@pytest.mark.parametrize("impl,assemble", [("jax", "concat"), ("jax", "dus"), ("xla", "concat"),
                                           ("pallas", "concat")])
@pytest.mark.parametrize("batch", [False, True])
def test_sum_squares_epilogue_every_path(P_, impl, assemble, batch):
    # The ring (per chunk, assembled like the outputs), sp-xla, P == 1 and the pallas
    # dispatch's ring fallback (these shapes do not suit the kernel): each weight with
    # sum_squares returns (y, ssq), ssq [..., S, 1] float32 over this rank's columns.
    rng = np.random.default_rng(P_ * 7 + batch)
    S, K = 8 * P_, 24
    x = rng.standard_normal((2, S, K) if batch else (S, K)).astype(np.float32)
    ws = [rng.standard_normal((K, n * P_)).astype(np.float32) for n in (8, 4, 12)]
    bs = [rng.standard_normal(w.shape[1]).astype(np.float32) for w in ws]
    ssq = [True, False, True]
    outs = _run_ag_ssq(make_mesh(P_), x, ws, bs, ssq, batch, impl=impl, assemble=assemble,
                       interpret=impl == "pallas")
    for o, w, b, q in zip(outs, ws, bs, ssq):
        ref = x.astype(np.float64) @ w + b
        if not q:
            assert rel(o, ref) <= 1e-5
            continue
        y, s = o
        assert rel(y, ref) <= 1e-5
        assert s.dtype == jnp.float32 and s.shape == x.shape[:-1] + (P_,)
        np.testing.assert_allclose(np.asarray(s, np.float64), _per_rank_ssq(y, P_), rtol=1e-6)


def test_sum_squares_of_bf16_is_float32_within_rounding():
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(16), jnp.bfloat16)
    ((y, s),) = _run_ag_ssq(make_mesh(4), x, [w], [b], [True], False)
    assert y.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    # The ring squares its bf16 chunks, but XLA (here on CPU) may fuse the square into
    # the matmul and bias and drop the bf16 round trip in between (as it may for the
    # unfused norm): within two bf16 roundings (2^-7) of the rounded output's squares.
    np.testing.assert_allclose(np.asarray(s, np.float64), _per_rank_ssq(np.asarray(y, np.float32), 4), rtol=2**-7)


def test_sum_squares_epilogue_called_directly():
    y = jnp.linspace(-3, 3, 16 * 8, dtype=jnp.float32).reshape(2, 8, 8)
    b = jnp.arange(8, dtype=jnp.float32)
    out, s = cm.Epilogue(b, "gelu_tanh", sum_squares=True)(y)
    ref = jax.nn.gelu(y + b, approximate=True)
    assert (out == ref).all() and s.shape == (2, 8, 1)
    np.testing.assert_allclose(s, jnp.sum(ref * ref, axis=-1, keepdims=True), rtol=1e-6)
    assert cm.row_sum_squares(jnp.ones((3, 4), jnp.bfloat16)).dtype == jnp.float32
    if jax.config.jax_enable_x64:
        assert cm.row_sum_squares(jnp.ones((3, 4), jnp.float64)).dtype == jnp.float64


def test_nn_column_sum_squares_feeds_rms_norm_across_heads():
    # single mode: nn.column(..., sum_squares=) returns (y, ssq) and the norm given
    # ssq equals the norm computing it (the same values, bit for bit)
    from flax import nnx

    from difflet_tpu.layers import nn
    from difflet_tpu.layers.normalization import rms_norm_across_heads
    from difflet_tpu.parallel.modes import Parallel

    par = Parallel()
    lins = [nn.Linear(8, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(i), bias=i == 0) for i in range(3)]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 8)), jnp.bfloat16)
    (q, qs), (k, ks), v = nn.column(par, x, lins, sum_squares=[True, True, False])
    for y, lin in ((q, lins[0]), (k, lins[1]), (v, lins[2])):
        assert (y == lin(x)).all()
    scale = jnp.linspace(0.5, 1.5, 16, dtype=jnp.bfloat16)
    for y, s in ((q, qs), (k, ks)):
        assert s.dtype == jnp.float32 and s.shape == (2, 6, 1)
        assert (rms_norm_across_heads(par, y, scale, 1e-6, 16, sum_sq=s)
                == rms_norm_across_heads(par, y, scale, 1e-6, 16)).all()
    e = nn.epilogue(lins[2], None, sum_squares=True)  # no bias: still an Epilogue, for its ssq
    assert isinstance(e, cm.Epilogue) and e.sum_squares and e.bias is None
