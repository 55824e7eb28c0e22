"""HunyuanVideoTransformer3DModel in Flax NNX, read top to bottom like diffusers'
`transformer_hunyuan_video.py` (0.42.1), with the same submodule names. The
dual- and single-stream blocks are the MMDiT family shared with FLUX
(`difflet_tpu/layers/mmdit.py`), the joint sequence `[image | text]`.

Every module is written once for the three ways to run over the `tp` axis
(`difflet_tpu.parallel.modes.Parallel`): one device, TP, SP. Column-parallel groups
go through `nn.column` / `par.column`, row-parallel outputs through
`nn.row` / `par.row`; adaLN outputs are column-sharded and gathered with
`par.gather_columns`.

Layout under SP (see `PLAN`): the dual-stream blocks keep the image stream
and the text stream sequence-sharded each on its own; the single-stream
blocks run on each rank's `[img_r | txt_r]`, joined locally with the RoPE
tables and key mask permuted to the gathered order, as FLUX's do
(`layers.mmdit.single_stream_rows`; `Config.sp_single` off: they run TP on
the gathered sequence).

Numerics as diffusers: timestep projections, RoPE tables and the rotation,
LayerNorm / RMSNorm statistics and the refiner's masked mean in float32;
everything else in the parameter dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu.layers import nn
from difflet_tpu.layers import (AdaLayerNormContinuous, AdaLN, CombinedTimestepTextProjEmbeddings, FeedForward,
                                LayerNorm, PixArtAlphaTextProjection, TimestepEmbedding, attend,
                                get_timestep_embedding, merge_heads, split_heads)
from difflet_tpu.layers.mmdit import PLAN as MMDIT_PLAN
from difflet_tpu.layers.mmdit import (DoubleStreamBlock, JointAttention, PackedProjOut, SingleStreamBlock,
                                      single_stream_order, single_stream_rows)

from .config import HunyuanVideoConfig

EPS = 1e-6


# --------------------------------------------------------------------------
# Parallel plan over the mesh's `tp` axis (P ranks): module path pattern over the
# NNX state (stacked blocks without an index) -> role; everything not listed is
# replicated.
#
# ==============================================  ==========  ==========================================
# module (per stacked block)                      role        note
# ==============================================  ==========  ==========================================
# dual attn.to_q/k/v, attn.add_q/k/v_proj         column      heads split over ranks
# dual ff.net.0.proj, ff_context.net.0.proj       column      GELU-tanh in the ring's epilogue
# dual attn.to_out.0, attn.to_add_out, ff*.net.2  row         psum (TP) / reduce-scatter (SP)
# single attn.to_q/k/v, proj_mlp                  column      one all-gather ring for q, k, v and mlp
# single proj_out.attn                            row         diffusers' proj_out over cat([attn, mlp]):
# single proj_out.mlp                             row         input features [0, D) / [D, D+F) of one
#                                                             checkpoint weight (keys.py, in_range);
#                                                             two pairs, one RS / psum, bias once
# adaLN norm1.linear, norm1_context.linear,       column      (B, kD) output gathered with
# single norm.linear, final norm_out.linear                   `par.gather_columns` (3.5 B params)
# per-head q/k RMSNorm weights, x_embedder, the   replicated  the refiner runs replicated on the text
# token refiner context_embedder, time_text_
# embed, final proj_out, RoPE tables
# ==============================================  ==========  ==========================================
#
# Sequence-sharded under SP (between layers): the dual blocks' image stream and
# text stream, each on its own (rank r holds rows [r*n/P, (r+1)*n/P) of each,
# padded by the Runner's rule); the single blocks' `[img_r | txt_r]` rows
# (`layers.mmdit.single_stream_rows`, `Config.sp_single`).
# --------------------------------------------------------------------------
PLAN = dict(MMDIT_PLAN)  # the MMDiT blocks' (difflet_tpu/layers/mmdit.py)


# --------------------------------------------------------------------------
# Embedders
# --------------------------------------------------------------------------

class HunyuanVideoPatchEmbed(nnx.Module):
    """Conv3d(kernel = stride = (pt, p, p)) as a Linear over patches flattened (c, pt, ph, pw);
    the patches are cut eagerly before the step (`layout.patchify`)."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        self.proj = nn.Linear(c.in_channels * c.patch_volume, c.inner_dim, dtype=dtype, rngs=rngs)

    def __call__(self, patches):
        return self.proj(patches)


