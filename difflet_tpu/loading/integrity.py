"""What a cache entry's digests cover, and the check of what a restore returned.

* `data_digest(directory)`: sha256 over every file of a saved orbax checkpoint;
* `meta_digest(meta)`: sha256 over difflet_meta.json's content (the parameter
  table whose dtypes a restore uses, the config, the cache key, `data_sha256`),
  so every file of an entry is covered by a digest;
* `restored_problems(got, want)`: restored parameters whose shape, dtype or
  sharding differ from what was asked, checked before a restore returns.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os

import jax
import jax.numpy as jnp

from difflet_tpu.parallel.modes import path_names


def _files(root) -> list:
    """Every file under `root` (an epath), recursively, as (relative posix path, path)."""
    out = []

    def walk(d, prefix):
        for p in d.iterdir():
            rel = f"{prefix}{p.name}"
            if p.is_dir():
                walk(p, rel + "/")
            else:
                out.append((rel, p))

    walk(root, "")
    return sorted(out, key=lambda t: t[0])


def _file_sha256(p) -> str:
    with p.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def data_digest(directory) -> str:
    """sha256 over every file of a saved orbax checkpoint (relative path, size and
    content of each, in sorted order). Files are hashed in parallel threads."""
    from etils import epath

    files = _files(epath.Path(directory))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda t: _file_sha256(t[1]), files))
    h = hashlib.sha256()
    for (rel, _), d in zip(files, digests):
        h.update(f"{rel}\0{d}\n".encode())
    return h.hexdigest()


def meta_digest(meta: dict) -> str:
    """sha256 of difflet_meta.json's content without its own `meta_sha256` (canonical JSON):
    the parameter table (shapes, dtypes), the config, the cache key and `data_sha256`."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def restored_problems(got, want, *, max_lines: int = 8) -> list[str]:
    """Parameters of `got` whose shape, dtype or sharding differ from `want` (a tree of the
    same structure: arrays or ShapeDtypeStructs), one line each, at most `max_lines`."""
    out = []
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree_util.tree_leaves(want)
    for (path, g), w in zip(flat_got, flat_want):
        names = path_names(path)
        name = ".".join(names[:-1] if names and names[-1] == "value" else names)
        wrong = []
        if tuple(g.shape) != tuple(w.shape):
            wrong.append(f"shape {tuple(g.shape)}, asked {tuple(w.shape)}")
        if jnp.dtype(g.dtype) != jnp.dtype(w.dtype):
            wrong.append(f"dtype {jnp.dtype(g.dtype).name}, asked {jnp.dtype(w.dtype).name}")
        ws, gs = getattr(w, "sharding", None), getattr(g, "sharding", None)
        if ws is not None and gs is not None and not gs.is_equivalent_to(ws, len(g.shape)):
            wrong.append(f"sharding {gs}, asked {ws}")
        if wrong:
            out.append(f"{name}: " + "; ".join(wrong))
    if len(out) > max_lines:
        out = out[:max_lines] + [f"... and {len(out) - max_lines} more"]
    return out
