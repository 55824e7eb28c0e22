"""Checks that turn a wrong result or a late failure into a clear error, early.

* `check_finite(x, what)`: NaN or inf in an output (or an input) raises
  `NonFiniteError` naming it and counting the bad values. The bench checks
  every model's final latents with it; a serving loop can check each step's
  output (one device reduction and one host sync per call, so it is opt-in).
* `writable_dir(path, what)` / `writable_file(path, what)`: an output that
  cannot be written is refused before the work that would produce it (the
  bench's `--json`, `--profile`, `--dump-hlo`; `load_transformer`'s
  `cache_dir`); `not_an_input` refuses an output that is also an input.
* `check_outputs([(flag, path)], inputs)`: every output of a run at once
  (generate, check): not empty, not under /proc or /sys, writable, not an
  input, no two the same file.
* `write_atomic(path, data, what)`: every file the project writes goes
  through a temporary file and a rename; a failed write is a `WriteError`
  and leaves nothing partial. `write_all_atomic` writes several outputs of
  one run all or none (no image left without its report).
* `check_input(name, x)` / `check_inputs(kwargs)`: the kind of every diffusers
  forward argument (floating latents and embeddings, real timesteps, 0/1
  masks, nothing empty), one table for every port (`Runner.prepare`) and the
  bench's `--embeddings`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import os
import shutil
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
    if os.path.exists(p) and not os.path.isfile(p):  # /dev/full, a FIFO: written in place, never renamed over
        raise ValueError(f"{what} {path}: not a regular file (a device or a pipe); give a file path")
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


class WriteError(RuntimeError):
    """An output could not be written; nothing partial was left at its path."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path, data, what: str = "output") -> str:
    """Writes `data` (str, bytes, or a function that writes into the open binary file) to
    `path` through a temporary file in the same directory, flushed and renamed over `path`:
    a reader never sees a partial file, and a failed write (a full disk, an I/O error, an
    exception of the writer) leaves `path` as it was. The file gets the mode `open()` would
    give it (0666 less the umask), not the temporary file's 0600. Raises WriteError naming
    `what` for an OS error; a writer's own exception propagates."""
    return write_all_atomic([(path, data, what)])[0]


