"""LTX-2's text connectors (diffusers `LTX2TextConnectors`, `pipelines/ltx2/connectors.py`, 0.42.1)
in Flax NNX: the stacked Gemma-3 hidden states of a prompt -> the video and audio text embeddings
the transformer cross-attends to.

Reads top to bottom like diffusers' file, with its names (`text_proj_in`, `video_connector.
transformer_blocks.0.attn1.to_q`, `...ff.net.0.proj`, `learnable_registers`), so a checkpoint key
is a parameter path with the leaf renamed (`loading.torch_key`):

1. the hidden states `[B, L, caption_channels * text_proj_in_factor]` (LTX2Pipeline's flattening of
   `stack(hidden_states, -1)`: channel-major, layer-minor) are normalised: LTX-2.0 per prompt and
   layer by the masked mean and range (`per_layer_masked_mean_norm`, times `scale_factor` 8),
   LTX-2.3 (`per_modality_projections`) per token and layer by RMS, masked, rescaled per modality;
2. projected (`text_proj_in`, or `video_text_proj_in` / `audio_text_proj_in`);
3. each of the two 1-D connector transformers: padding replaced by learnable registers (valid
   tokens moved to the front in order, registers by absolute position; the mask then becomes
   all-attend) or, without registers, the padding masked as keys; 1-D RoPE over
   `arange(L) / connector_rope_base_seq_len` ("interleaved" or "split", diffusers'
   `LTX2RotaryPosEmbed1d`, frequencies from float64 as `rope_double_precision`), pre-RMSNorm
   blocks of `LTX2Attention` (RMSNorm across heads on q and k, optional per-head gates
   `2 * sigmoid(to_gate_logits(x))`) and a tanh-GELU feed-forward, then `norm_out`.
4. diffusers' returned mask `(additive_mask < 1e-6)`, which is 1 everywhere for any 0/1 mask
   (the additive mask is 0 or -finfo.max); kept as diffusers computes it.

The connectors run once per prompt and are small next to the text encoder, with a head count
(30 in the released models) that does not divide a 4-way mesh: the parameters are replicated on
the mesh (`tp_spec` P()), no collective runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu.encoders import loading
from difflet_tpu.encoders.layers import Linear, RMSNorm, attention, split_heads


@dataclass(frozen=True)
class LTX2TextConnectorsConfig:
    caption_channels: int = 3840
    text_proj_in_factor: int = 49
    video_connector_num_attention_heads: int = 30
    video_connector_attention_head_dim: int = 128
    video_connector_num_layers: int = 2
    video_connector_num_learnable_registers: int | None = 128
    video_gated_attn: bool = False
    audio_connector_num_attention_heads: int = 30
    audio_connector_attention_head_dim: int = 128
    audio_connector_num_layers: int = 2
    audio_connector_num_learnable_registers: int | None = 128
    audio_gated_attn: bool = False
    connector_rope_base_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_temporal_positioning: bool = False
    rope_type: str = "interleaved"
    per_modality_projections: bool = False
    video_hidden_dim: int = 4096
    audio_hidden_dim: int = 2048
    proj_bias: bool = False

    def __post_init__(self):
        if self.rope_type not in ("interleaved", "split"):
            raise ValueError(f"LTX2TextConnectors: rope_type must be 'interleaved' or 'split', got {self.rope_type!r}")
        # causal_temporal_positioning: diffusers 0.42.1 stores it and never reads it

    @classmethod
    def from_dict(cls, d: dict) -> "LTX2TextConnectorsConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in names)
        if unknown:
            raise ValueError(f"LTX2TextConnectors config: unknown fields {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------
# Feature extraction (LTX-2.0 and LTX-2.3)
# --------------------------------------------------------------------------

def valid_tokens(attention_mask, padding_side: str):
    """bool `[B, L]` from the per-row token counts, as diffusers derives it (a contiguous run at
    the right for left padding, at the left for right padding)."""
    length = attention_mask.shape[1]
    counts = attention_mask.sum(-1, keepdims=True)
    pos = jnp.arange(length)[None]
    if padding_side == "left":
        return pos >= length - counts
    if padding_side == "right":
        return pos < counts
    raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")


def per_layer_masked_mean_norm(hidden, attention_mask, padding_side="left", scale_factor=8, eps=1e-6):
    """`[B, L, D, N]` -> `[B, L, D * N]`: per prompt and layer, minus the mean over valid tokens and
    channels, over their (max - min) range, times `scale_factor`; padding rows zero."""
    b, _, d, _ = hidden.shape
    mask = valid_tokens(attention_mask, padding_side)[:, :, None, None]
    counts = (attention_mask.sum(-1) * d).reshape(b, 1, 1, 1).astype(hidden.dtype)
    mean = jnp.where(mask, hidden, 0.0).sum(axis=(1, 2), keepdims=True) / (counts + eps)
    x_min = jnp.where(mask, hidden, jnp.inf).min(axis=(1, 2), keepdims=True)
    x_max = jnp.where(mask, hidden, -jnp.inf).max(axis=(1, 2), keepdims=True)
    out = (hidden - mean) / (x_max - x_min + eps) * scale_factor
    return jnp.where(mask, out, 0.0).reshape(b, hidden.shape[1], -1)


def per_token_rms_norm(hidden, eps=1e-6):
    """`[B, L, D, N]`: each token and layer over its D channels."""
    return hidden * jax.lax.rsqrt(jnp.mean(jnp.square(hidden), axis=2, keepdims=True) + eps)


# --------------------------------------------------------------------------
# The 1-D connector transformer
# --------------------------------------------------------------------------

def rope_1d(config: LTX2TextConnectorsConfig, heads: int, dim: int, length: int):
    """cos, sin of diffusers' `LTX2RotaryPosEmbed1d` for `dim` = heads * head_dim channels:
    interleaved `[L, dim]`, or split `[H, L, head_dim / 2]` (one batch row; they broadcast)."""
    grid = (np.arange(length, dtype=np.float32) / np.float32(config.connector_rope_base_seq_len))
    ftype = np.float64 if config.rope_double_precision else np.float32
    pow_indices = np.power(ftype(config.rope_theta), np.linspace(0.0, 1.0, dim // 2, dtype=ftype))
    freqs = (pow_indices * np.pi / 2.0).astype(np.float32)
    freqs = (grid[:, None] * np.float32(2) - np.float32(1)) * freqs  # [L, dim / 2]
    if config.rope_type == "interleaved":
        return np.repeat(np.cos(freqs), 2, -1), np.repeat(np.sin(freqs), 2, -1)
    cos, sin = np.cos(freqs).reshape(length, heads, -1), np.sin(freqs).reshape(length, heads, -1)
    return cos.transpose(1, 0, 2), sin.transpose(1, 0, 2)


def apply_rope(x, cos, sin, rope_type: str, heads: int):
    """`x` `[B, L, H * Dh]`, as diffusers' `apply_interleaved_rotary_emb` / `apply_split_rotary_emb`
    (float32 math, cast back)."""
    dtype, xf = x.dtype, x.astype(jnp.float32)
    if rope_type == "interleaved":
        pairs = xf.reshape(*x.shape[:-1], -1, 2)
        rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(x.shape)
        return (xf * cos + rotated * sin).astype(dtype)
    b, length, _ = x.shape
    xh = xf.reshape(b, length, heads, 2, -1).transpose(0, 2, 1, 3, 4)  # [B, H, L, 2, r]
    first, second = xh[..., 0, :], xh[..., 1, :]
    out = jnp.stack([first * cos - second * sin, second * cos + first * sin], -2)
    return out.transpose(0, 2, 1, 3, 4).reshape(x.shape).astype(dtype)


def rms_norm(x, eps=1e-6):
    """torch `nn.RMSNorm(elementwise_affine=False)`."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)).astype(x.dtype)


