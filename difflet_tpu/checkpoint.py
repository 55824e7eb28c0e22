"""Saving converted parameters with orbax and restoring them onto a mesh.

Converting a diffusers checkpoint (reading, transposing, permuting, casting)
happens once; its result can be saved with orbax and restored straight onto
the target shardings, so a second load skips the conversion:

* `load_transformer(path, cache_dir=...)` keeps a cache: the first load
  converts and saves, later loads restore (`restore_if_cached` / `save`).
* `save_params(directory, model)` / `restore_params(directory, abstract_model,
  mesh, plan)` are the explicit pair (e.g. to convert on one machine and ship
  the result to a bucket).

A cache entry is keyed by everything the converted values depend on:

* the source checkpoint: config.json and the index (hashed), and for each
  safetensors file its name, resolved path, size, mtime and a hash of its
  header (shapes, dtypes, offsets);
* the port (module name), its config (including `split_rope`, so parameters
  permuted at load time are only ever restored into a model that expects them
  permuted, never permuted again) and a hash of its key map (templates,
  transforms, permutations, kept dtypes);
* the load dtype and `FORMAT_VERSION`.

Any difference is a cache miss (the checkpoint is converted again and saved
under a new entry), never a silent wrong load. The mesh is not part of the
key: an entry restores onto any mesh (orbax reads each device's slice).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from difflet_tpu import weights
from difflet_tpu.parallel import check_divisible, param_specs, path_names

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PARAMS_DIR = "params"           # the orbax checkpoint inside a saved directory
META_FILE = "difflet_meta.json"  # written last: its presence marks a complete save


# --------------------------------------------------------------------------
# Identity of a source checkpoint and of a conversion
# --------------------------------------------------------------------------

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_fingerprint(path: pathlib.Path) -> dict:
    st = os.stat(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too small for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > st.st_size - 8:
            raise ValueError(f"{path}: header longer than the file")
        header = f.read(n)
    return {"name": path.name, "realpath": os.path.realpath(path), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "header_sha256": _sha256(header)}


def source_fingerprint(src_path) -> dict | None:
    """The identity of a diffusers transformer directory; None if it cannot be read
    (then the cache misses and the conversion reports the problem)."""
    src = pathlib.Path(src_path)
    try:
        config = (src / "config.json").read_bytes()
        index = src / weights.INDEX_FILE
        if index.exists():
            index_bytes = index.read_bytes()
            files = sorted(set(json.loads(index_bytes)["weight_map"].values()))
            index_hash = _sha256(index_bytes)
        elif (src / weights.SINGLE_FILE).exists():
            files, index_hash = [weights.SINGLE_FILE], None
        else:
            return None
        return {"config_sha256": _sha256(config), "index_sha256": index_hash,
                "files": [_file_fingerprint(src / f) for f in files]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _jsonable(obj):
    """A JSON-normal form (dataclasses as dicts, tuples as lists, the rest by repr)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return json.loads(json.dumps(obj, sort_keys=True, default=_json_default))


def _json_default(o):
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=repr)
    return repr(o)


def key_map_digest(key_map: dict) -> str:
    """A hash of everything a key map does to the checkpoint values."""
    # Every field of Key, so a field added later is hashed too.
    rows = [[path, _jsonable(k)] for path, k in sorted(key_map.items())]
    return _sha256(json.dumps(rows, sort_keys=True).encode())


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else jnp.dtype(dtype).name


def cache_key(src_path, port, port_config, *, dtype, key_map) -> dict | None:
    """Everything the converted parameters depend on (None: the source is unreadable)."""
    source = source_fingerprint(src_path)
    if source is None:
        return None
    return _jsonable({
        "format": FORMAT_VERSION,
        "port": getattr(port, "__name__", repr(port)),
        "port_config": _jsonable(port_config),
        "key_map_sha256": key_map_digest(key_map),
        "dtype": _dtype_name(dtype),
        "source": source,
    })


def key_digest(key: dict) -> str:
    """The cache entry name for a cache key."""
    return _sha256(json.dumps(key, sort_keys=True).encode())[:32]


