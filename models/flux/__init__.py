"""FLUX.1 (diffusers `FluxTransformer2DModel`, dev and schnell) on TPU slices: one device, TP, SP.

The port contract (docs/porting.md): `config_from_diffusers`, `PRESETS`,
`build`, `PLAN` (with its table in transformer_flux.py), `key_map`, `Runner`,
`example_inputs`, `flops`. Notes: docs/models/flux.md.
"""

from .config import CLASS_NAME, IGNORED_KEYS, PRESETS, FluxConfig, config_from_diffusers
from .keys import key_map
from .runner import Runner, example_inputs, flops
from .transformer_flux import PLAN, FluxTransformer2DModel, build, rope_tables, single_block_row_order

__all__ = ["CLASS_NAME", "IGNORED_KEYS", "PRESETS", "FluxConfig", "config_from_diffusers", "key_map", "Runner", "example_inputs",
           "flops", "PLAN", "FluxTransformer2DModel", "build", "rope_tables", "single_block_row_order"]
