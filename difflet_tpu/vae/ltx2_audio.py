"""LTX-2's audio VAE decoder (diffusers `AutoencoderKLLTX2Audio`, `models/autoencoders/
autoencoder_kl_ltx2_audio.py`, 0.42.1) in JAX, channels-last: latent spectrogram `[B, C, L, M]`
-> mel spectrogram `[B, output_channels, T, mel_bins]`, which the vocoder turns into a waveform.

Reads top to bottom like diffusers' `LTX2AudioDecoder`: `conv_in`, `mid.block_1`, `mid.block_2`,
the `up` levels from the deepest (each `num_res_blocks + 1` resnets, then a nearest 2x upsample
and a conv, whose first row along the causal axis is dropped), `norm_out`, SiLU, `conv_out`, then
the crop / zero-pad to `T = 4 L - 3` (causal) or `4 L` frames and `mel_bins` bins.

`LTX2AudioCausalConv2d` pads the causal axis ("height": time, "width": mel) only in front, the
other axis symmetrically; "none" pads both symmetrically. Norms: "pixel" (x / sqrt(mean_c(x^2) +
1e-6), the released model) or "group" (GroupNorm(32)). Resnets change width with a 1x1
`nin_shortcut`.

Not implemented (refused by name at load): attention blocks (`attn_resolutions`,
`mid_block_add_attention`: off in the released model) and the encoder. Parameters replicated on a
mesh; the batch is sharded over it when it divides.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import jax.numpy as jnp
from flax import nnx

from difflet_tpu.vae import loading
from difflet_tpu.vae.layers import GroupNorm, conv2d, fp32, param, silu

LATENT_DOWNSAMPLE_FACTOR = 4
CLASS_NAME = "AutoencoderKLLTX2Audio"


@dataclass(frozen=True)
class LTX2AudioVAEConfig:
    base_channels: int = 128
    output_channels: int = 2
    ch_mult: tuple = (1, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple | None = None
    in_channels: int = 2
    resolution: int = 256
    latent_channels: int = 8
    norm_type: str = "pixel"
    causality_axis: str | None = "height"
    dropout: float = 0.0
    mid_block_add_attention: bool = False
    sample_rate: int = 16000
    mel_hop_length: int = 160
    is_causal: bool = True
    mel_bins: int | None = 64
    double_z: bool = True

    def __post_init__(self):
        if self.attn_resolutions or self.mid_block_add_attention:
            raise ValueError("AutoencoderKLLTX2Audio: attention blocks (attn_resolutions, mid_block_add_attention) "
                             "are not implemented")
        if self.norm_type not in ("pixel", "group"):
            raise ValueError(f"AutoencoderKLLTX2Audio: norm_type {self.norm_type!r} is not 'pixel' or 'group'")
        if self.causality_axis not in (None, "none", "height", "width"):
            raise ValueError(f"AutoencoderKLLTX2Audio: causality_axis {self.causality_axis!r} is not implemented "
                             "(none, height, width)")

    @classmethod
    def from_dict(cls, d: dict) -> "LTX2AudioVAEConfig":
        kw = loading.config_fields(d, {f.name for f in fields(cls)}, CLASS_NAME)
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in kw.items()})


def pad_for(kernel: int, axis: str | None):
    """((top, bottom), (left, right)) of diffusers' `LTX2AudioCausalConv2d` for a square kernel
    (None: a plain `nn.Conv2d` with padding k // 2)."""
    p = kernel - 1
    sym = (p // 2, p - p // 2)
    if axis == "height":
        return (p, 0), sym
    if axis == "width":
        return sym, (p, 0)
    return sym, sym


class Conv2d(nnx.Module):
    """`LTX2AudioCausalConv2d` (its `conv` child) or a plain `nn.Conv2d`, NHWC."""

    def __init__(self, in_channels, out_channels, kernel, *, causality_axis, dtype, rngs):
        self.pad = pad_for(kernel, causality_axis)
        self.wrapped = causality_axis is not None  # diffusers' key has `.conv.` then
        conv = _Conv(in_channels, out_channels, kernel, dtype=dtype, rngs=rngs)
        if self.wrapped:
            self.conv = conv
        else:
            self.kernel, self.bias = conv.kernel, conv.bias

    def __call__(self, x):
        conv = self.conv if self.wrapped else self
        return conv2d(jnp.pad(x, ((0, 0), self.pad[0], self.pad[1], (0, 0))), conv.kernel[...], conv.bias[...], 0)


class _Conv(nnx.Module):
    def __init__(self, in_channels, out_channels, k, *, dtype, rngs):
        self.kernel = param(rngs, (k, k, in_channels, out_channels), dtype, torch_leaf="weight",
                            torch_shape=(out_channels, in_channels, k, k), torch_layout="conv")
        self.bias = param(rngs, (out_channels,), dtype, torch_leaf="bias", torch_shape=(out_channels,),
                          torch_layout="same", init="zeros")


class PixelNorm(nnx.Module):
    def __call__(self, x):
        xf = x.astype(fp32(x.dtype))
        return (xf / jnp.sqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + 1e-6)).astype(x.dtype)


def norm(c: LTX2AudioVAEConfig, channels, dtype, rngs):
    return PixelNorm() if c.norm_type == "pixel" else GroupNorm(32, channels, eps=1e-6, dtype=dtype, rngs=rngs)


class LTX2AudioResnetBlock(nnx.Module):
    def __init__(self, c: LTX2AudioVAEConfig, in_channels, out_channels, *, dtype, rngs):
        kw = dict(causality_axis=c.causality_axis, dtype=dtype, rngs=rngs)
        self.norm1 = norm(c, in_channels, dtype, rngs)
        self.conv1 = Conv2d(in_channels, out_channels, 3, **kw)
        self.norm2 = norm(c, out_channels, dtype, rngs)
        self.conv2 = Conv2d(out_channels, out_channels, 3, **kw)
        self.nin_shortcut = Conv2d(in_channels, out_channels, 1, **kw) if in_channels != out_channels else None

    def __call__(self, x):
        h = self.conv1(silu(self.norm1(x)))
        h = self.conv2(silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class LTX2AudioUpsample(nnx.Module):
    def __init__(self, c: LTX2AudioVAEConfig, channels, *, dtype, rngs):
        self.axis = c.causality_axis
        self.conv = Conv2d(channels, channels, 3, causality_axis=c.causality_axis, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        b, h, w, ch = x.shape
        x = jnp.broadcast_to(x[:, :, None, :, None], (b, h, 2, w, 2, ch)).reshape(b, 2 * h, 2 * w, ch)
        x = self.conv(x)
        if self.axis == "height":
            return x[:, 1:]
        if self.axis == "width":
            return x[:, :, 1:]
        return x


class Stage(nnx.Module):
    def __init__(self, blocks, upsample):
        self.block = nnx.List(blocks)
        self.upsample = upsample


class Mid(nnx.Module):
    def __init__(self, c, channels, *, dtype, rngs):
        self.block_1 = LTX2AudioResnetBlock(c, channels, channels, dtype=dtype, rngs=rngs)
        self.block_2 = LTX2AudioResnetBlock(c, channels, channels, dtype=dtype, rngs=rngs)


class LTX2AudioDecoder(nnx.Module):
    def __init__(self, c: LTX2AudioVAEConfig, *, dtype, rngs):
        self.config = c
        kw = dict(dtype=dtype, rngs=rngs)
        block_in = c.base_channels * c.ch_mult[-1]
        self.conv_in = Conv2d(c.latent_channels, block_in, 3, causality_axis=c.causality_axis, **kw)
        self.mid = Mid(c, block_in, **kw)
        stages = [None] * len(c.ch_mult)
        for level in reversed(range(len(c.ch_mult))):
            block_out = c.base_channels * c.ch_mult[level]
            blocks = []
            for _ in range(c.num_res_blocks + 1):
                blocks.append(LTX2AudioResnetBlock(c, block_in, block_out, **kw))
                block_in = block_out
            stages[level] = Stage(blocks, LTX2AudioUpsample(c, block_in, **kw) if level != 0 else None)
        self.up = nnx.List(stages)
        self.norm_out = norm(c, block_in, dtype, rngs)
        self.conv_out = Conv2d(block_in, c.output_channels, 3, causality_axis=c.causality_axis, **kw)

    def __call__(self, x):
        """NHWC `[B, L, M, C]` -> `[B, T, mel_bins, output_channels]`."""
        c = self.config
        frames, mel = x.shape[1], x.shape[2]
        target_t = frames * LATENT_DOWNSAMPLE_FACTOR
        if c.causality_axis is not None:
            target_t = max(target_t - (LATENT_DOWNSAMPLE_FACTOR - 1), 1)
        target_f = c.mel_bins if c.mel_bins is not None else mel
        h = self.conv_in(x)
        h = self.mid.block_2(self.mid.block_1(h))
        for level in reversed(range(len(c.ch_mult))):
            stage = self.up[level]
            for block in stage.block:
                h = block(h)
            if stage.upsample is not None:
                h = stage.upsample(h)
        h = self.conv_out(silu(self.norm_out(h)))[:, :target_t, :target_f]
        return jnp.pad(h, ((0, 0), (0, target_t - h.shape[1]), (0, target_f - h.shape[2]), (0, 0)))


class AutoencoderKLLTX2Audio(nnx.Module):
    """`model(z)`: diffusers `audio_vae.decode(z).sample` (NCHW `[B, C, L, M]` in, `[B, out, T, mel]`
    out); `model.decode_audio(latents)`: LTX2Pipeline's decode of the denoised packed audio
    latents `[B, L, C * M]` (denormalised by `latents_mean` / `latents_std`, unpacked to
    `[B, C, L, M]`, decoded; float32), jitted."""

    CLASS_NAMES = (CLASS_NAME,)

    def __init__(self, config: LTX2AudioVAEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = config
        self.dtype = loading.check_dtype(dtype)
        self.mesh = None
        self.decoder = LTX2AudioDecoder(config, dtype=self.dtype, rngs=rngs)
        ch = config.base_channels
        self.latents_mean = param(rngs, (ch,), self.dtype, torch_leaf="latents_mean", torch_shape=(ch,),
                                  torch_layout="same", init="zeros")
        self.latents_std = param(rngs, (ch,), self.dtype, torch_leaf="latents_std", torch_shape=(ch,),
                                 torch_layout="same", init="ones")

    @classmethod
    def from_pretrained(cls, folder, *, dtype=jnp.bfloat16, mesh=None, strict: bool = True):
        return loading.from_pretrained(cls, LTX2AudioVAEConfig, folder, dtype=dtype, mesh=mesh, strict=strict)

    temporal_compression_ratio = LATENT_DOWNSAMPLE_FACTOR
    mel_compression_ratio = LATENT_DOWNSAMPLE_FACTOR

    def __call__(self, z):
        loading.check_latents(z, self.config.latent_channels, ("frames", "mel_bins"), "NCHW")
        y = self.decoder(jnp.transpose(z, (0, 2, 3, 1)).astype(self.dtype))
        return jnp.transpose(y, (0, 3, 1, 2))

    def unpack_and_decode(self, latents):
        b, length, features = latents.shape
        mean = self.latents_mean[...].astype(jnp.float32)
        std = self.latents_std[...].astype(jnp.float32)
        z = latents.astype(jnp.float32) * std + mean
        # LTX2Pipeline `_unpack_audio_latents` without patches: [B, L, C * M] -> [B, C, L, M]
        z = z.reshape(b, length, self.config.latent_channels, -1).transpose(0, 2, 1, 3)
        return self(z)

    def decode_audio(self, latents):
        """Packed `[B, L, latent_channels * M]` (M = mel_bins / 4) -> float32 mel `[B, out, T, mel_bins]`."""
        shape = tuple(getattr(latents, "shape", ()))
        want = self.config.base_channels
        if len(shape) != 3 or shape[2] != want or shape[2] % self.config.latent_channels:
            raise ValueError(f"audio latents: shape {shape}, expected packed [batch, frames, {want}] "
                             f"(latent_channels x latent mel bins, the size of latents_mean)")
        return loading.call_jitted(self, "unpack_and_decode", latents, self.mesh)
