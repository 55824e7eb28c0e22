"""difflet-tpu: diffusion transformers on TPU slices with sequence parallelism.

Public entry points:
  make_mesh            difflet_tpu.mesh
  Config               difflet_tpu.config (every DIFFLET_TPU_* toggle)
  all_gather_matmul, matmul_reduce_scatter   difflet_tpu.collective_matmul
  attention            difflet_tpu.attention
"""

from difflet_tpu.config import Config, ConfigError
from difflet_tpu.mesh import make_mesh, use_cpu_devices

__all__ = ["Config", "ConfigError", "make_mesh", "use_cpu_devices"]
