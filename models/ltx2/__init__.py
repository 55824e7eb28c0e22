"""LTX-2 (diffusers `LTX2VideoTransformer3DModel`, LTX-2.0 and LTX-2.3) on TPU: single device, TP and SP.

Run it with `difflet_tpu.Runner(model, mesh, config)` (also exported here as
`Runner`): diffusers' forward kwargs in, `(sample, audio_sample)` out. Notes:
docs/models/ltx2.md (the parallel plan and the model-specific mechanisms).
"""

from difflet_tpu.port import Pipeline, port_spec
from difflet_tpu.runner import Runner

from . import config, keys, model, port, schedule
from .config import IGNORED_KEYS, CLASS_NAME, PRESETS, LTX2Config, config_from_diffusers
from .keys import key_map
from .model import PLAN, LTX2VideoTransformer3DModel, build
from .port import example_inputs, flops, latent_shape

SPEC = port_spec(
    config, model, keys, port, name="ltx2", model_class=LTX2VideoTransformer3DModel,
    heads=lambda c: {"num_attention_heads": c.num_attention_heads,
                     "audio_num_attention_heads": c.audio_num_attention_heads},
    released="ltx-2.0", bench_shape=dict(height=480, width=704, frames=49),
    tiny_shape=dict(height=96, width=128, frames=9),
    # The bench's LTX-2 pipeline (difflet_tpu/pipeline/denoise.py, bench.py): 30 steps,
    # classifier-free guidance (batch-2 calls) 3.0 on the video and 7.0 on the
    # audio latents, schedule.schedule shifted by the video token count; the
    # pipeline's audio argument names (schedule.ARG_NAMES).
    pipeline=Pipeline(schedule=lambda steps, inputs, preset: schedule.schedule(
        steps, inputs["hidden_states"].shape[1]), steps=30, guidance=3.0, guidance_mode="cfg",
        latent_keys=("hidden_states", "audio_hidden_states"), latent_guidance={"audio_hidden_states": 7.0},
        arg_names=schedule.ARG_NAMES),
    # The Pallas all-gather kernel under SP on TPU. The reference PR measured its
    # own kernel flat here and kept the ring; this one (with the reduce-scatter
    # kernel at ICI-bound sites and a2v on local rows) estimates 171.6 ms a step
    # at 480x704x49 on a v5e-4 against 266.3 for the JAX rings, which would be
    # slower than TP (255.8). Estimates, docs/ablations.md row 4b.
    ag_default="pallas",
    # Config.sp_cross_local: audio_to_video_attn's q / out projections replicated under SP
    sp_local_plan=model.SP_LOCAL_PLAN,
    # attention: the video stream's block-sparse self-attention ("sta:...", "radial:...",
    # layers/sparse_masks.py); audio and the cross-modal attentions stay dense
    extra_kwargs=("attention",),
)

__all__ = ["SPEC", "IGNORED_KEYS", "CLASS_NAME", "PRESETS", "LTX2Config", "config_from_diffusers", "PLAN",
           "LTX2VideoTransformer3DModel", "build", "key_map", "Runner", "example_inputs", "flops", "latent_shape"]
