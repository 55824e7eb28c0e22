"""Flax ports of diffusers DiTs, installed as `difflet_tpu.models` (never top-level `models`)."""
