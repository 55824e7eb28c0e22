"""FLUX.1 (diffusers `FluxTransformer2DModel`) in Flax NNX, written once for one device, TP and SP.

Reads top to bottom like diffusers' `transformer_flux.py`: the embedders, the
19 double-stream (joint, MMDiT) blocks, the 38 single-stream blocks, the
final AdaLN and projection. Module and parameter names are diffusers'
(`transformer_blocks.attn.to_q`, `single_transformer_blocks.proj_mlp`, ...),
so a checkpoint key maps to a parameter by renaming the leaf (`keys.py`).

Every forward runs inside one `shard_map` over the mesh's `tp` axis (or plain
`jit` on one device) and talks to the other ranks only through `Parallel`
(`difflet_tpu/parallel.py`):

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
forward (`single_block_row_order`; RoPE is per token, so no other change).
proj_out is diffusers' one Linear over cat([attn (D), mlp (4D)]), held as two
row-parallel kernels `proj_out.attn` and `proj_out.mlp` (the loader slices the
packed weight's input features, `Key(in_range=...)`, keys.py), so rank r's
rows of each are exactly the inputs it holds (its heads, its MLP columns); the
two products are summed in one reduce-scatter (SP) / all-reduce (TP), with no
concatenation and nothing that depends on P in the parameters.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu import layout, nn
from difflet_tpu.attention import attention
from difflet_tpu.parallel import COLUMN, ROW

from .config import EPS, FluxConfig, ROPE_THETA

# --------------------------------------------------------------------------
# Parallel plan (module path pattern over the NNX state, stacked blocks without
# an index -> role; everything not listed is replicated).
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
PLAN = {
    "transformer_blocks.attn.to_q": COLUMN,
    "transformer_blocks.attn.to_k": COLUMN,
    "transformer_blocks.attn.to_v": COLUMN,
    "transformer_blocks.attn.add_q_proj": COLUMN,
    "transformer_blocks.attn.add_k_proj": COLUMN,
    "transformer_blocks.attn.add_v_proj": COLUMN,
    "transformer_blocks.attn.to_out.0": ROW,
    "transformer_blocks.attn.to_add_out": ROW,
    "transformer_blocks.ff.net.0.proj": COLUMN,
    "transformer_blocks.ff.net.2": ROW,
    "transformer_blocks.ff_context.net.0.proj": COLUMN,
    "transformer_blocks.ff_context.net.2": ROW,
    "transformer_blocks.norm1.linear": COLUMN,
    "transformer_blocks.norm1_context.linear": COLUMN,
    "single_transformer_blocks.attn.to_q": COLUMN,
    "single_transformer_blocks.attn.to_k": COLUMN,
    "single_transformer_blocks.attn.to_v": COLUMN,
    "single_transformer_blocks.proj_mlp": COLUMN,
    "single_transformer_blocks.proj_out.attn": ROW,
    "single_transformer_blocks.proj_out.mlp": ROW,
    "single_transformer_blocks.norm.linear": COLUMN,
    "norm_out.linear": COLUMN,
}


# --------------------------------------------------------------------------
# Embeddings (diffusers embeddings.py)
# --------------------------------------------------------------------------

def timestep_proj(timesteps, dtype, num_channels: int = 256, max_period: float = 10000.0) -> np.ndarray:
    """`Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` of `timesteps * 1000`,
    on the host: `[B, 256]` float32, [cos, sin].

    As diffusers: the timestep (or guidance) is first cast to the model dtype and
    multiplied by 1000 in that dtype (so in bf16 it is rounded before the x1000),
    then the sinusoid runs in float32. torch's float32 exp / sin / cos (CPU) are
    correctly rounded for all but a few inputs (exp: 2 of the 128 frequencies);
    XLA's differ more (15 of the 128 exp values by an ulp; sin/cos by up to 2.6e-5
    at 750 rad), which moved the fixtures' outputs by ~1e-5 relative. So each
    transcendental runs in float64 and is rounded to float32, and the products stay
    float32 as torch's. The result is a (B, 256) input of the compiled step.
    """
    t = np.asarray(timesteps)
    t = (t.astype(dtype) * np.asarray(1000, dtype)).astype(np.float32)
    half = num_channels // 2
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32)
    exponent = exponent / np.float32(half)
    freqs = np.exp(exponent.astype(np.float64)).astype(np.float32)
    emb = (t[:, None] * freqs[None, :]).astype(np.float64)
    return np.concatenate([np.cos(emb), np.sin(emb)], axis=-1).astype(np.float32)


class TimestepEmbedding(nnx.Module):
    def __init__(self, in_channels: int, time_embed_dim: int, *, dtype, rngs):
        self.linear_1 = nn.Linear(in_channels, time_embed_dim, dtype=dtype, rngs=rngs)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim, dtype=dtype, rngs=rngs)

    def __call__(self, sample):
        return self.linear_2(jax.nn.silu(self.linear_1(sample)))


class PixArtAlphaTextProjection(nnx.Module):
    """linear_1, SiLU (FLUX's act_fn="silu"), linear_2."""

    def __init__(self, in_features: int, hidden_size: int, *, dtype, rngs):
        self.linear_1 = nn.Linear(in_features, hidden_size, dtype=dtype, rngs=rngs)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, caption):
        return self.linear_2(jax.nn.silu(self.linear_1(caption)))


