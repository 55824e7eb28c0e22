"""Non-causal multi-head attention over `[B, S, H, D]` with a key-validity mask.

On TPU it runs jax's maintained Pallas splash-attention kernel: the sequences
are padded (inside the step, by the same amount on every rank) to whole
kernel blocks, and pad keys, like the caller's masked keys (eager sequence
padding, HunyuanVideo's text mask), get segment id 0 while every query has
segment id 1, so no query attends to them. Elsewhere it runs XLA's
`jax.nn.dot_product_attention`. Scale is 1/sqrt(D), as diffusers' SDPA.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from difflet_tpu.kernels import cross_attention as cross_kernel

IMPLS = ("xla", "splash")
LANE = 128  # splash's lane width: block_kv_compute (so every kv block) is a multiple of it

# Splash block sizes per sequence length (docs/benchmarks.md, "Attention at long
# sequences"; benchmark/attention_blocks.py compiles the choice and its alternatives for
# v5e). Each axis (queries, keys) is rounded up to LANE, then padded to a whole number of
# its block. An axis no longer than its largest candidate is one block. A longer query
# axis takes the largest multiple of Q_ALIGN in [Q_EXACT_MIN, 2048] dividing its
# LANE-rounded length (splash only needs block_q to divide the query length); a longer
# key axis the largest of KV_BLOCKS dividing it, else its largest multiple-of-LANE
# divisor below 1024 (block_kv must be a multiple of a 128-lane block_kv_compute). So
# nothing pads beyond LANE, the least the previous fixed 128/256/512 blocks padded: pad
# rows and the pad/slice copies around the kernel are the only costs a compiled
# estimate sees (splash carries no cycle estimate and is priced by a roofline of its
# padded shapes), while fewer, bigger blocks amortise the kernel's fixed cost per grid
# step and re-read k/v less often (neither priced here). Only a query axis with no such
# divisor, or keys whose exact blocks break the SMEM bound below, take the largest
# candidate whose padding stays within PAD_CAP of the LANE-rounded length.
Q_BLOCKS = (2048, 1024, 512, 256)
Q_ALIGN = 16  # bf16 packs 16 rows per (16, 128) tile
Q_EXACT_MIN = 1024
KV_BLOCKS = (1024, 512, 256)
KV_COMPUTE = 512  # block_kv_compute: the largest of 512/256/128 dividing block_kv
PAD_CAP = 1 / 16
# VMEM: splash sets no vmem_limit_bytes, so Mosaic's default scoped limit binds (16 MiB on
# v5e, 32 MiB on v6e). Compiled for v5e, block_q x block_kv = 2048 x 1024 with a 512
# kv-compute chunk requests ~10 MiB; 2048 x 2048 with 512 does not fit. Validated here
# as this envelope; the compiler's figure per choice is in docs/benchmarks.md.
MAX_BLOCK_PAIR = 2048 * 1024
MAX_KV_COMPUTE = 512
# The kernel keeps its block-mask metadata (int8 block_mask + int8/int16 data_next, one
# entry per (q block, kv block) pair) in SMEM; 128-row blocks at HunyuanVideo 720p
# (931 x 931 pairs) would need ~2.6 MB. This bound keeps it far below SMEM's 1 MiB.
SMEM_METADATA_BUDGET = 256 * 1024


def _round_up(n, m):
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
    """One splash call's block sizes and the padded lengths they need."""

    block_q: int
    block_kv: int
    block_kv_compute: int
    sq: int   # padded query length (a multiple of block_q)
    skv: int  # padded key length (a multiple of block_kv)

    @property
    def grid(self) -> tuple[int, int]:
        """(q blocks, kv blocks) per head: the kernel's grid is heads x these."""
        return self.sq // self.block_q, self.skv // self.block_kv

    def smem_metadata_bytes(self) -> int:
        nq, nkv = self.grid
        return nq * nkv * (1 + (1 if nkv <= 127 else 2))  # block_mask int8, data_next int8/int16

    def validate(self) -> "SplashBlocks":
        """Raises ValueError unless splash and Mosaic accept these sizes (and the VMEM and
        SMEM envelopes above hold)."""
        bq, bkv, c = self.block_q, self.block_kv, self.block_kv_compute
        if min(bq, bkv, c) <= 0 or bq % 8 or c % LANE or bkv % c:
            raise ValueError(f"{self}: block_q must be a multiple of 8, block_kv_compute of {LANE}, "
                             "block_kv of block_kv_compute")
        if self.sq % bq or self.skv % bkv:
            raise ValueError(f"{self}: the padded lengths must be whole blocks")
        if bq * bkv > MAX_BLOCK_PAIR or c > MAX_KV_COMPUTE:
            raise ValueError(f"{self}: outside the VMEM envelope (block_q x block_kv <= {MAX_BLOCK_PAIR}, "
                             f"block_kv_compute <= {MAX_KV_COMPUTE})")
        if self.smem_metadata_bytes() > SMEM_METADATA_BUDGET:
            raise ValueError(f"{self}: {self.smem_metadata_bytes()} bytes of block-mask metadata in SMEM "
                             f"(budget {SMEM_METADATA_BUDGET})")
        return self

    def block_sizes(self):
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

        return sk.BlockSizes(block_q=self.block_q, block_kv=self.block_kv,
                             block_kv_compute=self.block_kv_compute)


