"""The one place a collective-matmul site's implementation is decided
(difflet_tpu.parallel.site_plan): kernel where it takes the site, the JAX ring where
it does not (one notice), the plain collectives where the cost rule says so, the pad
multiple per dtype; collective_matmul executes the plan it is given."""

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from difflet_tpu.kernels.tiles import Site
from difflet_tpu.parallel import collective_matmul as cm
from difflet_tpu.parallel import site_plan
from difflet_tpu.parallel.mesh import TP, make_mesh
from difflet_tpu.parallel.modes import Parallel

F32, BF16 = "float32", "bfloat16"


def ag(rows, k, widths, dtype=F32, ring=4):
    """A column site: this rank's `rows` x k, one weight per width (no epilogue)."""
    return Site("ag", [(1, rows, k)], [(k, n) for n in widths], dtype, ring)


def rs(rows, ks, n, dtype=F32, ring=4):
    """A row site: `rows` (every rank's) x k_i per pair, output width n."""
    return Site("rs", [(1, rows, k) for k in ks], [(k, n) for k in ks], dtype, ring)


def largest_tile(widths, limit=512):
    """The kernels' default column tile, written out: the largest multiple of 128 up to
    512 that divides every width (small sites fit VMEM at any tile)."""
    return max(t for t in range(128, limit + 1, 128) if all(w % t == 0 for w in widths))


# ---- the kernel where it takes the site, the ring where it does not --------------

# Sublane tiles: 8 rows float32, 16 bfloat16, per ring half; 128 lanes.
SUPPORT = [
    # site, expected impl, what the reason says (ring only)
    (ag(64, 256, [256, 384]), "pallas", None),              # halves of 32 f32 rows, tile 128
    (ag(64, 256, [512, 1024]), "pallas", None),             # tile 512
    (ag(64, 256, [256], BF16), "pallas", None),             # halves of 32 bf16 rows
    (ag(48, 256, [256], BF16), "jax", "multiple of 16"),    # halves of 24 bf16 rows
    (ag(12, 256, [256]), "jax", "multiple of 8"),           # halves of 6 f32 rows
    (ag(64, 256, [256, 96]), "jax", "multiples of 128"),    # a width off the lanes
    (ag(64, 200, [256]), "jax", "K = 200"),                 # a depth off the lanes
    (ag(64, 256, [256], "float16"), "jax", "dtype"),        # the kernels take f32 and bf16
    (rs(256, [128], 256), "pallas", None),                  # 256 / 8 = 32-row halves
    (rs(256, [128, 256], 384), "pallas", None),             # two pairs (FLUX's single-block proj_out)
    (rs(512, [128], 256, BF16), "pallas", None),
    (rs(32, [128], 256), "jax", "multiple of 8"),           # 32 / 8 = 4-row halves
    (rs(256, [128], 192), "jax", "not a multiple of 128"),
    (rs(256, [128, 128, 128], 256), "jax", "one or two"),
]


@pytest.mark.parametrize("site,impl,why", SUPPORT, ids=[f"{s.kind}-{i}" for i, (s, *_) in enumerate(SUPPORT)])
def test_kernel_where_supported_ring_where_not(site, impl, why, caplog):
    site_plan._NOTICED.clear()
    with caplog.at_level(logging.WARNING, logger="difflet_tpu.parallel.site_plan"):
        got = site_plan.plan(site, "pallas")
        again = site_plan.plan(site, "pallas")
    assert got == again and got.impl == impl and got.site == site
    notices = [r.getMessage() for r in caplog.records]
    if impl == "pallas":
        assert got.col_tile == largest_tile(site.widths) and got.blocks is None and not notices
    else:
        assert why in got.reason and got.col_tile is None
        op = "all_gather_matmul" if site.kind == "ag" else "matmul_reduce_scatter"
        assert len(notices) == 1, notices  # once per shape
        assert notices[0].startswith(f"{op}: Pallas kernel unsupported for ") and why in notices[0]
        assert notices[0].endswith("; using the JAX ring")
    # asked for the ring or the plain collectives: exactly that, no notice
    assert site_plan.plan(site, "jax").impl == "jax" and site_plan.plan(site, "xla").impl == "xla"
    assert len(caplog.records) == len(notices)


def test_tile_table_steers_the_kernel():
    from difflet_tpu.kernels.tiles import KernelTiles

    site = ag(64, 256, [512, 1024])
    table = KernelTiles("cpu", ((site.key(), 256),))
    got = site_plan.plan(site, "pallas", tiles=table)
    assert (got.impl, got.col_tile, got.blocks.col_tile_limit) == ("pallas", 256, 256)
    other = ag(64, 256, [512])  # not in the table: the defaults
    assert site_plan.plan(other, "pallas", tiles=table).blocks is None


