"""A pipeline folder's configs checked before any weight is read.

`check_scheduler_values`: a flow-matching scheduler config's values (counts, shifts), each
problem named with the file and the field. `check_configs`: the components' configs against
model_index.json, the text encoders' safetensors headers, the transformer against its port
and the mesh (`loading.check_transformer`, headers only), the widths the components share
(the pipeline class's `config_problems`) and the compile-cache folder. docs/loading.md lists
what is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from difflet_tpu import arguments as A
from difflet_tpu.arguments import ArgumentError as PipelineError


def check_scheduler_values(path: Path, raw: dict) -> None:
    """The values of a flow-matching scheduler config: counts are ints >= 1, shifts finite
    numbers (a string or 0 would change the image silently or fail mid-schedule); every
    problem named with the file and the field."""
    problems = []
    for key in ("num_train_timesteps", "base_image_seq_len", "max_image_seq_len"):
        if key in raw and raw[key] is not None:
            try:
                A.integer(key, raw[key], minimum=1)
            except A.ArgumentError as e:
                problems.append(str(e))
    for key in ("shift", "base_shift", "max_shift", "shift_terminal"):
        if raw.get(key) is not None:
            try:
                A.scale(key, raw[key], minimum=0 if key == "shift_terminal" else None)
            except A.ArgumentError as e:
                problems.append(str(e))
    if not isinstance(raw.get("use_dynamic_shifting", False), bool):
        problems.append(f"`use_dynamic_shifting` must be true or false, got {raw['use_dynamic_shifting']!r}")
    if raw.get("use_dynamic_shifting") and raw.get("base_image_seq_len", 256) == raw.get("max_image_seq_len", 4096):
        problems.append("`base_image_seq_len` equals `max_image_seq_len`: the dynamic shift divides by their difference")
    if problems:
        raise PipelineError(f"{path}: " + "; ".join(problems))


def check_configs(path: Path, index: dict, pipeline_cls, *, mesh=None, dtype=jnp.bfloat16, config=None) -> None:
    """Everything the folder's configs say, before any weight is read (the scheduler's config
    is read by `diffusion.check_configs`): each component's config names the class
    model_index.json lists (a FLUX VAE in a Qwen-Image folder is refused here), every text
    encoder's safetensors header, the transformer against its port and `mesh` (heads
    that do not divide; `loading.check_transformer` reads only headers), the widths the
    components share (`pipeline_cls.config_problems`) and the compile-cache folder."""
    from difflet_tpu import checks
    from difflet_tpu.config import Config
    from difflet_tpu.encoders.loading import Checkpoint
    from difflet_tpu.loading import check_transformer

    config = Config() if config is None else config
    raw, problems = {}, []
    for name, (kind, _, _) in pipeline_cls.components.items():
        if kind not in ("text_encoder", "transformer", "vae"):
            continue
        try:
            raw[name] = json.loads((path / name / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise PipelineError(f"{path / name / 'config.json'}: cannot read it ({e})") from None
        declared = raw[name].get("_class_name") or (raw[name].get("architectures") or [None])[0]
        if declared is not None and declared != index[name][1]:
            problems.append(f"{name}/config.json names {declared}, but model_index.json lists {index[name][1]}")
    if problems:
        raise PipelineError(f"{path} ({index['_class_name']}): " + "; ".join(problems))
    for name, (kind, _, _) in pipeline_cls.components.items():
        if kind == "text_encoder":  # headers only: a truncated file is named before any encoder loads
            Checkpoint(path / name)
    _, transformer_config = check_transformer(path / "transformer", dtype=dtype, mesh=mesh, config=config)
    problems = pipeline_cls.config_problems(transformer_config, raw)
    if problems:
        raise PipelineError(f"{path}: " + "; ".join(problems))
    if config.compile_cache and "://" not in config.compile_cache:
        checks.writable_dir(Path(config.compile_cache).expanduser(), "compile cache (DIFFLET_TPU_COMPILE_CACHE)")
