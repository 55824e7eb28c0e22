"""diffusers' `AutoencoderKL`, the decoder path (FLUX.1's VAE; Stable Diffusion's).

Follows diffusers `models/autoencoders/autoencoder_kl.py` (`_decode`), `autoencoders/vae.py`
(`Decoder`), `unets/unet_2d_blocks.py` (`UNetMidBlock2D`, `UpDecoderBlock2D`),
`resnet.py` (`ResnetBlock2D`), `upsampling.py` (`Upsample2D`) and
`attention_processor.py` (`Attention` with `AttnProcessor2_0`): module attribute
names are diffusers', so checkpoint keys map by `loading.py`'s one rule; the
encoder half is not built (its keys are skipped).

    z -> [post_quant_conv] -> conv_in -> mid_block (resnet, attention, resnet)
      -> up_blocks (layers_per_block + 1 resnets, then nearest 2x + conv but the last)
      -> GroupNorm -> SiLU -> conv_out

GroupNorm(norm_num_groups, eps 1e-6) statistics in float32; the mid-block attention
is single-head over all H*W positions.

Layout: channels-last inside (NHWC convolutions, `lax.conv_general_dilated`, the
TPU's native layout); diffusers' NCHW at the boundary.

Memory at 1024 x 1024 (latents 16 x 128 x 128, FLUX.1 config, bfloat16, per image):
the largest activations are the 256-channel maps at 1024 x 1024 of the third up
block (its upsampled input and its conv output: 256 x 1024^2 x 2 B = 512 MiB each);
512 channels at 512 x 512 are 256 MiB. GroupNorm works in float32 inside one fusion,
so it adds no float32 copy of a map. The mid-block attention runs over 128 x 128 =
16384 tokens of width 512: a materialised score matrix would be 16384^2 x 4 B = 1 GiB
per image, so `layers.attention` takes the queries 1024 rows at a time (64 MiB of
float32 scores per image). Compiled deviceless for v5e (batch 4 over a 2x2 slice, one
image per chip): 2.70 GiB of HBM per chip (2.53 GiB temporaries: a few of the 512 MiB
maps live at once), so a 16 GiB chip holds a few images; the batch is sharded over
a mesh's devices when it divides (`from_pretrained(mesh=...)`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from difflet_tpu.vae import loading
from difflet_tpu.vae.layers import Conv2d, GroupNorm, Linear, attention, silu, upsample_nearest2x


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig:
    """`AutoencoderKL`'s `config.json` (diffusers' defaults for absent fields)."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self):
        for name in ("down_block_types", "up_block_types", "block_out_channels", "latents_mean", "latents_std"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
        if len(self.up_block_types) != len(self.block_out_channels):
            raise ValueError(f"up_block_types {list(self.up_block_types)} and block_out_channels "
                             f"{list(self.block_out_channels)} differ in length")
        bad = [t for t in self.up_block_types if t != "UpDecoderBlock2D"]
        if bad:
            raise ValueError(f"up_block_types: only UpDecoderBlock2D is supported, got {bad}")
        if self.act_fn not in ("silu", "swish"):
            raise ValueError(f"act_fn: only silu is supported, got {self.act_fn!r}")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(f"block_out_channels {bad} are not multiples of norm_num_groups {self.norm_num_groups}")
        if not self.scaling_factor:
            raise ValueError(f"scaling_factor: {self.scaling_factor!r} (the decode divides by it)")

    @classmethod
    def from_dict(cls, config: dict) -> "AutoencoderKLConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**loading.config_fields(config, known, cls.__name__))


class ResnetBlock2D(nnx.Module):
    """diffusers `ResnetBlock2D` without a time embedding (`temb_channels=None`),
    output_scale_factor 1: `x + conv2(silu(norm2(conv1(silu(norm1(x))))))`, the skip
    through a 1x1 `conv_shortcut` when the width changes."""

    def __init__(self, in_channels: int, out_channels: int, *, groups: int, eps: float = 1e-6,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.norm1 = GroupNorm(groups, in_channels, eps=eps, **kw)
        self.conv1 = Conv2d(in_channels, out_channels, 3, padding=1, **kw)
        self.norm2 = GroupNorm(groups, out_channels, eps=eps, **kw)
        self.conv2 = Conv2d(out_channels, out_channels, 3, padding=1, **kw)
        self.conv_shortcut = Conv2d(in_channels, out_channels, 1, **kw) if in_channels != out_channels else None

    def __call__(self, x):
        h = self.conv1(silu(self.norm1(x)))
        h = self.conv2(silu(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + h


class Attention(nnx.Module):
    """diffusers `Attention` as `UNetMidBlock2D` builds it: GroupNorm, one head of width C
    over the H*W positions, `to_out.0`, residual; `rescale_output_factor` 1."""

    def __init__(self, channels: int, *, groups: int, eps: float = 1e-6, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.group_norm = GroupNorm(groups, channels, eps=eps, **kw)
        self.to_q = Linear(channels, channels, **kw)
        self.to_k = Linear(channels, channels, **kw)
        self.to_v = Linear(channels, channels, **kw)
        self.to_out = nnx.List([Linear(channels, channels, **kw)])  # torch: [Linear, Dropout]

    def __call__(self, x):
        b, h, w, c = x.shape
        t = self.group_norm(x).reshape(b, h * w, c)
        o = attention(self.to_q(t), self.to_k(t), self.to_v(t))
        return x + self.to_out[0](o).reshape(b, h, w, c)


class UNetMidBlock2D(nnx.Module):
    """diffusers `UNetMidBlock2D` (num_layers 1): resnet, [attention], resnet."""

    def __init__(self, channels: int, *, groups: int, add_attention: bool, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        kw = dict(groups=groups, dtype=dtype, rngs=rngs)
        self.attentions = nnx.List([Attention(channels, **kw)] if add_attention else [])
        self.resnets = nnx.List([ResnetBlock2D(channels, channels, **kw) for _ in range(2)])

    def __call__(self, x):
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class Upsample2D(nnx.Module):
    """diffusers `Upsample2D(use_conv=True)`: nearest 2x, then a 3x3 `conv`."""

    def __init__(self, channels: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.conv = Conv2d(channels, channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.conv(upsample_nearest2x(x))


class UpDecoderBlock2D(nnx.Module):
    """diffusers `UpDecoderBlock2D`: `num_layers` resnets, then an `Upsample2D` unless last."""

    def __init__(self, in_channels: int, out_channels: int, *, num_layers: int, add_upsample: bool,
                 groups: int, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.resnets = nnx.List([
            ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, groups=groups, dtype=dtype, rngs=rngs)
            for i in range(num_layers)])
        self.upsamplers = nnx.List([Upsample2D(out_channels, dtype=dtype, rngs=rngs)] if add_upsample else [])

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        for up in self.upsamplers:
            x = up(x)
        return x


class Decoder(nnx.Module):
    """diffusers `Decoder` (`norm_type="group"`) on NHWC."""

    def __init__(self, config: AutoencoderKLConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        kw = dict(dtype=dtype, rngs=rngs)
        groups = config.norm_num_groups
        chans = list(reversed(config.block_out_channels))
        self.conv_in = Conv2d(config.latent_channels, chans[0], 3, padding=1, **kw)
        self.mid_block = UNetMidBlock2D(chans[0], groups=groups, add_attention=config.mid_block_add_attention, **kw)
        self.up_blocks = nnx.List([
            UpDecoderBlock2D(chans[max(i - 1, 0)], chans[i], num_layers=config.layers_per_block + 1,
                             add_upsample=i != len(chans) - 1, groups=groups, **kw)
            for i in range(len(chans))])
        self.conv_norm_out = GroupNorm(groups, chans[-1], eps=1e-6, **kw)
        self.conv_out = Conv2d(chans[-1], config.out_channels, 3, padding=1, **kw)

    def __call__(self, x):
        x = self.mid_block(self.conv_in(x))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(silu(self.conv_norm_out(x)))


class AutoencoderKL(nnx.Module):
    """The decoder half of diffusers' `AutoencoderKL`.

    `model(z)` is diffusers' `vae.decode(z).sample` (NCHW in, NCHW out, model dtype);
    `model.decode(latents)` is what FluxPipeline does after its denoise loop (float32
    out, jitted, batch-sharded over the mesh given to `from_pretrained`).
    """

    CLASS_NAMES = ("AutoencoderKL",)

    def __init__(self, config: AutoencoderKLConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = config
        self.dtype = loading.check_dtype(dtype)
        self.mesh = None
        kw = dict(dtype=self.dtype, rngs=rngs)
        c = config.latent_channels
        self.post_quant_conv = Conv2d(c, c, 1, **kw) if config.use_post_quant_conv else None
        self.decoder = Decoder(config, **kw)

    @classmethod
    def from_pretrained(cls, folder, *, dtype=jnp.bfloat16, mesh=None, strict: bool = True) -> "AutoencoderKL":
        """Build from a diffusers `vae/` folder (`config.json`, safetensors); see `loading.py`
        for the checks. `mesh`: parameters replicated on it, decode batches sharded over it."""
        return loading.from_pretrained(cls, AutoencoderKLConfig, folder, dtype=dtype, mesh=mesh, strict=strict)

    def check_latents(self, z):
        """Refuse what is not a `[B, latent_channels, H, W]` floating array."""
        loading.check_latents(z, self.config.latent_channels, ("height", "width"), "NCHW")

    def __call__(self, z):
        """diffusers `AutoencoderKL.decode(z).sample`: `[B, C, h, w]` -> `[B, 3, 8h, 8w]` (FLUX)."""
        self.check_latents(z)
        x = jnp.transpose(z, (0, 2, 3, 1)).astype(self.dtype)
        if self.post_quant_conv is not None:
            x = self.post_quant_conv(x)
        return jnp.transpose(self.decoder(x), (0, 3, 1, 2))

    def unscale(self, latents):
        """FluxPipeline: `latents / scaling_factor + shift_factor` (no shift if None), float32."""
        z = latents.astype(jnp.float32) / self.config.scaling_factor
        return z if self.config.shift_factor is None else z + self.config.shift_factor

    def decode_latents(self, latents):
        return self(self.unscale(latents))

    def decode(self, latents):
        """The pipeline's decode of denoised latents `[B, C, h, w]` (NCHW): un-scale, decode;
        float32 images `[B, 3, H, W]` in about [-1, 1] (not clamped, as diffusers)."""
        self.check_latents(latents)
        return loading.call_jitted(self, "decode_latents", latents, self.mesh)