def unpatchify(y, frames: int, height: int, width: int, pt: int, p: int):
    """diffusers' final reshape: features `(c, pt, ph, pw)` -> `[B, C, F, H, W]`."""
    xp = np if isinstance(y, np.ndarray) else jnp
    B = y.shape[0]
    y = y.reshape(B, frames, height, width, -1, pt, p, p)
    y = xp.transpose(y, (0, 4, 1, 5, 2, 6, 3, 7))
    return y.reshape(B, y.shape[1], frames * pt, height * p, width * p)


class HunyuanVideoConditionEmbedding(nnx.Module):
    """`temb = timestep_emb + guidance_emb + text_embedder(pooled CLIP)`, and for
    token_replace the t=0 embedding of the first-frame tokens."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        self.image_condition_type = c.image_condition_type
        self.timestep_embedder = TimestepEmbedding(256, c.inner_dim, dtype=dtype, rngs=rngs)
        self.text_embedder = PixArtAlphaTextProjection(c.pooled_projection_dim, c.inner_dim, act_fn="silu",
                                                       dtype=dtype, rngs=rngs)
        self.guidance_embedder = (TimestepEmbedding(256, c.inner_dim, dtype=dtype, rngs=rngs)
                                  if c.guidance_embeds else None)

    def __call__(self, timestep, pooled_projection, guidance):
        dtype = pooled_projection.dtype
        timesteps_emb = self.timestep_embedder(get_timestep_embedding(timestep).astype(dtype))
        pooled = self.text_embedder(pooled_projection)
        token_replace_emb = None
        if self.image_condition_type == "token_replace":
            zero = jnp.zeros_like(timestep)
            token_replace_emb = self.timestep_embedder(get_timestep_embedding(zero).astype(dtype)) + pooled
        if self.guidance_embedder is not None:
            guidance_emb = self.guidance_embedder(get_timestep_embedding(guidance).astype(dtype))
            conditioning = timesteps_emb + guidance_emb + pooled
        else:
            conditioning = timesteps_emb + pooled
        return conditioning, token_replace_emb


# --------------------------------------------------------------------------
# Token refiner (replicated: 256 text tokens)
# --------------------------------------------------------------------------

class RefinerAttention(nnx.Module):
    """diffusers `Attention` (AttnProcessor2_0): biases, no q/k norm, no RoPE."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.head_dim = c.attention_head_dim
        self.to_q = nn.Linear(D, D, dtype=dtype, rngs=rngs)
        self.to_k = nn.Linear(D, D, dtype=dtype, rngs=rngs)
        self.to_v = nn.Linear(D, D, dtype=dtype, rngs=rngs)
        self.to_out = nnx.Dict({"0": nn.Linear(D, D, dtype=dtype, rngs=rngs)})

    def __call__(self, par, x, row_valid, key_valid):
        q, k, v = (split_heads(l(x), self.head_dim) for l in (self.to_q, self.to_k, self.to_v))
        o = attend(par, q, k, v, key_valid)
        # diffusers' mask is m[i] & m[j] with column 0 forced True: a padded query
        # row attends to key 0 alone, i.e. its output is exactly v[0].
        o = jnp.where(row_valid[:, :, None, None], o, v[:, :1])
        return self.to_out["0"](merge_heads(o))