def entry_dir(cache_dir, key: dict | str):
    """The cache entry directory for a key (or its digest)."""
    return _path(cache_dir) / (key if isinstance(key, str) else key_digest(key))


def _num_processes() -> int:
    return jax.process_count()


def _agree(digest: str | None, hit: bool) -> tuple[str | None, bool]:
    """Process 0's cache decision for every process of a multi-host job (they must
    all restore, or all convert and save to the same entry)."""
    if _num_processes() == 1:
        return digest, hit
    from jax.experimental import multihost_utils

    buf = np.zeros(17, np.uint8)
    if digest is not None:
        buf[0] = 2 if hit else 1
        buf[1:] = np.frombuffer(bytes.fromhex(digest), np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    if buf[0] == 0:
        return None, False
    return bytes(buf[1:]).hex(), bool(buf[0] == 2)


def _path(p):
    from etils import epath

    s = os.fspath(p)
    return epath.Path(s if "://" in s else os.path.abspath(s))


# --------------------------------------------------------------------------
# The explicit pair
# --------------------------------------------------------------------------

def _read_meta(directory) -> dict | None:
    f = _path(directory) / META_FILE
    try:
        return json.loads(f.read_text()) if f.exists() else None
    except (OSError, ValueError):
        return None


def _param_table(params) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out = {}
    for path, leaf in flat:
        names = path_names(path)
        if names and names[-1] == "value":
            names = names[:-1]
        out[".".join(names)] = {"shape": list(leaf.shape), "dtype": jnp.dtype(leaf.dtype).name}
    return out


def save_params(directory, model, *, extra: dict | None = None):
    """Saves the parameters of `model` (sharded or not) to `directory` with orbax.

    Every process of a multi-host job must call it, with a shared `directory`
    (e.g. a gs:// bucket). Overwrites an earlier save. Records each
    parameter's shape and dtype and the model's `config` (a dataclass), so that
    `restore_params` refuses a model built differently (e.g. other `split_rope`).
    """
    import orbax.checkpoint as ocp

    directory = _path(directory)
    params = nnx.state(model, nnx.Param)
    meta = {"format": FORMAT_VERSION, "params": _param_table(params),
            "config": _jsonable(getattr(model, "config", None)), **(extra or {})}
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / META_FILE).unlink(missing_ok=True)  # incomplete until rewritten
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(directory / PARAMS_DIR, nnx.to_pure_dict(params), force=True)
    ckptr.wait_until_finished()
    ckptr.close()
    if jax.process_index() == 0:
        tmp = directory / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        tmp.rename(directory / META_FILE)
    return directory


