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
* the port (its spec's name), its config (including `split_rope`, so parameters
  permuted at load time are only ever restored into a model that expects them
  permuted, never permuted again) and a hash of its key map (templates,
  transforms, permutations, kept dtypes);
* the load dtype and `FORMAT_VERSION`.

Any difference is a cache miss (the checkpoint is converted again and saved
under a new entry), never a silent wrong load. The mesh is not part of the
key: an entry restores onto any mesh (orbax reads each device's slice).

Every save records a digest of its own data (`data_sha256`: sha256 over the
orbax files), checked before a restore: a damaged entry (a flipped bit in a
data file restores as wrong values, not as an error: orbax 0.12's zarr
layouts checksum the shard index at most, not the chunk data, and it offers no
option for one) is a one-line warning and a re-conversion in the cache, and an
error from `restore_params`. Cache writes go to a temporary entry that is
renamed into place (local directories), so an interrupted save never leaves a
half-entry; on gs:// / s3:// (no directory rename) `difflet_meta.json` is
written last, after the digest, and an entry without it is never used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import os
import pathlib
import shutil
import struct
import sys
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from difflet_tpu.loading import checkpoint
from difflet_tpu.loading.integrity import data_digest, meta_digest, restored_problems
from difflet_tpu.parallel.modes import check_divisible, param_specs, path_names

log = logging.getLogger(__name__)

FORMAT_VERSION = 3               # 2: difflet_meta.json records data_sha256; 3: and meta_sha256 over itself
PARAMS_DIR = "params"           # the orbax checkpoint inside a saved directory
META_FILE = "difflet_meta.json"  # written last: its presence marks a complete save
# The remote stores orbax writes to (orbax tensorstore_utils._REMOTE_URL_PREFIXES).
REMOTE_PREFIXES = ("gs://", "s3://")


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
        files, weight_map = checkpoint.checkpoint_files(src)  # shard names checked: never outside `src`
        index_hash = None if weight_map is None else _sha256((src / checkpoint.INDEX_FILE).read_bytes())
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
        "port": port.name,
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


def _is_remote(p) -> bool:
    return "://" in os.fspath(p)


def check_cache_dir(cache_dir, *, write: bool = False) -> None:
    """A usable `cache_dir`: a local path or a gs:// / s3:// URL; with `write`,
    one where an entry can be written (a local directory is created if needed).
    Raises WeightsError naming the directory and the reason."""
    from difflet_tpu import checks

    try:
        s = os.fspath(cache_dir)
    except TypeError:
        raise checkpoint.WeightsError(f"cache_dir: {cache_dir!r} is not a path") from None
    if "://" in s and not s.startswith(REMOTE_PREFIXES):
        raise checkpoint.WeightsError(f"cache_dir {s!r}: unsupported URL scheme {s.split('://', 1)[0] + '://'!r}; use "
                                   f"a local path or {' / '.join(REMOTE_PREFIXES)} (the stores orbax writes to)")
    if not _is_remote(s) and os.path.exists(s) and not os.path.isdir(s):
        raise checkpoint.WeightsError(f"cache_dir {s}: exists and is not a directory")
    if not write:
        return
    hint = "; fix it, or pass cache_dir=None to load without caching"
    if not _is_remote(s):
        try:
            checks.writable_dir(s, "cache_dir")
        except ValueError as e:
            raise checkpoint.WeightsError(f"{e}{hint}") from None
        return
    probe = _path(s) / f".difflet-write-test-{uuid.uuid4().hex}"
    try:
        probe.write_text("")
        probe.unlink()
    except Exception as e:  # noqa: BLE001 - any store error
        raise checkpoint.WeightsError(f"cache_dir {s}: cannot write there ({_one_line(e)}){hint}") from None


def _one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line (TensorStore errors carry a ~60-line spec)."""
    text = str(e).split("See full TensorStore details")[0].strip()
    text = (text.splitlines() or [""])[0].strip().rstrip(".")
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class _DropOrbaxOrphans(logging.Filter):
    """asyncio's 'Task / Future exception was never retrieved' for the array reads a failed
    orbax restore abandoned (logged when they are collected: during the restore, or later,
    possibly at exit). Active while a restore runs and once one failed in this process,
    and only for orbax / TensorStore errors."""

    armed = False      # a restore failed: its orphans may be collected at any later time
    restoring = False  # a restore is running

    def filter(self, record):
        if not (self.armed or self.restoring):
            return True
        msg = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        text = msg + " " + (str(exc) if exc is not None else "")
        return not ("exception was never retrieved" in msg
                    and ("async_deserialize" in text or "orbax" in text or '"zarr" driver' in text
                         or "TensorStore" in text))


_ORPHAN_FILTER = _DropOrbaxOrphans()


def _abandoned_read(unraisable) -> bool:
    """An 'Exception ignored in <coroutine ...>' of an array read a failed orbax restore
    abandoned: the coroutine is orbax's (or the error is TensorStore's)."""
    code = getattr(unraisable.object, "cr_code", None)
    where = getattr(code, "co_filename", "") or ""
    text = str(unraisable.exc_value)
    return "orbax" in where or "Encountered error while reading array" in text or "TensorStore" in text


def _drop_abandoned_reads(hook):
    """`hook` without the abandoned reads' reports; they can be collected well after the
    restore returned (a loaded machine), so the wrapper stays installed, like the filter."""
    if getattr(hook, "_difflet_drops_abandoned_reads", False):
        return hook

    def filtered(unraisable):
        if not _abandoned_read(unraisable):
            hook(unraisable)

    filtered._difflet_drops_abandoned_reads = True
    return filtered


@contextlib.contextmanager
def _quiet_restore_noise():
    """A failed orbax restore is reported once, by the caller, in one line. Its background
    noise is dropped: the reads it abandoned print 'Exception ignored in <coroutine ...>'
    (sys.unraisablehook), TensorStore callbacks that hit the closed event loop print
    'RuntimeError: Event loop is closed' tracebacks (sys.excepthook, from their threads, a
    moment after the failure), and the abandoned tasks log 'Task exception was never
    retrieved' when collected, during or after the restore (a filter on the asyncio
    logger for exactly those records, left in place). Reads collected after the restore
    returned meet a wrapper of sys.unraisablehook that drops only them (left in place)."""
    hooks = sys.unraisablehook, sys.excepthook
    sys.unraisablehook = lambda unraisable: None
    sys.excepthook = lambda *exc: None  # only while the restore runs (nothing is uncaught here)
    logging.getLogger("asyncio").addFilter(_ORPHAN_FILTER)  # idempotent; drops only those records
    _ORPHAN_FILTER.restoring = True
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        _ORPHAN_FILTER.armed = True
        raise
    finally:
        if failed:
            time.sleep(0.2)  # the callbacks of reads still in flight arrive now
        gc.collect()
        _ORPHAN_FILTER.restoring = False
        sys.unraisablehook, sys.excepthook = hooks
        if failed:
            sys.unraisablehook = _drop_abandoned_reads(sys.unraisablehook)


def _meta_problem(meta: dict) -> str | None:
    """Why difflet_meta.json cannot be trusted (None: it matches its own digest)."""
    if meta.get("meta_sha256") != meta_digest(meta):
        return f"metadata digest mismatch ({META_FILE} changed: damaged or edited)"
    return None


def _data_problem(directory, meta: dict) -> str | None:
    """Why the saved entry of `directory` cannot be trusted (None: its metadata and its
    data match their digests)."""
    problem = _meta_problem(meta)
    if problem is not None:
        return problem
    want = meta.get("data_sha256")
    if not want:
        return "no data digest recorded"
    try:
        got = data_digest(_path(directory) / PARAMS_DIR)
    except OSError as e:
        return f"its files cannot be read ({_one_line(e)})"
    if got != want:
        return "data digest mismatch (the saved files changed: damaged or edited)"
    return None


def _agree_flag(flag: bool) -> bool:
    """Process 0's bool for every process."""
    if _num_processes() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([flag], np.uint8)))[0])


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
    `restore_params` refuses a model built differently (e.g. other `split_rope`),
    and a digest of the saved files (`data_sha256`), checked by `restore_params`.
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
        meta["data_sha256"] = data_digest(directory / PARAMS_DIR)  # the files as written, finalised
        meta["meta_sha256"] = meta_digest(meta)  # every other field: the dtypes restored, the key
        tmp = directory / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        tmp.rename(directory / META_FILE)
    return directory


