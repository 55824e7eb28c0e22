"""HunyuanVideo (diffusers `HunyuanVideoTransformer3DModel`, T2V and the two I2V
conditioning types) on TPU slices: one device, TP, SP.

Run it with `difflet_tpu.Runner(model, mesh, config)`; notes: docs/models/hunyuan_video.md.
"""

from difflet_tpu.port import Pipeline, port_spec
from difflet_tpu.runner import Runner

from . import config, keys, model, port, schedule
from .config import IGNORED_KEYS, CLASS_NAME, PRESETS, HunyuanVideoConfig, config_from_diffusers
from .keys import key_map
from .model import PLAN, Geometry, HunyuanVideoTransformer3DModel, build, unpatchify
from .port import example_inputs, flops, latent_shape, patchify, runner_geometry
from .rope import rope_tables

# The Pallas all-gather kernel under SP on TPU (the reference PR measured 478.0 ms
# vs 500.7 ms for the ring at 320x512x61); off TPU the JAX ring.
AG_DEFAULT = "pallas"

SPEC = port_spec(
    config, model, keys, port, name="hunyuan_video", model_class=HunyuanVideoTransformer3DModel,
    released="hunyuan-video", bench_shape=dict(height=320, width=512, frames=61),
    tiny_shape=dict(height=64, width=96, frames=9),
    # HunyuanVideoPipeline: 50 steps, embedded guidance 6.0 (passed x1000), timesteps
    # as the scheduler gives them (0..1000).
    pipeline=Pipeline(schedule=lambda steps, inputs, preset: schedule.schedule(steps),
                      steps=50, guidance=6.0, guidance_mode="embedded", guidance_mult=1000.0),
    ag_default=AG_DEFAULT,
    methods={"geometry": runner_geometry},
    # attention: block-sparse video self-attention ("sta:...", "radial:...", layers/sparse_masks.py)
    extra_kwargs=("attention",),
)

__all__ = ["AG_DEFAULT", "SPEC", "IGNORED_KEYS", "CLASS_NAME", "Geometry", "HunyuanVideoConfig",
           "HunyuanVideoTransformer3DModel", "PLAN", "PRESETS", "Runner", "build", "config_from_diffusers",
           "example_inputs", "flops", "key_map", "latent_shape", "patchify", "rope_tables", "unpatchify"]