class CombinedTimestepTextProjEmbeddings(nnx.Module):
    """schnell: temb = timestep_embedder(t) + text_embedder(pooled)."""

    def __init__(self, embedding_dim: int, pooled_projection_dim: int, *, dtype, rngs):
        self.timestep_embedder = TimestepEmbedding(256, embedding_dim, dtype=dtype, rngs=rngs)
        self.text_embedder = PixArtAlphaTextProjection(pooled_projection_dim, embedding_dim, dtype=dtype,
                                                       rngs=rngs)

    def __call__(self, timesteps_proj, guidance_proj, pooled_projection):
        del guidance_proj
        timesteps_emb = self.timestep_embedder(timesteps_proj.astype(pooled_projection.dtype))
        return timesteps_emb + self.text_embedder(pooled_projection)


class CombinedTimestepGuidanceTextProjEmbeddings(nnx.Module):
    """dev: temb = timestep_embedder(t) + guidance_embedder(g) + text_embedder(pooled)."""

    def __init__(self, embedding_dim: int, pooled_projection_dim: int, *, dtype, rngs):
        self.timestep_embedder = TimestepEmbedding(256, embedding_dim, dtype=dtype, rngs=rngs)
        self.guidance_embedder = TimestepEmbedding(256, embedding_dim, dtype=dtype, rngs=rngs)
        self.text_embedder = PixArtAlphaTextProjection(pooled_projection_dim, embedding_dim, dtype=dtype,
                                                       rngs=rngs)

    def __call__(self, timesteps_proj, guidance_proj, pooled_projection):
        timesteps_emb = self.timestep_embedder(timesteps_proj.astype(pooled_projection.dtype))
        guidance_emb = self.guidance_embedder(guidance_proj.astype(pooled_projection.dtype))
        return timesteps_emb + guidance_emb + self.text_embedder(pooled_projection)


# --------------------------------------------------------------------------
# RoPE (FluxPosEmbed): tables on the host, as the reference computes them
# --------------------------------------------------------------------------

