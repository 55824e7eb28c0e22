"""Prompt -> video: what the video pipelines add to the image frame (difflet_tpu.pipeline.diffusion).

The loading, folder checks, argument refusals, scale and count checks, the encoders' home, the
denoise loop and the timings are `DiffusionPipeline`'s. A video pipeline adds diffusers'
video rules and outputs:

- `num_frames` as diffusers' Wan pipelines take it: `num_frames - 1` must divide by the VAE's
  temporal factor (4); another count is rounded down to one that does, with diffusers' warning
  (`check_frames`), and the count made is in `Call.num_frames`.
- height and width rounded down to multiples of the VAE's spatial factor times the patch size,
  with diffusers' warning (`check_video_size`).
- unpacked latents `[B, C, T, h, w]` in float32 (`initial_video_latents`), as diffusers'
  `prepare_latents` draws them.
- the decode: `vae.decode_video` (spread over the mesh when the batch does not split over it:
  difflet_tpu/vae/spread.py), then diffusers' `VideoProcessor.postprocess_video`: `"np"` float32
  `[B, F, H, W, 3]` in [0, 1], `"pil"` a list (per video) of lists of PIL frames; for `"pil"` (and
  files) the frames leave the devices as uint8, a quarter of float32's bytes (`round(255 x)`, as
  diffusers' `numpy_to_pil`). A non-finite video is an error, checked on the devices before the
  conversion could hide it.
- `VideoPipelineOutput.frames`, and `fps` (the frame rate the model was trained for, what
  `difflet_tpu.generate` writes the MP4 at).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from difflet_tpu import arguments as A
from difflet_tpu import checks
from difflet_tpu.parallel import distributed
from difflet_tpu.pipeline import diffusion as D
from difflet_tpu.pipeline.diffusion import PipelineError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class VideoPipelineOutput:
    """diffusers' `WanPipelineOutput`: `frames` is float32 `[B, F, H, W, 3]` in [0, 1] (`"np"`), a
    list of lists of PIL images (`"pil"`), or the latents `[B, C, T, h, w]` (`"latent"`). `stats`:
    what the call did (transformer passes, step cache: difflet_tpu.pipeline.caching)."""

    frames: Any
    stats: dict = dataclasses.field(default_factory=dict)


@jax.jit
def _to_unit(video):
    """[B, 3, F, H, W] in [-1, 1] -> float32 [B, F, H, W, 3] in [0, 1] (`postprocess_video`'s "np")."""
    return jnp.clip(jnp.moveaxis(video, 1, -1) * 0.5 + 0.5, 0.0, 1.0)


class VideoPipeline(D.DiffusionPipeline):
    """Base of the text/image-to-video pipelines; `DiffusionPipeline.from_pretrained` picks the subclass."""

    default_height = 480
    default_width = 832
    default_num_frames = 81
    fps = 16

    @property
    def vae_scale_factor_temporal(self) -> int:
        """diffusers' `vae.config.scale_factor_temporal`: 2 per temporal downsample (4)."""
        return 2 ** sum(self.vae.config.temperal_downsample)

    @property
    def vae_scale_factor_spatial(self) -> int:
        """diffusers' `vae.config.scale_factor_spatial`: 2 per downsample times the VAE's patch
        (Wan 2.1: 8; Wan 2.2's 48-channel VAE, patch 2: 16)."""
        return 2 ** len(self.vae.config.temperal_downsample) * (self.vae.config.patch_size or 1)

    def check_frames(self, num_frames) -> int:
        """diffusers: `num_frames - 1` must divide by the temporal factor; otherwise rounded down
        (`num_frames // 4 * 4 + 1`) with a warning, at least 1."""
        n = A.count("num_frames", num_frames, "frames")
        ft = self.vae_scale_factor_temporal
        if n % ft != 1:
            made = max(n // ft * ft + 1, 1)
            logger.warning("`num_frames - 1` has to be divisible by %d. Rounding to the nearest number: %d frames "
                           "instead of %d.", ft, made, n)
            n = made
        return n

    def check_video_size(self, height, width, patch: tuple[int, int]) -> tuple[int, int]:
        """diffusers' Wan pipelines: height and width must divide by 16 (`check_inputs`), then are
        rounded down to multiples of the spatial factor times the patch (with a warning)."""
        height, width = A.size("height", height, 16), A.size("width", width, 16)  # diffusers' check_inputs
        fs = self.vae_scale_factor_spatial
        mh, mw = fs * patch[0], fs * patch[1]
        h, w = int(height) // mh * mh, int(width) // mw * mw
        if h == 0 or w == 0:
            raise PipelineError(f"height x width {height} x {width} is below one patch ({mh} x {mw} pixels)")
        if (h, w) != (height, width):
            logger.warning("`height` and `width` must be multiples of (%d, %d) for proper patchification. "
                           "Adjusting (%d, %d) -> (%d, %d).", mh, mw, height, width, h, w)
        return h, w

    @staticmethod
    def check_video_output_type(output_type) -> str:
        if output_type not in ("np", "pil", "latent"):
            raise PipelineError(f"`output_type` must be 'np', 'pil' or 'latent', got {output_type!r}")
        return output_type

    def latent_shape(self, batch: int, channels: int, num_frames: int, height: int, width: int) -> tuple:
        ft, fs = self.vae_scale_factor_temporal, self.vae_scale_factor_spatial
        return (batch, channels, (num_frames - 1) // ft + 1, height // fs, width // fs)

    @staticmethod
    def initial_video_latents(latents, seed, shape: tuple):
        """The given latents (checked: `shape`, finite, floating) as float32, or N(0, 1) float32
        from `seed` (`jax.random`; torch's generators cannot be matched, so parity tests pass
        `latents=`)."""
        if latents is not None:
            return jnp.asarray(A.latents(latents, shape), jnp.float32)
        seed = int(np.random.SeedSequence().generate_state(1)[0]) if seed is None else A.seed(seed)
        return jax.random.normal(jax.random.key(seed), shape, jnp.float32)

    def decode_frames(self, latents, output_type: str):
        """The VAE's decode of the denoised latents, then diffusers' `postprocess_video`."""
        self._stage("decode")
        start = time.perf_counter()
        # the VAE refuses a non-finite decode on the devices, before any uint8 conversion could hide it
        # (the whole array on every process of a multi-process mesh)
        if output_type == "pil":
            frames = self.with_room(lambda: distributed.fetch(self.vae.decode_video(latents, uint8=True)), "decode")
        else:
            frames = self.with_room(lambda: distributed.fetch(_to_unit(self.vae.decode_video(latents))), "decode")
        self.timings.decode = time.perf_counter() - start
        if output_type == "pil":
            from PIL import Image

            return [[Image.fromarray(f) for f in video] for video in frames]
        return frames

    def finish(self, latents, output_type: str, return_dict: bool):
        """The output as diffusers returns it: the latents (checked finite: a non-finite result is
        a failure of the denoise, named so) or the decoded frames."""
        checks.check_finite(latents, "the latents after the denoise (the transformer's steps)")
        self.final_latents = latents
        frames = latents if output_type == "latent" else self.decode_frames(latents, output_type)
        return VideoPipelineOutput(frames=frames) if return_dict else (frames,)
