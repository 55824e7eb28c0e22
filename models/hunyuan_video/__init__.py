"""HunyuanVideo (diffusers `HunyuanVideoTransformer3DModel`, T2V and the two I2V
conditioning types) on TPU slices: one device, TP, SP. See docs/models/hunyuan_video.md."""

from .checkpoint_keys import key_map
from .config import IGNORED_KEYS, PRESETS, HunyuanVideoConfig, config_from_diffusers
from .model import Geometry, HunyuanVideoTransformer3DModel, build, packed_order, patchify, rope_tables, unpatchify
from .plan import PLAN
from .runner import AG_DEFAULT, Runner, example_inputs, flops, latent_shape

__all__ = ["AG_DEFAULT", "Geometry", "HunyuanVideoConfig", "HunyuanVideoTransformer3DModel", "IGNORED_KEYS", "PLAN", "PRESETS",
           "Runner", "build", "config_from_diffusers", "example_inputs", "flops", "key_map", "latent_shape",
           "packed_order", "patchify", "rope_tables", "unpatchify"]
