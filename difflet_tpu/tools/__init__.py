"""Tooling: compiling for a TPU you do not have, reading its schedule, estimating, sweeping tiles.

  deviceless   compile for a TPU topology without one (libtpu)
  hlo          read the compiled schedule (per-op cycles, collectives)
  estimate     the schedule-based step-time estimate (docs/benchmarks.md)
  sweep_tiles  `python -m difflet_tpu.tools.sweep_tiles`: measures the kernels' column tiles on a TPU

The runtime (Runner, loading, layers, models, pipelines) never imports this package.
"""
