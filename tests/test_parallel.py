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
