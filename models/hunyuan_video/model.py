"""HunyuanVideoTransformer3DModel in Flax NNX, read top to bottom like diffusers'
`transformer_hunyuan_video.py` (0.42.1), with the same submodule names.

Every module is written once for the three ways to run over the `tp` axis
(`difflet_tpu.parallel.Parallel`): one device, TP, SP. Column-parallel groups
go through `nn.column` / `par.column`, row-parallel outputs through
`nn.row` / `par.row`; adaLN outputs are column-sharded and gathered with
`par.gather_columns`.

Layout under SP (see `PLAN`): the dual-stream blocks keep the image stream
and the text stream sequence-sharded each on its own; the single-stream
blocks run on one contiguous chunk of the joint `[image | text]` sequence per
rank (`Config.sp_single`; off: they run TP on the gathered sequence).

Numerics as diffusers: timestep projections, RoPE tables and the rotation,
LayerNorm / RMSNorm statistics and the refiner's masked mean in float32;
everything else in the parameter dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu import layout, nn
from difflet_tpu.attention import attention, reference_attention
from difflet_tpu.parallel import COLUMN, ROW

from .config import HunyuanVideoConfig

F32 = jnp.float32
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
# padded by the Runner's rule); the single blocks' joint `[image | text]`
# sequence as one contiguous chunk per rank (`Config.sp_single`).
# --------------------------------------------------------------------------
PLAN = {
    # dual-stream blocks
    "transformer_blocks.norm1.linear": COLUMN,
    "transformer_blocks.norm1_context.linear": COLUMN,
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
    # single-stream blocks
    "single_transformer_blocks.norm.linear": COLUMN,
    "single_transformer_blocks.attn.to_q": COLUMN,
    "single_transformer_blocks.attn.to_k": COLUMN,
    "single_transformer_blocks.attn.to_v": COLUMN,
    "single_transformer_blocks.proj_mlp": COLUMN,
    "single_transformer_blocks.proj_out.attn": ROW,
    "single_transformer_blocks.proj_out.mlp": ROW,
    # final layer
    "norm_out.linear": COLUMN,
}


# --------------------------------------------------------------------------
# Small building blocks
# --------------------------------------------------------------------------

class LayerNorm(nnx.Module):
    """torch `nn.LayerNorm(dim, elementwise_affine=True, eps=1e-6)`: `scale`, `bias`."""

    def __init__(self, dim: int, *, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x):
        return nn.layer_norm(x, self.scale[...], self.bias[...], eps=EPS)


def _linear(i, o, dtype, rngs, bias=True):
    return nn.Linear(i, o, bias=bias, dtype=dtype, rngs=rngs)


# The reference's float32 `exp(-ln(1e4) * i / 128)`, i < 128, bit for bit: torch 2.13 CPU
# (`torch.exp`, the fixtures' generator) is faithful but not correctly rounded; it differs from
# the correctly rounded value by one ulp at i = 12 and i = 106. Guidance = 6000 turns a one-ulp
# frequency difference into ~4e-4 rad, which alone moves the tiny model's output by ~1e-5
# relative L2; with this table the port is at the float32 floor (~4e-7). Other sizes are
# computed correctly rounded.
_TIMESTEP_FREQS_256 = np.array([
    0x3f800000, 0x3f6e39f8, 0x3f5dafd6, 0x3f4e4bac, 0x3f3ff911, 0x3f32a506, 0x3f263de0, 0x3f1ab32b,
    0x3f0ff59a, 0x3f05f6ee, 0x3ef953ce, 0x3ee80460, 0x3ed7e89b, 0x3ec8eb23, 0x3ebaf81b, 0x3eadfcff,
    0x3ea1e89b, 0x3e96aaea, 0x3e8c3503, 0x3e827908, 0x3e72d422, 0x3e61f836, 0x3e5247ed, 0x3e43ae7c,
    0x3e361887, 0x3e297409, 0x3e1db03f, 0x3e12bd90, 0x3e088d77, 0x3dfe24df, 0x3dec7fd5, 0x3ddc1464,
    0x3dcccccc, 0x3dbe94c7, 0x3db15978, 0x3da50957, 0x3d99940d, 0x3d8eea6c, 0x3d84fe4c, 0x3d778511,
    0x3d6655c1, 0x3d5657e3, 0x3d477640, 0x3d399d18, 0x3d2cba15, 0x3d20bc1b, 0x3d159348, 0x3d0b30cb,
    0x3d0186e2, 0x3cf11177, 0x3ce054d1, 0x3cd0c1a8, 0x3cc2434e, 0x3cb4c691, 0x3ca83989, 0x3c9c8b96,
    0x3c91ad39, 0x3c879009, 0x3c7c4d30, 0x3c6ac8e6, 0x3c5a7bf1, 0x3c4b50b5, 0x3c3d330e, 0x3c301050,
    0x3c23d70a, 0x3c187706, 0x3c0de12e, 0x3c040777, 0x3bf5b9ad, 0x3be4aa45, 0x3bd4ca15, 0x3bc6040a,
    0x3bb8449a, 0x3bab7982, 0x3b9f91cc, 0x3b947daf, 0x3b8a2e75, 0x3b80967c, 0x3b6f520d, 0x3b5eb47a,
    0x3b4f3e33, 0x3b40dac2, 0x3b33770d, 0x3b270153, 0x3b1b690d, 0x3b109ed8, 0x3b06946d, 0x3afa78f0,
    0x3ae91528, 0x3ad8e675, 0x3ac9d759, 0x3abbd3eb, 0x3aaec98e, 0x3aa2a6f7, 0x3a975c0b, 0x3a8cd9d9,
    0x3a83126e, 0x3a73f1a2, 0x3a6301e3, 0x3a533f24, 0x3a44948a, 0x3a36ee9d, 0x3a2a3b44, 0x3a1e69a2,
    0x3a136a14, 0x3a092e01, 0x39ff4fad, 0x39ed95e4, 0x39dd1721, 0x39cdbd93, 0x39bf74d6, 0x39b229fb,
    0x39a5cb61, 0x399a48a0, 0x398f9275, 0x39859aa4, 0x3978a80d, 0x3967648c, 0x395753e2, 0x394860bf,
    0x393a7753, 0x392d852a, 0x39217919, 0x39164326, 0x390bd46d, 0x39021f28, 0x38f22cdd, 0x38e15c8e,
], np.uint32).view(np.float32)


def timestep_freqs(dim: int = 256) -> np.ndarray:
    """`exp(exponent)` of `get_timestep_embedding` (max_period 1e4, shift 0), float32."""
    half = dim // 2
    if half == 128:
        return _TIMESTEP_FREQS_256
    exponent = (np.float32(-math.log(10000)) * np.arange(half, dtype=np.float32)) / np.float32(half)
    return np.exp(exponent.astype(np.float64)).astype(np.float32)


def timestep_proj(t, dim: int = 256):
    """`Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)`: [cos, sin], float32."""
    emb = t.astype(F32)[:, None] * jnp.asarray(timestep_freqs(dim))[None, :]
    return jnp.concatenate([jnp.cos(emb), jnp.sin(emb)], axis=-1)


class TimestepEmbedding(nnx.Module):
    def __init__(self, in_channels: int, dim: int, *, dtype, rngs):
        self.linear_1 = _linear(in_channels, dim, dtype, rngs)
        self.linear_2 = _linear(dim, dim, dtype, rngs)

    def __call__(self, x):
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class PixArtAlphaTextProjection(nnx.Module):
    """linear_1 -> SiLU -> linear_2 (act_fn="silu")."""

    def __init__(self, in_features: int, dim: int, *, dtype, rngs):
        self.linear_1 = _linear(in_features, dim, dtype, rngs)
        self.linear_2 = _linear(dim, dim, dtype, rngs)

    def __call__(self, x):
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class FeedForward(nnx.Module):
    """`net.0.proj` -> activation -> `net.2` (diffusers FeedForward, mult 4)."""

    def __init__(self, dim: int, inner: int, activation, *, dtype, rngs):
        self.activation = activation
        self.net = nnx.Dict({"0": nnx.Dict({"proj": _linear(dim, inner, dtype, rngs)}),
                             "2": _linear(inner, dim, dtype, rngs)})

    def __call__(self, par, x):
        (h,) = nn.column(par, x, [self.net["0"]["proj"]], [self.activation])
        return nn.row(par, [(h, self.net["2"])])


class AdaLinear(nnx.Module):
    """The Linear of an adaLN module (`norm1.linear`, `norm.linear`, `norm_out.linear`, ...)."""

    def __init__(self, dim: int, chunks: int, *, dtype, rngs):
        self.chunks = chunks
        self.linear = _linear(dim, chunks * dim, dtype, rngs)

    def __call__(self, par, emb_act):
        """`linear(silu(emb))` chunked; column-sharded and gathered (small: (B, chunks*D))."""
        return jnp.split(par.gather_columns(self.linear(emb_act)), self.chunks, axis=-1)


def modulate_rows(v, first, tr_v=None):
    """A per-sample modulation vector `(B, D)` for every row: `(B, 1, D)`, or with
    token_replace `(B, rows, D)` taking `tr_v` where `first` (first-frame rows)."""
    if first is None:
        return v[:, None]
    return jnp.where(first[None, :, None], tr_v[:, None], v[:, None])


def apply_rope(x, cos, sin, split: bool):
    """diffusers `apply_rotary_emb` in float32 (or wider) on `[B, S, H, hd]`; tables `[S, hd]`."""
    xf = x.astype(jnp.promote_types(x.dtype, F32))
    c, s = cos[:, None, :], sin[:, None, :]
    out = layout.apply_rope_split(xf, c, s) if split else layout.apply_rope_interleaved(xf, c, s)
    return out.astype(x.dtype)


def heads_of(t, head_dim):
    return t.reshape(*t.shape[:-1], t.shape[-1] // head_dim, head_dim)


def flat(t):
    return t.reshape(*t.shape[:-2], -1)


@dataclasses.dataclass
class Context:
    """What every block of one forward shares (traced values and static geometry)."""

    par: object                  # Parallel of the dual blocks
    par_single: object           # Parallel of the single blocks
    temb_act: jax.Array          # silu(temb), (B, D)
    tr_act: jax.Array | None     # silu(token_replace_emb), (B, D), token_replace only
    key_mask: jax.Array          # (B, N) joint [image | text] keys to attend to
    rope_img: tuple              # (cos, sin) (n_img, hd) of the image rows
    rope_joint: tuple            # (cos, sin) (N, hd): image rows, then identity on text rows
    first_img: jax.Array | None  # (rows,) this rank's image rows that are first-frame tokens
    first_joint: jax.Array | None  # (rows,) the single blocks' rows that are first-frame tokens
    n_img: int                   # image rows (padded) of the joint sequence
    split_rope: bool


def _attend(par, q, k, v, kv_mask):
    if q.dtype == jnp.float64:
        # XLA's attention (jax.nn.dot_product_attention) takes its softmax in float32;
        # float64 tests of the mechanisms need it in float64.
        return reference_attention(q, k, v, kv_mask)
    return attention(q, k, v, kv_mask, impl=par.attn_impl, interpret=par.interpret)


# --------------------------------------------------------------------------
# Embedders
# --------------------------------------------------------------------------

class HunyuanVideoPatchEmbed(nnx.Module):
    """Conv3d(kernel = stride = (pt, p, p)) as a Linear over patches flattened (c, pt, ph, pw);
    the patches are cut eagerly before the step (`patchify`)."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        self.proj = _linear(c.in_channels * c.patch_volume, c.inner_dim, dtype, rngs)

    def __call__(self, patches):
        return self.proj(patches)


