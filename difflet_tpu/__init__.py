"""difflet-tpu: diffusion transformers on TPU slices with sequence parallelism.

Public entry points:
  make_mesh            difflet_tpu.mesh
  Config               difflet_tpu.config (every DIFFLET_TPU_* toggle)
  all_gather_matmul, matmul_reduce_scatter   difflet_tpu.collective_matmul
  attention            difflet_tpu.attention
  load_transformer     difflet_tpu.weights (imported on first use)
"""

from difflet_tpu.config import Config, ConfigError
from difflet_tpu.mesh import make_mesh, use_cpu_devices

__all__ = ["Config", "ConfigError", "load_transformer", "make_mesh", "use_cpu_devices"]


def __getattr__(name):
    if name == "load_transformer":  # lazy: importing the package stays light
        from difflet_tpu.weights import load_transformer

        return load_transformer
    raise AttributeError(f"module 'difflet_tpu' has no attribute {name!r}")
