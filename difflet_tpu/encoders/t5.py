"""The T5 encoder family (transformers `T5EncoderModel`, `UMT5EncoderModel`) in Flax NNX.

Reads top to bottom like transformers `models/t5/modeling_t5.py`: the shared token embedding,
`num_layers` blocks of [pre-RMSNorm self-attention, pre-RMSNorm feed-forward], the final
RMSNorm. T5 v1.1 (FLUX.1's `text_encoder_2`): gated-GELU feed-forward (`wi_0`, `wi_1`, `wo`),
`T5LayerNorm` (RMS, no bias), no 1/sqrt(d) attention scaling, a learned relative position bias
over log-spaced distance buckets. One config flag, `per_layer_relative_bias`, makes it UMT5
(transformers `models/umt5/modeling_umt5.py`, Wan's text encoder): T5 computes the bias in
block 0 only and every block reuses it; UMT5 gives every block its own bias table.

Names are transformers' (`encoder.block.0.layer.0.SelfAttention.q`, `...layer.1.DenseReluDense.wi_0`),
so a key maps by `loading.torch_key`. The token embedding is `shared.weight` (transformers ties
`encoder.embed_tokens.weight` to it; a checkpoint holding only the latter loads too).

Precision as transformers loads it in half precision: `wo` stays float32
(`_keep_in_fp32_modules = ["wo"]`), its input is cast to float32, and the float32 result
promotes the residual stream to float32 from the first feed-forward on; each RMSNorm casts
back to the (half) weight dtype. transformers' float16 overflow clamps are not reproduced
(bfloat16 and float32 do not need them).

Tensor parallelism (`tp`): q/k/v and wi_0/wi_1 (wi) column-parallel, o and wo row-parallel;
the embedding, the bias tables and the norms replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import loading
from .layers import Embedding, Linear, RMSNorm, activation, attention, fp32, padding_mask, split_heads
from .runtime import check_token_inputs


@dataclass(frozen=True)
class T5Config:
    """The fields of transformers' `T5Config` / `UMT5Config` the encoder reads. Defaults: the
    T5 v1.1 XXL encoder of FLUX.1-dev `text_encoder_2/config.json`."""

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"
    per_layer_relative_bias: bool = False  # UMT5: every block has its own relative_attention_bias

    def __post_init__(self):
        act = self.feed_forward_proj.split("-")
        if len(act) > 2 or (len(act) == 2 and act[0] != "gated"):
            raise ValueError("T5Config: feed_forward_proj must be 'ACT' or 'gated-ACT', "
                             f"got {self.feed_forward_proj!r}")
        activation(self.dense_act_fn)

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def dense_act_fn(self) -> str:
        # As transformers' T5Config: "gated-gelu" means the tanh approximation ("gelu_new").
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else self.feed_forward_proj.split("-")[-1]

    @classmethod
    def from_dict(cls, d: dict) -> "T5Config":
        """From a `config.json`; `model_type` "umt5" sets `per_layer_relative_bias`."""
        if d.get("model_type") not in ("t5", "umt5"):
            raise ValueError(f"expected a T5 or UMT5 config.json, got model_type {d.get('model_type')!r}")
        return cls(**loading.known_fields(cls, d), per_layer_relative_bias=d["model_type"] == "umt5")


# FLUX.1-dev `text_encoder_2/config.json` (google/t5-v1_1-xxl's encoder).
T5_V1_1_XXL = T5Config()
# Wan2.1 `text_encoder/config.json` (google/umt5-xxl's encoder).
UMT5_XXL = T5Config(vocab_size=256384, per_layer_relative_bias=True)


def relative_position_bucket(relative_position: np.ndarray, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> np.ndarray:
    """transformers `T5Attention._relative_position_bucket`, in numpy: half the buckets for exact
    small distances, the rest log-spaced up to `max_distance`; with `bidirectional` the
    buckets are split between keys before and after the query. float32 math as torch's (the
    log-bucket boundaries are float32 roundings)."""
    relative_position = np.asarray(relative_position, np.int64)
    buckets = np.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) on the small ones, discarded below
        large = (np.log(relative_position.astype(np.float32) / np.float32(max_exact))
                 / np.float32(math.log(max_distance / max_exact)) * np.float32(num_buckets - max_exact))
        large = max_exact + np.where(is_small, 0, large).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(is_small, relative_position, large)


class T5Attention(nnx.Module):
    def __init__(self, config: T5Config, *, has_relative_attention_bias: bool, dtype, rngs: nnx.Rngs):
        self.config = config
        self.has_relative_attention_bias = has_relative_attention_bias
        inner = config.num_heads * config.d_kv
        self.q = Linear(config.d_model, inner, bias=False, parallel="column", dtype=dtype, rngs=rngs)
        self.k = Linear(config.d_model, inner, bias=False, parallel="column", dtype=dtype, rngs=rngs)
        self.v = Linear(config.d_model, inner, bias=False, parallel="column", dtype=dtype, rngs=rngs)
        self.o = Linear(inner, config.d_model, bias=False, parallel="row", dtype=dtype, rngs=rngs)
        if has_relative_attention_bias:
            self.relative_attention_bias = Embedding(config.relative_attention_num_buckets, config.num_heads,
                                                     dtype=dtype, rngs=rngs)

    def compute_bias(self, length: int):
        """`[1, H, S, S]` position bias of an encoder (bidirectional buckets)."""
        position = np.arange(length)
        buckets = relative_position_bucket(position[None, :] - position[:, None], bidirectional=True,
                                           num_buckets=self.config.relative_attention_num_buckets,
                                           max_distance=self.config.relative_attention_max_distance)
        values = self.relative_attention_bias(jnp.asarray(buckets))  # [S, S, H]
        return values.transpose(2, 0, 1)[None]

    def __call__(self, hidden_states, mask, position_bias):
        if position_bias is None:
            position_bias = self.compute_bias(hidden_states.shape[1])
        d = self.config.d_kv
        q = split_heads(self.q(hidden_states), d)
        k = split_heads(self.k(hidden_states), d)
        v = split_heads(self.v(hidden_states), d)
        # T5 folds any scaling into the initialisation of q: no 1/sqrt(d).
        out = attention(q, k, v, scale=1.0, mask=mask, bias=position_bias)
        return self.o(out), position_bias


class T5LayerSelfAttention(nnx.Module):
    def __init__(self, config: T5Config, *, has_relative_attention_bias: bool, dtype, rngs: nnx.Rngs):
        self.SelfAttention = T5Attention(config, has_relative_attention_bias=has_relative_attention_bias,
                                         dtype=dtype, rngs=rngs)
        self.layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon, style="t5", dtype=dtype)

    def __call__(self, hidden_states, mask, position_bias):
        out, position_bias = self.SelfAttention(self.layer_norm(hidden_states), mask, position_bias)
        return hidden_states + out, position_bias


class T5DenseActDense(nnx.Module):
    """Original T5's feed-forward: `wo(act(wi(x)))`."""

    def __init__(self, config: T5Config, *, dtype, rngs: nnx.Rngs):
        self.act = config.dense_act_fn
        self.wi = Linear(config.d_model, config.d_ff, bias=False, parallel="column", dtype=dtype, rngs=rngs)
        self.wo = Linear(config.d_ff, config.d_model, bias=False, parallel="row", dtype=fp32(dtype), rngs=rngs)

    def __call__(self, hidden_states):
        return self.wo(activation(self.act)(self.wi(hidden_states)))