def patchify(x, pt: int, p: int):
    """`[B, C, F, H, W]` -> `[B, F'H'W', C*pt*p*p]`, tokens in (f, h, w) order (numpy or jax)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    B, C, F, H, W = x.shape
    x = x.reshape(B, C, F // pt, pt, H // p, p, W // p, p)
    x = xp.transpose(x, (0, 2, 4, 6, 1, 3, 5, 7))
    return x.reshape(B, (F // pt) * (H // p) * (W // p), C * pt * p * p)


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
        self.text_embedder = PixArtAlphaTextProjection(c.pooled_projection_dim, c.inner_dim, dtype=dtype,
                                                       rngs=rngs)
        self.guidance_embedder = (TimestepEmbedding(256, c.inner_dim, dtype=dtype, rngs=rngs)
                                  if c.guidance_embeds else None)

    def __call__(self, timestep, pooled_projection, guidance):
        dtype = pooled_projection.dtype
        timesteps_emb = self.timestep_embedder(timestep_proj(timestep).astype(dtype))
        pooled = self.text_embedder(pooled_projection)
        token_replace_emb = None
        if self.image_condition_type == "token_replace":
            zero = jnp.zeros_like(timestep)
            token_replace_emb = self.timestep_embedder(timestep_proj(zero).astype(dtype)) + pooled
        if self.guidance_embedder is not None:
            guidance_emb = self.guidance_embedder(timestep_proj(guidance).astype(dtype))
            conditioning = timesteps_emb + guidance_emb + pooled
        else:
            conditioning = timesteps_emb + pooled
        return conditioning, token_replace_emb


class CombinedTimestepTextProjEmbeddings(nnx.Module):
    """The token refiner's own `timestep_emb + text_embedder(masked mean of the LLM features)`."""

    def __init__(self, dim: int, pooled_dim: int, *, dtype, rngs):
        self.timestep_embedder = TimestepEmbedding(256, dim, dtype=dtype, rngs=rngs)
        self.text_embedder = PixArtAlphaTextProjection(pooled_dim, dim, dtype=dtype, rngs=rngs)

    def __call__(self, timestep, pooled_projection):
        t = self.timestep_embedder(timestep_proj(timestep).astype(pooled_projection.dtype))
        return t + self.text_embedder(pooled_projection)


