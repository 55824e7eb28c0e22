"""Block-sparse video self-attention: the host-side plans (issue 43).

The masks here are built once per shape, on the host, in numpy; the kernel that
skips their empty blocks is jax's splash attention (`layers/sdpa.py`), which
takes any `Mask` it can slice (`BlockMask` below). Two families, both static and
training-free:

* **Sliding tile attention** (STA; Zhang et al., "Fast Video Generation with
  Sliding Tile Attention", ICML 2025, arXiv 2502.04507). The latent grid
  `(t, h, w)` is cut into tiles of `tile = (tt, th, tw)` tokens; tokens are
  reordered tile by tile (`TileLayout.order`), so each tile is one kernel block
  of `tt * th * tw` tokens, and a query tile attends the key tiles inside a
  window of `window = (wt, wh, ww)` tiles around it. At the grid's border the
  window is shifted inside, as STA does, so every query tile sees the same
  number of key tiles. Every block is dense or empty: nothing is computed and
  then masked away.
* **Radial attention** (Li et al., "Radial Attention: O(n log n) Sparse
  Attention with Energy Decay for Long Video Generation", NeurIPS 2025,
  arXiv 2506.19852; the mask of github.com/mit-han-lab/radial-attention,
  `radial_attn/attn_mask.py`). Tokens stay in frame-major order. Frames at
  distance `d` attend along a diagonal band whose width halves with each power
  of two of `d` (`decay`), floored at one block; once the band would be
  narrower than a block, only every `2**k`-th frame distance is kept. Adjacent
  frames (and, for Wan, the first frame: an attention sink) stay dense. The
  token mask is shrunk to kernel blocks as the reference does (a block is kept
  when most of its non-empty columns are dense), so the kernel's mask is the
  block mask, exactly.

`parse("sta:window=3,3,3,full_steps=10")` reads the option every entry point
takes (`attention=` on a pipeline call, `--attention` on generate and the bench).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np

KINDS = ("dense", "sta", "radial")
LANE = 128  # splash's key blocks are multiples of it (layers/sdpa.LANE)
MAX_TILE = 1024  # one tile is one q and one kv block: splash's VMEM envelope (sdpa.MAX_BLOCK_PAIR) holds 1024 x 1024
TILE_PAD_CAP = 1 / 8  # at most this share of the padded grid may be pad tokens
STA_DEFAULT_DENSITY = 0.30  # `--attention sta` alone: the widest window whose density stays at or below this
RADIAL_BLOCK = 128  # the reference's block (its kernels take 64 or 128)
SMEM_METADATA_BUDGET = 256 * 1024  # = layers/sdpa.SMEM_METADATA_BUDGET (sdpa imports this module lazily)


class SparsityError(ValueError):
    """An attention option or a window the shape cannot take."""


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """A parsed `attention=` option. `window` / `tile` None: chosen per shape (`plan_sta`)."""

    kind: str = "dense"
    window: tuple[int, int, int] | None = None
    tile: tuple[int, int, int] | None = None
    full_steps: int = 0
    decay: float = 0.5  # radial: the reference's `decay_factor`
    sink: bool = True   # radial: the first frame attended by every frame (the reference does so for Wan)

    @property
    def dense(self) -> bool:
        return self.kind == "dense"

    def spec(self) -> str:
        """The option as `parse` reads it back (for reports)."""
        if self.dense:
            return "dense"
        parts = [f"{k}={','.join(map(str, v))}" for k, v in (("window", self.window), ("tile", self.tile)) if v]
        if self.kind == "radial":
            parts += [f"decay={self.decay}", f"sink={int(self.sink)}"]
        parts.append(f"full_steps={self.full_steps}")
        return f"{self.kind}:{','.join(parts)}"

    def dense_at(self, step: int) -> bool:
        """Whether denoise step `step` (0-based) runs dense attention."""
        return self.dense or step < self.full_steps


def _ints(name: str, text: str, n: int) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SparsityError(f"attention option {name}={text!r}: expected {n} integers separated by commas") from None
    if len(vals) != n or min(vals) < 1:
        raise SparsityError(f"attention option {name}={text!r}: expected {n} positive integers (t, h, w)")
    return vals


def parse(text: str | None) -> SparseAttention:
    """`"dense"`, `"sta"`, `"sta:window=T,H,W,tile=T,H,W,full_steps=N"` or
    `"radial:decay=F,sink=0|1,full_steps=N"` -> `SparseAttention`; anything else is a
    `SparsityError` naming what is allowed."""
    if text is None or text == "dense":
        return SparseAttention()
    if not isinstance(text, str):
        raise SparsityError(f"attention must be a string such as 'sta' or 'radial:full_steps=10', got {text!r}")
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise SparsityError(f"attention {text!r}: the kind must be one of {', '.join(KINDS)}")
    allowed = {"dense": (), "sta": ("window", "tile", "full_steps"), "radial": ("decay", "sink", "full_steps")}[kind]
    fields: dict = {}
    # values may contain commas (window=3,3,3): split on "," only before a "name="
    parts = rest.split(",") if rest else []
    items, cur = [], None
    for p in parts:
        if "=" in p:
            cur = p.split("=", 1)
            items.append(cur)
        elif cur is not None:
            cur[1] += "," + p
        else:
            raise SparsityError(f"attention {text!r}: expected name=value pairs ({', '.join(allowed) or 'none'})")
    for name, value in items:
        if name not in allowed:
            raise SparsityError(f"attention {text!r}: unknown option {name!r} for {kind} "
                                f"(allowed: {', '.join(allowed) or 'none'})")
        if name in fields:
            raise SparsityError(f"attention {text!r}: {name} given twice")
        if name in ("window", "tile"):
            fields[name] = _ints(name, value, 3)
        elif name == "full_steps":
            try:
                fields[name] = int(value)
            except ValueError:
                raise SparsityError(f"attention {text!r}: full_steps must be an integer") from None
            if fields[name] < 0:
                raise SparsityError(f"attention {text!r}: full_steps must be >= 0")
        elif name == "decay":
            try:
                fields[name] = float(value)
            except ValueError:
                raise SparsityError(f"attention {text!r}: decay must be a number") from None
            if not 0 < fields[name] <= 1:
                raise SparsityError(f"attention {text!r}: decay must be in (0, 1]")
        elif name == "sink":
            if value not in ("0", "1"):
                raise SparsityError(f"attention {text!r}: sink must be 0 or 1")
            fields[name] = value == "1"
    return SparseAttention(kind=kind, **fields)


# --------------------------------------------------------------------------
# Sliding tile attention
# --------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """The latent grid `(t, h, w)` (tokens, frame-major as the ports patchify) cut into tiles."""

    grid: tuple[int, int, int]
    tile: tuple[int, int, int]

    def __post_init__(self):
        if len(self.grid) != 3 or len(self.tile) != 3 or min(self.grid) < 1 or min(self.tile) < 1:
            raise SparsityError(f"a tile layout needs a (t, h, w) grid and tile of positive sizes, "
                                f"got grid {self.grid}, tile {self.tile}")
        if any(t > g for t, g in zip(self.tile, self.grid)):
            raise SparsityError(f"tile {self.tile} is larger than the latent grid {self.grid} along an axis")

    @property
    def tiles(self) -> tuple[int, int, int]:
        """Tiles per axis (the last one along an axis padded)."""
        return tuple(_ceil_div(g, t) for g, t in zip(self.grid, self.tile))

    @property
    def block(self) -> int:
        """Tokens per tile: one kernel block."""
        return math.prod(self.tile)

    @property
    def padded_tokens(self) -> int:
        return math.prod(self.tiles) * self.block

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    def order(self) -> np.ndarray:
        """int64 `[padded_tokens]`: for each position of the tile-major sequence, the
        frame-major token it holds, or -1 for a pad position (a masked key)."""
        (nt, nh, nw), (tt, th, tw) = self.tiles, self.tile
        T, H, W = self.grid
        t = np.arange(nt * tt).reshape(nt, tt)
        h = np.arange(nh * th).reshape(nh, th)
        w = np.arange(nw * tw).reshape(nw, tw)
        # [nt, nh, nw, tt, th, tw] coordinates
        tc = t[:, None, None, :, None, None]
        hc = h[None, :, None, None, :, None]
        wc = w[None, None, :, None, None, :]
        valid = (tc < T) & (hc < H) & (wc < W)
        idx = (tc * H + hc) * W + wc
        return np.where(valid, idx, -1).reshape(-1)

    def inverse(self) -> np.ndarray:
        """int64 `[tokens]`: each frame-major token's position in the tile-major sequence."""
        order = self.order()
        inv = np.empty(self.tokens, np.int64)
        pos = np.nonzero(order >= 0)[0]
        inv[order[pos]] = pos
        return inv


