"""`load_transformer`: a diffusers `transformer/` folder onto the mesh.

The port is looked up by the config's `_class_name` among the ports' specs
(`difflet_tpu.models.spec_for_class`); the checkpoint is read and validated
by `loading.checkpoint`, and with `cache_dir` the converted parameters are
saved with orbax and later restored straight onto the mesh
(`loading.cache`). See docs/loading.md.
"""


from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from difflet_tpu.loading import cache, checkpoint
from difflet_tpu.loading.checkpoint import (Checkpoint, Key, WeightsError, _norm_index, abstract_port_model, fill_state,
                                           param_paths, read_param, summarize_keys, target_dtype, validate)
from difflet_tpu.parallel.modes import divisibility_problems, param_specs, path_names

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# Ports and loading
# --------------------------------------------------------------------------

def transformer_dir(path, subfolder=None) -> pathlib.Path:
    """The transformer folder `path` (/ `subfolder`, as diffusers' `from_pretrained(..., subfolder=)`
    takes it), with an error that says what to pass for a pipeline root or a hub id."""
    p = pathlib.Path(path)
    if subfolder is not None:
        if not isinstance(subfolder, str) or not subfolder or pathlib.Path(subfolder).is_absolute():
            raise WeightsError(f"subfolder: {subfolder!r}, expected a relative folder name such as 'transformer'")
        p = p / subfolder
    if p.is_dir() and (p / "model_index.json").is_file() and not (p / "config.json").exists():
        raise WeightsError(f"{p} is a diffusers pipeline folder (model_index.json); pass its transformer: "
                           f"load_transformer({str(p)!r}, subfolder='transformer'), or "
                           f"difflet_tpu.DiffusionPipeline.from_pretrained({str(p)!r}) for the whole pipeline")
    if not p.exists() and subfolder is None and str(path).count("/") == 1 and not str(path).startswith((".", "~", "/")):
        raise WeightsError(f"{path!r} is not a folder here; it looks like a hub id, and nothing is downloaded: "
                           f"download it first (e.g. `huggingface-cli download {path}`) and pass the local "
                           f"folder with subfolder='transformer'")
    return p