# --------------------------------------------------------------------------
# Token refiner (replicated: 256 text tokens)
# --------------------------------------------------------------------------

class RefinerAttention(nnx.Module):
    """diffusers `Attention` (AttnProcessor2_0): biases, no q/k norm, no RoPE."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.head_dim = c.attention_head_dim
        self.to_q = _linear(D, D, dtype, rngs)
        self.to_k = _linear(D, D, dtype, rngs)
        self.to_v = _linear(D, D, dtype, rngs)
        self.to_out = nnx.Dict({"0": _linear(D, D, dtype, rngs)})

    def __call__(self, par, x, row_valid, key_valid):
        q, k, v = (heads_of(l(x), self.head_dim) for l in (self.to_q, self.to_k, self.to_v))
        o = _attend(par, q, k, v, key_valid)
        # diffusers' mask is m[i] & m[j] with column 0 forced True: a padded query
        # row attends to key 0 alone, i.e. its output is exactly v[0].
        o = jnp.where(row_valid[:, :, None, None], o, v[:, :1])
        return self.to_out["0"](flat(o))


class HunyuanVideoIndividualTokenRefinerBlock(nnx.Module):
    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.norm1 = LayerNorm(D, dtype=dtype)
        self.attn = RefinerAttention(c, dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(D, dtype=dtype)
        self.ff = FeedForward(D, int(D * c.mlp_ratio), jax.nn.silu, dtype=dtype, rngs=rngs)  # "linear-silu"
        self.norm_out = AdaLinear(D, 2, dtype=dtype, rngs=rngs)  # HunyuanVideoAdaNorm: gates only

    def __call__(self, par, x, temb_act, row_valid, key_valid):
        attn_output = self.attn(par, self.norm1(x), row_valid, key_valid)
        gate_msa, gate_mlp = jnp.split(self.norm_out.linear(temb_act), 2, axis=-1)  # replicated
        x = x + attn_output * gate_msa[:, None]
        ff_output = self.ff(par, self.norm2(x))
        return x + ff_output * gate_mlp[:, None]


class HunyuanVideoIndividualTokenRefiner(nnx.Module):
    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        self.refiner_blocks = nn.stacked(
            lambda r: HunyuanVideoIndividualTokenRefinerBlock(c, dtype=dtype, rngs=r), c.num_refiner_layers, rngs)

    def __call__(self, par, x, temb_act, mask):
        row_valid = mask
        key_valid = mask.at[:, 0].set(True)  # self_attn_mask[:, :, :, 0] = True
        return nn.scan_blocks(self.refiner_blocks, x,
                              lambda blk, h: blk(par, h, temb_act, row_valid, key_valid))


class HunyuanVideoTokenRefiner(nnx.Module):
    """`context_embedder`: proj_in of the LLM features, then 2 refiner blocks. Runs
    replicated on every rank (a few hundred tokens), with plain (single-device) linears."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(D, c.text_embed_dim, dtype=dtype, rngs=rngs)
        self.proj_in = _linear(c.text_embed_dim, D, dtype, rngs)
        self.token_refiner = HunyuanVideoIndividualTokenRefiner(c, dtype=dtype, rngs=rngs)

    def __call__(self, par, hidden_states, timestep, attention_mask):
        local = dataclasses.replace(par, mode="single", size=1)  # replicated: no collectives
        mask_float = attention_mask.astype(F32)[..., None]
        pooled = (hidden_states * mask_float).sum(axis=1) / mask_float.sum(axis=1)
        pooled = pooled.astype(hidden_states.dtype)
        temb = self.time_text_embed(timestep, pooled)
        x = self.proj_in(hidden_states)
        return self.token_refiner(local, x, jax.nn.silu(temb), attention_mask != 0)