class T5DenseGatedActDense(nnx.Module):
    """T5 v1.1's feed-forward: `wo(act(wi_0(x)) * wi_1(x))`."""

    def __init__(self, config: T5Config, *, dtype, rngs: nnx.Rngs):
        self.act = config.dense_act_fn
        self.wi_0 = Linear(config.d_model, config.d_ff, bias=False, parallel="column", dtype=dtype, rngs=rngs)
        self.wi_1 = Linear(config.d_model, config.d_ff, bias=False, parallel="column", dtype=dtype, rngs=rngs)
        self.wo = Linear(config.d_ff, config.d_model, bias=False, parallel="row", dtype=fp32(dtype), rngs=rngs)

    def __call__(self, hidden_states):
        return self.wo(activation(self.act)(self.wi_0(hidden_states)) * self.wi_1(hidden_states))


class T5LayerFF(nnx.Module):
    def __init__(self, config: T5Config, *, dtype, rngs: nnx.Rngs):
        cls = T5DenseGatedActDense if config.is_gated_act else T5DenseActDense
        self.DenseReluDense = cls(config, dtype=dtype, rngs=rngs)
        self.layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon, style="t5", dtype=dtype)

    def __call__(self, hidden_states):
        return hidden_states + self.DenseReluDense(self.layer_norm(hidden_states))


