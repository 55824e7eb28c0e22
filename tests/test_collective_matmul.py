"""The JAX rings against numpy on 2 and 4 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from difflet_tpu import collective_matmul as cm
from difflet_tpu.mesh import TP, make_mesh
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


def test_nn_epilogue_is_a_kernel_epilogue_for_bias_and_gelu_tanh_only():
    from flax import nnx

    from difflet_tpu import nn
    from difflet_tpu.layers.feedforward import ACTIVATIONS, gelu_tanh

    lin = nn.Linear(8, 16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert isinstance(nn.epilogue(lin), cm.Epilogue) and nn.epilogue(lin).activation is None
    e = nn.epilogue(lin, gelu_tanh)
    assert isinstance(e, cm.Epilogue) and e.activation == "gelu_tanh"
    assert nn.epilogue(lin, ACTIVATIONS["gelu-approximate"]).activation == "gelu_tanh"
    for other in (ACTIVATIONS["gelu"], ACTIVATIONS["linear-silu"]):  # applied after the kernel, as before
        assert not isinstance(nn.epilogue(lin, other), cm.Epilogue)
    assert nn.epilogue(nn.Linear(8, 16, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0))) is None


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
