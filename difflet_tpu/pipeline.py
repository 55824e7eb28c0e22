"""The denoise loop: flow-matching Euler over a port's `Runner`, per model family.

A `Family` says how a diffusers pipeline drives its transformer: the
schedule (difflet_tpu.schedulers), how the timestep is scaled, whether
guidance is a classifier-free batch-2 call (Wan, LTX-2: unconditional and
conditional rows in one call, combined as `u + g (c - u)`) or an embedding
(FLUX.1-dev `guidance = g`, HunyuanVideo `guidance = 1000 g`), and for
Wan2.2-A14B the expert switch at `boundary_ratio * 1000`.

`Denoiser` holds the runners (one per expert), the conditioning (seeded
random embeddings of the right shapes, or precomputed ones from a file with
diffusers' argument names) and the latents from a seed. Each step calls the
runner's compiled step with the timestep as a runtime array (same shapes and
dtypes every step, so nothing recompiles) and then one jitted Euler update
`x + (sigma_next - sigma) * v` in float32 whose `dt` and guidance scale are
runtime scalars too.

Ports implement docs/porting.md; `ToyPort` is a contract-complete stand-in on
difflet_tpu.testing's toy model, for tests and for the bench before any port
has landed.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from typing import Callable

import numpy as np

from difflet_tpu import schedulers as S

PORT_MODULES = {
    "flux": "difflet_tpu.models.flux",
    "wan": "difflet_tpu.models.wan",
    "hunyuan_video": "difflet_tpu.models.hunyuan_video",
    "ltx2": "difflet_tpu.models.ltx2",
}
CONTRACT = ("config_from_diffusers", "PRESETS", "build", "PLAN", "key_map", "Runner", "example_inputs", "flops")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    released: str                 # the default released preset
    shape: dict                   # benchmark shape (height, width, frames)
    steps: int                    # the pipeline's default number of steps
    guidance: float               # the pipeline's default guidance scale
    guidance_mode: str            # "cfg" (batch 2), "embedded" (a `guidance` input) or "none"
    guidance_mult: float = 1.0    # embedded guidance = mult * g
    timestep_scale: float = 1.0   # the transformer gets timestep * scale
    flow_shift: float = 3.0       # Wan
    boundaries: dict = dataclasses.field(default_factory=dict)  # preset -> Wan2.2 boundary ratio
    flow_shifts: dict = dataclasses.field(default_factory=dict)  # preset -> flow shift
    latent_keys: tuple = ("hidden_states",)

    def schedule(self, steps: int, inputs: dict, preset: str) -> S.Schedule:
        if self.name == "flux":
            return S.flux_schedule(steps, inputs["hidden_states"].shape[1])
        if self.name == "wan":
            return S.wan_schedule(steps, self.flow_shifts.get(preset, self.flow_shift))
        if self.name == "hunyuan_video":
            return S.hunyuan_video_schedule(steps)
        if self.name == "ltx2":
            return S.ltx2_schedule(steps, inputs["hidden_states"].shape[1])
        return S.flow_match_euler(S.SchedulerConfig(shift=1.0), steps, sigmas=np.linspace(1.0, 1 / steps, steps))


FAMILIES = {
    "flux": Family("flux", "flux.1-dev", dict(height=1024, width=1024, frames=1), 28, 3.5, "embedded",
                   timestep_scale=1e-3),
    "wan": Family("wan", "Wan2.1-T2V-14B", dict(height=480, width=832, frames=9), 50, 5.0, "cfg",
                  boundaries={"Wan2.2-T2V-A14B": 0.875, "Wan2.2-I2V-A14B": 0.9},
                  flow_shifts={"Wan2.2-T2V-A14B": 12.0, "Wan2.2-I2V-A14B": 5.0, "Wan2.1-I2V-14B-720P": 5.0}),
    "hunyuan_video": Family("hunyuan_video", "hunyuan-video", dict(height=320, width=512, frames=61), 50, 6.0,
                            "embedded", guidance_mult=1000.0),
    "ltx2": Family("ltx2", "ltx-2.0", dict(height=480, width=704, frames=49), 30, 3.0, "cfg",
                   latent_keys=("hidden_states", "audio_hidden_states")),
    "toy": Family("toy", "toy-small", dict(height=64, width=64, frames=1), 8, 1.0, "none"),
}


# --------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------


def load_port(family: str):
    """The port module of a family (raises ImportError / AttributeError with the
    missing contract names if it has not landed or is incomplete)."""
    if family == "toy":
        return ToyPort
    mod = importlib.import_module(PORT_MODULES[family])
    missing = [n for n in CONTRACT if not hasattr(mod, n)]
    if missing:
        raise AttributeError(f"port {PORT_MODULES[family]} is missing {', '.join(missing)} (docs/porting.md)")
    return mod


def landed_ports() -> dict:
    """family -> (port module or None, reason it is unavailable)."""
    out = {}
    for fam in PORT_MODULES:
        try:
            out[fam] = (load_port(fam), None)
        except Exception as e:  # noqa: BLE001 - any import failure means "not landed"
            out[fam] = (None, f"{type(e).__name__}: {e}")
    return out


def resolve_model(name: str, ports: dict | None = None) -> tuple[str, str]:
    """`--model` -> (family, preset). Accepts "family" (its released preset),
    "family:preset" (e.g. "wan:tiny") or a released preset name (e.g. "flux.1-dev")."""
    ports = landed_ports() if ports is None else ports
    available = {f: p for f, (p, _) in ports.items() if p is not None}
    available["toy"] = ToyPort
    if ":" in name:
        fam, preset = name.split(":", 1)
    elif name in available or name in FAMILIES:
        fam, preset = name, None
    else:
        hits = [(f, name) for f, p in available.items() if name in p.PRESETS and name != "tiny"]
        if len(hits) != 1:
            raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(model_names(ports))}")
        return hits[0]
    if fam not in FAMILIES:
        raise ValueError(f"unknown model family {fam!r}; known: {', '.join(sorted(FAMILIES))}")
    if fam not in available:
        raise ValueError(f"the {fam} port has not landed ({ports[fam][1]})")
    preset = FAMILIES[fam].released if preset is None else preset
    if preset not in available[fam].PRESETS:
        raise ValueError(f"{fam} has no preset {preset!r}; presets: {', '.join(available[fam].PRESETS)}")
    return fam, preset


def model_names(ports: dict | None = None) -> list[str]:
    """"family:preset" names of every landed port's presets."""
    ports = landed_ports() if ports is None else ports
    names = []
    for fam, (p, _) in ports.items():
        if p is not None:
            names += [f"{fam}:{k}" for k in p.PRESETS]
    return names + [f"toy:{k}" for k in ToyPort.PRESETS]