class T5Block(nnx.Module):
    def __init__(self, config: T5Config, *, has_relative_attention_bias: bool, dtype, rngs: nnx.Rngs):
        self.layer = nnx.List([
            T5LayerSelfAttention(config, has_relative_attention_bias=has_relative_attention_bias, dtype=dtype,
                                 rngs=rngs),
            T5LayerFF(config, dtype=dtype, rngs=rngs),
        ])

    def __call__(self, hidden_states, mask, position_bias):
        hidden_states, position_bias = self.layer[0](hidden_states, mask, position_bias)
        return self.layer[1](hidden_states), position_bias


class T5Stack(nnx.Module):
    """The encoder stack; its token embedding is the model's `shared` (tied in transformers)."""

    def __init__(self, config: T5Config, *, dtype, rngs: nnx.Rngs):
        self.per_layer_relative_bias = config.per_layer_relative_bias
        self.block = nnx.List([
            T5Block(config, has_relative_attention_bias=config.per_layer_relative_bias or i == 0, dtype=dtype,
                    rngs=rngs)
            for i in range(config.num_layers)])
        self.final_layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon, style="t5", dtype=dtype)

    def __call__(self, inputs_embeds, mask):
        hidden_states, position_bias = inputs_embeds, None
        for block in self.block:
            hidden_states, position_bias = block(hidden_states, mask, position_bias)
            if self.per_layer_relative_bias:
                position_bias = None  # UMT5: the next block computes its own
        return self.final_layer_norm(hidden_states)


class T5EncoderModel(nnx.Module):
    """`(input_ids [B, S] int, attention_mask [B, S] 0/1 or None) -> last_hidden_state [B, S, d_model]`.

    Attention is bidirectional; with `attention_mask` padded keys are masked (transformers'
    `create_bidirectional_mask`). FLUX passes no mask (its 512 tokens attend to the padding
    too); Wan passes it.
    """

    def __init__(self, config: T5Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.shared = Embedding(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.encoder = T5Stack(config, dtype=dtype, rngs=rngs)

    def check_tp(self, tp: int):
        if self.config.num_heads % tp:
            raise ValueError(f"num_heads {self.config.num_heads} does not divide over tp={tp}")

    def check_inputs(self, input_ids, attention_mask=None):
        check_token_inputs(input_ids, attention_mask, vocab_size=self.config.vocab_size, name=type(self).__name__)

    def __call__(self, input_ids, attention_mask=None):
        self.check_inputs(input_ids, attention_mask)
        mask = None if attention_mask is None else padding_mask(attention_mask)
        return self.encoder(self.shared(input_ids), mask)


def build(config: T5Config, dtype=jnp.float32, seed: int = 0) -> T5EncoderModel:
    return T5EncoderModel(config, dtype=loading.dtype_of(dtype), rngs=nnx.Rngs(seed))


def abstract(config: T5Config, dtype=jnp.bfloat16, mesh=None) -> T5EncoderModel:
    """The model without memory (ShapeDtypeStruct parameters, sharded on `mesh` if given)."""
    return loading.abstract(lambda: build(config, dtype), mesh)


# Checkpoint keys the encoder does not read: a decoder and LM head (a full T5 checkpoint), and
# `encoder.embed_tokens.weight` when `shared.weight` is present (transformers ties the two).
SKIP_KEYS = (r"^decoder\.", r"^lm_head\.", r"^encoder\.embed_tokens\.weight$")


def candidates(key: str) -> list[str]:
    return [key, "encoder.embed_tokens.weight"] if key == "shared.weight" else [key]


def from_pretrained(folder, *, dtype=jnp.bfloat16, mesh=None) -> T5EncoderModel:
    """A transformers `T5EncoderModel` / `UMT5EncoderModel` folder (FLUX.1-dev `text_encoder_2/`,
    Wan `text_encoder/`)."""
    config = T5Config.from_dict(loading.read_config(folder))
    return loading.load(lambda: build(config, dtype), folder, candidates=candidates, skip=SKIP_KEYS, mesh=mesh)
