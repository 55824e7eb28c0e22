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

import numpy as np

from difflet_tpu.parallel import padding


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
    """How a diffusers pipeline drives this transformer (difflet_tpu.pipeline.denoise).

    schedule(steps, inputs, preset) -> pipeline.schedules.Schedule (flow-matching
    Euler) or a sampler of difflet_tpu.pipeline.samplers (Wan's UniPC), the port's
    `schedule.py`. guidance_mode: "cfg" (unconditional and conditional rows
    in one batch-2 call), "embedded" (a `guidance` input of guidance_mult * g)
    or "none". cfg_rescale: the guided velocity is rescaled per token to the
    conditional one's norm over channels (diffusers' QwenImagePipeline true CFG).
    expert(timestep, boundary_ratio) -> the index of the expert that runs the
    step, for ports with two transformers (`PortSpec.experts`; Wan2.2-A14B).
    arg_names: the pipeline's own argument names -> the transformer's, beyond
    the ones every pipeline shares (`denoise.PIPELINE_NAMES`), for `--embeddings`.
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
    expert: Callable | None = None
    arg_names: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Transformer2DModelOutput:
    """What a port returns with `return_dict=True` (diffusers' default), as diffusers'
    `Transformer2DModelOutput`: `.sample`; `out[0]` and `to_tuple()` as its
    `BaseOutput` allows. `return_dict=False` returns the tuple `(sample,)`."""

    sample: Any

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __getitem__(self, i):
        return self.to_tuple()[i]


@dataclasses.dataclass(frozen=True)
class AudioVisualModelOutput(Transformer2DModelOutput):
    """LTX-2's output (diffusers' `AudioVisualModelOutput`): `.sample` (video) and `.audio_sample`."""

    audio_sample: Any = None


def returned(return_dict, *outputs):
    """`outputs` as diffusers returns them: an output object, or the plain tuple."""
    if not return_dict:
        return tuple(outputs)
    return Transformer2DModelOutput(*outputs) if len(outputs) == 1 else AudioVisualModelOutput(*outputs)


def shape(x) -> tuple:
    """The shape of an array, a ShapeDtypeStruct or a (nested) list."""
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def packed_streams(cfg, hidden_states, encoder_hidden_states) -> tuple[int, int, int]:
    """(batch, image tokens, text tokens) of FLUX-style streams, `hidden_states`
    `(B, N_img, in_channels)` (2x2-packed latents) and `encoder_hidden_states`
    `(B, N_txt, joint_attention_dim)`; a ValueError naming the input otherwise."""
    hs, ehs = shape(hidden_states), shape(encoder_hidden_states)
    if len(hs) != 3 or hs[-1] != cfg.in_channels:
        raise ValueError(f"hidden_states: shape {hs}, expected (batch, image tokens, in_channels={cfg.in_channels}) "
                         f"(2x2-packed latents)")
    B, n_img = hs[0], hs[1]
    if len(ehs) != 3 or ehs[0] != B or ehs[-1] != cfg.joint_attention_dim:
        raise ValueError(f"encoder_hidden_states: shape {ehs}, expected ({B}, text tokens, "
                         f"joint_attention_dim={cfg.joint_attention_dim})")
    n_txt = ehs[1]
    if n_img < 1 or n_txt < 1:
        raise ValueError(f"empty stream: {n_img} image and {n_txt} text tokens")
    return B, n_img, n_txt


def check_per_sample(name: str, x, batch: int):
    """`x` (a timestep, a guidance scale) is one value, `(1,)` or `(batch,)`."""
    s = shape(x)
    if len(s) > 1 or (len(s) == 1 and s[0] not in (1, batch)):
        raise ValueError(f"{name}: shape {s}, expected ({batch},) (or one value for the batch)")


def returned_sample(n_rows: int, return_dict=True, unpatchify: Callable | None = None) -> Callable:
    """The usual `finish`: the first `n_rows` rows of the step's output (the pad cut),
    `unpatchify`d if given, returned as diffusers does (`returned`)."""

    def finish(out):
        out = padding.unpad(out, n_rows)
        out = out if unpatchify is None else unpatchify(out)
        return returned(return_dict, out)

    return finish


def check_size(why: str, *, frames: int | None = None, frame_step: int = 1, height: int, width: int,
               multiple: int) -> None:
    """`example_inputs`' check of a pixel size: `frames` is 1 + frame_step * k, `height` and
    `width` multiples of `multiple` (and every value >= 1); a ValueError naming each wrong
    value and the rule (`why`: where the multiple comes from)."""
    bad = []
    if frames is not None and (frames < 1 or (frames - 1) % frame_step):
        ok = 1 + frame_step * max(0, round((frames - 1) / frame_step))
        bad.append(f"frames {frames} is not 1 + {frame_step}k (e.g. {ok})")
    for name, v in (("height", height), ("width", width)):
        if v < 1 or v % multiple:
            bad.append(f"{name} {v} is not a positive multiple of {multiple} (e.g. {max(1, round(v / multiple)) * multiple})")
    if bad:
        raise ValueError("; ".join(bad) + f" ({why})")


def packed_image_grid(height: int, width: int) -> tuple[int, int]:
    """The `(height / 16, width / 16)` token grid of an image's VAE-8x latents packed 2x2
    (FLUX, Qwen-Image); `example_inputs`' check of the size."""
    check_size("VAE 8x, 2x2 packing", height=height, width=width, multiple=16)
    return height // 16, width // 16