class Identity(nnx.Module):
    """The parameter-free slots of diffusers' ModuleLists (`to_out.1` Dropout, `ff.net.1`)."""

    def __call__(self, x):
        return x


class LTX2Attention(nnx.Module):
    """diffusers' `LTX2Attention` with `LTX2AudioVideoAttnProcessor`, self-attention only."""

    def __init__(self, dim, heads, head_dim, *, gated, dtype, rngs):
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        lin = lambda i, o: Linear(i, o, dtype=dtype, rngs=rngs)
        self.norm_q = RMSNorm(inner, eps=1e-6, dtype=dtype)
        self.norm_k = RMSNorm(inner, eps=1e-6, dtype=dtype)
        self.to_q, self.to_k, self.to_v = lin(dim, inner), lin(dim, inner), lin(dim, inner)
        self.to_out = nnx.List([lin(inner, dim), Identity()])
        self.to_gate_logits = lin(dim, heads) if gated else None

    def __call__(self, x, bias, cos, sin, rope_type):
        q = apply_rope(self.norm_q(self.to_q(x)), cos, sin, rope_type, self.heads)
        k = apply_rope(self.norm_k(self.to_k(x)), cos, sin, rope_type, self.heads)
        v = self.to_v(x)
        split = lambda t: split_heads(t, self.head_dim)
        out = attention(split(q), split(k), split(v), scale=self.head_dim ** -0.5, bias=bias)
        if self.to_gate_logits is not None:
            gates = 2.0 * jax.nn.sigmoid(self.to_gate_logits(x))  # [B, L, H]
            out = (split(out) * gates[..., None]).reshape(out.shape)
        return self.to_out[0](out)


