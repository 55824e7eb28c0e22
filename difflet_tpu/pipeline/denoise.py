"""The denoise loop over a `Runner`, as each diffusers pipeline drives it.

A port's `PortSpec.pipeline` (difflet_tpu.port.Pipeline) says how its
diffusers pipeline drives the transformer: the
schedule (its `models/<name>/schedule.py`: a flow-matching Euler schedule of
difflet_tpu.pipeline.schedules, or Wan's UniPC sampler of difflet_tpu.pipeline.samplers),
how the timestep is scaled, whether guidance is a classifier-free batch-2 call
(Wan, LTX-2: unconditional and conditional rows in one call, combined as
`u + g (c - u)`) or an embedding (FLUX.1-dev `guidance = g`, HunyuanVideo
`guidance = 1000 g`), the switch between two experts (Wan2.2-A14B's at
`boundary_ratio * 1000`) and the pipeline's own argument names.

`Denoiser` holds the runners (one per expert), the conditioning (seeded
random embeddings of the right shapes, or precomputed ones from a file with
diffusers' argument names) and the latents from a seed. Each step calls the
runner's compiled step with the timestep as a runtime array (same shapes and
dtypes every step, so nothing recompiles) and then, for Euler, one jitted
update `x + (sigma_next - sigma) * v` in float32 whose `dt` and guidance scale
are runtime scalars too; for a sampler (UniPC) one jitted guided velocity and
the sampler's jitted step (its coefficients runtime arrays: one program too).
For Wan2.2-A14B the idle expert can wait in host memory
and come back at the switch (`Config.expert_offload`, `Denoiser(offload=)`).

Models are named as the bench takes them: "flux" (its released preset),
"flux:tiny", or a released preset name; `resolve_model` reads the specs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import Callable

import numpy as np

from difflet_tpu.pipeline import schedules as S


def resolve_model(name: str):
    """`--model` -> (PortSpec, preset). Accepts "port" (its released preset),
    "port:preset" (e.g. "wan:tiny") or a released preset name (e.g. "flux.1-dev")."""
    from difflet_tpu import models

    ports = {**models.specs(), **models.registered()}
    if ":" in name:
        fam, preset = name.split(":", 1)
    elif name in ports:
        fam, preset = name, None
    else:
        hits = [(s, name) for s in ports.values() if name in s.presets and name != "tiny"]
        if len(hits) != 1:
            raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(model_names())}")
        return hits[0]
    if fam not in ports:
        raise ValueError(f"unknown model port {fam!r}; known: {', '.join(sorted(ports))}")
    spec = ports[fam]
    preset = spec.released if preset is None else preset
    if preset not in spec.presets:
        raise ValueError(f"{fam} has no preset {preset!r}; presets: {', '.join(spec.presets)}")
    return spec, preset


def model_names() -> list[str]:
    """"port:preset" names of every port's presets."""
    from difflet_tpu import models

    ports = {**models.specs(), **models.registered()}
    return [f"{name}:{p}" for name, spec in ports.items() for p in spec.presets]


# --------------------------------------------------------------------------
# Conditioning
# --------------------------------------------------------------------------

# the diffusers pipelines' shared argument names -> transformer forward names; a
# port's own are its `Pipeline.arg_names` (LTX-2's audio, Wan's image)
PIPELINE_NAMES = {
    "prompt_embeds": "encoder_hidden_states",
    "pooled_prompt_embeds": "pooled_projections",
    "prompt_attention_mask": "encoder_attention_mask",
}
NOT_CONDITIONING = ("hidden_states", "audio_hidden_states", "timestep", "sigma", "guidance")
UNBATCHED = ("img_ids", "txt_ids")  # FLUX's positions: [tokens, 3], no batch axis


def forward_names(emb: dict, arg_names: dict | None = None) -> dict:
    """`emb` with pipeline argument names (`PIPELINE_NAMES`, and a port's own
    `Pipeline.arg_names`) replaced by the transformer's, `negative_` kept."""
    names = {**PIPELINE_NAMES, **(arg_names or {})}
    out = {}
    for k, v in emb.items():
        neg = k.startswith("negative_")
        base = k[len("negative_"):] if neg else k
        out[("negative_" if neg else "") + names.get(base, base)] = v
    return out


