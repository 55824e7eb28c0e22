"""VAE decoders (latents -> images / video) in JAX, loaded from diffusers `vae/` folders; the
causal-3D family's encoder (video -> latents) on request.

- `autoencoder_kl.AutoencoderKL`: diffusers `AutoencoderKL` (FLUX.1, Stable Diffusion).
- `causal3d.AutoencoderKLCausal3D`: the causal-3D family, diffusers
  `AutoencoderKLQwenImage` and `AutoencoderKLWan` (Wan 2.1 and 2.2).
- `hunyuan_video.AutoencoderKLHunyuanVideo`: diffusers `AutoencoderKLHunyuanVideo`.
- `ltx2_video.AutoencoderKLLTX2Video`: LTX-2's video VAE decoder (diffusers `AutoencoderKLLTX2Video`).
- `ltx2_audio.AutoencoderKLLTX2Audio`: LTX-2's audio VAE decoder (latents -> mel spectrogram), and
  `ltx2_vocoder.LTX2Vocoder` (mel -> waveform; diffusers `pipelines/ltx2/vocoder.py`).

`from_pretrained(folder)` picks the class by `config.json`'s `_class_name`. Each model's
`decode(latents)` does what its diffusers pipeline does after the denoise loop;
`AutoencoderKLCausal3D.encode(video)` (with `from_pretrained(..., encoder=True)`) what the
Wan image-to-video pipelines do to their condition video before `scale`.
"""

from __future__ import annotations

import jax.numpy as jnp

from difflet_tpu.vae.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from difflet_tpu.vae.causal3d import AutoencoderKLCausal3D, Causal3DConfig
from difflet_tpu.vae.hunyuan_video import AutoencoderKLHunyuanVideo, HunyuanVideoVAEConfig
from difflet_tpu.vae.loading import WeightsError, read_config
from difflet_tpu.vae.ltx2_audio import AutoencoderKLLTX2Audio, LTX2AudioVAEConfig
from difflet_tpu.vae.ltx2_video import AutoencoderKLLTX2Video, LTX2VideoVAEConfig
from difflet_tpu.vae.ltx2_vocoder import LTX2Vocoder, LTX2VocoderConfig

CLASSES = {name: cls for cls in (AutoencoderKL, AutoencoderKLCausal3D, AutoencoderKLHunyuanVideo, AutoencoderKLLTX2Video,
                                 AutoencoderKLLTX2Audio, LTX2Vocoder) for name in cls.CLASS_NAMES}


def from_pretrained(folder, *, dtype=jnp.bfloat16, mesh=None, strict: bool = True, encoder: bool = False):
    """The VAE decoder of a diffusers `vae/` folder, by its config's `_class_name`; with
    `encoder`, also the encoder half (causal-3D classes only)."""
    name = read_config(folder, tuple(CLASSES)).get("_class_name")
    if name is None:
        raise WeightsError(f"{folder}: config.json has no _class_name; use a class's from_pretrained")
    if not encoder:
        return CLASSES[name].from_pretrained(folder, dtype=dtype, mesh=mesh, strict=strict)
    if CLASSES[name] is not AutoencoderKLCausal3D:
        raise ValueError(f"{folder}: encoder=True: the {name} encoder is not implemented (causal-3D VAEs only)")
    return AutoencoderKLCausal3D.from_pretrained(folder, dtype=dtype, mesh=mesh, strict=strict, encoder=True)


__all__ = ["AutoencoderKL", "AutoencoderKLConfig", "AutoencoderKLCausal3D", "AutoencoderKLHunyuanVideo",
           "AutoencoderKLLTX2Audio", "AutoencoderKLLTX2Video", "Causal3DConfig", "HunyuanVideoVAEConfig",
           "LTX2AudioVAEConfig", "LTX2VideoVAEConfig", "LTX2Vocoder", "LTX2VocoderConfig", "WeightsError",
           "from_pretrained"]