def rope_tables(ids, axes_dim, theta: float = ROPE_THETA):
    """diffusers' `FluxPosEmbed(ids)`: cos, sin `[S, sum(axes_dim)]` float32, interleaved.

    ids `[S, n_axes]` (numpy). As diffusers: positions cast to float32, then
    frequencies, products, cos and sin in float64, cast to float32 at the end.
    """
    pos = np.asarray(ids, np.float32).astype(np.float64)
    cos_out, sin_out = [], []
    for i, dim in enumerate(axes_dim):
        freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        angles = np.outer(pos[:, i], freqs)
        cos_out.append(np.repeat(np.cos(angles), 2, axis=1).astype(np.float32))
        sin_out.append(np.repeat(np.sin(angles), 2, axis=1).astype(np.float32))
    return np.concatenate(cos_out, axis=-1), np.concatenate(sin_out, axis=-1)


def apply_rotary_emb(x, cos, sin, split: bool):
    """diffusers' `apply_rotary_emb(use_real=True, sequence_dim=1)`: x `[B, S, H, D]`,
    cos/sin `[S, D]`; computed in float32 (at least) and cast back.

    `split`: x and the tables are in split-halves order (the tables' two halves are
    equal, each channel pair (2i, 2i+1) having become (i, D/2 + i)), so the rotation
    is `[x1 c - x2 s, x2 c + x1 s]` on the halves: the same products and sums as
    diffusers' pairwise form, one elementwise pass (no rotated copy of x).
    Otherwise interleaved pairs (2i, 2i+1), as diffusers.
    """
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if split:
        half = x.shape[-1] // 2
        c, s = cos[None, :, None, :half], sin[None, :, None, :half]
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:
        out = layout.apply_rope_interleaved(xf, cos[None, :, None, :], sin[None, :, None, :])
    return out.astype(x.dtype)


def single_block_row_order(n_txt: int, n_img: int, ranks: int) -> np.ndarray:
    """Where the single blocks' gathered rows come from, as indices into [txt | img].

    Under SP rank r holds [txt_r | img_r] (its n_txt/P text rows, then its
    n_img/P image rows); the all-gather ring returns the ranks' shards in rank
    order, so row j of the gathered sequence is row `order[j]` of the joint
    [txt | img] sequence: [txt_0, img_0, txt_1, img_1, ...]. One rank: identity.
    """
    if n_txt % ranks or n_img % ranks:
        raise ValueError(f"streams of {n_txt} text and {n_img} image rows do not split over {ranks} ranks")
    t, i = n_txt // ranks, n_img // ranks
    return np.concatenate([np.concatenate([np.arange(r * t, (r + 1) * t), n_txt + np.arange(r * i, (r + 1) * i)])
                           for r in range(ranks)])


# --------------------------------------------------------------------------
# Normalization (diffusers normalization.py)
# --------------------------------------------------------------------------

def _modulation(par, linear: nn.Linear, emb):
    """`linear(silu(emb))` with the linear column-sharded: this rank's columns of the
    small (B, kD) output, then all of them (`gather_columns`)."""
    return par.gather_columns(linear(jax.nn.silu(emb)))


class AdaLayerNormZero(nnx.Module):
    """norm1 / norm1_context: 6 chunks (shift, scale, gate)_msa, (shift, scale, gate)_mlp."""

    def __init__(self, embedding_dim: int, *, dtype, rngs):
        self.linear = nn.Linear(embedding_dim, 6 * embedding_dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, x, emb):
        emb = _modulation(par, self.linear, emb)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(emb, 6, axis=1)
        x = nn.layer_norm(x, eps=EPS) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nnx.Module):
    """norm of the single blocks: 3 chunks (shift, scale, gate)."""

    def __init__(self, embedding_dim: int, *, dtype, rngs):
        self.linear = nn.Linear(embedding_dim, 3 * embedding_dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, x, emb):
        emb = _modulation(par, self.linear, emb)
        shift_msa, scale_msa, gate_msa = jnp.split(emb, 3, axis=1)
        x = nn.layer_norm(x, eps=EPS) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa


