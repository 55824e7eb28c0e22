"""CLIP's text tower (transformers `CLIPTextModel`) in Flax NNX.

Reads top to bottom like transformers `models/clip/modeling_clip.py`: token + learned position
embeddings, pre-LayerNorm encoder layers with causal self-attention and a quick_gelu MLP, the
final LayerNorm, and the pooled output taken at the end-of-text position. FLUX.1's pipeline
uses that pooled output (`FluxPipeline._get_clip_prompt_embeds`: `pooler_output`).

Module and parameter names are transformers' (`encoder.layers.0.self_attn.q_proj`), so a key
maps by `loading.torch_key`. Checkpoints saved by transformers 4.x prefix every key with
`text_model.` (its `CLIPTextModel` wrapped a `CLIPTextTransformer`); both forms load.

Tensor parallelism (`tp`): q/k/v_proj and fc1 column-parallel, out_proj and fc2 row-parallel,
embeddings and LayerNorms replicated (layers.py).

The encoder layers here (`CLIPAttention`, `CLIPMLP`, `CLIPEncoderLayer`, `CLIPEncoder`) are the
vision tower's too (clip_vision.py): they read only the fields both configs have (hidden_size,
intermediate_size, num_attention_heads, num_hidden_layers, hidden_act, layer_norm_eps).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from . import loading
from .layers import Embedding, LayerNorm, Linear, activation, attention, causal_mask, padding_mask, split_heads
from .runtime import check_token_inputs


@dataclass(frozen=True)
class CLIPTextConfig:
    """The fields of transformers' `CLIPTextConfig` this model reads (its defaults are ViT-B/32's;
    these are ViT-L/14's, FLUX.1-dev `text_encoder/config.json`)."""

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    # 2 in configs saved before transformers PR #24773 (FLUX.1-dev's): the pooled row is then the
    # argmax token id (the end-of-text id is the largest in CLIP's vocabulary), else the first `eos_token_id`.
    eos_token_id: int = 2

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"CLIPTextConfig: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        activation(self.hidden_act)

    @classmethod
    def from_dict(cls, d: dict) -> "CLIPTextConfig":
        """From a `config.json` (a `CLIPTextConfig`, or a full `CLIPConfig`'s `text_config`)."""
        if d.get("model_type") == "clip" and "text_config" in d:
            d = d["text_config"]
        return cls(**loading.known_fields(cls, d))


# FLUX.1-dev `text_encoder/config.json` (openai/clip-vit-large-patch14's text tower).
CLIP_VIT_L_14 = CLIPTextConfig()


class CLIPTextEmbeddings(nnx.Module):
    def __init__(self, config: CLIPTextConfig, *, dtype, rngs: nnx.Rngs):
        self.token_embedding = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.position_embedding = Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype,
                                            rngs=rngs)

    def __call__(self, input_ids):
        positions = jnp.arange(input_ids.shape[-1])
        return self.token_embedding(input_ids) + self.position_embedding(positions)[None]


class CLIPAttention(nnx.Module):
    def __init__(self, config: CLIPTextConfig, *, dtype, rngs: nnx.Rngs):
        d = config.hidden_size
        self.head_dim = d // config.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.k_proj = Linear(d, d, parallel="column", dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, d, parallel="column", dtype=dtype, rngs=rngs)
        self.q_proj = Linear(d, d, parallel="column", dtype=dtype, rngs=rngs)
        self.out_proj = Linear(d, d, parallel="row", dtype=dtype, rngs=rngs)

    def __call__(self, hidden_states, mask):
        q = split_heads(self.q_proj(hidden_states), self.head_dim)
        k = split_heads(self.k_proj(hidden_states), self.head_dim)
        v = split_heads(self.v_proj(hidden_states), self.head_dim)
        return self.out_proj(attention(q, k, v, scale=self.scale, mask=mask))


