"""LTX-2 (diffusers `LTX2VideoTransformer3DModel`, 0.42.1) in Flax NNX.

Reads top to bottom like diffusers' `transformer_ltx2.py`, with the same
submodule names, so a diffusers key maps to a parameter path by renaming the
leaf only. One forward serves every parallel mode through `Parallel`:

* the **video** stream (thousands of rows) is sequence-sharded under SP: each
  column-parallel group that reads video rows starts with an all-gather ring
  (`par.column`), each row-parallel output that writes video rows ends in a
  reduce-scatter ring (`par.row`);
* the **audio** stream (tens of rows) and the text stay replicated: under SP
  they run as plain TP (`apar`: column-parallel locally, all-reduce after the
  row-parallel output).

RoPE tables are computed on the host (`layers.rope.fractional`) and arrive sharded over
heads (audio-to-video attention's q table also by rows, for `SP_LOCAL_PLAN`);
the text masks are diffusers' additive -10000 bias; video pad rows (added
eagerly by the Runner for SP) are dropped as keys in video self-attention and
in v2a (video keys).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.layers import nn
from difflet_tpu.parallel.collective_matmul import row_sum_squares
from difflet_tpu.layers import (FeedForward, PixArtAlphaTextProjection, RMSNorm, TimestepEmbedding,
                                get_timestep_embedding, modulate, rms_norm)
from difflet_tpu.layers.across_heads import AcrossHeadsAttention
from difflet_tpu.layers.rope import GroupedRope
from difflet_tpu.parallel.modes import COLUMN, REPLICATED, ROW, SHARDED

from .config import LTX2Config

# --------------------------------------------------------------------------
# The parallel plan (module path patterns over the NNX state; stacked blocks
# without an index). Everything not listed is replicated.
#
# | column-parallel (out features / heads)     | row-parallel (in features)  |
# |--------------------------------------------|-----------------------------|
# | to_q, to_k, to_v, to_gate_logits of attn1, | to_out.0 of the same six    |
# |   attn2, audio_attn1, audio_attn2,         |   attentions; ff.net.2,     |
# |   audio_to_video_attn, video_to_audio_attn |   audio_ff.net.2            |
# | ff.net.0.proj, audio_ff.net.0.proj         |                             |
# | adaLN `.linear` of time_embed,             |                             |
# |   audio_time_embed, av_cross_attn_* (4),   |                             |
# |   prompt_adaln, audio_prompt_adaln: the    |                             |
# |   (B, kD) output is all-gathered           |                             |
#
# SHARDED: norm_q / norm_k weights (RMSNorm across heads; the per-token sum of
# squares is all-reduced over `tp`).
# Replicated: proj_in, audio_proj_in, caption projections, the adaLN timestep
# embedders (linear_1/2), every scale_shift_table, proj_out, audio_proj_out.
# Sequence-sharded under SP: the video residual stream, its norms, modulation
# and gated residuals (per-token timesteps too). Audio and text: replicated.
# --------------------------------------------------------------------------
PLAN = {
    "transformer_blocks.*.to_q": COLUMN,
    "transformer_blocks.*.to_k": COLUMN,
    "transformer_blocks.*.to_v": COLUMN,
    "transformer_blocks.*.to_gate_logits": COLUMN,
    "transformer_blocks.*.norm_q": SHARDED,
    "transformer_blocks.*.norm_k": SHARDED,
    "transformer_blocks.*.to_out.0": ROW,
    "transformer_blocks.*ff.net.0.proj": COLUMN,
    "transformer_blocks.*ff.net.2": ROW,
    "*time_embed.linear": COLUMN,
    "av_cross_attn_*.linear": COLUMN,
    "*prompt_adaln.linear": COLUMN,
}

# Under SP with `Parallel.cross_local` (Config.sp_cross_local): audio-to-video
# attention's queries and output on this rank's video rows with every head, from
# replicated weights, so no ring runs there (both of its rings move 4096-wide video
# rows for 2048-wide products: ICI-bound hops). The audio K/V keep the TP plan and
# are gathered by heads in the block (the audio rows are few and replicated).
SP_LOCAL_PLAN = {
    "transformer_blocks.audio_to_video_attn.to_q": REPLICATED,
    "transformer_blocks.audio_to_video_attn.norm_q": REPLICATED,
    "transformer_blocks.audio_to_video_attn.to_gate_logits": REPLICATED,
    "transformer_blocks.audio_to_video_attn.to_out.0": REPLICATED,
}

TEXT_MASK_BIAS = -10000.0  # diffusers: (1 - mask) * -10000.0


# --------------------------------------------------------------------------
# Embeddings (diffusers embeddings.py)
# --------------------------------------------------------------------------

class PixArtAlphaCombinedTimestepSizeEmbeddings(nnx.Module):
    def __init__(self, embedding_dim, *, dtype, rngs):
        self.timestep_embedder = TimestepEmbedding(256, embedding_dim, dtype=dtype, rngs=rngs)

    def __call__(self, timestep, hidden_dtype):
        return self.timestep_embedder(get_timestep_embedding(timestep).astype(hidden_dtype))


class LTX2AdaLayerNormSingle(nnx.Module):
    """`emb = TimestepEmbedding(Timesteps(t))`; returns `(linear(silu(emb)), emb)`.

    `linear` is column-parallel: each rank computes its columns of the small
    `(B, T, n*D)` output, then all of them are gathered. Per-token timesteps
    under SP hold this rank's rows only, so there the rows are gathered by the
    ring (all rows, this rank's columns) and an all-to-all returns this
    rank's rows with every column.
    """

    def __init__(self, embedding_dim, num_mod_params=6, *, dtype, rngs):
        self.num_mod_params = num_mod_params
        self.emb = PixArtAlphaCombinedTimestepSizeEmbeddings(embedding_dim, dtype=dtype, rngs=rngs)
        self.linear = nn.Linear(embedding_dim, num_mod_params * embedding_dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, timestep, batch_size, hidden_dtype):
        """timestep `(B,)` or `(B, T)` -> `((B, T, n*D), (B, T, D))`."""
        tokens = timestep.reshape(batch_size, -1).shape[1]
        embedded = self.emb(timestep.reshape(-1), hidden_dtype).reshape(batch_size, tokens, -1)
        if par.seq_sharded and tokens > 1:  # this rank's rows of per-token timesteps
            (mod,) = nn.column(par, jax.nn.silu(embedded), [self.linear])
            mod = jax.lax.all_to_all(mod, par.axis, split_axis=1, concat_axis=2, tiled=True)
        else:
            mod = par.gather_columns(self.linear(jax.nn.silu(embedded)))
        return mod, embedded


# --------------------------------------------------------------------------
# Attention: `layers.across_heads` (every attention of the block)
# --------------------------------------------------------------------------

# --------------------------------------------------------------------------
# The block
# --------------------------------------------------------------------------

def norm_after_add(norm: RMSNorm, x, sum_sq=None):
    """`norm(x)` for an x the block has just written (a gated residual add): the same
    math, but the sum of squares (`sum_sq`, or `row_sum_squares(x)`) is not read through
    `rms_norm`'s optimization barrier, so XLA reduces it in the fusion that writes x
    (one pass over the video rows less per norm; the scaling still fuses into its
    consumer)."""
    return rms_norm(x, None if norm.weight is None else norm.weight.scale[...], norm.eps,
                    sum_sq=row_sum_squares(x) if sum_sq is None else sum_sq, dim=x.shape[-1])


class BlockInputs(NamedTuple):
    """Per-forward tensors every block reads (this rank's video rows under SP)."""

    encoder_hidden_states: jax.Array
    audio_encoder_hidden_states: jax.Array
    temb: jax.Array
    temb_audio: jax.Array
    temb_ca_scale_shift: jax.Array
    temb_ca_audio_scale_shift: jax.Array
    temb_ca_gate: jax.Array
    temb_ca_audio_gate: jax.Array
    temb_prompt: jax.Array | None
    temb_prompt_audio: jax.Array | None
    video_rotary_emb: GroupedRope
    audio_rotary_emb: GroupedRope
    ca_video_rotary_emb: GroupedRope
    ca_audio_rotary_emb: GroupedRope
    ca_video_local_rotary_emb: GroupedRope | None  # this rank's video rows, every channel (SP_LOCAL_PLAN)
    encoder_attention_mask: jax.Array | None  # additive (B, 1, L)
    audio_encoder_attention_mask: jax.Array | None
    video_kv_mask: jax.Array | None  # bool [Nv_padded]: False for pad rows
    perturbation_mask: jax.Array | None  # (B, 1, 1)
    stg_layers: jax.Array | None  # bool [num_layers]


def get_mod_params(scale_shift_table, temb, batch_size):
    n = scale_shift_table.shape[0]
    ada = scale_shift_table[None, None] + temb.reshape(batch_size, temb.shape[1], n, -1)
    return [ada[:, :, i] for i in range(n)]


class LTX2VideoTransformerBlock(nnx.Module):
    def __init__(self, c: LTX2Config, *, dtype, rngs):
        dim, adim = c.inner_dim, c.audio_inner_dim
        eps, affine = c.norm_eps, c.norm_elementwise_affine
        attn = lambda q, h, d, **kw: AcrossHeadsAttention(q, h, d, bias=c.attention_bias, out_bias=c.attention_out_bias,
                                                          eps=eps, row_major=True, dtype=dtype, rngs=rngs, **kw)
        H, Dh, Ha, Dha = c.num_attention_heads, c.attention_head_dim, c.audio_num_attention_heads, \
            c.audio_attention_head_dim
        self.perturbed_attn = c.perturbed_attn

        # 1. Self-attention (video and audio)
        self.norm1 = RMSNorm(dim, eps, affine, dtype=dtype)
        self.attn1 = attn(dim, H, Dh, gated=c.gated_attn)
        self.audio_norm1 = RMSNorm(adim, eps, affine, dtype=dtype)
        self.audio_attn1 = attn(adim, Ha, Dha, gated=c.audio_gated_attn)
        # 2. Prompt cross-attention
        self.norm2 = RMSNorm(dim, eps, affine, dtype=dtype)
        self.attn2 = attn(dim, H, Dh, kv_dim=c.cross_attention_dim, gated=c.gated_attn)
        self.audio_norm2 = RMSNorm(adim, eps, affine, dtype=dtype)
        self.audio_attn2 = attn(adim, Ha, Dha, kv_dim=c.audio_cross_attention_dim,
                                gated=c.audio_gated_attn)
        # 3. Audio-to-video (Q video, K/V audio) and video-to-audio (Q audio, K/V video)
        self.audio_to_video_norm = RMSNorm(dim, eps, affine, dtype=dtype)
        self.audio_to_video_attn = attn(dim, Ha, Dha, kv_dim=adim, gated=c.gated_attn)
        self.video_to_audio_norm = RMSNorm(adim, eps, affine, dtype=dtype)
        self.video_to_audio_attn = attn(adim, Ha, Dha, kv_dim=dim,
                                        gated=c.audio_gated_attn)
        # 4. Feed-forward
        self.norm3 = RMSNorm(dim, eps, affine, dtype=dtype)
        self.ff = FeedForward(dim, activation_fn=c.activation_fn, bias=c.ff_bias, dtype=dtype, rngs=rngs)
        self.audio_norm3 = RMSNorm(adim, eps, affine, dtype=dtype)
        self.audio_ff = FeedForward(adim, activation_fn=c.activation_fn, bias=c.audio_ff_bias, dtype=dtype,
                                    rngs=rngs)
        # 5. Per-layer modulation tables
        self.video_cross_attn_adaln = c.cross_attn_mod
        self.audio_cross_attn_adaln = c.audio_cross_attn_mod
        table = lambda n, d, scale: nnx.Param(jax.random.normal(rngs.params(), (n, d), dtype) * scale)
        self.scale_shift_table = table(9 if c.cross_attn_mod else 6, dim, dim ** -0.5)
        self.audio_scale_shift_table = table(9 if c.audio_cross_attn_mod else 6, adim, adim ** -0.5)
        self.cross_attn_adaln = c.cross_attn_mod or c.audio_cross_attn_mod
        if self.cross_attn_adaln:
            self.prompt_scale_shift_table = table(2, dim, 1.0)
            self.audio_prompt_scale_shift_table = table(2, adim, 1.0)
        self.video_a2v_cross_attn_scale_shift_table = table(5, dim, 1.0)
        self.audio_a2v_cross_attn_scale_shift_table = table(5, adim, 1.0)

    def __call__(self, par, apar, hidden_states, audio_hidden_states, b: BlockInputs, *, layer=None,
                 use_a2v_cross_attention=True, use_v2a_cross_attention=True, sum_sq=None, sparse=None):
        """`par` runs the video stream (sequence-sharded under SP), `apar` the audio stream (never).
        `sparse`: the video self-attention's block-sparse mask (`layers.sparse_masks.BlockSparsity`,
        the video rows in its order) or None; every other attention stays dense.

        `sum_sq`: `row_sum_squares(hidden_states)` if the caller has it (the previous block's
        last residual add reduced it), for norm1."""
        batch_size = hidden_states.shape[0]
        perturbation = None
        if self.perturbed_attn and b.perturbation_mask is not None:  # STG: lerp weight 1 off the STG layers
            perturbation = jnp.where(b.stg_layers[layer], b.perturbation_mask, 1.0)

        # 1.1. Video self-attention
        video_ada_params = get_mod_params(self.scale_shift_table[...], b.temb, batch_size)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = video_ada_params[:6]
        if self.video_cross_attn_adaln:
            shift_text_q, scale_text_q, gate_text_q = video_ada_params[6:9]
        norm1 = self.norm1(hidden_states) if sum_sq is None else norm_after_add(self.norm1, hidden_states, sum_sq)
        norm_hidden_states = norm1 * (1 + scale_msa) + shift_msa
        attn_hidden_states = self.attn1(par, norm_hidden_states, rope=b.video_rotary_emb, kv_mask=b.video_kv_mask,
                                        perturbation=perturbation, sparse=sparse)
        hidden_states = hidden_states + attn_hidden_states * gate_msa

        # 1.2. Audio self-attention
        audio_ada_params = get_mod_params(self.audio_scale_shift_table[...], b.temb_audio, batch_size)
        audio_shift_msa, audio_scale_msa, audio_gate_msa, audio_shift_mlp, audio_scale_mlp, audio_gate_mlp = \
            audio_ada_params[:6]
        if self.audio_cross_attn_adaln:
            audio_shift_text_q, audio_scale_text_q, audio_gate_text_q = audio_ada_params[6:9]
        norm_audio_hidden_states = self.audio_norm1(audio_hidden_states) * (1 + audio_scale_msa) + audio_shift_msa
        attn_audio_hidden_states = self.audio_attn1(apar, norm_audio_hidden_states, rope=b.audio_rotary_emb,
                                                    perturbation=perturbation)
        audio_hidden_states = audio_hidden_states + attn_audio_hidden_states * audio_gate_msa

        # 2. Cross-attention with the text (Q: video or audio; K, V: text, replicated)
        encoder_hidden_states, audio_encoder_hidden_states = b.encoder_hidden_states, b.audio_encoder_hidden_states
        if self.cross_attn_adaln:
            if b.temb_prompt is not None:
                shift_text_kv, scale_text_kv = get_mod_params(self.prompt_scale_shift_table[...], b.temb_prompt,
                                                              batch_size)
                audio_shift_text_kv, audio_scale_text_kv = get_mod_params(
                    self.audio_prompt_scale_shift_table[...], b.temb_prompt_audio, batch_size)
            else:  # use_prompt_adaln_single=False: the static per-layer tables only
                shift_text_kv, scale_text_kv = self.prompt_scale_shift_table[...][None, None].transpose(2, 0, 1, 3)
                audio_shift_text_kv, audio_scale_text_kv = \
                    self.audio_prompt_scale_shift_table[...][None, None].transpose(2, 0, 1, 3)

        # 2.1. Video-text
        norm_hidden_states = norm_after_add(self.norm2, hidden_states)
        if self.video_cross_attn_adaln:
            norm_hidden_states = norm_hidden_states * (1 + scale_text_q) + shift_text_q
        if self.cross_attn_adaln:
            encoder_hidden_states = encoder_hidden_states * (1 + scale_text_kv) + shift_text_kv
        attn_hidden_states = self.attn2(par, norm_hidden_states, encoder_hidden_states, kvpar=apar,
                                        bias=b.encoder_attention_mask)
        if self.video_cross_attn_adaln:
            attn_hidden_states = attn_hidden_states * gate_text_q
        hidden_states = hidden_states + attn_hidden_states

        # 2.2. Audio-text
        norm_audio_hidden_states = self.audio_norm2(audio_hidden_states)
        if self.audio_cross_attn_adaln:
            norm_audio_hidden_states = norm_audio_hidden_states * (1 + audio_scale_text_q) + audio_shift_text_q
        if self.cross_attn_adaln:
            audio_encoder_hidden_states = audio_encoder_hidden_states * (1 + audio_scale_text_kv) \
                + audio_shift_text_kv
        attn_audio_hidden_states = self.audio_attn2(apar, norm_audio_hidden_states, audio_encoder_hidden_states,
                                                    bias=b.audio_encoder_attention_mask)
        if self.audio_cross_attn_adaln:
            attn_audio_hidden_states = attn_audio_hidden_states * audio_gate_text_q
        audio_hidden_states = audio_hidden_states + attn_audio_hidden_states

        # 3. Audio-to-video and video-to-audio cross-attention
        if use_a2v_cross_attention or use_v2a_cross_attention:
            norm_hidden_states = norm_after_add(self.audio_to_video_norm, hidden_states)
            norm_audio_hidden_states = self.video_to_audio_norm(audio_hidden_states)

            # 3.1. Global + per-layer modulation (NOTE: scale before shift)
            table = self.video_a2v_cross_attn_scale_shift_table[...]
            video_a2v_ca_scale, video_a2v_ca_shift, video_v2a_ca_scale, video_v2a_ca_shift = get_mod_params(
                table[:4], b.temb_ca_scale_shift, batch_size)
            a2v_gate = get_mod_params(table[4:], b.temb_ca_gate, batch_size)[0]
            table = self.audio_a2v_cross_attn_scale_shift_table[...]
            audio_a2v_ca_scale, audio_a2v_ca_shift, audio_v2a_ca_scale, audio_v2a_ca_shift = get_mod_params(
                table[:4], b.temb_ca_audio_scale_shift, batch_size)
            v2a_gate = get_mod_params(table[4:], b.temb_ca_audio_gate, batch_size)[0]

            # 3.2. a2v: Q video (gathered rows), K/V audio; output reduce-scattered to video rows
            if use_a2v_cross_attention:
                mod_norm_hidden_states = norm_hidden_states * (1 + video_a2v_ca_scale) + video_a2v_ca_shift
                mod_norm_audio_hidden_states = norm_audio_hidden_states * (1 + audio_a2v_ca_scale) \
                    + audio_a2v_ca_shift
                a2v_attn_hidden_states = self.audio_to_video_attn(  # local: SP_LOCAL_PLAN
                    par, mod_norm_hidden_states, mod_norm_audio_hidden_states, kvpar=apar, local=True,
                    rope=b.ca_video_rotary_emb, local_rope=b.ca_video_local_rotary_emb,
                    key_rope=b.ca_audio_rotary_emb)
                hidden_states = hidden_states + a2v_gate * a2v_attn_hidden_states

            # 3.3. v2a: Q audio, K/V video (gathered rows, pad keys dropped); output all-reduced
            if use_v2a_cross_attention:
                mod_norm_hidden_states = norm_hidden_states * (1 + video_v2a_ca_scale) + video_v2a_ca_shift
                mod_norm_audio_hidden_states = norm_audio_hidden_states * (1 + audio_v2a_ca_scale) \
                    + audio_v2a_ca_shift
                v2a_attn_hidden_states = self.video_to_audio_attn(
                    apar, mod_norm_audio_hidden_states, mod_norm_hidden_states, kvpar=par,
                    rope=b.ca_audio_rotary_emb, key_rope=b.ca_video_rotary_emb, kv_mask=b.video_kv_mask)
                audio_hidden_states = audio_hidden_states + v2a_gate * v2a_attn_hidden_states

        # 4. Feed-forward
        norm_hidden_states = norm_after_add(self.norm3, hidden_states) * (1 + scale_mlp) + shift_mlp
        hidden_states = hidden_states + self.ff(par, norm_hidden_states) * gate_mlp
        norm_audio_hidden_states = self.audio_norm3(audio_hidden_states) * (1 + audio_scale_mlp) + audio_shift_mlp
        audio_hidden_states = audio_hidden_states + self.audio_ff(apar, norm_audio_hidden_states) * audio_gate_mlp
        return hidden_states, audio_hidden_states


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------

def rope_groups(c: LTX2Config) -> dict[str, int | None]:
    """Rotation groups of each RoPE's tables ("half" layout), None for interleaved tables.

    Native split: the RoPE module's heads (diffusers groups by `cos.shape[1]`:
    video heads for the video side of a2v/v2a, audio heads for the audio
    side). Interleaved permuted to split halves: the consuming attention's heads.
    """
    if c.rope_type == "split":
        return dict(video=c.num_attention_heads, audio=c.audio_num_attention_heads,
                    ca_video=c.num_attention_heads, ca_audio=c.audio_num_attention_heads)
    if c.split_rope:
        return dict(video=c.num_attention_heads, audio=c.audio_num_attention_heads,
                    ca_video=c.audio_num_attention_heads, ca_audio=c.audio_num_attention_heads)
    return dict(video=None, audio=None, ca_video=None, ca_audio=None)


class LTX2VideoTransformer3DModel(nnx.Module):
    """diffusers' LTX2VideoTransformer3DModel in Flax NNX; run it through `Runner`."""

    def __init__(self, c: LTX2Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = c
        dim, adim = c.inner_dim, c.audio_inner_dim
        lin = lambda i, o: nn.Linear(i, o, dtype=dtype, rngs=rngs)
        adaln = lambda d, n: LTX2AdaLayerNormSingle(d, n, dtype=dtype, rngs=rngs)

        # 1. Patchification input projections
        self.proj_in = lin(c.in_channels, dim)
        self.audio_proj_in = lin(c.audio_in_channels, adim)
        if c.use_keyframes_abs_pos_embedding:
            self.keyframes_abs_pos_embedding = nnx.Param(jnp.zeros((1, dim), dtype))
        # 2. Prompt embeddings (LTX-2.0)
        if c.use_prompt_embeddings:
            self.caption_projection = PixArtAlphaTextProjection(c.caption_channels, dim, dtype=dtype, rngs=rngs)
            self.audio_caption_projection = PixArtAlphaTextProjection(c.caption_channels, adim, dtype=dtype,
                                                                      rngs=rngs)
        # 3. Timestep modulation
        self.time_embed = adaln(dim, 9 if c.cross_attn_mod else 6)
        self.audio_time_embed = adaln(adim, 9 if c.audio_cross_attn_mod else 6)
        self.av_cross_attn_video_scale_shift = adaln(dim, 4)
        self.av_cross_attn_audio_scale_shift = adaln(adim, 4)
        self.av_cross_attn_video_a2v_gate = adaln(dim, 1)
        self.av_cross_attn_audio_v2a_gate = adaln(adim, 1)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (2, dim), dtype) * dim ** -0.5)
        self.audio_scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (2, adim), dtype) * adim ** -0.5)
        if c.prompt_modulation and c.use_prompt_adaln_single:
            self.prompt_adaln = adaln(dim, 2)
            self.audio_prompt_adaln = adaln(adim, 2)
        # 4. RoPE: host-side tables (layers.rope.fractional), no parameters.
        # 5. Transformer blocks, stacked for one scan
        self.transformer_blocks = nn.stacked(lambda r: LTX2VideoTransformerBlock(c, dtype=dtype, rngs=r),
                                             c.num_layers, rngs)
        # 6. Output layers (norm_out / audio_norm_out: LayerNorm without affine)
        self.proj_out = lin(dim, c.video_out_channels)
        self.audio_proj_out = lin(adim, c.audio_output_channels)

    def __call__(self, par, inputs: dict, *, isolate_modalities: bool = False, sparse=None):
        """The forward on prepared inputs (see `port.prepare`): video rows are
        this rank's (padded) rows under SP; returns `(sample, audio_sample)`. `sparse`:
        the video self-attention's block-sparse mask (the rows in its order) or None."""
        c = self.config
        apar = dataclasses.replace(par, mode="tp") if par.seq_sharded else par
        hidden_states = inputs["hidden_states"]
        audio_hidden_states = inputs["audio_hidden_states"]
        batch_size, dtype, adtype = hidden_states.shape[0], hidden_states.dtype, audio_hidden_states.dtype

        # text masks -> additive bias, as diffusers
        def text_bias(mask, dt):
            return None if mask is None else ((1 - mask.astype(dt)) * TEXT_MASK_BIAS)[:, None, :]

        encoder_attention_mask = text_bias(inputs.get("encoder_attention_mask"), dtype)
        audio_encoder_attention_mask = text_bias(inputs.get("audio_encoder_attention_mask"), adtype)

        # 1. RoPE tables (this rank's channels)
        groups = rope_groups(c)
        ropes = {k: GroupedRope(inputs[f"rope_{k}_cos"], inputs[f"rope_{k}_sin"], groups[k]) for k in groups}
        ropes["ca_video_local"] = (GroupedRope(inputs["rope_ca_video_local_cos"], inputs["rope_ca_video_local_sin"],
                                        groups["ca_video"]) if "rope_ca_video_local_cos" in inputs else None)

        # 2. Input projections
        hidden_states = self.proj_in(hidden_states)
        audio_hidden_states = self.audio_proj_in(audio_hidden_states)
        if c.use_keyframes_abs_pos_embedding and inputs.get("video_keyframes_mask") is not None:
            marker = (inputs["video_keyframes_mask"] > 0).astype(dtype)
            hidden_states = hidden_states + marker * self.keyframes_abs_pos_embedding[...].astype(dtype)

        # 3. Timestep embeddings and modulation
        gate_factor = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        temb, embedded_timestep = self.time_embed(par, inputs["timestep"], batch_size, dtype)
        temb_audio, audio_embedded_timestep = self.audio_time_embed(par, inputs["audio_timestep"], batch_size,
                                                                    adtype)
        if c.prompt_modulation and c.use_prompt_adaln_single:
            temb_prompt, _ = self.prompt_adaln(par, inputs["sigma"], batch_size, dtype)
            temb_prompt_audio, _ = self.audio_prompt_adaln(par, inputs["audio_sigma"], batch_size, adtype)
        else:
            temb_prompt = temb_prompt_audio = None
        video_ca_timestep, audio_ca_timestep = inputs["video_ca_timestep"], inputs["audio_ca_timestep"]
        video_cross_attn_scale_shift, _ = self.av_cross_attn_video_scale_shift(par, video_ca_timestep, batch_size,
                                                                               dtype)
        video_cross_attn_a2v_gate, _ = self.av_cross_attn_video_a2v_gate(par, video_ca_timestep * gate_factor,
                                                                         batch_size, dtype)
        audio_cross_attn_scale_shift, _ = self.av_cross_attn_audio_scale_shift(par, audio_ca_timestep, batch_size,
                                                                               adtype)
        audio_cross_attn_v2a_gate, _ = self.av_cross_attn_audio_v2a_gate(par, audio_ca_timestep * gate_factor,
                                                                         batch_size, adtype)

        # 4. Prompt embeddings (LTX-2.0)
        encoder_hidden_states = inputs["encoder_hidden_states"]
        audio_encoder_hidden_states = inputs["audio_encoder_hidden_states"]
        if c.use_prompt_embeddings:
            encoder_hidden_states = self.caption_projection(encoder_hidden_states)
            audio_encoder_hidden_states = self.audio_caption_projection(audio_encoder_hidden_states)

        # 5. Transformer blocks: one scan over the stacked parameters
        perturbation_mask = inputs.get("perturbation_mask")
        b = BlockInputs(
            encoder_hidden_states, audio_encoder_hidden_states, temb, temb_audio, video_cross_attn_scale_shift,
            audio_cross_attn_scale_shift, video_cross_attn_a2v_gate, audio_cross_attn_v2a_gate, temb_prompt,
            temb_prompt_audio, ropes["video"], ropes["audio"], ropes["ca_video"], ropes["ca_audio"],
            ropes["ca_video_local"],
            encoder_attention_mask, audio_encoder_attention_mask, inputs.get("video_kv_mask"),
            None if perturbation_mask is None else perturbation_mask.reshape(-1, 1, 1),
            inputs.get("stg_layers"))

        # the video rows' sum of squares for the next norm1 is carried: reduced in the
        # fusion of the block's last residual add, not in a pass of its own per block
        def body(block, carry):
            h, a, ssq, layer = carry
            h, a = block(par, apar, h, a, b, layer=layer, use_a2v_cross_attention=not isolate_modalities,
                         use_v2a_cross_attention=not isolate_modalities, sum_sq=ssq, sparse=sparse)
            return h, a, row_sum_squares(h), layer + 1

        hidden_states, audio_hidden_states, _, _ = nn.scan_blocks(
            self.transformer_blocks, (hidden_states, audio_hidden_states, row_sum_squares(hidden_states), jnp.int32(0)),
            body, chain=True, derive=lambda c: (c[0], c[1], row_sum_squares(c[0]), c[3]))

        # 6. Output layers (embedded_timestep, not temb; [0] = shift, [1] = scale)
        scale_shift_values = self.scale_shift_table[...][None, None] + embedded_timestep[:, :, None]
        shift, scale = scale_shift_values[:, :, 0], scale_shift_values[:, :, 1]
        hidden_states = modulate(hidden_states, shift, scale)
        output = self.proj_out(hidden_states)

        audio_scale_shift_values = self.audio_scale_shift_table[...][None, None] + audio_embedded_timestep[:, :, None]
        audio_shift, audio_scale = audio_scale_shift_values[:, :, 0], audio_scale_shift_values[:, :, 1]
        audio_hidden_states = modulate(audio_hidden_states, audio_shift, audio_scale)
        audio_output = self.audio_proj_out(audio_hidden_states)
        return output, audio_output


def build(config: LTX2Config, *, dtype=jnp.float32, rngs: nnx.Rngs) -> LTX2VideoTransformer3DModel:
    """The model with random parameters (load real ones with `weights.load_transformer`)."""
    return LTX2VideoTransformer3DModel(config, dtype=dtype, rngs=rngs)

