"""FLUX.1 (diffusers `FluxTransformer2DModel`, dev and schnell) on TPU slices: one device, TP, SP.

Run it with `difflet_tpu.Runner(model, mesh, config)`; notes: docs/models/flux.md.
"""

from difflet_tpu.port import Pipeline, port_spec
from difflet_tpu.runner import Runner

from . import config, keys, model, port, schedule
from .config import IGNORED_KEYS, CLASS_NAME, PRESETS, FluxConfig, config_from_diffusers
from .keys import key_map
from .port import example_inputs, flops
from .model import PLAN, FluxTransformer2DModel, build

SPEC = port_spec(
    config, model, keys, port, name="flux", model_class=FluxTransformer2DModel,
    released="flux.1-dev", bench_shape=dict(height=1024, width=1024, frames=1),
    tiny_shape=dict(height=64, width=96, frames=1),
    # FluxPipeline: 28 steps, guidance 3.5 embedded (dev), timestep / 1000.
    pipeline=Pipeline(schedule=lambda steps, inputs, preset: schedule.schedule(
        steps, inputs["hidden_states"].shape[1]), steps=28, guidance=3.5, guidance_mode="embedded",
        timestep_scale=1e-3),
    # The Pallas all-gather kernel under SP on TPU: the reference PR measured
    # 156.5 -> 140.6 ms a step at 1024x1024 on v5e-4.
    ag_default="pallas",
)

__all__ = ["SPEC", "IGNORED_KEYS", "CLASS_NAME", "PRESETS", "FluxConfig", "config_from_diffusers", "key_map", "Runner",
           "example_inputs", "flops", "PLAN", "FluxTransformer2DModel", "build"]
