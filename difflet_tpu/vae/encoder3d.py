"""The causal-3D VAE family's encoder half (Wan 2.1, Qwen-Image, Wan 2.2): video -> latent mean.

Follows diffusers `models/autoencoders/autoencoder_kl_wan.py` (`WanEncoder3d`,
`WanResidualDownBlock`, `AvgDown3D`, `WanResample`'s downsample modes, `patchify`,
`AutoencoderKLWan._encode`) and `autoencoder_kl_qwenimage.py` (`QwenImageEncoder3d`, the
same layout as Wan 2.1's); the blocks it shares with the decoder (`CausalConv3d`,
`ResidualBlock`, `MidBlock`, `RMSNorm`, `FeatCache`) come from `causal3d.py`.

    video -> patchify (Wan 2.2) -> conv_in -> down_blocks -> mid_block (resnet, attention, resnet)
      -> RMS norm -> SiLU -> conv_out (2 z_dim channels) -> quant_conv (1x1x1) -> mean | logvar

- Wan 2.1 / Qwen-Image: per level `num_res_blocks` residual blocks, then a `Resample`
  but after the last level.
- Wan 2.2 (`is_residual`): per level a `ResidualDownBlock` (residual blocks, the
  resample) plus the parameter-free `AvgDown3D` shortcut of the block's input.
- `downsample2d`: zero pad right and bottom by one, 3x3 conv with stride 2, per frame;
  `downsample3d`: the same, then a (3, 1, 1) time conv with stride 2 over the chunk's
  frames after the chunk before's last one, skipped on the first chunk (frame 0 stays
  one frame).

Frame chunks as diffusers' `_encode`: frame 0 alone, then chunks of 4 frames, each with
the `FeatCache` of the chunk before; the 4-frame chunks run under `lax.scan`, so the
activations held are a chunk's, not the clip's. With two temporal downsamples
(`temperal_downsample` [False, True, True]) `1 + 4 k` frames encode to `1 + k` latent
frames. `encode` returns the distribution's mean (`latent_dist.mean` = `.mode()`, what
the image-to-video pipelines take with `sample_mode="argmax"`).

Layout: channels-last inside (`[B, T, H, W, C]`), diffusers' NCTHW at the boundary.

Memory, compiled deviceless for v5e (one video per chip, parameters replicated,
bfloat16): Wan 2.1's published config at 81 x 480 x 832 (Wan2.1 / Wan2.2-A14B I2V's
condition video) 4.38 GiB per chip (4.08 GiB temporaries; float32, as the diffusers
examples load the Wan VAE: 5.00 GiB, 4.40 GiB temporaries); Wan2.2-TI2V-5B's one
704 x 1280 frame 0.94 GiB (0.65 GiB temporaries). Estimates: not measured on a TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.vae.causal3d import Causal3DConfig, CausalConv3d, FeatCache, MidBlock, ResidualBlock
from difflet_tpu.vae.layers import Conv2d, RMSNorm, fp32, param, silu

CHUNK_FRAMES = 4  # frames per chunk after the first (diffusers' `_encode`)


def spatial_factor(config: Causal3DConfig) -> int:
    """Pixels per latent pixel: 2 per downsampling level, times the patch size (8 for
    Wan 2.1 / Qwen-Image, 16 for Wan 2.2)."""
    return 2 ** (len(config.dim_mult) - 1) * (config.patch_size or 1)


def video_channels(config: Causal3DConfig) -> int:
    """The video's channels: the encoder's `in_channels` before patchify."""
    return config.in_channels // (config.patch_size or 1) ** 2


def check_video(video, config: Causal3DConfig) -> None:
    """Refuse what `encode` cannot take: not `[B, C, 1 + 4k, H, W]` floating, H and W not
    multiples of the spatial factor."""
    shape = tuple(getattr(video, "shape", ()))
    c, s = video_channels(config), spatial_factor(config)
    if len(shape) != 5 or shape[1] != c or 0 in shape:
        raise ValueError(f"video: shape {shape}, expected [batch, {c}, frames, height, width] (NCTHW)")
    if not jnp.issubdtype(video.dtype, jnp.floating):
        raise ValueError(f"video: dtype {video.dtype}, expected a floating dtype (values in [-1, 1])")
    if (shape[2] - 1) % CHUNK_FRAMES:
        raise ValueError(f"video: {shape[2]} frames, expected 1 + {CHUNK_FRAMES} k (1, 5, 9, ...)")
    if shape[3] % s or shape[4] % s:
        raise ValueError(f"video: height {shape[3]} and width {shape[4]} must be multiples of {s}")


def patchify(x, patch_size: int | None):
    """diffusers `patchify` (Wan 2.2) on `[B, T, H, W, C]`: pixel `(h p + b, w p + a)` of
    channel c goes to channel `(c p + a) p + b` (the inverse of `causal3d.unpatchify`)."""
    if not patch_size or patch_size == 1:
        return x
    b, t, h, w, c = x.shape
    p = patch_size
    x = x.reshape(b, t, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, t, h // p, w // p, c * p * p)


class ZeroPad(nnx.Module):
    """`nn.ZeroPad2d((0, 1, 0, 1))`: one zero row below, one zero column right; no
    parameters (index 0 of the resample `Sequential`)."""

    def __call__(self, x):
        return jnp.pad(x, ((0, 0),) * (x.ndim - 3) + ((0, 1), (0, 1), (0, 0)))


class StridedConv2d(Conv2d):
    """`nn.Conv2d(dim, dim, 3, stride=(2, 2))`, no padding, per frame."""

    def __call__(self, x):
        lead = x.shape[:-3]
        x = x.reshape((-1,) + x.shape[-3:])
        y = jax.lax.conv_general_dilated(
            x, self.kernel[...].astype(x.dtype), window_strides=(2, 2), padding="VALID",
            dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=fp32(x.dtype))
        y = (y + self.bias[...].astype(y.dtype)).astype(x.dtype)
        return y.reshape(lead + y.shape[1:])


class TimeDownConv(nnx.Module):
    """The `downsample3d` `time_conv`: `WanCausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))`
    with no padding (the caller puts the chunk before's last frame in front)."""

    def __init__(self, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.kernel = param(rngs, (3, 1, 1, dim, dim), dtype, torch_leaf="weight", torch_shape=(dim, dim, 3, 1, 1),
                            torch_layout="conv")
        self.bias = param(rngs, (dim,), dtype, torch_leaf="bias", torch_shape=(dim,), torch_layout="same",
                          init="zeros")

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(
            x, self.kernel[...].astype(x.dtype), window_strides=(2, 1, 1), padding="VALID",
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), preferred_element_type=fp32(x.dtype))
        return (y + self.bias[...].astype(y.dtype)).astype(x.dtype)


class Downsample(nnx.Module):
    """diffusers `WanResample` / `QwenImageResample`, the encoder's modes: `resample` =
    [zero pad, strided 3x3 conv] per frame; `downsample3d` then halves the frames with
    `time_conv` over [the chunk before's last frame, this chunk], skipped on the first
    chunk (diffusers caches that chunk's frames and keeps them)."""

    def __init__(self, dim: int, mode: str, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        if mode not in ("downsample2d", "downsample3d"):
            raise ValueError(f"Downsample: mode {mode!r} is not an encoder mode")
        kw = dict(dtype=dtype, rngs=rngs)
        self.resample = nnx.List([ZeroPad(), StridedConv2d(dim, dim, 3, **kw)])
        self.time_conv = TimeDownConv(dim, **kw) if mode == "downsample3d" else None

    def __call__(self, x, feat: FeatCache | None = None):
        for layer in self.resample:
            x = layer(x)
        if self.time_conv is not None and feat is not None:
            hist = feat.step(x)  # records this chunk's last frames (after the spatial part)
            if hist is not None:
                x = self.time_conv(jnp.concatenate([hist[:, -1:].astype(x.dtype), x], axis=1))
        return x


class AvgDown3D(nnx.Module):
    """diffusers `AvgDown3D` (Wan 2.2), no parameters: zeros in front to a multiple of
    `factor_t` frames, each `factor_t x factor_s x factor_s` neighbourhood read as channels
    `(c, t, h, w)`, then the mean over each group of `in * factor / out` consecutive ones."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int = 1):
        factor = factor_t * factor_s * factor_s
        if in_channels * factor % out_channels:
            raise ValueError(f"AvgDown3D: {in_channels} x {factor} is not a multiple of {out_channels}")
        self.out_channels, self.factor_t, self.factor_s = out_channels, factor_t, factor_s
        self.group_size = in_channels * factor // out_channels

    def __call__(self, x):
        ft, fs = self.factor_t, self.factor_s
        pad_t = -x.shape[1] % ft
        if pad_t:
            x = jnp.pad(x, ((0, 0), (pad_t, 0), (0, 0), (0, 0), (0, 0)))
        b, t, h, w, c = x.shape
        x = x.reshape(b, t // ft, ft, h // fs, fs, w // fs, fs, c).transpose(0, 1, 3, 5, 7, 2, 4, 6)
        x = x.reshape(b, t // ft, h // fs, w // fs, self.out_channels, self.group_size)
        return jnp.mean(x.astype(fp32(x.dtype)), axis=-1).astype(x.dtype)


class ResidualDownBlock(nnx.Module):
    """diffusers `WanResidualDownBlock` (Wan 2.2, `is_residual`): residual blocks, then
    `downsampler` (a `Downsample`) if the level downsamples, plus `avg_shortcut`
    (`AvgDown3D`) of the block's input."""

    def __init__(self, in_dim: int, out_dim: int, *, num_res_blocks: int, temperal_downsample: bool,
                 down_flag: bool, dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.avg_shortcut = AvgDown3D(in_dim, out_dim, factor_t=2 if temperal_downsample else 1,
                                      factor_s=2 if down_flag else 1)
        self.resnets = nnx.List([ResidualBlock(in_dim if i == 0 else out_dim, out_dim, **kw)
                                 for i in range(num_res_blocks)])
        mode = "downsample3d" if temperal_downsample else "downsample2d"
        self.downsampler = Downsample(out_dim, mode, **kw) if down_flag else None

    def __call__(self, x, feat: FeatCache | None = None):
        x_in = x
        for resnet in self.resnets:
            x = resnet(x, feat)
        if self.downsampler is not None:
            x = self.downsampler(x, feat)
        return x + self.avg_shortcut(x_in)


class Encoder3d(nnx.Module):
    """diffusers `WanEncoder3d` / `QwenImageEncoder3d` on one chunk of frames: `2 z_dim`
    output channels (mean | logvar)."""

    def __init__(self, config: Causal3DConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        if config.attn_scales:  # diffusers would insert attention blocks; no published config does
            raise ValueError(f"Encoder3d: attn_scales {list(config.attn_scales)} is not supported (only [])")
        kw = dict(dtype=dtype, rngs=rngs)
        mult = config.dim_mult
        dims = [config.base_dim * u for u in (1,) + mult]
        self.conv_in = CausalConv3d(config.in_channels, dims[0], 3, padding=1, **kw)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            down_flag = i != len(mult) - 1
            temporal = down_flag and config.temperal_downsample[i]
            if config.is_residual:  # Wan 2.2
                blocks.append(ResidualDownBlock(in_dim, out_dim, num_res_blocks=config.num_res_blocks,
                                                temperal_downsample=temporal, down_flag=down_flag, **kw))
                continue
            for j in range(config.num_res_blocks):  # Wan 2.1, Qwen-Image: a flat list
                blocks.append(ResidualBlock(in_dim if j == 0 else out_dim, out_dim, **kw))
            if down_flag:
                blocks.append(Downsample(out_dim, "downsample3d" if temporal else "downsample2d", **kw))
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(dims[-1], **kw)
        self.norm_out = RMSNorm(dims[-1], images=False, **kw)
        self.conv_out = CausalConv3d(dims[-1], 2 * config.z_dim, 3, padding=1, **kw)

    def __call__(self, x, feat: FeatCache | None = None):
        x = self.conv_in(x, feat)
        for block in self.down_blocks:
            x = block(x, feat)
        x = self.mid_block(x, feat)
        return self.conv_out(silu(self.norm_out(x)), feat)


def encode_mean(encoder: Encoder3d, quant_conv: CausalConv3d, video, config: Causal3DConfig):
    """diffusers `vae.encode(video).latent_dist.mean` in the model's dtype:
    NCTHW `[B, C, 1 + 4k, H, W]` -> `[B, z_dim, 1 + k, H / s, W / s]` (s = `spatial_factor`).
    Frame 0 alone, then `lax.scan` over the 4-frame chunks carrying the `FeatCache`."""
    x = patchify(jnp.transpose(video, (0, 2, 3, 4, 1)), config.patch_size)
    chunks = (x.shape[1] - 1) // CHUNK_FRAMES
    feat = FeatCache(record=chunks > 0)
    out = encoder(x[:, :1], feat)
    if chunks:
        graphdef, state = nnx.split(encoder)

        def chunk(cache, frames):
            f = FeatCache(cache)
            y = nnx.merge(graphdef, state)(frames, f)
            return f.next, y

        b, _, h, w, c = x.shape
        rest = x[:, 1:].reshape(b, chunks, CHUNK_FRAMES, h, w, c)
        _, ys = jax.lax.scan(chunk, feat.next, jnp.moveaxis(rest, 1, 0))  # [chunks, B, t, h, w, 2 z]
        ys = jnp.moveaxis(ys, 0, 1)
        out = jnp.concatenate([out, ys.reshape((b, -1) + ys.shape[3:])], axis=1)
    mean = quant_conv(out)[..., :config.z_dim]  # quant_conv is 1x1x1; the first z_dim channels are the mean
    return jnp.transpose(mean, (0, 4, 1, 2, 3))