class GELUProj(nnx.Module):
    """diffusers' `GELU(approximate="tanh")`: `proj` then tanh-GELU."""

    def __init__(self, dim, inner, *, dtype, rngs):
        self.proj = Linear(dim, inner, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.proj(x), approximate=True)


class FeedForward(nnx.Module):
    def __init__(self, dim, *, dtype, rngs):
        self.net = nnx.List([GELUProj(dim, 4 * dim, dtype=dtype, rngs=rngs), Identity(),
                             Linear(4 * dim, dim, dtype=dtype, rngs=rngs)])

    def __call__(self, x):
        return self.net[2](self.net[0](x))


class LTX2TransformerBlock1d(nnx.Module):
    def __init__(self, dim, heads, head_dim, *, gated, dtype, rngs):
        self.attn1 = LTX2Attention(dim, heads, head_dim, gated=gated, dtype=dtype, rngs=rngs)
        self.ff = FeedForward(dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, bias, cos, sin, rope_type):
        x = x + self.attn1(rms_norm(x), bias, cos, sin, rope_type)
        return x + self.ff(rms_norm(x))


class LTX2ConnectorTransformer1d(nnx.Module):
    def __init__(self, config: LTX2TextConnectorsConfig, prefix: str, *, dtype, rngs):
        get = lambda name: getattr(config, f"{prefix}_{name}")
        self.config = config
        self.heads, head_dim = get("connector_num_attention_heads"), get("connector_attention_head_dim")
        self.inner_dim = self.heads * head_dim
        self.num_registers = get("connector_num_learnable_registers")
        if self.num_registers is not None:
            self.learnable_registers = nnx.Param(
                jax.random.uniform(rngs.params(), (self.num_registers, self.inner_dim), dtype, -1.0, 1.0))
        self.transformer_blocks = nnx.List([
            LTX2TransformerBlock1d(self.inner_dim, self.heads, head_dim, gated=get("gated_attn"), dtype=dtype, rngs=rngs)
            for _ in range(get("connector_num_layers"))])

    def __call__(self, hidden_states, additive_mask):
        """`hidden_states` `[B, L, inner]`, `additive_mask` `[B, 1, 1, L]` (0 or -finfo.max) ->
        (hidden states, the mask the blocks used)."""
        batch, length, _ = hidden_states.shape
        if self.num_registers is not None:
            if length % self.num_registers:
                raise ValueError(f"LTX2TextConnectors: the text length {length} must be a multiple of the "
                                 f"{self.num_registers} learnable registers (max_sequence_length)")
            registers = jnp.tile(self.learnable_registers[...], (length // self.num_registers, 1))
            binary = (additive_mask.reshape(batch, length) >= -9000.0).astype(jnp.int32)
            order = jnp.argsort(1 - binary, axis=1, stable=True)
            front = jnp.take_along_axis(hidden_states, order[..., None], axis=1)
            front_mask = (jnp.arange(length)[None] < binary.sum(1, keepdims=True))[..., None]
            hidden_states = jnp.where(front_mask, front, registers[None].astype(hidden_states.dtype))
            additive_mask = jnp.zeros_like(additive_mask)
        cos, sin = (jnp.asarray(t) for t in rope_1d(self.config, self.heads, self.inner_dim, length))
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, additive_mask, cos, sin, self.config.rope_type)
        return rms_norm(hidden_states), additive_mask


class LTX2TextConnectors(nnx.Module):
    """`(text_encoder_hidden_states [B, L, caption_channels * text_proj_in_factor] (or 4-D),
    attention_mask [B, L] 0/1, padding_side, scale_factor) -> (video_text_embedding,
    audio_text_embedding, mask [B, L])`, as diffusers' `forward`."""

    def __init__(self, config: LTX2TextConnectorsConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = c = config
        text_dim = c.caption_channels * c.text_proj_in_factor
        lin = lambda o: Linear(text_dim, o, bias=c.proj_bias, dtype=dtype, rngs=rngs)
        if c.per_modality_projections:
            self.video_text_proj_in = lin(c.video_hidden_dim)
            self.audio_text_proj_in = lin(c.audio_hidden_dim)
        else:
            self.text_proj_in = lin(c.caption_channels)
        self.video_connector = LTX2ConnectorTransformer1d(c, "video", dtype=dtype, rngs=rngs)
        self.audio_connector = LTX2ConnectorTransformer1d(c, "audio", dtype=dtype, rngs=rngs)

    def check_tp(self, tp: int):
        pass  # replicated

    def check_inputs(self, text_encoder_hidden_states, attention_mask):
        c, h = self.config, text_encoder_hidden_states
        want = c.caption_channels * c.text_proj_in_factor
        features = h.shape[2] * h.shape[3] if h.ndim == 4 else h.shape[-1]
        if h.ndim not in (3, 4) or features != want:
            raise ValueError(f"LTX2TextConnectors: text_encoder_hidden_states must be [batch, seq, {want}] "
                             f"(caption_channels {c.caption_channels} x {c.text_proj_in_factor} hidden states), "
                             f"got {tuple(h.shape)}")
        if tuple(attention_mask.shape) != tuple(h.shape[:2]):
            raise ValueError(f"LTX2TextConnectors: attention_mask must be {list(h.shape[:2])}, "
                             f"got {tuple(attention_mask.shape)}")

    def __call__(self, text_encoder_hidden_states, attention_mask, padding_side: str = "left", scale_factor=8):
        self.check_inputs(text_encoder_hidden_states, attention_mask)
        c = self.config
        hidden = text_encoder_hidden_states
        b, length = hidden.shape[:2]
        if hidden.ndim == 3:
            hidden = hidden.reshape(b, length, c.caption_channels, -1)
        if c.per_modality_projections:  # LTX-2.3
            normed = per_token_rms_norm(hidden).reshape(b, length, -1)
            normed = jnp.where(attention_mask.astype(bool)[..., None], normed, 0.0)
            video = self.video_text_proj_in(normed * math.sqrt(c.video_hidden_dim / c.caption_channels))
            audio = self.audio_text_proj_in(normed * math.sqrt(c.audio_hidden_dim / c.caption_channels))
        else:  # LTX-2.0
            normed = per_layer_masked_mean_norm(hidden, attention_mask, padding_side, scale_factor)
            video = audio = self.text_proj_in(normed.astype(hidden.dtype))
        dtype = video.dtype
        additive = ((attention_mask.astype(jnp.int32) - 1).astype(dtype).reshape(b, 1, 1, length)
                    * jnp.finfo(dtype).max)
        video, video_mask = self.video_connector(video, additive)
        binary = (video_mask < 1e-6).astype(jnp.int32).reshape(b, length, 1)
        video = video * binary.astype(video.dtype)
        audio, _ = self.audio_connector(audio, additive)
        return video, audio, binary[..., 0]


def build(config: LTX2TextConnectorsConfig, dtype=jnp.float32, seed: int = 0) -> LTX2TextConnectors:
    return LTX2TextConnectors(config, dtype=loading.dtype_of(dtype), rngs=nnx.Rngs(seed))


def from_pretrained(folder, *, dtype=jnp.float32, mesh=None) -> LTX2TextConnectors:
    """A diffusers `connectors/` folder (config.json, diffusion_pytorch_model.safetensors)."""
    config = LTX2TextConnectorsConfig.from_dict(loading.read_config(folder))
    return loading.load(lambda: build(config, dtype), folder, candidates=lambda key: [key], mesh=mesh,
                        weights="diffusion_pytorch_model")


@nnx.jit(static_argnames=("padding_side",))
def _forward(model, hidden, mask, padding_side):
    return model(hidden, mask, padding_side)


def encode(model: LTX2TextConnectors, text_encoder_hidden_states, attention_mask, padding_side: str = "left"):
    """The connectors under `jax.jit`, inputs checked first, outputs checked finite."""
    hidden, mask = jnp.asarray(text_encoder_hidden_states), jnp.asarray(attention_mask)
    model.check_inputs(hidden, mask)
    out = _forward(model, hidden, mask, padding_side)
    for name, x in zip(("video", "audio"), out[:2]):
        if not bool(jnp.isfinite(x).all()):
            raise FloatingPointError(f"LTX2TextConnectors: the {name} text embedding is not finite")
    return out
