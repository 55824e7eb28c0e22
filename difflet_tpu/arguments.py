"""The argument checks every entry point shares, with one table of bounds.

`DiffusionPipeline.__call__` (and the video pipelines), `python -m difflet_tpu.generate`,
the bench and the check call these functions, so a value is refused the same way, with the
same bound, whichever door it comes in by. Each refusal is an `ArgumentError` (a ValueError)
that names the argument, prints its value (a jax or numpy scalar as its number, not
`Array(64, dtype=int32)`) and says what to give instead. Nothing here imports jax at module
level: the command lines check their flags before jax starts.

Integers accept Python ints, numpy integers and 0-d integer arrays (jax or numpy); bool is
never an int here, and a float is not silently truncated. Scales accept any finite real
(int or float, numpy / jax scalars included).
"""

from __future__ import annotations

import math

import numpy as np

# One table of bounds (inclusive). Past them a run cannot finish on any slice this project targets
# (or, for cpu_devices, the host's thread pools): the request is refused before the work instead
# of ending in a MemoryError, a hang or silent wrapping. `seed`: jax.random.key takes 32 bits, so a
# larger seed would wrap to a smaller one's image; it is refused, not wrapped.
LIMITS = dict(
    seed=(0, 2**32 - 1),
    steps=(1, 10_000),        # num_inference_steps, --steps
    warmup=(1, 1_000),        # the bench's untimed steps
    batch=(1, 1_024),         # images per call: prompts x num_images_per_prompt, --batch
    height=(1, 16_384),
    width=(1, 16_384),
    frames=(1, 4_097),        # video frames, 1 + 4 k (the causal VAE's 4x temporal factor)
    cpu_devices=(1, 64),      # parallel.mesh.MAX_CPU_DEVICES
    iters=(1, 100_000),       # the check's timed calls per site
)


class ArgumentError(ValueError):
    """An argument, or a pipeline folder, that cannot be run; raised before the work."""


def show(value) -> str:
    """`value` as a person reads it: a 0-d jax / numpy array as its number."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and tuple(value.shape) == ():
        try:
            return repr(value.item())
        except Exception:  # noqa: BLE001 - a traced value has no number
            pass
    return repr(value)


def refuse(name: str, value, what: str) -> ArgumentError:
    """The refusal of `value` for `name`: "--steps 0: must be >= 1" for a command-line flag,
    "`num_inference_steps` must be >= 1, got 0" for a Python argument."""
    if name.startswith("--"):
        return ArgumentError(f"{name} {show(value)}: {what}")
    return ArgumentError(f"`{name}` {what}, got {show(value)}")


def _integer_dtype(value) -> bool:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    try:
        return np.dtype(dtype).kind in "iu"
    except TypeError:
        return False


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
            limit: str | None = None) -> int:
    """`value` as a Python int within [minimum, maximum] (default: `LIMITS[limit]`);
    ArgumentError otherwise. Bool and floats are refused (`True` is not one token, 7.5 steps
    are not 7)."""
    if limit is not None:
        lo, hi = LIMITS[limit]
        minimum = lo if minimum is None else minimum
        maximum = hi if maximum is None else maximum
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not is_int and not (_integer_dtype(value) and tuple(getattr(value, "shape", (1,))) == ()):
        raise ArgumentError(f"{refuse(name, value, 'must be an int')} ({type(value).__name__})")
    v = int(value)
    if minimum is not None and v < minimum:
        raise refuse(name, v, f"must be >= {minimum}")
    if maximum is not None and v > maximum:
        raise refuse(name, v, f"must be <= {maximum}")
    return v


def seed(value, name: str = "seed") -> int:
    """An int in [0, 2**32): jax.random.key's 32 bits. Larger or negative seeds are refused,
    not wrapped (2**32 would give seed 0's image)."""
    return integer(name, value, limit="seed")


def count(name: str, value, limit: str) -> int:
    """A count >= 1 within `LIMITS[limit]` (steps, batch, frames, ...)."""
    return integer(name, value, limit=limit)


def size(name: str, value, multiple: int, limit: str | None = None) -> int:
    """A positive multiple of `multiple` within `LIMITS[limit or name]` (height, width)."""
    v = integer(name, value)
    hi = LIMITS[limit or name][1]
    if v <= 0 or v % multiple or v > hi:
        raise refuse(name, v, f"must be a positive multiple of {multiple} up to {hi}")
    return v


def num_frames(value, temporal_factor: int = 4, name: str = "num_frames") -> int:
    """Video frames: 1 + k x `temporal_factor` (the causal VAE keeps the first frame and
    compresses each `temporal_factor` after it), within LIMITS["frames"]."""
    v = integer(name, value, limit="frames")
    if (v - 1) % temporal_factor:
        lower = v - (v - 1) % temporal_factor
        raise ArgumentError(f"{refuse(name, v, f'must be 1 + a multiple of {temporal_factor}')}; e.g. {lower} or "
                            f"{lower + temporal_factor}")
    return v


def scale(name: str, value, *, required: bool = True, minimum: float | None = None) -> float | None:
    """A guidance scale: a finite real number (>= `minimum` when given), or None when not
    `required`. Strings, bool, complex and NaN / inf are refused (a NaN would only show as a
    non-finite image after the whole run; None would fail at the first step)."""
    if value is None:
        if required:
            raise ArgumentError(f"{refuse(name, None, 'must be a finite real number')}; give a number (or leave "
                                f"the argument out for the pipeline's default)")
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) or (
        hasattr(value, "dtype") and tuple(getattr(value, "shape", (1,))) == ()
        and (_integer_dtype(value) or is_floating(value.dtype)))
    if isinstance(value, (bool, np.bool_)):
        ok = False
    v = float(value) if ok else None
    if v is None or not math.isfinite(v):
        raise refuse(name, value, "must be a finite real number")
    if minimum is not None and v < minimum:
        raise refuse(name, v, f"must be >= {minimum}")
    return v


