"""QwenImagePipeline's schedule: sigmas linspace(1, 1/N, N), mu = calculate_shift(image tokens,
256, 8192, 0.5, 0.9), the scheduler's exponential time shift and terminal stretch."""

from difflet_tpu.pipeline import schedules

# Qwen/Qwen-Image's scheduler config (FlowMatchEulerDiscreteScheduler): dynamic shifting
# with mu from the image token count over [256, 8192] -> [0.5, 0.9], stretched to a
# terminal sigma of 0.02 (tests/fixtures/qwen_image/schedule.json holds diffusers' arrays).
SCHEDULER = schedules.SchedulerConfig(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                      base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02)


def schedule(steps: int, image_seq_len: int, cfg: schedules.SchedulerConfig = SCHEDULER) -> schedules.Schedule:
    """QwenImagePipeline's schedule (module docstring)."""
    return schedules.shifted_linear(cfg, steps, image_seq_len)