def test_one_rank_and_bad_requests():
    assert site_plan.plan(ag(64, 256, [256], ring=1), "pallas").impl == "xla"  # a local matmul
    with pytest.raises(ValueError, match="impl must be one of"):
        site_plan.plan(ag(64, 256, [256]), "auto")  # "auto" is a row-site rule
    with pytest.raises(ValueError, match="impl must be one of"):
        site_plan.plan(rs(256, [128], 256), "ring")
    with pytest.raises(ValueError, match="chip must be one of"):
        site_plan.plan(rs(256, [128], 256), "auto")
    with pytest.raises(ValueError, match="chip must be one of"):
        site_plan.plan(rs(256, [128], 256), "jax", chip="v4")


# ---- the cost rule with chip constants --------------------------------------------

# v5e, P = 4, bf16, k = n = 3072 (FLUX.1-dev's text MLP): the plain path wins below
# m* = 151 rows a rank (`_m_star`, solved by hand below) where hops are weight-bound;
# from about 240 rows the ring's hops are compute-bound and it wins outright.
COST = [
    (ag(64, 3072, [3072], BF16), "pallas", "xla"),
    (ag(128, 3072, [3072], BF16), "pallas", "xla"),
    (ag(512, 3072, [3072], BF16), "pallas", "pallas"),
    (ag(1024, 3072, [3072], BF16), "jax", "jax"),
    (rs(4 * 128, [3072], 3072, BF16), "auto", "xla"),    # compute-bound hops: the JAX ring, and it loses
    (rs(4 * 1024, [3072], 3072, BF16), "auto", "jax"),
    (rs(4 * 1024, [768], 3072, BF16), "auto", "pallas"),  # k = 768: ICI-bound hops, the kernel
    (ag(64, 3072, [3072], BF16), "xla", "xla"),
]


@pytest.mark.parametrize("site,asked,impl", COST)
def test_plain_collectives_where_the_cost_rule_says(site, asked, impl):
    got = site_plan.plan(site, asked, chip="v5e")
    assert got.impl == impl, got.reason
    if impl == "xla" and asked != "xla":
        assert "rows a rank" in got.reason and "v5e" in got.reason
    # without chip constants no plain path is chosen unless asked
    if asked != "auto":
        assert site_plan.plan(site, asked).impl == asked


def test_cost_rule_before_the_kernel_rule():
    """A site the plain path wins takes it even where the kernel would refuse the shape
    (no notice); where the ring wins, the refusal sends it to the JAX ring."""
    site_plan._NOTICED.clear()
    few = ag(72, 3072, [3072], BF16)  # halves of 36 rows: not whole bf16 tiles
    assert site_plan.plan(few, "pallas", chip="v5e").impl == "xla" and not site_plan._NOTICED
    many = ag(1032, 3072, [3072], BF16)  # halves of 516 rows
    assert site_plan.plan(many, "pallas", chip="v5e").impl == "jax" and len(site_plan._NOTICED) == 1


# ---- the pad multiple --------------------------------------------------------------

