"""Qwen-Image (diffusers `QwenImageTransformer2DModel`: Qwen-Image, -Edit, -Edit-2511's
zero_cond_t, -Layered's flags) on TPU slices: one device, TP, SP.

Run it with `difflet_tpu.Runner(model, mesh, config)`; notes: docs/models/qwen_image.md.
"""

from difflet_tpu.port import Pipeline, port_spec
from difflet_tpu.runner import Runner

from . import config, keys, model, port
from .config import IGNORED_KEYS, CLASS_NAME, PRESETS, QwenImageConfig, config_from_diffusers
from .keys import key_map
from .model import PLAN, QwenImageTransformer2DModel, build, time_proj
from .port import example_inputs, flops, image_shapes
from .rope import joint_tables
from .schedule import SCHEDULER, schedule

# Under SP on TPU the image stream's all-gathers (to_q/to_k/to_v, img_mlp.net.0.proj)
# run the Pallas all-gather-matmul kernel by default: in the deviceless v5e:2x2
# compile at 1024x1024 it is the cheaper choice at both sites (estimated 207 ms a step
# against 274 ms for the JAX rings with concat assembly and 233 ms with dus assembly;
# docs/models/qwen_image.md). The reference PR measured the kernel 1% slower than the
# ring on a v5e-4 (179.7 vs 178.0 ms); DIFFLET_TPU_SP_KERNEL=jax picks the ring. The
# text stream's MLP takes plain collectives on TPU (`parallel.site_plan.plain_collective_pays`).
AG_DEFAULT = "pallas"

SPEC = port_spec(
    config, model, keys, port, name="qwen_image", model_class=QwenImageTransformer2DModel,
    released="qwen-image", bench_shape=dict(height=1024, width=1024, frames=1),
    tiny_shape=dict(height=64, width=96, frames=1),
    # QwenImagePipeline: 50 steps, true CFG (true_cfg_scale 4.0, a negative prompt) as one
    # batch-2 call with rows [negative, positive], timestep / 1000.
    pipeline=Pipeline(schedule=lambda steps, inputs, preset: schedule(steps, inputs["hidden_states"].shape[1]),
                      steps=50, guidance=4.0, guidance_mode="cfg", timestep_scale=1e-3, cfg_rescale=True),
    ag_default=AG_DEFAULT,
)

__all__ = ["AG_DEFAULT", "SCHEDULER", "SPEC", "IGNORED_KEYS", "CLASS_NAME", "PLAN", "PRESETS", "QwenImageConfig",
           "QwenImageTransformer2DModel", "Runner", "build", "config_from_diffusers", "example_inputs", "flops",
           "image_shapes", "joint_tables", "key_map", "schedule", "time_proj"]