# --------------------------------------------------------------------------
# Conditioning
# --------------------------------------------------------------------------

# diffusers pipeline argument names -> transformer forward names
PIPELINE_ALIASES = {
    "prompt_embeds": "encoder_hidden_states",
    "pooled_prompt_embeds": "pooled_projections",
    "prompt_attention_mask": "encoder_attention_mask",
    "audio_prompt_embeds": "audio_encoder_hidden_states",
    "image_embeds": "encoder_hidden_states_image",
}
NOT_CONDITIONING = ("hidden_states", "audio_hidden_states", "timestep", "sigma", "guidance")


def read_embeddings(path: str) -> dict:
    """Precomputed text embeddings: a .safetensors or .npz whose keys are
    diffusers' argument names (transformer forward names such as
    `encoder_hidden_states`, or pipeline names such as `prompt_embeds`), plus
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
    out = {}
    for k, v in raw.items():
        neg = k.startswith("negative_")
        base = k[len("negative_"):] if neg else k
        base = PIPELINE_ALIASES.get(base, base)
        out[("negative_" if neg else "") + base] = np.asarray(v)
    if not out:
        raise ValueError(f"--embeddings {path}: no arrays")
    try:
        check_finite(raw, f"--embeddings {path}:")
    except NonFiniteError as e:
        raise ValueError(str(e)) from None
    return out


def apply_embeddings(inputs: dict, emb: dict, cfg_batch: bool) -> dict:
    """Replaces the random conditioning of `inputs` (batch 1, or 2 for CFG with
    rows [unconditional, conditional]) by the file's, checking shapes."""
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
        want = inputs[k].shape[1:]
        pos = np.asarray(emb[k])
        if pos.ndim == len(want):
            pos = pos[None]
        if pos.shape[1:] != want or pos.shape[0] != 1:
            raise ValueError(f"--embeddings: {k} has shape {emb[k].shape}, this model needs (1, {', '.join(map(str, want))})")
        if cfg_batch:
            neg = emb.get("negative_" + k)
            if neg is None:
                neg = np.zeros_like(pos) if "mask" not in k else np.ones_like(pos)
            neg = neg[None] if neg.ndim == len(want) else neg
            if neg.shape != pos.shape:
                raise ValueError(f"--embeddings: negative_{k} {neg.shape} does not match {k} {pos.shape}")
            pos = np.concatenate([neg, pos])
        out[k] = pos.astype(inputs[k].dtype)
    return out


