"""Wan 2.1 / 2.2 (diffusers `WanTransformer3DModel`) on TPU: one device, TP and SP.

Run it with `difflet_tpu.Runner(model, mesh, config)` (also `wan.Runner`); the
port adds the text K/V cache (`Runner.encode_text`, `Runner.text_kv_shapes`,
`Runner(..., cache_text=True)`) and the Wan2.2 two-expert pipelines
(`WanExperts`, `load_experts`; boundaries in `EXPERT_BOUNDARY` = `SPEC.experts`).
Notes: docs/models/wan.md.
"""

from difflet_tpu.port import Pipeline, port_spec
from difflet_tpu.runner import Runner

from . import config, keys, model, port, schedule
from .config import (IGNORED_KEYS, CLASS_NAME, EXPERT_BOUNDARY, FLOW_SHIFT, FLOW_SHIFTS, PRESETS, WanConfig,
                     config_from_diffusers, preset)
from .keys import key_map
from .model import PLAN, WanTransformer3DModel, build
from .port import (WanExperts, encode_text, example_inputs, flops, load_experts, patchify, text_kv_shapes,
                   unpatchify)
from .rope import rope_tables

SPEC = port_spec(
    config, model, keys, port, name="wan", model_class=WanTransformer3DModel,
    released="Wan2.1-T2V-14B", bench_shape=dict(height=480, width=832, frames=9),
    tiny_shape=dict(height=64, width=96, frames=9),
    # WanPipeline: 50 steps of its folders' UniPC scheduler, classifier-free guidance 5.0
    # (batch 2), the flow shift per checkpoint (config.FLOW_SHIFTS); Wan2.2-A14B's expert switch.
    pipeline=Pipeline(schedule=lambda steps, inputs, preset: schedule.schedule(
        steps, FLOW_SHIFTS.get(preset, FLOW_SHIFT)), steps=50, guidance=5.0, guidance_mode="cfg",
        expert=schedule.expert, arg_names=schedule.ARG_NAMES),
    # The Pallas all-gather kernel under SP on TPU (the reference PR's default for Wan).
    ag_default="pallas",
    experts=EXPERT_BOUNDARY,
    # cache_text: reuse the text K/V while the calls pass the very same
    # encoder_hidden_states (and image) objects (a denoise loop).
    options=dict(cache_text=False),
    # text_kv: encode_text's cache instead of encoder_hidden_states; attention: block-sparse
    # self-attention ("sta:...", "radial:...", layers/sparse_masks.py)
    extra_kwargs=("text_kv", "attention"),
    methods=dict(encode_text=encode_text, text_kv_shapes=text_kv_shapes),
    # Config.sp_cross_local: attn2's q / out projections replicated under SP
    sp_local_plan=model.SP_LOCAL_PLAN,
)

__all__ = ["SPEC", "IGNORED_KEYS", "CLASS_NAME", "EXPERT_BOUNDARY", "FLOW_SHIFT", "FLOW_SHIFTS", "PLAN", "PRESETS", "Runner",
           "WanConfig", "WanExperts", "WanTransformer3DModel", "build", "config_from_diffusers",
           "example_inputs", "flops", "key_map", "load_experts", "patchify", "preset", "rope_tables",
           "unpatchify"]
