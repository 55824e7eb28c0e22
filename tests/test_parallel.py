"""One step written once runs on one device, under TP and under SP with the same numbers."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from difflet_tpu import runtime, testing
from difflet_tpu.parallel import padding
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import TP, make_mesh
from difflet_tpu.parallel.modes import SHARDED, Parallel, leaf_spec, param_specs
from difflet_tpu.testing import PLAN, ToyConfig, ToyModel, rel_l2


rel = rel_l2


def toy_step(model, par, x, kv_mask):
    return model(par, x, kv_mask)


def run(model, mesh, mode, x, kv_mask):
    par = Parallel.for_mesh(mesh, Config(), mode=mode)
    if mesh is None:
        step, state = testing.compile_step(model, toy_step, par)
        return step(state, x, kv_mask)
    rows = P(None, TP, None) if par.seq_sharded else P()
    step, state = testing.compile_step(model, toy_step, par, mesh, PLAN, in_specs=(rows, P()), out_specs=rows)
    return step(state, x, kv_mask)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mode", ["tp", "sp", "sp-xla"])
def test_toy_model_parity_with_padding(tp, mode):
    c = ToyConfig()
    model = ToyModel(c, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    S = 13  # needs padding to 2*tp
    x = rng.standard_normal((2, S, c.in_channels)).astype(np.float32)
    ref = run(model, None, "single", x, None)

    xp, pad = padding.pad_tokens(x, 2 * tp)
    mask = padding.key_mask(S, S + pad, batch=2)
    got = padding.unpad(run(model, make_mesh(tp), mode, xp, mask), S)
    assert rel(got, ref) <= 1e-5
    if pad:
        # The pad-key cut matters: without the mask the padded run differs.
        bad = padding.unpad(run(model, make_mesh(tp), mode, xp, None), S)
        assert rel(bad, ref) > 1e-3


def test_plan_specs():
    model = ToyModel(ToyConfig(), nnx.Rngs(0))
    specs = param_specs(nnx.state(model), PLAN)
    assert specs["blocks"]["attn"]["to_q"]["kernel"].get_value() == P(None, None, TP)
    assert specs["blocks"]["attn"]["to_q"]["bias"].get_value() == P(None, TP)
    assert specs["blocks"]["attn"]["to_out"]["0"]["kernel"].get_value() == P(None, TP, None)
    assert specs["blocks"]["attn"]["to_out"]["0"]["bias"].get_value() == P(None, None)
    assert specs["proj_in"]["kernel"].get_value() == P()
    assert leaf_spec("a.norm_q", "scale", 1, {"a.norm_q": SHARDED}) == P(TP)


def test_place_checks_divisibility():
    model = ToyModel(ToyConfig(ffn=66), nnx.Rngs(0))
    with pytest.raises(ValueError, match="do not divide"):
        runtime.place(model, make_mesh(4), PLAN)


def test_heads_must_divide():
    with pytest.raises(ValueError, match="3 heads"):
        Parallel(mode="tp", size=2).local_heads(3)


def test_rs_auto_needs_chip_constants():
    with pytest.raises(ValueError, match="chip must be one of"):
        Parallel(mode="sp", size=4, rs_impl="auto")
    mesh = make_mesh(2)
    assert Parallel.for_mesh(mesh, Config(sp=True)).rs_impl == "jax"  # CPU: the ring
    assert Parallel.for_mesh(mesh, Config(sp=True, sp_rs_kernel="pallas")).rs_impl == "pallas"


@pytest.mark.parametrize("chip", ["v5e", None])
def test_column_and_row_on_plain_collectives_match_numpy(chip):
    """A column and a row site whose rows are few (8 a rank) and whose local weights
    are large enough (2 MiB f32) that `plain_collective_pays` on v5e: with chip
    constants they run the plain all-gather / reduce-scatter (no ring permutes),
    without them the JAX ring; both equal the float64 product."""
    P_, S, K, N = 4, 32, 1024, 1024
    rng = np.random.default_rng(7)
    x = rng.standard_normal((S, K)).astype(np.float32)
    ws = [rng.standard_normal((K, N)).astype(np.float32) for _ in range(2)]  # local 1024 x 256 each
    xr = rng.standard_normal((S, 2 * K)).astype(np.float32)
    wr = rng.standard_normal((2 * K, N)).astype(np.float32)                  # local 512 x 1024
    par = Parallel(mode="sp", size=P_, ag_impl="jax", rs_impl="jax", chip=chip, interpret=True)

    def f(x, w0, w1, xr, wr):
        a, b = par.column(x, [w0, w1])
        return a, b, par.row([(xr, wr)])

    g = jax.jit(jax.shard_map(f, mesh=make_mesh(P_),
                              in_specs=(P(TP, None), P(None, TP), P(None, TP), P(None, TP), P(TP, None)),
                              out_specs=(P(None, TP), P(None, TP), P(TP, None)), check_vma=False))
    jaxpr = str(jax.make_jaxpr(g)(x, *ws, xr, wr))
    plain = chip is not None
    assert ("ppermute" in jaxpr) != plain
    assert ("all_gather" in jaxpr) == plain and ("reduce_scatter" in jaxpr) == plain
    a, b, r = g(x, *ws, xr, wr)
    x64 = x.astype(np.float64)
    assert rel(a, x64 @ ws[0]) <= 1e-5 and rel(b, x64 @ ws[1]) <= 1e-5
    assert rel(r, xr.astype(np.float64) @ wr) <= 1e-5