def _axis_block(n: int, candidates) -> int:
    """The block for an axis of n tokens: the whole LANE-rounded axis if it fits the largest
    candidate, else the largest candidate whose padding stays within PAD_CAP of the
    LANE-rounded length, else LANE (no padding beyond it)."""
    base = _round_up(n, LANE)
    if base <= candidates[0]:
        return base
    for b in candidates:
        if _round_up(n, b) - base <= PAD_CAP * base:
            return b
    return LANE


def _q_block(n: int) -> int:
    """block_q for n queries: one block up to Q_BLOCKS[0] (of exactly n rows when n is a
    multiple of Q_ALIGN in [Q_EXACT_MIN, Q_BLOCKS[0]], the size of the exact blocks below:
    no padding, no pad / slice copies around the kernel; e.g. Wan's cross-attention on
    one rank's 1184 rows under `Config.sp_cross_local`), else an exact divisor of the
    LANE-rounded length in [Q_EXACT_MIN, Q_BLOCKS[0]], else the PAD_CAP rule."""
    if Q_EXACT_MIN <= n <= Q_BLOCKS[0] and n % Q_ALIGN == 0:
        return n
    base = _round_up(n, LANE)
    if base > Q_BLOCKS[0]:
        for b in range(Q_BLOCKS[0], Q_EXACT_MIN - 1, -Q_ALIGN):
            if base % b == 0:
                return b
    return _axis_block(n, Q_BLOCKS)


def _kv_block(n: int) -> int:
    """block_kv for n keys: one block up to KV_BLOCKS[0]; else a block dividing the
    LANE-rounded length exactly (no padding beyond it): the largest of KV_BLOCKS, else
    the largest multiple of LANE below KV_BLOCKS[0]."""
    base = _round_up(n, LANE)
    if base <= KV_BLOCKS[0]:
        return base
    exact = [b for b in KV_BLOCKS if base % b == 0]
    return exact[0] if exact else next(b for b in range(KV_BLOCKS[0], 0, -LANE) if base % b == 0)


def splash_blocks(sq: int, skv: int) -> SplashBlocks:
    """The validated block sizes and padded lengths of a splash call over `sq` queries
    and `skv` keys (Q_BLOCKS, KV_BLOCKS, KV_COMPUTE, PAD_CAP above)."""
    bq = _q_block(sq)
    for bkv in (_kv_block(skv), _axis_block(skv, KV_BLOCKS)):  # exact keys, else padded (SMEM)
        c = max(x for x in (KV_COMPUTE, 256, LANE) if x <= KV_COMPUTE and bkv % x == 0)
        blocks = SplashBlocks(bq, bkv, c, _round_up(sq, bq), _round_up(skv, bkv))
        if blocks.smem_metadata_bytes() <= SMEM_METADATA_BUDGET:
            break
    return blocks.validate()


