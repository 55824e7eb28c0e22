"""How a model's linears run over the mesh's `tp` axis: one device, TP or SP.

A port calls `par.column(...)` for each group of column-parallel linears
that share an input and `par.row(...)` for each row-parallel output; the
mode decides the collectives:

=========  ==========================  =================================
mode       column(x, W) input x        row([(x, W)]) output
=========  ==========================  =================================
single     full sequence               full sum
tp         full sequence (replicated)  `psum` (all-reduce)
sp         this rank's rows; gathered  this rank's rows; reduce-scatter
           by the all-gather ring      fused into the matmul ring
sp-xla     as sp, with plain           as sp, with plain `psum_scatter`
           `all_gather` (XLA may       (XLA may decompose it)
           decompose it)
=========  ==========================  =================================

Under sp on a TPU whose chip constants are known, a site whose rows per rank
are too few for its ring to pay takes sp-xla's collectives instead
(`plain_collective_pays`, per site).

Each model declares its parallel plan once (`PLAN`: module path pattern ->
COLUMN / ROW / SHARDED / REPLICATED); `param_specs` turns it into
PartitionSpecs for the parameters, with stacked (scanned) layers getting a
leading unsharded axis.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from difflet_tpu.parallel import collective_matmul as cm
from difflet_tpu.parallel import chips
from difflet_tpu.kernels import tiles as kernel_tiles
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import TP

MODES = ("single", "tp", "sp", "sp-xla")

# Parallel roles of a parameter (see `param_specs`).
COLUMN = "column"          # Linear: kernel [K, N] sharded on N, bias on N
ROW = "row"                # Linear: kernel [K, N] sharded on K, bias replicated
SHARDED = "sharded"        # a vector sharded like a column output (across-heads norm weight)
REPLICATED = "replicated"  # the default


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The parallel mode of one compiled step. Inside `shard_map` unless mode is "single"."""

    mode: str = "single"
    axis: str = TP
    size: int = 1
    ag_impl: str = "jax"
    rs_impl: str = "jax"      # "jax", "pallas", "xla", or "auto": per site by `rs_site_impl`
    chip: str | None = None   # chips.CHIPS key of the mesh's TPU (per-site choices); None off TPU
    assemble: str = "concat"
    attn_impl: str = "xla"
    interpret: bool = False  # Pallas kernels interpreted (off TPU)
    sp_cross_local: bool = False  # what Config.sp_cross_local asks; `cross_local` is where it holds
    tiles: kernel_tiles.KernelTiles | None = None  # the kernels' column tile per site (Config.kernel_tiles)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"parallel mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "single" and self.size != 1:
            raise ValueError("mode 'single' runs on one device (size 1)")
        if self.rs_impl == "auto" and self.chip not in chips.CHIPS:
            raise ValueError(f"rs_impl 'auto' chooses by the chip's constants: chip must be one of "
                             f"{sorted(chips.CHIPS)}, got {self.chip!r}")

    @classmethod
    def for_mesh(cls, mesh, config: Config | None = None, *, mode: str | None = None,
                 ag_default: str = "jax") -> "Parallel":
        """The mode for `mesh` (None: one device) from `config` (default: the environment).

        `mode` overrides the config's TP/SP choice ("tp", "sp", "sp-xla").
        `ag_default` is the model's all-gather-matmul default on TPU.
        """
        config = Config.from_env() if config is None else config
        if mesh is None:  # one chip: splash attention on a TPU too
            return cls(attn_impl="splash" if jax.default_backend() == "tpu" else "xla")
        device = mesh.devices.flat[0]
        platform = device.platform
        chip = chips.chip_for_device(device)
        mode = mode or ("sp" if config.sp else "tp")
        tiles = None if config.kernel_tiles is None else kernel_tiles.load(config.kernel_tiles).for_devices(
            device.device_kind)
        return cls(mode=mode, size=mesh.shape[TP],
                   ag_impl=config.ag_kernel(ag_default, platform),
                   rs_impl=config.rs_kernel(platform, chip), chip=None if chip is None else chip.name,
                   assemble=config.sp_ag_assemble,
                   attn_impl="splash" if platform == "tpu" else "xla",
                   interpret=platform != "tpu",
                   sp_cross_local=config.sp_cross_local, tiles=tiles)

    @property
    def sharded(self) -> bool:
        return self.mode != "single"

    @property
    def seq_sharded(self) -> bool:
        """Activations between layers hold only this rank's rows."""
        return self.mode in ("sp", "sp-xla")

    @property
    def cross_local(self) -> bool:
        """Cross-attention on this rank's own rows with every head (Config.sp_cross_local):
        only where the rows are sequence-sharded."""
        return self.sp_cross_local and self.seq_sharded

    def local(self) -> "Parallel":
        """This rank alone: mode "single" (local matmuls, no collective) with the same
        attention implementation, for work on this rank's rows with replicated
        weights (`cross_local`)."""
        return dataclasses.replace(self, mode="single", size=1, sp_cross_local=False)

    # ---- linears --------------------------------------------------------

    def column(self, x, weights, epilogues=None, heads=False):
        """Column-parallel linears sharing the input `x`; one output per weight.

        Under SP, x holds this rank's rows and each output every row (the
        all-gather is fused into the matmuls); otherwise x holds every row.
        `epilogues` are row-wise functions (bias, activation) per output.
        A weight is an array or a `cm.LayerWeight` (one layer of a stack, which
        only the Pallas kernels read in place). `heads`: the outputs are split
        into attention heads (q/k/v), which `ag_site_impl` prices.
        """
        weights = list(weights)
        if self.seq_sharded:
            impl = "xla" if self.mode == "sp-xla" else self.ag_site_impl(x, weights, heads)
            return cm.all_gather_matmul(x, weights, axis_name=self.axis, impl=impl,
                                        assemble=self.assemble, epilogues=epilogues,
                                        interpret=self.interpret, tiles=self.tiles)
        epilogues = epilogues or [None] * len(weights)
        return [y if e is None else e(y) for y, e in zip((x @ cm.as_array(w) for w in weights), epilogues)]

    def row(self, pairs, bias=None):
        """`sum_i x_i @ w_i` over row-parallel shards, plus the (replicated) bias once.

        Under SP the result holds this rank's rows (reduce-scatter fused into
        the matmuls); under TP every row (all-reduce).
        """
        pairs = list(pairs)
        if self.mode == "single":
            y = cm._sum_dots(pairs)
        elif self.mode == "tp":
            y = cm.matmul_all_reduce(pairs, axis_name=self.axis)
        else:
            impl = "xla" if self.mode == "sp-xla" else self.rs_site_impl(pairs)
            y = cm.matmul_reduce_scatter(pairs, axis_name=self.axis, impl=impl,
                                         interpret=self.interpret, tiles=self.tiles)
        return y if bias is None else y + bias

    def ag_site_impl(self, x, weights, heads=False) -> str:
        """`ag_impl` for this column site: "xla" (plain all-gather + one matmul) where
        `plain_collective_pays` against the ring `ag_impl` runs, for this rank's rows on
        this chip (`relayout` where the outputs go to attention `heads` and the weights
        are layers of a stack); without chip constants (`chip` None: off TPU) always
        `ag_impl`."""
        if self.ag_impl == "xla":
            return "xla"
        relayout = heads and any(isinstance(w, cm.LayerWeight) for w in weights)
        if self._plain_pays("all_gather", math.prod(x.shape[:-1]), x.shape[-1], sum(w.shape[-1] for w in weights),
                            jnp.dtype(x.dtype).itemsize, self.ag_impl, relayout):
            return "xla"
        return self.ag_impl

    def rs_site_impl(self, pairs) -> str:
        """`rs_impl` for this row site, "auto" decided here: the Pallas kernel where its
        ring hops are ICI-bound on this chip (`kernels.matmul_reduce_scatter_stream.ici_bound`),
        the JAX ring where they are compute-bound; then, with chip constants, "xla" (one
        matmul + plain reduce-scatter) where `plain_collective_pays` against that ring
        for this rank's rows."""
        if self.rs_impl == "xla":
            return "xla"
        k = sum(x.shape[-1] for x, _ in pairs)
        itemsize = jnp.dtype(pairs[0][0].dtype).itemsize
        impl = self.rs_impl
        if impl == "auto":
            from difflet_tpu.kernels import matmul_reduce_scatter_stream as rs_kernel

            impl = "pallas" if rs_kernel.ici_bound(k, itemsize, chips.CHIPS[self.chip]) else "jax"
        rows = math.prod(pairs[0][0].shape[:-1]) // self.size
        if self._plain_pays("reduce_scatter", rows, k, pairs[0][1].shape[-1], itemsize, impl):
            return "xla"
        return impl

    def _plain_pays(self, kind, rows, k, n, itemsize, ring, relayout=False) -> bool:
        """`plain_collective_pays` on this chip and ring; False without chip constants
        (off TPU) or on one rank."""
        return (self.chip is not None and self.size > 1
                and plain_collective_pays(kind, rows, k, n, itemsize, self.size, chips.CHIPS[self.chip],
                                          ring, relayout))

    # ---- other collectives ----------------------------------------------

    def sum_over_ranks(self, x):
        """Sum of a per-rank partial (e.g. a sum of squares over this rank's channels)."""
        return lax.psum(x, self.axis) if self.sharded else x

    def gather_columns(self, x):
        """All columns of a column-sharded (small) activation, e.g. adaLN outputs.

        Only for values whose rows are the same on every rank (a replicated input
        times a column-sharded weight, or the weight itself): the result is typed
        rank-invariant for `shard_map`'s `check_vma`, so a replicated output built
        from it may be declared `P()`. (A row-sharded input's columns would be
        gathered but its rows still differ by rank: not for this function.)
        """
        if not self.sharded:
            return x
        return lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True, to="invarying")

    def gather_rows(self, x, axis: int = 1):
        """All rows of a sequence-sharded activation (identity unless SP)."""
        return lax.all_gather(x, self.axis, axis=axis, tiled=True) if self.seq_sharded else x

    def shard_rows(self, x, axis: int = 1):
        """This rank's rows of a full-sequence activation (identity unless SP).

        The offset is `axis_index` at run time: every rank runs one program.
        """
        if not self.seq_sharded:
            return x
        n = x.shape[axis]
        if n % (2 * self.size):
            raise ValueError(f"cannot shard {n} rows over {self.size} ranks: {cm.split_rule(self.size)}")
        rows = n // self.size
        return lax.dynamic_slice_in_dim(x, lax.axis_index(self.axis) * rows, rows, axis=axis)

    def rank(self):
        """This rank's index on the `tp` axis, a runtime value (0 on one device)."""
        return lax.axis_index(self.axis) if self.sharded else jnp.int32(0)

    def local_heads(self, heads: int) -> int:
        """Attention heads per rank; the head count must divide by the axis size."""
        if heads % self.size:
            raise ValueError(f"{heads} heads do not divide over tp={self.size} ranks")
        return heads // self.size


