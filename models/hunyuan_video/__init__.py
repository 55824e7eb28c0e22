"""HunyuanVideo (diffusers `HunyuanVideoTransformer3DModel`, T2V and the two I2V
conditioning types) on TPU slices: one device, TP, SP.

Run it with `difflet_tpu.Runner(model, mesh, config)`; notes: docs/models/hunyuan_video.md.
"""

from difflet_tpu import schedulers
from difflet_tpu.port import Pipeline, PortSpec
from difflet_tpu.runner import Runner

from .config import IGNORED_KEYS, CLASS_NAME, PRESETS, HunyuanVideoConfig, config_from_diffusers
from .keys import key_map
from .model import PLAN, Geometry, HunyuanVideoTransformer3DModel, build, patchify, unpatchify
from .port import FORWARD_ARGS, example_inputs, flops, forward, latent_shape, prepare, runner_geometry
from .rope import rope_tables

# The Pallas all-gather kernel under SP on TPU (the reference PR measured 478.0 ms
# vs 500.7 ms for the ring at 320x512x61); off TPU the JAX ring.
AG_DEFAULT = "pallas"

SPEC = PortSpec(
    name="hunyuan_video",
    class_names=(CLASS_NAME,),
    model_class=HunyuanVideoTransformer3DModel,
    config_from_diffusers=config_from_diffusers,
    presets=PRESETS,
    build=build,
    plan=PLAN,
    key_map=key_map,
    prepare=prepare,
    forward=forward,
    forward_args=FORWARD_ARGS,
    heads=lambda c: {"num_attention_heads": c.num_attention_heads},
    released="hunyuan-video",
    bench_shape=dict(height=320, width=512, frames=61),
    tiny_shape=dict(height=64, width=96, frames=9),
    example_inputs=example_inputs,
    flops=flops,
    # HunyuanVideoPipeline: 50 steps, embedded guidance 6.0 (passed x1000), timesteps
    # as the scheduler gives them (0..1000).
    pipeline=Pipeline(schedule=lambda steps, inputs, preset: schedulers.hunyuan_video_schedule(steps),
                      steps=50, guidance=6.0, guidance_mode="embedded", guidance_mult=1000.0),
    ag_default=AG_DEFAULT,
    methods={"geometry": runner_geometry},
    ignored_keys=IGNORED_KEYS,  # diffusers' _keys_to_ignore_on_load_unexpected
)

__all__ = ["AG_DEFAULT", "SPEC", "CLASS_NAME", "Geometry", "HunyuanVideoConfig", "HunyuanVideoTransformer3DModel",
           "PLAN", "PRESETS", "Runner", "build", "config_from_diffusers", "example_inputs", "flops", "key_map",
           "latent_shape", "patchify", "rope_tables", "unpatchify"]
