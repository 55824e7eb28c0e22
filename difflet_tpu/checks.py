"""Checks that turn a wrong result or a late failure into a clear error, early.

* `check_finite(x, what)`: NaN or inf in an output (or an input) raises
  `NonFiniteError` naming it and counting the bad values. The bench checks
  every model's final latents with it; a serving loop can check each step's
  output (one device reduction and one host sync per call, so it is opt-in).
* `writable_dir(path, what)` / `writable_file(path, what)`: an output that
  cannot be written is refused before the work that would produce it (the
  bench's `--json`, `--profile`, `--dump-hlo`; `load_transformer`'s
  `cache_dir`).
"""

from __future__ import annotations

import dataclasses

import os
import tempfile

import numpy as np


class NonFiniteError(FloatingPointError):
    """An array holds NaN or inf where only finite values are correct."""


def _leaves(x, name=""):
    if isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from _leaves(x[k], f"{name}.{k}" if name else str(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{name}[{i}]")
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):  # a model output (`.sample`, ...)
        for f in dataclasses.fields(x):
            yield from _leaves(getattr(x, f.name), f"{name}.{f.name}" if name else f.name)
    elif x is not None:
        yield name, x


def _is_float(a) -> bool:
    dtype = getattr(a, "dtype", None)
    if dtype is None:
        return isinstance(a, float)
    dtype = np.dtype(dtype)
    return dtype.kind in "fc" or dtype.name.startswith(("bfloat", "float"))  # ml_dtypes' kinds are "V"


def check_finite(x, what: str = "output"):
    """Returns `x` if every floating-point value in it is finite; raises NonFiniteError otherwise.

    x: an array (numpy or jax, sharded or not), a Python float, or a dict /
    list / tuple of them (e.g. a dict of latents). Integer and bool arrays are
    skipped. For jax arrays the check runs on the devices and only a bool per
    array comes back to the host; the counts are computed only on failure.
    """
    for name, leaf in _leaves(x):
        if not _is_float(leaf):
            continue
        label = f"{what} {name}" if name else what
        if isinstance(leaf, (float, np.floating)):
            if not np.isfinite(leaf):
                raise NonFiniteError(f"{label} is {float(leaf)} (not finite)")
            continue
        if isinstance(leaf, np.ndarray):
            ok = bool(np.isfinite(leaf).all())
            xp = np
        else:
            import jax.numpy as jnp

            ok = bool(jnp.isfinite(leaf).all())
            xp = jnp
        if not ok:
            n_nan = int(xp.isnan(leaf).sum())
            n_inf = int(xp.isinf(leaf).sum())
            raise NonFiniteError(f"{label}: {n_nan} NaN and {n_inf} inf of {int(np.prod(leaf.shape))} values "
                                 f"(shape {tuple(leaf.shape)}, {np.dtype(leaf.dtype).name})")
    return x


def _create_a_file_in(directory: str):
    fd, probe = tempfile.mkstemp(prefix=".difflet-write-test-", dir=directory)
    os.close(fd)
    os.unlink(probe)


def writable_dir(path, what: str) -> str:
    """`path` as an absolute directory that exists (created if needed, with its
    parents) and in which a file can be created; ValueError naming `what` otherwise."""
    p = os.path.abspath(os.fspath(path))
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"{what} {path}: exists and is not a directory")
    try:
        os.makedirs(p, exist_ok=True)
        _create_a_file_in(p)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    return p


def writable_file(path, what: str) -> str:
    """`path` as an absolute file path that can be written (its directory must
    exist; an existing file is not modified by the check); ValueError otherwise."""
    p = os.path.abspath(os.fspath(path))
    if os.path.isdir(p):
        raise ValueError(f"{what} {path}: is a directory, not a file")
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        raise ValueError(f"{what} {path}: directory {parent} does not exist")
    try:
        if os.path.exists(p):
            with open(p, "a"):
                pass
        else:
            _create_a_file_in(parent)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    return p