# --------------------------------------------------------------------------
# Per site: ring or plain collective
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
    still in flight); docs/benchmarks.md, row 3c.
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


# --------------------------------------------------------------------------
# Parallel plan -> PartitionSpecs
# --------------------------------------------------------------------------

_BASE_SPECS = {
    (COLUMN, "kernel"): (None, TP),
    (COLUMN, "bias"): (TP,),
    (ROW, "kernel"): (TP, None),
    (ROW, "bias"): (None,),
}


def role_of(module_path: str, plan: dict) -> str:
    """The plan's role for a dot-joined module path; the first matching pattern wins."""
    for pattern, role in plan.items():
        if fnmatch.fnmatchcase(module_path, pattern):
            return role
    return REPLICATED


def leaf_spec(module_path: str, leaf_name: str, ndim: int, plan: dict) -> P:
    """PartitionSpec of one parameter. Leading extra axes (stacked layers) stay unsharded."""
    role = role_of(module_path, plan)
    if role == REPLICATED:
        return P()
    if role == SHARDED:
        base = (TP,)
    else:
        base = _BASE_SPECS.get((role, leaf_name))
        if base is None:
            raise ValueError(f"plan gives {module_path} role {role!r}, which has no rule for {leaf_name!r}")
    if ndim < len(base):
        raise ValueError(f"{module_path}.{leaf_name}: rank {ndim} < {len(base)}")
    return P(*([None] * (ndim - len(base)) + list(base)))


