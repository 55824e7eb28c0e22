"""LTX-2 (diffusers `LTX2VideoTransformer3DModel`) on TPU: single device, TP and SP.

Exports the port contract of docs/porting.md; docs/models/ltx2.md has the
parallel plan and the model-specific mechanisms.
"""

from .config import IGNORED_KEYS, PRESETS, LTX2Config, config_from_diffusers
from .model import PLAN, LTX2VideoTransformer3DModel, build, key_map
from .runner import AG_DEFAULT, Runner, example_inputs, flops, latent_shape

__all__ = ["IGNORED_KEYS", "PRESETS", "LTX2Config", "config_from_diffusers", "PLAN", "LTX2VideoTransformer3DModel", "build",
           "key_map", "Runner", "example_inputs", "flops", "latent_shape", "AG_DEFAULT"]
