"""FluxPipeline's schedule: FLUX.1's scheduler config, linear sigmas shifted by mu from the
image token count (`calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)`). The transformer
gets `timestep / 1000` and, for FLUX.1-dev, `guidance = guidance_scale` (the port's `Pipeline`)."""

from difflet_tpu.pipeline import schedules

# black-forest-labs/FLUX.1-dev's scheduler/scheduler_config.json
SCHEDULER = schedules.SchedulerConfig(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                      base_image_seq_len=256, max_image_seq_len=4096)


def schedule(num_steps: int, image_seq_len: int, cfg: schedules.SchedulerConfig = SCHEDULER) -> schedules.Schedule:
    """FluxPipeline's schedule: linear sigmas, shifted by mu from the image token count."""
    return schedules.shifted_linear(cfg, num_steps, image_seq_len)
