"""FLUX.1 (diffusers `FluxTransformer2DModel`) in Flax NNX, written once for one device, TP and SP.

Reads top to bottom like diffusers' `transformer_flux.py`: the embedders, the
19 double-stream (joint, MMDiT) blocks, the 38 single-stream blocks, the
final AdaLN and projection. Module and parameter names are diffusers'
(`transformer_blocks.attn.to_q`, `single_transformer_blocks.proj_mlp`, ...),
so a checkpoint key maps to a parameter by renaming the leaf (`keys.py`). The
blocks are the MMDiT family shared with HunyuanVideo (`difflet_tpu/layers/mmdit.py`),
the joint sequence `[txt | img]`.

Every forward runs inside one `shard_map` over the mesh's `tp` axis (or plain
`jit` on one device) and talks to the other ranks only through `Parallel`
(`difflet_tpu/parallel/modes.py`):

* one device: everything local;
* TP: weights sharded by `PLAN`, activations replicated, a psum after each
  row-parallel matmul;
* SP: the image and the text stream are each sequence-sharded (every rank
  holds its own rows of both, each stream padded eagerly to a multiple of 2P);
  every column-parallel group is an all-gather ring fused into its matmuls and
  every row-parallel output a reduce-scatter ring; attention runs on the full
  joint sequence for this rank's heads.

Double block under SP: one AG ring feeds to_q/to_k/to_v (image rows), another
add_q/add_k/add_v_proj (text rows); attention over [txt | img]; to_out.0 and
to_add_out end in reduce-scatters; ff and ff_context each an AG ring in and
an RS ring out. Single block under SP: this rank's rows are [txt_r | img_r]
(its text rows then its image rows), one AG ring feeds q, k, v and proj_mlp
together, so the gathered rows are in the order [txt_0, img_0, txt_1, img_1,
...]; the cos/sin rows and the key mask are permuted to that order once per
forward (`layers.mmdit.single_stream_rows`; RoPE is per token, so no other change).
proj_out is diffusers' one Linear over cat([attn (D), mlp (4D)]), held as two
row-parallel kernels `proj_out.attn` and `proj_out.mlp` (the loader slices the
packed weight's input features, `Key(in_range=...)`, keys.py), so rank r's
rows of each are exactly the inputs it holds (its heads, its MLP columns); the
two products are summed in one reduce-scatter (SP) / all-reduce (TP), with no
concatenation and nothing that depends on P in the parameters.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu.layers import nn
from difflet_tpu.layers import (AdaLayerNormContinuous, AdaLN, CombinedTimestepTextProjEmbeddings,
                                PixArtAlphaTextProjection, TimestepEmbedding, get_timestep_embedding)
from difflet_tpu.layers.mmdit import PLAN as MMDIT_PLAN
from difflet_tpu.layers.mmdit import (DoubleStreamBlock, JointAttention, PackedProjOut, SingleStreamBlock,
                                      single_stream_rows, stream_rope)
from difflet_tpu.layers.normalization import few_rows

from .config import EPS, FluxConfig

# --------------------------------------------------------------------------
# Parallel plan (module path pattern over the NNX state, stacked blocks without
# an index -> role; everything not listed is replicated): the MMDiT blocks'
# (difflet_tpu/layers/mmdit.py).
#
# ================================================  ==========  ===========================================
# module                                            role        note
# ================================================  ==========  ===========================================
# transformer_blocks.attn.to_q / to_k / to_v        column      heads; SP: one AG ring over image rows
# transformer_blocks.attn.add_q/add_k/add_v_proj    column      heads; SP: one AG ring over text rows
# transformer_blocks.attn.to_out.0 / to_add_out     row         SP: reduce-scatter ring each
# transformer_blocks.ff(_context).net.0.proj        column      GELU-tanh in the ring's epilogue
# transformer_blocks.ff(_context).net.2             row
# transformer_blocks.norm1(_context).linear         column      adaLN (D -> 6D): gather_columns of (B, 6D)
# single_transformer_blocks.attn.to_q/to_k/to_v     column      SP: one AG ring with proj_mlp
# single_transformer_blocks.proj_mlp                column
# single_transformer_blocks.proj_out.attn           row         diffusers' proj_out over cat([attn, mlp]):
# single_transformer_blocks.proj_out.mlp            row         input features [0, D) / [D, 5D) of one
#                                                               checkpoint weight (keys.py, in_range);
#                                                               two pairs, one RS / psum, bias once
# single_transformer_blocks.norm.linear             column      adaLN (D -> 3D)
# norm_out.linear                                   column      AdaLayerNormContinuous (D -> 2D)
# attn.norm_q/norm_k/norm_added_q/norm_added_k      replicated  per-head RMSNorm ([head_dim], every head)
# x_embedder, context_embedder, time_text_embed,    replicated  small; under SP they run on this rank's rows
# proj_out                                                      (embedders) or the (B, D) temb
# ================================================  ==========  ===========================================
#
# Sequence-sharded under SP: the image stream and the text stream between
# layers (residuals, LayerNorms, modulation, gated adds), and the single
# blocks' [txt_r | img_r] rows. Replicated everywhere: temb, the adaLN outputs
# (B, kD) after their gather, the RoPE tables and the key mask.
# --------------------------------------------------------------------------
PLAN = dict(MMDIT_PLAN)


# --------------------------------------------------------------------------
# Embeddings (diffusers embeddings.py; the layers are difflet_tpu/layers/embeddings.py)
# --------------------------------------------------------------------------

def timestep_proj(timesteps, dtype) -> np.ndarray:
    """`Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` of `timesteps * 1000`,
    eagerly before the step: `[B, 256]` float32, [cos, sin].

    As diffusers' FLUX embedders: the timestep (or guidance) is cast to the model
    dtype and multiplied by 1000 in that dtype (so in bf16 it is rounded before
    the x1000); the sinusoid is `layers.get_timestep_embedding` (its float32
    rounding policy).
    """
    t = (np.asarray(timesteps).astype(dtype) * np.asarray(1000, dtype)).astype(np.float32)
    return np.asarray(get_timestep_embedding(t))


class CombinedTimestepGuidanceTextProjEmbeddings(nnx.Module):
    """dev: temb = timestep_embedder(t) + guidance_embedder(g) + text_embedder(pooled)."""

    def __init__(self, embedding_dim: int, pooled_projection_dim: int, *, dtype, rngs):
        self.timestep_embedder = TimestepEmbedding(256, embedding_dim, dtype=dtype, rngs=rngs)
        self.guidance_embedder = TimestepEmbedding(256, embedding_dim, dtype=dtype, rngs=rngs)
        self.text_embedder = PixArtAlphaTextProjection(pooled_projection_dim, embedding_dim, act_fn="silu",
                                                       dtype=dtype, rngs=rngs)

    def __call__(self, timesteps_proj, guidance_proj, pooled_projection):
        timesteps_emb = self.timestep_embedder(timesteps_proj.astype(pooled_projection.dtype))
        guidance_emb = self.guidance_embedder(guidance_proj.astype(pooled_projection.dtype))
        return timesteps_emb + guidance_emb + self.text_embedder(pooled_projection)


# --------------------------------------------------------------------------
# Blocks (the MMDiT family, difflet_tpu/layers/mmdit.py)
# --------------------------------------------------------------------------

class FluxTransformerBlock(DoubleStreamBlock):
    """diffusers' `FluxTransformerBlock`: `DoubleStreamBlock` ([txt | img], float16 clip)."""


    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, mlp_dim: int, *, dtype, rngs):
        super().__init__(dim, num_attention_heads, attention_head_dim, mlp_dim, context_first=True, clip_fp16=True,
                         eps=EPS, dtype=dtype, rngs=rngs)


