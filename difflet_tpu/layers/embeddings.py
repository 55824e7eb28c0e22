"""Timestep and text embeddings (diffusers `embeddings.py`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu.layers import nn

from .feedforward import gelu_tanh

# torch's float32 `exp(-ln(1e4) * i / 128)`, i < 128, bit for bit (the CPU torch that made
# tests/fixtures): within an ulp of the correctly rounded values, one ulp above them at
# i = 12 and i = 106 (tests/test_layers.py). See `get_timestep_embedding`.
_TORCH_FREQS_128 = np.array([
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


def timestep_frequencies(half: int, max_period: float = 10000.0) -> np.ndarray:
    """float32 `exp(-ln(max_period) * arange(half) / half)`: torch's bits for the
    256-channel sinusoid, correctly rounded for other sizes (host constants)."""
    if half == 128 and max_period == 10000.0:
        return _TORCH_FREQS_128
    exponent = (np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32)) / np.float32(half)
    return np.exp(exponent.astype(np.float64)).astype(np.float32)


def get_timestep_embedding(timesteps, embedding_dim: int = 256):
    """diffusers' `get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=True,
    downscale_freq_shift=0)` (`Timesteps` of every port): `[..., embedding_dim]` = [cos, sin].

    One policy for torch's float32 rounding, for every port:

    * float32 whatever the model dtype, as diffusers (`timesteps[:, None].float()`);
    * the frequencies are host constants with torch's float32 `exp` bits
      (`timestep_frequencies`). torch's CPU `exp` is not correctly rounded and
      no formula here reproduces it (the correctly rounded values, numpy's
      float32 `exp` and XLA's differ from it at 2, 55 and 17 of the 128), and one
      ulp matters: guidance 6000 (HunyuanVideo) turns it into ~2e-4 rad, which
      moves that fixture's output by 1.4e-5 relative; with torch's bits every
      port's fixtures are at the float32 floor (~5e-7);
    * `t * f` in float32 (IEEE: the same products as torch), then cos and sin in
      float32 by XLA (within an ulp of torch's on CPU).

    Runs inside the step or eagerly on host arrays (FLUX's `timestep_proj`).
    """
    freqs = timestep_frequencies(embedding_dim // 2)
    emb = jnp.asarray(timesteps).astype(jnp.float32)[..., None] * freqs
    return jnp.concatenate([jnp.cos(emb), jnp.sin(emb)], axis=-1)


class TimestepEmbedding(nnx.Module):
    """`linear_1`, SiLU, `linear_2` (replicated: a `(B, D)` embedding)."""

    def __init__(self, in_channels: int, time_embed_dim: int, *, dtype, rngs: nnx.Rngs):
        self.linear_1 = nn.Linear(in_channels, time_embed_dim, dtype=dtype, rngs=rngs)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim, dtype=dtype, rngs=rngs)

    def __call__(self, sample):
        return self.linear_2(jax.nn.silu(self.linear_1(sample)))


class PixArtAlphaTextProjection(nnx.Module):
    """`linear_1`, activation (`act_fn`: "gelu_tanh", diffusers' default, or "silu"), `linear_2`."""

    def __init__(self, in_features: int, hidden_size: int, *, act_fn: str = "gelu_tanh", dtype, rngs: nnx.Rngs):
        if act_fn not in ("gelu_tanh", "silu"):
            raise ValueError(f"act_fn must be 'gelu_tanh' or 'silu', got {act_fn!r}")
        self.act_fn = act_fn
        self.linear_1 = nn.Linear(in_features, hidden_size, dtype=dtype, rngs=rngs)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, dtype=dtype, rngs=rngs)

    def _act(self, x):
        return gelu_tanh(x) if self.act_fn == "gelu_tanh" else jax.nn.silu(x)

    def __call__(self, caption):
        """On every rank's full (replicated) weights."""
        return self.linear_2(self._act(self.linear_1(caption)))

    def parallel(self, par, caption):
        """`linear_1` column-parallel, `linear_2` row-parallel (Wan's PLAN) on rows every
        rank holds (the text): local columns, then the partial sums all-reduced in
        float32 (a psum under SP too: the text is never sequence-sharded)."""
        h = self._act(self.linear_1(caption))
        y = jnp.matmul(h, self.linear_2.kernel[...], preferred_element_type=nn.fp32(h.dtype))
        return self.linear_2.add_bias(par.sum_over_ranks(y).astype(h.dtype))


class CombinedTimestepTextProjEmbeddings(nnx.Module):
    """`timestep_embedder(sinusoid) + text_embedder(pooled)` (FLUX.1-schnell's
    `time_text_embed`, HunyuanVideo's token refiner's)."""

    def __init__(self, embedding_dim: int, pooled_projection_dim: int, *, dtype, rngs: nnx.Rngs):
        self.timestep_embedder = TimestepEmbedding(256, embedding_dim, dtype=dtype, rngs=rngs)
        self.text_embedder = PixArtAlphaTextProjection(pooled_projection_dim, embedding_dim, act_fn="silu",
                                                       dtype=dtype, rngs=rngs)

    def __call__(self, timesteps_proj, pooled_projection):
        """timesteps_proj: `get_timestep_embedding` of the timestep, `[B, 256]`."""
        timesteps_emb = self.timestep_embedder(timesteps_proj.astype(pooled_projection.dtype))
        return timesteps_emb + self.text_embedder(pooled_projection)
