"""Helpers shared by the collective-matmul kernels (all_gather_matmul, matmul_reduce_scatter).

Nothing here launches a kernel: chip facts (VMEM capacity), tiling rules that
Mosaic enforces but interpret mode does not, the rank tables both kernels take
by scalar prefetch, and the `out_shape` / `interpret` plumbing.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Chip VMEM when no TPU is attached (deviceless compiles, CPU interpret mode):
# v5e and v6e both have 128 MiB. With a TPU attached the real value is read.
DEFAULT_VMEM_CAPACITY_BYTES = 128 * 1024 * 1024

# Headroom added to a kernel's own buffer plan for what Mosaic allocates
# itself (f32 matmul results before the cast, relayout temporaries). The
# scoped limit requested is plan + headroom; a plan whose limit would exceed
# the chip's VMEM is refused by `unsupported_reason`.
VMEM_HEADROOM_BYTES = 8 * 1024 * 1024

LANES = 128
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def vmem_capacity_bytes() -> int:
    """VMEM per TensorCore of the attached TPU, else v5e's 128 MiB."""
    from jax._src import xla_bridge

    # Never initialise a backend just to ask (a check may run before jax picks
    # its platform, and libtpu would then try to open a TPU).
    if not xla_bridge.backends_are_initialized():
        return DEFAULT_VMEM_CAPACITY_BYTES
    try:
        if jax.default_backend() != "tpu":
            return DEFAULT_VMEM_CAPACITY_BYTES
        return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    except Exception:  # a deviceless topology, or a chip jax does not know
        return DEFAULT_VMEM_CAPACITY_BYTES