# --------------------------------------------------------------------------
# Dual-stream blocks
# --------------------------------------------------------------------------

class JointAttention(nnx.Module):
    """`Attention(added_kv_proj_dim=D, context_pre_only=False, qk_norm="rms_norm")` with
    `HunyuanVideoAttnProcessor2_0`: joint attention over `[image | text]`."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D, hd = c.inner_dim, c.attention_head_dim
        self.heads, self.head_dim = c.num_attention_heads, hd
        self.to_q = _linear(D, D, dtype, rngs)
        self.to_k = _linear(D, D, dtype, rngs)
        self.to_v = _linear(D, D, dtype, rngs)
        self.to_out = nnx.Dict({"0": _linear(D, D, dtype, rngs)})
        self.add_q_proj = _linear(D, D, dtype, rngs)
        self.add_k_proj = _linear(D, D, dtype, rngs)
        self.add_v_proj = _linear(D, D, dtype, rngs)
        self.to_add_out = _linear(D, D, dtype, rngs)
        self.norm_q = nn.Weight(hd, dtype=dtype)
        self.norm_k = nn.Weight(hd, dtype=dtype)
        self.norm_added_q = nn.Weight(hd, dtype=dtype)
        self.norm_added_k = nn.Weight(hd, dtype=dtype)

    def __call__(self, ctx: Context, x, context):
        par, hd = ctx.par, self.head_dim
        par.local_heads(self.heads)
        # 1. QKV projections (image stream; under SP the all-gather ring gives every row)
        q, k, v = (heads_of(t, hd) for t in nn.column(par, x, [self.to_q, self.to_k, self.to_v]))
        # 2. per-head RMSNorm, 3. RoPE on the image stream
        q = apply_rope(nn.rms_norm(q, self.norm_q.scale[...], EPS), *ctx.rope_img, ctx.split_rope)
        k = apply_rope(nn.rms_norm(k, self.norm_k.scale[...], EPS), *ctx.rope_img, ctx.split_rope)
        # 4. text stream QKV and norms
        eq, ek, ev = (heads_of(t, hd) for t in
                      nn.column(par, context, [self.add_q_proj, self.add_k_proj, self.add_v_proj]))
        eq = nn.rms_norm(eq, self.norm_added_q.scale[...], EPS)
        ek = nn.rms_norm(ek, self.norm_added_k.scale[...], EPS)
        # 5. attention over [image | text] with the key mask
        o = _attend(par, jnp.concatenate([q, eq], 1), jnp.concatenate([k, ek], 1),
                    jnp.concatenate([v, ev], 1), ctx.key_mask)
        o = flat(o)
        # 6. output projections (row-parallel: psum / reduce-scatter)
        hidden = nn.row(par, [(o[:, :ctx.n_img], self.to_out["0"])])
        encoder = nn.row(par, [(o[:, ctx.n_img:], self.to_add_out)])
        return hidden, encoder


class HunyuanVideoTransformerBlock(nnx.Module):
    """Dual stream (and, with token_replace, `HunyuanVideoTokenReplaceTransformerBlock`:
    same weights, first-frame image rows modulated with the t=0 embedding)."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.norm1 = AdaLinear(D, 6, dtype=dtype, rngs=rngs)          # AdaLayerNormZero
        self.norm1_context = AdaLinear(D, 6, dtype=dtype, rngs=rngs)
        self.attn = JointAttention(c, dtype=dtype, rngs=rngs)
        self.ff = FeedForward(D, c.mlp_dim, nn.gelu_tanh, dtype=dtype, rngs=rngs)
        self.ff_context = FeedForward(D, c.mlp_dim, nn.gelu_tanh, dtype=dtype, rngs=rngs)

    def __call__(self, ctx: Context, hidden_states, encoder_hidden_states):
        par, first = ctx.par, ctx.first_img
        # 1. Input normalization (shift, scale, gate (msa), shift, scale, gate (mlp))
        mod = self.norm1(par, ctx.temb_act)
        tr = self.norm1(par, ctx.tr_act) if first is not None else [None] * 6
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            modulate_rows(m, first, t) for m, t in zip(mod, tr))
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
            m[:, None] for m in self.norm1_context(par, ctx.temb_act))
        norm_hidden_states = nn.layer_norm(hidden_states, eps=EPS) * (1 + scale_msa) + shift_msa
        norm_encoder_hidden_states = nn.layer_norm(encoder_hidden_states, eps=EPS) * (1 + c_scale_msa) + c_shift_msa
        # 2. Joint attention
        attn_output, context_attn_output = self.attn(ctx, norm_hidden_states, norm_encoder_hidden_states)
        # 3. Modulation and residual connection
        hidden_states = hidden_states + attn_output * gate_msa
        encoder_hidden_states = encoder_hidden_states + context_attn_output * c_gate_msa
        norm_hidden_states = nn.layer_norm(hidden_states, eps=EPS) * (1 + scale_mlp) + shift_mlp
        norm_encoder_hidden_states = nn.layer_norm(encoder_hidden_states, eps=EPS) * (1 + c_scale_mlp) + c_shift_mlp
        # 4. Feed-forward
        ff_output = self.ff(par, norm_hidden_states)
        context_ff_output = self.ff_context(par, norm_encoder_hidden_states)
        hidden_states = hidden_states + gate_mlp * ff_output
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp * context_ff_output
        return hidden_states, encoder_hidden_states