class FluxSingleTransformerBlock(SingleStreamBlock):
    """diffusers' order of submodules; the forward is `SingleStreamBlock`'s: under SP the
    rows are this rank's [txt_r | img_r], `rope` and `kv_mask` in the gathered order
    (`layers.mmdit.single_stream_order`)."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, mlp_hidden_dim: int,
                 *, dtype, rngs):
        self.eps, self.clip_fp16 = EPS, True
        self.norm = AdaLN(dim, 3, dtype=dtype, rngs=rngs)  # AdaLayerNormZeroSingle
        self.proj_mlp = nn.Linear(dim, mlp_hidden_dim, dtype=dtype, rngs=rngs)
        self.proj_out = PackedProjOut(num_attention_heads * attention_head_dim, mlp_hidden_dim, dim, dtype=dtype,
                                      rngs=rngs)
        self.attn = JointAttention(dim, num_attention_heads, attention_head_dim, pre_only=True, eps=EPS,
                                   dtype=dtype, rngs=rngs)


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------

class FluxTransformer2DModel(nnx.Module):
    """diffusers' FluxTransformer2DModel in Flax NNX; run it through `Runner`."""

    def __init__(self, config: FluxConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        D = c.inner_dim
        embed_cls = (CombinedTimestepGuidanceTextProjEmbeddings if c.guidance_embeds
                     else CombinedTimestepTextProjEmbeddings)
        self.time_text_embed = embed_cls(D, c.pooled_projection_dim, dtype=dtype, rngs=rngs)
        self.context_embedder = nn.Linear(c.joint_attention_dim, D, dtype=dtype, rngs=rngs)
        self.x_embedder = nn.Linear(c.in_channels, D, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nn.stacked(
            lambda r: FluxTransformerBlock(D, c.num_attention_heads, c.attention_head_dim, 4 * D, dtype=dtype, rngs=r),
            c.num_layers, rngs)
        self.single_transformer_blocks = nn.stacked(
            lambda r: FluxSingleTransformerBlock(D, c.num_attention_heads, c.attention_head_dim,
                                                 c.mlp_hidden_dim, dtype=dtype, rngs=r),
            c.num_single_layers, rngs)
        self.norm_out = AdaLayerNormContinuous(D, EPS, dtype=dtype, rngs=rngs)
        self.proj_out = nn.Linear(D, c.out_features, dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.x_embedder.kernel.dtype

    def __call__(self, par, hidden_states, encoder_hidden_states, pooled_projections, timesteps_proj,
                 guidance_proj, freqs_cos, freqs_sin, kv_mask=None):
        """One forward inside the step.

        hidden_states `[B, N_img, C]` and encoder_hidden_states `[B, N_txt, C_txt]`:
        every row (one device, TP) or this rank's rows of each stream (SP; each
        stream padded to a multiple of 2P). timesteps_proj / guidance_proj `[B, 256]`:
        the sinusoids of timestep*1000 and guidance*1000 (`timestep_proj`, on the host;
        guidance ignored without a guidance embedder). freqs_cos / freqs_sin `[S, head_dim]`
        float32 for the joint [txt | img] sequence (padded like the streams, in
        split-halves order when `config.split_rope`). kv_mask: None, or bool `[S]`
        (False for pad keys). Returns proj_out's output for the image rows held.
        """
        c = self.config
        dtype = self.dtype
        hidden_states = self.x_embedder(hidden_states.astype(dtype))
        # the embedders' linears over padded rows, as the adaLN modulations (`few_rows`)
        batch = pooled_projections.shape[0]
        pooled_projections = few_rows(pooled_projections.astype(dtype))
        if c.guidance_embeds:
            temb = self.time_text_embed(few_rows(timesteps_proj), few_rows(guidance_proj), pooled_projections)
        else:
            temb = self.time_text_embed(few_rows(timesteps_proj), pooled_projections)
        temb = temb[:batch]
        encoder_hidden_states = self.context_embedder(encoder_hidden_states.astype(dtype))

        rope = (freqs_cos, freqs_sin, c.split_rope)
        double_rope = rope
        if par.seq_sharded:  # each stream's rows of the tables, sliced once (JointAttention)
            double_rope = stream_rope(rope, encoder_hidden_states.shape[1] * par.size)
        hidden_states, encoder_hidden_states = nn.scan_blocks(
            self.transformer_blocks, (hidden_states, encoder_hidden_states),
            lambda block, carry: block(par, *carry, temb, double_rope, kv_mask), chain=True)

        # Single blocks on [txt | img] (under SP this rank's [txt_r | img_r], tables and mask
        # in the gathered order: layers.mmdit.single_stream_rows)
        n_txt_local = encoder_hidden_states.shape[1]
        hidden_states, (cos, sin), (kv_mask,) = single_stream_rows(
            par, encoder_hidden_states, hidden_states, (freqs_cos, freqs_sin), (kv_mask,))
        rope = (cos, sin, c.split_rope)
        hidden_states = nn.scan_blocks(self.single_transformer_blocks, hidden_states,
                                       lambda block, h: block(par, h, temb, rope, kv_mask), chain=True)
        hidden_states = hidden_states[:, n_txt_local:]

        return self.proj_out(self.norm_out(par, hidden_states, temb))


def build(config: FluxConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> FluxTransformer2DModel:
    """The model with random parameters (load a checkpoint with difflet_tpu.loading.load_transformer)."""
    return FluxTransformer2DModel(config, dtype=dtype, rngs=rngs)
