"""One video's causal-3D decode spread over the devices of a mesh: a spatial split, exact.

Why spatial: the decoder runs latent frame after latent frame, each chunk reading the
causal cache (`causal3d.FeatCache`) the chunk before wrote, so temporal chunks cannot
run side by side; the cache is per pixel (a conv's last two input frames), so a split
of the rows keeps it local. Every device holds a band of rows (the height split) or
columns (the width split) of every frame, at every resolution of the decoder:

- a spatial 3x3 convolution (`layers.conv2d`, `causal3d.CausalConv3d`, the resample
  convs) first takes one row from each neighbour (`halo`: two `lax.ppermute`s); the
  first and last ranks receive nothing, and `ppermute` fills what a rank does not
  receive with zeros, which is the convolution's own zero padding;
- nearest 2x upsampling, `DupUp3D`, Wan 2.2's unpatchify, the RMS norms (over
  channels), SiLU and the 1x1 / (3, 1, 1) convolutions act per pixel: local;
- the mid-block attention (one head over each frame's H*W positions, at the lowest
  resolution) keeps its queries local and all-gathers the keys and values (`gather`);
- the output is as the one-device decode's (the same arithmetic per pixel; XLA may
  pick other convolution kernels for other shapes, so float32 agrees to ~1e-6).

Rows that do not divide over the ranks: the latents are zero-padded at the end to a
multiple (`Split.local` rows per rank), and every padded row is kept at zero before each
spatial convolution (`mask`: a rank compares its global row index, from
`lax.axis_index`, with the real row count of that resolution), so it reads exactly as
the zero padding; the attention gathers only the real rows as keys; the padded output
rows are cut. Rank-dependent values are runtime values (`lax.axis_index`), never
Python constants per rank.

`Split` is the trace-time context (`active`); the layers call `halo` / `gather` /
`mask`, which do nothing outside a spread decode. `decode` runs a decode function
under `jax.shard_map` with the split active.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

AXES = ("height", "width")
_DIM = {"height": -3, "width": -2}  # channels-last [..., H, W, C]


@dataclasses.dataclass(frozen=True)
class Split:
    """A spatial split: `rows` latent rows (or columns) of `axis` over the `size` ranks of
    the mesh axes `names`, `local` per rank (the last ranks' padded at the end)."""

    names: tuple[str, ...]
    size: int
    axis: str
    rows: int
    local: int

    @property
    def dim(self) -> int:
        return _DIM[self.axis]

    @property
    def even(self) -> bool:
        return self.rows == self.size * self.local

    def real(self, x) -> int:
        """The real rows of `x`'s resolution (`x` holds `local` x scale rows per rank)."""
        return self.rows * (x.shape[self.dim] // self.local)


_ACTIVE: contextvars.ContextVar[Split | None] = contextvars.ContextVar("difflet_vae_split", default=None)


@contextlib.contextmanager
def active(split: Split):
    token = _ACTIVE.set(split)
    try:
        yield split
    finally:
        _ACTIVE.reset(token)


def current() -> Split | None:
    return _ACTIVE.get()


def mask(x):
    """`x` with the padded rows (global index >= the real rows) zeroed; unchanged when the
    rows divide evenly or outside a spread decode."""
    s = current()
    if s is None or s.even:
        return x
    n, dim = x.shape[s.dim], x.ndim + s.dim
    row = jax.lax.axis_index(s.names) * n + jax.lax.broadcasted_iota(jnp.int32, x.shape, dim)
    return jnp.where(row < s.real(x), x, jnp.zeros((), x.dtype))


def halo(x, pad: int):
    """Before a 'same' convolution of zero padding `pad` over H and W: `x` with `pad` rows of
    each neighbour along the split axis (zeros at the first and last ranks), and the H, W
    zero padding the convolution still needs (0 on the split axis). Outside a spread
    decode: `x` and (`pad`, `pad`) on both."""
    s = current()
    pads = [(pad, pad), (pad, pad)]
    if s is None or pad == 0:
        return x, pads
    x = mask(x)
    n, dim = x.shape[s.dim], x.ndim + s.dim
    if pad > n:
        raise ValueError(f"spread decode: a halo of {pad} rows needs >= {pad} rows per rank, got {n}")
    down = [(i, i + 1) for i in range(s.size - 1)]  # rank i's last rows become rank i+1's top halo
    up = [(i + 1, i) for i in range(s.size - 1)]
    above = jax.lax.ppermute(jax.lax.slice_in_dim(x, n - pad, n, axis=dim), s.names, down)
    below = jax.lax.ppermute(jax.lax.slice_in_dim(x, 0, pad, axis=dim), s.names, up)
    pads[s.dim + 3] = (0, 0)
    return jnp.concatenate([above, x, below], axis=dim), pads


def gather(x):
    """Every rank's rows of `x` along the split axis (padded rows dropped): the mid-block
    attention's keys and values. Outside a spread decode: `x`."""
    s = current()
    if s is None:
        return x
    real = s.real(x)
    x = jax.lax.all_gather(x, s.names, axis=x.ndim + s.dim, tiled=True)
    return jax.lax.slice_in_dim(x, 0, real, axis=x.ndim + s.dim)


def choose_axis(height: int, width: int, size: int) -> str:
    """The split axis for latents of `height` x `width` over `size` ranks: the width when it
    divides, else the height when it divides, else the width (padded). The width first:
    compiled for v5e:2x2 at 480x832x81 (both divide), the width split is the faster and
    smaller (docs/benchmarks.md, an estimate)."""
    if width % size and height % size == 0:
        return "height"
    return "width"


def plan(mesh: Mesh, height: int, width: int, axis: str | None = None) -> Split:
    """The split of latents `height` x `width` over every device of `mesh` (`axis`: None chooses)."""
    axis = axis or choose_axis(height, width, mesh.size)
    if axis not in AXES:
        raise ValueError(f"spread decode: axis {axis!r} is not one of {AXES}")
    rows = height if axis == "height" else width
    return Split(tuple(mesh.axis_names), mesh.size, axis, rows, -(-rows // mesh.size))


def decode(fn, state, z, mesh: Mesh, axis: str | None = None, *, frames_last: bool = False):
    """`fn(state, z)` (a decode of NCTHW latents `z` to NCTHW pixels, a fixed factor per
    latent row) with the rows of `z` spread over `mesh` (see the module docstring);
    `state` (the parameters) replicated. `frames_last`: `fn` returns (NTHWC frames, a
    finite flag), the flag true when it is on every rank. Call under `jax.jit`."""
    split = plan(mesh, z.shape[3], z.shape[4], axis)
    zdim = 3 if split.axis == "height" else 4
    odim = zdim - 1 if frames_last else zdim  # the split axis of the output
    padded = split.size * split.local
    if padded != split.rows:
        z = jnp.pad(z, [(0, padded - split.rows if d == zdim else 0) for d in range(z.ndim)])
    spec = PartitionSpec(*[split.names if d == zdim else None for d in range(z.ndim)])
    out_spec = PartitionSpec(*[split.names if d == odim else None for d in range(z.ndim)])

    def body(state, z):
        with active(split):
            out = fn(state, z)
        if frames_last:
            frames, finite = out
            return frames, jax.lax.pmin(finite.astype(jnp.int32), split.names) > 0
        return out

    out_specs = (out_spec, PartitionSpec()) if frames_last else out_spec
    out = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(), spec), out_specs=out_specs)(state, z)
    frames = out[0] if frames_last else out
    scale = frames.shape[odim] // padded
    frames = jax.lax.slice_in_dim(frames, 0, split.rows * scale, axis=odim)
    return (frames, out[1]) if frames_last else frames