class AdaLayerNormContinuous(nnx.Module):
    """norm_out: NOTE scale comes first, then shift."""

    def __init__(self, embedding_dim: int, conditioning_embedding_dim: int, *, dtype, rngs):
        self.linear = nn.Linear(conditioning_embedding_dim, 2 * embedding_dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, x, conditioning_embedding):
        emb = _modulation(par, self.linear, conditioning_embedding.astype(x.dtype))
        scale, shift = jnp.split(emb, 2, axis=1)
        return nn.layer_norm(x, eps=EPS) * (1 + scale)[:, None, :] + shift[:, None, :]


# --------------------------------------------------------------------------
# Attention (FluxAttention + FluxAttnProcessor)
# --------------------------------------------------------------------------

class FluxAttention(nnx.Module):
    """Joint attention. `added_kv`: the double blocks' text projections; `pre_only`:
    the single blocks' (no to_out)."""

    def __init__(self, query_dim: int, heads: int, dim_head: int, *, added_kv: bool = False,
                 pre_only: bool = False, dtype, rngs):
        self.heads, self.head_dim = heads, dim_head
        inner = heads * dim_head
        self.norm_q = nn.Weight(dim_head, dtype=dtype)
        self.norm_k = nn.Weight(dim_head, dtype=dtype)
        self.to_q = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
        self.to_k = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
        self.to_v = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
        if not pre_only:
            self.to_out = nnx.Dict({"0": nn.Linear(inner, query_dim, dtype=dtype, rngs=rngs)})
        if added_kv:
            self.norm_added_q = nn.Weight(dim_head, dtype=dtype)
            self.norm_added_k = nn.Weight(dim_head, dtype=dtype)
            self.add_q_proj = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
            self.add_k_proj = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
            self.add_v_proj = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
            self.to_add_out = nn.Linear(inner, query_dim, dtype=dtype, rngs=rngs)

    def _heads(self, t):
        return t.reshape(*t.shape[:-1], -1, self.head_dim)  # [B, S, local heads, head_dim]

    def attend(self, par, q, k, v, rope, kv_mask):
        """softmax(q k^T) v over this rank's heads, RoPE on q and k; `[B, S, heads_local * head_dim]`."""
        cos, sin, split = rope
        q = apply_rotary_emb(q, cos, sin, split)
        k = apply_rotary_emb(k, cos, sin, split)
        o = attention(q, k, v, kv_mask, impl=par.attn_impl, interpret=par.interpret)
        return o.reshape(*o.shape[:2], -1).astype(q.dtype)

    def __call__(self, par, hidden_states, encoder_hidden_states, rope, kv_mask):
        """The double blocks' joint attention over [txt | img]: (image out, text out)."""
        par.local_heads(self.heads)
        q, k, v = nn.column(par, hidden_states, [self.to_q, self.to_k, self.to_v])
        eq, ek, ev = nn.column(par, encoder_hidden_states, [self.add_q_proj, self.add_k_proj, self.add_v_proj])
        q = nn.rms_norm(self._heads(q), self.norm_q.scale[...], EPS)
        k = nn.rms_norm(self._heads(k), self.norm_k.scale[...], EPS)
        eq = nn.rms_norm(self._heads(eq), self.norm_added_q.scale[...], EPS)
        ek = nn.rms_norm(self._heads(ek), self.norm_added_k.scale[...], EPS)
        n_txt = eq.shape[1]
        q = jnp.concatenate([eq, q], axis=1)
        k = jnp.concatenate([ek, k], axis=1)
        v = jnp.concatenate([self._heads(ev), self._heads(v)], axis=1)
        o = self.attend(par, q, k, v, rope, kv_mask)
        encoder_out, hidden_out = o[:, :n_txt], o[:, n_txt:]
        hidden_out = nn.row(par, [(hidden_out, self.to_out["0"])])
        encoder_out = nn.row(par, [(encoder_out, self.to_add_out)])
        return hidden_out, encoder_out


