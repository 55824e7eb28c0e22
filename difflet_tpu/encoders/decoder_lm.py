"""A decoder-only language model used as a text encoder, in Flax NNX.

One family for the Llama-shaped LMs (transformers `models/llama/modeling_llama.py`,
`models/qwen2/modeling_qwen2.py`, the language model of `models/qwen2_5_vl/modeling_qwen2_5_vl.py`
and of `models/gemma3/modeling_gemma3.py`), parametrised by its config: q/k/v bias (Qwen2),
grouped-query attention, RoPE (plain, or Qwen2.5-VL's multimodal RoPE with `mrope_section`),
the RMSNorm epsilon, the MLP activation, and Gemma-3's differences: the `(1 + w)` RMSNorm
(`norm_offset`), the sqrt(hidden) embedding scale (`embed_scale`), sandwich norms
(`sandwich_norm`: the attention and MLP outputs are normed before their residual add, and the MLP
input by `pre_feedforward_layernorm`), RMS-normed queries and keys per head (`qk_norm`), the
attention scale `query_pre_attn_scalar ** -0.5`, and `layer_types`: "sliding_attention" layers
see the last `sliding_window` keys only and use RoPE base `rope_local_theta`, "full_attention"
layers see every earlier key with RoPE base `rope_theta` and linear scaling `rope_scaling_factor`
(positions divided by it). Reads top to bottom like those files: token embedding,
`num_hidden_layers` pre-RMSNorm decoder layers (causal self-attention, gated MLP), the final norm.

`output_hidden_states=True` returns every entry of transformers' `hidden_states` (the embeddings,
then each layer's output, the last one after the final norm), as LTX2Pipeline stacks them.

Verified (tests/encoders) for Gemma-3 (`Gemma3ForConditionalGeneration`, LTX-2's text encoder) on
text-only input as diffusers' `LTX2Pipeline` calls it (left padding, every hidden state), and for
Qwen2.5-VL's language model on text-only input as diffusers' `QwenImagePipeline` calls it: `text_encoder(input_ids, attention_mask, output_hidden_states=True)
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
`model.language_model.` (transformers >= 4.52 layout), `model.` (the original Qwen2.5-VL and
Llama layout, also what transformers 5 `save_pretrained` writes for them) or `language_model.model.`
(Gemma-3's published layout, which transformers 5 `save_pretrained` writes for it). Documented skips: the vision
towers (`visual.*`, `model.visual.*`; Gemma-3's `model.vision_tower.*`, `model.multi_modal_projector.*`)
and the LM head (`lm_head.*`), which the hidden states do not use.

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
    sandwich_norm: bool = False  # Gemma-3: post-attention / pre- and post-feedforward norms
    qk_norm: bool = False  # Gemma-3: q_norm / k_norm (RMSNorm over head_dim) before RoPE
    query_pre_attn_scalar: float | None = None  # attention scale scalar ** -0.5; None: head_dim
    layer_types: tuple[str, ...] | None = None  # Gemma-3: "sliding_attention" | "full_attention" each layer
    sliding_window: int | None = None  # keys a sliding layer sees: j > i - sliding_window
    rope_scaling_factor: float = 1.0  # linear RoPE scaling of the full-attention layers
    rope_local_theta: float | None = None  # RoPE base of the sliding layers; None: rope_theta

    def __post_init__(self):
        for name in ("mrope_section", "layer_types"):  # tuples: the config is hashed as a jit static
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
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
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"DecoderLMConfig: {len(self.layer_types)} layer_types for {self.num_hidden_layers} "
                                 "layers")
            bad = set(self.layer_types) - {"sliding_attention", "full_attention"}
            if bad:
                raise ValueError(f"DecoderLMConfig: unsupported layer_types {sorted(bad)}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
                raise ValueError(f"DecoderLMConfig: sliding layers need sliding_window > 0, got {self.sliding_window}")

    def sliding(self, i: int) -> bool:
        return self.layer_types is not None and self.layer_types[i] == "sliding_attention"

    @property
    def dim(self) -> int:
        """The head dimension."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderLMConfig":
        """From a `config.json` of Qwen2.5-VL (its `text_config`, or the flat fields of
        transformers 4.x configs), Qwen2 or Llama. RoPE must be unscaled ("default")."""
        model_type = d.get("model_type")
        if model_type in ("gemma3", "gemma3_text"):
            return cls.from_gemma3(d)
        if model_type not in ("qwen2_5_vl", "qwen2_5_vl_text", "qwen2", "llama"):
            raise ValueError(f"unsupported decoder LM config: model_type {model_type!r} "
                             "(supported: gemma3, qwen2_5_vl, qwen2, llama)")
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

    @classmethod
    def from_gemma3(cls, d: dict) -> "DecoderLMConfig":
        """From a Gemma-3 `config.json` (`Gemma3ForConditionalGeneration`'s `text_config`, or
        `gemma3_text`): transformers' `Gemma3TextConfig` defaults for absent fields, RoPE per layer
        type from `rope_parameters` (or the older `rope_scaling` + `rope_theta` + `rope_local_base_freq`)."""
        text = {**d, **d.get("text_config", {})}
        defaults = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                        max_position_embeddings=131072, query_pre_attn_scalar=256, sliding_window=4096)
        text = {**defaults, **text}
        for field in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
            if text.get(field):
                raise ValueError(f"Gemma-3 config: {field}={text[field]!r} is not implemented")
        layers = text.get("layer_types") or [
            "sliding_attention" if (i + 1) % text.get("sliding_window_pattern", 6) else "full_attention"
            for i in range(text["num_hidden_layers"])]
        rope = text.get("rope_parameters") or {}
        full = {"rope_theta": text.get("rope_theta", 1e6), **(text.get("rope_scaling") or {}),
                **(rope.get("full_attention") or {})}
        local = {"rope_theta": text.get("rope_local_base_freq", 1e4), **(rope.get("sliding_attention") or {})}
        for kind, params, allowed in (("full_attention", full, ("default", "linear")),
                                      ("sliding_attention", local, ("default",))):
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type not in allowed:
                raise ValueError(f"Gemma-3 config: RoPE {rope_type!r} for {kind} is not implemented "
                                 f"(implemented: {', '.join(allowed)})")
        kwargs = loading.known_fields(cls, text)
        kwargs.update(hidden_act=text.get("hidden_activation", "gelu_pytorch_tanh"), norm_offset=True,
                      embed_scale=True, sandwich_norm=True, qk_norm=True, layer_types=tuple(layers),
                      query_pre_attn_scalar=float(text["query_pre_attn_scalar"]), attention_bias=False,
                      rope_theta=float(full["rope_theta"]), rope_scaling_factor=float(full.get("factor", 1.0)),
                      rope_local_theta=float(local["rope_theta"]), mrope_section=None)
        return cls(**kwargs)