def sublane_rows(dtype) -> int:
    """Rows of one (sublane x lane) tile for `dtype`: 8 for 32-bit, 16 for bf16."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def dtype_reason(dtype) -> str | None:
    d = jnp.dtype(dtype)
    if d not in SUPPORTED_DTYPES:
        return f"dtype {d} is not supported (float32 or bfloat16)"
    return None


def column_tile_candidates(widths, limit: int) -> list[int]:
    """Multiples of 128 that divide every width, largest first, at most `limit`."""
    g = 0
    for w in widths:
        g = math.gcd(g, int(w))
    return [t for t in range(min(g, limit) // LANES * LANES, 0, -LANES) if g % t == 0]


def depth_tile(K: int, limit: int) -> int:
    """The depth chunk of a matmul kernel: the largest multiple of 128 dividing K
    (itself a multiple of 128), at most `limit` (K itself when K <= limit)."""
    return column_tile_candidates([K], max(int(limit), LANES))[0]


MAX_CHUNKS = 64  # the most row chunks a streaming plan cuts a half into

# Generated code (v5e): Mosaic unrolls every dot's vregs, so a kernel's code grows with
# bodies x rows x depth x columns its dots cover (one body per weight, the depth chunk
# tk and column tile tn). Deviceless v5e:2x2 compiles of the all-gather kernel: Wan
# q/k/v 3 x 1184 x 1024 x 256 -> 1.03 MiB, FLUX's single-block group 4 x 1152 x 1024 x
# 384 -> 1.84 MiB, Wan's batch-2 q/k/v 3 x 2368 x 1024 x 256 -> 1.92 MiB, HunyuanVideo
# 320x512x61's single-block group 4 x 2624 x 1024 x 384 -> 3.66 MiB (at tn = 128: 1.34
# MiB; docs/kernels.md). The all-gather plan keeps its column tile within this budget,
# and where 128 columns do not, cuts the halves into more chunks, so its code stays
# under 2 MiB.
MAX_DOT_ELEMENTS = 1.9e9


def dot_code_fits(bodies: float, rows: int, tk: int, tn: int) -> bool:
    """Whether `bodies` unrolled dot bodies of rows x tk x tn stay within MAX_DOT_ELEMENTS."""
    return bodies * rows * tk * tn <= MAX_DOT_ELEMENTS


def row_tiles(rows: int, max_rows: int, unit: int) -> tuple[tuple[int, int], ...]:
    """Splits `rows` (a multiple of `unit`) into near-equal static (offset, size)
    pieces, each a multiple of `unit` and at most max(max_rows, unit) rows."""
    units = rows // unit
    n = max(1, -(-rows // max(max_rows, unit)))
    n = min(n, units)
    base, extra = divmod(units, n)
    out, off = [], 0
    for i in range(n):
        size = (base + (i < extra)) * unit
        out.append((off, size))
        off += size
    return tuple(out)


def fold_batch(shape) -> tuple[int, tuple[int, ...]]:
    """Leading dims `[..., rows, cols]` -> (B, leading): B = prod(leading) (1 if none)."""
    lead = tuple(int(d) for d in shape[:-2])
    return math.prod(lead), lead


def ring_tables(axis_name: str, shard_rows: int) -> jax.Array:
    """The rank-dependent scalars both kernels read by scalar prefetch.

    int32[2 + 2P]: [forward neighbour (r+1), backward neighbour (r-1),
    first-row offsets of rank r-j's shard for j = 0..P-1,
    first-row offsets of rank r+j's shard for j = 0..P-1], r = axis_index.
    Computed from `lax.axis_index` at run time, so every rank compiles and runs
    one identical program (see difflet_tpu.parallel.collective_matmul's docstring).
    """
    P = lax.axis_size(axis_name)
    r = lax.axis_index(axis_name).astype(jnp.int32)
    j = jnp.arange(P, dtype=jnp.int32)
    fwd = (r + 1) % P
    bwd = (r + P - 1) % P
    minus = ((r - j) % P) * shard_rows
    plus = ((r + j) % P) * shard_rows
    return jnp.concatenate([jnp.stack([fwd, bwd]), minus, plus]).astype(jnp.int32)


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """`out_shape` for a pallas_call under shard_map: varying over the same
    manual axes as `like` (needed with check_vma=True, harmless without)."""
    try:
        varying = frozenset(jax.typeof(like).manual_axis_type.varying)
    except AttributeError:  # outside shard_map
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def in_hbm(w: jax.Array) -> jax.Array:
    """`w` constrained to HBM as a kernel input. The kernels stream weights tile by
    tile; left to itself, XLA may prefetch a small weight (even a whole stack of
    layers) into VMEM before every call."""
    return pltpu.with_memory_space_constraint(w, pltpu.HBM)


def interpret_params(interpret):
    """False -> compile with Mosaic; True -> TPU interpret mode (default
    params); a `pltpu.InterpretParams` is passed through (tests set
    detect_races=True)."""
    if interpret is False or interpret is None:
        return False
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


@dataclasses.dataclass(frozen=True)
class VmemPlan:
    """Bytes per VMEM buffer of a kernel, and the scoped limit it requests."""

    buffers: tuple[tuple[str, tuple[int, ...], str, int], ...]  # (name, shape, dtype, bytes)
    headroom: int = VMEM_HEADROOM_BYTES

    @property
    def total(self) -> int:
        return sum(b for *_, b in self.buffers)

    @property
    def limit(self) -> int:
        return self.total + self.headroom

    def describe(self) -> str:
        mib = 1024 * 1024
        lines = [f"  {n:<14} {str(list(s)):<28} {d:<9} {b / mib:8.2f} MiB" for n, s, d, b in self.buffers]
        lines.append(f"  {'total':<14} {'':<28} {'':<9} {self.total / mib:8.2f} MiB"
                     f"  (vmem_limit_bytes {self.limit / mib:.2f} MiB)")
        return "\n".join(lines)


def buffer(name, shape, dtype):
    d = jnp.dtype(dtype)
    return (name, tuple(int(s) for s in shape), d.name, math.prod(shape) * d.itemsize)


def kernel_vmem_from_hlo(text: str) -> list[dict]:
    """Per Pallas kernel (`tpu_custom_call`) in a compiled module's text: its
    name, the scoped VMEM it requested (`scoped_memory_configs`) and the VMEM
    Mosaic says it uses (`used_scoped_memory_configs`), in bytes."""
    import re

    out = []
    for m in re.finditer(r'custom_call_target="tpu_custom_call"', text):
        start = text.rfind("\n", 0, m.start()) + 1
        # One instruction may span lines (its frontend attributes do); it ends
        # where the next instruction or the computation does.
        nxt = re.compile(r"\n\s+(?:ROOT )?%|\n\}\n").search(text, m.start())
        line = text[start:nxt.start() if nxt else len(text)]
        name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) =", line)

        def vmem(key):
            cfg = re.search(r'"%s":\[([^\]]*)\]' % key, line)
            if not cfg:
                return None
            sizes = [int(s) for ms, s in re.findall(r'"memory_space":"(\d+)","offset":"\d+","size":"(\d+)"',
                                                       cfg.group(1)) if ms == "1"]
            return sum(sizes) if sizes else 0

        out.append(dict(name=name.group(1) if name else "?", requested=vmem("scoped_memory_configs"),
                        used=vmem("used_scoped_memory_configs")))
    return out


# --------------------------------------------------------------------------
# Streaming plans (kernels/all_gather_matmul_stream/): a half in row chunks
# --------------------------------------------------------------------------

DEFAULT_STREAM_WINDOW = 3
# Rows a step below which the streaming all-gather holds its weights in VMEM (read
# once a call, not once a step): a weight tile's HBM read (K tn 2 bytes) takes longer
# than its products with the step's rows (2 rows K tn flops) when rows < peak / hbm
# bandwidth, about 240 on v5e (197 TFLOP/s, 819 GB/s; cloud.google.com/tpu/docs/v5e)
# and 280 on v6e; 256 rounds it (FLUX's 512 text rows: 128 rows a step at tp=4).
FEW_ROWS = 256


@dataclasses.dataclass(frozen=True)
class StreamBlocks:
    """Block sizes asked of a streaming kernel; validated here, fitted by `fit_stream`.

    chunk_rows: rows of one chunk of a half (a multiple of the dtype's sublane
      rows), or None for the largest whose buffers fit VMEM.
    window: VMEM slots per direction a chunk may travel through (>= 2; the
      credits let a sender write only into a slot its neighbour has freed).
    col_tile_limit / row_tile_limit: the largest column tile (a multiple of
      128) and matmul row piece.
    depth_tile_limit: the largest depth chunk: both kernels take the contraction
      depth (the all-gather's K, each reduce-scatter pair's k_i) in chunks summed
      in float32 (`depth_tile`), so the dots Mosaic unrolls stay small.
    weights_in_vmem: all-gather kernel: hold every weight's column shard in
      VMEM, read from HBM once a call instead of once a step; None (default):
      when a step has fewer than `FEW_ROWS` rows and they fit.
    """

    chunk_rows: int | None = None
    window: int = DEFAULT_STREAM_WINDOW
    col_tile_limit: int = 512
    row_tile_limit: int = 512
    depth_tile_limit: int = 1024
    weights_in_vmem: bool | None = None

    def __post_init__(self):
        if self.weights_in_vmem not in (None, True, False):
            raise ValueError(f"StreamBlocks.weights_in_vmem must be None, True or False, got {self.weights_in_vmem!r}")
        ints = dict(window=self.window, col_tile_limit=self.col_tile_limit, row_tile_limit=self.row_tile_limit,
                    depth_tile_limit=self.depth_tile_limit)
        if self.chunk_rows is not None:
            ints["chunk_rows"] = self.chunk_rows
        for k, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"StreamBlocks.{k} must be a positive int, got {v!r}")
        if self.window < 2:
            raise ValueError(f"StreamBlocks.window must be >= 2 (a chunk is read in one slot while the "
                             f"next arrives in another), got {self.window}")
        for k in ("col_tile_limit", "depth_tile_limit"):
            if getattr(self, k) < LANES:
                raise ValueError(f"StreamBlocks.{k} must be >= {LANES}, got {getattr(self, k)}")


def neighbour_barrier(axis_name, neighbours) -> None:
    """Waits until both ring neighbours have entered this kernel instance (the
    `collective_id`'s barrier semaphore): nobody may write a chunk, a tile or a credit
    into a neighbour's kernel before it runs."""
    barrier = pltpu.get_barrier_semaphore()
    for nbr in neighbours:
        pl.semaphore_signal(barrier, 1, device_id={axis_name: nbr})
    pl.semaphore_wait(barrier, len(neighbours))


def credit_needed(t, W: int, skip_credit_at=None):
    """Whether a streaming kernel's send at step t waits one credit first: its
    downstream must have freed the slot of its step t + 1 - W (the credit protocol
    of kernels/all_gather_matmul_stream/). `skip_credit_at` (tests only): the
    step whose send goes without its credit."""
    needed = t + 1 - W >= 0
    return needed if skip_credit_at is None else needed & (t != skip_credit_at)


def signal_credit(t, W: int, T: int, P: int, credit, upstream, axis_name, skip_credit_at=None):
    """After step t of T (P a chunk) has freed slot t % W: one credit per direction to
    the upstream neighbour if upstream fills that slot next (step t + W is in range and
    not an own-chunk step). `skip_credit_at` as `credit_needed` (the signal it would
    meet is left out, so the counts balance)."""
    nxt = t + W
    owed = (nxt < T) & (nxt % P != 0)
    if skip_credit_at is not None:
        owed = owed & (t != skip_credit_at + 1 - W)

    @pl.when(owed)
    def _():
        for d in (0, 1):
            pl.semaphore_signal(credit.at[d], 1, device_id={axis_name: upstream[d]})


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """A fitted streaming plan: each half of h rows moves as `chunks` chunks of
    `chunk_rows` rows; chunk c starts at row `chunk_offset(c)` of its half, the
    last one shifted back to end at h (it overlaps the one before by
    chunks * chunk_rows - h rows, computed and written twice with the same
    values) when chunk_rows does not divide h."""

    half_rows: int
    chunk_rows: int
    chunks: int
    window: int
    col_tile: int
    row_tiles: tuple[tuple[int, int], ...]  # a step's row tiles, over the 2 B hc rows both kernels
    # multiply as one M operand (both directions, every batch)
    vmem: VmemPlan
    weights_in_vmem: bool = False  # all-gather: every weight tile held in VMEM, read once a call

    def __post_init__(self):
        h, hc, C = self.half_rows, self.chunk_rows, self.chunks
        if not 0 < hc <= h or C != -(-h // hc):
            raise ValueError(f"StreamPlan: {C} chunks of {hc} rows do not cover a {h}-row half")
        if self.window < 2 or self.col_tile % LANES:
            raise ValueError(f"StreamPlan: window {self.window} < 2 or column tile {self.col_tile}")
        covered = sum(sz for _, sz in self.row_tiles)
        if not covered or covered % hc:
            raise ValueError(f"StreamPlan: row pieces {self.row_tiles} do not cover whole chunks of {hc} rows")

    def chunk_offset(self, c: int) -> int:
        return min(c * self.chunk_rows, self.half_rows - self.chunk_rows)

    @property
    def overlap_rows(self) -> int:
        return self.chunks * self.chunk_rows - self.half_rows


def stream_chunk_rows(half_rows: int, n: int, unit: int) -> int:
    """Rows of each of `n` equal chunks covering a half: ceil(half / n) in whole `unit`s."""
    return -(-half_rows // (n * unit)) * unit


def fit_stream(half_rows: int, unit: int, blocks: StreamBlocks, candidates, what: str):
    """(reason, StreamPlan): the plan of the fewest chunks (largest chunk) that fits.

    With blocks.chunk_rows set, that chunk size only; else C = 1, 2, ... up to
    `MAX_CHUNKS`, chunk rows `stream_chunk_rows`, the fewest chunks C0 that fit,
    or, if C0's chunks do not tile the half exactly, the fewest of C0 .. 2 C0
    that do (Wan 480x832x81's 4096-row halves: 4 chunks of 1024 rather than 3 of
    1376, the last overlapping by 32 rows). `candidates(chunk_rows)` yields
    (VmemPlan, (col_tile, row_tiles[, weights_in_vmem])) pairs, best first."""
    cap = vmem_capacity_bytes()
    if blocks.chunk_rows is not None:
        if blocks.chunk_rows % unit or blocks.chunk_rows > half_rows:
            return (f"chunk_rows {blocks.chunk_rows} is not a multiple of {unit} rows within the "
                    f"{half_rows}-row half"), None
        sizes = [blocks.chunk_rows]
    else:
        sizes = []
        for n in range(1, min(half_rows // unit, MAX_CHUNKS) + 1):
            hc = stream_chunk_rows(half_rows, n, unit)
            if hc not in sizes:
                sizes.append(hc)
    plan, fits = None, []
    for hc in sizes:
        for plan, (tn, tiles, *rest) in candidates(hc):
            if plan.limit <= cap:
                fits.append(StreamPlan(half_rows, hc, -(-half_rows // hc), blocks.window, tn, tiles, plan, *rest))
                break
        if fits and blocks.chunk_rows is None:
            # the fewest chunks that fit, unless up to twice as many tile the half exactly
            # (no overlapping last chunk, whose rows would be multiplied twice)
            if fits[0].overlap_rows == 0 or fits[-1].overlap_rows == 0 or fits[-1].chunks >= 2 * fits[0].chunks:
                break
    if fits:
        exact = [p for p in fits if p.overlap_rows == 0]
        return None, (exact or fits)[0]
    need = "no plan" if plan is None else f"{plan.limit / 2**20:.1f} MiB needed"
    return (f"VMEM budget exceeded: {need} ({what}, chunks of {sizes[-1]} rows) > {cap / 2**20:.0f} MiB "
            f"on this chip"), None
