"""Wan 2.1 / 2.2 (diffusers `WanTransformer3DModel`) on TPU: one device, TP and SP.

The port contract (docs/porting.md): `config_from_diffusers`, `PRESETS`,
`build`, `PLAN`, `key_map`, `Runner`, `example_inputs`, `flops`; plus the
text K/V cache (`Runner.encode_text`), the Wan2.2 two-expert pipelines
(`WanExperts`, `load_experts`, `EXPERT_BOUNDARY`) and the layout helpers.
See docs/models/wan.md.
"""

from difflet_tpu.models.wan.config import (EXPERT_BOUNDARY, IGNORED_KEYS, PRESETS, WanConfig,
                                           config_from_diffusers, preset)
from difflet_tpu.models.wan.model import PLAN, WanTransformer3DModel, build, key_map
from difflet_tpu.models.wan.runner import (Runner, WanExperts, example_inputs, flops, load_experts,
                                           patchify, rope_tables, unpatchify)

__all__ = ["EXPERT_BOUNDARY", "IGNORED_KEYS", "PLAN", "PRESETS", "Runner", "WanConfig", "WanExperts",
           "WanTransformer3DModel", "build", "config_from_diffusers", "example_inputs", "flops",
           "key_map", "load_experts", "patchify", "preset", "rope_tables", "unpatchify"]