# Qwen-Image `text_encoder/config.json`: Qwen2.5-VL-7B-Instruct's language model.
QWEN2_5_VL_7B = DecoderLMConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6,
                                rope_theta=1000000.0, mrope_section=(16, 24, 24), attention_bias=True,
                                max_position_embeddings=128000)


# --------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------

def rope_cos_sin(config: DecoderLMConfig, position_ids, dtype, *, sliding: bool = False):
    """cos, sin `[B, S, head_dim]` for `position_ids` `[3, B, S]` (transformers'
    `Qwen2_5_VLRotaryEmbedding`: frequency j of the first half reads the stream its
    `mrope_section` chunk selects; the second half repeats the first) or `[B, S]` (1-D RoPE).
    `sliding`: the RoPE of Gemma-3's sliding layers (base `rope_local_theta`, unscaled); else base
    `rope_theta` with the linear `rope_scaling_factor` (transformers' "linear": inv_freq / factor)."""
    dim = config.dim
    theta = config.rope_local_theta if sliding and config.rope_local_theta is not None else config.rope_theta
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)))
    if not sliding and config.rope_scaling_factor != 1.0:
        inv_freq = inv_freq / np.float32(config.rope_scaling_factor)
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
        self.scaling = (config.query_pre_attn_scalar or d) ** -0.5
        h, kv, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = Linear(config.hidden_size, h * d, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.k_proj = Linear(config.hidden_size, kv * d, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.v_proj = Linear(config.hidden_size, kv * d, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * d, config.hidden_size, bias=False, parallel="row", dtype=dtype, rngs=rngs)
        if config.qk_norm:  # per head, replicated
            self.q_norm = rms_norm(config, dtype, d)
            self.k_norm = rms_norm(config, dtype, d)
        self.qk_norm = config.qk_norm

    def __call__(self, hidden_states, mask, cos, sin):
        q = split_heads(self.q_proj(hidden_states), self.head_dim)
        k = split_heads(self.k_proj(hidden_states), self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
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


def rms_norm(config: DecoderLMConfig, dtype, features: int | None = None) -> RMSNorm:
    return RMSNorm(features or config.hidden_size, eps=config.rms_norm_eps, style="llama", offset=config.norm_offset,
                   dtype=dtype)


class DecoderLayer(nnx.Module):
    """Llama: `h + attn(input_ln(h))`, then `h + mlp(post_attention_ln(h))`. Gemma-3
    (`sandwich_norm`): `h + post_attention_ln(attn(input_ln(h)))`, then
    `h + post_feedforward_ln(mlp(pre_feedforward_ln(h)))`."""

    def __init__(self, config: DecoderLMConfig, *, dtype, rngs: nnx.Rngs):
        self.sandwich = config.sandwich_norm
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)
        self.input_layernorm = rms_norm(config, dtype)
        self.post_attention_layernorm = rms_norm(config, dtype)
        if self.sandwich:
            self.pre_feedforward_layernorm = rms_norm(config, dtype)
            self.post_feedforward_layernorm = rms_norm(config, dtype)

    def __call__(self, hidden_states, mask, cos, sin):
        attn = self.self_attn(self.input_layernorm(hidden_states), mask, cos, sin)
        if not self.sandwich:
            hidden_states = hidden_states + attn
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        return hidden_states + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden_states)))


