"""From noise to a sample: the flow-matching schedules, the samplers and the denoise loop.

  schedules  the generic flow-matching Euler schedule (sigmas, shifts)
  unipc      diffusers' UniPCMultistepScheduler for flow models (Wan's folders)
  samplers   a `scheduler_config.json` (by `_class_name`) -> its checked config and sampler
  denoise    the denoise loop over a `Runner` (guidance, the port's expert switch), compiled once

The user-facing pipelines (prompt -> image, `DiffusionPipeline.from_pretrained`)
live here too; each model's own schedule, expert switch and argument names are in
its port folder (`models/<name>/schedule.py`), its pipeline in `models/<name>/pipeline.py`.
"""
