"""A decoder-only language model used as a text encoder, in Flax NNX.

One family for the Llama-shaped LMs (transformers `models/llama/modeling_llama.py`,
`models/qwen2/modeling_qwen2.py`, and the language model of
`models/qwen2_5_vl/modeling_qwen2_5_vl.py`), parametrised by its config: q/k/v bias (Qwen2),
grouped-query attention, RoPE (plain, or Qwen2.5-VL's multimodal RoPE with `mrope_section`),
the RMSNorm epsilon and Gemma's `(1 + w)` weight offset, Gemma's sqrt(hidden) embedding scale,
the MLP activation. Reads top to bottom like those files: token embedding, `num_hidden_layers`
pre-RMSNorm decoder layers (causal self-attention, gated MLP), the final norm.

Verified (tests/encoders) for Qwen2.5-VL's language model on text-only input as diffusers'
`QwenImagePipeline` calls it: `text_encoder(input_ids, attention_mask, output_hidden_states=True)
.hidden_states[-1]`. In transformers that last entry is `last_hidden_state`, i.e. AFTER the final
norm (`capture_outputs` overwrites `hidden_states[-1]` with it), which is what `__call__` returns.
And for Llama (`LlamaModel`, HunyuanVideo's `text_encoder`) as `HunyuanVideoPipeline` calls it:
`.hidden_states[-(num_hidden_layers_to_skip + 1)]` = `hidden_states[-3]`, the output of decoder
layer L - 2 (no final norm): `model(..., hidden_state=-3)` runs only the layers it needs.

Position ids. The multimodal RoPE has three position streams (temporal, height, width); the
rotary frequencies are split by `mrope_section` and section i reads stream i % 3. For text-only
input transformers (5.x, `Qwen2_5_VLModel.compute_3d_position_ids`) computes no 3-D positions
(`get_rope_index` runs only with image/video grids), so the language model uses
`arange(seq_len)` in all three streams for every row, whatever the attention mask: a left-padded
row's first real token has position = its number of pad tokens. `position_ids` ([B, S] or
[3, B, S]) may be passed to override that.

Masking: causal, and with `attention_mask` padded keys are masked too (transformers'
`create_causal_mask`). A query with no key left (a left-padding position) gets a zero attention
output, as torch's SDPA gives transformers' default attention.

Names are transformers' (`layers.0.self_attn.q_proj`); checkpoint keys carry the prefix
`model.language_model.` (transformers >= 4.52 layout) or `model.` (the original Qwen2.5-VL and
Llama layout, also what transformers 5 `save_pretrained` writes). Documented skips: the vision
tower (`visual.*`, `model.visual.*`) and the LM head (`lm_head.*`), which the hidden states do
not use.

Tensor parallelism (`tp`): q/k/v_proj, gate_proj, up_proj column-parallel; o_proj, down_proj
row-parallel; embedding and norms replicated. The query and KV head counts must divide by tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import loading
from .layers import Embedding, Linear, RMSNorm, activation, attention, causal_mask, padding_mask, split_heads
from .runtime import check_token_inputs


@dataclass(frozen=True)
class DecoderLMConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    mrope_section: tuple[int, ...] | None = None  # Qwen2-VL / Qwen2.5-VL multimodal RoPE; None = 1-D RoPE
    attention_bias: bool = False  # bias on q/k/v_proj (Qwen2: True); o_proj has none
    mlp_bias: bool = False
    norm_offset: bool = False  # Gemma: RMSNorm multiplies by (1 + weight)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DecoderLMConfig: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"DecoderLMConfig: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.dim % 2:
            raise ValueError(f"DecoderLMConfig: head_dim {self.dim} must be even for RoPE")
        if self.mrope_section is not None and sum(self.mrope_section) != self.dim // 2:
            raise ValueError(f"DecoderLMConfig: mrope_section {list(self.mrope_section)} must sum to head_dim / 2 = "
                             f"{self.dim // 2}")
        activation(self.hidden_act)

    @property
    def dim(self) -> int:
        """The head dimension."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderLMConfig":
        """From a `config.json` of Qwen2.5-VL (its `text_config`, or the flat fields of
        transformers 4.x configs), Qwen2 or Llama. RoPE must be unscaled ("default")."""
        model_type = d.get("model_type")
        if model_type not in ("qwen2_5_vl", "qwen2_5_vl_text", "qwen2", "llama"):
            raise ValueError(f"unsupported decoder LM config: model_type {model_type!r} "
                             "(supported: qwen2_5_vl, qwen2, llama)")
        text = {**d, **d.get("text_config", {})}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"unsupported RoPE type {rope_type!r} (only unscaled RoPE is implemented)")
        if text.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not implemented (use_sliding_window is true)")
        mrope = rope.get("mrope_section")
        if model_type.startswith("qwen2_5_vl") and mrope is None:
            mrope = [16, 24, 24]  # transformers' default for Qwen2.5-VL
        kwargs = loading.known_fields(cls, text)
        kwargs.update(rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                      mrope_section=None if mrope is None else tuple(mrope),
                      attention_bias=model_type != "llama" or bool(text.get("attention_bias", False)),
                      mlp_bias=bool(text.get("mlp_bias", False)))
        return cls(**kwargs)