# --------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------


def _euler_update():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def update(x, out, dt, g):
        v = out.astype(jnp.float32)
        return x + dt * v

    @jax.jit
    def update_cfg(x, out, dt, g):
        v = out.astype(jnp.float32)
        b = x.shape[0]
        uncond, cond = v[:b], v[b:]
        return x + dt * (uncond + g * (cond - uncond))

    return update, update_cfg


_UPDATES = None


def updates():
    """The jitted Euler / CFG latent updates (built once)."""
    global _UPDATES
    if _UPDATES is None:
        _UPDATES = _euler_update()
    return _UPDATES


@dataclasses.dataclass
class StepTimes:
    times: list          # every warm-up call, seconds
    first_call_s: float  # the first call per expert (compiles)

    def compile_s(self, steady: float) -> float:
        """Warm-up time beyond `steady` seconds per call: the compilations."""
        return max(0.0, sum(self.times) - steady * len(self.times))


class Denoiser:
    """The denoise loop of one model on one mesh/mode.

    runners: one Runner, or two for Wan2.2-A14B ([high noise, low noise]).
    inputs: diffusers forward kwargs at batch 1 (numpy) from `example_inputs`;
    for CFG families the conditioning rows are doubled here to [uncond, cond].
    """

    def __init__(self, family: Family, runners: list, inputs: dict, schedule: S.Schedule, *,
                 guidance: float, boundary: float | None = None, cfg_inputs: dict | None = None,
                 audio_guidance: float | None = None, dtype=None):
        import jax.numpy as jnp

        self.family = family
        self.runners = list(runners)
        self.schedule = schedule
        self.guidance = float(guidance)
        self.audio_guidance = float(audio_guidance if audio_guidance is not None else guidance)
        self.boundary = boundary
        self.cfg = family.guidance_mode == "cfg" and guidance != 1.0
        self.dtype = dtype or jnp.float32
        base = cfg_inputs if (self.cfg and cfg_inputs is not None) else inputs
        self.latents0 = {k: np.asarray(inputs[k], np.float32) for k in family.latent_keys if k in inputs}
        self.cond = {k: v for k, v in base.items() if k not in self.latents0 and k not in ("timestep", "sigma", "guidance")}
        self.batch = next(iter(self.latents0.values())).shape[0] * (2 if self.cfg else 1)
        self.timestep_shape = np.shape(inputs["timestep"])[1:]  # () or (tokens,) for per-token timesteps
        self.timestep_dtype = np.asarray(inputs["timestep"]).dtype
        self.has_sigma = "sigma" in inputs
        self.has_guidance = "guidance" in inputs

    def expert(self, t: float) -> int:
        return S.wan22_expert(t, self.boundary) if len(self.runners) > 1 else 0

    def kwargs(self, latents: dict, t: float) -> dict:
        import jax.numpy as jnp

        kw = dict(self.cond)
        for k, x in latents.items():
            x = jnp.concatenate([x, x]) if self.cfg else x
            kw[k] = x.astype(self.dtype)
        ts = np.full((self.batch, *self.timestep_shape), t * self.family.timestep_scale, self.timestep_dtype)
        kw["timestep"] = ts
        if self.has_sigma:
            kw["sigma"] = ts
        if self.has_guidance:
            g = self.guidance * self.family.guidance_mult
            kw["guidance"] = np.full((self.batch,), g, np.float32)
        return kw

    def step(self, latents: dict, i: int) -> dict:
        t = float(self.schedule.timesteps[i])
        out = self.runners[self.expert(t)](**self.kwargs(latents, t))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        update, update_cfg = updates()
        fn = update_cfg if self.cfg else update
        dt = np.float32(self.schedule.dt(i))
        new = {}
        for (k, x), o, g in zip(latents.items(), outs, (self.guidance, self.audio_guidance)):
            new[k] = fn(x, o, dt, np.float32(g))
        return new

    def initial(self) -> dict:
        import jax.numpy as jnp

        return {k: jnp.asarray(v) for k, v in self.latents0.items()}

    def warmup(self, n: int) -> StepTimes:
        """Runs `max(n, 2)` chained steps per expert used by the schedule (the
        first compiles for the initial latents, the second for latents as the
        update returns them); the latents are thrown away.
        compile_s = first call - a steady call."""
        import jax

        times, first = [], 0.0
        experts = sorted({self.expert(float(t)) for t in self.schedule.timesteps})
        for e in experts:
            i = next(j for j, t in enumerate(self.schedule.timesteps) if self.expert(float(t)) == e)
            lat = self.initial()
            for r in range(max(n, 2)):
                t0 = time.perf_counter()
                lat = jax.block_until_ready(self.step(lat, i))
                dt = time.perf_counter() - t0
                times.append(dt)
                if r == 0:
                    first += dt
        return StepTimes(times, first)

    def run(self, progress: Callable | None = None, profile_dir: str | None = None):
        """The timed loop: every step waited on. Returns (final latents dict of numpy, step seconds)."""
        import jax

        lat = self.initial()
        times = []
        ctx = None
        if profile_dir:
            ctx = jax.profiler.trace(profile_dir)
            ctx.__enter__()
        try:
            for i in range(len(self.schedule)):
                t0 = time.perf_counter()
                lat = jax.block_until_ready(self.step(lat, i))
                times.append(time.perf_counter() - t0)
                if progress:
                    progress(i + 1, len(self.schedule), times[-1])
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
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


