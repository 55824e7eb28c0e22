"""The LTX-2 pipeline's schedule: linear sigmas shifted by mu from the video token count
(`calculate_shift(video_seq_len, 1024, 4096, 0.95, 2.05)`)."""

from difflet_tpu.pipeline import schedules

# Lightricks/LTX-2's scheduler/scheduler_config.json (the fields that shape a schedule)
SCHEDULER = schedules.SchedulerConfig(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                      base_image_seq_len=1024, max_image_seq_len=4096)

# LTX2Pipeline's argument names of the audio stream -> the transformer's (`--embeddings` files)
ARG_NAMES = {"audio_prompt_embeds": "audio_encoder_hidden_states"}


def schedule(num_steps: int, video_seq_len: int, cfg: schedules.SchedulerConfig = SCHEDULER) -> schedules.Schedule:
    """The LTX-2 pipeline's schedule: linear sigmas, shifted by mu from the video token count."""
    return schedules.shifted_linear(cfg, num_steps, video_seq_len)
