"""WanPipeline's scheduler and Wan2.2-A14B's expert switch.

The scheduler: the Wan-AI `*-Diffusers` folders ship diffusers' `UniPCMultistepScheduler`
(`scheduler/scheduler_config.json`: flow_prediction with flow sigmas, solver_order 2, bh2,
lower_order_final, final sigma 0) with a static `flow_shift` (config.FLOW_SHIFTS per checkpoint:
3.0 for 480p, 5.0 for 720p). `schedule` is that run as a sampler (difflet_tpu.pipeline.unipc):
sigmas linspace(1, 1/1000, N + 1)[:-1] shifted, timesteps int(1000 sigma), and the
predictor-corrector step. The switch: the high-noise expert (`transformer`) while
`t >= boundary_ratio * 1000`, the low-noise one (`transformer_2`) after; `WanExperts` and the
denoise loop (through `SPEC.pipeline.expert`) both use `expert`.
"""

from difflet_tpu.pipeline import unipc

from .config import NUM_TRAIN_TIMESTEPS

# WanPipeline's argument names -> the transformer's (`--embeddings` files)
ARG_NAMES = {"image_embeds": "encoder_hidden_states_image"}

# the fields of the Wan-AI *-Diffusers `scheduler/scheduler_config.json` that shape the run
SCHEDULER = dict(_class_name="UniPCMultistepScheduler", num_train_timesteps=NUM_TRAIN_TIMESTEPS,
                 prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, solver_order=2,
                 solver_type="bh2", predict_x0=True, lower_order_final=True, final_sigmas_type="zero",
                 disable_corrector=[], timestep_spacing="linspace", use_dynamic_shifting=False)


def scheduler(flow_shift: float = 3.0) -> unipc.UniPCConfig:
    """Wan's UniPC config with `flow_shift`: 3.0 for 480p, 5.0 for 720p (Wan2.1), 12.0 for Wan2.2-T2V-A14B."""
    return unipc.UniPCConfig.from_dict(dict(SCHEDULER, flow_shift=flow_shift), "Wan's scheduler_config.json")


def schedule(num_steps: int, flow_shift: float = 3.0) -> unipc.UniPCSampler:
    """WanPipeline's run: `scheduler.set_timesteps(num_steps)` of the UniPC config with `flow_shift`."""
    return unipc.UniPCSampler(scheduler(flow_shift), num_steps)


def expert(timestep: float, boundary_ratio: float | None, n: int = NUM_TRAIN_TIMESTEPS) -> int:
    """Wan2.2-A14B: expert 0 (high noise, `transformer`) while `t >= boundary`,
    expert 1 (`transformer_2`) after; Wan2.1 (no boundary) always 0."""
    if boundary_ratio is None:
        return 0
    return 0 if timestep >= boundary_ratio * n else 1