def write_all_atomic(items) -> list[str]:
    """The outputs of one run, all or none: `items` is [(path, data, what)] as `write_atomic`
    takes them; each is written to a temporary file beside its path, and only when every one
    is written are they renamed into place. A failed write (of the report after the images,
    say) leaves every path as it was."""
    done, paths = [], []
    try:
        for path, data, what in items:
            p = os.path.abspath(os.fspath(path))
            paths.append(p)
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(p)}.", suffix=".tmp", dir=os.path.dirname(p))
            except OSError as e:
                raise WriteError(f"{what} {path}: cannot write it ({e.strerror or e}); nothing was written") from None
            done.append(tmp)
            try:
                os.fchmod(fd, 0o666 & ~_umask())
                with os.fdopen(fd, "wb") as f:
                    if callable(data):
                        data(f)
                    else:
                        f.write(data.encode() if isinstance(data, str) else data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise WriteError(f"{what} {path}: cannot write it ({e.strerror or e}); nothing was written") from None
        for i, (tmp, p, (path, _, what)) in enumerate(zip(done, paths, items)):
            try:
                os.replace(tmp, p)
            except OSError as e:
                raise WriteError(f"{what} {path}: cannot move it into place ({e.strerror or e})") from None
            done[i] = None
    finally:
        for tmp in done:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    return paths


@contextlib.contextmanager
def atomic_dir(path, what: str = "output"):
    """Yields a new temporary directory beside `path` to write into. When the block ends
    without error it replaces `path` (a rename; an older directory there is removed), and
    on any error it is removed: `path` never holds a partial result. WriteError names `what`."""
    p = os.path.abspath(os.fspath(path))
    parent, base = os.path.dirname(p), os.path.basename(p)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
        os.chmod(tmp, 0o777 & ~_umask())  # as makedirs would make it, not mkdtemp's 0700
    except OSError as e:
        raise WriteError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    try:
        yield tmp
        try:
            old = None
            if os.path.lexists(p):  # rename(2) replaces only an empty directory: move the old one aside
                old = tempfile.mkdtemp(prefix=f".{base}.", suffix=".old", dir=parent)
                os.replace(p, old)
            os.replace(tmp, p)
            tmp = None
        except OSError as e:
            raise WriteError(f"{what} {path}: cannot move it into place ({e.strerror or e})") from None
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# Trees of the kernel's own files: nothing written there is a file on a disk, and a probe can
# succeed there even for root while the real write fails after the run.
NOT_WRITABLE_TREES = ("/proc", "/sys")


def check_outputs(outputs, inputs: dict | None = None) -> list[str]:
    """Every output of one run checked before the work: `outputs` is [(flag, path)] (None:
    not asked for), `inputs` {flag: path} as `not_an_input` takes them. Refused: an empty path
    (`--json ''` is not "no report"), a path under /proc or /sys, what `writable_file` refuses
    (a directory, a device or pipe, a missing or unwritable folder), an input or a file inside
    an input folder, and two outputs that are the same file. Returns the absolute paths."""
    seen, out = {}, []
    for flag, path in outputs:
        if path is None:
            continue
        if not str(os.fspath(path)).strip():
            raise ValueError(f"{flag} {str(path)!r}: an empty path; give a file name, or leave {flag} out")
        real = os.path.realpath(os.fspath(path))
        for tree in NOT_WRITABLE_TREES:
            if real == tree or real.startswith(tree + os.sep):
                raise ValueError(f"{flag} {path}: under {tree}, which holds the kernel's files, not yours; give a "
                                 f"path on a disk")
        p = writable_file(path, flag)
        not_an_input(path, inputs or {}, flag)
        if real in seen:
            raise ValueError(f"{flag} {path}: is also the {seen[real]} output; give each output its own file")
        seen[real] = flag
        out.append(p)
    return out


def not_an_input(path, inputs: dict, what: str) -> None:
    """An output `path` that is one of `inputs` ({flag: path}; a directory input covers
    the files under it) is refused before the work: it would overwrite what the run reads."""
    out = os.path.realpath(os.fspath(path))
    for flag, src in inputs.items():
        if not src:
            continue
        src = os.path.realpath(os.fspath(src))
        if out == src or (os.path.isdir(src) and out.startswith(src.rstrip(os.sep) + os.sep)):
            raise ValueError(f"{what} {path}: is also an input ({flag} {src}); write the output elsewhere")


# --------------------------------------------------------------------------
# Input kinds: one table for every port's forward arguments and the bench's --embeddings
# --------------------------------------------------------------------------

# diffusers forward arguments by the kind of value they must hold; names no port uses are
# harmless. Floating arrays are never made from integers, bools or complex numbers silently:
# a cast would run the model on wrong values (complex keeps only its real part).
FLOAT_INPUTS = frozenset({
    "hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
    "encoder_hidden_states_image", "pooled_projections"})
# Real numbers (integers or floats; not bool, complex or strings): times, scales, positions.
REAL_INPUTS = frozenset({
    "timestep", "audio_timestep", "sigma", "audio_sigma", "guidance", "img_ids", "txt_ids",
    "video_coords", "audio_coords", "fps", "perturbation_mask", "video_keyframes_mask"})
# Text masks: bool, or numbers that are all 0 or 1. Any other value would mean one thing to one
# part of a model and another to the next (HunyuanVideo's refiner reads `mask != 0`, its joint
# attention counts the ones).
MASK_INPUTS = frozenset({"encoder_attention_mask", "audio_encoder_attention_mask", "encoder_hidden_states_mask"})
# Streams whose token axis (1) must not be empty.
TOKEN_INPUTS = frozenset({"encoder_hidden_states", "audio_encoder_hidden_states", "encoder_hidden_states_image"})


def input_kind(name: str) -> str | None:
    """"float", "real", "mask" or None (not an array input) for a forward argument name;
    a `negative_` prefix (the unconditional half of --embeddings) is ignored."""
    name = name.removeprefix("negative_")
    for kind, names in (("float", FLOAT_INPUTS), ("real", REAL_INPUTS), ("mask", MASK_INPUTS)):
        if name in names:
            return kind
    return None


def _dtype_of(x):
    if isinstance(x, (bool, np.bool_)):
        return np.dtype(bool)
    if isinstance(x, (int, float, complex, np.number)):
        return np.asarray(x).dtype
    if hasattr(x, "dtype"):
        try:
            return np.dtype(x.dtype)
        except TypeError:
            return None
    if isinstance(x, (list, tuple)):
        try:
            return np.asarray(x).dtype
        except (ValueError, TypeError):
            return None
    return None


def _float_dtype(dt) -> bool:
    return dt.kind == "f" or dt.name.startswith(("bfloat", "float"))


def check_input(name: str, x, kind: str | None = None, where: str = "") -> None:
    """`x` holds the kind of value `name` needs (`input_kind`), and is not empty; a
    ValueError naming the input, its dtype or values and what is expected otherwise.

    float: a floating-point array; real: integer or floating (a scalar or an array);
    mask: bool, or numbers all 0 or 1. Masks are read on the host (their values decide
    which tokens exist); every other check reads only the dtype and the shape."""
    kind = kind or input_kind(name)
    if kind is None or x is None:
        return
    label = f"{where}{name}"
    if isinstance(x, str) or isinstance(x, bytes):
        raise ValueError(f"{label}: {x!r} is a string; expected {_EXPECT[kind]}")
    dt = _dtype_of(x)
    if dt is None:
        raise ValueError(f"{label}: a {type(x).__name__} is not an array; expected {_EXPECT[kind]}")
    ok = {"float": _float_dtype(dt),
          "real": _float_dtype(dt) or dt.kind in "iu",
          "mask": _float_dtype(dt) or dt.kind in "iub"}[kind]
    if not ok:
        raise ValueError(f"{label}: dtype {dt.name}; expected {_EXPECT[kind]} (not cast: a cast would run on "
                         f"other values)")
    shape = tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)
    if 0 in shape:
        axis = shape.index(0)
        what = ": no text tokens" if name.removeprefix("negative_") in TOKEN_INPUTS and axis == 1 else ""
        raise ValueError(f"{label}: shape {shape} is empty (axis {axis} has length 0{what}); every axis needs "
                         f"at least one entry")
    if kind == "mask" and dt.kind != "b":
        if isinstance(x, np.ndarray) or not hasattr(x, "dtype") or isinstance(x, np.generic):
            a = np.asarray(x)
            bad = ~((a == 0) | (a == 1))
            n_bad = int(bad.sum())
            first = a[bad].ravel()[:1].tolist() if n_bad else []
        else:  # a jax array: the test on its devices, one bool (and the count on failure) back
            import jax.numpy as jnp

            bad = (~((x == 0) | (x == 1))).ravel()
            n_bad = int(jnp.sum(bad))
            first = [float(x.ravel()[jnp.argmax(bad)])] if n_bad else []
        if n_bad:
            raise ValueError(f"{label}: {n_bad} value(s) other than 0 and 1 (e.g. {first[0]}); a mask is bool or "
                             f"0/1 (1: a token, 0: padding)")


_EXPECT = {"float": "a floating-point array (float32, bfloat16, float16, float64)",
           "real": "integers or floating-point numbers (not bool, complex or strings)",
           "mask": "a bool or 0/1 mask"}


def check_inputs(kwargs: dict, where: str = "") -> None:
    """`check_input` on every argument of `kwargs` whose name has a kind."""
    for name, x in kwargs.items():
        check_input(name, x, where=where)
