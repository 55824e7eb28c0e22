"""Device meshes whose `tp` rings follow the physical ICI links.

The sequence-parallel rings send each chunk to ring neighbours
(`axis_index +- 1` on `tp`), so neighbours in a `tp` group must be neighbours
on the chip interconnect, the last one included (the ring closes). On a v5e
2x2 (no wraparound links) the 4-ring is devices 0,1,3,2, every hop a direct
link; `np.array(devices)` gives 0,1,2,3, whose hops 1->2 and 3->0 are diagonal
(two ICI hops on shared links).

A mesh has up to three axes, in this order (outermost first):

* `cfg`: classifier-free guidance. The unconditional and the conditional rows
  of a CFG batch go to the two `cfg` groups; the guidance combine is the one
  collective over it (`difflet_tpu.pipeline.denoise`).
* `data`: more batch rows (several prompts or videos per call).
* `tp`: the tensor / sequence-parallel ring (`Parallel` names only this axis).

Parameters are sharded over `tp` only (replicated over `cfg` and `data`);
step inputs with a batch axis are split over `cfg` x `data` (the Runner's
`BATCH` placeholder in a port's PartitionSpecs). `make_mesh` keeps only the
`cfg` / `data` axes asked for (size > 1), so a plain TP/SP mesh is the 1-D
`tp` mesh it always was.

Ring order: on TPU the devices' chip coordinates are known, and each `tp`
group is a block of the chip grid walked as a closed ring of unit hops (a
2 x n block: along one row and back along the other; larger even blocks: a
boustrophedon that returns along the first column). `jax.make_mesh` does not
guarantee that for a multi-axis mesh (on a v5e 2x4 its 4-groups have diagonal
hops, on a 4x4 its 8-rings a hop of 4), so the rings are built here; on CPU,
the devices' order (process by process) is used.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys

TP = "tp"      # the tensor/sequence-parallel axis
CFG = "cfg"    # classifier-free guidance: [unconditional | conditional] rows
DATA = "data"  # more batch rows
AXES = (CFG, DATA, TP)  # mesh axis order, outermost first
BATCH_AXES = (CFG, DATA)
# Placeholder for a port's PartitionSpecs: "this array axis is the batch".
# The Runner replaces it by the mesh's batch axes (`cfg`, `data`) or None.
BATCH = "batch"


def parse_mesh(value: str) -> dict[str, int]:
    """"cfg=2,tp=4" -> {"cfg": 2, "tp": 4}; axes cfg, data and tp, each once, sizes >= 1.

    Raises ValueError naming what is wrong."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"mesh {value!r}: expected AXIS=SIZE[,AXIS=SIZE...] with axes {', '.join(AXES)}, "
                         f"e.g. cfg=2,tp=4")
    out = {}
    for part in value.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*=\s*(\d+)\s*", part)
        if not m:
            raise ValueError(f"mesh {value!r}: {part.strip()!r} is not AXIS=SIZE (e.g. cfg=2,tp=4)")
        axis, size = m.group(1), int(m.group(2))
        if axis not in AXES:
            raise ValueError(f"mesh {value!r}: unknown axis {axis!r}; axes are {', '.join(AXES)}")
        if axis in out:
            raise ValueError(f"mesh {value!r}: axis {axis!r} given twice")
        if size < 1:
            raise ValueError(f"mesh {value!r}: {axis}={size}, sizes must be >= 1")
        out[axis] = size
    return out


def format_mesh(shape: dict) -> str:
    """{"cfg": 2, "tp": 4} -> "cfg=2,tp=4" (axes in mesh order)."""
    return ",".join(f"{a}={shape[a]}" for a in AXES if a in shape)