def path_names(path) -> list[str]:
    """A jax tree path as plain names."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return out


def param_specs(params, plan: dict):
    """PartitionSpecs for a params pytree (e.g. an `nnx.State`) from a plan."""

    def spec(path, leaf):
        names = path_names(path)
        if names and names[-1] == "value":  # nnx.Variable leaves
            names = names[:-1]
        return leaf_spec(".".join(names[:-1]), names[-1], jnp.ndim(leaf), plan)

    return jax.tree_util.tree_map_with_path(spec, params)


def divisibility_problems(plan: dict, params, size: int) -> list[str]:
    """Every sharded axis that does not divide by `size`, one line each."""
    bad = []

    def check(path, leaf, spec):
        for dim, ax in zip(jnp.shape(leaf), spec):
            if ax == TP and dim % size:
                bad.append(f"{'.'.join(path_names(path))}: {jnp.shape(leaf)} axis of {dim} over tp={size}")
        return leaf

    specs = param_specs(params, plan)
    jax.tree_util.tree_map_with_path(check, params, specs)
    return bad


def check_divisible(plan: dict, params, size: int):
    """Every sharded axis divides by `size`; a clear error listing all that do not."""
    bad = divisibility_problems(plan, params, size)
    if bad:
        raise ValueError("parameters do not divide over the tp axis:\n  " + "\n  ".join(bad))
