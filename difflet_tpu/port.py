"""What a model port declares: one `PortSpec` per `models/<name>/` folder.

A port is the model (`model.py`), its diffusers config (`config.py`), its
checkpoint key map (`keys.py`) and how one call is prepared (`port.py`):
`prepare(run, kwargs) -> Prepared` validates diffusers' forward kwargs and
builds the step inputs eagerly (padding, patchify, RoPE tables), and
`forward(model, par, inputs, key)` is the step, written once for every
parallel mode. Everything else (placement, the pad rule, compilation and its
cache, the attention choice, tracing for deviceless compiles, caches) is
`difflet_tpu.runner.Runner`'s, once for every port.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One call's step inputs, made eagerly by a port's `prepare`.

    key:       the static geometry (hashable): one compiled step per key; also
               given to `forward`.
    inputs:    name -> array (host numpy or jax) or `Runner.constant` result.
    specs:     name -> PartitionSpec of that input over the mesh.
    out_specs: PartitionSpec (pytree) of the step's outputs.
    finish:    outputs -> what diffusers returns (unpad, unpatchify), eager.
    """

    key: Hashable
    inputs: dict
    specs: dict
    out_specs: Any
    finish: Callable


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How a diffusers pipeline drives this transformer (difflet_tpu.pipeline).

    schedule(steps, inputs, preset) -> schedulers.Schedule. guidance_mode:
    "cfg" (unconditional and conditional rows in one batch-2 call),
    "embedded" (a `guidance` input of guidance_mult * g) or "none".
    cfg_rescale: the guided velocity is rescaled per token to the conditional
    one's norm over channels (diffusers' QwenImagePipeline true CFG).
    """

    schedule: Callable
    steps: int
    guidance: float
    guidance_mode: str
    guidance_mult: float = 1.0
    timestep_scale: float = 1.0
    latent_keys: tuple = ("hidden_states",)
    latent_guidance: dict = dataclasses.field(default_factory=dict)  # latent key -> its own default scale (LTX-2 audio)
    cfg_rescale: bool = False


@dataclasses.dataclass(frozen=True)
class PortSpec:
    """Everything the harness needs from one port; the registry is built from these.

    name:          the family name used by the bench ("flux").
    class_names:   diffusers `_class_name`s this port loads.
    model_class:   the Flax model class (`Runner` finds the spec from a model).
    config_from_diffusers, presets, build, plan, key_map: the loader's contract.
    prepare, forward: the Runner's contract (module docstring).
    heads:         config -> {name: head count}; each must divide tp.
    released:      the default released preset; bench_shape its benchmark
                   (height, width, frames); tiny_shape the CPU default's.
    example_inputs, flops: for the bench.
    ag_default:    the all-gather-matmul implementation under SP on TPU when
                   `Config.sp_kernel` is unset.
    pipeline:      the schedule and guidance of the diffusers pipeline.
    experts:       preset -> Wan2.2-style boundary ratio (two transformers).
    options:       port-only Runner options and their defaults.
    ignored_keys:  diffusers' `_keys_to_ignore_on_load_unexpected` patterns.
    """

    name: str
    class_names: tuple
    model_class: type
    config_from_diffusers: Callable
    presets: dict
    build: Callable
    plan: dict
    key_map: Callable
    prepare: Callable
    forward: Callable
    heads: Callable
    released: str
    bench_shape: dict
    tiny_shape: dict
    example_inputs: Callable
    flops: Callable
    pipeline: Pipeline
    ag_default: str = "jax"
    experts: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    ignored_keys: tuple = ()
    forward_args: tuple = ()  # diffusers' forward parameters in order (positional calls)
    methods: dict = dataclasses.field(default_factory=dict)  # extra Runner methods: name -> fn(run, ...)