def read_embeddings(path: str) -> dict:
    """Precomputed text embeddings: a .safetensors or .npz whose keys are
    diffusers' argument names (transformer forward names such as
    `encoder_hidden_states`, or pipeline names such as `prompt_embeds`; a
    port's own pipeline names are renamed by `apply_embeddings`), plus
    `negative_*` for the unconditional half of classifier-free guidance.

    Raises ValueError naming the file for a file that cannot be read, an empty
    one, and arrays with NaN or inf."""
    from difflet_tpu.checks import NonFiniteError, check_finite

    try:
        if path.endswith(".safetensors"):
            from safetensors.numpy import load_file

            raw = load_file(path)
        elif path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as f:
                raw = {k: f[k] for k in f.files}
        else:
            raise ValueError(f"--embeddings {path}: expected a .safetensors or .npz file")
    except ValueError as e:
        if str(e).startswith("--embeddings"):
            raise
        raise ValueError(f"--embeddings {path}: cannot read it ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - zipfile, safetensors and OS errors, all with the path
        raise ValueError(f"--embeddings {path}: cannot read it ({type(e).__name__}: {e})") from None
    out = forward_names({k: np.asarray(v) for k, v in raw.items()})
    if not out:
        raise ValueError(f"--embeddings {path}: no arrays")
    from difflet_tpu.checks import check_input

    for (k, v), name in zip(raw.items(), out):  # floating embeddings, 0/1 masks, real positions: never cast
        check_input(k, np.asarray(v), kind=input_kind_of(name), where=f"--embeddings {path}: ")
    try:
        check_finite(raw, f"--embeddings {path}:")
    except NonFiniteError as e:
        raise ValueError(str(e)) from None
    return out


def input_kind_of(name: str) -> str:
    """The kind (`checks.input_kind`) of an --embeddings array: a forward argument's, and
    floating for names no table lists (text embeddings of a port's own name)."""
    from difflet_tpu.checks import input_kind

    return input_kind(name) or ("mask" if "mask" in name else "float")


def apply_embeddings(inputs: dict, emb: dict, cfg_batch: bool, arg_names: dict | None = None) -> dict:
    """Replaces the random conditioning of `inputs` (batch 1, or 2 for CFG with
    rows [unconditional, conditional]) by the file's, checking shapes; `arg_names`:
    the port's own pipeline argument names (`Pipeline.arg_names`)."""
    emb = forward_names(emb, arg_names)
    out = dict(inputs)
    cond_keys = [k for k in inputs if k not in NOT_CONDITIONING and isinstance(inputs[k], np.ndarray)]
    unknown = [k for k in emb if k.removeprefix("negative_") not in cond_keys]
    if unknown:
        raise ValueError(f"--embeddings: unknown arrays {unknown}; this model takes {cond_keys}")
    orphans = sorted(k for k in emb if k.startswith("negative_") and k.removeprefix("negative_") not in emb)
    if orphans:
        raise ValueError(f"--embeddings: {orphans} without {[k.removeprefix('negative_') for k in orphans]}: "
                         "a negative_* array only gives the unconditional rows of its positive one")
    for k in cond_keys:
        if k not in emb:
            continue
        if k in UNBATCHED:  # positions shared by the batch (FLUX's ids): the model's shape, or [1, ...] of it
            want = inputs[k].shape
            got = np.asarray(emb[k])
            got = got[0] if got.ndim == len(want) + 1 and got.shape[0] == 1 else got
            if got.shape != want:
                raise ValueError(f"--embeddings: {k} has shape {emb[k].shape}, this model needs {want} (no batch "
                                 f"axis: one set of positions for every prompt)")
            out[k] = got.astype(inputs[k].dtype)
            continue
        rows = inputs[k].shape[0] // (2 if cfg_batch else 1)  # prompts (--batch)
        want = inputs[k].shape[1:]
        pos = np.asarray(emb[k])
        if pos.ndim == len(want):
            pos = pos[None]
        if pos.shape[1:] != want or pos.shape[0] not in (1, rows):
            n = "1" if rows == 1 else f"1 or {rows}"
            raise ValueError(f"--embeddings: {k} has shape {emb[k].shape}, this model needs ({n}, "
                             f"{', '.join(map(str, want))}) (one prompt for the batch, or one per prompt of "
                             f"--batch {rows})")
        pos = np.repeat(pos, rows // pos.shape[0], axis=0)
        if cfg_batch:
            neg = emb.get("negative_" + k)
            if neg is None:
                neg = np.zeros_like(pos) if "mask" not in k else np.ones_like(pos)
            neg = neg[None] if neg.ndim == len(want) else neg
            if neg.shape[1:] != want or neg.shape[0] not in (1, rows):
                raise ValueError(f"--embeddings: negative_{k} {neg.shape} does not match {k} {emb[k].shape}")
            neg = np.repeat(neg, rows // neg.shape[0], axis=0)
            pos = np.concatenate([neg, pos])
        out[k] = pos.astype(inputs[k].dtype)
    return out


# --------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------


def _guided(v, b: int, g):
    """u + g (c - u) for v = [u | c] (float32) on the batch axis, as the weighted sum
    (1 - g) u + g c over the two halves: with the batch split over the mesh's `cfg` axis
    (u on one group, c on the other) that sum is one all-reduce over `cfg` of one latent
    per chip (docs/multi-host.md)."""
    import jax
    import jax.numpy as jnp

    half = jax.lax.broadcasted_iota(jnp.int32, (2,) + (1,) * v.ndim, 0)  # 0: unconditional, 1: conditional
    w = jnp.where(half == 0, 1 - g, g).astype(jnp.float32)
    return jnp.sum(w * v.reshape((2, b) + v.shape[1:]), axis=0)


def _guided_rescaled(v, b: int, g):
    """diffusers' QwenImagePipeline true CFG: `u + g (c - u)` times `||c|| / ||guided||`,
    norms per token over channels."""
    import jax.numpy as jnp

    u, c = v[:b], v[b:]
    guided = u + g * (c - u)
    return guided * (jnp.linalg.norm(c, axis=-1, keepdims=True) / jnp.linalg.norm(guided, axis=-1, keepdims=True))


def _jit(mesh):
    import functools

    import jax

    if mesh is None:
        return jax.jit
    from jax.sharding import NamedSharding, PartitionSpec as P

    # the latents stay whole on every device of the mesh
    return functools.partial(jax.jit, out_shardings=NamedSharding(mesh, P()))


def _euler_update(mesh=None):
    import jax.numpy as jnp

    jit = _jit(mesh)

    @jit
    def update(x, out, dt, g):
        v = out.astype(jnp.float32)
        return x + dt * v

    @jit
    def update_cfg(x, out, dt, g):
        """x + dt * (u + g (c - u)) for out = [u | c] on the batch axis (`_guided`)."""
        return x + dt * _guided(out.astype(jnp.float32), x.shape[0], g)

    @jit
    def update_cfg_rescaled(x, out, dt, g):
        """update_cfg with diffusers' QwenImagePipeline true CFG (`_guided_rescaled`)."""
        return x + dt * _guided_rescaled(out.astype(jnp.float32), x.shape[0], g)

    return update, update_cfg, update_cfg_rescaled


def _guides(mesh=None):
    import jax.numpy as jnp

    jit = _jit(mesh)

    @jit
    def velocity(out, g):
        return out.astype(jnp.float32)

    @jit
    def velocity_cfg(out, g):
        return _guided(out.astype(jnp.float32), out.shape[0] // 2, g)

    @jit
    def velocity_cfg_rescaled(out, g):
        return _guided_rescaled(out.astype(jnp.float32), out.shape[0] // 2, g)

    return velocity, velocity_cfg, velocity_cfg_rescaled


_UPDATES = {}


def updates(mesh=None):
    """The jitted Euler / CFG / rescaled-CFG latent updates (built once per mesh; on a mesh their
    outputs are replicated, so every process holds the whole latents)."""
    if mesh not in _UPDATES:
        _UPDATES[mesh] = _euler_update(mesh)
    return _UPDATES[mesh]


_GUIDES = {}


def guides(mesh=None):
    """The jitted velocity / CFG / rescaled-CFG guided velocities (float32, replicated on a mesh)
    that a multistep sampler (samplers.UniPCSampler) steps with, built once per mesh."""
    if mesh not in _GUIDES:
        _GUIDES[mesh] = _guides(mesh)
    return _GUIDES[mesh]


@dataclasses.dataclass
class StepTimes:
    times: list          # every warm-up call, seconds
    first_call_s: float  # the first call per expert (compiles)

    def compile_s(self, steady: float) -> float:
        """Warm-up time beyond `steady` seconds per call: the compilations."""
        return max(0.0, sum(self.times) - steady * len(self.times))


class Denoiser:
    """The denoise loop of one model on one mesh/mode.

    pipeline: the port's `PortSpec.pipeline` (schedule facts and guidance mode).
    runners: one Runner, or two for Wan2.2-A14B ([high noise, low noise]; the
    step's expert is `pipeline.expert(t, boundary)`).
    schedule: a `schedules.Schedule` (Euler) or a sampler (`samplers`; each
    latent steps with its own copy, `sampler(key)`).
    inputs: diffusers forward kwargs at batch 1 (numpy) from `example_inputs`;
    for CFG pipelines the conditioning rows are doubled here to [uncond, cond].
    latent_guidance: latent key -> its own guidance scale (LTX-2's audio);
    the other latents use `guidance`.
    offload: where the idle expert of two lives, "auto" / "on" / "off"
    (`Config.expert_offload`; default: the first runner's config). When on,
    only the expert the step needs is on the devices: the first step moves
    the others to host memory (`Runner.offload`), and each expert switch
    drops the outgoing expert's device arrays and copies the incoming one's
    from host memory (`Runner.load`), recorded in `swaps`. For the device
    memory to be freed the runners must hold the only references to their
    parameters (build the models, hand them to the Runners, drop them).
    With one runner it is a no-op.
    cache: step caching (`config.StepCacheOptions` or its option string; None: off): each
    `run` / `warmup` goes through a fresh `step_cache.StepCache` (`step_cache`; its `stats()`
    after the run), the step's rows one cache slot that starts over at an expert switch.
    """

    def __init__(self, pipeline, runners: list, inputs: dict, schedule, *,
                 guidance: float, boundary: float | None = None, cfg_inputs: dict | None = None,
                 latent_guidance: dict | None = None, dtype=None, offload: str | None = None, cache=None):
        import jax.numpy as jnp

        from difflet_tpu.config import parse_step_cache

        self.pipeline = pipeline
        self.runners = list(runners)
        if len(self.runners) > 1 and pipeline.expert is None:
            raise ValueError(f"{len(self.runners)} runners, but this pipeline switches no experts "
                             f"(Pipeline.expert is None): pass one runner")
        self.schedule = schedule
        self.guidance = float(guidance)
        self.boundary = boundary
        self.cfg = pipeline.guidance_mode == "cfg" and guidance != 1.0
        self.dtype = dtype or jnp.float32
        self.mesh = getattr(self.runners[0], "mesh", None)
        base = cfg_inputs if (self.cfg and cfg_inputs is not None) else inputs
        self.latents0 = {k: np.asarray(inputs[k], np.float32) for k in pipeline.latent_keys if k in inputs}
        self.latent_guidance = {k: float((latent_guidance or {}).get(k, guidance)) for k in self.latents0}
        self.cond = {k: v for k, v in base.items() if k not in self.latents0 and k not in ("timestep", "sigma", "guidance")}
        self.batch = next(iter(self.latents0.values())).shape[0] * (2 if self.cfg else 1)
        self.timestep_shape = np.shape(inputs["timestep"])[1:]  # () or (tokens,) for per-token timesteps
        self.timestep_dtype = np.asarray(inputs["timestep"]).dtype
        self.has_sigma = "sigma" in inputs
        self.has_guidance = "guidance" in inputs
        if offload is None:
            config = getattr(self.runners[0], "config", None)
            offload = config.expert_offload if config is not None else "auto"
        from difflet_tpu.pipeline.placement import ExpertHome

        self.home = ExpertHome(self.runners, offload)
        self.offload_setting = offload
        self.last_swap_s = 0.0
        self.cache = parse_step_cache(cache)
        self.step_cache = None

    # the expert placement's state, read by the bench's report and the tests
    offload = property(lambda self: self.home.offload)
    offload_reason = property(lambda self: self.home.reason)
    active = property(lambda self: self.home.active)
    placement_s = property(lambda self: self.home.placement_s)

    @property
    def swaps(self) -> list:
        return self.home.swaps

    def activate(self, e: int, kw: dict, step: int | None = None) -> float:
        """Makes expert `e` the one on the devices when offloading (`placement.ExpertHome`)."""
        return self.home.activate(e, kw, step)

    def expert(self, t: float) -> int:
        return self.pipeline.expert(t, self.boundary) if len(self.runners) > 1 else 0

    def kwargs(self, latents: dict, t: float) -> dict:
        import jax.numpy as jnp

        kw = dict(self.cond)
        for k, x in latents.items():
            x = jnp.concatenate([x, x]) if self.cfg else x
            kw[k] = x.astype(self.dtype)
        ts = np.full((self.batch, *self.timestep_shape), t * self.pipeline.timestep_scale, self.timestep_dtype)
        kw["timestep"] = ts
        if self.has_sigma:
            kw["sigma"] = ts
        if self.has_guidance:
            g = self.guidance * self.pipeline.guidance_mult
            kw["guidance"] = np.full((self.batch,), g, np.float32)
        return kw

    def step(self, latents: dict, i: int) -> dict:
        t = float(self.schedule.timesteps[i])
        e = self.expert(t)
        kw = self.kwargs(latents, t)
        self.last_swap_s = self.activate(e, kw, i) if len(self.runners) > 1 else 0.0
        if self.step_cache is not None:
            outs = self.step_cache(self.runners[e], i, "rows", dict(kw, return_dict=False))
        else:
            outs = self.runners[e](**kw, return_dict=False)
        mode = 0 if not self.cfg else 2 if self.pipeline.cfg_rescale else 1
        new = {}
        if isinstance(self.schedule, S.Schedule):  # Euler: the guidance and the update in one program
            fn = updates(self.mesh)[mode]
            dt = np.float32(self.schedule.dt(i))
            for (k, x), o in zip(latents.items(), outs):
                new[k] = fn(x, o, dt, np.float32(self.latent_guidance[k]))
            return new
        guide = guides(self.mesh)[mode]  # a sampler (samplers.UniPCSampler): the guided velocity, its step
        for (k, x), o in zip(latents.items(), outs):
            new[k] = self.sampler(k).step(i, guide(o, np.float32(self.latent_guidance[k])), x)
        return new

    def start_cache(self) -> None:
        """A fresh step cache for a run (None without `cache`)."""
        from difflet_tpu.step_cache import StepCache

        self.step_cache = None if self.cache is None else StepCache(self.cache)

    def sampler(self, key: str):
        """The sampler of latent `key` (one per latent: a multistep sampler keeps its own history),
        rebuilt when `self.schedule` is replaced."""
        if getattr(self, "_samplers_of", None) is not self.schedule:
            self._samplers = {k: copy.copy(self.schedule) for k in self.latents0}
            self._samplers_of = self.schedule
        return self._samplers[key]

    def initial(self) -> dict:
        """The initial latents: on the runners' mesh, whole on every device (every
        process of a multi-process mesh holds them), else on the default device."""
        import jax
        import jax.numpy as jnp

        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in self.latents0.items()}
        from jax.sharding import NamedSharding, PartitionSpec as P

        return {k: jax.device_put(v, NamedSharding(self.mesh, P())) for k, v in self.latents0.items()}

    def warmup(self, n: int) -> StepTimes:
        """Runs `max(n, 2)` chained steps per expert used by the schedule (the
        first compiles for the initial latents, the second for latents as the
        update returns them); the latents are thrown away.
        compile_s = first call - a steady call."""
        import jax

        times, first = [], 0.0
        self.start_cache()
        experts = sorted({self.expert(float(t)) for t in self.schedule.timesteps})
        for e in experts:
            i = next(j for j, t in enumerate(self.schedule.timesteps) if self.expert(float(t)) == e)
            lat = self.initial()
            for r in range(max(n, 2)):
                if not isinstance(self.schedule, S.Schedule):
                    for k in self.latents0:  # each warm-up call is a first step at i
                        self.sampler(k).begin(i)
                t0 = time.perf_counter()
                lat = jax.block_until_ready(self.step(lat, i))
                dt = time.perf_counter() - t0 - self.last_swap_s
                times.append(dt)
                if r == 0:
                    first += dt
        return StepTimes(times, first)

    def run(self, progress: Callable | None = None, profile_dir: str | None = None):
        """The timed loop: every step waited on. Returns (final latents dict of numpy, step
        seconds); an expert switch's copy is not in its step's time but in `swaps`
        (this run's only)."""
        import jax

        from difflet_tpu import checks

        lat = self.initial()
        times = []
        self.home.swaps = []
        self.start_cache()
        with contextlib.ExitStack() as stack:
            if profile_dir:  # traced into a temporary directory, renamed to profile_dir only on success
                tmp = stack.enter_context(checks.atomic_dir(profile_dir, "--profile"))
                stack.enter_context(jax.profiler.trace(tmp))
            for i in range(len(self.schedule)):
                t0 = time.perf_counter()
                lat = jax.block_until_ready(self.step(lat, i))
                times.append(time.perf_counter() - t0 - self.last_swap_s)
                if progress:
                    progress(i + 1, len(self.schedule), times[-1])
        return {k: np.asarray(v) for k, v in lat.items()}, times


# --------------------------------------------------------------------------
# Compilation counting
# --------------------------------------------------------------------------


class CompileCounter:
    """Counts XLA backend compilations while active (jax.monitoring events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    _installed = False
    _count = 0

    @classmethod
    def _listener(cls, event, duration, **kw):
        if event == cls.EVENT:
            cls._count += 1

    @classmethod
    def count(cls) -> int:
        if not cls._installed:
            import jax

            jax.monitoring.register_event_duration_secs_listener(cls._listener)
            cls._installed = True
        return cls._count