class FeedForward(nnx.Module):
    """net.0 = GELU(proj, approximate="tanh"), net.2 = Linear."""

    def __init__(self, dim: int, inner: int, *, dtype, rngs):
        self.net = nnx.Dict({"0": nnx.Dict({"proj": nn.Linear(dim, inner, dtype=dtype, rngs=rngs)}),
                             "2": nn.Linear(inner, dim, dtype=dtype, rngs=rngs)})

    def __call__(self, par, x):
        (h,) = nn.column(par, x, [self.net["0"]["proj"]], [nn.gelu_tanh])
        return nn.row(par, [(h, self.net["2"])])


def _clip_fp16(x):
    return jnp.clip(x, -65504, 65504) if x.dtype == jnp.float16 else x


# --------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------

class PackedProjOut(nnx.Module):
    """diffusers' single-block `proj_out = Linear(D + 4D -> D)` over cat([attn, mlp]),
    as two kernels over its two input ranges: `attn` ([D, D], no bias) and `mlp`
    ([4D, D], with proj_out's bias). Both are row-parallel, so each rank holds the
    rows of the inputs it computed; `__call__` sums the two products in one
    reduce-scatter (SP) or all-reduce (TP) and adds the bias once."""

    def __init__(self, attn_dim: int, mlp_dim: int, out_dim: int, *, dtype, rngs):
        self.attn = nn.Linear(attn_dim, out_dim, bias=False, dtype=dtype, rngs=rngs)
        self.mlp = nn.Linear(mlp_dim, out_dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, attn_output, mlp_hidden_states):
        return par.row([(attn_output, self.attn.kernel[...]), (mlp_hidden_states, self.mlp.kernel[...])],
                       self.mlp.bias[...])


class FluxSingleTransformerBlock(nnx.Module):
    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, mlp_hidden_dim: int,
                 *, dtype, rngs):
        self.mlp_hidden_dim = mlp_hidden_dim
        self.norm = AdaLayerNormZeroSingle(dim, dtype=dtype, rngs=rngs)
        self.proj_mlp = nn.Linear(dim, mlp_hidden_dim, dtype=dtype, rngs=rngs)
        self.proj_out = PackedProjOut(num_attention_heads * attention_head_dim, mlp_hidden_dim, dim, dtype=dtype,
                                      rngs=rngs)
        self.attn = FluxAttention(dim, num_attention_heads, attention_head_dim, pre_only=True, dtype=dtype,
                                  rngs=rngs)

    def __call__(self, par, hidden_states, temb, rope, kv_mask):
        """hidden_states: the joint [txt | img] rows (under SP this rank's [txt_r | img_r];
        `rope` and `kv_mask` are then in the gathered order, see single_block_row_order)."""
        residual = hidden_states
        norm_hidden_states, gate = self.norm(par, hidden_states, temb)
        attn = self.attn
        par.local_heads(attn.heads)
        q, k, v, mlp_hidden_states = nn.column(par, norm_hidden_states,
                                               [attn.to_q, attn.to_k, attn.to_v, self.proj_mlp],
                                               [None, None, None, nn.gelu_tanh])
        q = nn.rms_norm(attn._heads(q), attn.norm_q.scale[...], EPS)
        k = nn.rms_norm(attn._heads(k), attn.norm_k.scale[...], EPS)
        attn_output = attn.attend(par, q, k, attn._heads(v), rope, kv_mask)
        # proj_out(cat([attn_output, mlp_hidden_states])): two row-parallel pairs, one collective.
        out = self.proj_out(par, attn_output, mlp_hidden_states)
        return _clip_fp16(residual + gate[:, None] * out)