def sliding_window_mask(length: int, window: int):
    """bool `[1, 1, S, S]`: query i sees keys i - window < j (transformers' `sliding_window_overlay`),
    combined with the causal mask by the caller."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    return jnp.asarray(j > i - window)[None, None]


def scale_embeddings(config: DecoderLMConfig, hidden_states):
    """Gemma: the token embeddings times sqrt(hidden_size) (transformers' `embed_scale`)."""
    if config.embed_scale:
        hidden_states = hidden_states * jnp.asarray(math.sqrt(config.hidden_size), hidden_states.dtype)
    return hidden_states


def layer_inputs(config: DecoderLMConfig, batch: int, length: int, dtype, attention_mask=None, position_ids=None,
                 run: int | None = None) -> tuple:
    """(mask, cos, sin) of the full-attention layers and of the sliding ones (None when none of the
    first `run` layers slides): what every decoder layer reads besides the hidden states."""
    run = config.num_hidden_layers if run is None else run
    streams = 3 if config.mrope_section is not None else None
    if position_ids is None:
        # transformers for text-only input: arange in every stream and row, padding or not.
        position_ids = jnp.broadcast_to(jnp.arange(length), (batch, length))
    if streams and position_ids.ndim == 2:
        position_ids = jnp.broadcast_to(position_ids[None], (streams, batch, length))
    want = (streams, batch, length) if streams else (batch, length)
    if tuple(position_ids.shape) != want:
        raise ValueError(f"DecoderLM: position_ids must be [batch, seq] or {list(want)}, "
                         f"got {tuple(position_ids.shape)}")
    mask = causal_mask(length)
    if attention_mask is not None:
        mask = mask & padding_mask(attention_mask)
    full = (mask, *rope_cos_sin(config, position_ids, dtype))
    sliding = None
    if any(config.sliding(i) for i in range(run)):
        sliding = (mask & sliding_window_mask(length, config.sliding_window),
                   *rope_cos_sin(config, position_ids, dtype, sliding=True))
    return full, sliding


class DecoderLM(nnx.Module):
    """`(input_ids [B, S] int, attention_mask [B, S] 0/1 or None, position_ids None | [B, S] |
    [3, B, S], hidden_state=-1, output_hidden_states=False) -> [B, S, hidden_size]`: transformers'
    `hidden_states[hidden_state]` (-1: after the final norm; -1 - n: the output of layer L - n; 0: the
    embeddings); with `output_hidden_states=True` the tuple of transformers' `hidden_states`
    (embeddings, then each layer's output, the last after the final norm: `num_hidden_layers + 1`
    entries)."""

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

    def __call__(self, input_ids, attention_mask=None, position_ids=None, hidden_state: int = -1,
                 output_hidden_states: bool = False):
        self.check_inputs(input_ids, attention_mask)
        config = self.config
        run = config.num_hidden_layers if output_hidden_states else self.layers_for(hidden_state)
        batch, length = input_ids.shape
        hidden_states = scale_embeddings(config, self.embed_tokens(input_ids))
        kinds = layer_inputs(config, batch, length, hidden_states.dtype, attention_mask, position_ids, run)
        states = [hidden_states]
        for i, layer in enumerate(self.layers[:run]):
            hidden_states = layer(hidden_states, *kinds[config.sliding(i)])
            states.append(hidden_states)
        if run == config.num_hidden_layers:
            states[-1] = self.norm(hidden_states)
        return tuple(states) if output_hidden_states else states[-1]


def build(config: DecoderLMConfig, dtype=jnp.float32, seed: int = 0) -> DecoderLM:
    return DecoderLM(config, dtype=loading.dtype_of(dtype), rngs=nnx.Rngs(seed))


def abstract(config: DecoderLMConfig, dtype=jnp.bfloat16, mesh=None) -> DecoderLM:
    """The model without memory (ShapeDtypeStruct parameters, sharded on `mesh` if given)."""
    return loading.abstract(lambda: build(config, dtype), mesh)


# Checkpoint keys the text encoder does not read: the vision towers and the LM head.
SKIP_KEYS = (r"^(model\.)?visual\.", r"^(model\.)?vision_tower\.", r"^(model\.)?multi_modal_projector\.",
             r"^(language_model\.)?lm_head\.")


def candidates(key: str) -> list[str]:
    # a bare `LlamaModel` (HunyuanVideo's text_encoder) saves its keys without a prefix; the last:
    # Gemma-3's published layout, which transformers 5 also writes for it
    return [f"model.language_model.{key}", f"model.{key}", key, f"language_model.model.{key}"]


def from_pretrained(folder, *, dtype=jnp.bfloat16, mesh=None, memory_kind: str | None = None) -> DecoderLM:
    """A transformers folder of Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`, e.g. Qwen-Image
    `text_encoder/`), Gemma-3 (`Gemma3ForConditionalGeneration`, LTX-2's `text_encoder/`), Qwen2 or
    Llama (`LlamaModel`, e.g. HunyuanVideo `text_encoder/`): the language model only."""
    config = DecoderLMConfig.from_dict(loading.read_config(folder))
    return loading.load(lambda: build(config, dtype), folder, candidates=candidates, skip=SKIP_KEYS, mesh=mesh,
                        memory_kind=memory_kind)