@pytest.mark.parametrize("mode,size,ag_impl,rs_impl,chip,dtype,expect", [
    ("single", 1, "jax", "jax", None, F32, 1),
    ("tp", 4, "pallas", "pallas", None, F32, 1),
    ("sp", 4, "jax", "jax", None, F32, 8),          # 2P: two ring halves a rank
    ("sp", 4, "jax", "jax", None, BF16, 8),
    ("sp", 4, "pallas", "jax", None, F32, 64),      # 2P x 8 float32 rows a sublane tile
    ("sp", 4, "jax", "pallas", None, BF16, 128),    # 2P x 16 bfloat16 rows
    ("sp", 4, "jax", "auto", "v5e", BF16, 128),
    ("sp", 2, "pallas", "jax", None, BF16, 64),
    ("sp-xla", 4, "pallas", "pallas", None, F32, 8),  # no kernel runs under sp-xla
])
def test_pad_multiple(mode, size, ag_impl, rs_impl, chip, dtype, expect):
    par = Parallel(mode=mode, size=size, ag_impl=ag_impl, rs_impl=rs_impl, chip=chip)
    assert site_plan.pad_multiple(par, jnp.dtype(dtype)) == expect


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_pad_multiple_is_what_the_kernels_take(dtype):
    """A stream padded by the rule is split so both kernels take it; half that is not."""
    P_ = 4
    m = site_plan.pad_multiple(Parallel(mode="sp", size=P_, ag_impl="pallas", rs_impl="pallas"), jnp.dtype(dtype))
    for rows, ok in ((m, True), (3 * m, True), (m // 2, False)):
        assert (site_plan.kernel_plan(ag(rows // P_, 256, [256], dtype, P_))[0] is None) == ok
        assert (site_plan.kernel_plan(rs(rows, [256], 256, dtype, P_))[0] is None) == ok


# ---- collective_matmul executes the plan -------------------------------------------

def _traced(f, *args):
    g = jax.shard_map(f, mesh=make_mesh(4), in_specs=(P(TP, None), P(None, TP)), out_specs=P(None, TP),
                      check_vma=False)
    return str(jax.make_jaxpr(g)(*args))


def test_collective_matmul_executes_the_plan():
    P_, S, K, N = 4, 64, 128, 512
    rng = np.random.default_rng(0)
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    site = cm.column_site(x[:S // P_], [w[:, :N // P_]], None, P_)  # this rank's operands
    for asked, has, lacks in (("xla", "all_gather", ("ppermute", "pallas_call")),
                              ("jax", "ppermute", ("all_gather", "pallas_call")),
                              ("pallas", "pallas_call", ("ppermute",))):
        plan = site_plan.plan(site, asked)
        assert plan.impl == asked
        jaxpr = _traced(lambda x, w: cm.all_gather_matmul(x, [w], plan=plan, interpret=True)[0], x, w)
        assert has in jaxpr and not any(m in jaxpr for m in lacks), asked
    # a plan for another site, or a plan with impl=: refused
    other = site_plan.plan(cm.column_site(x[:S // P_], [w[:, :256]], None, P_), "jax")
    with pytest.raises(ValueError, match="another site"):
        _traced(lambda x, w: cm.all_gather_matmul(x, [w], plan=other)[0], x, w)
    with pytest.raises(ValueError, match="not both"):
        _traced(lambda x, w: cm.all_gather_matmul(x, [w], plan=plan, impl="jax")[0], x, w)


def test_forced_kernel_on_a_shape_it_cannot_take_runs_the_ring_with_one_notice(caplog):
    """impl="pallas" asked of a site whose halves are 6 rows: the planner sends it to the
    JAX ring and says why once; the numbers are the product's."""
    site_plan._NOTICED.clear()
    P_, S, K, N = 4, 48, 128, 512
    rng = np.random.default_rng(1)
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    f = lambda x, w: cm.all_gather_matmul(x, [w], impl="pallas", interpret=True)[0]
    with caplog.at_level(logging.WARNING, logger="difflet_tpu.parallel.site_plan"):
        jaxpr = _traced(f, x, w)
        _traced(f, x, w)
    assert "ppermute" in jaxpr and "pallas_call" not in jaxpr
    assert len(caplog.records) == 1 and "using the JAX ring" in caplog.records[0].getMessage()
    g = jax.jit(jax.shard_map(f, mesh=make_mesh(P_), in_specs=(P(TP, None), P(None, TP)), out_specs=P(None, TP),
                              check_vma=False))
    np.testing.assert_allclose(np.asarray(g(x, w)), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


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
    assert par.row_plan([(x, w)]).impl == expect
    assert Parallel(mode="sp", size=P_, rs_impl="jax", chip=chip).row_plan([(x, w)]).impl == "jax"



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
    from difflet_tpu.parallel.site_plan import plain_collective_pays

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
def test_plan_takes_plain_collectives_for_few_rows(site, rows, k, n, heads, expect):
    from difflet_tpu.parallel import collective_matmul as cm

    P_, layers = 4, 19
    x = jax.ShapeDtypeStruct((1, rows if site == "ag" else rows * P_, k), jnp.bfloat16)
    w = cm.LayerWeight(jax.ShapeDtypeStruct((layers, k, n), jnp.bfloat16), jnp.int32(0))  # a scanned layer
    par = Parallel(mode="sp", size=P_, ag_impl="pallas", rs_impl="auto", chip="v5e")
    got = par.column_plan(x, [w], heads=heads) if site == "ag" else par.row_plan([(x, w)])
    assert got.impl == expect
    # without chip constants (off TPU) nothing changes
    off = Parallel(mode="sp", size=P_, ag_impl="pallas", rs_impl="jax")
    assert (off.column_plan(x, [w], heads=heads) if site == "ag" else off.row_plan([(x, w)])).impl == (
        "pallas" if site == "ag" else "jax")


def test_plan_prices_the_ring_that_would_run():
    """A row site the kernel keeps (to_add_out at 128 rows: 35 us against 42 us) goes plain
    when the JAX ring would run it (2P half-row dots, each reading the weight)."""
    from difflet_tpu.parallel import chips
    from difflet_tpu.parallel.site_plan import plain_collective_pays, plain_seconds, ring_seconds

    c = chips.CHIPS["v5e"]
    args = ("reduce_scatter", 128, 768, 3072, 2, 4, c)
    assert ring_seconds(*args, "pallas") < plain_seconds(*args) < ring_seconds(*args, "jax")
    assert not plain_collective_pays(*args, "pallas") and plain_collective_pays(*args, "jax")
    x = jax.ShapeDtypeStruct((1, 512, 768), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((768, 3072), jnp.bfloat16)
    assert Parallel(mode="sp", size=4, rs_impl="pallas", chip="v5e").row_plan([(x, w)]).impl == "pallas"
    assert Parallel(mode="sp", size=4, rs_impl="jax", chip="v5e").row_plan([(x, w)]).impl == "xla"
