"""Where a collective-matmul site's implementation is decided: here, once.

A site is one call of `collective_matmul.all_gather_matmul` (a column site,
kind "ag") or `matmul_reduce_scatter` (a row site, kind "rs") under SP, as
its static signature (`kernels.tiles.Site`: per-rank shapes, dtype, ring
size, the epilogue the all-gather kernel would apply). `plan` turns a site and
what the mode asks for ("jax", "pallas", "xla"; "auto" for a row site) into a
`SitePlan`, in this order:

1. "xla" asked (sp-xla): the plain collective + one matmul.
2. "auto": the Pallas kernel where its ring hops are ICI-bound on this chip
   (`kernels.matmul_reduce_scatter_stream.ici_bound`), else the JAX ring.
3. With chip constants (on a v5e / v6e): "xla" where `plain_collective_pays`
   against the ring that step 1-2 chose, for this rank's rows.
4. "pallas" where the kernel takes the site (its plan, with the tile table's
   column tile); else the JAX ring, with one notice per shape.

`Parallel.column` / `row` plan every site and `collective_matmul` executes the
plan. The Runner's pad rule (`pad_multiple`) reads the same requests: where a
kernel may be planned, each ring half is padded to whole sublane tiles, the
kernels' layout rule, so step 4 finds the rows it needs.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax.numpy as jnp

from difflet_tpu.kernels import _common as kernel_rules
from difflet_tpu.kernels import tiles as kernel_tiles
from difflet_tpu.parallel import chips

log = logging.getLogger(__name__)

IMPLS = ("jax", "pallas", "xla")
REQUESTS = IMPLS + ("auto",)  # "auto": row sites only
OPS = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}  # the call, as the notice names it


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """How one site runs: `impl` ("pallas", "jax" or "xla") and why.

    site: the site planned (`kernels.tiles.Site`); collective_matmul refuses a
      plan for another one.
    blocks: what the kernel is asked for (a tile table's column tile as its limit),
      None for its defaults; only for "pallas".
    col_tile: the column tile the kernel's plan takes with those blocks ("pallas").
    """

    impl: str
    reason: str
    site: kernel_tiles.Site
    blocks: kernel_rules.StreamBlocks | None = None
    col_tile: int | None = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"SitePlan.impl must be one of {IMPLS}, got {self.impl!r}")


# --------------------------------------------------------------------------
# The layout rule: the split of each rank's rows, and the pad multiple
# --------------------------------------------------------------------------

def split_rule(P: int) -> str:
    """The sequence-length rule of the rings, for error messages."""
    return (f"the sequence must be a multiple of 2*P = {2 * P} rows, so each rank's shard "
            f"splits into two equal halves that travel in opposite directions; pad it eagerly "
            f"before the compiled step (difflet_tpu.parallel.padding.pad_tokens)")


def kernel_requested(par) -> bool:
    """Whether `plan` may choose a Pallas kernel for some site of `par` (a `Parallel`):
    under sp with "pallas" asked of either ring, or "auto" of the row sites."""
    return par.mode == "sp" and ("pallas" in (par.ag_impl, par.rs_impl) or par.rs_impl == "auto")


def pad_multiple(par, dtype) -> int:
    """Token streams are padded to a multiple of this (`Runner.rows`): 1 unless rows are
    sequence-sharded; 2P (each rank's rows are two ring halves, `split_rule`); times the
    kernels' sublane tile of `dtype` (8 rows float32, 16 bfloat16) where a kernel may be
    planned (`kernel_requested`), as the kernels take whole tiles per half."""
    if not par.seq_sharded:
        return 1
    mult = 2 * par.size
    if kernel_requested(par):
        mult *= kernel_rules.sublane_rows(dtype)
    return mult


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------

def dims(site: kernel_tiles.Site) -> tuple[int, int, int, int]:
    """(rows, k, n, itemsize) of the local matmul the cost rule prices: this rank's rows m
    (all batch rows), the contraction and output widths (column site: K and the sum of
    this rank's columns; row site: the sum of k_i and N), the dtype's bytes."""
    x0 = site.x_shapes[0]
    if site.kind == "ag":
        rows, k, n = math.prod(x0[:-1]), x0[-1], sum(w[-1] for w in site.w_shapes)
    else:
        rows, k, n = math.prod(x0[:-1]) // site.ring, sum(x[-1] for x in site.x_shapes), site.w_shapes[0][-1]
    return rows, k, n, jnp.dtype(site.dtype).itemsize


def kernel_plan(site: kernel_tiles.Site, blocks=None):
    """(reason, StreamPlan) of the site's Pallas kernel: reason None where it takes the
    site (shapes, dtype, epilogue, VMEM), else one sentence why not."""
    if site.kind == "ag":
        from difflet_tpu.kernels import all_gather_matmul_stream as kernel

        heads = [None if h is None else kernel.Heads(*h) for h in site.heads] if site.heads else None
        return kernel.plan(site.x_shapes[0], site.widths, site.dtype, site.ring, blocks=blocks,
                           biases=list(site.biases) or None, activations=list(site.activations) or None,
                           sum_squares=list(site.sum_squares) or None, heads=heads)
    from difflet_tpu.kernels import matmul_reduce_scatter_stream as kernel

    return kernel.plan(site.x_shapes, site.w_shapes, site.dtype, site.ring, blocks=blocks)


def plan(site: kernel_tiles.Site, impl: str, *, chip: str | None = None, relayout: bool = False,
         tiles: kernel_tiles.KernelTiles | None = None) -> SitePlan:
    """The `SitePlan` of `site` when the mode asks for `impl` (see the module docstring).

    chip: a `chips.CHIPS` key, or None (off TPU: no cost rule, "auto" refused).
    relayout: a column site whose outputs go to attention heads and whose weights are
      layers of a stack (`weight_relayout_seconds`).
    tiles: a `kernels.tiles.KernelTiles` table (the kernel's column tile per site).
    """
    if impl not in REQUESTS or (impl == "auto" and site.kind != "rs"):
        raise ValueError(f"{OPS[site.kind]}: impl must be one of {IMPLS if site.kind == 'ag' else REQUESTS}, "
                         f"got {impl!r}")
    if chip is not None and chip not in chips.CHIPS:
        raise ValueError(f"chip must be one of {sorted(chips.CHIPS)} or None, got {chip!r}")
    if impl == "auto" and chip is None:
        raise ValueError(f"impl 'auto' chooses by the chip's constants: chip must be one of "
                         f"{sorted(chips.CHIPS)}, got None")
    if impl == "xla":
        return SitePlan("xla", "the plain collective + one matmul asked (sp-xla)", site)
    if site.ring < 2:
        return SitePlan("xla", "one rank: a local matmul, no collective", site)
    rows, k, n, itemsize = dims(site)
    ring, why = impl, f"{impl} asked"
    if impl == "auto":
        from difflet_tpu.kernels import matmul_reduce_scatter_stream as rs_kernel

        bound = rs_kernel.ici_bound(k, itemsize, chips.CHIPS[chip])
        ring = "pallas" if bound else "jax"
        why = f"auto: ring hops {'ICI' if bound else 'compute'}-bound on {chip} (k = {k})"
    if chip is not None:
        args = ("all_gather" if site.kind == "ag" else "reduce_scatter", rows, k, n, itemsize, site.ring,
                chips.CHIPS[chip])
        if plain_collective_pays(*args, ring, relayout):
            return SitePlan("xla", f"{rows} rows a rank: the plain collective is cheaper than the {ring} ring "
                                   f"on {chip} ({plain_seconds(*args, relayout) * 1e6:.0f} us against "
                                   f"{ring_seconds(*args, ring, relayout) * 1e6:.0f} us, modelled)", site)
    if ring == "jax":
        return SitePlan("jax", why, site)
    blocks = tiles.blocks(site) if tiles is not None else None
    reason, stream = kernel_plan(site, blocks)
    if reason is not None:
        _notice_fallback(site, reason)
        return SitePlan("jax", f"the Pallas kernel does not take this site: {reason}", site)
    return SitePlan("pallas", why, site, blocks, stream.col_tile)


_NOTICED: set = set()


def _notice_fallback(site, reason):
    """One warning per (call, shapes): the kernel was asked for and the ring runs."""
    if site.kind == "ag":
        key = (site.x_shapes[0], site.w_shapes, site.dtype)
    else:
        key = (site.x_shapes, site.w_shapes)
    op = OPS[site.kind]
    if (op, key) in _NOTICED:
        return
    _NOTICED.add((op, key))
    log.warning("%s: Pallas kernel unsupported for %s (%s); using the JAX ring", op, key, reason)


# --------------------------------------------------------------------------
# The cost rule: ring or plain collective
# --------------------------------------------------------------------------

def weight_relayout_seconds(k: int, n: int, itemsize: int, chip) -> float:
    """Two reads and two writes of a `[k, n]` weight at HBM bandwidth: a scanned layer's
    weight sliced out of its stack and transposed, which XLA does before a plain dot
    whose output it lays out heads-major for attention. Seen in the deviceless v5e:2x2
    compile of FLUX.1-dev with add_q/k/v_proj on the plain all-gather: a dynamic-slice
    and a transpose copy of each 3072 x 768 layer per block, which cost more than the
    kernel they replaced saved (1.4 ms a step). XLA fused the slice into the dot
    where the output stays row-major (ff_context.net.0.proj / .2: no copy). The
    Pallas kernels read a stacked layer in place."""
    return 4 * itemsize * k * n / chip.hbm_bw


def ring_seconds(kind: str, rows: int, k: int, n: int, itemsize: int, P: int, chip,
                 impl: str = "pallas", relayout: bool = False) -> float:
    """Modelled time of one collective-matmul ring on `chip` (an `chips.Chip`).

    `kind`: "all_gather" (a column site) or "reduce_scatter" (a row site); `rows`: this
    rank's rows m (all batch rows); `k`, `n`: the local matmul's contraction and output
    widths (column site: K and the sum of this rank's columns; row site: this rank's
    sum of k_i and N); `itemsize` b. The Pallas kernel (`impl` "pallas") multiplies m
    rows by the whole local weight at each of its P hops, streaming the weight from HBM
    again every hop (as `estimate.collective_matmul_hops` prices it):
    c = max(2 m k n / peak, b k n / HBM bandwidth); the JAX ring ("jax") multiplies the
    two halves as separate dots, c = 2 max(m k n / peak, b k n / HBM bandwidth). Each of
    the first P-1 hops sends one half each way, t = b (m/2) w / link + latency (w = k:
    rows of x for the all-gather; w = n: accumulators for the reduce-scatter), exposed
    where it exceeds c. Ring = P c + (P-1) max(0, t - c), plus, for the JAX ring (which
    slices the layer out of its stack like the plain path), `weight_relayout_seconds`
    where `relayout`.

    Below `kernels._common.FEW_ROWS` rows the streaming all-gather kernel holds its
    weights in VMEM and reads them once, not P times; this model still charges P reads
    on purpose. Charging one flipped FLUX.1-dev's text MLP input from the plain path to
    the kernel, and the compiled step got slower (127.7 -> 129.0 ms estimated on
    v5e:2x2: the text `to_add_out` kernel's first sends then queue behind transfers
    still in flight); docs/ablations.md, row 3c.
    """
    w = k if kind == "all_gather" else n
    if impl == "jax":
        c = 2 * max(rows * k * n / chip.bf16_flops, itemsize * k * n / chip.hbm_bw)
    else:
        c = max(2 * rows * k * n / chip.bf16_flops, itemsize * k * n / chip.hbm_bw)
    t = itemsize * (rows / 2) * w / chip.ici_link_bw + chip.ici_latency
    copy = weight_relayout_seconds(k, n, itemsize, chip) if relayout and impl == "jax" else 0.0
    return P * c + (P - 1) * max(0.0, t - c) + copy


def plain_seconds(kind: str, rows: int, k: int, n: int, itemsize: int, P: int, chip,
                  relayout: bool = False) -> float:
    """Modelled time of the plain path (`impl="xla"`) for the same site as
    `ring_seconds`: one matmul of all P m rows (column site; row site: all rows of the
    partial sum) reading the weight once, max(2 P m k n / peak, b k n / HBM bandwidth),
    plus the synchronous collective of the P m rows of width w (all-gather of x: w = k;
    reduce-scatter of the sums: w = n) as `estimate` prices a ring collective:
    (P-1)/P of b P m w bytes over two links, b (P-1) m w / (2 link), plus P-1
    latencies, plus `weight_relayout_seconds` where `relayout`."""
    w = k if kind == "all_gather" else n
    matmul = max(2 * P * rows * k * n / chip.bf16_flops, itemsize * k * n / chip.hbm_bw)
    collective = itemsize * (P - 1) * rows * w / (2 * chip.ici_link_bw) + (P - 1) * chip.ici_latency
    copy = weight_relayout_seconds(k, n, itemsize, chip) if relayout else 0.0
    return matmul + collective + copy


def plain_collective_pays(kind: str, rows: int, k: int, n: int, itemsize: int, P: int, chip,
                          ring: str = "pallas", relayout: bool = False) -> bool:
    """Whether a sequence-parallel site ("all_gather": a column site; "reduce_scatter":
    a row site) is cheaper as the plain collective + one local matmul than as the ring
    it would run (`ring`: "pallas" or "jax"):
    `plain_seconds(...) < ring_seconds(...)` (see both for the terms). `relayout`: the
    site's weights are layers of a stack and its outputs go to attention heads
    (`weight_relayout_seconds`).

    Few rows per rank make every ring hop bound by re-reading the weight from HBM
    (below peak / HBM bandwidth = 197e12 / 819e9 = 240 rows on v5e, 560 on v6e), so
    the ring pays P weight reads (the JAX ring 2P) where the plain path pays one and an
    exposed collective of the rows. For the kernel, weight-bound hops, no ring transfer
    exposed, the plain matmul compute-bound and no relayout, the inequality is
        P b k n / HBM bw > 2 P m k n / peak + b (P-1) m w / (2 link) + (P-1) latency,
    i.e. m < m* = (P b k n / HBM bw - (P-1) latency) / (2 P k n / peak + b (P-1) w / (2 link)):
    v5e (CHIPS: 197 TFLOP/s bf16, 819 GB/s HBM, 45 GB/s per link, 1 us per hop), P = 4,
    bf16, k = n = 3072 (FLUX.1-dev's ff_context.net.0.proj / .2 at P = 4): m* = 151
    rows (v6e: 233). So FLUX's text stream (512 tokens, 128 rows a rank) takes the
    plain all-gather for ff_context.net.0.proj (78 us against the kernel's 92 us) and
    the plain reduce-scatter for ff_context.net.2, whose compute-bound hops would run
    the JAX ring (78 us against 184 us); it keeps the kernels for add_q/k/v_proj
    (heads: 135 us against 69 us) and to_add_out (k = 768, ICI-bound hops that send
    the sums hop by hop: 42 us against 35 us); its image stream (1024 rows) keeps
    every ring.
    """
    return (plain_seconds(kind, rows, k, n, itemsize, P, chip, relayout)
            < ring_seconds(kind, rows, k, n, itemsize, P, chip, ring, relayout))
