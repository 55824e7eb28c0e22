"""Qwen-Image (diffusers `QwenImageTransformer2DModel`) in Flax NNX, written once for one device, TP and SP.

Reads top to bottom like diffusers' `transformer_qwenimage.py`: the timestep
embedding (`QwenTimestepProjEmbeddings`), `txt_norm` + `txt_in` and `img_in`,
60 dual-stream blocks (`QwenImageTransformerBlock`), `norm_out` and `proj_out`.
It is an MMDiT with double-stream blocks only, composed from the shared layers
(`difflet_tpu/layers/`): the joint attention is `JointAttention` (diffusers'
`Attention(added_kv_proj_dim=dim, qk_norm="rms_norm")` with
`QwenDoubleStreamAttnProcessor2_0`: per-head RMSNorm of q/k, RoPE, the joint
sequence `[text | image]`, the text mask on the keys), `img_mlp` / `txt_mlp` are
`FeedForward` (GELU-tanh), `img_mod` / `txt_mod` are `AdaLN(dim, 6)` (diffusers'
`Sequential(SiLU, Linear(dim, 6 dim))` chunked into shift, scale, gate for the
attention and for the MLP: keys.py maps `img_mod.1` to `img_mod.linear`), and
zero_cond_t's per-token modulation (`modulate_index`) is AdaLN's
`token_replace`.

Every forward runs inside one `shard_map` over the mesh's `tp` axis (or plain
`jit` on one device) and talks to the other ranks only through `Parallel`:

* one device: everything local;
* TP: weights sharded by `PLAN`, activations replicated, a psum after each
  row-parallel matmul (to_out.0, to_add_out, img_mlp.net.2, txt_mlp.net.2);
* SP: the image and the text stream are each sequence-sharded (every rank holds
  its rows of both, each padded eagerly to a multiple of 2P, pad keys masked);
  one all-gather feeds to_q/to_k/to_v (image rows), one add_q/add_k/add_v
  (text rows), attention runs on the full joint sequence for this rank's heads,
  to_out.0 and to_add_out end in reduce-scatters, and each MLP is an all-gather
  in and a reduce-scatter out. No row reordering: the joint sequence is gathered
  stream by stream. Each site's collective is fused into its matmuls (the Pallas
  AG kernel, TPU default, or the JAX rings) or, where a rank's rows are too few
  for a ring to pay, plain (`difflet_tpu.parallel.site_plan.plain_collective_pays`: on TPU,
  the short text stream's MLP).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.layers import nn
from difflet_tpu.layers import AdaLayerNormContinuous, AdaLN, FeedForward, TimestepEmbedding, Weight, modulate, rms_norm
from difflet_tpu.layers.embeddings import timestep_frequencies
from difflet_tpu.layers.mmdit import JointAttention, clip_fp16, joint_attention_plan, stream_rope
from difflet_tpu.parallel.modes import COLUMN, ROW

from .config import EPS, QwenImageConfig

# --------------------------------------------------------------------------
# Parallel plan (module path pattern over the NNX state, stacked blocks without
# an index -> role; everything not listed is replicated). diffusers' `_tp_plan`
# for the attention and MLPs, plus the modulation linears (replicated in
# diffusers): at 20B they are a third of the weights (2 x 3072 x 18432 a block),
# so they are column-parallel here and their small (B, 6D) outputs gathered.
#
# ==========================================  ==========  =========================================
# module                                      role        note
# ==========================================  ==========  =========================================
# transformer_blocks.img_mod / txt_mod        column      Linear(D, 6D) (`img_mod.1`); gather (B, 6D)
# transformer_blocks.attn.to_q / to_k / to_v  column      heads; SP: one all-gather (AG) over image rows
# transformer_blocks.attn.add_q/k/v_proj      column      heads; SP: one AG over text rows
# transformer_blocks.attn.to_out.0            row         SP: a reduce-scatter (RS)
# transformer_blocks.attn.to_add_out          row         SP: an RS (text rows)
# transformer_blocks.img_mlp / txt_mlp        column/row  net.0.proj (GELU-tanh epilogue) / net.2
# norm_out.linear                             column      AdaLayerNormContinuous (D -> 2D)
# attn.norm_q/norm_k/norm_added_q/norm_added_k replicated per-head RMSNorm ([head_dim])
# img_in, txt_in, txt_norm, time_text_embed,  replicated  small; under SP img_in / txt_in run on
# proj_out                                                this rank's rows
# ==========================================  ==========  =========================================
# --------------------------------------------------------------------------
PLAN = {
    "transformer_blocks.img_mod.linear": COLUMN,
    "transformer_blocks.txt_mod.linear": COLUMN,
    **joint_attention_plan("transformer_blocks.attn"),
    "transformer_blocks.img_mlp.net.0.proj": COLUMN,
    "transformer_blocks.img_mlp.net.2": ROW,
    "transformer_blocks.txt_mlp.net.0.proj": COLUMN,
    "transformer_blocks.txt_mlp.net.2": ROW,
    "norm_out.linear": COLUMN,
}


# --------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------

def time_proj(timestep, dtype):
    """`Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)` of the
    timestep as diffusers' forward passes it (`timestep.to(hidden_states.dtype)`):
    `[B, 256]` = [cos, sin] of `1000 * (t * freqs)`, in float32 (float64 for float64
    models). The x1000 comes after the product, as `get_timestep_embedding(scale=1000)`
    applies it; the frequencies are torch's float32 bits (`timestep_frequencies`)."""
    f = nn.fp32(dtype)
    t = jnp.asarray(timestep).astype(dtype).astype(f)
    emb = (t[:, None] * timestep_frequencies(128).astype(f)) * jnp.asarray(1000, f)
    return jnp.concatenate([jnp.cos(emb), jnp.sin(emb)], axis=-1)