# Qwen-Image `text_encoder/config.json`: Qwen2.5-VL-7B-Instruct's language model.
QWEN2_5_VL_7B = DecoderLMConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6,
                                rope_theta=1000000.0, mrope_section=(16, 24, 24), attention_bias=True,
                                max_position_embeddings=128000)


# --------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------

def rope_cos_sin(config: DecoderLMConfig, position_ids, dtype):
    """cos, sin `[B, S, head_dim]` for `position_ids` `[3, B, S]` (transformers'
    `Qwen2_5_VLRotaryEmbedding`: frequency j of the first half reads the stream its
    `mrope_section` chunk selects; the second half repeats the first) or `[B, S]` (1-D RoPE)."""
    dim = config.dim
    inv_freq = (1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)))
    inv_freq = jnp.asarray(inv_freq.astype(np.float32))
    if config.mrope_section is not None:
        stream = np.concatenate([np.full(n, i % 3) for i, n in enumerate(config.mrope_section)])
        pos = position_ids.astype(jnp.float32)[stream]  # [dim/2, B, S]: each frequency's stream
        freqs = pos.transpose(1, 2, 0) * inv_freq
    else:
        freqs = position_ids.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary_pos_emb(x, cos, sin):
    """`x` `[B, S, H, D]`, cos/sin `[B, S, D]`."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------
# Decoder layers
# --------------------------------------------------------------------------

class Attention(nnx.Module):
    def __init__(self, config: DecoderLMConfig, *, dtype, rngs: nnx.Rngs):
        self.head_dim = d = config.dim
        self.scaling = d ** -0.5
        h, kv, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = Linear(config.hidden_size, h * d, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.k_proj = Linear(config.hidden_size, kv * d, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.v_proj = Linear(config.hidden_size, kv * d, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * d, config.hidden_size, bias=False, parallel="row", dtype=dtype, rngs=rngs)

    def __call__(self, hidden_states, mask, cos, sin):
        q = apply_rotary_pos_emb(split_heads(self.q_proj(hidden_states), self.head_dim), cos, sin)
        k = apply_rotary_pos_emb(split_heads(self.k_proj(hidden_states), self.head_dim), cos, sin)
        v = split_heads(self.v_proj(hidden_states), self.head_dim)
        return self.o_proj(attention(q, k, v, scale=self.scaling, mask=mask))


class MLP(nnx.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))`."""

    def __init__(self, config: DecoderLMConfig, *, dtype, rngs: nnx.Rngs):
        self.act = config.hidden_act
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(d, f, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, bias=bias, parallel="row", dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


def rms_norm(config: DecoderLMConfig, dtype) -> RMSNorm:
    return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, style="llama", offset=config.norm_offset, dtype=dtype)


