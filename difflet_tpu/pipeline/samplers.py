"""Samplers: a diffusers scheduler config -> what a denoise loop steps with.

A pipeline folder's `scheduler/scheduler_config.json` names its scheduler by `_class_name`;
two are implemented, each checked field by field (a wrong type or range, or an option that
would change the result and is not implemented, is a ValueError naming the file and field):

  FlowMatchEulerDiscreteScheduler -> schedules.SchedulerConfig, stepped by `EulerSampler`
                                     (FLUX.1, Qwen-Image, HunyuanVideo, LTX-2)
  UniPCMultistepScheduler         -> unipc.UniPCConfig, stepped by `unipc.UniPCSampler` (Wan)

A sampler has `.timesteps` ([N] float32: what the transformer gets before a model's own
scaling), `.sigmas` ([N + 1] float32), `len()`, `begin(i)` (a run from step i; step 0 always
starts one) and `step(i, model_output, sample) -> sample`.

    cfg = scheduler_from_folder("Wan2.1-T2V-1.3B-Diffusers/scheduler")
    sampler = make_sampler(cfg, 50)          # or sampler_from_config(raw_dict, 50)
    for i, t in enumerate(sampler.timesteps):
        latents = sampler.step(i, transformer(latents, t), latents)
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from difflet_tpu.pipeline import schedules as S
from difflet_tpu.pipeline import unipc

EULER = "FlowMatchEulerDiscreteScheduler"
UNIPC = "UniPCMultistepScheduler"
SCHEDULERS = (EULER, UNIPC)

# diffusers 0.42.1's FlowMatchEulerDiscreteScheduler.__init__ defaults
EULER_DEFAULTS = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096, invert_sigmas=False, shift_terminal=None,
                      use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
                      time_shift_type="exponential", stochastic_sampling=False)
EULER_NOT_IMPLEMENTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                         "stochastic_sampling")


def euler_config(raw: dict, where: str = "scheduler_config.json") -> S.SchedulerConfig:
    """A FlowMatchEulerDiscreteScheduler config, checked (null fields take diffusers' defaults)."""
    unknown = sorted(k for k in raw if not k.startswith("_") and k not in EULER_DEFAULTS)
    if unknown:
        raise ValueError(f"{where}: unknown {EULER} fields {unknown} (diffusers 0.42.1 has none of these; refused "
                         f"rather than ignored)")
    c = {**EULER_DEFAULTS, **{k: v for k, v in raw.items() if not k.startswith("_") and v is not None}}
    get = S.ConfigField(c, where)
    on = [k for k in EULER_NOT_IMPLEMENTED if get.bool(k)]
    if on:
        raise ValueError(f"{where}: {on} are not implemented by this port's flow-matching Euler schedule")
    cfg = S.SchedulerConfig(
        shift=get.number("shift", positive=True), use_dynamic_shifting=get.bool("use_dynamic_shifting"),
        base_shift=get.number("base_shift"), max_shift=get.number("max_shift"),
        base_image_seq_len=get.int("base_image_seq_len", minimum=1),
        max_image_seq_len=get.int("max_image_seq_len", minimum=1),
        shift_terminal=get.number("shift_terminal", optional=True),
        time_shift_type=get.choice("time_shift_type", ("exponential", "linear")),
        num_train_timesteps=get.int("num_train_timesteps", minimum=1))
    if cfg.max_image_seq_len == cfg.base_image_seq_len:
        raise ValueError(f"{where}: max_image_seq_len == base_image_seq_len ({cfg.base_image_seq_len}): "
                         f"calculate_shift divides by their difference")
    if cfg.shift_terminal is not None and not 0 <= cfg.shift_terminal < 1:
        raise ValueError(f"{where}: shift_terminal must be in [0, 1) or null, got {cfg.shift_terminal!r}")
    return cfg


def scheduler_from_config(raw: dict, where: str = "scheduler_config.json") -> S.SchedulerConfig | unipc.UniPCConfig:
    """The checked config of the scheduler `raw["_class_name"]` names (FlowMatchEuler when absent)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    name = raw.get("_class_name", EULER)
    if name == EULER:
        return euler_config(raw, where)
    if name == UNIPC:
        return unipc.UniPCConfig.from_dict(raw, where)
    raise ValueError(f"{where}: _class_name {name!r} is not supported (supported: {', '.join(SCHEDULERS)})")


def scheduler_from_folder(path) -> S.SchedulerConfig | unipc.UniPCConfig:
    """`path/scheduler_config.json` (`path`: a pipeline's `scheduler/` folder, or the file itself), checked."""
    path = Path(path)
    if path.is_dir():
        path = path / "scheduler_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None
    return scheduler_from_config(raw, str(path))


def make_sampler(config: S.SchedulerConfig | unipc.UniPCConfig, num_inference_steps: int | None, *, sigmas=None,
                 mu: float | None = None):
    """`scheduler.set_timesteps(num_inference_steps, sigmas=sigmas, mu=mu)` as a sampler."""
    if isinstance(config, unipc.UniPCConfig):
        return unipc.UniPCSampler(config, num_inference_steps, sigmas=sigmas, mu=mu)
    if isinstance(config, S.SchedulerConfig):
        n = len(sigmas) if sigmas is not None else num_inference_steps
        return EulerSampler(S.flow_match_euler(config, n, sigmas=sigmas, mu=mu))
    raise TypeError(f"not a scheduler config: {config!r}")


def sampler_from_config(raw: dict, num_inference_steps: int | None, *, where: str = "scheduler_config.json",
                        **set_timesteps_kwargs):
    """`make_sampler(scheduler_from_config(raw, where), num_inference_steps, **set_timesteps_kwargs)`."""
    return make_sampler(scheduler_from_config(raw, where), num_inference_steps, **set_timesteps_kwargs)


@functools.cache
def _euler():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def euler(latents, velocity, dt):
        """FlowMatchEulerDiscreteScheduler.step: in float32, back to the velocity's dtype."""
        x = latents.astype(jnp.float32) + dt * velocity.astype(jnp.float32)
        return x.astype(velocity.dtype)

    return euler


@dataclasses.dataclass
class EulerSampler:
    """FlowMatchEulerDiscreteScheduler's step over a `schedules.Schedule`: x + (sigma_{i+1} - sigma_i) v."""

    schedule: S.Schedule

    @property
    def timesteps(self) -> np.ndarray:
        return self.schedule.timesteps

    @property
    def sigmas(self) -> np.ndarray:
        return self.schedule.sigmas

    def __len__(self) -> int:
        return len(self.schedule)

    def dt(self, i: int) -> float:
        return self.schedule.dt(i)

    def begin(self, i: int = 0) -> None:
        """Euler keeps no state between steps."""

    def step(self, i: int, model_output, sample):
        return _euler()(sample, model_output, np.float32(self.schedule.dt(i)))


def as_sampler(schedule):
    """A sampler as is; a `schedules.Schedule` as its `EulerSampler`."""
    return EulerSampler(schedule) if isinstance(schedule, S.Schedule) else schedule