def restore_params(directory, abstract_model, mesh=None, plan=None):
    """The parameters saved in `directory`, restored onto `mesh` with `plan`'s
    shardings (None: one device), merged into `abstract_model`.

    Each device reads only its own slice. The dtypes are the saved ones; the
    shapes must match `abstract_model`'s and, if both the saved and the given
    model have a dataclass `config`, those must be equal. Non-parameter state
    is taken from `abstract_model` as is (see `weights.fill_state`).
    """
    import orbax.checkpoint as ocp

    directory = _path(directory)
    meta = _read_meta(directory)
    if meta is None:
        raise weights.WeightsError(f"{directory}: no {META_FILE} (not saved by save_params, "
                                   "or the save was interrupted)")
    if meta.get("format") != FORMAT_VERSION:
        raise weights.WeightsError(f"{directory}: format {meta.get('format')}, this version reads "
                                   f"{FORMAT_VERSION}; convert the checkpoint again")
    graphdef, params, rest = nnx.split(abstract_model, nnx.Param, ...)
    saved, have = meta["params"], _param_table(params)
    problems = [f"missing parameter {p} {have[p]['shape']}" for p in sorted(set(have) - set(saved))]
    problems += [f"unexpected parameter {p} {saved[p]['shape']}" for p in sorted(set(saved) - set(have))]
    problems += [f"wrong shape for {p}: saved {saved[p]['shape']}, model {have[p]['shape']}"
                 for p in sorted(set(saved) & set(have)) if saved[p]["shape"] != have[p]["shape"]]
    cfg = _jsonable(getattr(abstract_model, "config", None))
    if isinstance(cfg, dict) and isinstance(meta.get("config"), dict) and cfg != meta["config"]:
        diff = sorted(k for k in set(cfg) | set(meta["config"]) if cfg.get(k) != meta["config"].get(k))
        problems.append("model config differs from the saved one in "
                        + ", ".join(f"{k} (saved {meta['config'].get(k)!r}, model {cfg.get(k)!r})"
                                    for k in diff))
    if problems:
        raise weights.WeightsError(f"{directory}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))

    if mesh is not None:
        check_divisible(plan, params, mesh.shape["tp"])
        specs = param_specs(params, plan)
        sharding = lambda spec: NamedSharding(mesh, spec)
    else:
        specs = jax.tree.map(lambda _: None, params)
        dev = jax.devices()[0]
        sharding = lambda spec: SingleDeviceSharding(dev)

    def target(path, leaf, spec):
        names = path_names(path)
        name = ".".join(names[:-1] if names[-1] == "value" else names)
        return jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(saved[name]["dtype"]), sharding=sharding(spec))

    abstract = jax.tree_util.tree_map_with_path(target, params, specs)
    ckptr = ocp.StandardCheckpointer()
    try:
        restored = ckptr.restore(directory / PARAMS_DIR, nnx.to_pure_dict(abstract))
    finally:
        ckptr.close()
    nnx.replace_by_pure_dict(abstract, restored)
    return nnx.merge(graphdef, abstract, rest)


# --------------------------------------------------------------------------
# The cache used by load_transformer
# --------------------------------------------------------------------------

def save(cache_dir, src_path, port, port_config, model, *, dtype):
    """Saves a freshly converted `model` as the cache entry for its source and
    conversion; returns the entry directory (None if the source has no identity)."""
    key = cache_key(src_path, port, port_config, dtype=dtype, key_map=port.key_map(port_config, model))
    digest, _ = _agree(None if key is None else key_digest(key), False)
    if digest is None:
        log.warning("%s: cannot fingerprint the checkpoint, not caching it", src_path)
        return None
    d = entry_dir(cache_dir, digest)
    save_params(d, model, extra={"cache_key": key, "source_path": os.path.abspath(src_path)})
    log.info("cached the converted parameters of %s in %s", src_path, d)
    return d


def restore_if_cached(cache_dir, src_path, port, port_config, *, dtype, mesh):
    """The model restored from the cache entry matching this source and conversion,
    placed on `mesh`; None on a miss (no entry, or any part of the key differs).

    On several hosts, process 0's checkpoint identity and decision count for all.
    """
    abstract = weights.abstract_port_model(port, port_config, dtype=dtype)
    key = cache_key(src_path, port, port_config, dtype=dtype, key_map=port.key_map(port_config, abstract))
    hit = False
    if key is not None:
        meta = _read_meta(entry_dir(cache_dir, key))
        hit = meta is not None and meta.get("cache_key") == key
    digest, hit = _agree(None if key is None else key_digest(key), hit)
    if not hit:
        return None
    d = entry_dir(cache_dir, digest)
    try:
        model = restore_params(d, abstract, mesh, port.PLAN)
    except Exception as e:  # a damaged entry: convert again (and overwrite it)
        if _num_processes() > 1:  # the processes could disagree: stop instead
            raise weights.WeightsError(f"cache entry {d} cannot be restored ({e}); delete it") from e
        log.warning("cache entry %s cannot be restored (%s); converting %s again", d, e, src_path)
        return None
    log.info("restored %s from the cache entry %s", src_path, d)
    return weights.fill_state(model, port, port_config, dtype=dtype, mesh=mesh, plan=port.PLAN)


def clear(cache_dir) -> None:
    """Removes every cache entry under `cache_dir` (local paths)."""
    d = pathlib.Path(cache_dir)
    if d.exists():
        for entry in d.iterdir():
            if (entry / META_FILE).exists() or (entry / PARAMS_DIR).exists():
                shutil.rmtree(entry)
