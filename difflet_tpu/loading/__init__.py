"""Diffusers checkpoints in: reading and validating safetensors, the orbax cache, `load_transformer`.

  checkpoint  key maps (`Key`), the safetensors files of a folder (`Checkpoint`), validation, per-slice reads
  cache       the orbax cache of converted parameters (`cache_dir=`)
  load        `load_transformer` / `check_transformer`: the port found from `_class_name`, placed on the mesh
"""

from difflet_tpu.loading.checkpoint import (INDEX_FILE, SINGLE_FILE, Checkpoint, Key, WeightsError,
                                           abstract_port_model, checkpoint_files, default_key_map, fill_state,
                                           param_paths, validate)
from difflet_tpu.loading.load import (check_transformer, load_params, load_transformer, mesh_problems, read_config)

__all__ = ["INDEX_FILE", "SINGLE_FILE", "Checkpoint", "Key", "WeightsError", "abstract_port_model",
           "check_transformer", "checkpoint_files", "default_key_map", "fill_state", "load_params",
           "load_transformer", "mesh_problems", "param_paths", "read_config", "validate"]
