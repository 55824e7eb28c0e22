"""The causal-3D VAE family (Wan 2.1's VAE, which Qwen-Image reuses; Wan 2.2's), the decoder path
(the encoder half, built on request, is `encoder3d.py`).

Follows diffusers `models/autoencoders/autoencoder_kl_qwenimage.py`
(`AutoencoderKLQwenImage`) and `autoencoder_kl_wan.py` (`AutoencoderKLWan`): the two
build the same decoder from the same config fields (Qwen-Image's is a copy of
Wan 2.1's), so one implementation serves both, chosen by `config.json`'s
`_class_name`; Wan 2.2's config adds `is_residual` (up blocks with a parameter-free
`DupUp3D` shortcut, `ResidualUpBlock`), `patch_size` (the output unpatchified) and
`decoder_base_dim`. Module attribute names are diffusers', so checkpoint keys map by
`loading.py`'s one rule; the encoder half is built only with `encoder=True` (else its
keys are skipped).

    z -> post_quant_conv (1x1x1) -> conv_in -> mid_block (resnet, attention, resnet)
      -> up_blocks (num_res_blocks + 1 resnets, then a resample but the last)
      -> RMS norm -> SiLU -> conv_out -> clamp to [-1, 1]

- Convolutions over time are causal (`CausalConv3d`): 2 frames of zeros in front,
  none behind, so output frame t reads input frames <= t.
- Norms are `F.normalize` over channels times sqrt(C) times gamma (`layers.RMSNorm`).
- The mid-block attention is single-head over each frame's H*W positions.
- `upsample3d` resamples (the `temperal_upsample` blocks, the config's
  `temperal_downsample` reversed) double the frames with a causal (3, 1, 1)
  `time_conv` to 2C channels, interleaved as frames 2t, 2t+1, before the spatial
  nearest 2x + conv; `upsample2d` is the spatial part alone.

Frame by frame, as diffusers' `_decode`: latent frame 0 is decoded alone, then each
further latent frame with `FeatCache`, the last `CACHE_T` = 2 input frames of every
causal conv from the chunk before (diffusers' `feat_cache` / `feat_idx`). In the first
chunk an `upsample3d` skips its `time_conv` and keeps its one frame ("Rep"), so
`T` latent frames decode to `1 + 4 (T - 1)` frames (two temporal upsamples); the
later chunks run under `lax.scan` (one compiled step). A chunk-0 conv sees zeros
before its frame, so a one-frame chunk-0 conv is the 2-D conv with the kernel's
last temporal tap (exactly; a third of the work of the 3-D conv over zeros).
Output frame 0 depends on latent frame 0 alone, so the Qwen-Image `decode` (which
keeps frame 0, as QwenImagePipeline does) decodes only latent frame 0.

On a mesh of several devices that do not divide the batch, `decode` / `decode_video`
spread each video's rows (or columns) over them (`spread.py`: one-row halos before every
spatial conv, the mid-block K/V all-gathered; exact): the causal chunks are sequential,
so the split is spatial, not temporal.

Layout: channels-last inside (`[B, T, H, W, C]`, `lax.conv_general_dilated`), diffusers'
NCTHW at the boundary.

Memory at 1024 x 1024 (latents 16 x 1 x 128 x 128, Qwen-Image config, bfloat16, per
image): the largest activation is the third up block's nearest-2x upsampled map,
192 channels at 1024 x 1024 = 384 MiB, before its resample conv; the 96-channel maps
at 1024 x 1024 are 192 MiB. RMS norms work in float32 inside one fusion. The
mid-block attention runs over 16384 tokens of width 384: `layers.attention` takes
1024 query rows at a time (64 MiB of float32 scores per image instead of a 1 GiB
score matrix). The one-frame decode records no causal cache. Compiled deviceless
for v5e (batch 4 over a 2x2 slice, one image per chip): 1.46 GiB of HBM per chip
(1.26 GiB temporaries). For video the scan carries each causal conv's 2-frame
history (`FeatCache`) besides the output video: Wan 2.1 at 81 x 480 x 832 (latents
16 x 21 x 60 x 104, one video per chip) compiles to 5.41 GiB per chip; one video at
81 x 720 x 1280 spread by width over a v5e:2x2 (`spread.py`, uint8 frames out) to 4.87 GiB
per chip, an estimated 3.5 s (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.vae import loading
from difflet_tpu.vae import spread as vae_spread
from difflet_tpu.vae.layers import Conv2d, RMSNorm, attention, conv2d, fp32, param, silu, upsample_nearest2x

CACHE_T = 2  # frames of history a causal conv keeps (its temporal kernel 3 minus 1)

# diffusers' defaults of both classes (Wan 2.1's statistics; Qwen-Image's config repeats them)
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

# config.json fields of each class (its `__init__` arguments)
_COMMON = {"base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales", "temperal_downsample",
           "dropout", "latents_mean", "latents_std"}
CONFIG_FIELDS = {
    "AutoencoderKLQwenImage": _COMMON | {"input_channels"},
    "AutoencoderKLWan": _COMMON | {"decoder_base_dim", "is_residual", "in_channels", "out_channels", "patch_size",
                                   "scale_factor_temporal", "scale_factor_spatial"},
}


@dataclasses.dataclass(frozen=True)
class Causal3DConfig:
    """An `AutoencoderKLQwenImage` / `AutoencoderKLWan` config (diffusers' defaults for
    absent fields). `in_channels` and `out_channels` are Qwen-Image's `input_channels`;
    `decoder_base_dim` defaults to `base_dim`; `attn_scales` is the encoder's."""

    class_name: str = "AutoencoderKLQwenImage"
    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    out_channels: int = 3
    in_channels: int = 3
    attn_scales: tuple[float, ...] = ()
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD
    is_residual: bool = False
    patch_size: int | None = None

    def __post_init__(self):
        for name in ("dim_mult", "temperal_downsample", "latents_mean", "latents_std", "attn_scales"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.decoder_base_dim is None:
            object.__setattr__(self, "decoder_base_dim", self.base_dim)
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"temperal_downsample {list(self.temperal_downsample)} needs len(dim_mult) - 1 = "
                             f"{len(self.dim_mult) - 1} entries")
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, z_dim is {self.z_dim}")
        if any(s == 0 for s in self.latents_std):
            raise ValueError("latents_std has a zero entry (the decode multiplies by it)")
        p = self.patch_size
        if p is not None and (not isinstance(p, int) or p < 1 or self.out_channels % (p * p)
                              or self.in_channels % (p * p)):
            raise ValueError(f"patch_size {p!r}: needs a positive int whose square divides out_channels "
                             f"{self.out_channels} and in_channels {self.in_channels}")

    @classmethod
    def from_dict(cls, config: dict) -> "Causal3DConfig":
        name = config.get("_class_name", "AutoencoderKLQwenImage")
        fields = loading.config_fields(config, CONFIG_FIELDS[name], name)
        if name == "AutoencoderKLQwenImage" and "input_channels" in fields:
            fields["out_channels"] = fields["in_channels"] = fields.pop("input_channels")
        for unused in ("dropout", "scale_factor_temporal", "scale_factor_spatial"):
            fields.pop(unused, None)  # inference has no dropout; the factors follow from the layout
        return cls(class_name=name, **fields)

    @property
    def temperal_upsample(self) -> tuple[bool, ...]:
        return self.temperal_downsample[::-1]