class Embedding(nnx.Module):
    """torch `nn.Embedding(num, dim)`: `weight [num, dim]`."""

    def __init__(self, num: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (num, dim), dtype))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


class QwenTimestepProjEmbeddings(nnx.Module):
    """`timestep_embedder(time_proj(t))` (+ `addition_t_embedding(additional_t_cond)`
    with use_additional_t_cond): temb `[B, D]`, replicated."""

    def __init__(self, embedding_dim: int, use_additional_t_cond: bool, *, dtype, rngs: nnx.Rngs):
        self.timestep_embedder = TimestepEmbedding(256, embedding_dim, dtype=dtype, rngs=rngs)
        self.use_additional_t_cond = use_additional_t_cond
        if use_additional_t_cond:
            self.addition_t_embedding = Embedding(2, embedding_dim, dtype=dtype, rngs=rngs)

    def __call__(self, timestep, dtype, addition_t_cond=None):
        conditioning = self.timestep_embedder(time_proj(timestep, dtype).astype(dtype))
        if self.use_additional_t_cond:
            conditioning = conditioning + self.addition_t_embedding(addition_t_cond).astype(dtype)
        return conditioning


# --------------------------------------------------------------------------
# The dual-stream block
# --------------------------------------------------------------------------

class QwenImageTransformerBlock(nnx.Module):
    """diffusers' `QwenImageTransformerBlock`: per stream adaLN modulation (`img_mod`,
    `txt_mod`: shift, scale, gate for attention, then for the MLP), LayerNorms without
    affine (`img_norm1/2`, `txt_norm1/2`), joint attention, gated residuals, a GELU-tanh
    MLP per stream (`img_mlp`, `txt_mlp`); float16 activations clipped."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, *, dtype, rngs: nnx.Rngs):
        self.img_mod = AdaLN(dim, 6, dtype=dtype, rngs=rngs)
        self.attn = JointAttention(dim, num_attention_heads, attention_head_dim, added_kv=True,
                                   context_first=True, eps=EPS, dtype=dtype, rngs=rngs)
        self.img_mlp = FeedForward(dim, dim_out=dim, activation_fn="gelu-approximate", dtype=dtype, rngs=rngs)
        self.txt_mod = AdaLN(dim, 6, dtype=dtype, rngs=rngs)
        self.txt_mlp = FeedForward(dim, dim_out=dim, activation_fn="gelu-approximate", dtype=dtype, rngs=rngs)

    def __call__(self, par, hidden_states, encoder_hidden_states, temb, rope, kv_mask, token_replace=None):
        """hidden_states: the image stream, encoder_hidden_states: the text stream (each this
        rank's rows under SP); `rope`, `kv_mask`: the joint [text | image] sequence's rows.
        token_replace: zero_cond_t's (bool `[image rows held]`, t = 0 embedding): those rows
        take the t = 0 modulation (diffusers' `modulate_index == 1`)."""
        img_shift1, img_scale1, img_gate1, img_shift2, img_scale2, img_gate2 = self.img_mod(par, temb, token_replace)
        txt_shift1, txt_scale1, txt_gate1, txt_shift2, txt_scale2, txt_gate2 = self.txt_mod(par, temb)

        img_modulated = modulate(hidden_states, img_shift1, img_scale1, EPS)
        txt_modulated = modulate(encoder_hidden_states, txt_shift1, txt_scale1, EPS)
        img_attn_output, txt_attn_output = self.attn(par, img_modulated, txt_modulated, rope, kv_mask)
        hidden_states = hidden_states + img_gate1 * img_attn_output
        encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn_output

        img_modulated2 = modulate(hidden_states, img_shift2, img_scale2, EPS)
        hidden_states = hidden_states + img_gate2 * self.img_mlp(par, img_modulated2)
        txt_modulated2 = modulate(encoder_hidden_states, txt_shift2, txt_scale2, EPS)
        encoder_hidden_states = encoder_hidden_states + txt_gate2 * self.txt_mlp(par, txt_modulated2)
        return clip_fp16(hidden_states), clip_fp16(encoder_hidden_states)


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------

class QwenImageTransformer2DModel(nnx.Module):
    """diffusers' QwenImageTransformer2DModel in Flax NNX; run it through `Runner`."""

    def __init__(self, config: QwenImageConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        D = c.inner_dim
        self.time_text_embed = QwenTimestepProjEmbeddings(D, c.use_additional_t_cond, dtype=dtype, rngs=rngs)
        self.txt_norm = Weight(c.joint_attention_dim, dtype=dtype)  # RMSNorm(joint_attention_dim, eps=1e-6)
        self.img_in = nn.Linear(c.in_channels, D, dtype=dtype, rngs=rngs)
        self.txt_in = nn.Linear(c.joint_attention_dim, D, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nn.stacked(
            lambda r: QwenImageTransformerBlock(D, c.num_attention_heads, c.attention_head_dim, dtype=dtype, rngs=r),
            c.num_layers, rngs)
        self.norm_out = AdaLayerNormContinuous(D, EPS, dtype=dtype, rngs=rngs)
        self.proj_out = nn.Linear(D, c.out_features, dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.img_in.kernel.dtype

    def __call__(self, par, hidden_states, encoder_hidden_states, timestep, freqs_cos, freqs_sin, kv_mask=None,
                 additional_t_cond=None, cond_rows=None):
        """One forward inside the step.

        hidden_states `[B, N_img, in_channels]` (packed latents) and encoder_hidden_states
        `[B, N_txt, joint_attention_dim]`: every row (one device, TP) or this rank's rows
        of each stream (SP; each padded to a multiple of 2P). timestep `[B]` float32 as
        diffusers takes it (t / 1000). freqs_cos / freqs_sin `[S, head_dim]` for the
        joint [text | image] sequence (`rope.joint_tables`). kv_mask: None, or bool
        `[S]` / `[B, S]` (False for masked text and pad keys). additional_t_cond `[B]`
        int32 (use_additional_t_cond). cond_rows: bool `[image rows held]`, True for
        the condition images' tokens (zero_cond_t). Returns proj_out's output for the
        image rows held.
        """
        c = self.config
        dtype = self.dtype
        hidden_states = self.img_in(hidden_states.astype(dtype))
        temb = self.time_text_embed(timestep, dtype, additional_t_cond)
        token_replace = None
        if c.zero_cond_t:  # diffusers: cat([t, 0 * t]), image rows picked by modulate_index
            token_replace = (cond_rows, self.time_text_embed(jnp.zeros_like(timestep), dtype))
        encoder_hidden_states = rms_norm(encoder_hidden_states.astype(dtype), self.txt_norm.scale[...], EPS)
        encoder_hidden_states = self.txt_in(encoder_hidden_states)

        rope = (freqs_cos, freqs_sin, c.split_rope)
        if par.seq_sharded:  # each stream's rows of the tables, sliced once (JointAttention)
            rope = stream_rope(rope, encoder_hidden_states.shape[1] * par.size)
        hidden_states, encoder_hidden_states = nn.scan_blocks(
            self.transformer_blocks, (hidden_states, encoder_hidden_states),
            lambda block, carry: block(par, *carry, temb, rope, kv_mask, token_replace), chain=True)

        return self.proj_out(self.norm_out(par, hidden_states, temb))


def build(config: QwenImageConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> QwenImageTransformer2DModel:
    """The model with random parameters (load a checkpoint with difflet_tpu.loading.load_transformer)."""
    return QwenImageTransformer2DModel(config, dtype=dtype, rngs=rngs)
