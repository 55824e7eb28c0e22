"""kernels/cross_attention.py (`rms_cross_attention`): the across-heads q RMSNorm and per-head
attention in one kernel, against the unfused path (`rms_norm_across_heads`, then attention
with the heads split) in TPU interpret mode, against a float64 evaluation of the same math,
its shape rules, and a deviceless v5e compile at Wan2.1-14B's shapes (480x832x9, one rank's
1184 rows of 4736, 512 text keys)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.tools import deviceless
from difflet_tpu.layers.sdpa import attention
from difflet_tpu.kernels import _common
from difflet_tpu.kernels import cross_attention as ca
from difflet_tpu.layers import rms_norm_across_heads
from difflet_tpu.parallel.modes import Parallel
from difflet_tpu.testing import rel_l2

EPS = 1e-6


def _inputs(dtype, B=2, S=64, L=32, H=4, d=128, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    D = H * d
    q = (3 * jax.random.normal(ks[0], (B, S, D), jnp.float32)).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(ks[1], (D,), jnp.float32)).astype(dtype)
    k = jax.random.normal(ks[2], (B, L, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[3], (B, L, D), jnp.float32).astype(dtype)
    return q, w, k, v


def _unfused(q, w, k, v, d, impl):
    """What Wan's cross-attention does without the kernel: norm, split heads, attend, merge."""
    qn = rms_norm_across_heads(Parallel(), q, w, EPS, q.shape[-1])
    heads = lambda t: t.reshape(*t.shape[:-1], t.shape[-1] // d, d)
    o = attention(heads(qn), heads(k), heads(v), impl=impl, interpret=True)
    return o.reshape(q.shape)


def _float64(q, w, k, v, d):
    """The same math in float64 (numpy): RMSNorm over all channels, per-head softmax attention."""
    q, w, k, v = (np.asarray(t, np.float64) for t in (q, w, k, v))
    qn = q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + EPS) * w
    B, S, D = q.shape
    heads = lambda t: t.reshape(t.shape[0], t.shape[1], D // d, d)
    s = np.einsum("bqhd,bkhd->bhqk", heads(qn), heads(k)) / math.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, heads(v)).reshape(B, S, D)


def test_float32_matches_unfused_path_and_float64():
    q, w, k, v = _inputs(jnp.float32)
    got = ca.rms_cross_attention(q, w, k, v, head_dim=128, eps=EPS, interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    exact = _float64(q, w, k, v, 128)
    for impl in ("xla", "splash"):
        assert rel_l2(got, _unfused(q, w, k, v, 128, impl)) <= 1e-6
    assert rel_l2(got, exact) <= 1e-6
    # the norm matters: without it (q as given) the result is far off
    assert rel_l2(ca.rms_cross_attention(q, jnp.ones_like(w), k, v, head_dim=128, eps=EPS, interpret=True),
                  exact) > 1e-2


def test_bfloat16_within_rounding_of_unfused_splash():
    """bf16: the unfused splash path and the kernel round at the same points (norm output,
    q scaled by 1/sqrt(d), probabilities for PV, output); both within bf16 rounding of float64."""
    q, w, k, v = _inputs(jnp.bfloat16)
    got = ca.rms_cross_attention(q, w, k, v, head_dim=128, eps=EPS, interpret=True)
    ref = _unfused(q, w, k, v, 128, "splash")
    exact = _float64(q, w, k, v, 128)
    assert rel_l2(got, ref) <= 1e-2
    assert rel_l2(got, exact) <= 1.5 * rel_l2(ref, exact) + 1e-3


def test_row_block_and_vmem_plan_at_wan_shapes():
    assert ca.row_block(1184, 5120, jnp.bfloat16) == 592  # 16-row tiles: 592 x 5120 x 2 B = 5.8 MiB
    assert ca.unsupported_reason((1, 1184, 5120), (1, 512, 5120), 128, jnp.bfloat16) is None
    assert ca.vmem_plan(592, 5120, 512, 128, jnp.bfloat16).limit <= _common.DEFAULT_VMEM_CAPACITY_BYTES


@pytest.mark.parametrize("q_shape,kv_shape,head_dim,dtype,words", [
    ((1, 1184, 5120), (1, 512, 5120), 128, jnp.float16, "float16"),
    ((1, 1184, 5120), (1, 512, 5120), 64, jnp.bfloat16, "head_dim 64"),
    ((1, 1184, 5120), (1, 257, 5120), 128, jnp.bfloat16, "257 keys"),   # Wan I2V's image tokens
    ((1, 1184, 5120), (1, 4096, 5120), 128, jnp.bfloat16, "4096 keys"),
    ((1, 1176, 5120), (1, 512, 5120), 128, jnp.bfloat16, "1176 rows"),  # no 16-row block divides
    ((1, 1184, 5120), (1, 512, 2560), 128, jnp.bfloat16, "not [B, rows, D]"),
])
def test_unsupported(q_shape, kv_shape, head_dim, dtype, words):
    reason = ca.unsupported_reason(q_shape, kv_shape, head_dim, dtype)
    assert reason is not None and words in reason, reason


CODE = r"""
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from difflet_tpu.tools import deviceless
from difflet_tpu.kernels import _common, cross_attention as ca
mesh = deviceless.topology_mesh("v5e:2x2")
bf = jnp.bfloat16
sd = lambda shape, spec: jax.ShapeDtypeStruct(shape, bf, sharding=NamedSharding(mesh, spec))
f = jax.shard_map(lambda q, w, k, v: ca.rms_cross_attention(q, w, k, v, head_dim=128, eps=1e-6), mesh=mesh,
                  in_specs=(P(None, "tp"), P(), P(), P()), out_specs=P(None, "tp"), check_vma=False)
args = [sd((1, 4736, 5120), P(None, "tp")), sd((5120,), P()), sd((1, 512, 5120), P()), sd((1, 512, 5120), P())]
compiled = jax.jit(f).trace(*args).lower().compile()
print(json.dumps(dict(kernels=_common.kernel_vmem_from_hlo(compiled.as_text()),
                      plan_limit=ca.vmem_plan(592, 5120, 512, 128, bf).limit)))
"""


@pytest.mark.slow
def test_compiles_for_v5e_within_its_vmem_limit(monkeypatch):
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    out = deviceless.run_python(CODE, timeout=900)
    (k,) = [k for k in out["kernels"] if k["name"].startswith("rms_cross_attention")]
    assert k["requested"] == out["plan_limit"] and 0 < k["used"] <= k["requested"], (k, out)
