"""Pallas TPU kernels, installed as `difflet_tpu.kernels` (never top-level `kernels`)."""
