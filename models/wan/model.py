"""WanTransformer3DModel (Wan 2.1 / 2.2) in Flax NNX, written once for one device, TP and SP.

Reads top to bottom like diffusers' `transformer_wan.py` (same submodule
names, so checkpoint keys map by renaming leaves only). Every function takes
`par` (`difflet_tpu.parallel.modes.Parallel`): column-parallel groups go through
`nn.column`, row-parallel outputs through `nn.row`, so under SP the residual
stream holds this rank's rows and every column input is an all-gather fused
into its matmul, every row output a reduce-scatter fused into its matmul.

Numerics follow diffusers: LayerNorms, modulation arithmetic and the gated
residual adds in float32 (`.float()` ... `.type_as`), `time_embedder`,
`scale_shift_table`s and `norm2` kept in float32, RoPE tables computed in
float64 and stored as float32 (see `rope.rope_tables`). "float32" here means
`promote_types(dtype, float32)`, so a float64 model stays float64 (tests).

Shapes inside the step (B batch, n = this rank's rows under SP, else all N
rows; S = every row; D = heads * head_dim; P = tp size):
  patches (B, n, C*pt*ph*pw) -> x (B, n, D) -> blocks -> (B, n, C_out*pt*ph*pw)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.layers import nn
from difflet_tpu.layers import (FeedForward, LayerNorm, PixArtAlphaTextProjection, TimestepEmbedding,
                                get_timestep_embedding, modulate, row_moments)
from difflet_tpu.layers.across_heads import AcrossHeadsAttention
from difflet_tpu.layers.rope import HeadRope
from difflet_tpu.layers.normalization import few_rows_linear
from difflet_tpu.parallel.modes import COLUMN, REPLICATED, ROW, SHARDED, Parallel

from difflet_tpu.models.wan.config import WanConfig

# --------------------------------------------------------------------------
# The parallel plan (module path pattern -> role; everything else replicated)
#
#   column-parallel (out features = heads sharded; under SP: AG ring in)
#     blocks.attn1.to_q/to_k/to_v, blocks.attn2.to_q, blocks.ffn.net.0.proj
#   column-parallel on replicated text / image tokens (no gather: K/V are
#   computed once per prompt from the 512 + 257 replicated tokens)
#     blocks.attn2.to_k/to_v/add_k_proj/add_v_proj
#   row-parallel (in features sharded; TP: psum, SP: RS ring out)
#     blocks.attn1.to_out.0, blocks.attn2.to_out.0, blocks.ffn.net.2
#   sharded like the columns (across-heads q/k RMSNorm: the per-token sum of
#   squares is psum'd over tp in float32 before normalising)
#     blocks.attn1.norm_q/norm_k, blocks.attn2.norm_q/norm_k/norm_added_k
#   modulation: condition_embedder.time_proj (D -> 6D) column-parallel, its
#     small (B, 6D) output all-gathered (per-token timesteps: the weight is
#     gathered instead and each rank embeds its own rows)
#   text projection: text_embedder.linear_1 column, linear_2 row (psum; the
#     text is replicated, never sequence-sharded)
#   replicated: patch_embedding, time_embedder, image_embedder, the per-block
#     scale_shift_table and norm2 affine, norm_out, proj_out, RoPE tables
#   sequence-sharded under SP: the residual stream x, per-token timesteps and
#     their modulation, the final projection (outputs gathered at the end)
# --------------------------------------------------------------------------
PLAN = {
    "condition_embedder.time_proj": COLUMN,
    "condition_embedder.text_embedder.linear_1": COLUMN,
    "condition_embedder.text_embedder.linear_2": ROW,
    "blocks.attn1.to_q": COLUMN,
    "blocks.attn1.to_k": COLUMN,
    "blocks.attn1.to_v": COLUMN,
    "blocks.attn1.norm_q": SHARDED,
    "blocks.attn1.norm_k": SHARDED,
    "blocks.attn1.to_out.0": ROW,
    "blocks.attn2.to_q": COLUMN,
    "blocks.attn2.to_k": COLUMN,
    "blocks.attn2.to_v": COLUMN,
    "blocks.attn2.add_k_proj": COLUMN,
    "blocks.attn2.add_v_proj": COLUMN,
    "blocks.attn2.norm_q": SHARDED,
    "blocks.attn2.norm_k": SHARDED,
    "blocks.attn2.norm_added_k": SHARDED,
    "blocks.attn2.to_out.0": ROW,
    "blocks.ffn.net.0.proj": COLUMN,
    "blocks.ffn.net.2": ROW,
}

# Under SP with `Parallel.cross_local` (Config.sp_cross_local): cross-attention on this
# rank's rows with every head, no ring. Its q and output projections (and q's norm)
# are replicated over tp; the text K/V keep the column plan (computed per head shard)
# and are gathered to all heads (`layers.across_heads`, `local=True`). At 480x832x9 on a
# v5e-4 both attn2 rings have ICI-bound hops (a 592 x 5120 bf16 half each way per hop
# against a 1280-column matmul; docs/models/wan.md).
SP_LOCAL_PLAN = {
    "blocks.attn2.to_q": REPLICATED,
    "blocks.attn2.norm_q": REPLICATED,
    "blocks.attn2.to_out.0": REPLICATED,
}


def _chunks(mod, k: int):
    """diffusers' `.chunk(k, dim)` of a modulation tensor, each broadcastable to (B, n, D).

    mod: (B, k, D) per sample, or (B, n, k, D) per token (Wan2.2 TI2V).
    """
    if mod.ndim == 3:
        return [mod[:, i:i + 1] for i in range(k)]
    return [mod[:, :, i] for i in range(k)]


# --------------------------------------------------------------------------
# Attention: `layers.across_heads` (attn1 with RoPE and pad keys dropped; attn2 on
# the text K/V of `context_kv`, local under `par.cross_local`: SP_LOCAL_PLAN)
# --------------------------------------------------------------------------

def wan_attention(c: WanConfig, *, added_kv_proj_dim: int | None, dtype, rngs: nnx.Rngs) -> AcrossHeadsAttention:
    """diffusers' `WanAttention` (q/k RMSNorm across heads, eps `c.eps`)."""
    return AcrossHeadsAttention(c.inner_dim, c.num_attention_heads, c.attention_head_dim,
                                added_kv_dim=added_kv_proj_dim, eps=c.eps, dtype=dtype, rngs=rngs)


