"""diffusers' `AutoencoderKLHunyuanVideo`, the decoder path (HunyuanVideo's causal 3D VAE).

Follows diffusers `models/autoencoders/autoencoder_kl_hunyuan_video.py`: module attribute names
are diffusers' (`HunyuanVideoCausalConv3d` keeps its `nn.Conv3d` as `.conv`, so keys read
`decoder.conv_in.conv.weight`), so checkpoint keys map by `loading.py`'s one rule; the encoder
half is not built (its keys are skipped).

    z -> post_quant_conv (1x1x1) -> conv_in -> mid_block (resnet, attention, resnet)
      -> up_blocks (layers_per_block + 1 resnets, then an upsample but the last)
      -> GroupNorm -> SiLU -> conv_out            (not clamped)

- Every conv is `HunyuanVideoCausalConv3d`: `F.pad(..., mode="replicate")` with k - 1 copies of
  the first frame in front (none behind) and k // 2 edge copies on each spatial side, then a
  valid `nn.Conv3d`. So output frame t reads input frames <= t, and no zeros enter anywhere.
- GroupNorm statistics per sample and group over all frames and positions (torch's 5-D
  `nn.GroupNorm`), in float32 (`layers.GroupNorm`); so the decode as a whole is not causal
  (a later latent frame moves the statistics every frame is normalised with).
- The mid-block attention is diffusers' `Attention` (one head of width C, GroupNorm first,
  residual) over all T*H*W tokens with `prepare_causal_attention_mask`: a token of frame i
  sees the tokens of frames <= i (`layers.attention(..., causal_block=H*W)`).
- `HunyuanVideoUpsampleCausal3D`: frame 0 nearest 2x in space only, the other frames nearest
  (2, 2, 2) (or (1, 2, 2)): each repeated twice in time, so T frames become 1 + 2 (T - 1); the
  up blocks 1 and 2 upsample time (temporal_compression_ratio 4), 0..2 space.

The decode is diffusers' default (`use_framewise_decoding=True`, `use_tiling=False`): up to
`tile_sample_min_num_frames / 4` = 4 latent frames are decoded at once; a longer clip in
temporal tiles (`_temporal_tiled_decode`): tiles of 5 latent frames starting every 3, each
decoded alone, a tile's first output frame dropped after the first tile, the first 4 frames
of each later tile blended linearly with the last 4 of the tile before, 12 frames kept per
tile (13 of the first), cut to 1 + 4 (T - 1). The full tiles share one compiled decoder
(`lax.map`); at most two shorter tail tiles compile on their own.

On a mesh of several devices that do not divide the batch, `decode_video` spreads each video's
rows (or columns) over them (`spread.py`: one-row halos before every 3x3x3 conv, the edge rows
copied as `replicate` pads them; GroupNorm sums added over the ranks; the mid-block's keys and
values all-gathered; exact, every temporal tile split the same way).

Layout: channels-last inside (`[B, T, H, W, C]`, `lax.conv_general_dilated`), NCTHW at the
boundary.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.vae import loading
from difflet_tpu.vae import spread as vae_spread
from difflet_tpu.vae.layers import GroupNorm, Linear, attention, fp32, param, silu

# AutoencoderKLHunyuanVideo.__init__'s framewise-decoding defaults (sample frames)
TILE_SAMPLE_MIN_NUM_FRAMES = 16
TILE_SAMPLE_STRIDE_NUM_FRAMES = 12

CONFIG_FIELDS = {"in_channels", "out_channels", "latent_channels", "down_block_types", "up_block_types",
                 "block_out_channels", "layers_per_block", "act_fn", "norm_num_groups", "scaling_factor",
                 "spatial_compression_ratio", "temporal_compression_ratio", "mid_block_add_attention"}


@dataclasses.dataclass(frozen=True)
class HunyuanVideoVAEConfig:
    """`AutoencoderKLHunyuanVideo`'s `config.json` (diffusers' defaults for absent fields)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 16
    down_block_types: tuple[str, ...] = ("HunyuanVideoDownBlock3D",) * 4
    up_block_types: tuple[str, ...] = ("HunyuanVideoUpBlock3D",) * 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    act_fn: str = "silu"
    norm_num_groups: int = 32
    scaling_factor: float = 0.476986
    spatial_compression_ratio: int = 8
    temporal_compression_ratio: int = 4
    mid_block_add_attention: bool = True

    def __post_init__(self):
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bad = [t for t in self.up_block_types if t != "HunyuanVideoUpBlock3D"]
        if bad:
            raise ValueError(f"up_block_types: only HunyuanVideoUpBlock3D is supported, got {bad}")
        if len(self.up_block_types) != len(self.block_out_channels):
            raise ValueError(f"up_block_types {list(self.up_block_types)} and block_out_channels "
                             f"{list(self.block_out_channels)} differ in length")
        if self.temporal_compression_ratio != 4:  # diffusers' decoder raises for any other
            raise ValueError(f"temporal_compression_ratio {self.temporal_compression_ratio}: only 4 is supported")
        s = self.spatial_compression_ratio
        if s < 1 or s & (s - 1) or int(math.log2(s)) > len(self.block_out_channels):
            raise ValueError(f"spatial_compression_ratio {s}: needs a power of 2 with at most one upsample per block")
        if self.act_fn not in ("silu", "swish"):
            raise ValueError(f"act_fn: only silu is supported, got {self.act_fn!r}")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(f"block_out_channels {bad} are not multiples of norm_num_groups {self.norm_num_groups}")
        if not self.scaling_factor:
            raise ValueError(f"scaling_factor: {self.scaling_factor!r} (the decode divides by it)")

    @classmethod
    def from_dict(cls, config: dict) -> "HunyuanVideoVAEConfig":
        return cls(**loading.config_fields(config, CONFIG_FIELDS, "AutoencoderKLHunyuanVideo"))

    def upsample_factors(self) -> list[tuple[int, int, int] | None]:
        """Per up block, diffusers' `HunyuanVideoDecoder3D` rule: (t, h, w) factors or None."""
        n = len(self.block_out_channels)
        n_space, n_time = int(math.log2(self.spatial_compression_ratio)), int(math.log2(4))
        out = []
        for i in range(n):
            space = i < n_space
            time = i >= n - 1 - n_time and i != n - 1
            out.append((2 if time else 1, 2 if space else 1, 2 if space else 1) if space or time else None)
        return out