class FeatCache:
    """diffusers' `feat_cache` / `feat_idx` for one decoder call on a chunk of frames.

    `prev`: per causal conv in call order, the `CACHE_T` input frames before this chunk
    (`[B, CACHE_T, H, W, C]`), or None for the first chunk (zeros before it). With
    `record`, `next` collects the same for the chunk after (zeros in front where the
    history is shorter, as diffusers' zero padding of a short cache).
    """

    def __init__(self, prev: list | None = None, *, record: bool = True):
        self.prev, self.record, self.next = prev, record, []

    @property
    def first(self) -> bool:
        return self.prev is None

    def step(self, x):
        """This conv's history before `x` (None on the first chunk), and remember the
        `CACHE_T` frames ending `x` for the next chunk."""
        hist = None if self.prev is None else self.prev[len(self.next)]
        if not self.record:
            self.next.append(None)
            return hist
        full = x if hist is None else jnp.concatenate([hist, x], axis=1)
        if full.shape[1] < CACHE_T:
            full = jnp.pad(full, ((0, 0), (CACHE_T - full.shape[1], 0)) + ((0, 0),) * (x.ndim - 2))
        self.next.append(full[:, -CACHE_T:])
        return hist


class CausalConv3d(nnx.Module):
    """diffusers `QwenImageCausalConv3d` / `WanCausalConv3d` (`nn.Conv3d`, stride 1) on
    `[B, T, H, W, C]`: spatial zero padding, time padded only in front (2 x padding_t
    frames: zeros, or the chunk before's frames from the `FeatCache`). Kernel `[kt, kh, kw, in, out]`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, *, padding=0, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        kt, kh, kw = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
        pt, ph, pw = (padding,) * 3 if isinstance(padding, int) else padding
        if kt != 2 * pt + 1 or kh != 2 * ph + 1 or kw != 2 * pw + 1 or kh != kw or kt > CACHE_T + 1:
            raise ValueError(f"CausalConv3d: kernel {kernel_size} with padding {padding} is not a 'same' causal conv")
        self.padding = ph
        self.kernel = param(rngs, (kt, kh, kw, in_channels, out_channels), dtype, torch_leaf="weight",
                            torch_shape=(out_channels, in_channels, kt, kh, kw), torch_layout="conv")
        self.bias = param(rngs, (out_channels,), dtype, torch_leaf="bias", torch_shape=(out_channels,),
                          torch_layout="same", init="zeros")

    def __call__(self, x, feat: FeatCache | None = None):
        kernel, bias = self.kernel[...], self.bias[...]
        kt = kernel.shape[0]
        if kt == 1:
            return conv2d(x, kernel[0], bias, self.padding)
        hist = feat.step(x) if feat is not None else None
        if hist is None:
            if x.shape[1] == 1:  # only zeros before the one frame: the last temporal tap alone
                return conv2d(x, kernel[-1], bias, self.padding)
            x = jnp.pad(x, ((0, 0), (kt - 1, 0), (0, 0), (0, 0), (0, 0)))
        else:
            x = jnp.concatenate([hist.astype(x.dtype), x], axis=1)[:, -(x.shape[1] + kt - 1):]
        x, pads = vae_spread.halo(x, self.padding)  # in a spread decode: the neighbours' rows
        y = jax.lax.conv_general_dilated(
            x, kernel.astype(x.dtype), window_strides=(1, 1, 1), padding=[(0, 0)] + pads,
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), preferred_element_type=fp32(x.dtype))
        return (y + bias.astype(y.dtype)).astype(x.dtype)


class ResidualBlock(nnx.Module):
    """diffusers `QwenImageResidualBlock` / `WanResidualBlock`:
    `shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))`."""

    def __init__(self, in_dim: int, out_dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.norm1 = RMSNorm(in_dim, images=False, **kw)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1, **kw)
        self.norm2 = RMSNorm(out_dim, images=False, **kw)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1, **kw)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1, **kw) if in_dim != out_dim else None

    def __call__(self, x, feat: FeatCache | None = None):
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(silu(self.norm1(x)), feat)
        x = self.conv2(silu(self.norm2(x)), feat)
        return x + h


class AttentionBlock(nnx.Module):
    """diffusers `QwenImageAttentionBlock` / `WanAttentionBlock`: per frame, RMS norm, a 1x1
    `to_qkv` conv split q | k | v over channels, one head over H*W, 1x1 `proj`, residual."""

    def __init__(self, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(dim, images=True, **kw)
        self.to_qkv = Conv2d(dim, dim * 3, 1, **kw)
        self.proj = Conv2d(dim, dim, 1, **kw)

    def __call__(self, x):
        b, t, h, w, c = x.shape
        qkv = self.to_qkv(self.norm(x))
        kv = vae_spread.gather(qkv[..., c:])  # a spread decode: local queries, every rank's keys and values
        q, k, v = (a.reshape(b * t, -1, c) for a in (qkv[..., :c], kv[..., :c], kv[..., c:]))
        o = attention(q, k, v)
        return x + self.proj(o.reshape(b, t, h, w, c))


class MidBlock(nnx.Module):
    """diffusers `QwenImageMidBlock` / `WanMidBlock` (num_layers 1): resnet, attention, resnet."""

    def __init__(self, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.attentions = nnx.List([AttentionBlock(dim, **kw)])
        self.resnets = nnx.List([ResidualBlock(dim, dim, **kw) for _ in range(2)])

    def __call__(self, x, feat: FeatCache | None = None):
        x = self.resnets[0](x, feat)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attn(x), feat)
        return x


class Upsample(nnx.Module):
    """diffusers `QwenImageUpsample` / `WanUpsample` (`nn.Upsample(scale_factor=2,
    mode="nearest-exact")`): no parameters; index 0 of the resample `Sequential`."""

    def __call__(self, x):
        return upsample_nearest2x(x)


class Resample(nnx.Module):
    """diffusers `QwenImageResample` / `WanResample`, the decoder's modes:
    `upsample2d`: `resample` = [nearest 2x, 3x3 conv to `upsample_out_dim`] per frame;
    `upsample3d`: first a causal (3, 1, 1) `time_conv` to 2C channels, read as two frames
    per frame (channels [0, C) frame 2t, [C, 2C) frame 2t + 1), skipped on the first
    chunk (diffusers' "Rep": frame 0 stays one frame), then the same spatial part."""

    def __init__(self, dim: int, mode: str, *, upsample_out_dim: int | None = None, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        if mode not in ("upsample2d", "upsample3d"):
            raise ValueError(f"Resample: mode {mode!r} is not a decoder mode")
        kw = dict(dtype=dtype, rngs=rngs)
        self.mode = mode
        out_dim = dim // 2 if upsample_out_dim is None else upsample_out_dim
        self.resample = nnx.List([Upsample(), Conv2d(dim, out_dim, 3, padding=1, **kw)])
        self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0), **kw) \
            if mode == "upsample3d" else None

    def __call__(self, x, feat: FeatCache | None = None):
        if self.time_conv is not None and feat is not None:
            if feat.first:
                feat.step(x[:, :0])  # the time_conv's history for chunk 1: zeros
            else:
                y = self.time_conv(x, feat)
                b, t, h, w, c2 = y.shape
                x = y.reshape(b, t, h, w, 2, c2 // 2).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c2 // 2)
        for layer in self.resample:
            x = layer(x)
        return x


class UpBlock(nnx.Module):
    """diffusers `QwenImageUpBlock` / `WanUpBlock`: `num_res_blocks + 1` residual blocks, then
    `upsamplers.0` (a `Resample`) unless the last block."""

    def __init__(self, in_dim: int, out_dim: int, *, num_res_blocks: int, upsample_mode: str | None,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.resnets = nnx.List([ResidualBlock(in_dim if i == 0 else out_dim, out_dim, **kw)
                                 for i in range(num_res_blocks + 1)])
        self.upsamplers = nnx.List([Resample(out_dim, upsample_mode, **kw)] if upsample_mode else [])

    def __call__(self, x, feat: FeatCache | None = None):
        for resnet in self.resnets:
            x = resnet(x, feat)
        for up in self.upsamplers:
            x = up(x, feat)
        return x


class DupUp3D(nnx.Module):
    """diffusers `DupUp3D` (Wan 2.2), no parameters: each input channel repeated, then read
    as `factor_t x factor_s x factor_s` neighbours of `out_channels` channels (a pixel
    shuffle of the repeats); on the first chunk the first `factor_t - 1` frames are dropped
    (the frame count of an `upsample3d` there)."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int = 1):
        self.out_channels, self.factor_t, self.factor_s = out_channels, factor_t, factor_s
        factor = factor_t * factor_s * factor_s
        if out_channels * factor % in_channels:
            raise ValueError(f"DupUp3D: {out_channels} x {factor} is not a multiple of {in_channels}")
        self.repeats = out_channels * factor // in_channels

    def __call__(self, x, first_chunk: bool = False):
        b, t, h, w, _ = x.shape
        ft, fs, c = self.factor_t, self.factor_s, self.out_channels
        x = jnp.repeat(x, self.repeats, axis=-1).reshape(b, t, h, w, c, ft, fs, fs)
        x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, t * ft, h * fs, w * fs, c)
        return x[:, ft - 1:] if first_chunk else x


class ResidualUpBlock(nnx.Module):
    """diffusers `WanResidualUpBlock` (Wan 2.2, `is_residual`): residual blocks, then
    `upsampler` (a `Resample` to `out_dim`), plus the parameter-free `avg_shortcut`
    (`DupUp3D`) of the block's input, when the block upsamples."""

    def __init__(self, in_dim: int, out_dim: int, *, num_res_blocks: int, temperal_upsample: bool, up_flag: bool,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.avg_shortcut = DupUp3D(in_dim, out_dim, factor_t=2 if temperal_upsample else 1, factor_s=2) \
            if up_flag else None
        self.resnets = nnx.List([ResidualBlock(in_dim if i == 0 else out_dim, out_dim, **kw)
                                 for i in range(num_res_blocks + 1)])
        mode = "upsample3d" if temperal_upsample else "upsample2d"
        self.upsampler = Resample(out_dim, mode, upsample_out_dim=out_dim, **kw) if up_flag else None

    def __call__(self, x, feat: FeatCache | None = None):
        x_in = x
        for resnet in self.resnets:
            x = resnet(x, feat)
        if self.upsampler is not None:
            x = self.upsampler(x, feat)
        if self.avg_shortcut is not None:
            x = x + self.avg_shortcut(x_in, first_chunk=feat is not None and feat.first)
        return x


def unpatchify(x, patch_size: int | None):
    """diffusers `unpatchify` (Wan 2.2) on `[B, T, H, W, C p p]`: channel `(c p + a) p + b`
    goes to pixel `(h p + b, w p + a)` of channel c."""
    if not patch_size or patch_size == 1:
        return x
    b, t, h, w, cpp = x.shape
    p = patch_size
    x = x.reshape(b, t, h, w, cpp // (p * p), p, p).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, t, h * p, w * p, cpp // (p * p))


class Decoder3d(nnx.Module):
    """diffusers `QwenImageDecoder3d` / `WanDecoder3d` on one chunk of frames."""

    def __init__(self, config: Causal3DConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        mult = config.dim_mult
        dims = [config.decoder_base_dim * u for u in (mult[-1],) + mult[::-1]]
        self.conv_in = CausalConv3d(config.z_dim, dims[0], 3, padding=1, **kw)
        self.mid_block = MidBlock(dims[0], **kw)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            up_flag = i != len(mult) - 1
            temporal = up_flag and config.temperal_upsample[i]
            if config.is_residual:  # Wan 2.2
                blocks.append(ResidualUpBlock(in_dim, out_dim, num_res_blocks=config.num_res_blocks,
                                              temperal_upsample=temporal, up_flag=up_flag, **kw))
                continue
            if i > 0:
                in_dim //= 2  # the resample before halved the width (Wan 2.1, Qwen-Image)
            mode = ("upsample3d" if temporal else "upsample2d") if up_flag else None
            blocks.append(UpBlock(in_dim, out_dim, num_res_blocks=config.num_res_blocks, upsample_mode=mode, **kw))
        self.up_blocks = nnx.List(blocks)
        self.norm_out = RMSNorm(dims[-1], images=False, **kw)
        self.conv_out = CausalConv3d(dims[-1], config.out_channels, 3, padding=1, **kw)

    def __call__(self, x, feat: FeatCache | None = None):
        x = self.mid_block(self.conv_in(x, feat), feat)
        for block in self.up_blocks:
            x = block(x, feat)
        return self.conv_out(silu(self.norm_out(x)), feat)


class AutoencoderKLCausal3D(nnx.Module):
    """diffusers' `AutoencoderKLQwenImage` / `AutoencoderKLWan` (Wan 2.1, 2.2): the decoder,
    and the encoder when built with `encoder=True`.

    `model(z)` is diffusers' `vae.decode(z).sample` (NCTHW in and out, model dtype,
    clamped); `model.decode(latents)` is what QwenImagePipeline does after its denoise
    loop (NCHW float32 image, frame 0); `model.decode_video(latents)` the same for every
    frame (NCTHW float32), as the Wan pipelines. `model.encode(video)` is
    `vae.encode(video).latent_dist.mean` (float32), `model.scale(mean)` the image-to-video
    pipelines' normalisation of it. All jitted, batch-sharded over the mesh given to
    `from_pretrained`; a video's decode spread over it (`spread_axis`) when the batch does not split.
    """

    CLASS_NAMES = tuple(CONFIG_FIELDS)
    UINT8_METHODS = ("decode_video_latents",)  # make uint8 frames themselves (`loading._apply`)

    def __init__(self, config: Causal3DConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 encoder: bool = False):
        self.config = config
        self.dtype = loading.check_dtype(dtype)
        self.mesh = None
        kw = dict(dtype=self.dtype, rngs=rngs)
        if encoder:
            from difflet_tpu.vae.encoder3d import Encoder3d  # encoder3d imports this module's blocks

            self.encoder = Encoder3d(config, **kw)
            self.quant_conv = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, 1, **kw)
        else:  # no encoder parameters, nothing allocated
            self.encoder = self.quant_conv = None
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, 1, **kw)
        self.decoder = Decoder3d(config, **kw)

    @classmethod
    def from_pretrained(cls, folder, *, dtype=jnp.bfloat16, mesh=None, strict: bool = True, encoder: bool = False):
        """Build from a diffusers `vae/` folder (`config.json`, safetensors); see `loading.py`
        for the checks. `mesh`: parameters replicated on it, batches sharded over it.
        `encoder`: also build and load the encoder half (`encoder.*`, `quant_conv.*`), for
        `encode`; off by default (decoding never reads it)."""
        return loading.from_pretrained(cls, Causal3DConfig, folder, dtype=dtype, mesh=mesh, strict=strict,
                                       encoder=encoder)

    def check_latents(self, z):
        """Refuse what is not a `[B, z_dim, T, H, W]` floating array."""
        loading.check_latents(z, self.config.z_dim, ("frames", "height", "width"), "NCTHW")

    def __call__(self, z):
        """diffusers `vae.decode(z).sample`: `[B, z_dim, T, h, w]` -> `[B, 3, 1 + 4 (T - 1), 8h, 8w]`."""
        return jnp.transpose(self.frames(z), (0, 4, 1, 2, 3))

    def frames(self, z, uint8: bool = False):
        """`__call__` channels last: `[B, 1 + 4 (T - 1), 8h, 8w, 3]`, clamped to [-1, 1]. `uint8`:
        (uint8 frames, whether every pixel was finite), each chunk's frames converted
        (`loading.to_uint8`) as the chunk is decoded, so no float video is ever whole and the
        uint8 frames are made in their final layout (Wan 2.2 at 121 x 704 x 1280 on v5e: the
        transpose of the whole converted video ran out of scoped VMEM)."""
        self.check_latents(z)
        x = self.post_quant_conv(jnp.transpose(z, (0, 2, 3, 4, 1)).astype(self.dtype))

        def finish(y):  # one chunk's frames as they leave the decoder
            y = jnp.clip(unpatchify(y, self.config.patch_size), -1.0, 1.0)
            return (loading.to_uint8(y), jnp.all(jnp.isfinite(y))) if uint8 else (y, None)

        feat = FeatCache(record=x.shape[1] > 1)
        out, finite = finish(self.decoder(x[:, :1], feat))  # first chunk: latent frame 0 alone
        if x.shape[1] > 1:
            graphdef, state = nnx.split(self.decoder)

            def chunk(cache, frame):
                f = FeatCache(cache)
                y = nnx.merge(graphdef, state)(frame[:, None], f)
                return f.next, finish(y)

            _, (rest, rest_finite) = jax.lax.scan(chunk, feat.next, jnp.moveaxis(x[:, 1:], 1, 0))
            rest = jnp.moveaxis(rest, 0, 1)  # [B, T-1, t, H, W, C]
            out = jnp.concatenate([out, rest.reshape((rest.shape[0], -1) + rest.shape[3:])], axis=1)
            finite = finite & jnp.all(rest_finite) if uint8 else None
        return (out, finite) if uint8 else out

    def unscale(self, latents):
        """QwenImagePipeline / WanPipeline: `latents / (1 / latents_std) + latents_mean` per
        channel, float32."""
        shape = (1, -1, 1, 1, 1)
        mean = jnp.asarray(self.config.latents_mean, jnp.float32).reshape(shape)
        inv_std = 1.0 / jnp.asarray(self.config.latents_std, jnp.float32).reshape(shape)
        return latents.astype(jnp.float32) / inv_std + mean

    def scale(self, latents):
        """WanImageToVideoPipeline's normalisation of the encoded condition (the inverse of
        `unscale`): `(latents - latents_mean) * (1 / latents_std)` per channel, float32."""
        shape = (1, -1, 1, 1, 1)
        mean = jnp.asarray(self.config.latents_mean, jnp.float32).reshape(shape)
        inv_std = 1.0 / jnp.asarray(self.config.latents_std, jnp.float32).reshape(shape)
        return (jnp.asarray(latents, jnp.float32) - mean) * inv_std

    def encode_video(self, video):
        """The traced body of `encode`: the latent mean in the model's dtype."""
        from difflet_tpu.vae.encoder3d import encode_mean

        return encode_mean(self.encoder, self.quant_conv, video.astype(self.dtype), self.config)

    def encode(self, video):
        """diffusers `vae.encode(video).latent_dist.mean` (= `.mode()`, the image-to-video
        pipelines' `sample_mode="argmax"`): NCTHW `[B, C, 1 + 4k, H, W]` in [-1, 1] ->
        float32 `[B, z_dim, 1 + k, H / s, W / s]`, s = 8 (Wan 2.1, Qwen-Image) or 16 (Wan 2.2).
        Needs `from_pretrained(..., encoder=True)`."""
        from difflet_tpu.vae.encoder3d import check_video

        if self.encoder is None:
            raise ValueError("encode: this VAE was built without its encoder; load it with "
                             "from_pretrained(folder, encoder=True)")
        check_video(video, self.config)
        return loading.call_jitted(self, "encode_video", video, self.mesh)

    def _decode(self, latents, spread_axis: str | None, uint8: bool = False):
        z = self.unscale(latents)
        if not uint8:
            return vae_spread.apply(self, z, spread_axis)
        if spread_axis is None:
            return self.frames(z, True)
        graphdef, state = nnx.split(self)
        return vae_spread.decode(lambda s, z: nnx.merge(graphdef, s).frames(z, True), state, z, self.mesh,
                                 spread_axis, frames_last=True)

    def decode_image(self, latents, spread_axis: str | None = None):
        # frame 0 of the output reads latent frame 0 only (causal), so decode that alone
        return self._decode(latents[:, :, :1], spread_axis)[:, :, 0]

    def decode_video_latents(self, latents, spread_axis: str | None = None, uint8: bool = False):
        """`uint8`: (channels-last uint8 frames, finite), converted chunk by chunk (`frames`)."""
        return self._decode(latents, spread_axis, uint8)

    def spread_axis(self, shape, spread: str | None = None, axis: str | None = None) -> str | None:
        """The axis ("height" / "width") a decode of latents of `shape` splits over the mesh's
        devices, or None for the batch-sharded / one-device decode (`vae_spread.choose`)."""
        return vae_spread.choose(self.mesh, shape, spread, axis)

    def decode(self, latents, *, spread: str | None = None, axis: str | None = None, uint8: bool = False):
        """QwenImagePipeline's decode of denoised latents `[B, z_dim, T, h, w]` (T = 1 for an
        image): un-scale, decode, frame 0: float32 `[B, 3, 8h, 8w]` in [-1, 1]; `uint8`:
        `[B, 8h, 8w, 3]` uint8 (`loading.to_uint8`, as diffusers' `output_type="pil"`).
        `spread` / `axis`: see `spread_axis`."""
        self.check_latents(latents)
        return self._call("decode_image", latents, spread, axis, uint8)

    def decode_video(self, latents, *, spread: str | None = None, axis: str | None = None, uint8: bool = False):
        """The Wan pipelines' decode: un-scale, decode every frame: float32
        `[B, 3, 1 + 4 (T - 1), 8h, 8w]` in [-1, 1]; `uint8`: `[B, 1 + 4 (T - 1), 8h, 8w, 3]`
        uint8 frames (`loading.to_uint8`), converted on the devices. On a mesh of several
        devices that do not divide the batch, each video's rows are spread over them
        (`spread_axis`, `vae/spread.py`: exact, not tiled)."""
        self.check_latents(latents)
        return self._call("decode_video_latents", latents, spread, axis, uint8)

    def _call(self, method, latents, spread, axis, uint8):
        return loading.call_decode(self, method, latents, spread=spread, axis=axis, uint8=uint8)