def _window_starts(n: int, w: int) -> np.ndarray:
    """First tile of the window of `w` tiles centred on each of `n` tiles, shifted inside [0, n)."""
    return np.clip(np.arange(n) - (w - 1) // 2, 0, max(n - w, 0))


def sta_block_mask(tiles: tuple[int, int, int], window: tuple[int, int, int]) -> np.ndarray:
    """bool `[n, n]` over tiles in tile-major order (n = prod(tiles)): query tile q
    attends key tile k when k lies in q's window along every axis."""
    axes = []
    for n, w in zip(tiles, window):
        s = _window_starts(n, w)[:, None]
        k = np.arange(n)[None, :]
        axes.append((k >= s) & (k < s + w))  # [n_axis, n_axis]
    at, ah, aw = axes
    m = at[:, None, None, :, None, None] & ah[None, :, None, None, :, None] & aw[None, None, :, None, None, :]
    n = math.prod(tiles)
    return m.reshape(n, n)


def tile_candidates(grid: tuple[int, int, int]):
    """Tiles whose token count is a multiple of LANE, at most MAX_TILE, padding the grid by
    at most TILE_PAD_CAP, best first: padding in steps of 1/32, then the most cube-like
    (a window of tiles is then near a cube of tokens, as STA's 6x8x8 tiles), then the
    largest (fewer kernel steps). Each as (padding share, aspect, -tokens, tile)."""
    out = []
    T, H, W = grid
    for tt, th, tw in itertools.product(range(1, min(T, 8) + 1), range(1, min(H, 32) + 1), range(1, min(W, 64) + 1)):
        size = tt * th * tw
        if size % LANE or size > MAX_TILE:
            continue
        layout = TileLayout(grid, (tt, th, tw))
        pad = 1 - layout.tokens / layout.padded_tokens
        if pad <= TILE_PAD_CAP:
            out.append((math.ceil(pad * 32) / 32, max(tt, th, tw) / min(tt, th, tw), -size, (tt, th, tw)))
    return sorted(out)


def plan_sta(grid: tuple[int, int, int], option: SparseAttention) -> tuple[TileLayout, tuple[int, int, int]]:
    """The tile layout and window of an STA option at this grid: the given tile or the
    least-padding one of the largest blocks (`tile_candidates`), and the given window or
    the default (the widest cube-like window whose density stays <= STA_DEFAULT_DENSITY).
    A tile or window the grid cannot take is a `SparsityError` naming the grid."""
    if option.tile is not None:
        size = math.prod(option.tile)
        if size % LANE or size > MAX_TILE:
            raise SparsityError(f"STA tile {option.tile} holds {size} tokens: a tile is one kernel block, so it "
                                f"must hold a multiple of {LANE} tokens, at most {MAX_TILE}")
        layout = TileLayout(grid, option.tile)
    else:
        cands = tile_candidates(grid)
        if not cands:
            raise SparsityError(f"no STA tile fits the latent grid {grid} (t, h, w): a tile must hold a multiple of "
                                f"{LANE} tokens (at most {MAX_TILE}) and pad the grid by at most "
                                f"{TILE_PAD_CAP:.0%}; give tile=T,H,W or use dense attention")
        layout = TileLayout(grid, cands[0][-1])
    tiles = layout.tiles
    if option.window is not None:
        bad = [f"{a}: {w} > {n}" for a, w, n in zip("thw", option.window, tiles) if w > n]
        if bad:
            raise SparsityError(f"STA window {option.window} (tiles) is wider than the {tiles} tiles of tile "
                                f"{layout.tile} over the latent grid {grid} ({'; '.join(bad)})")
        return layout, option.window
    return layout, default_window(tiles)


def default_window(tiles: tuple[int, int, int]) -> tuple[int, int, int]:
    """The largest window (most key tiles) with density <= STA_DEFAULT_DENSITY, ties to the most
    even shares per axis; at least one tile per axis."""
    n = math.prod(tiles)
    best = None
    for w in itertools.product(*(range(1, k + 1) for k in tiles)):
        d = math.prod(w) / n
        if d > STA_DEFAULT_DENSITY:
            continue
        shares = [a / k for a, k in zip(w, tiles)]
        key = (math.prod(w), -(max(shares) - min(shares)))
        if best is None or key > best[0]:
            best = (key, w)
    return best[1] if best else (1, 1, 1)


# --------------------------------------------------------------------------
# Radial attention
# --------------------------------------------------------------------------

def _radial_frame_pair(i: int, j: int, per_frame: int, decay: float, block: int, sink: bool) -> tuple[float, bool]:
    """(band half-width in tokens, kept) for query frame i and key frame j, as the reference's
    `get_window_width` / `get_diagonal_split_mask` (its Wan rule: |i - j| <= 1 dense; frame 0 a sink)."""
    d = abs(i - j)
    if d <= 1 or (sink and j == 0):
        return float(per_frame), True
    group = d.bit_length()
    width = 2 ** per_frame.bit_length() / 2 ** group * decay
    width = max(width, block)
    decay_length = 2 ** per_frame.bit_length() / 2 ** group
    if decay_length >= block:
        return width, True
    return width, d % int(block / decay_length) == 0


def radial_token_mask(frames: int, per_frame: int, *, decay: float = 0.5, block: int = RADIAL_BLOCK,
                      sink: bool = True) -> np.ndarray:
    """bool `[S, S]` (S = frames * per_frame) before block shrinking: the reference's
    frame-pair bands. For tests and small shapes; `radial_block_mask` never builds it."""
    S = frames * per_frame
    m = np.zeros((S, S), bool)
    idx = np.arange(per_frame)
    band = np.abs(idx[None, :] - idx[:, None])
    for i in range(frames):
        for j in range(frames):
            width, kept = _radial_frame_pair(i, j, per_frame, decay, block, sink)
            if kept:
                m[i * per_frame:(i + 1) * per_frame, j * per_frame:(j + 1) * per_frame] = band <= width
    return m


def radial_block_mask(frames: int, per_frame: int, *, decay: float = 0.5, block: int = RADIAL_BLOCK,
                      sink: bool = True) -> np.ndarray:
    """bool `[nb, nb]` (nb = ceil(frames * per_frame / block)) over blocks of `block`
    frame-major tokens: the reference's `gen_log_mask_shrinked`. Each frame pair's band is
    placed at its offset inside whole blocks and shrunk block by block (`shrinkMaskStrict`:
    a block is kept when more than 60% of its non-empty columns are more than a third
    dense; the pair's trailing block past its whole blocks is dropped, as there), and the
    pairs are OR-ed; the last partial block of the sequence is dense. The band is a
    Toeplitz matrix, so each column's count in a block is an interval length: memory and
    time follow blocks x block per pair, never the token mask."""
    S = frames * per_frame
    nb = _ceil_div(S, block)
    out = np.zeros((nb, nb), bool)
    pair_blocks = _ceil_div(per_frame, block)
    for i in range(frames):
        for j in range(frames):
            width, kept = _radial_frame_pair(i, j, per_frame, decay, block, sink)
            if not kept:
                continue
            w = int(math.floor(width))
            rr, rc = (i * per_frame) % block, (j * per_frame) % block
            nq, nk = (rr + pair_blocks * block) // block, (rc + pair_blocks * block) // block
            # local rows of each q block of the padded pair: [q0, q1) in pair coordinates
            q0 = np.clip(np.arange(nq) * block - rr, 0, per_frame)
            q1 = np.clip(np.arange(1, nq + 1) * block - rr, 0, per_frame)
            c = np.arange(nk * block).reshape(nk, block) - rc  # local column of each padded column
            valid = (c >= 0) & (c < per_frame)
            lo = np.maximum(q0[:, None, None], c[None] - w)
            hi = np.minimum(q1[:, None, None], c[None] + w + 1)
            count = np.where(valid[None], np.clip(hi - lo, 0, None), 0)  # [nq, nk, block]
            dens = count / block
            nonzero = (dens > 0).sum(-1)
            high = (dens > 1 / 3).sum(-1)
            keep = (high / (nonzero + 1e-9)) > 0.6
            b0, k0 = (i * per_frame) // block, (j * per_frame) // block
            bq, bk = min(nq, nb - b0), min(nk, nb - k0)
            out[b0:b0 + bq, k0:k0 + bk] |= keep[:bq, :bk]
    if S % block:
        out[S // block:, :] = True
        out[:, S // block:] = True
    return out


# --------------------------------------------------------------------------
# The mask splash takes
# --------------------------------------------------------------------------

def density(block_mask: np.ndarray) -> float:
    """Share of (query block, key block) pairs the kernel computes."""
    return float(np.count_nonzero(block_mask)) / block_mask.size


def expand(block_mask: np.ndarray, block: int) -> np.ndarray:
    """The token mask of a block mask (tests, small shapes)."""
    return np.repeat(np.repeat(block_mask, block, axis=0), block, axis=1)


def splash_mask(block_mask: np.ndarray, block: int, shape: tuple[int, int] | None = None):
    """A splash `Mask` of `shape` (default: the block mask's token extent) that is the block
    mask at `block` tokens a block, answered from the block mask (never a token mask):
    splash's `MultiHeadMask` of it makes a block-sparse `make_splash_mha`. Tokens past the
    block mask's extent (the kernel's own padding) attend as their last block does."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    class BlockMask(sm.Mask):
        def __init__(self, bm, block, shape):
            self.bm, self.block = bm, block
            self._shape = (bm.shape[0] * block, bm.shape[1] * block) if shape is None else tuple(shape)
            self.key = (block, self._shape, bm.shape, np.packbits(bm).tobytes())

        @property
        def shape(self):
            return self._shape

        def __getitem__(self, idx):
            qs, ks = idx
            q = np.arange(self._shape[0])[qs]
            k = np.arange(self._shape[1])[ks]
            qb = np.minimum(q // self.block, self.bm.shape[0] - 1)
            kb = np.minimum(k // self.block, self.bm.shape[1] - 1)
            if q.size and k.size and qb[0] == qb[-1] and kb[0] == kb[-1]:  # one block: splash's usual slice
                return np.broadcast_to(self.bm[qb[0], kb[0]], (q.size, k.size))
            return self.bm[np.ix_(qb, kb)]

        def __eq__(self, other):
            return isinstance(other, sm.Mask) and getattr(other, "key", None) == self.key

        def __hash__(self):
            return hash(self.key)

    return BlockMask(np.asarray(block_mask, bool), block, shape)


# --------------------------------------------------------------------------
# The plan a step runs with
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class BlockSparsity:
    """A self-attention's block-sparse mask as the kernel runs it: `block_mask` over blocks of
    `block` tokens (in the order the tokens are given to the attention), `kernel_block` tokens
    a kernel block (a multiple of `block`; one kernel block may hold several mask blocks, and
    then costs a whole block when any of them is active). `order`: the tile-major position ->
    frame-major token map the port applies around the step (STA), or None. Hashable by value:
    it is part of a compiled step's key."""

    name: str
    block_mask: np.ndarray
    block: int
    kernel_block: int
    order: np.ndarray | None = None

    @property
    def key(self):
        return (self.name, self.block, self.kernel_block, self.block_mask.shape,
                np.packbits(self.block_mask).tobytes())

    def __eq__(self, other):
        return isinstance(other, BlockSparsity) and other.key == self.key

    def __hash__(self):
        return hash(self.key)

    @property
    def tokens(self) -> int:
        """Tokens the mask covers (padded to whole blocks)."""
        return self.block_mask.shape[0] * self.block

    def kernel_mask(self, length: int) -> np.ndarray:
        """bool `[n, n]` over kernel blocks for a sequence padded to `length` (a multiple of
        `kernel_block`): a kernel block is computed when any mask block in it is active;
        blocks past the mask (the step's own pad rows) as its last block."""
        r = self.kernel_block // self.block
        n = length // self.kernel_block
        idx = np.minimum(np.arange(n * r), self.block_mask.shape[0] - 1)
        fine = self.block_mask[np.ix_(idx, idx)]
        return fine.reshape(n, r, n, r).any(axis=(1, 3))

    def smem_bytes(self, length: int) -> int:
        """Splash's block metadata in SMEM for a sequence padded to `length`: with its grid shrunk
        to each query block's active key blocks, `[query blocks, widest row]` entries of
        block_mask (int8), data_next (int16 here: more than 127 key blocks) and mask_next
        (int8, present when a kernel block holds mask blocks of both kinds): 4 bytes each,
        an upper bound."""
        m = self.kernel_mask(length)
        return m.shape[0] * int(m.sum(1).max()) * 4

    def density(self, length: int | None = None) -> float:
        """Share of kernel blocks computed (what `--compile-only` prices)."""
        length = length or -(-self.tokens // self.kernel_block) * self.kernel_block
        return density(self.kernel_mask(length))


def with_dense_tail(sparse: BlockSparsity, dense_rows: int, multiple: int = 1) -> tuple[BlockSparsity, int]:
    """The mask of a joint `[video | text]` self-attention (HunyuanVideo) and its video rows:
    `sparse`'s blocks over the video rows (its tokens, then pad rows up to whole kernel blocks
    and a multiple of `multiple`, so the text starts on a kernel block), and `dense_rows` rows
    after them that attend every key and that every query attends (the text keeps full
    attention both ways). The video pad blocks are empty (their rows still see the text keys;
    their keys are masked anyway). The dense rows make every kernel row as wide as the
    sequence, so the kernel block grows (by `sparse.block`, up to MAX_TILE) until splash's
    block metadata fits its SMEM budget; none fitting is a `SparsityError`."""
    kb = sparse.kernel_block
    while True:
        step = math.lcm(kb, multiple)
        video_rows = _ceil_div(sparse.tokens, step) * step
        nv, nd = video_rows // sparse.block, _ceil_div(dense_rows, sparse.block)
        bm = np.ones((nv + nd, nv + nd), bool)
        bm[:nv, :nv] = False
        n = sparse.block_mask.shape[0]
        bm[:n, :n] = sparse.block_mask
        joint = BlockSparsity(f"{sparse.name}, {dense_rows} dense rows after {video_rows}", bm, sparse.block, kb,
                              sparse.order)
        metadata = joint.smem_bytes(_ceil_div(video_rows + dense_rows, kb) * kb)
        if metadata <= SMEM_METADATA_BUDGET:
            return joint, video_rows
        if kb + sparse.block > MAX_TILE:
            raise SparsityError(f"{sparse.name} with {dense_rows} dense rows: {metadata} bytes of block-mask "
                                f"metadata in splash's SMEM at kernel blocks of {kb} tokens (budget "
                                f"{SMEM_METADATA_BUDGET}); use larger tiles")
        kb += sparse.block


def plan(option: SparseAttention, grid: tuple[int, int, int], *, sink: bool = True) -> BlockSparsity | None:
    """The block sparsity of `option` over a frame-major latent grid `(t, h, w)` of tokens,
    or None for dense. STA reorders tokens tile by tile (`order`); radial keeps frame-major
    tokens and masks at RADIAL_BLOCK. `sink`: the
    first frame attended by every frame (the reference's rule for Wan; not for HunyuanVideo).
    Radial's kernel block is the smallest multiple of RADIAL_BLOCK from 2 x RADIAL_BLOCK whose
    block metadata fits splash's SMEM budget (layers/sdpa.SMEM_METADATA_BUDGET)."""
    if option.dense:
        return None
    if option.kind == "sta":
        layout, window = plan_sta(grid, option)
        bm = sta_block_mask(layout.tiles, window)
        out = BlockSparsity(f"sta window {window} of tile {layout.tile} over {grid}", bm, layout.block,
                            layout.block, layout.order())
    else:
        t, h, w = grid
        sink = sink and option.sink
        bm = radial_block_mask(t, h * w, decay=option.decay, block=RADIAL_BLOCK, sink=sink)
        name = f"radial decay {option.decay} sink {int(sink)} over {grid}"
        # the smallest kernel block (a multiple of the mask's) whose metadata fits splash's SMEM
        for k in range(2, 9):
            out = BlockSparsity(name, bm, RADIAL_BLOCK, k * RADIAL_BLOCK)
            if out.smem_bytes(-(-out.tokens // out.kernel_block) * out.kernel_block) <= SMEM_METADATA_BUDGET:
                break
    # a mask with every block active is dense attention: run the dense step (same order, same
    # program, bit-identical), not a kernel that masks nothing
    return None if out.kernel_mask(-(-out.tokens // out.kernel_block) * out.kernel_block).all() else out


def plan_for(option, grid: tuple[int, int, int], *, sink: bool = True) -> BlockSparsity | None:
    """`attention=` (a string, a `SparseAttention` or None) -> `plan` at this latent grid, or None
    for dense; cached per (option, grid, sink), since building the radial mask walks every frame
    pair. What a port's `prepare` and its pipeline's early check call."""
    option = option if isinstance(option, SparseAttention) else parse(option)
    return None if option.dense else _cached_plan(option, tuple(grid), sink)


@functools.lru_cache(maxsize=16)
def _cached_plan(option, grid, sink):
    return plan(option, grid, sink=sink)


def reorder_rows(x, order: np.ndarray):
    """x's rows (axis 1; numpy or jax) in `order`'s positions (`TileLayout.order`); pad positions
    (-1) are zeros."""
    import jax.numpy as jnp

    xp = np if isinstance(x, np.ndarray) else jnp
    take = xp.take(x, np.maximum(order, 0), axis=1)
    keep = (order >= 0).reshape((1, -1) + (1,) * (x.ndim - 2))
    return xp.where(keep, take, xp.zeros((), x.dtype))


def inverse_order(order: np.ndarray) -> np.ndarray:
    """int64 `[tokens]`: each frame-major token's position in `order` (its pad positions skipped)."""
    inv = np.empty(int((order >= 0).sum()), np.int64)
    pos = np.nonzero(order >= 0)[0]
    inv[order[pos]] = pos
    return inv