# --------------------------------------------------------------------------
# Single-stream blocks
# --------------------------------------------------------------------------

class SingleAttention(nnx.Module):
    """`Attention(pre_only=True, qk_norm="rms_norm")`: q/k/v of the joint sequence."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D, hd = c.inner_dim, c.attention_head_dim
        self.heads, self.head_dim = c.num_attention_heads, hd
        self.to_q = _linear(D, D, dtype, rngs)
        self.to_k = _linear(D, D, dtype, rngs)
        self.to_v = _linear(D, D, dtype, rngs)
        self.norm_q = nn.Weight(hd, dtype=dtype)
        self.norm_k = nn.Weight(hd, dtype=dtype)


class PackedProjOut(nnx.Module):
    """diffusers' single-block `proj_out = Linear(D + F, D)` over `cat([attn, mlp])`,
    as two kernels over its two input ranges (`Key(in_range=...)` in keys.py):
    `attn` (`[D, D]`, no bias) and `mlp` (`[F, D]`, with proj_out's bias). Both are
    row-parallel, so each rank holds the rows of the inputs it computed (its heads,
    its MLP columns); `__call__` sums the two products in one reduce-scatter (SP) or
    all-reduce (TP) and adds the bias once. As FLUX's `PackedProjOut`."""

    def __init__(self, attn_dim: int, mlp_dim: int, out_dim: int, *, dtype, rngs):
        self.attn = nn.Linear(attn_dim, out_dim, bias=False, dtype=dtype, rngs=rngs)
        self.mlp = nn.Linear(mlp_dim, out_dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, attn_output, mlp_hidden_states):
        return par.row([(attn_output, self.attn.kernel[...]), (mlp_hidden_states, self.mlp.kernel[...])],
                       self.mlp.bias[...])


class HunyuanVideoSingleTransformerBlock(nnx.Module):
    """Single stream (and `HunyuanVideoTokenReplaceSingleTransformerBlock` with token_replace)."""

    def __init__(self, c: HunyuanVideoConfig, *, dtype, rngs):
        D = c.inner_dim
        self.attn = SingleAttention(c, dtype=dtype, rngs=rngs)
        self.norm = AdaLinear(D, 3, dtype=dtype, rngs=rngs)           # AdaLayerNormZeroSingle
        self.proj_mlp = _linear(D, c.mlp_dim, dtype, rngs)
        self.proj_out = PackedProjOut(D, c.mlp_dim, D, dtype=dtype, rngs=rngs)

    def __call__(self, ctx: Context, hidden_states):
        """`hidden_states`: rows of the joint `[image | text]` sequence (this rank's chunk under SP)."""
        par, first, attn = ctx.par_single, ctx.first_joint, self.attn
        residual = hidden_states
        # 1. Input normalization
        mod = self.norm(par, ctx.temb_act)
        tr = self.norm(par, ctx.tr_act) if first is not None else [None] * 3
        shift_msa, scale_msa, gate = (modulate_rows(m, first, t) for m, t in zip(mod, tr))
        norm_hidden_states = nn.layer_norm(hidden_states, eps=EPS) * (1 + scale_msa) + shift_msa
        # q|k|v|mlp share one column-parallel group (one all-gather ring under SP)
        par.local_heads(attn.heads)  # a clear error if the heads do not divide over the ranks
        q, k, v, mlp_hidden_states = nn.column(par, norm_hidden_states,
                                               [attn.to_q, attn.to_k, attn.to_v, self.proj_mlp],
                                               [None, None, None, nn.gelu_tanh])
        hd = attn.head_dim
        # 2. Attention: per-head RMSNorm, RoPE on the image rows only (identity on text rows)
        q = apply_rope(nn.rms_norm(heads_of(q, hd), attn.norm_q.scale[...], EPS), *ctx.rope_joint, ctx.split_rope)
        k = apply_rope(nn.rms_norm(heads_of(k, hd), attn.norm_k.scale[...], EPS), *ctx.rope_joint, ctx.split_rope)
        attn_output = flat(_attend(par, q, k, heads_of(v, hd), ctx.key_mask))
        # 3. Modulation and residual connection: proj_out(cat[attn, mlp]) as one row-parallel output
        proj = self.proj_out(par, attn_output, mlp_hidden_states)
        return gate * proj + residual


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
    single_sp: bool  # single blocks on a joint-sequence chunk per rank (SP only)

    @property
    def n_joint(self) -> int:
        return self.n_img_pad + self.n_txt_pad


def joint_key_mask(encoder_attention_mask, geom: Geometry):
    """`[B, N]` keys of the joint `[image | image pad | text | text pad]` sequence to attend to.

    As diffusers: `position < N_img + sum(text_mask)`, i.e. built from the count
    of valid text tokens (right padding assumed; holes in the mask are not
    honoured here, only in the refiner). The image rows padded in for SP and the
    text rows padded in (beyond the count) are never keys.
    """
    count = encoder_attention_mask.astype(jnp.int32).sum(axis=1)
    pos = jnp.arange(geom.n_joint)[None, :]
    return (pos < geom.n_img) | ((pos >= geom.n_img_pad) & (pos < geom.n_img_pad + count[:, None]))


def single_chunk_rows(par, n_joint: int):
    """This rank's contiguous rows of the joint sequence for the single blocks under SP:
    `[r * n/P, (r+1) * n/P)` with r = `par.rank()`, a runtime value (every rank one program)."""
    rows = n_joint // par.size
    return par.rank() * rows + jnp.arange(rows)


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
        self.transformer_blocks = nn.stacked(
            lambda r: HunyuanVideoTransformerBlock(c, dtype=dtype, rngs=r), c.num_layers, rngs)
        # 4. Single stream transformer blocks
        self.single_transformer_blocks = nn.stacked(
            lambda r: HunyuanVideoSingleTransformerBlock(c, dtype=dtype, rngs=r), c.num_single_layers, rngs)
        # 5. Output projection (AdaLayerNormContinuous: scale, shift)
        self.norm_out = AdaLinear(D, 2, dtype=dtype, rngs=rngs)
        self.proj_out = _linear(D, c.patch_volume * c.out_channels, dtype, rngs)

    def __call__(self, par, geom: Geometry, patches, timestep, encoder_hidden_states, encoder_attention_mask,
                 pooled_projections, guidance, freqs_cos, freqs_sin):
        """One forward inside the step.

        patches: `[B, n_img_pad, C*pt*p*p]` (this rank's rows under SP); timestep,
        guidance `(B,)` float32; encoder_hidden_states `[B, n_txt_pad, text_dim]`,
        encoder_attention_mask `[B, n_txt_pad]`, pooled_projections `[B, pooled_dim]`,
        freqs_cos, freqs_sin `[n_joint, head_dim]` float32 (`rope.joint_tables`)
        (replicated). Returns `[B, rows, pt*p*p*C_out]`: this rank's joint-sequence
        rows under SP, the image rows otherwise.
        """
        c = self.config
        P = par.size
        sp = par.seq_sharded
        single_sp = sp and geom.single_sp
        par_single = par if (single_sp or not sp) else dataclasses.replace(par, mode="tp")

        # 1. RoPE (image rows; identity on pad and text rows), split-halves order if loaded so
        rope_img = (freqs_cos[:geom.n_img_pad], freqs_sin[:geom.n_img_pad])
        rope_joint = (freqs_cos, freqs_sin)

        # 2. Conditional embeddings
        temb, token_replace_emb = self.time_text_embed(timestep, pooled_projections, guidance)
        hidden_states = self.x_embedder(patches)
        encoder_hidden_states = self.context_embedder(par, encoder_hidden_states, timestep, encoder_attention_mask)
        encoder_hidden_states = par.shard_rows(encoder_hidden_states)

        # 3. Joint key mask from the count of valid text tokens (assumes right padding, as diffusers)
        key_mask = joint_key_mask(encoder_attention_mask, geom)

        # first-frame rows (token_replace), from each rank's offset at run time
        first_img = first_joint = None
        if c.token_replace:
            first_tokens = geom.height * geom.width
            rows_img = hidden_states.shape[1]
            offset_img = par.rank() * rows_img if sp else 0
            first_img = offset_img + jnp.arange(rows_img) < first_tokens
            rows_joint = geom.n_joint // P if single_sp else geom.n_joint
            offset_joint = par.rank() * rows_joint if single_sp else 0
            first_joint = offset_joint + jnp.arange(rows_joint) < first_tokens

        ctx = Context(par=par, par_single=par_single, temb_act=jax.nn.silu(temb),
                      tr_act=None if token_replace_emb is None else jax.nn.silu(token_replace_emb),
                      key_mask=key_mask, rope_img=rope_img, rope_joint=rope_joint, first_img=first_img,
                      first_joint=first_joint, n_img=geom.n_img_pad, split_rope=c.split_rope)

        # 4. Transformer blocks
        hidden_states, encoder_hidden_states = nn.scan_blocks(
            self.transformer_blocks, (hidden_states, encoder_hidden_states),
            lambda blk, carry: blk(ctx, *carry))

        if single_sp:
            # all 40 single blocks on a contiguous chunk of [image | text]; the first one
            # cuts it with a gather by a per-rank row index (a runtime value)
            joint = jnp.concatenate([par.gather_rows(hidden_states), par.gather_rows(encoder_hidden_states)], 1)
            x = jnp.take(joint, single_chunk_rows(par, geom.n_joint), axis=1)
        else:
            x = jnp.concatenate([par.gather_rows(hidden_states), par.gather_rows(encoder_hidden_states)], 1)
        x = nn.scan_blocks(self.single_transformer_blocks, x, lambda blk, h: blk(ctx, h))
        if sp and not single_sp:
            x = par.shard_rows(x)
        elif not sp:
            x = x[:, :geom.n_img_pad]

        # 5. Output projection (on this rank's rows; the runner gathers and cuts eagerly)
        scale, shift = self.norm_out(par, ctx.temb_act)
        x = nn.layer_norm(x, eps=EPS) * (1 + scale)[:, None] + shift[:, None]
        return self.proj_out(x)


def build(config: HunyuanVideoConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> HunyuanVideoTransformer3DModel:
    """The model with random parameters (load real ones with `difflet_tpu.weights.load_transformer`)."""
    return HunyuanVideoTransformer3DModel(config, dtype=dtype, rngs=rngs)
