"""Non-causal multi-head attention over `[B, S, H, D]` with a key-validity mask.

On TPU it runs jax's maintained Pallas splash-attention kernel: the sequences
are padded (inside the step, by the same amount on every rank) to whole
kernel blocks, and pad keys, like the caller's masked keys (eager sequence
padding, HunyuanVideo's text mask), get segment id 0 while every query has
segment id 1, so no query attends to them. Elsewhere it runs XLA's
`jax.nn.dot_product_attention`. Scale is 1/sqrt(D), as diffusers' SDPA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

IMPLS = ("xla", "splash")
BLOCK = 128  # splash needs sequence lengths in whole blocks of 128
# Long sequences are padded to whole 512-row blocks instead: the kernel keeps its
# block-mask metadata (about 2 bytes per (q block, kv block) pair) in 1 MiB of SMEM,
# and 128-row blocks at HunyuanVideo 720p (119056 tokens, 931 x 931 blocks) need 1.9 MB.
LONG_BLOCK = 512
LONG_PAIRS = 65536  # more 128-row block pairs than this: pad to LONG_BLOCK


def attention(q, k, v, kv_mask=None, *, impl="xla", interpret=False):
    """softmax(q k^T / sqrt(D)) v over keys where `kv_mask` is True.

    Args:
      q: `[B, Sq, H, D]`; k, v: `[B, Skv, H, D]`.
      kv_mask: optional bool `[B, Skv]` or `[Skv]`: True for keys to attend to.
        Every query row must have at least one valid key.
      impl: "xla" (any platform) or "splash" (Pallas TPU kernel).
      interpret: run the splash kernel in interpret mode (tests off TPU).
    """
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if q.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} are not [B, S, H, D]")
    B, Skv = k.shape[0], k.shape[1]
    if kv_mask is not None:
        kv_mask = jnp.broadcast_to(jnp.asarray(kv_mask, bool), (B, Skv))
    if impl == "splash":
        return _splash(q, k, v, kv_mask, interpret)
    mask = None if kv_mask is None else kv_mask[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def reference_attention(q, k, v, kv_mask=None, bias=None):
    """Plain einsum softmax attention in the input precision (tests, float64 runs);
    `bias`: an additive key bias `(B, 1, Skv)`."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias[:, None]
    if kv_mask is not None:
        m = jnp.broadcast_to(jnp.asarray(kv_mask, bool), (k.shape[0], k.shape[1]))
        s = jnp.where(m[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _block(n):
    for b in (512, 256, 128):
        if n % b == 0:
            return b
    raise AssertionError(n)


@functools.lru_cache(maxsize=None)
def _splash_kernel(heads, sq, skv, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.FullMask((sq, skv)) for _ in range(heads)])
    bq, bkv = _block(sq), _block(skv)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv)
    return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def _splash(q, k, v, kv_mask, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    unit = LONG_BLOCK if -(-Sq // BLOCK) * -(-Skv // BLOCK) > LONG_PAIRS else BLOCK
    sq = -(-Sq // unit) * unit
    skv = -(-Skv // unit) * unit
    if kv_mask is None:
        kv_mask = jnp.ones((B, Skv), bool)
    kv_seg = jnp.pad(kv_mask.astype(jnp.int32), ((0, 0), (0, skv - Skv)))  # pad keys: segment 0
    q_seg = jnp.ones((B, sq), jnp.int32)
    # [B, S, H, D] -> [B, H, S, D]; the kernel does not scale q.
    qh = jnp.pad((q * (1.0 / math.sqrt(D))).astype(q.dtype), ((0, 0), (0, sq - Sq), (0, 0), (0, 0)))
    kh = jnp.pad(k, ((0, 0), (0, skv - Skv), (0, 0), (0, 0)))
    vh = jnp.pad(v, ((0, 0), (0, skv - Skv), (0, 0), (0, 0)))
    qh, kh, vh = (jnp.swapaxes(t, 1, 2) for t in (qh, kh, vh))
    kernel = _splash_kernel(H, sq, skv, bool(interpret))
    out = _vma_untyped(jax.vmap(lambda a, b, c, qs, ks: kernel(a, b, c, segment_ids=sk.SegmentIds(q=qs, kv=ks))),
                       qh, kh, vh, q_seg, kv_seg)
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