class HunyuanVideoIndividualTokenRefinerBlock(nnx.Module):
    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.norm1 = LayerNorm(D, EPS, dtype=dtype)
        self.attn = RefinerAttention(c, dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(D, EPS, dtype=dtype)
        self.ff = FeedForward(D, mult=c.mlp_ratio, activation_fn="linear-silu", dtype=dtype, rngs=rngs)
        self.norm_out = AdaLN(D, 2, dtype=dtype, rngs=rngs)  # HunyuanVideoAdaNorm: gates only

    def __call__(self, par, x, temb, row_valid, key_valid):
        attn_output = self.attn(par, self.norm1(x), row_valid, key_valid)
        gate_msa, gate_mlp = self.norm_out(par, temb)
        x = x + attn_output * gate_msa
        ff_output = self.ff(par, self.norm2(x))
        return x + ff_output * gate_mlp


class HunyuanVideoIndividualTokenRefiner(nnx.Module):
    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        self.refiner_blocks = nn.stacked(
            lambda r: HunyuanVideoIndividualTokenRefinerBlock(c, dtype=dtype, rngs=r), c.num_refiner_layers, rngs)

    def __call__(self, par, x, temb, mask):
        row_valid = mask
        key_valid = mask.at[:, 0].set(True)  # self_attn_mask[:, :, :, 0] = True
        return nn.scan_blocks(self.refiner_blocks, x, lambda blk, h: blk(par, h, temb, row_valid, key_valid))


class HunyuanVideoTokenRefiner(nnx.Module):
    """`context_embedder`: proj_in of the LLM features, then 2 refiner blocks. Runs
    replicated on every rank (a few hundred tokens), with plain (single-device) linears."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(D, c.text_embed_dim, dtype=dtype, rngs=rngs)
        self.proj_in = nn.Linear(c.text_embed_dim, D, dtype=dtype, rngs=rngs)
        self.token_refiner = HunyuanVideoIndividualTokenRefiner(c, dtype=dtype, rngs=rngs)

    def __call__(self, par, hidden_states, timestep, attention_mask):
        local = dataclasses.replace(par, mode="single", size=1)  # replicated: no collectives
        mask_float = attention_mask.astype(jnp.float32)[..., None]
        pooled = (hidden_states * mask_float).sum(axis=1) / mask_float.sum(axis=1)
        pooled = pooled.astype(hidden_states.dtype)
        temb = self.time_text_embed(get_timestep_embedding(timestep), pooled)
        x = self.proj_in(hidden_states)
        return self.token_refiner(local, x, temb, attention_mask != 0)


# --------------------------------------------------------------------------
# Transformer blocks (the MMDiT family, difflet_tpu/layers/mmdit.py). The dual
# stream block is `DoubleStreamBlock` with the joint sequence [image | text];
# with token_replace (`HunyuanVideoTokenReplaceTransformerBlock`, same weights)
# the first-frame image rows are modulated with the t=0 embedding.
# --------------------------------------------------------------------------

class HunyuanVideoSingleTransformerBlock(SingleStreamBlock):
    """diffusers' order of submodules; the forward is `SingleStreamBlock`'s (and
    `HunyuanVideoTokenReplaceSingleTransformerBlock`'s with token_replace)."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.eps, self.clip_fp16 = EPS, False
        self.attn = JointAttention(D, c.num_attention_heads, c.attention_head_dim, pre_only=True, eps=EPS,
                                   dtype=dtype, rngs=rngs)
        self.norm = AdaLN(D, 3, dtype=dtype, rngs=rngs)  # AdaLayerNormZeroSingle
        self.proj_mlp = nn.Linear(D, c.mlp_dim, dtype=dtype, rngs=rngs)
        self.proj_out = PackedProjOut(D, c.mlp_dim, D, dtype=dtype, rngs=rngs)


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shape facts of one compiled step."""

    frames: int      # F' (post-patch)
    height: int      # H'
    width: int       # W'
    n_img: int       # F'H'W' image tokens
    n_img_pad: int   # image rows in the step (padded to 2P under SP)
    n_txt_pad: int   # text rows in the step (padded to 2P under SP)
    single_sp: bool  # single blocks sequence-parallel too (SP only; `Config.sp_single`)

    @property
    def n_joint(self) -> int:
        return self.n_img_pad + self.n_txt_pad


def joint_key_mask(encoder_attention_mask, geom: Geometry, image_rows=None):
    """`[B, N]` keys of the joint `[image | image pad | text | text pad]` sequence to attend to.
    image_rows: `[n_img_pad]` the frame-major token of each image row, -1 for a pad row (a
    block-sparse step's tile order, `port.prepare`), or None (frame-major, pad last).

    As diffusers: `position < N_img + sum(text_mask)`, i.e. built from the count
    of valid text tokens (right padding assumed; holes in the mask are not
    honoured here, only in the refiner). The image rows padded in for SP and the
    text rows padded in (beyond the count) are never keys.
    """
    count = encoder_attention_mask.astype(jnp.int32).sum(axis=1)
    pos = jnp.arange(geom.n_joint)[None, :]
    image = pos < geom.n_img
    if image_rows is not None:
        image = jnp.concatenate([image_rows >= 0, jnp.zeros((geom.n_txt_pad,), bool)])[None, :]
    return image | ((pos >= geom.n_img_pad) & (pos < geom.n_img_pad + count[:, None]))


class HunyuanVideoTransformer3DModel(nnx.Module):
    def __init__(self, c: HunyuanVideoConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = c
        self.dtype = jnp.dtype(dtype).name
        D = c.inner_dim
        # 1. Latent and condition embedders
        self.x_embedder = HunyuanVideoPatchEmbed(c, dtype=dtype, rngs=rngs)
        self.context_embedder = HunyuanVideoTokenRefiner(c, dtype=dtype, rngs=rngs)
        self.time_text_embed = HunyuanVideoConditionEmbedding(c, dtype=dtype, rngs=rngs)
        # 2. RoPE: tables built on the host (rope.py), inputs of the step
        # 3. Dual stream transformer blocks
        self.transformer_blocks = nn.stacked(  # HunyuanVideoTransformerBlock: [image | text]
            lambda r: DoubleStreamBlock(D, c.num_attention_heads, c.attention_head_dim, c.mlp_dim,
                                        context_first=False, eps=EPS, dtype=dtype, rngs=r),
            c.num_layers, rngs)
        # 4. Single stream transformer blocks
        self.single_transformer_blocks = nn.stacked(
            lambda r: HunyuanVideoSingleTransformerBlock(c, dtype=dtype, rngs=r), c.num_single_layers, rngs)
        # 5. Output projection
        self.norm_out = AdaLayerNormContinuous(D, EPS, dtype=dtype, rngs=rngs)
        self.proj_out = nn.Linear(D, c.patch_volume * c.out_channels, dtype=dtype, rngs=rngs)

    def __call__(self, par, geom: Geometry, patches, timestep, encoder_hidden_states, encoder_attention_mask,
                 pooled_projections, guidance, freqs_cos, freqs_sin, image_rows=None, sparse=None):
        """One forward inside the step.

        patches: `[B, n_img_pad, C*pt*p*p]` (this rank's rows under SP); timestep,
        guidance `(B,)` float32; encoder_hidden_states `[B, n_txt_pad, text_dim]`,
        encoder_attention_mask `[B, n_txt_pad]`, pooled_projections `[B, pooled_dim]`,
        freqs_cos, freqs_sin `[n_joint, head_dim]` float32 (`rope.joint_tables`)
        (replicated). Block-sparse video attention (`port.prepare`): image_rows `[n_img_pad]`
        int32 the frame-major token of each image row (tile order; -1: pad), sparse the
        joint `[video | text]` mask (`sparse_masks.with_dense_tail`). Returns
        `[B, rows, pt*p*p*C_out]` for the image rows (this rank's under SP).
        """
        c = self.config
        sp = par.seq_sharded
        single_sp = sp and geom.single_sp
        par_single = par if (single_sp or not sp) else dataclasses.replace(par, mode="tp")

        # 1. RoPE over the joint [image | text] rows (identity on pad and text rows), in
        # split-halves order if loaded so
        rope = (freqs_cos, freqs_sin, c.split_rope)

        # 2. Conditional embeddings
        temb, token_replace_emb = self.time_text_embed(timestep, pooled_projections, guidance)
        hidden_states = self.x_embedder(patches)
        encoder_hidden_states = self.context_embedder(par, encoder_hidden_states, timestep, encoder_attention_mask)
        encoder_hidden_states = par.shard_rows(encoder_hidden_states)

        # 3. Joint key mask from the count of valid text tokens (assumes right padding, as diffusers)
        key_mask = (joint_key_mask(encoder_attention_mask, geom) if image_rows is None
                    else joint_key_mask(encoder_attention_mask, geom, image_rows))

        # first-frame rows (token_replace), from each rank's offset at run time: they are
        # modulated with the t=0 embedding
        tr_img = first_img = None
        if c.token_replace:
            first_tokens = geom.height * geom.width
            rows_img = hidden_states.shape[1]
            offset_img = par.rank() * rows_img if sp else 0
            if image_rows is None:
                first_img = offset_img + jnp.arange(rows_img) < first_tokens
            else:  # rows in tile order
                first_all = (image_rows >= 0) & (image_rows < first_tokens)
                first_img = jax.lax.dynamic_slice_in_dim(first_all, offset_img, rows_img)
            tr_img = (first_img, token_replace_emb)

        # 4. Transformer blocks
        hidden_states, encoder_hidden_states = nn.scan_blocks(
            self.transformer_blocks, (hidden_states, encoder_hidden_states),
            lambda blk, carry: blk(par, *carry, temb, rope, key_mask, tr_img, sparse), chain=True)

        # Single blocks on [image | text]: under SP this rank's [img_r | txt_r] with the
        # tables and mask in the gathered order (layers.mmdit.single_stream_rows); with
        # single-stream SP off, dense TP on the gathered sequence.
        n_img_rows = hidden_states.shape[1]
        if sp and not single_sp:
            x = jnp.concatenate([par.gather_rows(hidden_states), par.gather_rows(encoder_hidden_states)], 1)
            mask_s, rope_s, n_img_rows = key_mask, rope, geom.n_img_pad
            if c.token_replace:
                first_img = (jnp.arange(geom.n_img_pad) < first_tokens if image_rows is None else first_all)
            order = None
        else:
            x, (cos, sin), (mask_s,) = single_stream_rows(par, hidden_states, encoder_hidden_states,
                                                          (freqs_cos, freqs_sin), (key_mask,))
            rope_s = (cos, sin, c.split_rope)
            # under SP the gathered rows interleave the ranks' [img_r | txt_r]: the sparse
            # attention puts them in the joint order of its mask
            order = single_stream_order(geom.n_img_pad, geom.n_txt_pad, par.size) if sp and sparse is not None else None
        tr_joint = None
        if c.token_replace:  # text rows are never first-frame rows
            flags = jnp.concatenate([first_img, jnp.zeros((x.shape[1] - n_img_rows,), bool)])
            tr_joint = (flags, token_replace_emb)
        x = nn.scan_blocks(self.single_transformer_blocks, x,
                           lambda blk, h: blk(par_single, h, temb, rope_s, mask_s, tr_joint, sparse, order),
                           chain=True)
        x = x[:, :n_img_rows]
        if sp and not single_sp:
            x = par.shard_rows(x)

        # 5. Output projection (on this rank's rows; the runner gathers and cuts eagerly)
        return self.proj_out(self.norm_out(par, x, temb))


def build(config: HunyuanVideoConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> HunyuanVideoTransformer3DModel:
    """The model with random parameters (load real ones with `difflet_tpu.loading.load_transformer`)."""
    return HunyuanVideoTransformer3DModel(config, dtype=dtype, rngs=rngs)
