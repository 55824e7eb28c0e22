"""WanPipeline's schedule and Wan2.2-A14B's expert switch.

The schedule: a flow-matching Euler scheduler of `shift = flow_shift` (config.FLOW_SHIFTS
per checkpoint), no input sigmas (the scheduler's own linspace between its shifted
sigma_max and sigma_min), static shift. The switch: the high-noise expert
(`transformer`) while `t >= boundary_ratio * 1000`, the low-noise one (`transformer_2`)
after; `WanExperts` and the denoise loop (through `SPEC.pipeline.expert`) both use `expert`.
"""

from difflet_tpu.pipeline import schedules

from .config import NUM_TRAIN_TIMESTEPS

# WanPipeline's argument names -> the transformer's (`--embeddings` files)
ARG_NAMES = {"image_embeds": "encoder_hidden_states_image"}


def scheduler(flow_shift: float = 3.0) -> schedules.SchedulerConfig:
    """Wan's flow shift: 3.0 for 480p, 5.0 for 720p (Wan2.1), 12.0 for Wan2.2-T2V-A14B."""
    return schedules.SchedulerConfig(shift=flow_shift)


def schedule(num_steps: int, flow_shift: float = 3.0) -> schedules.Schedule:
    """WanPipeline's flow-matching schedule with a static `flow_shift`."""
    return schedules.flow_match_euler(scheduler(flow_shift), num_steps)


def expert(timestep: float, boundary_ratio: float | None, n: int = NUM_TRAIN_TIMESTEPS) -> int:
    """Wan2.2-A14B: expert 0 (high noise, `transformer`) while `t >= boundary`,
    expert 1 (`transformer_2`) after; Wan2.1 (no boundary) always 0."""
    if boundary_ratio is None:
        return 0
    return 0 if timestep >= boundary_ratio * n else 1
