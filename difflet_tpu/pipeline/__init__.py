"""From noise to a sample: the flow-matching schedules and the denoise loop.

  schedules  the flow-matching Euler schedules of the diffusers pipelines (sigmas, shifts)
  denoise    the denoise loop over a `Runner` (guidance, Wan2.2's expert switch), compiled once

The user-facing pipelines (prompt -> image, `DiffusionPipeline.from_pretrained`)
live here too; each model's own pipeline is in its port folder (`models/<name>/pipeline.py`).
"""