def attention(q, k, v, kv_mask=None, *, impl="xla", interpret=False, head_major=False, q_scaled=False,
              sparse=None):
    """softmax(q k^T / sqrt(D)) v over keys where `kv_mask` is True.

    Args:
      q: `[B, Sq, H, D]`; k, v: `[B, Skv, H, D]` (`head_major`: `[B, H, S, D]`,
        the layout splash takes, as `layers.attention.HeadsOut` writes them).
      kv_mask: optional bool `[B, Skv]` or `[Skv]`: True for keys to attend to.
        Every query row must have at least one valid key.
      impl: "xla" (any platform) or "splash" (Pallas TPU kernel).
      interpret: run the splash kernel in interpret mode (tests off TPU).
      q_scaled: q is already multiplied by 1/sqrt(D) (rounded to its dtype).
      sparse: a `sparse_masks.BlockSparsity` (self-attention over the video tokens): only
        its active blocks are attended; splash skips the others, XLA masks them as -inf.

    Returns `[B, Sq, H, D]`.
    """
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    # shapes as [B, S, H, D] whichever the layout
    qs, ks, vs = (t.shape if t.ndim != 4 or not head_major else (t.shape[0], t.shape[2], t.shape[1], t.shape[3])
                  for t in (q, k, v))
    if len(qs) != 4 or ks != vs or ks[0] != qs[0] or ks[2:] != qs[2:]:
        raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} are not "
                         + ("[B, H, S, D]" if head_major else "[B, S, H, D]"))
    B, Skv = ks[0], ks[1]
    if kv_mask is not None:
        kv_mask = jnp.broadcast_to(jnp.asarray(kv_mask, bool), (B, Skv))
    if sparse is not None:
        check_sparse(sparse, qs[1], Skv)
    if impl == "splash":
        if sparse is not None:
            return _splash(q, k, v, kv_mask, interpret, blocks=sparse_blocks(sparse, qs[1]), head_major=head_major,
                           q_scaled=q_scaled, sparse=sparse)
        return _splash(q, k, v, kv_mask, interpret, head_major=head_major, q_scaled=q_scaled)
    if head_major:
        q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
    mask = None if kv_mask is None else kv_mask[:, None, None, :]
    if sparse is not None:
        tokens = jnp.asarray(token_mask(sparse, qs[1]))[None, None]
        mask = tokens if mask is None else mask & tokens
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0 if q_scaled else None, implementation="xla")


# XLA's attention with a sparse mask materialises the token mask (as it does the scores):
# for tests and small shapes; a TPU runs splash, which reads the block mask
MAX_XLA_SPARSE_TOKENS = 16384


def check_sparse(sparse, sq: int, skv: int) -> None:
    """A block-sparse mask applies to self-attention over the tokens it was planned for
    (plus the step's pad rows)."""
    if sq != skv or sq < sparse.tokens - sparse.block + 1:
        raise ValueError(f"a block-sparse mask ({sparse.name}: {sparse.tokens} tokens) applies to the "
                         f"self-attention it was planned for, not {sq} queries over {skv} keys")


def token_mask(sparse, length: int) -> np.ndarray:
    """bool `[length, length]`: the kernel's block mask at token resolution (what splash computes)."""
    if length > MAX_XLA_SPARSE_TOKENS:
        raise ValueError(f"block-sparse attention over {length} tokens runs on the splash kernel (TPU, or "
                         f"interpret mode); XLA's attention would need a {length}x{length} mask")
    kb = sparse.kernel_block
    padded = _round_up(length, kb)
    m = np.repeat(np.repeat(sparse.kernel_mask(padded), kb, 0), kb, 1)
    return m[:length, :length]


def sparse_blocks(sparse, sq: int) -> SplashBlocks:
    """Splash's blocks for a block-sparse self-attention: one kernel block of queries and of keys,
    the largest kv-compute chunk (512/256/128) dividing it. SMEM holds the block metadata of the
    shrunk grid only (each query block's active key blocks), so that is what is bounded."""
    kb = sparse.kernel_block
    c = max(x for x in (KV_COMPUTE, 256, LANE) if kb % x == 0)
    blocks = SplashBlocks(kb, kb, c, _round_up(sq, kb), _round_up(sq, kb))
    if kb % LANE or kb * kb > MAX_BLOCK_PAIR:
        raise ValueError(f"{sparse.name}: kernel blocks of {kb} tokens are outside splash's envelope")
    metadata = sparse.smem_bytes(blocks.sq)
    if metadata > SMEM_METADATA_BUDGET:
        raise ValueError(f"{sparse.name}: {metadata} bytes of block-mask metadata in SMEM (budget "
                         f"{SMEM_METADATA_BUDGET}); use larger tiles")
    return blocks


def fuses_rms_cross(par, q_shape, k, dtype, head_dim: int) -> bool:
    """Whether `rms_cross_attention` takes this query-side norm and attention as one
    kernel: with splash attention (TPU, or interpreted), the shapes and dtypes
    `kernels.cross_attention` takes. q_shape `[B, n, D]` (every head), k `[B, L, D]`."""
    return (par.attn_impl == "splash" and dtype in (jnp.bfloat16, jnp.float32) and k.dtype == dtype
            and cross_kernel.unsupported_reason(q_shape, k.shape, head_dim, dtype) is None)


def rms_cross_attention(par, q, weight, k, v, *, head_dim: int, eps: float):
    """q's across-heads RMSNorm (weight `[D]`), splash's relayouts, the heads' split and merge
    and the attention in one kernel (`kernels.cross_attention`; `fuses_rms_cross` says when):
    q `[B, n, D]` not normalised, k/v `[B, L, D]`, every head; the result `[B, n, D]`."""
    return cross_kernel.rms_cross_attention(q, weight, k, v, head_dim=head_dim, eps=eps, interpret=par.interpret)


