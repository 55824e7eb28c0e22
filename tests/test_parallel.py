"""One step written once runs on one device, under TP and under SP with the same numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from difflet_tpu import layout, runtime
from difflet_tpu.config import Config
from difflet_tpu.mesh import TP, make_mesh
from difflet_tpu.parallel import COLUMN, ROW, SHARDED, Parallel, leaf_spec, param_specs
from difflet_tpu.testing import PLAN, ToyConfig, ToyModel, rel_l2


rel = rel_l2


def toy_step(model, par, x, kv_mask):
    return model(par, x, kv_mask)


def run(model, mesh, mode, x, kv_mask):
    par = Parallel.for_mesh(mesh, Config(), mode=mode)
    if mesh is None:
        step, state = runtime.compile_step(model, toy_step, par)
        return step(state, x, kv_mask)
    rows = P(None, TP, None) if par.seq_sharded else P()
    step, state = runtime.compile_step(model, toy_step, par, mesh, PLAN, in_specs=(rows, P()), out_specs=rows)
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

    xp, pad = layout.pad_tokens(x, 2 * tp)
    mask = layout.key_mask(S, S + pad, batch=2)
    got = layout.unpad(run(model, make_mesh(tp), mode, xp, mask), S)
    assert rel(got, ref) <= 1e-5
    if pad:
        # The pad-key cut matters: without the mask the padded run differs.
        bad = layout.unpad(run(model, make_mesh(tp), mode, xp, None), S)
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


@pytest.mark.parametrize("chip,k,dtype,expect", [
    ("v5e", 1280, jnp.bfloat16, "pallas"),  # Wan attention out at P = 4: ICI-bound
    ("v5e", 3456, jnp.bfloat16, "jax"),     # Wan FFN down: compute-bound
    ("v5e", 768 + 3072, jnp.bfloat16, "jax"),  # FLUX single-block proj_out pairs
    ("v5e", 3456, jnp.float32, "pallas"),   # twice the bytes per hop
    ("v6e", 3456, jnp.bfloat16, "pallas"),  # 4.7x the FLOP/s, 2x the link
])
def test_rs_auto_takes_the_kernel_where_hops_are_ici_bound(chip, k, dtype, expect):
    """The rule against the hop arithmetic written out: per hop, both halves'
    matmul (2 B s k N flops at peak) vs one half of sums each way over a link."""
    from difflet_tpu import estimate

    B, S, N, P_ = 1, 4736, 5120, 4
    s = S // P_
    c = estimate.CHIPS[chip]
    compute = 2 * B * s * k * N / c.bf16_flops
    transfer = jnp.dtype(dtype).itemsize * B * (s // 2) * N / c.ici_link_bw
    assert (transfer > compute) == (expect == "pallas")
    par = Parallel(mode="sp", size=P_, rs_impl="auto", chip=chip)
    x = jax.ShapeDtypeStruct((B, S, k), dtype)
    w = jax.ShapeDtypeStruct((k, N), dtype)
    assert par.rs_site_impl([(x, w)]) == expect
    assert Parallel(mode="sp", size=P_, rs_impl="jax", chip=chip).rs_site_impl([(x, w)]) == "jax"


def test_rs_auto_needs_chip_constants():
    with pytest.raises(ValueError, match="chip must be one of"):
        Parallel(mode="sp", size=4, rs_impl="auto")
    mesh = make_mesh(2)
    assert Parallel.for_mesh(mesh, Config(sp=True)).rs_impl == "jax"  # CPU: the ring
    assert Parallel.for_mesh(mesh, Config(sp=True, sp_rs_kernel="pallas")).rs_impl == "pallas"
