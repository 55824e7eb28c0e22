"""HunyuanVideoPipeline's schedule: sigmas `linspace(1, 0, N+1)[:-1]` with the scheduler's
static shift 7.0; the transformer gets `guidance = guidance_scale * 1000` (the port's `Pipeline`)."""

import numpy as np

from difflet_tpu.pipeline import schedules

SCHEDULER = schedules.SchedulerConfig(shift=7.0)


def schedule(num_steps: int, cfg: schedules.SchedulerConfig = SCHEDULER) -> schedules.Schedule:
    """HunyuanVideoPipeline's schedule: sigmas linspace(1, 0) with the scheduler's shift."""
    return schedules.flow_match_euler(cfg, num_steps, sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