# --------------------------------------------------------------------------
# Condition embeddings
# --------------------------------------------------------------------------

class WanImageEmbedding(nnx.Module):
    """FP32LayerNorm -> FeedForward(exact GELU) -> FP32LayerNorm (eps 1e-5, diffusers' default).
    With `pos_embed_seq_len` (FLF2V) the first and last images' tokens of each sample, rows 2b and
    2b + 1, are joined into one row of 2 L tokens and a learned position embedding added first."""

    def __init__(self, in_dim: int, dim: int, *, pos_embed_seq_len: int | None = None, dtype, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(in_dim, 1e-5, dtype=nn.fp32(dtype))
        self.ff = FeedForward(in_dim, dim_out=dim, mult=1, activation_fn="gelu", dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(dim, 1e-5, dtype=nn.fp32(dtype))
        self.pos_embed = (nnx.Param(jnp.zeros((1, pos_embed_seq_len, in_dim), dtype))
                          if pos_embed_seq_len is not None else None)

    def __call__(self, x):
        if self.pos_embed is not None:
            b, n, d = x.shape
            x = x.reshape(b // 2, 2 * n, d) + self.pos_embed[...].astype(x.dtype)
        return self.norm2(self.ff(Parallel(), self.norm1(x)))  # replicated (PLAN): local matmuls


class WanTimeTextImageEmbedding(nnx.Module):
    def __init__(self, c: WanConfig, *, dtype, rngs: nnx.Rngs):
        dim = c.inner_dim
        self.freq_dim = c.freq_dim
        self.time_embedder = TimestepEmbedding(c.freq_dim, dim, dtype=nn.fp32(dtype), rngs=rngs)
        self.time_proj = nn.Linear(dim, 6 * dim, dtype=dtype, rngs=rngs)
        self.text_embedder = PixArtAlphaTextProjection(c.text_dim, dim, dtype=dtype, rngs=rngs)
        self.image_embedder = (WanImageEmbedding(c.image_dim, dim, pos_embed_seq_len=c.pos_embed_seq_len,
                                                 dtype=dtype, rngs=rngs)
                               if c.image_dim is not None else None)

    def time(self, par, timestep, dtype):
        """temb (B, D) and timestep_proj (B, 6, D); per-token timesteps (B, n):
        temb (B, n, D) and timestep_proj (B, n, 6, D) for this rank's rows."""
        te_dtype = self.time_embedder.linear_1.kernel.dtype
        temb = self.time_embedder(get_timestep_embedding(timestep, self.freq_dim).astype(te_dtype))
        temb = temb.astype(dtype)
        h = jax.nn.silu(temb)
        if timestep.ndim == 1:
            # per-sample rows padded to 8 (few_rows_linear): a one-row product is a multiply-reduce
            # fusion XLA prices ~3x its weight's HBM read, 8 rows an MXU matmul near it
            proj = par.gather_columns(few_rows_linear(self.time_proj, h))  # (B, 6D/P) -> (B, 6D): tiny
        else:
            # Per-token rows differ by rank under SP: gather the (sharded) weight once
            # instead of the (B, n, 6D) output.
            w = par.gather_columns(self.time_proj.kernel[...])
            b = par.gather_columns(self.time_proj.bias[...])
            proj = h @ w + b
        return temb, proj.reshape(*proj.shape[:-1], 6, -1)

    def text(self, par, encoder_hidden_states, encoder_hidden_states_image, dtype):
        ctx = self.text_embedder.parallel(par, encoder_hidden_states.astype(dtype))
        img = None
        if encoder_hidden_states_image is not None:
            img = self.image_embedder(encoder_hidden_states_image.astype(dtype))
        return ctx, img


# --------------------------------------------------------------------------
# Transformer block
# --------------------------------------------------------------------------

class WanTransformerBlock(nnx.Module):
    def __init__(self, c: WanConfig, *, dtype, rngs: nnx.Rngs):
        dim = c.inner_dim
        self.eps = c.eps
        self.attn1 = wan_attention(c, added_kv_proj_dim=None, dtype=dtype, rngs=rngs)
        self.attn2 = wan_attention(c, added_kv_proj_dim=c.added_kv_proj_dim, dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(dim, c.eps, dtype=nn.fp32(dtype))  # cross_attn_norm=True
        self.ffn = FeedForward(dim, inner_dim=c.ffn_dim, activation_fn="gelu-approximate", dtype=dtype, rngs=rngs)
        self.scale_shift_table = nnx.Param(
            jax.random.normal(rngs.params(), (1, 6, dim), nn.fp32(dtype)) / dim ** 0.5)

    def __call__(self, par, x, kv, temb, cos, sin, kv_mask, split_rope: bool, moments=None, sparse=None):
        """x (B, n, D); kv: this block's attn2 K/V; temb: timestep_proj (B, 6, D) or (B, n, 6, D);
        moments: `row_moments(x)` if the caller has them (the scan carries them), for norm1;
        sparse: the self-attention's block-sparse mask (layers/sparse_masks.py) or None."""
        f = nn.fp32(x.dtype)
        table = self.scale_shift_table[...]
        if temb.ndim == 4:
            table = table[None]
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = _chunks(
            table.astype(f) + temb.astype(f), 6)

        # 1. Self-attention
        h = modulate(x.astype(f), shift_msa, scale_msa, self.eps, moments).astype(x.dtype)
        attn = self.attn1(par, h, rope=HeadRope(cos, sin, split_rope), kv_mask=kv_mask, sparse=sparse)
        x = (x.astype(f) + attn * gate_msa).astype(x.dtype)

        # 2. Cross-attention (no modulation, no gate)
        h = self.norm2(x.astype(f)).astype(x.dtype)
        x = x + self.attn2(par, h, kv=kv, local=True)

        # 3. Feed-forward
        h = modulate(x.astype(f), c_shift_msa, c_scale_msa, self.eps).astype(x.dtype)
        ff = self.ffn(par, h)
        return (x.astype(f) + ff.astype(f) * c_gate_msa).astype(x.dtype)


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------

class WanTransformer3DModel(nnx.Module):
    """diffusers' WanTransformer3DModel in Flax NNX; run it through `Runner`."""

    def __init__(self, c: WanConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = c
        self.dtype = jnp.dtype(dtype)
        dim = c.inner_dim
        pt, ph, pw = c.patch_size
        # 1. Patch embedding: Conv3d(kernel = stride = patch) as a Linear on
        # patches flattened (c, pt, ph, pw) (the runner patchifies eagerly).
        self.patch_embedding = nn.Linear(c.patch_features, dim, dtype=dtype, rngs=rngs)
        # 2. Condition embeddings
        self.condition_embedder = WanTimeTextImageEmbedding(c, dtype=dtype, rngs=rngs)
        # 3. Transformer blocks (stacked, run as a scan)
        self.blocks = nn.stacked(lambda r: WanTransformerBlock(c, dtype=dtype, rngs=r), c.num_layers, rngs)
        # 4. Output norm & projection
        self.proj_out = nn.Linear(dim, c.out_channels * pt * ph * pw, dtype=dtype, rngs=rngs)
        self.scale_shift_table = nnx.Param(
            jax.random.normal(rngs.params(), (1, 2, dim), nn.fp32(dtype)) / dim ** 0.5)

    def encode_text(self, par, encoder_hidden_states, encoder_hidden_states_image=None, all_heads: bool = False):
        """Every block's cross-attention K/V, stacked `[layers, B, L, D/P]` (this rank's heads),
        or `[layers, B, L, D]` with `all_heads` (`par.cross_local`'s cache)."""
        ctx, img = self.condition_embedder.text(par, encoder_hidden_states, encoder_hidden_states_image,
                                                self.dtype)
        return nn.map_blocks(self.blocks, lambda blk: blk.attn2.context_kv(par, ctx, img, all_heads))

    def __call__(self, par, patches, timestep, text_kv, cos, sin, kv_mask=None, sparse=None):
        """The denoiser on patch rows.

        patches: (B, n, C*pt*ph*pw), this rank's rows under SP (padded eagerly).
        timestep: (B,), or (B, n) per token (rows as the patches).
        text_kv: `encode_text`'s output. cos/sin: RoPE tables (S, head_dim) for
        every row (pad rows: identity). kv_mask: (S,) valid keys, or None. sparse: block-sparse
        self-attention (`layers.sparse_masks.BlockSparsity`; rows in its order) or None.
        Returns (B, n, C_out*pt*ph*pw), features (pt, ph, pw, c).
        """
        dtype = self.dtype
        f = nn.fp32(dtype)
        x = self.patch_embedding(patches.astype(dtype))
        temb, timestep_proj = self.condition_embedder.time(par, timestep, dtype)

        split = self.config.split_rope

        # norm1's statistics are carried: reduced in the fusion of the previous block's
        # last residual add (the first block's before the scan), not in a pass of their own
        def body(blk, carry, kv):
            h, moments = carry
            h = blk(par, h, kv, timestep_proj, cos, sin, kv_mask, split, moments, sparse)
            return h, row_moments(h)

        x, moments = nn.scan_blocks(self.blocks, (x, row_moments(x)), body, xs=text_kv)

        # 5. Output norm, projection (uses temb, not timestep_proj)
        table = self.scale_shift_table[...]
        mod = table[None] + temb[:, :, None] if temb.ndim == 3 else table + temb[:, None]
        shift, scale = _chunks(mod.astype(f), 2)
        x = modulate(x.astype(f), shift, scale, self.config.eps, moments).astype(dtype)
        return self.proj_out(x)


def build(config: WanConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs) -> WanTransformer3DModel:
    """The model with random parameters (float32 kept where diffusers keeps it)."""
    return WanTransformer3DModel(config, dtype=dtype, rngs=rngs)
