"""Cross-attention on one rank's rows with every head, the queries' across-heads RMSNorm inside.

`rms_cross_attention(q, weight, k, v)`: per head h, softmax(qn_h k_h^T / sqrt(d)) v_h, where
qn = RMSNorm over all D = H * d channels of q (float32 statistics, `weight` per channel), and
q, k, v, the output are `[B, rows, D]` with the heads as column blocks (the layout a plain
projection writes and a plain projection reads).

Wan's cross-attention under `Config.sp_cross_local` (every head of this rank's rows, the text
K/V replicated) otherwise spends three passes around splash attention at 480x832x9 on a v5e-4
(compiled estimates, per layer): the q row sums of squares (57 us), the normalised and scaled q
written head-major for splash (56 us) and splash's head-major output copied back to rows
(86 us). Here the grid is (batch, row block, head): a row block of q is DMA'd once (its block
index does not change across heads), its sums of squares are taken at the first head into
VMEM, and each head reads its 128-lane column block of q, K and V and writes its column block
of the output. The text keys (Wan: 512) are one block, so the softmax is exact in one pass (no
online rescaling). No masks: every key is attended to (Wan's padded text included, as
diffusers does).

Numerics follow the unfused path (`rms_norm_across_heads`, then `attention.attention`'s
splash): the norm in float32 cast to q's dtype, q scaled by 1/sqrt(d) in q's dtype, scores and
the softmax in float32, probabilities cast to v's dtype for the PV product, float32
accumulation. The sums of squares add 128-lane partial sums (a different order than XLA's
reduction: float32 rounding apart).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from difflet_tpu.kernels import _common

LANES = _common.LANES
# q's row block is the kernel's largest buffer (rows x D, double-buffered); at most this many
# bytes per copy (Wan at 480x832x9: 592 x 5120 bf16 = 5.9 MiB)
MAX_Q_BLOCK_BYTES = 8 * 1024 * 1024


def row_block(rows: int, width: int, dtype) -> int | None:
    """The largest row block dividing `rows`, a multiple of the dtype's sublane tile, within
    MAX_Q_BLOCK_BYTES for a `width`-wide block; None if there is none."""
    unit = _common.sublane_rows(dtype)
    cap = MAX_Q_BLOCK_BYTES // (width * jnp.dtype(dtype).itemsize)
    best = None
    for b in range(unit, min(rows, cap) + 1, unit):
        if rows % b == 0:
            best = b
    return best


def unsupported_reason(q_shape, kv_shape, head_dim: int, dtype) -> str | None:
    """Why the kernel does not take these shapes (None: it does)."""
    r = _common.dtype_reason(dtype)
    if r:
        return r
    if len(q_shape) != 3 or len(kv_shape) != 3 or q_shape[0] != kv_shape[0] or q_shape[2] != kv_shape[2]:
        return f"q {q_shape} and k/v {kv_shape} are not [B, rows, D] of one D"
    if head_dim % LANES or q_shape[2] % head_dim:
        return f"head_dim {head_dim} is not a multiple of {LANES} dividing D = {q_shape[2]}"
    if kv_shape[1] % _common.sublane_rows(dtype) or kv_shape[1] > 2048:
        return f"{kv_shape[1]} keys: not one block (a multiple of {_common.sublane_rows(dtype)}, at most 2048)"
    if row_block(q_shape[1], q_shape[2], dtype) is None:
        return f"no row block of {q_shape[1]} rows fits"
    return None


def vmem_plan(rows_block: int, width: int, keys: int, head_dim: int, dtype) -> _common.VmemPlan:
    return _common.VmemPlan((
        _common.buffer("q", (2, rows_block, width), dtype),
        _common.buffer("k, v", (2, 2, keys, head_dim), dtype),
        _common.buffer("out", (2, rows_block, head_dim), dtype),
        _common.buffer("rms", (rows_block, 1), jnp.float32),
        _common.buffer("scores", (3, rows_block, keys), jnp.float32),  # s, p, p in v's dtype
    ))


def _kernel(q_ref, w_ref, k_ref, v_ref, o_ref, r_ref, *, dim, eps, head_dim, scale):
    h = pl.program_id(2)
    f32 = jnp.float32
    dtype = q_ref.dtype

    @pl.when(h == 0)
    def _():
        def body(c, acc):
            x = q_ref[:, pl.ds(pl.multiple_of(c * LANES, LANES), LANES)].astype(f32)
            return acc + x * x

        acc = lax.fori_loop(0, dim // LANES, body, jnp.zeros((q_ref.shape[0], LANES), f32))
        r_ref[...] = lax.rsqrt(jnp.sum(acc, axis=-1, keepdims=True) / dim + eps)

    qh = q_ref[:, pl.ds(pl.multiple_of(h * head_dim, LANES), head_dim)].astype(f32)
    qn = (qh * r_ref[...] * w_ref[...].astype(f32)).astype(dtype)       # rms_norm: float32, cast back
    qs = (qn.astype(f32) * jnp.asarray(scale, dtype).astype(f32)).astype(dtype)  # q * (1/sqrt(d)) in q's dtype
    prec = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    s = lax.dot_general(qs, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=f32, precision=prec)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = lax.dot_general(p.astype(v_ref.dtype), v_ref[...], (((1,), (0,)), ((), ())), preferred_element_type=f32,
                        precision=prec)
    o_ref[...] = (o / l).astype(o_ref.dtype)


def rms_cross_attention(q, weight, k, v, *, head_dim: int, eps: float, interpret=False):
    """Per head softmax(RMSNorm(q)_h k_h^T / sqrt(head_dim)) v_h; q `[B, S, D]`, weight `[D]`,
    k, v `[B, L, D]`; returns `[B, S, D]` in q's dtype (see the module docstring)."""
    B, S, D = q.shape
    L = k.shape[1]
    reason = unsupported_reason(q.shape, k.shape, head_dim, q.dtype)
    if reason:
        raise ValueError(f"rms_cross_attention: {reason}")
    bq = row_block(S, D, q.dtype)
    H = D // head_dim
    plan = vmem_plan(bq, D, L, head_dim, q.dtype)
    isz = jnp.dtype(q.dtype).itemsize
    nq = S // bq
    cost = pl.CostEstimate(
        flops=4 * B * S * L * D + 4 * B * S * D,  # QK^T and PV per head; the norm's squares and scalings
        transcendentals=B * H * S * L,
        # q and the output once; K and V once per row block
        bytes_accessed=isz * (2 * B * S * D + 2 * B * nq * L * D),
    )
    kernel = functools.partial(_kernel, dim=D, eps=eps, head_dim=head_dim, scale=1.0 / math.sqrt(head_dim))
    return pl.pallas_call(
        kernel,
        out_shape=_common.out_struct((B, S, D), q.dtype, q),
        grid=(B, nq, H),
        in_specs=[
            pl.BlockSpec((None, bq, D), lambda b, i, h: (b, i, 0)),
            pl.BlockSpec((1, head_dim), lambda b, i, h: (0, h)),
            pl.BlockSpec((None, L, head_dim), lambda b, i, h: (b, 0, h)),
            pl.BlockSpec((None, L, head_dim), lambda b, i, h: (b, 0, h)),
        ],
        out_specs=pl.BlockSpec((None, bq, head_dim), lambda b, i, h: (b, i, h)),
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=plan.limit),
        cost_estimate=cost,
        interpret=_common.interpret_params(interpret),
        name="rms_cross_attention",
    )(q, weight.reshape(1, D), k, v)
