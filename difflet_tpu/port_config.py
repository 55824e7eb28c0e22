"""The shared part of every port's `config_from_diffusers`: typed checks of a diffusers `config.json`.

A port declares a schema, `{key: check}`, with one entry per key of the
diffusers class's `__init__` that it understands, and calls `parse`:

    values = port_config.parse(cfg, overrides, CLASS_NAME, SCHEMA)

`parse` returns the checked (and normalised: lists to tuples) values of the
keys present, and raises a ValueError naming the key and the value for

* a `_class_name` other than the port's,
* a `config.json` key the schema does not list (a key the port does not know
  could change the model, so it is not dropped silently),
* a value of the wrong type or range (`num_layers: -1`, `"2"`, `2.5`;
  `patch_size: [1, -2, 2]`; `eps: 0`; ...).

An unknown keyword override (a build option passed to `load_transformer` or
`config_from_diffusers`) raises `UnknownOption`, a ValueError, so the loader
can name it as an argument rather than as a `config.json` key. Each port keeps
its own rules on top (supported values, relations between keys).
"""

from __future__ import annotations

import math
from typing import Any, Callable

Check = Callable[[str, Any], Any]


class PortConfig:
    """The base of the ports' frozen config dataclasses: what every one derives the same way."""

    @property
    def inner_dim(self) -> int:
        """The attention width, `num_attention_heads * attention_head_dim` (diffusers' `inner_dim`)."""
        return self.num_attention_heads * self.attention_head_dim


class ImagePatchConfig(PortConfig):
    """A port on square 2-D patches of a latent image (FLUX, Qwen-Image): `patch_size`,
    `in_channels`, `out_channels` (None: as `in_channels`)."""

    @property
    def out_features(self) -> int:
        """proj_out's width: patch_size**2 * (out_channels or in_channels) (diffusers leaves unpatchify
        to the pipeline)."""
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


class UnknownOption(ValueError):
    """A keyword override that is not a config key of the port."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def pos_int(key, v):
    if not _is_int(v) or v < 1:
        raise ValueError(f"{key}: {v!r} is not a positive integer")
    return v


def nonneg_int(key, v):
    if not _is_int(v) or v < 0:
        raise ValueError(f"{key}: {v!r} is not a non-negative integer")
    return v


def pos_float(key, v):
    """A finite number > 0 (an int is accepted and kept)."""
    if not _is_number(v) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{key}: {v!r} is not a finite positive number")
    return v


def boolean(key, v):
    if not isinstance(v, bool):
        raise ValueError(f"{key}: {v!r} is not a bool (true / false)")
    return v


def string(key, v):
    if not isinstance(v, str):
        raise ValueError(f"{key}: {v!r} is not a string")
    return v


def optional(check: Check) -> Check:
    """`check`, or None (JSON null)."""

    def opt(key, v):
        return None if v is None else check(key, v)

    opt.__name__ = f"optional({check.__name__})"
    return opt


def pos_ints(n: int | None = None) -> Check:
    """A list / tuple of positive integers (of length `n` if given), returned as a tuple."""

    def check(key, v):
        what = f"a list of {n} positive integers" if n else "a list of positive integers"
        if not isinstance(v, (list, tuple)) or (n is not None and len(v) != n) or not v:
            raise ValueError(f"{key}: {v!r} is not {what}")
        for x in v:
            if not _is_int(x) or x < 1:
                raise ValueError(f"{key}: {v!r} is not {what} ({x!r})")
        return tuple(v)

    check.__name__ = f"pos_ints({n})"
    return check


def check_rope_axes(key: str, axes: tuple, head_dim: int):
    """RoPE axis widths (`axes_dims_rope`, `rope_axes_dim`): each even (RoPE rotates
    channel pairs), together `attention_head_dim`."""
    if any(d % 2 for d in axes):
        raise ValueError(f"{key}: {list(axes)} must be positive even numbers (RoPE rotates channel pairs)")
    if sum(axes) != head_dim:
        raise ValueError(f"{key}: {list(axes)} sums to {sum(axes)}, not attention_head_dim = {head_dim}")


def parse(cfg: dict, overrides: dict, class_name: str, schema: dict[str, Check]) -> dict:
    """The checked values of `cfg` (a diffusers config.json dict) updated by `overrides`.

    Keys starting with `_` (`_class_name`, `_diffusers_version`, ...) are
    metadata; `_class_name`, if present, must be `class_name`.
    """
    if cfg.get("_class_name", class_name) != class_name:
        raise ValueError(f"_class_name: {cfg['_class_name']!r} is not {class_name}")
    unknown = sorted(k for k in overrides if k not in schema)
    if unknown:
        raise UnknownOption(f"unknown option(s) {', '.join(map(repr, unknown))}: not {class_name} config keys "
                            f"(known: {', '.join(sorted(schema))})")
    unknown = sorted(k for k in cfg if not k.startswith("_") and k not in schema)
    if unknown:
        raise ValueError(f"{unknown[0]!r}: not a {class_name} config key this port knows "
                         f"(unknown keys: {unknown}; known: {', '.join(sorted(schema))})")
    out = {}
    for key, value in {**cfg, **overrides}.items():
        if key.startswith("_"):
            continue
        out[key] = schema[key](key, value)
    return out
