"""difflet-tpu: diffusion transformers on TPU slices with sequence parallelism.

The public API:
  Config             every DIFFLET_TPU_* toggle (difflet_tpu.config)
  make_mesh          a `cfg` x `data` x `tp` mesh, each `tp` group a ring of ICI hops (difflet_tpu.parallel.mesh)
  load_transformer   a diffusers `transformer/` folder onto the mesh (difflet_tpu.loading)
  Runner             one port's step on one device, under TP or under SP (difflet_tpu.runner)
  DiffusionPipeline  prompt -> image from a diffusers pipeline folder (difflet_tpu.pipeline)

The packages, by concern: `parallel/` (meshes, modes, collective matmuls,
padding, multi-host), `kernels/` (Pallas TPU kernels and their tiles),
`layers/` (shared model blocks, RoPE, attention dispatch), `loading/`
(checkpoints in), `models/` (one port per model), `encoders/` and `vae/`
(text encoders and VAEs, shared across models), `pipeline/` (schedules, the
denoise loop, pipelines); tooling: `tools/` and `bench/`. docs/architecture.md.
"""

from difflet_tpu.config import Config, ConfigError
from difflet_tpu.parallel.mesh import make_mesh, use_cpu_devices

__all__ = ["Config", "ConfigError", "DiffusionPipeline", "Runner", "load_transformer", "make_mesh",
           "use_cpu_devices"]

_LAZY = {  # imported on first use, so `import difflet_tpu` stays light
    "Runner": "difflet_tpu.runner",
    "load_transformer": "difflet_tpu.loading.load",
    "DiffusionPipeline": "difflet_tpu.pipeline.diffusion",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'difflet_tpu' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