class FluxTransformerBlock(nnx.Module):
    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, *, dtype, rngs):
        self.norm1 = AdaLayerNormZero(dim, dtype=dtype, rngs=rngs)
        self.norm1_context = AdaLayerNormZero(dim, dtype=dtype, rngs=rngs)
        self.attn = FluxAttention(dim, num_attention_heads, attention_head_dim, added_kv=True, dtype=dtype,
                                  rngs=rngs)
        self.ff = FeedForward(dim, 4 * dim, dtype=dtype, rngs=rngs)
        self.ff_context = FeedForward(dim, 4 * dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, hidden_states, encoder_hidden_states, temb, rope, kv_mask):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(par, hidden_states, temb)
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            par, encoder_hidden_states, temb)

        attn_output, context_attn_output = self.attn(par, norm_hidden_states, norm_encoder_hidden_states,
                                                     rope, kv_mask)

        # Process attention outputs for the `hidden_states`.
        attn_output = gate_msa[:, None] * attn_output
        hidden_states = hidden_states + attn_output
        norm_hidden_states = nn.layer_norm(hidden_states, eps=EPS)
        norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        ff_output = self.ff(par, norm_hidden_states)
        hidden_states = hidden_states + gate_mlp[:, None] * ff_output

        # Process attention outputs for the `encoder_hidden_states`.
        encoder_hidden_states = encoder_hidden_states + c_gate_msa[:, None] * context_attn_output
        norm_encoder_hidden_states = nn.layer_norm(encoder_hidden_states, eps=EPS)
        norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        context_ff_output = self.ff_context(par, norm_encoder_hidden_states)
        encoder_hidden_states = _clip_fp16(encoder_hidden_states + c_gate_mlp[:, None] * context_ff_output)
        return encoder_hidden_states, hidden_states


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
            lambda r: FluxTransformerBlock(D, c.num_attention_heads, c.attention_head_dim, dtype=dtype, rngs=r),
            c.num_layers, rngs)
        self.single_transformer_blocks = nn.stacked(
            lambda r: FluxSingleTransformerBlock(D, c.num_attention_heads, c.attention_head_dim,
                                                 c.mlp_hidden_dim, dtype=dtype, rngs=r),
            c.num_single_layers, rngs)
        self.norm_out = AdaLayerNormContinuous(D, D, dtype=dtype, rngs=rngs)
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
        temb = self.time_text_embed(timesteps_proj, guidance_proj, pooled_projections.astype(dtype))
        encoder_hidden_states = self.context_embedder(encoder_hidden_states.astype(dtype))

        rope = (freqs_cos, freqs_sin, c.split_rope)

        def double(block, carry):
            enc, hid = carry
            return block(par, hid, enc, temb, rope, kv_mask)

        encoder_hidden_states, hidden_states = nn.scan_blocks(
            self.transformer_blocks, (encoder_hidden_states, hidden_states), double)

        # Single blocks: [txt | img] (under SP this rank's [txt_r | img_r]); the gathered
        # rows are in single_block_row_order, so the tables and mask follow it.
        n_txt_local = encoder_hidden_states.shape[1]
        ranks = par.size if par.seq_sharded else 1
        if ranks > 1:
            order = single_block_row_order(n_txt_local * ranks, hidden_states.shape[1] * ranks, ranks)
            rope = (jnp.take(freqs_cos, order, axis=0), jnp.take(freqs_sin, order, axis=0), c.split_rope)
            if kv_mask is not None:
                kv_mask = jnp.take(kv_mask, order, axis=-1)
        hidden_states = jnp.concatenate([encoder_hidden_states, hidden_states], axis=1)
        hidden_states = nn.scan_blocks(self.single_transformer_blocks, hidden_states,
                                       lambda block, h: block(par, h, temb, rope, kv_mask))
        hidden_states = hidden_states[:, n_txt_local:]

        hidden_states = self.norm_out(par, hidden_states, temb)
        return self.proj_out(hidden_states)


def build(config: FluxConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> FluxTransformer2DModel:
    """The model with random parameters (load a checkpoint with difflet_tpu.weights.load_transformer)."""
    return FluxTransformer2DModel(config, dtype=dtype, rngs=rngs)