def max_sequence_length(value, limit: int, name: str = "max_sequence_length") -> int:
    """An int in [1, limit] (the text encoder's longest sequence; diffusers' check)."""
    v = integer(name, value, minimum=1)
    if v > limit:
        raise refuse(name, v, f"cannot be greater than {limit} (the text encoder's limit)")
    return v


def prompts(value, name: str = "prompt", allow_empty: bool = False) -> list[str]:
    """A string or a non-empty list of strings, as a list; empty or blank strings refused
    unless `allow_empty` (negative prompts)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ArgumentError(f"`{name}` must be a non-empty string or list of strings, got {show(value)}")
    for i, p in enumerate(items):
        if not isinstance(p, str):
            raise ArgumentError(f"`{name}`[{i}] must be a string, got {show(p)} ({type(p).__name__})")
        if not allow_empty and not p.strip():
            where = f"`{name}`" if isinstance(value, str) else f"`{name}`[{i}]"
            raise ArgumentError(f"{where} is empty: give a prompt to generate from")
    return list(items)


def negative_prompt(value, name: str = "negative_prompt") -> list[str] | None:
    """None, or a string / list of strings (empty strings allowed, as diffusers); checked
    whether or not guidance will use it, so a wrong type is never silently ignored."""
    return None if value is None else prompts(value, name, allow_empty=True)


def is_floating(dtype) -> bool:
    """A floating dtype, bfloat16 and the other ml_dtypes included (np.issubdtype does not
    count them)."""
    import jax.numpy as jnp

    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))
    except TypeError:
        return False


def latents(value, shape: tuple, name: str = "latents"):
    """Given latents: exactly `shape`, a floating dtype (float32, bfloat16, float16, float64)
    and finite; returned as they are."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        value = np.asarray(value)
        dtype = value.dtype
    if tuple(value.shape) != tuple(shape):
        raise ArgumentError(f"`{name}` must have the shape {tuple(shape)}, got {tuple(value.shape)}")
    if not is_floating(dtype):
        raise ArgumentError(f"`{name}` must be floating-point (float32, bfloat16, float16), got {np.dtype(dtype).name}")
    from difflet_tpu import checks

    try:
        checks.check_finite(value, f"`{name}`")
    except checks.NonFiniteError as e:
        raise ArgumentError(f"{e}; `{name}` must be finite") from None
    return value