class Conv3d(nnx.Module):
    """torch `nn.Conv3d` (stride 1, no padding) on `[B, T, H, W, C]`; kernel `[kt, kh, kw, in, out]`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        k = kernel_size
        self.kernel = param(rngs, (k, k, k, in_channels, out_channels), dtype, torch_leaf="weight",
                            torch_shape=(out_channels, in_channels, k, k, k), torch_layout="conv")
        self.bias = param(rngs, (out_channels,), dtype, torch_leaf="bias", torch_shape=(out_channels,),
                          torch_layout="same", init="zeros")

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(
            x, self.kernel[...].astype(x.dtype), window_strides=(1, 1, 1), padding="VALID",
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), preferred_element_type=fp32(x.dtype))
        return (y + self.bias[...].astype(y.dtype)).astype(x.dtype)  # accumulate in float32, round once


class CausalConv3d(nnx.Module):
    """diffusers `HunyuanVideoCausalConv3d`: replicate padding (time: k - 1 in front; space: k // 2
    each side), then the valid `conv`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, *, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        self.k = kernel_size
        self.conv = Conv3d(in_channels, out_channels, kernel_size, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        k = self.k
        if k > 1:
            x, (ph, pw) = vae_spread.halo(x, k // 2, "edge")  # in a spread decode: the neighbours' rows
            x = jnp.pad(x, ((0, 0), (k - 1, 0), ph, pw, (0, 0)), mode="edge")
        return self.conv(x)


class ResnetBlockCausal3D(nnx.Module):
    """diffusers `HunyuanVideoResnetBlockCausal3D`: `shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))`."""

    def __init__(self, in_channels: int, out_channels: int, *, groups: int, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.norm1 = GroupNorm(groups, in_channels, eps=1e-6, **kw)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, **kw)
        self.norm2 = GroupNorm(groups, out_channels, eps=1e-6, **kw)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, **kw)
        self.conv_shortcut = CausalConv3d(in_channels, out_channels, 1, **kw) if in_channels != out_channels else None

    def __call__(self, x):
        h = self.conv1(silu(self.norm1(x)))
        h = self.conv2(silu(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return h + x


class Attention(nnx.Module):
    """diffusers `Attention` as `HunyuanVideoMidBlock3D` builds it (heads = 1 of width C,
    `group_norm`, residual) with its frame-causal mask over the T*H*W tokens."""

    def __init__(self, channels: int, *, groups: int, dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.group_norm = GroupNorm(groups, channels, eps=1e-6, **kw)
        self.to_q = Linear(channels, channels, **kw)
        self.to_k = Linear(channels, channels, **kw)
        self.to_v = Linear(channels, channels, **kw)
        self.to_out = nnx.List([Linear(channels, channels, **kw)])  # torch: [Linear, Dropout]

    def __call__(self, x):
        b, t, h, w, c = x.shape
        n = self.group_norm(x)
        kv = vae_spread.gather(n).reshape(b, -1, c)  # a spread decode: local queries, every rank's keys and values
        n = n.reshape(b, t * h * w, c)
        o = attention(self.to_q(n), self.to_k(kv), self.to_v(kv), causal_block=(h * w, kv.shape[1] // t))
        return x + self.to_out[0](o).reshape(x.shape)


class MidBlock3D(nnx.Module):
    """diffusers `HunyuanVideoMidBlock3D` (num_layers 1): resnet, [attention], resnet."""

    def __init__(self, channels: int, *, groups: int, add_attention: bool, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        kw = dict(groups=groups, dtype=dtype, rngs=rngs)
        self.attentions = nnx.List([Attention(channels, **kw)] if add_attention else [])
        self.resnets = nnx.List([ResnetBlockCausal3D(channels, channels, **kw) for _ in range(2)])

    def __call__(self, x):
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


def upsample_nearest(x, factors: tuple[int, int, int]):
    """diffusers `HunyuanVideoUpsampleCausal3D`'s interpolation on `[B, T, H, W, C]`: frame 0
    nearest in space only, the others nearest in (time, space) by `factors`."""
    ft, fh, fw = factors
    b, t, h, w, c = x.shape
    x = jnp.broadcast_to(x[:, :, :, None, :, None, :], (b, t, h, fh, w, fw, c)).reshape(b, t, h * fh, w * fw, c)
    if ft == 1 or t == 1:
        return x
    rest = jnp.repeat(x[:, 1:], ft, axis=1)
    return jnp.concatenate([x[:, :1], rest], axis=1)


class UpsampleCausal3D(nnx.Module):
    """diffusers `HunyuanVideoUpsampleCausal3D`: nearest upsampling, then a causal 3x3x3 `conv`."""

    def __init__(self, channels: int, factors: tuple[int, int, int], *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.factors = factors
        self.conv = CausalConv3d(channels, channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.conv(upsample_nearest(x, self.factors))


class UpBlock3D(nnx.Module):
    """diffusers `HunyuanVideoUpBlock3D`: `num_layers` resnets, then `upsamplers.0` when it upsamples."""

    def __init__(self, in_channels: int, out_channels: int, *, num_layers: int, factors, groups: int,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.resnets = nnx.List([ResnetBlockCausal3D(in_channels if i == 0 else out_channels, out_channels,
                                                     groups=groups, **kw) for i in range(num_layers)])
        self.upsamplers = nnx.List([UpsampleCausal3D(out_channels, factors, **kw)] if factors else [])

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        for up in self.upsamplers:
            x = up(x)
        return x


class Decoder3D(nnx.Module):
    """diffusers `HunyuanVideoDecoder3D` on `[B, T, H, W, C]`."""

    def __init__(self, config: HunyuanVideoVAEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        groups = config.norm_num_groups
        chans = list(reversed(config.block_out_channels))
        self.conv_in = CausalConv3d(config.latent_channels, chans[0], 3, **kw)
        self.mid_block = MidBlock3D(chans[0], groups=groups, add_attention=config.mid_block_add_attention, **kw)
        self.up_blocks = nnx.List([
            UpBlock3D(chans[max(i - 1, 0)], chans[i], num_layers=config.layers_per_block + 1, factors=f,
                      groups=groups, **kw)
            for i, f in enumerate(config.upsample_factors())])
        self.conv_norm_out = GroupNorm(groups, chans[-1], eps=1e-6, **kw)
        self.conv_out = CausalConv3d(chans[-1], config.out_channels, 3, **kw)

    def __call__(self, x):
        x = self.mid_block(self.conv_in(x))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(silu(self.conv_norm_out(x)))


def blend_t(a, b, extent: int):
    """diffusers `blend_t` on `[B, T, H, W, C]`: b's first `extent` frames fade in from a's last."""
    e = min(a.shape[1], b.shape[1], extent)
    w = (jnp.arange(e, dtype=jnp.float32) / e).astype(b.dtype).reshape(1, e, 1, 1, 1)
    head = a[:, -e:] * (1 - w) + b[:, :e] * w
    return jnp.concatenate([head, b[:, e:]], axis=1)


class AutoencoderKLHunyuanVideo(nnx.Module):
    """The decoder half of diffusers' `AutoencoderKLHunyuanVideo`.

    `model(z)` is diffusers' `vae.decode(z).sample` with its defaults (NCTHW in and out, model
    dtype, framewise tiles past 4 latent frames, not clamped); `model.decode_video(latents)` is
    what HunyuanVideoPipeline does after its denoise loop (`latents / scaling_factor`, the decode;
    float32, jitted, batch-sharded over the mesh given to `from_pretrained`).
    """

    CLASS_NAMES = ("AutoencoderKLHunyuanVideo",)

    def __init__(self, config: HunyuanVideoVAEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = config
        self.dtype = loading.check_dtype(dtype)
        self.mesh = None
        kw = dict(dtype=self.dtype, rngs=rngs)
        self.post_quant_conv = Conv3d(config.latent_channels, config.latent_channels, 1, **kw)
        self.decoder = Decoder3D(config, **kw)

    @classmethod
    def from_pretrained(cls, folder, *, dtype=jnp.bfloat16, mesh=None, strict: bool = True):
        """Build from a diffusers `vae/` folder (`config.json`, safetensors); see `loading.py`."""
        return loading.from_pretrained(cls, HunyuanVideoVAEConfig, folder, dtype=dtype, mesh=mesh, strict=strict)

    @property
    def temporal_compression_ratio(self) -> int:
        return self.config.temporal_compression_ratio

    @property
    def spatial_compression_ratio(self) -> int:
        return self.config.spatial_compression_ratio

    def check_latents(self, z):
        loading.check_latents(z, self.config.latent_channels, ("frames", "height", "width"), "NCTHW")

    def decode_tile(self, z):
        return self.decoder(self.post_quant_conv(z))

    def __call__(self, z):
        """`[B, C, T, h, w]` -> `[B, 3, 1 + 4 (T - 1), 8h, 8w]`, diffusers' default `_decode`."""
        self.check_latents(z)
        x = jnp.transpose(z, (0, 2, 3, 4, 1)).astype(self.dtype)
        t = x.shape[1]
        ratio = self.config.temporal_compression_ratio
        min_t = TILE_SAMPLE_MIN_NUM_FRAMES // ratio
        if t <= min_t:
            out = self.decode_tile(x)
        else:
            out = self.temporal_tiled_decode(x, min_t, TILE_SAMPLE_STRIDE_NUM_FRAMES // ratio)
        return jnp.transpose(out, (0, 4, 1, 2, 3))

    def temporal_tiled_decode(self, x, min_t: int, stride_t: int):
        """diffusers `_temporal_tiled_decode` (tiling off) on `[B, T, h, w, C]`."""
        t = x.shape[1]
        starts = list(range(0, t, stride_t))
        full = [i for i in starts if i + min_t + 1 <= t]
        tiles = {}
        if full:  # the tiles of min_t + 1 latent frames: one compiled decoder over all
            graphdef, state = nnx.split(self)
            stacked = jnp.stack([x[:, i:i + min_t + 1] for i in full])
            decoded = jax.lax.map(lambda tile: nnx.merge(graphdef, state).decode_tile(tile), stacked)
            tiles.update({i: decoded[k] for k, i in enumerate(full)})
        for i in starts:
            if i not in tiles:
                tiles[i] = self.decode_tile(x[:, i:i + min_t + 1])
        sample_stride = TILE_SAMPLE_STRIDE_NUM_FRAMES
        blend = TILE_SAMPLE_MIN_NUM_FRAMES - TILE_SAMPLE_STRIDE_NUM_FRAMES
        row = [tiles[i] if k == 0 else tiles[i][:, 1:] for k, i in enumerate(starts)]
        result = []
        for k, tile in enumerate(row):
            if k > 0:
                tile = blend_t(row[k - 1], tile, blend)
                row[k] = tile  # diffusers blends in place: the next tile fades from this blended one
                result.append(tile[:, :sample_stride])
            else:
                result.append(tile[:, :sample_stride + 1])
        num_sample_frames = (t - 1) * self.config.temporal_compression_ratio + 1
        return jnp.concatenate(result, axis=1)[:, :num_sample_frames]

    def unscale(self, latents):
        """HunyuanVideoPipeline: `latents / scaling_factor`, float32."""
        return latents.astype(jnp.float32) / self.config.scaling_factor

    def decode_video_latents(self, latents, spread_axis: str | None = None):
        return vae_spread.apply(self, self.unscale(latents), spread_axis)

    def spread_axis(self, shape, spread: str | None = None, axis: str | None = None) -> str | None:
        """The axis a decode of latents of `shape` splits over the mesh (`vae_spread.choose`), or None."""
        return vae_spread.choose(self.mesh, shape, spread, axis)

    def decode_video(self, latents, *, spread: str | None = None, axis: str | None = None, uint8: bool = False):
        """HunyuanVideoPipeline's decode of denoised latents `[B, C, T, h, w]`: float32
        `[B, 3, 1 + 4 (T - 1), 8h, 8w]` in about [-1, 1] (not clamped, as diffusers); `uint8`:
        `[B, 1 + 4 (T - 1), 8h, 8w, 3]` uint8 frames (`loading.to_uint8`), converted on the
        devices. On a mesh of several devices that do not divide the batch, each video's rows
        are spread over them (`spread` / `axis`: `vae_spread.choose`; exact, not tiled)."""
        self.check_latents(latents)
        return loading.call_decode(self, "decode_video_latents", latents, spread=spread, axis=axis, uint8=uint8)
