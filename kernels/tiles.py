"""Column tiles per kernel site: the table a tile sweep writes and the dispatch reads.

Both collective-matmul kernels multiply in column tiles of tn columns (a
multiple of 128 dividing every weight's width), by default the largest up to
512 that fits VMEM (`kernels._common.StreamBlocks.col_tile_limit`). Which tile
is fastest at a site is a property of the chip and the site's shapes (the
weight tile's DMA against its products with the step's rows, the output DMA
per tile, the float32 result Mosaic keeps per dot) that a compiled schedule
does not show: the estimator prices a kernel by its flops and bytes, which do
not depend on tn. So the tile is measured, per site:

    python -m difflet_tpu.tools.sweep_tiles --model wan:Wan2.1-T2V-14B --height 480 --width 832 \
        --frames 9 --out tiles-v5e.json           # on the TPU slice, times every candidate
    DIFFLET_TPU_KERNEL_TILES=tiles-v5e.json ...   # the dispatch then uses the fastest

A `Site` is one kernel call's static signature (per-rank shapes, dtype, ring
size, epilogue); the table maps each site's key to its tile, for one device
kind (a table measured on another chip is refused: `for_devices`). Sites not in
the table keep the default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

from difflet_tpu.kernels import _common

FORMAT = "difflet-tpu kernel tiles v1"
KINDS = ("ag", "rs")


@dataclasses.dataclass(frozen=True)
class Site:
    """One collective-matmul kernel call, as the dispatch makes it (per-rank shapes).

    kind "ag": x_shapes one [..., s, K], w_shapes [K, n_i] per weight, and per
    weight the bias's (rows, dtype) or None, the activation or None, the
    sum-of-squares flag, and the head-major epilogue (`Heads` fields: head_dim,
    norm, eps, rope, scale) or None (empty where no weight has one). kind "rs":
    x_shapes [..., S, k_i] and w_shapes [k_i, N] per pair (no epilogue).
    """

    kind: str
    x_shapes: tuple
    w_shapes: tuple
    dtype: str
    ring: int
    biases: tuple = ()
    activations: tuple = ()
    sum_squares: tuple = ()
    heads: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Site.kind must be one of {KINDS}, got {self.kind!r}")
        norm = lambda t: tuple(tuple(int(d) for d in s) for s in t)
        object.__setattr__(self, "x_shapes", norm(self.x_shapes))
        object.__setattr__(self, "w_shapes", norm(self.w_shapes))
        object.__setattr__(self, "biases", tuple(None if b is None else (int(b[0]), str(b[1]))
                                                 for b in self.biases))
        object.__setattr__(self, "activations", tuple(self.activations))
        object.__setattr__(self, "sum_squares", tuple(bool(q) for q in self.sum_squares))
        heads = tuple(None if h is None else tuple(h) for h in self.heads)
        object.__setattr__(self, "heads", heads if any(h is not None for h in heads) else ())

    @property
    def widths(self) -> list[int]:
        """The widths a column tile must divide: every n_i (ag), N (rs)."""
        return [w[1] for w in self.w_shapes] if self.kind == "ag" else [self.w_shapes[0][1]]

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "Site":
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """Column tiles by site for one device kind (hashable: it rides in `Parallel`)."""

    device_kind: str
    tiles: tuple  # ((site key, column tile), ...)

    def col_tile(self, site: Site) -> int | None:
        return dict(self.tiles).get(site.key())

    def blocks(self, site: Site) -> _common.StreamBlocks | None:
        """The block sizes the dispatch asks for at `site`: the table's column tile as
        the limit (the plan takes it when it fits VMEM), or None (the defaults)."""
        tn = self.col_tile(site)
        return None if tn is None else _common.StreamBlocks(col_tile_limit=tn)

    def for_devices(self, device_kind: str) -> "KernelTiles":
        """This table, checked against the devices it is about to steer."""
        if device_kind != self.device_kind:
            raise ValueError(f"kernel tile table measured on {self.device_kind!r}, these devices are "
                             f"{device_kind!r}: sweep again on this chip (python -m difflet_tpu.tools.sweep_tiles)")
        return self


def load(path: str) -> KernelTiles:
    """The table at `path`, validated: format, device kind, every site and tile."""
    if os.path.isdir(path):
        raise ValueError(f"kernel tile table {path!r} is a directory; give the JSON file python -m "
                         f"difflet_tpu.tools.sweep_tiles wrote")
    if not os.path.isfile(path):
        raise ValueError(f"kernel tile table {path!r} does not exist")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"kernel tile table {path!r} is not readable JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"kernel tile table {path!r}: format is not {FORMAT!r}")
    kind = data.get("device_kind")
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kernel tile table {path!r}: no device_kind")
    tiles = {}
    for i, row in enumerate(data.get("sites", [])):
        try:
            site, tn = Site.from_dict(row["site"]), row["col_tile"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"kernel tile table {path!r}: site {i} is malformed ({e})") from None
        if tn is None:  # swept without a ranking (compile-only): no choice
            continue
        if (not isinstance(tn, int) or isinstance(tn, bool) or tn < _common.LANES
                or any(tn % _common.LANES or n % tn for n in site.widths)):
            raise ValueError(f"kernel tile table {path!r}: site {i}: column tile {tn!r} is not a multiple of "
                             f"{_common.LANES} dividing the widths {site.widths}")
        tiles[site.key()] = tn
    return KernelTiles(kind, tuple(sorted(tiles.items())))


def save(path: str, device_kind: str, rows: list[dict], **meta) -> None:
    """Writes a table: rows of {"site": Site as dict, "col_tile": int or None, ...}."""
    from difflet_tpu import checks  # a temporary file and a rename: a reader never sees half a table

    checks.write_atomic(path, json.dumps(dict(format=FORMAT, device_kind=device_kind, **meta, sites=rows),
                                         indent=1) + "\n", "kernel tile table")


# --------------------------------------------------------------------------
# Recording the sites a step calls (the sweep's input)
# --------------------------------------------------------------------------

_recorders: list[list] = []


@contextlib.contextmanager
def recording():
    """Collects (Site, StreamBlocks or None) for every kernel call the dispatch
    makes while tracing inside the block."""
    seen: list = []
    _recorders.append(seen)
    try:
        yield seen
    finally:
        _recorders.remove(seen)


def record(site: Site, blocks) -> None:
    for seen in _recorders:
        seen.append((site, blocks))