def make_mesh(tp: int | None = None, devices=None, *, cfg: int = 1, data: int = 1):
    """A mesh of `cfg` x `data` x `tp` devices (all of them by default: `tp`
    takes what `cfg` and `data` leave).

    Axes of size 1 other than `tp` are left out, so `make_mesh(4)` is the 1-D
    `tp` mesh. Each `tp` group is a ring in ICI order on TPU (`ring_groups`);
    with several processes (`difflet_tpu.parallel.distributed`) `devices` defaults to
    every process's devices.
    """
    import jax
    import numpy as np

    devices = list(jax.devices() if devices is None else devices)
    for name, n in (("tp", tp), ("cfg", cfg), ("data", data)):
        if n is None and name == "tp":
            continue
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"make_mesh: {name}={n!r} must be an int >= 1 (devices available: {len(devices)})")
    tp, cfg, data = (None if tp is None else int(tp)), int(cfg), int(data)
    outer = cfg * data
    if tp is None:
        if len(devices) % outer:
            raise ValueError(f"make_mesh: cfg={cfg} x data={data} does not divide {len(devices)} devices")
        tp = len(devices) // outer
    if tp < 1 or tp * outer > len(devices):
        raise ValueError(f"make_mesh: cfg={cfg} x data={data} x tp={tp} = {tp * outer} devices, "
                         f"but {len(devices)} are available")
    groups = ring_groups(devices, tp, outer)
    shape = {CFG: cfg, DATA: data, TP: tp}
    names = tuple(a for a in AXES if a == TP or shape[a] > 1)
    arr = np.array([d for g in groups for d in g], dtype=object).reshape(tuple(shape[a] for a in names))
    return jax.sharding.Mesh(arr, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def mesh_shape(mesh) -> dict[str, int]:
    """{"cfg": c, "data": d, "tp": t} of a mesh (absent axes: 1)."""
    return {a: (mesh.shape[a] if a in mesh.axis_names else 1) for a in AXES}


def batch_axes(mesh) -> tuple[str, ...]:
    """The mesh's batch axes (`cfg`, `data`) present, in mesh order."""
    return tuple(a for a in BATCH_AXES if mesh is not None and a in mesh.axis_names)


def batch_ways(mesh) -> int:
    """How many ways the batch is split: cfg x data (1 without those axes)."""
    return math.prod(mesh.shape[a] for a in batch_axes(mesh)) if mesh is not None else 1


def ring_order(mesh) -> list[int]:
    """Device ids in the order of the mesh's `tp` axis (the first `tp` group's ring
    for a multi-axis mesh; `tp_groups` gives every group)."""
    return tp_groups(mesh)[0]


def tp_groups(mesh) -> list[list[int]]:
    """Device ids of every `tp` group, each in ring order."""
    arr = mesh.devices
    i = mesh.axis_names.index(TP)
    arr = arr.transpose([a for a in range(arr.ndim) if a != i] + [i])
    return [[d.id for d in g] for g in arr.reshape(-1, mesh.shape[TP])]


def ring_hops(order: list, coords: dict) -> list[int]:
    """ICI hops (Manhattan distance of chip coordinates) between ring neighbours,
    the closing hop last."""
    return [sum(abs(a - b) for a, b in zip(coords[x], coords[y])) for x, y in zip(order, order[1:] + order[:1])]


# --------------------------------------------------------------------------
# Rings on the chip grid
# --------------------------------------------------------------------------

def _cycle(rows: int, cols: int) -> list[tuple[int, int]] | None:
    """A closed walk of unit steps over every cell of a rows x cols grid, or None
    if there is none (a grid graph has a Hamiltonian cycle iff both sides are
    >= 2 and the cell count is even; 1x1 and 1x2 are trivially rings)."""
    if rows * cols <= 2:
        return [(r, c) for r in range(rows) for c in range(cols)]
    if min(rows, cols) < 2 or (rows * cols) % 2:
        return None
    if rows % 2:  # walk the transpose: its row count is even
        return [(r, c) for c, r in _cycle(cols, rows)]
    out = [(0, c) for c in range(cols)]  # along the first row
    for r in range(1, rows):  # snake back and forth over columns 1.. (ends in column 1)
        cs = range(cols - 1, 0, -1) if r % 2 else range(1, cols)
        out += [(r, c) for c in cs]
    out += [(r, 0) for r in range(rows - 1, 0, -1)]  # home along column 0
    return out


def _coords(d):
    c = getattr(d, "coords", None)
    if c is None:
        return None
    return tuple(int(x) for x in c) + (int(getattr(d, "core_on_chip", 0)),)


def ring_groups(devices, tp: int, groups: int) -> list[list]:
    """`groups` lists of `tp` devices, each in ring order.

    TPU devices (chip coordinates known, one core per chip as on v5e / v6e):
    the chip grid is cut into blocks of `tp` chips that each have a closed
    ring of unit hops, the most square such block shape first, blocks taken
    in row-major order. Anything else (CPU devices, a grid the blocks do not
    tile): the devices' own order, with `jax.make_mesh`'s order for a
    single ring on TPU.
    """
    devices = list(devices)
    need = tp * groups
    coords = [_coords(d) for d in devices]
    if all(c is not None for c in coords) and len({c for c in coords}) == len(coords):
        blocks = _grid_blocks(devices, coords, tp, groups)
        if blocks is not None:
            return blocks
        if groups == 1:
            import jax

            m = jax.make_mesh((tp,), (TP,), devices=devices[:tp], axis_types=(jax.sharding.AxisType.Auto,))
            return [list(m.devices.reshape(-1))]
    return [devices[g * tp:(g + 1) * tp] for g in range(groups)]


def _grid_blocks(devices, coords, tp, groups):
    by = {c: d for c, d in zip(coords, devices)}
    dims = [max(c[i] for c in by) + 1 for i in range(4)]
    if math.prod(dims) != len(by) or dims[2] != 1 or dims[3] != 1:  # a full 2-D grid, one core per chip
        return None
    X, Y = dims[0], dims[1]
    shapes = []
    for bx in range(1, X + 1):
        if X % bx or tp % bx:
            continue
        byy = tp // bx
        if Y % byy:
            continue
        if _cycle(byy, bx) is None:
            continue
        shapes.append((abs(bx - byy), -bx, bx, byy))
    if not shapes:
        return None
    _, _, bx, byy = min(shapes)  # the most square block; ties: wider in x
    nblocks = (X // bx) * (Y // byy)
    if nblocks < groups:
        return None
    ring = _cycle(byy, bx)  # (row = y, col = x) within the block
    out = []
    for oy, ox in itertools.product(range(0, Y, byy), range(0, X, bx)):
        out.append([by[(ox + c, oy + r, 0, 0)] for r, c in ring])
    return out[:groups]


# --------------------------------------------------------------------------
# CPU devices for tests and the CPU bench
# --------------------------------------------------------------------------

MAX_CPU_DEVICES = 64  # virtual CPU devices: a large count only stalls the host


def use_cpu_devices(n: int) -> None:
    """Makes `n` virtual CPU devices available, for tests and the CPU bench.

    Call before jax creates its backends. Sets the CPU platform only when no
    platform was chosen (a machine with libtpu installed would otherwise try to
    open a TPU). Raises if jax already runs with fewer devices, and for `n`
    outside [1, MAX_CPU_DEVICES] (each device is a thread pool of this host).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CPU_DEVICES:
        raise ValueError(f"use_cpu_devices({n!r}): the number of virtual CPU devices must be an int in "
                         f"[1, {MAX_CPU_DEVICES}]")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "jax" in sys.modules:
        import jax
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            have = jax.local_device_count()
            if have < n:
                raise RuntimeError(
                    f"jax was initialised with {have} devices before use_cpu_devices({n}); "
                    f"call it before any jax computation, or set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax")
            return
        jax.config.update("jax_num_cpu_devices", n)
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
