"""One step written once runs on one device, under TP and under SP with the same numbers."""

import math

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
    from difflet_tpu.parallel import chips

    B, S, N, P_ = 1, 4736, 5120, 4
    s = S // P_
    c = chips.CHIPS[chip]
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


# ---- per site: ring or plain collective (`plain_collective_pays`) ----------

def _m_star(chip, P_, k, n, w, b):
    """The rows below which the plain path wins, solved by hand from the chip constants,
    in the regime the closed form assumes (ring hops bound by the weight read, no ring
    transfer exposed, the plain matmul compute-bound)."""
    return (P_ * b * k * n / chip.hbm_bw - (P_ - 1) * chip.ici_latency) / (
        2 * P_ * k * n / chip.bf16_flops + b * (P_ - 1) * w / (2 * chip.ici_link_bw))


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_plain_collective_boundary_from_chip_constants(chip, kind):
    from difflet_tpu.parallel import chips
    from difflet_tpu.parallel.modes import plain_collective_pays

    c = chips.CHIPS[chip]
    P_, k, n, b = 4, 3072, 3072, 2  # FLUX.1-dev's ff_context.net.0.proj / .2 at P = 4, bf16
    m = _m_star(c, P_, k, n, k if kind == "all_gather" else n, b)
    lo, hi = math.floor(m), math.floor(m) + 1
    # the closed form's regime holds on both sides of the boundary
    assert b * k * n / c.hbm_bw > 2 * hi * k * n / c.bf16_flops                       # hops weight-bound
    assert b * k * n / c.hbm_bw > b * (hi / 2) * k / c.ici_link_bw + c.ici_latency   # no transfer exposed
    assert 2 * P_ * lo * k * n / c.bf16_flops > b * k * n / c.hbm_bw                 # plain matmul compute-bound
    assert plain_collective_pays(kind, lo, k, n, b, P_, c)
    assert not plain_collective_pays(kind, hi, k, n, b, P_, c)
    assert {"v5e": 151, "v6e": 233}[chip] == lo


@pytest.mark.parametrize("site,rows,k,n,heads,expect", [
    ("ag", 128, 3072, 3072, False, "xla"),      # FLUX text ff_context.net.0.proj: 512 tokens / 4
    ("ag", 128, 3072, 3 * 768, True, "pallas"),  # FLUX text add_q/k/v_proj: the layer's relayout charged
    ("ag", 128, 3072, 3 * 768, False, "xla"),    # ... which alone decides it
    ("ag", 1024, 3072, 3072, False, "pallas"),  # FLUX image ff.net.0.proj: 4096 tokens / 4
    ("rs", 128, 3072, 3072, False, "xla"),      # FLUX text ff_context.net.2 (would run the JAX ring)
    ("rs", 128, 768, 3072, False, "pallas"),    # FLUX text to_add_out: ICI-bound hops, "auto" takes the kernel
    ("rs", 1024, 3072, 3072, False, "jax"),     # FLUX image ff.net.2: compute-bound hops, the JAX ring
])
def test_site_impl_takes_plain_collectives_for_few_rows(site, rows, k, n, heads, expect):
    from difflet_tpu.parallel import collective_matmul as cm

    P_, layers = 4, 19
    x = jax.ShapeDtypeStruct((1, rows if site == "ag" else rows * P_, k), jnp.bfloat16)
    w = cm.LayerWeight(jax.ShapeDtypeStruct((layers, k, n), jnp.bfloat16), jnp.int32(0))  # a scanned layer
    par = Parallel(mode="sp", size=P_, ag_impl="pallas", rs_impl="auto", chip="v5e")
    got = par.ag_site_impl(x, [w], heads) if site == "ag" else par.rs_site_impl([(x, w)])
    assert got == expect
    # without chip constants (off TPU) nothing changes
    off = Parallel(mode="sp", size=P_, ag_impl="pallas", rs_impl="jax")
    assert (off.ag_site_impl(x, [w], heads) if site == "ag" else off.rs_site_impl([(x, w)])) == (
        "pallas" if site == "ag" else "jax")


def test_site_impl_prices_the_ring_that_would_run():
    """A row site the kernel keeps (to_add_out at 128 rows: 35 us against 42 us) goes plain
    when the JAX ring would run it (2P half-row dots, each reading the weight)."""
    from difflet_tpu.parallel import chips
    from difflet_tpu.parallel.modes import plain_collective_pays, plain_seconds, ring_seconds

    c = chips.CHIPS["v5e"]
    args = ("reduce_scatter", 128, 768, 3072, 2, 4, c)
    assert ring_seconds(*args, "pallas") < plain_seconds(*args) < ring_seconds(*args, "jax")
    assert not plain_collective_pays(*args, "pallas") and plain_collective_pays(*args, "jax")
    x = jax.ShapeDtypeStruct((1, 512, 768), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((768, 3072), jnp.bfloat16)
    assert Parallel(mode="sp", size=4, rs_impl="pallas", chip="v5e").rs_site_impl([(x, w)]) == "pallas"
    assert Parallel(mode="sp", size=4, rs_impl="jax", chip="v5e").rs_site_impl([(x, w)]) == "xla"


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
