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

Under sp each site's implementation (kernel, JAX ring or sp-xla's plain
collectives, per site) is decided by `site_plan.plan`: `column_plan` /
`row_plan` ask it, `collective_matmul` executes what it decides.

Each model declares its parallel plan once (`PLAN`: module path pattern ->
COLUMN / ROW / SHARDED / REPLICATED); `param_specs` turns it into
PartitionSpecs for the parameters, with stacked (scanned) layers getting a
leading unsharded axis.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from difflet_tpu.parallel import collective_matmul as cm
from difflet_tpu.parallel import chips, site_plan
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
    rs_impl: str = "jax"      # "jax", "pallas", "xla", or "auto": per site by `site_plan.plan`
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
        into attention heads (q/k/v), which `column_plan` prices.
        """
        weights = list(weights)
        if self.seq_sharded:
            return cm.all_gather_matmul(x, weights, axis_name=self.axis,
                                        plan=self.column_plan(x, weights, epilogues, heads),
                                        assemble=self.assemble, epilogues=epilogues, interpret=self.interpret)
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
            y = cm.matmul_reduce_scatter(pairs, axis_name=self.axis, plan=self.row_plan(pairs),
                                         interpret=self.interpret)
        return y if bias is None else y + bias

    def column_plan(self, x, weights, epilogues=None, heads=False) -> site_plan.SitePlan:
        """The `site_plan.SitePlan` of this column site under SP: what `ag_impl` asks
        ("xla" under sp-xla), priced on this chip (`relayout` where the outputs go to
        attention `heads` and the weights are layers of a stack)."""
        weights = list(weights)
        relayout = heads and any(isinstance(w, cm.LayerWeight) for w in weights)
        return site_plan.plan(cm.column_site(x, weights, epilogues, self.size), self._asked(self.ag_impl),
                              chip=self.chip, relayout=relayout, tiles=self.tiles)

    def row_plan(self, pairs) -> site_plan.SitePlan:
        """The `site_plan.SitePlan` of this row site under SP: what `rs_impl` asks
        ("auto" decided there; "xla" under sp-xla), priced on this chip."""
        return site_plan.plan(cm.row_site(pairs, self.size), self._asked(self.rs_impl), chip=self.chip,
                              tiles=self.tiles)

    def _asked(self, impl: str) -> str:
        return "xla" if self.mode == "sp-xla" else impl

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
            raise ValueError(f"cannot shard {n} rows over {self.size} ranks: {site_plan.split_rule(self.size)}")
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