class CLIPMLP(nnx.Module):
    def __init__(self, config: CLIPTextConfig, *, dtype, rngs: nnx.Rngs):
        self.act = config.hidden_act
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, parallel="column", dtype=dtype, rngs=rngs)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, parallel="row", dtype=dtype, rngs=rngs)

    def __call__(self, hidden_states):
        return self.fc2(activation(self.act)(self.fc1(hidden_states)))


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, config: CLIPTextConfig, *, dtype, rngs: nnx.Rngs):
        self.self_attn = CLIPAttention(config, dtype=dtype, rngs=rngs)
        self.layer_norm1 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(config, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def __call__(self, hidden_states, mask):
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states), mask)
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class CLIPEncoder(nnx.Module):
    def __init__(self, config: CLIPTextConfig, *, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([CLIPEncoderLayer(config, dtype=dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])

    def __call__(self, hidden_states, mask, num_layers: int | None = None):
        """The first `num_layers` layers (all when None): transformers' `hidden_states[num_layers]`."""
        for i, layer in enumerate(self.layers):
            if num_layers is not None and i == num_layers:
                break
            hidden_states = layer(hidden_states, mask)
        return hidden_states


class CLIPTextModel(nnx.Module):
    """`(input_ids [B, S] int, attention_mask [B, S] 0/1 or None) -> (last_hidden_state [B, S, D],
    pooled_output [B, D])`, as transformers' `last_hidden_state` and `pooler_output`.

    Attention is causal; with `attention_mask`, padded keys are masked too (transformers'
    `create_causal_mask`). FLUX passes no mask (its padding is end-of-text tokens after the text,
    which the causal mask keeps out of every text position).
    """

    def __init__(self, config: CLIPTextConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embeddings = CLIPTextEmbeddings(config, dtype=dtype, rngs=rngs)
        self.encoder = CLIPEncoder(config, dtype=dtype, rngs=rngs)
        self.final_layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def check_tp(self, tp: int):
        if self.config.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {self.config.num_attention_heads} does not divide over tp={tp}")

    def check_inputs(self, input_ids, attention_mask=None):
        check_token_inputs(input_ids, attention_mask, vocab_size=self.config.vocab_size,
                           max_length=self.config.max_position_embeddings, name="CLIPTextModel")

    def __call__(self, input_ids, attention_mask=None):
        self.check_inputs(input_ids, attention_mask)
        hidden_states = self.embeddings(input_ids)
        mask = causal_mask(input_ids.shape[1])
        if attention_mask is not None:
            mask = mask & padding_mask(attention_mask)
        last_hidden_state = self.final_layer_norm(self.encoder(hidden_states, mask))
        if self.config.eos_token_id == 2:
            # Legacy configs (before transformers PR #24773): the end-of-text token has the highest id.
            eos_index = jnp.argmax(input_ids, axis=-1)
        else:
            # The first end-of-text token (padding may repeat it); 0 if there is none, as torch's argmax.
            eos_index = jnp.argmax(input_ids == self.config.eos_token_id, axis=-1)
        pooled_output = jnp.take_along_axis(last_hidden_state, eos_index[:, None, None], axis=1)[:, 0]
        return last_hidden_state, pooled_output


def build(config: CLIPTextConfig, dtype=jnp.float32, seed: int = 0) -> CLIPTextModel:
    return CLIPTextModel(config, dtype=loading.dtype_of(dtype), rngs=nnx.Rngs(seed))


def abstract(config: CLIPTextConfig, dtype=jnp.bfloat16, mesh=None) -> CLIPTextModel:
    """The model without memory (ShapeDtypeStruct parameters, sharded on `mesh` if given)."""
    return loading.abstract(lambda: build(config, dtype), mesh)


# Checkpoint keys this model does not read: the `position_ids` buffer older checkpoints saved.
SKIP_KEYS = (r"(^|\.)embeddings\.position_ids$",)


def from_pretrained(folder, *, dtype=jnp.bfloat16, mesh=None) -> CLIPTextModel:
    """A transformers `CLIPTextModel` folder (e.g. FLUX.1-dev `text_encoder/`); keys with or
    without the `text_model.` prefix of transformers 4.x checkpoints."""
    config = CLIPTextConfig.from_dict(loading.read_config(folder))
    return loading.load(lambda: build(config, dtype), folder, candidates=lambda k: [k, f"text_model.{k}"],
                        skip=SKIP_KEYS, mesh=mesh)
