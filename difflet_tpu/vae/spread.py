"""One video's VAE decode spread over the devices of a mesh: a spatial split, exact.

The video decoders (the causal-3D family: Wan 2.x, Qwen-Image; HunyuanVideo's; LTX-2's) all
decode this way; what follows is said of the causal-3D decoder, then what the other two add.

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

HunyuanVideo's decoder (`hunyuan_video.py`) and LTX-2's (`ltx2_video.py`) add:

- convolutions padded by repeating the edge row (HunyuanVideo's `replicate`) or by reflecting
  about it (LTX-2's `reflect`): `halo(x, pad, mode)` exchanges the same rows, then the rows
  outside the image (before row 0 on the first rank; from the last real row on, wherever the
  real rows end) are set from the rows the one-device padding copies, all inside the rank's
  window (its rows and the halos), by `dynamic_update_slice`;
- GroupNorm statistics over every frame and position (HunyuanVideo): each rank sums its real
  rows, `psum` adds the ranks' sums, `size` counts the real elements (two passes, as torch);
- the mid-block attention over all T*H*W tokens with the frame-causal mask: local queries,
  the normed input all-gathered for the keys and values (`gather`);
- depth-to-space upsampling, nearest upsampling in time and space, unpatchify, per-pixel
  norms (LTX-2's RMS and LayerNorm over channels), 1x1x1 convolutions and the time padding:
  per pixel or along time, local.

`Split` is the trace-time context (`active`); the layers call `halo` / `gather` /
`mask` / `psum` / `size`, which do nothing outside a spread decode. `decode` runs a decode
function under `jax.shard_map` with the split active; `apply` does it for an `nnx` module
(the VAE's `__call__`), and `choose` says whether and along which axis a decode of a batch
of latents spreads (`Config.vae_spread`, `DIFFLET_TPU_VAE_SPREAD`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from difflet_tpu import config

AXES = ("height", "width")
PAD_MODES = ("zeros", "edge", "reflect")  # a convolution's spatial padding: torch's zeros, replicate, reflect
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


def halo(x, pad: int, mode: str = "zeros"):
    """Before a 'same' convolution of padding `pad` over H and W (`mode`: zeros, edge copies
    or reflection, `PAD_MODES`): `x` with `pad` rows of each neighbour along the split axis,
    the rows outside the image as `mode` pads them, and the H, W padding the convolution
    still needs (0 on the split axis; `jnp.pad` the rest in `mode`). Outside a spread
    decode: `x` and (`pad`, `pad`) on both."""
    if mode not in PAD_MODES:
        raise ValueError(f"spread decode: padding mode {mode!r} is not one of {PAD_MODES}")
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
    window = jnp.concatenate([above, x, below], axis=dim)  # global rows rank * n - pad ... rank * n + n + pad
    if mode != "zeros":  # ppermute's zeros are the zero padding; the other modes copy rows
        window = _pad_rows(window, s, n, pad, mode, dim)
    pads[s.dim + 3] = (0, 0)
    return window, pads


def _pad_rows(window, s: Split, n: int, pad: int, mode: str, dim: int):
    """The rows of `window` outside the image set as the one-device `mode` padding sets them:
    rows -1 .. -pad (the first rank) from rows 0 (edge) or 1 .. pad (reflect); rows real ..
    real + pad - 1 from row real - 1 (edge) or real - 2 .. real - 1 - pad (reflect), on the
    rank whose window holds them with real rows of its own (elsewhere they are padding no
    real output reads)."""
    rank = jax.lax.axis_index(s.names)
    flip = mode == "reflect"

    def rows(start, count):  # rows start .. start + count - 1 of the window (start clipped into it)
        return jax.lax.dynamic_slice_in_dim(window, start, count, axis=dim)

    def edge_or_reflect(last, image_after: bool):
        """The `pad` rows of padding beside the image's edge row `last` (a window position): before
        it when the image lies after it (the top edge), else after it (the bottom edge)."""
        if not flip:
            return jnp.concatenate([rows(last, 1)] * pad, axis=dim)
        src = rows(last + 1, pad) if image_after else rows(last - pad, pad)
        return jnp.flip(src, axis=dim)

    top = jax.lax.slice_in_dim(window, 0, pad, axis=dim)
    top = jnp.where(rank == 0, edge_or_reflect(pad, True), top)  # image row 0 at window position pad
    window = jax.lax.dynamic_update_slice_in_dim(window, top, 0, axis=dim)
    real = s.rows * (n // s.local)  # the real rows at this resolution
    end = real - rank * n + pad  # window position of row `real` (the first row past the image)
    start = jnp.clip(end, 0, n + pad)
    fix = (end > pad) & (end <= n + pad)  # this rank has real rows and its window reaches past them
    bottom = jnp.where(fix, edge_or_reflect(jnp.clip(end - 1, 0, n + 2 * pad - 1), False), rows(start, pad))
    return jax.lax.dynamic_update_slice_in_dim(window, bottom, start, axis=dim)


def psum(x):
    """`x` (a partial sum over this rank's rows) summed over the split's ranks; unchanged
    outside a spread decode. The caller masks the padded rows out of its sum (`mask`)."""
    s = current()
    return x if s is None else jax.lax.psum(x, s.names)


def size(x) -> int:
    """The element count of the whole image (every rank's real rows) that `x` holds a band of;
    `x.size` outside a spread decode."""
    s = current()
    return x.size if s is None else x.size // x.shape[s.dim] * s.real(x)


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


def choose(mesh: Mesh | None, shape, spread: str | None = None, axis: str | None = None) -> str | None:
    """The axis ("height" / "width") a decode of NCTHW latents of `shape` splits over the
    devices of `mesh`, or None for the batch-sharded / one-device decode. `spread` ("auto",
    "on", "off"; None: `Config.vae_spread`, `DIFFLET_TPU_VAE_SPREAD`): "auto" spreads when
    the mesh has more than one device and they do not divide the batch; "on" whenever the
    mesh has more than one device. `axis` None: `choose_axis`."""
    spread = config.Config.from_env().vae_spread if spread is None else spread
    if spread not in config.SPREAD_VALUES:
        raise ValueError(f"spread: {spread!r} is not one of {config.SPREAD_VALUES}")
    n = 1 if mesh is None else mesh.size
    if spread == "off" or n == 1 or (spread == "auto" and shape[0] % n == 0):
        return None
    return plan(mesh, shape[3], shape[4], axis).axis


def apply(module: nnx.Module, z, axis: str | None):
    """`module(z)` (a VAE's decode of NCTHW latents), spread over `module.mesh` along `axis`
    (`decode`), or on its own when `axis` is None. Call under `jax.jit`."""
    if axis is None:
        return module(z)
    graphdef, state = nnx.split(module)
    return decode(lambda state, z: nnx.merge(graphdef, state)(z), state, z, module.mesh, axis)


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
