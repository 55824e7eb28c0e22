"""Models on devices: placement, abstract models, bytes, host memory, the compile cache.

`place` puts a model's parameters on a mesh by its parallel plan;
`abstract_model` builds one without memory (deviceless compiles);
`memory_report` reads a compiled program's HBM per chip. The step itself is
compiled by `difflet_tpu.runner.Runner`.

`enable_compile_cache(dir)` turns on JAX's persistent compilation cache so a
later process loads the compiled steps; `compile_stats()` counts compiles and
the cache's hits and misses (jax.monitoring events).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from difflet_tpu.parallel.modes import check_divisible, param_specs


def place(model, mesh, plan):
    """Puts every parameter of `model` on `mesh` with its plan sharding (in place)."""
    state = nnx.state(model)
    check_divisible(plan, state, mesh.shape["tp"])
    specs = param_specs(state, plan)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs)
    nnx.update(model, placed)
    return model


def abstract_model(build, mesh=None, plan=None):
    """`build()` as an abstract model (no memory): parameters are
    ShapeDtypeStructs, with their plan shardings on `mesh`. For deviceless
    compiles of released model sizes."""
    model = nnx.eval_shape(build)
    if mesh is None:
        return model
    state = nnx.state(model)
    specs = param_specs(state, plan)
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                          state, specs)
    nnx.update(model, placed)
    return model


def memory_report(compiled) -> dict:
    """HBM per chip of a compiled program, in bytes."""
    m = compiled.memory_analysis()
    out = dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
               temporaries=m.temp_size_in_bytes, aliased=m.alias_size_in_bytes,
               code=m.generated_code_size_in_bytes)
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"] + out["code"]
    return out


def bytes_per_device(model) -> int:
    """Bytes of `model`'s parameters on one device: each leaf's shard under its
    sharding (NamedShardings on one mesh shard evenly; a leaf without one counts whole)."""
    return tree_bytes_per_device(nnx.state(model))


def tree_bytes_per_device(tree) -> int:
    """`bytes_per_device` of a pytree of arrays (a Runner's parameter state)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


# --------------------------------------------------------------------------
# Host memory (the idle expert of a two-expert model, Config.expert_offload)
# --------------------------------------------------------------------------

HOST_MEMORY_KIND = "pinned_host"  # page-locked: the host-to-device copies DMA from it

# Host-to-device bytes/s per chip (PCIe), for the estimated swap time of an offloaded
# expert. An assumption from "How to Scale Your Model", part 2 (TPUs,
# https://jax-ml.github.io/scaling-book/tpus/): "PCIe bandwidth is typically around
# 1.5e10 bytes / second per chip", Trillium (v6e) 32 GB/s. Not measured here.
H2D_BYTES_PER_S = {"v5e": 1.5e10, "v6e": 3.2e10}


def host_memory_kind(devices) -> str | None:
    """`HOST_MEMORY_KIND` when every device can address it (TPU; CPU in jax 0.12), else None."""
    for d in devices:
        try:
            kinds = {m.kind for m in d.addressable_memories()}
        except Exception:  # noqa: BLE001 - platforms without memory spaces
            return None
        if HOST_MEMORY_KIND not in kinds:
            return None
    return HOST_MEMORY_KIND


def device_memory_limit(devices) -> int | None:
    """The smallest memory limit (`memory_stats()["bytes_limit"]`) of this process's
    devices, or None when a device reports none (CPU)."""
    limits = []
    for d in devices:
        if d.process_index != jax.process_index():
            continue
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - platforms without memory stats
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def live_bytes(memory_kind: str = "device") -> int:
    """Bytes of every live jax array in `memory_kind`, summed over their addressable
    shards (what this process holds there; replicas count once per device)."""
    total = 0
    for a in jax.live_arrays():
        if a.is_deleted() or a.sharding.memory_kind != memory_kind:
            continue
        shard = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
        total += shard * len(a.sharding.addressable_devices)
    return total


# --------------------------------------------------------------------------
# Persistent compilation cache
# --------------------------------------------------------------------------

# jax.monitoring events (jax 0.12: jax/_src/compiler.py, compilation_cache.py,
# dispatch.py). A "miss" is recorded when an entry is written; with the
# thresholds below every miss is written.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # every XLA compile or cache load
CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"
CACHE_ENTRY_SUFFIX = "-cache"  # jax's LRUCache file names: <key>-cache (+ <key>-atime)


class CompileCacheError(ValueError):
    """The compile cache directory cannot be used (named, with the reason)."""


def enable_compile_cache(path: str) -> str:
    """Turns on JAX's persistent compilation cache in `path` for this process.

    Every compiled program is written (no minimum compile time or size, so
    CPU compiles of tiny presets are cached too) and a later process with the
    same programs, devices, flags and jax/libtpu versions loads them instead
    of compiling. Call it before the first compile. The directory is created
    if missing and must be a writable local directory; anything else is a
    `CompileCacheError` here, before any work. Returns the absolute path.
    See https://docs.jax.dev/en/latest/persistent_compilation_cache.html.
    """
    import os
    import tempfile

    if not isinstance(path, str) or not path.strip():
        raise CompileCacheError(f"compile cache directory must be a non-empty path, got {path!r}")
    if "://" in path:
        # jax can write to gs:// through etils, but we only validate local paths
        raise CompileCacheError(f"compile cache {path!r}: only local directories are supported")
    full = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(full, exist_ok=True)
    except OSError as e:
        raise CompileCacheError(f"compile cache {path!r}: cannot create the directory ({e.strerror})") from e
    try:  # a real write: os.access misjudges read-only mounts and root
        with tempfile.NamedTemporaryFile(dir=full, prefix=".difflet-write-test-"):
            pass
    except OSError as e:
        raise CompileCacheError(f"compile cache {path!r}: directory is not writable ({e.strerror})") from e

    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", full)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if previous is not None and os.path.abspath(previous) != full:
        # jax opens its cache once per process; a new directory needs a reset
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    compile_stats()  # install the listeners before the first compile
    return full


def cache_entries(path: str) -> int:
    """Number of compiled programs stored in a compile cache directory."""
    import os

    if not os.path.isdir(path):
        return 0
    return sum(1 for name in os.listdir(path) if name.endswith(CACHE_ENTRY_SUFFIX))


_STATS = {"compiles": 0, "compile_s": 0.0, "cache_requests": 0, "cache_hits": 0, "cache_misses": 0}
_LISTENING = False


def _on_event(event, **kw):
    key = {CACHE_REQUEST_EVENT: "cache_requests", CACHE_HIT_EVENT: "cache_hits",
           CACHE_MISS_EVENT: "cache_misses"}.get(event)
    if key:
        _STATS[key] += 1


def _on_duration(event, duration, **kw):
    if event == COMPILE_EVENT:
        _STATS["compiles"] += 1
        _STATS["compile_s"] += duration


def compile_stats() -> dict:
    """Process-wide counters since the first call: XLA compiles (cache loads
    included) and their seconds, compile-cache requests, hits and misses.
    Take the difference of two snapshots for one piece of work."""
    global _LISTENING
    if not _LISTENING:
        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _LISTENING = True
    return dict(_STATS)


def stats_since(before: dict) -> dict:
    """`compile_stats()` now minus `before`."""
    now = compile_stats()
    out = {k: now[k] - before[k] for k in now}
    out["compile_s"] = round(out["compile_s"], 3)
    return out
