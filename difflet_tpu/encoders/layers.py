"""Building blocks shared by the text encoders (CLIP, T5/UMT5, the decoder-only LMs).

Parameter leaves are named so that a transformers checkpoint key maps by one rule
(`loading.torch_key`): a `Linear`'s `kernel` is torch's `weight` transposed (`[in, out]`,
Flax convention), every other leaf (`weight`, `bias`) is named as in torch.

Every parameter carries its tensor-parallel `PartitionSpec` over the mesh axis `"tp"` as
Variable metadata `tp_spec` (`loading.partition_specs` reads it): Megatron-style,
column-parallel projections (q/k/v, fc1, up/gate) shard their output features,
row-parallel ones (o, fc2, down) their input features, and embeddings and norms are
replicated. The forward is plain `jax.numpy` under `jax.jit`; with sharded parameters GSPMD
inserts the collectives (one all-reduce after each row-parallel product).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

TP = "tp"

# Megatron roles -> (kernel spec [in, out], bias spec [out]).
PARALLEL = {
    None: (P(), P()),
    "column": (P(None, TP), P(TP)),
    "row": (P(TP, None), P()),
}


def fp32(dtype):
    """The dtype of float32 math for `dtype`: float32, or float64 for float64 models."""
    return jnp.promote_types(dtype, jnp.float32)


class Linear(nnx.Module):
    """torch `nn.Linear`: `y = x @ kernel + bias`, kernel `[in, out]` (torch weight transposed).

    `parallel`: None (replicated), "column" or "row" (see the module docstring).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, parallel: str | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        kernel_spec, bias_spec = PARALLEL[parallel]
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features), dtype)
                                / math.sqrt(in_features), tp_spec=kernel_spec)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), tp_spec=bias_spec) if bias else None

    def __call__(self, x):
        kernel = self.kernel[...]
        y = x.astype(kernel.dtype) @ kernel  # as torch, the input is cast to the layer's dtype by its caller
        return y if self.bias is None else y + self.bias[...]


class Embedding(nnx.Module):
    """torch `nn.Embedding`: `weight[ids]`, `weight` `[num_embeddings, dim]`, replicated."""

    def __init__(self, num_embeddings: int, features: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (num_embeddings, features), dtype), tp_spec=P())

    def __call__(self, ids):
        # ids are range-checked before the forward (runtime.check_token_inputs): `take` would clamp.
        return jnp.take(self.weight[...], ids, axis=0)


class LayerNorm(nnx.Module):
    """torch `nn.LayerNorm` (weight and bias); statistics in float32, output in the input dtype."""

    def __init__(self, features: int, *, eps: float, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((features,), dtype), tp_spec=P())
        self.bias = nnx.Param(jnp.zeros((features,), dtype), tp_spec=P())

    def __call__(self, x):
        h = x.astype(fp32(x.dtype))
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.weight[...].astype(h.dtype) + self.bias[...].astype(h.dtype)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm without mean or bias, in its transformers variants.

    * `style="t5"` (`T5LayerNorm`): `x * rsqrt(mean(x^2) + eps)` (float32 statistics), cast to
      the weight's dtype only when that is half precision, times `weight`.
    * `style="llama"` (`Qwen2RMSNorm`, `LlamaRMSNorm`): normalised in float32, cast back to the
      input dtype, times `weight`.
    * `offset=True` (`GemmaRMSNorm`): `(1 + weight)` instead of `weight`, multiplied in float32
      before the cast back.
    """

    def __init__(self, features: int, *, eps: float, style: str = "llama", offset: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        if style not in ("t5", "llama"):
            raise ValueError(f"RMSNorm style must be 't5' or 'llama', got {style!r}")
        self.eps, self.style, self.offset = eps, style, offset
        self.weight = nnx.Param((jnp.zeros if offset else jnp.ones)((features,), dtype), tp_spec=P())

    def __call__(self, x):
        weight = self.weight[...]
        h = x.astype(fp32(x.dtype))
        h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps)
        if self.offset:
            return (h * (1.0 + weight.astype(h.dtype))).astype(x.dtype)
        if self.style == "t5":
            if weight.dtype in (jnp.float16, jnp.bfloat16):
                h = h.astype(weight.dtype)
            return weight * h
        return weight * h.astype(x.dtype)


# --------------------------------------------------------------------------
# Activations (transformers `activations.ACT2FN`, the ones these encoders use)
# --------------------------------------------------------------------------

def quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


ACT2FN = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh approximation
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": quick_gelu,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def activation(name: str):
    if name not in ACT2FN:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACT2FN)}")
    return ACT2FN[name]


# --------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------

def split_heads(x, head_dim: int):
    """`[B, S, H * D] -> [B, S, H, D]`."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def attention(q, k, v, *, scale: float, mask=None, bias=None):
    """Softmax attention, `q` `[B, S, H, D]`, `k`/`v` `[B, T, KV, D]` (GQA when KV < H: query
    head h reads KV head h // (H / KV), as transformers' `repeat_kv`).

    `mask`: bool, broadcastable to `[B, 1, S, T]`, True = attend. `bias`: additive, broadcastable
    to `[B, H, S, T]` (T5's position bias). Scores and softmax in float32. A query row with no
    key to attend to gets a zero output, as torch's `scaled_dot_product_attention` (transformers'
    default "sdpa" attention) returns for a fully masked row (e.g. a left-padding query under a
    causal mask); never NaN.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} key/value heads")
    qg = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    scores = scores.reshape(b, h, s, k.shape[1])
    if bias is not None:
        scores = scores + bias.astype(scores.dtype)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        e = jnp.exp(scores - jax.lax.stop_gradient(row_max))  # exp(-inf) = 0 on masked keys
        denom = e.sum(-1, keepdims=True)
        probs = e / jnp.where(denom > 0, denom, 1.0)
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    probs = probs.astype(v.dtype).reshape(b, kv, h // kv, s, k.shape[1])
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h * d)


def padding_mask(attention_mask):
    """`[B, T]` 0/1 -> bool `[B, 1, 1, T]` (keys to attend to)."""
    return (attention_mask != 0)[:, None, None, :]


def causal_mask(length: int):
    """bool `[1, 1, S, S]`, query i attends to keys j <= i."""
    return jnp.asarray(np.tril(np.ones((length, length), dtype=bool)))[None, None]