# --------------------------------------------------------------------------
# A contract-complete toy port (difflet_tpu.testing's model)
# --------------------------------------------------------------------------


class _ToyPortModule:
    """docs/porting.md's contract over difflet_tpu.testing.ToyModel: latents
    `[B, S, C]` as `hidden_states`, a `timestep` that scales the input."""

    PRESETS = {
        "tiny": dict(dim=32, heads=4, ffn=64, layers=2, in_channels=8, tokens=24),
        "toy-small": dict(dim=256, heads=8, ffn=1024, layers=4, in_channels=64, tokens=1000),
    }

    def __init__(self):
        from difflet_tpu import testing

        self.PLAN = testing.PLAN

    @staticmethod
    def config_from_diffusers(cfg: dict, *, split_rope=True):
        from difflet_tpu.testing import ToyConfig

        return ToyConfig(**{k: v for k, v in cfg.items() if k != "tokens"}), cfg.get("tokens", 24)

    @staticmethod
    def build(config, *, dtype=None, rngs):
        import jax.numpy as jnp
        from flax import nnx
        from difflet_tpu.testing import ToyModel

        c, tokens = config
        m = ToyModel(c, rngs)
        if dtype is not None and dtype != jnp.float32:
            state = nnx.state(m)
            nnx.update(m, __import__("jax").tree.map(lambda x: x.astype(dtype), state))
        m.tokens = tokens
        return m

    @staticmethod
    def key_map(config, model):
        from difflet_tpu import weights

        return weights.default_key_map(model, stacked={"blocks": config[0].layers})

    @staticmethod
    def example_inputs(config, *, height=64, width=64, frames=1, batch=1, seed=0, dtype=np.float32):
        c, tokens = config
        rng = np.random.default_rng(seed)
        return {"hidden_states": rng.standard_normal((batch, tokens, c.in_channels)).astype(dtype),
                "timestep": np.full((batch,), 900.0, np.float32)}

    @staticmethod
    def flops(config, inputs):
        c, _ = config
        B, N, _ = inputs["hidden_states"].shape
        D = c.dim
        return float(B * c.layers * (8 * N * D * D + 4 * N * D * c.ffn + 4 * N * N * D))

    class Runner:
        def __init__(self, model, mesh=None, config=None, mode=None):
            from difflet_tpu.config import Config
            from difflet_tpu.parallel import Parallel

            self.model, self.mesh = model, mesh
            self.config = Config.from_env() if config is None else config
            self.par = Parallel.for_mesh(mesh, self.config, mode=mode)
            if mesh is not None:
                from flax import nnx
                import jax

                leaves = jax.tree_util.tree_leaves(nnx.state(model))
                if not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
                    from difflet_tpu import runtime
                    from difflet_tpu.testing import PLAN

                    runtime.place(model, mesh, PLAN)
            self._step = None

        def _compiled(self):
            if self._step is None:
                from jax.sharding import PartitionSpec as P
                from difflet_tpu import runtime
                from difflet_tpu.mesh import TP
                from difflet_tpu.testing import PLAN

                rows = P(None, TP, None) if self.par.seq_sharded else P()

                def fn(m, par, x, t, mask):
                    return m(par, x * (1.0 + t[:, None, None] / 1000.0).astype(x.dtype), mask)

                self._step = runtime.compile_step(self.model, fn, self.par, self.mesh, PLAN,
                                                  in_specs=(rows, P(), P()), out_specs=rows)
            return self._step

        def _pad(self, n):
            mult = 2 * self.par.size if self.par.seq_sharded else 1
            return -(-n // mult) * mult

        def __call__(self, hidden_states, timestep):
            import jax.numpy as jnp
            from difflet_tpu import layout

            n = hidden_states.shape[1]
            x = layout.pad_tokens(hidden_states, 2 * self.par.size)[0] if self.par.seq_sharded else hidden_states
            mask = layout.key_mask(n, x.shape[1], batch=x.shape[0])
            step, state = self._compiled()
            out = step(state, x, jnp.asarray(timestep, jnp.float32), mask)
            return layout.unpad(out, n)

        def trace(self, hidden_states, timestep):
            import jax
            import jax.numpy as jnp
            from jax.sharding import NamedSharding, PartitionSpec as P
            from difflet_tpu.mesh import TP

            n = hidden_states.shape[1]
            rows = self._pad(n)
            step, state = self._compiled()
            spec = P(None, TP, None) if self.par.seq_sharded else P()
            sh = (lambda s: NamedSharding(self.mesh, s)) if self.mesh is not None else (lambda s: None)
            x = jax.ShapeDtypeStruct((hidden_states.shape[0], rows, hidden_states.shape[2]), hidden_states.dtype,
                                     sharding=sh(spec))
            t = jax.ShapeDtypeStruct(timestep.shape, jnp.float32, sharding=sh(P()))
            mask = jax.ShapeDtypeStruct((hidden_states.shape[0], rows), jnp.bool_, sharding=sh(P()))
            return step.trace(state, x, t, mask)


class _Lazy:
    def __init__(self, factory):
        self._factory, self._obj = factory, None

    def __getattr__(self, name):
        if self._obj is None:
            self._obj = self._factory()
        return getattr(self._obj, name)


ToyPort = _Lazy(_ToyPortModule)
