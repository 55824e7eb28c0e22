"""LTX-2's vocoder (diffusers `LTX2Vocoder`, `pipelines/ltx2/vocoder.py`, 0.42.1) in JAX,
channels-last: mel spectrogram `[B, C, T, mel_bins]` -> waveform `[B, out_channels, T * prod(upsample_factors)]`.

A HiFi-GAN generator as diffusers writes it: the mel channels and bins flattened to
`C * mel_bins` input channels (channel-major), `conv_in` (k 7), then per upsample layer a
LeakyReLU(`leaky_relu_negative_slope`), a `ConvTranspose1d` (padding `(k - stride) / 2`) and the
mean of `len(resnet_kernel_sizes)` residual blocks (each: for every dilation, LeakyReLU, dilated
"same" conv, LeakyReLU, conv, added back), then `act_out` (torch's default LeakyReLU slope 0.01),
`conv_out` (k 7) and tanh (`final_act_fn`).

Not implemented (refused by name at load): the snake / snakebeta activations and the anti-aliased
activations (`act_fn`, `antialias`), i.e. LTX-2.3's `LTX2VocoderWithBWE` path; LTX-2.0's vocoder
uses neither. Parameters replicated on a mesh; the batch is sharded over it when it divides.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.vae import loading
from difflet_tpu.vae.layers import fp32, param

CLASS_NAME = "LTX2Vocoder"


@dataclass(frozen=True)
class LTX2VocoderConfig:
    in_channels: int = 128
    hidden_channels: int = 1024
    out_channels: int = 2
    upsample_kernel_sizes: tuple = (16, 15, 8, 4, 4)
    upsample_factors: tuple = (6, 5, 2, 2, 2)
    resnet_kernel_sizes: tuple = (3, 7, 11)
    resnet_dilations: tuple = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    act_fn: str = "leaky_relu"
    leaky_relu_negative_slope: float = 0.1
    antialias: bool = False
    antialias_ratio: int = 2
    antialias_kernel_size: int = 12
    final_act_fn: str | None = "tanh"
    final_bias: bool = True
    output_sampling_rate: int = 24000

    def __post_init__(self):
        if self.act_fn != "leaky_relu" or self.antialias:
            raise ValueError(f"LTX2Vocoder: act_fn={self.act_fn!r}, antialias={self.antialias} is not implemented "
                             "(leaky_relu without antialias, LTX-2.0's vocoder)")
        if self.final_act_fn not in ("tanh", "clamp", None):
            raise ValueError(f"LTX2Vocoder: final_act_fn {self.final_act_fn!r} is not tanh, clamp or None")
        if len(self.upsample_kernel_sizes) != len(self.upsample_factors):
            raise ValueError("LTX2Vocoder: upsample_kernel_sizes and upsample_factors differ in length")
        if len(self.resnet_kernel_sizes) != len(self.resnet_dilations):
            raise ValueError("LTX2Vocoder: resnet_kernel_sizes and resnet_dilations differ in length")

    @classmethod
    def from_dict(cls, d: dict) -> "LTX2VocoderConfig":
        kw = loading.config_fields(d, {f.name for f in fields(cls)}, CLASS_NAME)
        tup = lambda v: tuple(tup(x) for x in v) if isinstance(v, list) else v
        return cls(**{k: tup(v) for k, v in kw.items()})


def leaky_relu(x, slope):
    return jnp.where(x >= 0, x, x * slope)


class Conv1d(nnx.Module):
    """torch `nn.Conv1d` on `[B, T, C]`, symmetric padding `padding` (or "same" for `dilation`)."""

    def __init__(self, in_channels, out_channels, k, *, dilation=1, padding=None, bias=True, dtype, rngs):
        total = dilation * (k - 1)
        self.pad = (padding, padding) if padding is not None else (total // 2, total - total // 2)
        self.dilation = dilation
        self.kernel = param(rngs, (k, in_channels, out_channels), dtype, torch_leaf="weight",
                            torch_shape=(out_channels, in_channels, k), torch_layout="conv")
        self.bias = param(rngs, (out_channels,), dtype, torch_leaf="bias", torch_shape=(out_channels,),
                          torch_layout="same", init="zeros") if bias else None

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(x, self.kernel[...].astype(x.dtype), (1,), [self.pad],
                                         rhs_dilation=(self.dilation,), dimension_numbers=("NWC", "WIO", "NWC"),
                                         preferred_element_type=fp32(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y.astype(x.dtype)


class ConvTranspose1d(nnx.Module):
    """torch `nn.ConvTranspose1d(in, out, k, stride, padding)` on `[B, T, C]`: the input dilated
    by `stride`, padded `k - 1 - padding` each side, convolved with the flipped kernel. torch's
    weight is `[in, out, k]` (kept as is)."""

    def __init__(self, in_channels, out_channels, k, stride, padding, *, dtype, rngs):
        self.stride, self.padding, self.k = stride, padding, k
        self.weight = param(rngs, (in_channels, out_channels, k), dtype, torch_leaf="weight",
                            torch_shape=(in_channels, out_channels, k), torch_layout="same")
        self.bias = param(rngs, (out_channels,), dtype, torch_leaf="bias", torch_shape=(out_channels,),
                          torch_layout="same", init="zeros")

    def __call__(self, x):
        kernel = jnp.flip(self.weight[...], -1).transpose(2, 0, 1).astype(x.dtype)  # [k, in, out]
        p = self.k - 1 - self.padding
        y = jax.lax.conv_general_dilated(x, kernel, (1,), [(p, p)], lhs_dilation=(self.stride,),
                                         dimension_numbers=("NWC", "WIO", "NWC"), preferred_element_type=fp32(x.dtype))
        return (y + self.bias[...].astype(y.dtype)).astype(x.dtype)


class ResBlock(nnx.Module):
    def __init__(self, channels, k, dilations, slope, *, dtype, rngs):
        self.slope = slope
        self.convs1 = nnx.List([Conv1d(channels, channels, k, dilation=d, dtype=dtype, rngs=rngs) for d in dilations])
        self.convs2 = nnx.List([Conv1d(channels, channels, k, dtype=dtype, rngs=rngs) for _ in dilations])

    def __call__(self, x):
        # diffusers' acts2 for leaky_relu are the last acts1 module: LeakyReLU(slope) too
        for conv1, conv2 in zip(self.convs1, self.convs2):
            x = x + conv2(leaky_relu(conv1(leaky_relu(x, self.slope)), self.slope))
        return x


class LTX2Vocoder(nnx.Module):
    """`model(mel)`: diffusers `vocoder(mel)` (`[B, C, T, mel_bins]` -> `[B, out_channels, samples]`);
    `model.vocode(mel)` the same jitted, float32, checked finite; `sample_rate` its output rate."""

    CLASS_NAMES = (CLASS_NAME,)

    def __init__(self, config: LTX2VocoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        c = self.config = config
        self.dtype = loading.check_dtype(dtype)
        self.mesh = None
        kw = dict(dtype=self.dtype, rngs=rngs)
        self.conv_in = Conv1d(c.in_channels, c.hidden_channels, 7, padding=3, **kw)
        ups, resnets = [], []
        channels = c.hidden_channels
        for stride, k in zip(c.upsample_factors, c.upsample_kernel_sizes):
            ups.append(ConvTranspose1d(channels, channels // 2, k, stride, (k - stride) // 2, **kw))
            channels //= 2
            for rk, dilations in zip(c.resnet_kernel_sizes, c.resnet_dilations):
                resnets.append(ResBlock(channels, rk, dilations, c.leaky_relu_negative_slope, **kw))
        self.upsamplers, self.resnets = nnx.List(ups), nnx.List(resnets)
        self.conv_out = Conv1d(channels, c.out_channels, 7, padding=3, bias=c.final_bias, **kw)

    @classmethod
    def from_pretrained(cls, folder, *, dtype=jnp.float32, mesh=None, strict: bool = True):
        return loading.from_pretrained(cls, LTX2VocoderConfig, folder, dtype=dtype, mesh=mesh, strict=strict)

    @property
    def sample_rate(self) -> int:
        return self.config.output_sampling_rate

    def __call__(self, mel):
        c = self.config
        b, ch, t, bins = mel.shape
        if ch * bins != c.in_channels:
            raise ValueError(f"LTX2Vocoder: mel {tuple(mel.shape)} has {ch} x {bins} channels x bins, "
                             f"expected {c.in_channels} in all")
        x = jnp.transpose(mel, (0, 2, 1, 3)).reshape(b, t, ch * bins).astype(self.dtype)  # channel-major
        x = self.conv_in(x)
        n = len(c.resnet_kernel_sizes)
        for i, up in enumerate(self.upsamplers):
            x = up(leaky_relu(x, c.leaky_relu_negative_slope))
            x = sum(self.resnets[j](x) for j in range(i * n, (i + 1) * n)) / n
        x = self.conv_out(leaky_relu(x, 0.01))
        if c.final_act_fn == "tanh":
            x = jnp.tanh(x)
        elif c.final_act_fn == "clamp":
            x = jnp.clip(x, -1.0, 1.0)
        return jnp.transpose(x, (0, 2, 1))

    def vocode(self, mel):
        """float32 waveform `[B, out_channels, T * prod(upsample_factors)]`."""
        if getattr(mel, "ndim", 0) != 4:
            raise ValueError(f"LTX2Vocoder: mel must be [batch, channels, frames, mel_bins], got "
                             f"{tuple(getattr(mel, 'shape', ()))}")
        return loading.call_jitted(self, "__call__", mel, self.mesh)
