"""Flax ports of diffusers DiTs, installed as `difflet_tpu.models` (never top-level `models`).

REGISTRY maps a diffusers `_class_name` to its port module. Each port module
provides: `config_from_diffusers(cfg, *, split_rope=True)`, `PRESETS`,
`build(config, *, dtype, rngs)`, `PLAN`, `key_map(config, model)` and a
`Runner` (see docs/porting.md).
"""

REGISTRY = {
    "FluxTransformer2DModel": "difflet_tpu.models.flux",
    "WanTransformer3DModel": "difflet_tpu.models.wan",
    "HunyuanVideoTransformer3DModel": "difflet_tpu.models.hunyuan_video",
    "LTX2VideoTransformer3DModel": "difflet_tpu.models.ltx2",
}
