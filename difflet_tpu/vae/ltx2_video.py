"""LTX-2's video VAE decoder (diffusers `AutoencoderKLLTX2Video`, `models/autoencoders/
autoencoder_kl_ltx2.py`, 0.42.1, the class `LTX2Pipeline` uses) in JAX, channels-last (NTHWC).

Reads top to bottom like diffusers' `LTX2VideoDecoder3d`: `conv_in`, `mid_block` (resnets),
`up_blocks` (an optional `conv_in` resnet, a depth-to-space upsampler with its residual, resnets),
`norm_out` (per-channel RMS), SiLU, `conv_out`, then the 4 x 4 spatial patches unfolded.

* `LTX2VideoCausalConv3d`: time padded by repeating the first frame `k - 1` times (causal) or the
  first and last frames `(k - 1) / 2` times each (non-causal; the decoder's `is_causal`, which
  `decode(z)` uses since the pipeline passes no `causal`), spatial padding "zeros" or "reflect"
  (the released decoder's `decoder_spatial_padding_mode`).
* The resnet: `PerChannelRMSNorm` (x / sqrt(mean_c(x^2) + 1e-8), no weight), SiLU, conv, twice; a
  LayerNorm + 1x1x1 `nn.Conv3d` shortcut when the width changes.
* The upsampler: conv to `C * prod(stride) / upscale_factor`, depth-to-space, the first
  `stride_t - 1` frames dropped; with `upsample_residual` the input's own depth-to-space, tiled over
  channels, is added.

Not implemented (refused by name at load): `timestep_conditioning` (the decoder's timestep
embedding, `decode_timestep`), `decoder_inject_noise`, and the encoder (the text-to-video pipeline
never encodes). Parameters replicated on a mesh; the batch is sharded over it when it divides,
else each video's rows (or columns) are spread over its devices (`spread.py`: one-row halos
before every 3x3x3 conv, reflected at the image's edges as `reflect` pads; the norms, the
depth-to-space upsamplers and the unpatchify act per pixel; exact). No attention, no norm over
positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu.vae import loading
from difflet_tpu.vae import spread as vae_spread
from difflet_tpu.vae.layers import fp32, param, silu


@dataclass(frozen=True)
class LTX2VideoVAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    decoder_block_out_channels: tuple = (256, 512, 1024)
    decoder_layers_per_block: tuple = (5, 5, 5, 5)
    decoder_spatio_temporal_scaling: tuple | bool = (True, True, True)
    decoder_inject_noise: tuple | bool = (False, False, False, False)
    upsample_type: tuple = ("spatiotemporal", "spatiotemporal", "spatiotemporal")
    upsample_residual: tuple | bool = (True, True, True)
    upsample_factor: tuple = (2, 2, 2)
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    decoder_causal: bool = True
    decoder_spatial_padding_mode: str = "reflect"
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    # encoder fields the decoder does not read
    ENCODER_FIELDS = ("block_out_channels", "down_block_types", "layers_per_block", "spatio_temporal_scaling",
                      "downsample_type", "encoder_causal", "encoder_spatial_padding_mode")

    def __post_init__(self):
        n = len(self.decoder_layers_per_block)
        noise = self.decoder_inject_noise
        if self.timestep_conditioning:
            raise ValueError("AutoencoderKLLTX2Video: timestep_conditioning=True (the decoder's timestep embedding, "
                             "decode_timestep) is not implemented")
        if any((noise,) if isinstance(noise, bool) else noise):
            raise ValueError("AutoencoderKLLTX2Video: decoder_inject_noise is not implemented")
        if self.decoder_spatial_padding_mode not in ("zeros", "reflect"):
            raise ValueError(f"AutoencoderKLLTX2Video: decoder_spatial_padding_mode "
                             f"{self.decoder_spatial_padding_mode!r} is not implemented (zeros, reflect)")
        for name in ("decoder_block_out_channels", "upsample_type", "upsample_factor"):
            if len(getattr(self, name)) != n - 1:
                raise ValueError(f"AutoencoderKLLTX2Video: {name} needs {n - 1} entries (one per up block)")

    @classmethod
    def from_dict(cls, d: dict) -> "LTX2VideoVAEConfig":
        known = {f.name for f in fields(cls)} | set(cls.ENCODER_FIELDS)
        kw = loading.config_fields(d, known, "AutoencoderKLLTX2Video")
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in kw.items() if k not in cls.ENCODER_FIELDS}
        return cls(**kw)

    def per_block(self, name, count):
        v = getattr(self, name)
        return (v,) * count if isinstance(v, bool) else tuple(v)

    @property
    def spatial_ratio(self) -> int:
        return self.spatial_compression_ratio or self.patch_size * 2 ** sum(
            t in ("spatial", "spatiotemporal") for t, on in zip(self.upsample_type, self.per_block(
                "decoder_spatio_temporal_scaling", len(self.upsample_type))) if on)

    @property
    def temporal_ratio(self) -> int:
        return self.temporal_compression_ratio or self.patch_size_t * 2 ** sum(
            t in ("temporal", "spatiotemporal") for t, on in zip(self.upsample_type, self.per_block(
                "decoder_spatio_temporal_scaling", len(self.upsample_type))) if on)


CLASS_NAME = "AutoencoderKLLTX2Video"


def per_channel_rms_norm(x, eps=1e-8):
    xf = x.astype(fp32(x.dtype))
    return (xf / jnp.sqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)).astype(x.dtype)


class Conv3d(nnx.Module):
    """torch `nn.Conv3d` (stride 1, no padding) on NTHWC; kernel `[kt, kh, kw, in, out]`."""

    def __init__(self, in_channels, out_channels, kernel_size, *, dtype, rngs):
        k = kernel_size
        self.kernel = param(rngs, (k, k, k, in_channels, out_channels), dtype, torch_leaf="weight",
                            torch_shape=(out_channels, in_channels, k, k, k), torch_layout="conv")
        self.bias = param(rngs, (out_channels,), dtype, torch_leaf="bias", torch_shape=(out_channels,),
                          torch_layout="same", init="zeros")

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(x, self.kernel[...].astype(x.dtype), (1, 1, 1), "VALID",
                                         dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                         preferred_element_type=fp32(x.dtype))
        return (y + self.bias[...].astype(y.dtype)).astype(x.dtype)


class LTX2VideoCausalConv3d(nnx.Module):
    def __init__(self, in_channels, out_channels, *, padding_mode, dtype, rngs, kernel_size=3):
        self.k, self.padding_mode = kernel_size, padding_mode
        self.conv = Conv3d(in_channels, out_channels, kernel_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, causal: bool):
        k = self.k
        if causal:
            x = jnp.concatenate([jnp.repeat(x[:, :1], k - 1, axis=1), x], axis=1)
        else:
            x = jnp.concatenate([jnp.repeat(x[:, :1], (k - 1) // 2, axis=1), x,
                                 jnp.repeat(x[:, -1:], (k - 1) // 2, axis=1)], axis=1)
        mode = "reflect" if self.padding_mode == "reflect" else "zeros"
        x, (ph, pw) = vae_spread.halo(x, k // 2, mode)  # in a spread decode: the neighbours' rows
        x = jnp.pad(x, ((0, 0), (0, 0), ph, pw, (0, 0)), mode="constant" if mode == "zeros" else mode)
        return self.conv(x)


class LayerNorm(nnx.Module):
    """torch `nn.LayerNorm(C)` over the channels (last axis), float32 statistics."""

    def __init__(self, dim, *, eps, dtype, rngs):
        self.eps = eps
        self.weight = param(rngs, (dim,), dtype, torch_leaf="weight", torch_shape=(dim,), torch_layout="same",
                            init="ones")
        self.bias = param(rngs, (dim,), dtype, torch_leaf="bias", torch_shape=(dim,), torch_layout="same",
                          init="zeros")

    def __call__(self, x):
        xf = x.astype(fp32(x.dtype))
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(y.dtype) + self.bias[...].astype(y.dtype)).astype(x.dtype)


class LTX2VideoResnetBlock3d(nnx.Module):
    def __init__(self, in_channels, out_channels, *, eps, padding_mode, dtype, rngs):
        kw = dict(padding_mode=padding_mode, dtype=dtype, rngs=rngs)
        self.conv1 = LTX2VideoCausalConv3d(in_channels, out_channels, **kw)
        self.conv2 = LTX2VideoCausalConv3d(out_channels, out_channels, **kw)
        changes = in_channels != out_channels
        self.norm3 = LayerNorm(in_channels, eps=eps, dtype=dtype, rngs=rngs) if changes else None
        self.conv_shortcut = Conv3d(in_channels, out_channels, 1, dtype=dtype, rngs=rngs) if changes else None

    def __call__(self, inputs, causal):
        h = self.conv1(silu(per_channel_rms_norm(inputs)), causal)
        h = self.conv2(silu(per_channel_rms_norm(h)), causal)
        if self.norm3 is not None:
            inputs = self.conv_shortcut(self.norm3(inputs))
        return h + inputs


def depth_to_space(x, stride):
    """NTHWC `[B, T, H, W, C' * st * sh * sw]` (channel = ((c' * st + a) * sh + b) * sw + d, diffusers'
    unflatten order) -> `[B, T * st, H * sh, W * sw, C']`."""
    b, t, h, w, c = x.shape
    st, sh, sw = stride
    x = x.reshape(b, t, h, w, c // (st * sh * sw), st, sh, sw)
    x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, t * st, h * sh, w * sw, -1)


class LTX2VideoUpsampler3d(nnx.Module):
    def __init__(self, in_channels, stride, *, residual, upscale_factor, padding_mode, dtype, rngs):
        self.stride, self.residual, self.upscale_factor = stride, residual, upscale_factor
        out = in_channels * int(np.prod(stride)) // upscale_factor
        self.conv = LTX2VideoCausalConv3d(in_channels, out, padding_mode=padding_mode, dtype=dtype, rngs=rngs)

    def __call__(self, x, causal):
        drop = self.stride[0] - 1
        h = depth_to_space(self.conv(x, causal), self.stride)[:, drop:]
        if self.residual:
            r = depth_to_space(x, self.stride)
            r = jnp.tile(r, (1, 1, 1, 1, int(np.prod(self.stride)) // self.upscale_factor))[:, drop:]
            h = h + r
        return h


class LTX2VideoMidBlock3d(nnx.Module):
    def __init__(self, channels, num_layers, *, eps, padding_mode, dtype, rngs):
        self.resnets = nnx.List([LTX2VideoResnetBlock3d(channels, channels, eps=eps, padding_mode=padding_mode,
                                                        dtype=dtype, rngs=rngs) for _ in range(num_layers)])

    def __call__(self, x, causal):
        for resnet in self.resnets:
            x = resnet(x, causal)
        return x


STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}


class LTX2VideoUpBlock3d(nnx.Module):
    def __init__(self, in_channels, out_channels, num_layers, *, scale, upsample_type, residual, upscale_factor, eps,
                 padding_mode, dtype, rngs):
        kw = dict(eps=eps, padding_mode=padding_mode, dtype=dtype, rngs=rngs)
        self.conv_in = LTX2VideoResnetBlock3d(in_channels, out_channels, **kw) if in_channels != out_channels else None
        self.upsamplers = nnx.List([LTX2VideoUpsampler3d(
            out_channels * upscale_factor, STRIDES[upsample_type], residual=residual, upscale_factor=upscale_factor,
            padding_mode=padding_mode, dtype=dtype, rngs=rngs)]) if scale else None
        self.resnets = nnx.List([LTX2VideoResnetBlock3d(out_channels, out_channels, **kw) for _ in range(num_layers)])

    def __call__(self, x, causal):
        if self.conv_in is not None:
            x = self.conv_in(x, causal)
        for up in self.upsamplers or ():
            x = up(x, causal)
        for resnet in self.resnets:
            x = resnet(x, causal)
        return x


class LTX2VideoDecoder3d(nnx.Module):
    def __init__(self, c: LTX2VideoVAEConfig, *, dtype, rngs):
        n = len(c.decoder_layers_per_block)
        block_out = tuple(reversed(c.decoder_block_out_channels))
        scaling = tuple(reversed(c.per_block("decoder_spatio_temporal_scaling", n - 1)))
        layers = tuple(reversed(c.decoder_layers_per_block))
        residual = tuple(reversed(c.per_block("upsample_residual", n - 1)))
        factor = tuple(reversed(c.upsample_factor))
        upsample_type = tuple(c.upsample_type)  # diffusers does not reverse it
        self.causal, self.patch_size, self.patch_size_t = c.decoder_causal, c.patch_size, c.patch_size_t
        kw = dict(padding_mode=c.decoder_spatial_padding_mode, dtype=dtype, rngs=rngs)
        out = block_out[0]
        self.conv_in = LTX2VideoCausalConv3d(c.latent_channels, out, **kw)
        self.mid_block = LTX2VideoMidBlock3d(out, layers[0], eps=c.resnet_norm_eps, **kw)
        blocks = []
        for i in range(len(block_out)):
            inp, out = out // factor[i], block_out[i] // factor[i]
            blocks.append(LTX2VideoUpBlock3d(inp, out, layers[i + 1], scale=scaling[i], upsample_type=upsample_type[i],
                                             residual=residual[i], upscale_factor=factor[i], eps=c.resnet_norm_eps,
                                             **kw))
        self.up_blocks = nnx.List(blocks)
        self.conv_out = LTX2VideoCausalConv3d(out, c.out_channels * c.patch_size ** 2, **kw)

    def __call__(self, x):
        causal = self.causal
        x = self.mid_block(self.conv_in(x, causal), causal)
        for block in self.up_blocks:
            x = block(x, causal)
        x = self.conv_out(silu(per_channel_rms_norm(x)), causal)
        # unpatchify: channel = ((c * p_t + t) * p + pw) * p + ph (diffusers' permute puts the 4th
        # factor on the height, the 3rd on the width)
        b, t, h, w, ch = x.shape
        p, pt = self.patch_size, self.patch_size_t
        x = x.reshape(b, t, h, w, ch // (pt * p * p), pt, p, p)
        x = x.transpose(0, 1, 5, 2, 7, 3, 6, 4)
        return x.reshape(b, t * pt, h * p, w * p, -1)


class AutoencoderKLLTX2Video(nnx.Module):
    """`model(z)`: diffusers `vae.decode(z).sample` (NCTHW in and out, not clamped);
    `model.decode_video(latents)`: LTX2Pipeline's decode of denoised latents (denormalised by
    `latents_mean` / `latents_std` / `scaling_factor`, decoded; float32 NCTHW), jitted."""

    CLASS_NAMES = (CLASS_NAME,)

    def __init__(self, config: LTX2VideoVAEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = config
        self.dtype = loading.check_dtype(dtype)
        self.mesh = None
        self.decoder = LTX2VideoDecoder3d(config, dtype=self.dtype, rngs=rngs)
        ch = config.latent_channels
        self.latents_mean = param(rngs, (ch,), self.dtype, torch_leaf="latents_mean", torch_shape=(ch,),
                                  torch_layout="same", init="zeros")
        self.latents_std = param(rngs, (ch,), self.dtype, torch_leaf="latents_std", torch_shape=(ch,),
                                 torch_layout="same", init="ones")

    @classmethod
    def from_pretrained(cls, folder, *, dtype=jnp.bfloat16, mesh=None, strict: bool = True):
        return loading.from_pretrained(cls, LTX2VideoVAEConfig, folder, dtype=dtype, mesh=mesh, strict=strict)

    @property
    def spatial_compression_ratio(self) -> int:
        return self.config.spatial_ratio

    @property
    def temporal_compression_ratio(self) -> int:
        return self.config.temporal_ratio

    def check_latents(self, z):
        loading.check_latents(z, self.config.latent_channels, ("frames", "height", "width"), "NCTHW")

    def __call__(self, z):
        self.check_latents(z)
        x = self.decoder(jnp.transpose(z, (0, 2, 3, 4, 1)).astype(self.dtype))
        return jnp.transpose(x, (0, 4, 1, 2, 3))

    def denormalize(self, latents):
        """LTX2Pipeline `_denormalize_latents`: `latents * std / scaling_factor + mean` per channel."""
        shape = (1, -1, 1, 1, 1)
        mean = self.latents_mean[...].astype(jnp.float32).reshape(shape)
        std = self.latents_std[...].astype(jnp.float32).reshape(shape)
        return latents.astype(jnp.float32) * std / self.config.scaling_factor + mean

    def decode_video_latents(self, latents, spread_axis: str | None = None):
        return vae_spread.apply(self, self.denormalize(latents), spread_axis)

    def spread_axis(self, shape, spread: str | None = None, axis: str | None = None) -> str | None:
        """The axis a decode of latents of `shape` splits over the mesh (`vae_spread.choose`), or None."""
        return vae_spread.choose(self.mesh, shape, spread, axis)

    def decode_video(self, latents, *, spread: str | None = None, axis: str | None = None, uint8: bool = False):
        """`[B, C, T, h, w]` -> float32 `[B, 3, 1 + r_t (T - 1), r_s h, r_s w]` (not clamped; the
        pipeline's postprocess clamps); `uint8`: `[B, F, H, W, 3]` uint8 frames (`loading.to_uint8`,
        clamped as the postprocess), converted on the devices. On a mesh of several devices that
        do not divide the batch, each video's rows are spread over them (`spread` / `axis`:
        `vae_spread.choose`; exact, not tiled)."""
        self.check_latents(latents)
        return loading.call_decode(self, "decode_video_latents", latents, spread=spread, axis=axis, uint8=uint8)
