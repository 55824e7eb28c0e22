"""A pipeline folder's configs checked before any weight is read.

`check_configs`: the components' configs against
model_index.json, the text encoders' safetensors headers, the transformer against its port
and the mesh (`loading.check_transformer`, headers only), the widths the components share
(the pipeline class's `config_problems`) and the compile-cache folder. docs/loading.md lists
what is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from difflet_tpu.arguments import ArgumentError as PipelineError


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
    components = pipeline_cls.folder_components(index)
    for name, (kind, _, _) in components.items():
        if kind not in ("image_encoder", "text_encoder", "transformer", "vae"):
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
    for name, (kind, _, _) in components.items():
        if kind in ("image_encoder", "text_encoder"):  # headers only: a truncated file is named before any encoder loads
            Checkpoint(path / name)
    _, transformer_config = check_transformer(path / "transformer", dtype=dtype, mesh=mesh, config=config)
    problems = pipeline_cls.config_problems(transformer_config, raw)
    if problems:
        raise PipelineError(f"{path}: " + "; ".join(problems))
    if config.compile_cache and "://" not in config.compile_cache:
        checks.writable_dir(Path(config.compile_cache).expanduser(), "compile cache (DIFFLET_TPU_COMPILE_CACHE)")