def randn(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """`example_inputs`' standard normal values, rounded to float32 first, then to `dtype`."""
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def call_model(model, par, inputs: dict, key):
    """The usual `forward`: the model on the prepared inputs, `model(par, **inputs)`."""
    return model(par, **inputs)


def attention_heads(config) -> dict:
    """The usual `heads`: the config's `num_attention_heads` must divide tp."""
    return {"num_attention_heads": config.num_attention_heads}


@dataclasses.dataclass(frozen=True)
class PortSpec:
    """Everything the harness needs from one port; the registry is built from these.

    name:          the family name used by the bench ("flux").
    class_names:   diffusers `_class_name`s this port loads.
    model_class:   the Flax model class (`Runner` finds the spec from a model).
    config_from_diffusers, presets, build, plan, key_map: the loader's contract.
    prepare, forward: the Runner's contract (module docstring).
    heads:         config -> {name: head count}; each must divide tp
                   (default: `num_attention_heads`).
    released:      the default released preset; bench_shape its benchmark
                   (height, width, frames); tiny_shape the CPU default's.
    example_inputs, flops: for the bench.
    ag_default:    the all-gather-matmul implementation under SP on TPU when
                   `Config.sp_kernel` is unset.
    pipeline:      the schedule and guidance of the diffusers pipeline.
    experts:       preset -> Wan2.2-style boundary ratio (two transformers).
    options:       port-only Runner options and their defaults.
    ignored_keys:  diffusers' `_keys_to_ignore_on_load_unexpected` patterns.
    sp_local_plan: plan rows that take precedence over `plan` under SP with
                   `Parallel.cross_local` (`Config.sp_cross_local`): the weights
                   a port then uses on this rank's rows whole (`plan_for`).
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
    released: str
    bench_shape: dict
    tiny_shape: dict
    example_inputs: Callable
    flops: Callable
    pipeline: Pipeline
    heads: Callable = attention_heads
    ag_default: str = "jax"
    experts: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    ignored_keys: tuple = ()
    forward_args: tuple = ()  # diffusers' forward parameters in order (positional calls; others refused)
    extra_kwargs: tuple = ()  # keywords the port takes beyond diffusers' forward (Wan's text_kv)
    methods: dict = dataclasses.field(default_factory=dict)  # extra Runner methods: name -> fn(run, ...)
    sp_local_plan: dict = dataclasses.field(default_factory=dict)

    def plan_for(self, par) -> dict:
        """The parallel plan of a Runner's `par`: `plan`, with `sp_local_plan`'s rows
        first (the first matching pattern wins) when `par.cross_local`."""
        if par.cross_local and self.sp_local_plan:
            return {**self.sp_local_plan, **{k: v for k, v in self.plan.items() if k not in self.sp_local_plan}}
        return self.plan


def port_spec(config, model, keys, port, **own) -> PortSpec:
    """The spec of a port folder (docs/porting.md): the loader's and the Runner's
    contract read from its modules, which name them the same way in every folder
    (`config.CLASS_NAME`, `PRESETS`, `IGNORED_KEYS`, `config_from_diffusers`;
    `model.PLAN`, `build`; `keys.key_map`; `port.prepare`, `forward`,
    `FORWARD_ARGS`, `example_inputs`, `flops`), plus `own`: what is the port's
    own (`name`, `model_class`, shapes, pipeline, defaults, extras)."""
    return PortSpec(class_names=(config.CLASS_NAME,), config_from_diffusers=config.config_from_diffusers,
                    presets=config.PRESETS, ignored_keys=config.IGNORED_KEYS, build=model.build, plan=model.PLAN,
                    key_map=keys.key_map, prepare=port.prepare, forward=port.forward,
                    forward_args=port.FORWARD_ARGS, example_inputs=port.example_inputs, flops=port.flops, **own)