class DecoderLayer(nnx.Module):
    def __init__(self, config: DecoderLMConfig, *, dtype, rngs: nnx.Rngs):
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)
        self.input_layernorm = rms_norm(config, dtype)
        self.post_attention_layernorm = rms_norm(config, dtype)

    def __call__(self, hidden_states, mask, cos, sin):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), mask, cos, sin)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DecoderLM(nnx.Module):
    """`(input_ids [B, S] int, attention_mask [B, S] 0/1 or None, position_ids None | [B, S] |
    [3, B, S], hidden_state=-1) -> [B, S, hidden_size]`: transformers' `hidden_states[hidden_state]`
    (-1: after the final norm; -1 - n: the output of layer L - n; 0: the embeddings)."""

    def __init__(self, config: DecoderLMConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_hidden_layers)])
        self.norm = rms_norm(config, dtype)

    def check_tp(self, tp: int):
        c = self.config
        for name, n in (("num_attention_heads", c.num_attention_heads), ("num_key_value_heads", c.num_key_value_heads)):
            if n % tp:
                raise ValueError(f"{name} {n} does not divide over tp={tp}")

    def check_inputs(self, input_ids, attention_mask=None):
        check_token_inputs(input_ids, attention_mask, vocab_size=self.config.vocab_size, name="DecoderLM")

    def layers_for(self, hidden_state: int) -> int:
        """How many decoder layers `hidden_states[hidden_state]` needs (L + 1 entries: the
        embeddings, then each layer's output, the last one normed)."""
        n = self.config.num_hidden_layers
        if isinstance(hidden_state, bool) or not isinstance(hidden_state, int) or not -(n + 1) <= hidden_state <= n:
            raise ValueError(f"DecoderLM: hidden_state must be an int in [{-(n + 1)}, {n}] (transformers' "
                             f"hidden_states has {n + 1} entries), got {hidden_state!r}")
        return hidden_state % (n + 1)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, hidden_state: int = -1):
        self.check_inputs(input_ids, attention_mask)
        run = self.layers_for(hidden_state)
        batch, length = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        if self.config.embed_scale:
            hidden_states = hidden_states * jnp.asarray(math.sqrt(self.config.hidden_size), hidden_states.dtype)
        streams = 3 if self.config.mrope_section is not None else None
        if position_ids is None:
            # transformers for text-only input: arange in every stream and row, padding or not.
            position_ids = jnp.broadcast_to(jnp.arange(length), (batch, length))
        if streams and position_ids.ndim == 2:
            position_ids = jnp.broadcast_to(position_ids[None], (streams, batch, length))
        want = (streams, batch, length) if streams else (batch, length)
        if tuple(position_ids.shape) != want:
            raise ValueError(f"DecoderLM: position_ids must be [batch, seq] or {list(want)}, "
                             f"got {tuple(position_ids.shape)}")
        cos, sin = rope_cos_sin(self.config, position_ids, hidden_states.dtype)
        mask = causal_mask(length)
        if attention_mask is not None:
            mask = mask & padding_mask(attention_mask)
        for layer in self.layers[:run]:
            hidden_states = layer(hidden_states, mask, cos, sin)
        return self.norm(hidden_states) if run == self.config.num_hidden_layers else hidden_states


def build(config: DecoderLMConfig, dtype=jnp.float32, seed: int = 0) -> DecoderLM:
    return DecoderLM(config, dtype=loading.dtype_of(dtype), rngs=nnx.Rngs(seed))


def abstract(config: DecoderLMConfig, dtype=jnp.bfloat16, mesh=None) -> DecoderLM:
    """The model without memory (ShapeDtypeStruct parameters, sharded on `mesh` if given)."""
    return loading.abstract(lambda: build(config, dtype), mesh)


# Checkpoint keys the text encoder does not read: the vision tower and the LM head.
SKIP_KEYS = (r"^(model\.)?visual\.", r"^lm_head\.")


def candidates(key: str) -> list[str]:
    # a bare `LlamaModel` (HunyuanVideo's text_encoder) saves its keys without a prefix
    return [f"model.language_model.{key}", f"model.{key}", key]


def from_pretrained(folder, *, dtype=jnp.bfloat16, mesh=None) -> DecoderLM:
    """A transformers folder of Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`, e.g. Qwen-Image
    `text_encoder/`), Qwen2 or Llama (`LlamaModel`, e.g. HunyuanVideo `text_encoder/`): the
    language model only."""
    config = DecoderLMConfig.from_dict(loading.read_config(folder))
    return loading.load(lambda: build(config, dtype), folder, candidates=candidates, skip=SKIP_KEYS, mesh=mesh)
