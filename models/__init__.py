"""Flax ports of diffusers DiTs, installed as `difflet_tpu.models` (never top-level `models`).

Each port is one folder with the same files (docs/porting.md): `config.py`,
`model.py`, `keys.py`, `rope.py`, `port.py`, `schedule.py`, and an `__init__.py` that
declares its `SPEC` (`difflet_tpu.port.PortSpec`). `PORTS` is the one list of
ports; everything else, the loader's class lookup included, reads their specs.
"""

from __future__ import annotations

import importlib

PORTS = ("flux", "wan", "hunyuan_video", "ltx2", "qwen_image")


def spec(name: str):
    """The `PortSpec` of port `name` ("flux", "wan", ..., or a registered test port)."""
    for extra in _EXTRA:
        if extra.name == name:
            return extra
    if name not in PORTS:
        raise ValueError(f"unknown model port {name!r}; ports: {', '.join(PORTS)}")
    return importlib.import_module(f"difflet_tpu.models.{name}").SPEC


def specs() -> dict:
    """Every port's spec, by name."""
    return {name: spec(name) for name in PORTS}


def spec_for_class(class_name: str):
    """The spec of the port (in-tree or registered) that loads diffusers class `class_name`."""
    every = [*specs().values(), *_EXTRA]
    for s in every:
        if class_name in s.class_names:
            return s
    known = sorted(c for s in every for c in s.class_names)
    raise ValueError(f"no port for diffusers class {class_name!r}; ported: {', '.join(known)}")


def spec_for_model(model):
    """The spec of the port whose model class `model` is (or a registered test port's)."""
    for s in (*specs().values(), *_EXTRA):
        if isinstance(model, s.model_class):
            return s
    raise TypeError(f"{type(model).__name__} is not a model of any port ({', '.join(PORTS)})")


_EXTRA = []


def registered() -> dict:
    """The registered out-of-tree specs (`register`), by name."""
    return {s.name: s for s in _EXTRA}


def register(port_spec):
    """Registers an out-of-tree spec for `spec_for_model` (e.g. the toy port of
    difflet_tpu.testing); in-tree ports are listed in PORTS."""
    if port_spec not in _EXTRA:
        _EXTRA.append(port_spec)
    return port_spec