def restore_params(directory, abstract_model, mesh=None, plan=None, *, verify: bool = True):
    """The parameters saved in `directory`, restored onto `mesh` with `plan`'s
    shardings (None: one device), merged into `abstract_model`.

    Each device reads only its own slice. The dtypes are the saved ones; the
    shapes must match `abstract_model`'s and, if both the saved and the given
    model have a dataclass `config`, those must be equal. Non-parameter state
    is taken from `abstract_model` as is (see `checkpoint.fill_state`).
    verify: check the saved files against their recorded digest first (process
    0 reads every file once; the others follow its verdict); a mismatch is a
    WeightsError.
    """
    import orbax.checkpoint as ocp

    directory = _path(directory)
    meta = _read_meta(directory)
    if meta is None:
        raise checkpoint.WeightsError(f"{directory}: no {META_FILE} (not saved by save_params, "
                                   "or the save was interrupted)")
    if meta.get("format") != FORMAT_VERSION:
        raise checkpoint.WeightsError(f"{directory}: format {meta.get('format')}, this version reads "
                                   f"{FORMAT_VERSION}; convert the checkpoint again")
    problem = _meta_problem(meta)  # cheap, and always: the table below decides the restored dtypes
    if problem is not None:
        raise checkpoint.WeightsError(f"{directory}: {problem}; save it again")
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
        raise checkpoint.WeightsError(f"{directory}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    if verify:
        problem = _data_problem(directory, meta) if jax.process_index() == 0 else None
        if not _agree_flag(problem is None):
            raise checkpoint.WeightsError(f"{directory}: {problem or 'data digest mismatch on process 0'}; "
                                       "save it again")

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
    problems = restored_problems(abstract, jax.tree_util.tree_map_with_path(target, params, specs))
    if problems:
        raise checkpoint.WeightsError(f"{directory}: restored parameters differ from what was asked:\n  "
                                      + "\n  ".join(problems))
    return nnx.merge(graphdef, abstract, rest)


# --------------------------------------------------------------------------
# The cache used by load_transformer
# --------------------------------------------------------------------------

def _sync(name: str):
    if _num_processes() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save(cache_dir, src_path, port, port_config, model, *, dtype):
    """Saves a freshly converted `model` as the cache entry for its source and
    conversion; returns the entry directory (None if the source has no identity).

    Local cache: written to a temporary directory next to the entry and renamed
    into place (replacing a damaged entry of the same key), so an interrupted
    save leaves only a `.<digest>.partial-*` directory that is never restored.
    """
    key = cache_key(src_path, port, port_config, dtype=dtype, key_map=port.key_map(port_config, model))
    digest, _ = _agree(None if key is None else key_digest(key), False)
    if digest is None:
        log.warning("%s: cannot fingerprint the checkpoint, not caching it", src_path)
        return None
    d = entry_dir(cache_dir, digest)
    extra = {"cache_key": key, "source_path": os.path.abspath(src_path)}
    if _is_remote(cache_dir):  # no directory rename: difflet_meta.json, written last, marks it complete
        save_params(d, model, extra=extra)
        log.info("cached the converted parameters of %s in %s", src_path, d)
        return d
    token = uuid.uuid4().hex[:12] if _num_processes() == 1 else "shared"  # the same name on every process
    tmp = d.parent / f".{digest}.partial-{token}"
    if jax.process_index() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _sync("difflet cache: partial entry cleared")
    save_params(tmp, model, extra=extra)
    if jax.process_index() == 0:
        if d.exists():  # an entry of this key that did not restore (damaged): replaced
            shutil.rmtree(d, ignore_errors=True)
        try:
            os.rename(tmp, d)
        except OSError:  # another process saved the same entry meanwhile: keep it
            shutil.rmtree(tmp, ignore_errors=True)
    _sync("difflet cache: entry in place")
    log.info("cached the converted parameters of %s in %s", src_path, d)
    return d


def _converted(abstract, key_map, dtype):
    """The parameters a conversion makes (`checkpoint.target_dtype`: the load dtype, or a
    key's kept dtype), as ShapeDtypeStructs: what a cache restore must return."""

    def one(path, leaf):
        names = path_names(path)
        key = key_map[".".join(names[:-1] if names[-1] == "value" else names)]
        return jax.ShapeDtypeStruct(leaf.shape, checkpoint.target_dtype(key, leaf.dtype, dtype))

    return jax.tree_util.tree_map_with_path(one, nnx.state(abstract, nnx.Param))


def restore_if_cached(cache_dir, src_path, port, port_config, *, dtype, mesh, abstract=None):
    """The model restored from the cache entry matching this source and conversion,
    placed on `mesh`; None on a miss (no entry, any part of the key differs, or
    the entry's data does not match its digest: one warning line, then the
    caller converts again and the entry is replaced).

    On several hosts, process 0's checkpoint identity and decision count for all.
    """
    if abstract is None:
        abstract = checkpoint.abstract_port_model(port, port_config, dtype=dtype)
    key_map = port.key_map(port_config, abstract)
    key = cache_key(src_path, port, port_config, dtype=dtype, key_map=key_map)
    hit = False
    if key is not None and jax.process_index() == 0:  # only process 0's decision counts
        d = entry_dir(cache_dir, key)
        meta = _read_meta(d)
        hit = meta is not None and meta.get("cache_key") == key
        if hit:
            problem = _data_problem(d, meta)
            if problem is not None:
                log.warning("cache entry %s: %s; converting %s again", d, problem, src_path)
                hit = False
    digest, hit = _agree(None if key is None else key_digest(key), hit)
    if not hit:
        return None
    d = entry_dir(cache_dir, digest)
    try:
        with _quiet_restore_noise():
            model = restore_params(d, abstract, mesh, port.plan, verify=False)  # verified above
    except Exception as e:  # a damaged entry the digest did not catch: convert again (and replace it)
        if _num_processes() > 1:  # the processes could disagree: stop instead
            raise checkpoint.WeightsError(f"cache entry {d} cannot be restored ({_one_line(e)}); delete it") from None
        log.warning("cache entry %s cannot be restored (%s); converting %s again", d, _one_line(e), src_path)
        return None
    asked = restored_problems(nnx.state(model, nnx.Param), _converted(abstract, key_map, dtype))
    if asked:
        if _num_processes() > 1:
            raise checkpoint.WeightsError(f"cache entry {d} restores other parameters than asked ({asked[0]}); "
                                          f"delete it")
        log.warning("cache entry %s restores other parameters than asked (%s); converting %s again", d, asked[0],
                    src_path)
        return None
    log.info("restored %s from the cache entry %s", src_path, d)
    return checkpoint.fill_state(model, port, port_config, dtype=dtype, mesh=mesh, plan=port.plan)


def clear(cache_dir) -> None:
    """Removes every cache entry under `cache_dir` (local paths), partial ones included."""
    d = pathlib.Path(cache_dir)
    if d.exists():
        for entry in d.iterdir():
            if (entry / META_FILE).exists() or (entry / PARAMS_DIR).exists():
                shutil.rmtree(entry)