def reference_attention(q, k, v, kv_mask=None, bias=None, scale=None, sparse=None):
    """Plain einsum softmax attention in the input precision (tests, float64 runs);
    `bias`: an additive key bias `(B, 1, Skv)`; `scale` of the logits (default 1/sqrt(D));
    `sparse`: a block-sparse mask (`attention`'s), as -inf."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias[:, None]
    if sparse is not None:
        check_sparse(sparse, q.shape[1], k.shape[1])
        s = jnp.where(jnp.asarray(token_mask(sparse, q.shape[1]))[None, None], s, -jnp.inf)
    if kv_mask is not None:
        m = jnp.broadcast_to(jnp.asarray(kv_mask, bool), (k.shape[0], k.shape[1]))
        s = jnp.where(m[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@functools.lru_cache(maxsize=None)
def _splash_kernel(heads, blocks: SplashBlocks, interpret, sparse=None):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    from difflet_tpu.layers import sparse_masks

    if sparse is None:
        one = sm.FullMask((blocks.sq, blocks.skv))
    else:
        one = sparse_masks.splash_mask(sparse.kernel_mask(blocks.sq), sparse.kernel_block, (blocks.sq, blocks.skv))
    return sk.make_splash_mha(sm.MultiHeadMask([one] * heads), block_sizes=blocks.block_sizes(), head_shards=1,
                              q_seq_shards=1, interpret=interpret)


def _splash(q, k, v, kv_mask, interpret, blocks: SplashBlocks | None = None, check: bool = True,
            head_major=False, q_scaled=False, sparse=None):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    if head_major:
        B, H, Sq, D = q.shape
        Skv = k.shape[2]
    else:
        B, Sq, H, D = q.shape
        Skv = k.shape[1]
    s_ax = 2 if head_major else 1
    if blocks is None:
        blocks = splash_blocks(Sq, Skv)
    elif blocks.sq < Sq or blocks.skv < Skv:
        raise ValueError(f"{blocks} is shorter than the sequences ({Sq}, {Skv})")
    if check and sparse is None:  # benchmark/attention_blocks.py compiles candidates outside the envelopes too
        blocks.validate()
    sq, skv = blocks.sq, blocks.skv
    if kv_mask is None:
        kv_mask = jnp.ones((B, Skv), bool)
    kv_seg = jnp.pad(kv_mask.astype(jnp.int32), ((0, 0), (0, skv - Skv)))  # pad keys: segment 0
    q_seg = jnp.ones((B, sq), jnp.int32)
    # the kernel does not scale q; it takes [B, H, S, D] (padded rows only where the blocks need them)
    if not q_scaled:
        q = (q * (1.0 / math.sqrt(D))).astype(q.dtype)
    pad = lambda t, n: t if n == 0 else jnp.pad(t, [(0, n) if a == s_ax else (0, 0) for a in range(4)])
    qh, kh, vh = pad(q, sq - Sq), pad(k, skv - Skv), pad(v, skv - Skv)
    if not head_major:
        qh, kh, vh = (jnp.swapaxes(t, 1, 2) for t in (qh, kh, vh))
    kernel = _splash_kernel(H, blocks, bool(interpret), sparse)
    call = jax.vmap(lambda a, b, c, qs, ks: kernel(a, b, c, segment_ids=sk.SegmentIds(q=qs, kv=ks)))
    if sparse is None:
        out = _vma_untyped(call, qh, kh, vh, q_seg, kv_seg)
    else:
        # the compile-only estimator prices splash by its active blocks: it reads the density here
        with jax.named_scope(f"splash_sparse_density_{sparse.density(sq):.6f}"):
            out = _vma_untyped(call, qh, kh, vh, q_seg, kv_seg)
    return jnp.swapaxes(out, 1, 2)[:, :Sq]


def _vma_untyped(fn, *args):
    """`fn(*args)` for a Pallas kernel whose `out_shape` declares no manual-axis types
    (jax's splash attention), inside `shard_map(check_vma=True)`: traced with the
    check off, its output typed varying over every manual axis an input varies over
    (a per-rank kernel's output does). Outside shard_map, or unchecked, a plain call."""
    from jax._src import config as jax_config  # shard_map's own switch; no public API

    if not jax_config._check_vma.value:
        return fn(*args)
    varying = set()
    for a in jax.tree_util.tree_leaves(args):
        varying |= set(jax.typeof(a).manual_axis_type.varying)
    with jax_config._check_vma(False):
        out = fn(*args)
    return jax.lax.pcast(out, tuple(sorted(varying)), to="varying") if varying else out