def read_config(path) -> dict:
    """A diffusers transformer directory's config.json, checked for `_class_name`."""
    cfg_path = pathlib.Path(path) / "config.json"
    if not os.path.lexists(cfg_path):
        what = "no such folder" if not os.path.lexists(path) else "no config.json"
        raise WeightsError(f"{path}: {what} (expected a diffusers transformer directory)")
    problem = checkpoint.file_problem(cfg_path)
    if problem:
        raise WeightsError(f"{cfg_path}: {problem}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{cfg_path}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise WeightsError(f"{cfg_path}: not a JSON object")
    if "_class_name" not in cfg:
        raise WeightsError(f"{cfg_path}: no _class_name")
    return cfg


def place_from_callback(shape: tuple, sharding, cb) -> jax.Array:
    """A global array from `cb(index) -> host slice`, one addressable device at a time.

    Like `jax.make_array_from_callback`, but each slice goes to its device
    before the next is read, so the host holds one device's slice of one
    parameter at a time; a slice that several devices hold (replicated) is
    read once and copied between devices.
    """
    placed, arrays = {}, []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        index = _norm_index(index, shape)
        spot = tuple((s.start, s.stop) for s in index)
        if spot in placed:
            arrays.append(jax.device_put(placed[spot], device))
            continue
        host = np.asarray(cb(index))
        arr = jax.device_put(host, device)
        arr.block_until_ready()
        del host
        placed[spot] = arr
        arrays.append(arr)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _float_params(params) -> dict[str, bool]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = path_names(path)
        out[".".join(names[:-1] if names[-1] == "value" else names)] = bool(
            jnp.issubdtype(jnp.dtype(leaf.dtype), jnp.inexact))
    return out


# Port config fields that count attention heads (TP and SP give each rank whole heads).
_HEAD_FIELD = re.compile(r"(^|_)(num_attention_heads|heads)$")


def mesh_problems(port_config, params, mesh, plan) -> list[str]:
    """Head counts (port config fields `*num_attention_heads` / `heads`) and sharded
    parameter axes that do not divide over the mesh's `tp` axis."""
    if mesh is None:
        return []
    size = mesh.shape["tp"]
    bad = []
    if dataclasses.is_dataclass(port_config):
        for f in dataclasses.fields(port_config):
            v = getattr(port_config, f.name)
            if _HEAD_FIELD.search(f.name) and isinstance(v, int) and v % size:
                bad.append(f"{f.name}: {v} heads over tp={size} (each rank needs whole heads)")
    return bad + divisibility_problems(plan, params, size)


def _raise_mesh_problems(where, port_config, params, mesh, plan):
    bad = mesh_problems(port_config, params, mesh, plan)
    if bad:
        raise WeightsError(f"{where}: heads or parameters do not divide over the tp axis (tp={mesh.shape['tp']}):"
                           f"\n  " + "\n  ".join(bad))


def load_params(model, ckpt: Checkpoint, key_map: dict[str, Key], *, dtype, mesh=None, plan=None,
                where: str = "", ignore=(), port_config=None):
    """Reads, validates and places every parameter of an (abstract) `model` in place.

    ignore: the port's IGNORED_KEYS (checkpoint keys dropped with one notice).
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    shapes = param_paths(params)
    missing_map = sorted(set(shapes) - set(key_map))
    if missing_map:
        raise WeightsError(f"key map has no entry for parameters {missing_map}")
    where = where or str(ckpt.path)
    ignored = validate(ckpt, key_map, shapes, where, ignore=ignore, float_params=_float_params(params))
    if ignored:
        log.warning("%s: ignoring %d checkpoint key(s) that the reference ignores too (diffusers "
                    "_keys_to_ignore_on_load_unexpected %s): %s", where, len(ignored), list(ignore),
                    summarize_keys(ignored))
    if mesh is not None:
        _raise_mesh_problems(where, port_config, params, mesh, plan)
        specs = param_specs(params, plan)
    else:
        specs = None
    dev = jax.devices()[0]

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    spec_leaves = jax.tree_util.tree_leaves(specs) if specs is not None else [None] * len(flat)
    out = []
    for (path, leaf), spec in zip(flat, spec_leaves):
        names = path_names(path)
        pname = ".".join(names[:-1] if names[-1] == "value" else names)
        key = key_map[pname]
        shape = tuple(leaf.shape)
        target = target_dtype(key, leaf.dtype, dtype)
        sharding = NamedSharding(mesh, spec) if mesh is not None else SingleDeviceSharding(dev)

        def cb(index, key=key, shape=shape, target=target):
            return read_param(ckpt, key, shape, index).astype(target)

        out.append(place_from_callback(shape, sharding, cb))
    params = jax.tree_util.tree_unflatten(treedef, out)
    return nnx.merge(graphdef, params, rest)


def _check_arguments(dtype, mesh, config):
    """The Python arguments of load_transformer, before any file is opened."""
    from jax.sharding import Mesh

    from difflet_tpu.config import Config

    if dtype is not None:
        try:
            d = jnp.dtype(dtype)
        except TypeError:
            raise WeightsError(f"dtype: {dtype!r} is not a dtype (use jnp.bfloat16, jnp.float32 or None)") from None
        if not jnp.issubdtype(d, jnp.floating):
            raise WeightsError(f"dtype: {d.name} is not a floating-point dtype (use jnp.bfloat16, "
                               f"jnp.float32 or None)")
    if mesh is not None and not (isinstance(mesh, Mesh) and "tp" in mesh.shape):
        raise WeightsError(f"mesh: {mesh!r} is not a jax.sharding.Mesh with a 'tp' axis "
                           f"(use difflet_tpu.make_mesh(), or None for one device)")
    if config is None:
        return Config.from_env()
    if not isinstance(config, Config):
        raise WeightsError(f"config: {config!r} is not a difflet_tpu.Config")
    return config


def _port_and_config(path, config, overrides):
    from difflet_tpu.port_config import UnknownOption

    if "split_rope" in overrides:
        raise WeightsError("load_transformer: split_rope is not a keyword argument; pass "
                           "config=difflet_tpu.Config(split_rope=...)")
    from difflet_tpu import models

    cfg = read_config(path)
    try:
        port = models.spec_for_class(cfg["_class_name"])
    except ValueError:
        known = sorted(c for s in [*models.specs().values(), *models.registered().values()] for c in s.class_names)
        raise WeightsError(f"unknown _class_name {cfg['_class_name']!r}; supported: {', '.join(known)}") from None
    name = port.name
    try:
        port_config = port.config_from_diffusers(cfg, split_rope=config.split_rope, **overrides)
    except (UnknownOption, TypeError) as e:
        if not overrides:
            raise
        raise WeightsError(f"load_transformer: unknown keyword argument(s) {sorted(overrides)} for "
                           f"{name} (not a load_transformer argument nor a build option of the port): {e}"
                           ) from None
    except ValueError as e:
        raise WeightsError(f"{pathlib.Path(path) / 'config.json'}: not supported by {name}: {e}") from None
    return port, port_config


def check_transformer(path, *, dtype=jnp.bfloat16, mesh=None, config=None, subfolder=None, **overrides):
    """Everything `load_transformer` validates, without reading a tensor or compiling.

    Checks the arguments, config.json against the port, the files (headers,
    lengths, index, shard names), every key's presence, shape and dtype, and
    that heads and sharded dimensions divide over `mesh`. Returns
    `(port, port_config)`; raises WeightsError like `load_transformer`.
    """
    path = transformer_dir(path, subfolder)
    config = _check_arguments(dtype, mesh, config)
    port, port_config = _port_and_config(path, config, overrides)
    abstract = abstract_port_model(port, port_config, dtype=dtype)
    params = nnx.state(abstract, nnx.Param)
    if mesh is not None:
        _raise_mesh_problems(str(path), port_config, params, mesh, port.plan)
    ckpt = Checkpoint(path)
    validate(ckpt, port.key_map(port_config, abstract), param_paths(params), str(path),
             ignore=port.ignored_keys, float_params=_float_params(params))
    return port, port_config


def load_transformer(path, *, dtype=jnp.bfloat16, mesh=None, config=None, cache_dir=None, subfolder=None,
                     **overrides):
    """A ready port of the diffusers transformer at `path`.

    Args:
      path: a diffusers transformer directory (config.json + safetensors), or a
        pipeline folder with `subfolder="transformer"` (as diffusers takes it).
      dtype: parameter dtype (the port keeps fp32 where the reference does,
        through `Key(dtype="float32")`); a floating-point dtype or None.
      mesh: a `tp` mesh from `make_mesh`; each parameter is placed with its
        plan's sharding and each device reads only its slice. None: one device.
      config: a `difflet_tpu.Config` (default: the environment); its
        `split_rope` decides the q/k layout.
      cache_dir: an orbax cache of the converted parameters (see
        `difflet_tpu.loading.cache`): the first load converts and saves them, a
        later load with the same checkpoint, port config and dtype restores
        them onto `mesh` without reading the safetensors. A local path, gs://
        or s3://; on a miss it must be writable (checked before converting).
      overrides: port-specific build options (config keys of the port, passed
        to `config_from_diffusers`); an unknown one is an error.

    Raises:
      WeightsError: before anything is read or compiled, for a bad argument
        (dtype, mesh, config, an unknown keyword, an unusable cache_dir), an
        unknown `_class_name`, a config value the port does not support,
        missing / unexpected / mis-shaped / mis-typed keys (all listed
        together), truncated or corrupt files, an index naming a missing
        shard or a file outside the directory, a missing config.json, or
        heads / sharded dimensions that do not divide over `mesh`.
    """
    path = transformer_dir(path, subfolder)
    config = _check_arguments(dtype, mesh, config)
    port, port_config = _port_and_config(path, config, overrides)
    abstract = abstract_port_model(port, port_config, dtype=dtype)
    if mesh is not None:
        _raise_mesh_problems(str(path), port_config, nnx.state(abstract, nnx.Param), mesh, port.plan)
    if cache_dir is not None:
        cache.check_cache_dir(cache_dir)
        cached = cache.restore_if_cached(cache_dir, path, port, port_config, dtype=dtype, mesh=mesh,
                                         abstract=abstract)
        if cached is not None:
            return cached
        cache.check_cache_dir(cache_dir, write=True)  # before the conversion, not after it
    ckpt = Checkpoint(path)
    model = load_params(abstract, ckpt, port.key_map(port_config, abstract), dtype=dtype, mesh=mesh,
                        plan=port.plan, where=str(path), ignore=port.ignored_keys,
                        port_config=port_config)
    model = fill_state(model, port, port_config, dtype=dtype, mesh=mesh, plan=port.plan)
    if cache_dir is not None:
        cache.save(cache_dir, path, port, port_config, model, dtype=dtype)
    return model
