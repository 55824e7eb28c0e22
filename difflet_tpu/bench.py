"""`python -m difflet_tpu.bench`: the denoise benchmark, TP vs SP, and compile-only estimates.

With no arguments on a machine without a TPU it sets up 4 virtual CPU
devices and runs every port's tiny preset for a few steps under TP and
SP (float32), printing a table: step times, the final latents' sha256, and
SP vs TP relative L2 / PSNR. On a TPU VM the same command runs the ports'
released presets at their benchmark shapes.

`--compile-only --topology v5e:2x2` needs neither a TPU nor weights: it
compiles the real config's step for that slice (deviceless) per mode and
reports HBM per chip, FLOPs, collectives and a schedule-based ESTIMATE of the
step time (difflet_tpu.estimate; docs/benchmarks.md has the model and its
constants).

Meshes: `--mesh cfg=2,tp=4` (or DIFFLET_TPU_MESH) splits classifier-free
guidance's [unconditional | conditional] rows over two `cfg` groups, each a
`tp` ring; `data` splits more rows (`--batch` prompts). Default: one `tp`
ring over every device when the heads divide it, else the largest ring that
divides them with `cfg` / `data` groups for the rest.

Multi-host (`--distributed`, or `--coordinator/--num-processes/--process-id`):
every process runs the same command on the global mesh (difflet_tpu.distributed);
process 0 prints the table and writes the JSON, and the final latents' sha256
of every process must agree.

Two-expert models (Wan2.2 A14B): `--expert-offload` / DIFFLET_TPU_EXPERT_OFFLOAD
keeps the idle expert in host memory (difflet_tpu/config.py); --compile-only
then leaves it out of HBM per chip and estimates the swap, the timed run
measures it.

Modes: tp, sp (JAX rings or Pallas kernels per the config / model default),
sp-xla (plain all_gather / psum_scatter with XLA's collective-matmul
decomposition switched on), all. Default: DIFFLET_TPU_SP (1 -> sp, 0 -> tp),
unset -> tp and sp. Under --compile-only: tp, sp (the JAX rings), sp-pallas
(the Pallas all-gather kernel), sp-xla; default and `all` = all four.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import numbers
import os
import sys
import time

CPU_DEVICES = 4
XLA_CM_FLAGS = {
    "xla_tpu_all_gather_collective_matmul_mode": "POST_SPMD",
    "xla_tpu_reduce_scatter_collective_matmul_mode": "POST_SPMD",
}
MODES = ("tp", "sp", "sp-xla")
COMPILE_VARIANTS = {  # compile-only: mode -> (parallel mode, Config overrides)
    "tp": ("tp", {}),
    "sp": ("sp", {"sp_kernel": "jax"}),
    "sp-pallas": ("sp", {"sp_kernel": "pallas"}),
    "sp-xla": ("sp-xla", {}),
}


class BenchError(Exception):
    """A bad flag or an impossible combination, reported before anything runs."""


def has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def parser():
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="port (" + ", ".join(_port_names()) + "), port:preset "
                    "(wan:tiny, wan:Wan2.2-T2V-A14B) or a released preset name; repeatable; default: every "
                    "port (tiny presets on CPU)")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--steps", type=int, help="denoise steps (default: 4 on CPU, the pipeline's default on TPU)")
    ap.add_argument("--mode", help="tp | sp | sp-xla | all, or a comma list (default: from DIFFLET_TPU_SP)")
    ap.add_argument("--weights", help="a diffusers transformer directory (random init otherwise)")
    ap.add_argument("--embeddings", help="precomputed text embeddings (.safetensors / .npz, diffusers argument names)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per expert before the timed loop (>= 1)")
    ap.add_argument("--guidance", type=float, help="guidance scale (default: the pipeline's; 1 turns CFG off)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: float32 on CPU, bfloat16 on TPU")
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--profile", help="jax.profiler trace of the timed steps into DIR/<model>-<mode>")
    ap.add_argument("--dump-hlo", help="write each compiled step's HLO text into DIR")
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="JAX's persistent compilation cache in DIR (created if missing): a second run loads "
                    "the compiled steps instead of compiling (default: DIFFLET_TPU_COMPILE_CACHE, else off)")
    ap.add_argument("--compile-only", action="store_true", help="deviceless compile + estimate for --topology")
    ap.add_argument("--topology", help="TPU topology for --compile-only, e.g. v5e:2x2, v5e:2x4, v6e:2x2")
    ap.add_argument("--calibrated", choices=("yes", "no"), default="yes",
                    help="--compile-only: apply the estimator's one fitted factor (default yes; both are reported)")
    ap.add_argument("--mesh", help="device mesh AXIS=SIZE,... over cfg, data, tp, e.g. cfg=2,tp=4 (default: "
                    "DIFFLET_TPU_MESH, else one tp ring over every device when the heads divide it)")
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (CFG doubles the rows; default 1)")
    ap.add_argument("--expert-offload", choices=("auto", "on", "off"),
                    help="where a two-expert model (Wan2.2 A14B) keeps its idle expert: host memory (on), the "
                    "devices (off), or auto: host memory only when both experts do not fit the device memory "
                    "(default: DIFFLET_TPU_EXPERT_OFFLOAD, else auto; docs in difflet_tpu/config.py)")
    dist = ap.add_argument_group("multi-host (jax.distributed; docs/multi-host.md)")
    dist.add_argument("--distributed", action="store_true",
                      help="join a multi-process run found from the environment (a TPU VM slice: run the same "
                      "command on every worker)")
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (explicit multi-process run)")
    dist.add_argument("--num-processes", type=int)
    dist.add_argument("--process-id", type=int)
    dist.add_argument("--cpu-devices", type=int, help="virtual CPU devices in this process (no TPU; default 4)")
    dist.add_argument("--init-timeout", type=int, default=300,
                      help="seconds to wait for the coordinator and every process (default 300)")
    dist.add_argument("--heartbeat-timeout", type=int, default=100,
                      help="seconds after which a silent process is declared dead (default 100)")
    return ap


def _port_names():
    from difflet_tpu.models import PORTS

    return PORTS


def parse_modes(value: str | None) -> list[str]:
    if value is None:
        env = os.environ.get("DIFFLET_TPU_SP")
        if env is None:
            return ["tp", "sp"]
        if env.strip() not in ("0", "1"):
            raise BenchError(f"DIFFLET_TPU_SP={env!r} is not allowed; use 0 or 1")
        return ["sp"] if env.strip() == "1" else ["tp"]
    out = []
    for m in value.split(","):
        m = m.strip()
        if m == "all":
            out += [x for x in MODES if x not in out]
        elif m in MODES or m == "sp-pallas":
            if m not in out:
                out.append(m)
        else:
            raise BenchError(f"--mode {value!r}: unknown mode {m!r}; use tp, sp, sp-xla or all")
    return out


def validate(args, ap):
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first call compiles; timed steps never include it)")
    for name in ("height", "width", "frames"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name} must be positive")
    if args.guidance is not None and not (math.isfinite(args.guidance) and args.guidance >= 0):
        ap.error(f"--guidance {args.guidance}: must be a finite number >= 0")
    if not 0 <= args.seed < 2**32:
        ap.error(f"--seed {args.seed}: must be in [0, 2**32)")
    if args.compile_only:
        if not args.topology:
            ap.error("--compile-only needs --topology (e.g. v5e:2x2)")
        for flag in ("weights", "embeddings", "profile"):
            if getattr(args, flag):
                ap.error(f"--{flag} cannot be combined with --compile-only (nothing runs)")
        if args.compile_cache:  # jax 0.12 writes entries but cannot load them without a TPU client
            ap.error("--compile-cache cannot be combined with --compile-only (a deviceless compile "
                     "cannot load cached executables)")
    elif args.topology:
        ap.error("--topology only applies to --compile-only")
    if args.weights and not os.path.isdir(args.weights):
        ap.error(f"--weights {args.weights}: not a directory")
    if args.weights and args.model and len(args.model) > 1:
        ap.error("--weights loads one transformer: give one --model")
    if args.embeddings and not os.path.isfile(args.embeddings):
        ap.error(f"--embeddings {args.embeddings}: no such file")
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    from difflet_tpu.config import Config, ConfigError
    from difflet_tpu.mesh import parse_mesh

    if args.mesh is not None:
        try:
            args.mesh_axes = parse_mesh(args.mesh)
        except ValueError as e:
            ap.error(f"--mesh: {e}")
    else:
        try:
            args.mesh_axes = Config.from_env().mesh_axes()
        except ConfigError as e:
            ap.error(str(e))
    try:
        args.offload = args.expert_offload or Config.from_env().expert_offload
    except ConfigError as e:
        ap.error(str(e))
    explicit = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if any(explicit) and not all(explicit):
        ap.error("--coordinator, --num-processes and --process-id go together")
    args.multi = args.distributed or all(explicit)
    if args.compile_only and (args.multi or args.cpu_devices):
        ap.error("--compile-only compiles deviceless in one process: no --distributed / --coordinator / "
                 "--cpu-devices")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        ap.error("--cpu-devices must be >= 1")
    if args.init_timeout < 1 or args.heartbeat_timeout < 1:
        ap.error("--init-timeout and --heartbeat-timeout must be >= 1 (seconds)")
    try:
        args.modes = parse_modes(args.mode)
    except BenchError as e:
        ap.error(str(e))
    if args.compile_only:
        if args.mode is None or "all" in args.mode.split(","):
            args.modes = list(COMPILE_VARIANTS)
    elif "sp-pallas" in args.modes:
        ap.error("--mode sp-pallas is a --compile-only variant; on a device set DIFFLET_TPU_SP_KERNEL=pallas")
    # Outputs are checked before any work (a run must not end in a traceback over its report).
    from difflet_tpu import checks

    try:
        if args.json:
            checks.writable_file(args.json, "--json")
        for flag in ("profile", "dump_hlo"):
            if getattr(args, flag):
                checks.writable_dir(getattr(args, flag), "--" + flag.replace("_", "-"))
    except ValueError as e:
        ap.error(str(e))
    args.embedding_arrays = None
    if args.embeddings:
        from difflet_tpu.pipeline import read_embeddings

        try:
            args.embedding_arrays = read_embeddings(args.embeddings)
        except ValueError as e:
            ap.error(str(e))


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def sha256(arrays: dict) -> str:
    import numpy as np

    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(np.ascontiguousarray(np.asarray(arrays[k], np.float32)).tobytes())
    return h.hexdigest()


def compare(a: dict, b: dict) -> dict:
    """Relative L2 of a against reference b and PSNR over b's data range, all latents together."""
    import numpy as np

    x = np.concatenate([np.asarray(a[k], np.float64).ravel() for k in sorted(b)])
    y = np.concatenate([np.asarray(b[k], np.float64).ravel() for k in sorted(b)])
    err = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
    mse = float(np.mean((x - y) ** 2))
    rng = float(y.max() - y.min())
    psnr = float("inf") if mse == 0 else float(10 * math.log10(rng * rng / mse))
    return dict(rel_l2=err, psnr_db=psnr)


class Progress:
    def __init__(self, label, stream=None, width=24):
        self.label, self.stream, self.width = label, stream or sys.stderr, width

    def __call__(self, i, n, dt):
        fill = int(self.width * i / n)
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {i}/{n} {dt * 1e3:8.1f} ms")
        if i == n:
            self.stream.write("\n")
        self.stream.flush()


def ms(x):
    return None if x is None else round(1e3 * x, 3)


def shape_for(spec, preset, args):
    """The (height, width, frames) to run: the preset's bench shape, then the flags."""
    base = dict(spec.tiny_shape if preset == "tiny" else spec.bench_shape)
    for k in ("height", "width", "frames"):
        if getattr(args, k) is not None:
            base[k] = getattr(args, k)
    if spec.bench_shape.get("frames") == 1 and base.get("frames", 1) != 1:
        raise BenchError(f"{spec.name} makes images: --frames must be 1")
    return base


def guidance_for(spec, args) -> tuple[float, bool]:
    """(the guidance scale: `--guidance`, else the pipeline's; whether the step runs
    classifier-free guidance as one batch-2 call: a CFG pipeline at a scale other than 1)."""
    guidance = spec.pipeline.guidance if args.guidance is None else args.guidance
    return guidance, spec.pipeline.guidance_mode == "cfg" and guidance != 1.0


def mesh_axes_for(spec, cfg, n: int, rows: int, requested: dict | None, guided: bool = False) -> dict:
    """The mesh {"cfg", "data", "tp"} for a model on `n` devices and `rows` batch rows.

    `requested` (--mesh / DIFFLET_TPU_MESH) wins; a missing `tp` takes the devices
    `cfg` x `data` leave. Otherwise the mesh using the most devices whose `tp`
    divides every head count and whose cfg x data divides the rows, preferring a
    larger `tp` ring, then `cfg` groups: one `tp` ring over all devices whenever the
    heads divide it (Wan's 40 heads on 16 chips: cfg=2 x tp=8)."""
    heads = spec.heads(cfg)
    if requested:
        axes = {"cfg": 1, "data": 1, **requested}
        if axes["cfg"] > 1 and not guided:
            raise BenchError(f"{spec.name}: a cfg axis splits classifier-free guidance's rows, and this run has no "
                             f"CFG batch (guidance embedded, or --guidance 1): use data= for more rows")
        outer = axes["cfg"] * axes["data"]
        if "tp" not in requested:
            if n % outer:
                raise BenchError(f"--mesh {requested}: cfg x data = {outer} does not divide the {n} devices")
            axes["tp"] = n // outer
        if outer * axes["tp"] > n:
            raise BenchError(f"--mesh needs {outer * axes['tp']} devices, {n} are available")
        bad = {k: h for k, h in heads.items() if h % axes["tp"]}
        if bad:
            raise BenchError(f"{spec.name}: {bad} heads do not divide over tp={axes['tp']} (choose a tp that "
                             f"divides {sorted(set(heads.values()))})")
        if rows % outer:
            raise BenchError(f"{spec.name}: {rows} batch rows do not split over cfg x data = {outer} (CFG gives 2 "
                             f"rows per prompt; --batch sets the prompts)")
        return axes
    best = None
    for c in ((1, 2) if guided else (1,)):
        for d in range(1, n + 1):
            for t in range(1, n + 1):
                used = c * d * t
                if used > n or n % used or rows % (c * d) or any(h % t for h in heads.values()):
                    continue
                key = (used, t, c)
                if best is None or key > best[0]:
                    best = (key, dict(cfg=c, data=d, tp=t))
    return best[1]


def build_config(spec, preset):
    from difflet_tpu.config import Config

    return spec.config_from_diffusers(dict(spec.presets[preset]), split_rope=Config.from_env().split_rope)


# --------------------------------------------------------------------------
# The on-device (or CPU) benchmark
# --------------------------------------------------------------------------


def weights_model(path, cpu: bool):
    """The (spec, preset) of `--weights DIR` given without `--model`: the port from
    the checkpoint's `_class_name`, the preset "tiny" on CPU (its shapes; the
    checkpoint's config decides the model), the released one on TPU."""
    from difflet_tpu import models, weights

    if not os.path.isfile(os.path.join(path, "config.json")):
        if os.path.isdir(os.path.join(path, "transformer_2")):
            raise BenchError(f"--weights {path} holds two experts (transformer/, transformer_2/): name the "
                             "pipeline with --model (wan:Wan2.2-T2V-A14B or wan:Wan2.2-I2V-A14B)")
        raise BenchError(f"--weights {path}: no config.json (expected a diffusers transformer directory)")
    cls = weights.read_config(path)["_class_name"]
    try:
        spec = models.spec_for_class(cls)
    except ValueError:
        raise BenchError(f"--weights {path} holds a {cls}, which no port supports "
                         f"(supported: {', '.join(sorted(models.REGISTRY))})") from None
    preset = "tiny" if cpu else spec.released
    print(f"--weights {path}: a {cls}; running {spec.name}:{preset} (give --model to choose)", file=sys.stderr)
    return spec, preset


def resolve_models(args):
    """--model (or --weights' own model, or every port) as (spec, preset) pairs."""
    from difflet_tpu import models
    from difflet_tpu import pipeline as PL

    if args.model:
        return [PL.resolve_model(m) for m in args.model]
    if args.weights:
        return [weights_model(args.weights, args.cpu)]
    return [(s, "tiny" if args.cpu else s.released) for s in models.specs().values()]


def weight_dirs(args, spec, preset) -> list[str]:
    """The transformer directories `--weights` names for a model (two for Wan2.2-A14B)."""
    if spec.experts.get(preset) is None:
        return [args.weights]
    return [os.path.join(args.weights, "transformer"), os.path.join(args.weights, "transformer_2")]


def model_mesh(spec, preset, args, n_devices: int):
    """The mesh one model runs on: `mesh_axes_for` its heads (the checkpoint's config
    with --weights), its batch rows and --mesh / DIFFLET_TPU_MESH, over every device."""
    from difflet_tpu import weights
    from difflet_tpu.config import Config
    from difflet_tpu.mesh import make_mesh

    try:
        cfg = build_config(spec, preset)
        if args.weights:
            wcfg = weights.read_config(weight_dirs(args, spec, preset)[0])
            if wcfg["_class_name"] in spec.class_names:  # otherwise prepare refuses it
                cfg = spec.config_from_diffusers(wcfg, split_rope=Config.from_env().split_rope)
    except ValueError as e:  # WeightsError included
        raise BenchError(str(e)) from None
    _, guided = guidance_for(spec, args)
    axes = mesh_axes_for(spec, cfg, n_devices, args.batch * (2 if guided else 1), args.mesh_axes, guided)
    return make_mesh(**axes)


def prepare(spec, preset, args, mesh, dtype) -> dict:
    """Everything about one model that can be refused, before any model runs: the
    config (the checkpoint's, validated without reading a tensor), the memory it
    needs on CPU, the shape, the embeddings and the inputs. Raises BenchError."""
    import jax.numpy as jnp
    import numpy as np

    from difflet_tpu import pipeline as PL
    from difflet_tpu import runtime
    from difflet_tpu.config import Config

    fam, pipe = spec.name, spec.pipeline
    boundary = spec.experts.get(preset)
    n_experts = 2 if boundary is not None else 1
    try:
        cfg = build_config(spec, preset)
        dirs = weight_dirs(args, spec, preset) if args.weights else []
        if dirs:  # the checkpoint's own config decides the shapes
            from difflet_tpu import weights

            wcfg = weights.read_config(dirs[0])
            if wcfg["_class_name"] not in spec.class_names:
                raise BenchError(f"--weights {args.weights} holds a {wcfg['_class_name']}, not a {fam} transformer "
                                 f"(--model {fam}:{preset})")
            for d in dirs:  # every check of load_transformer, nothing read
                _, cfg = weights.check_transformer(d, dtype=dtype, mesh=mesh, config=Config.from_env())
        from flax import nnx

        from difflet_tpu import weights

        params = nnx.state(nnx.eval_shape(lambda: spec.build(cfg, dtype=dtype, rngs=nnx.Rngs(0))), nnx.Param)
        bad = weights.mesh_problems(cfg, params, mesh, spec.plan)
        if bad:
            raise BenchError(f"{fam}:{preset} does not divide over the {mesh.shape['tp']} devices:\n  "
                             + "\n  ".join(bad))
        if n_experts > 1 and args.offload == "on" and runtime.host_memory_kind(list(mesh.devices.flat)) is None:
            raise BenchError(f"--expert-offload on: the {mesh.devices.flat[0].platform} devices have no "
                             f"{runtime.HOST_MEMORY_KIND} memory to keep {fam}:{preset}'s idle expert in; use "
                             f"--expert-offload off or auto")
        if args.cpu:
            count, nbytes = param_bytes(params)
            mem = host_memory_bytes()
            if mem and n_experts * nbytes > mem // 2:
                name = f"{fam}:{preset}"
                raise BenchError(
                    f"{name}{' (--weights)' if dirs else ''} on CPU: {count / 1e9:.2f} B parameters"
                    f"{' per expert, 2 experts,' if n_experts > 1 else ''} need "
                    f"{n_experts * nbytes / 2**30:.1f} GiB as {jnp.dtype(dtype).name}, more than half of this "
                    f"machine's {mem / 2**30:.1f} GiB. It needs a TPU; here, plan it with --compile-only --topology "
                    f"v5e:2x2 --model {name}, or run a tiny preset (--model {fam}:tiny)")
        shape = shape_for(spec, preset, args)
        guidance, cfg_batch = guidance_for(spec, args)
        steps = args.steps or (4 if args.cpu else pipe.steps)
        np_dtype = np.float32 if dtype == jnp.float32 else jnp.bfloat16
        inputs = spec.example_inputs(cfg, **shape, batch=args.batch, seed=args.seed, dtype=np_dtype)
        cfg_inputs = (spec.example_inputs(cfg, **shape, batch=2 * args.batch, seed=args.seed + 1, dtype=np_dtype)
                      if cfg_batch else None)
        if cfg_inputs is not None:  # conditional rows second, the same latents
            for k in pipe.latent_keys:
                if k in cfg_inputs:
                    cfg_inputs[k] = np.concatenate([inputs[k], inputs[k]])
        emb = args.embedding_arrays
        if emb is not None:
            if cfg_batch:
                cfg_inputs = PL.apply_embeddings(cfg_inputs, emb, True)
            else:
                inputs = PL.apply_embeddings(inputs, emb, False)
                unused = sorted(k for k in emb if k.startswith("negative_"))
                if unused:
                    print(f"note: --embeddings: {unused} not used: {fam} runs without classifier-free guidance "
                          f"({'embedded guidance' if pipe.guidance_mode != 'cfg' else '--guidance 1'})",
                          file=sys.stderr)
        schedule = pipe.schedule(steps, inputs, preset)
    except ValueError as e:  # WeightsError included
        raise BenchError(str(e)) from None
    return dict(fam=fam, preset=preset, spec=spec, cfg=cfg, dirs=dirs, shape=shape, mesh=mesh,
                guidance=guidance, cfg_batch=cfg_batch, steps=steps, np_dtype=np_dtype, inputs=inputs,
                cfg_inputs=cfg_inputs, schedule=schedule, boundary=boundary, n_experts=n_experts)


def run_model(plan, args, mesh, dtype, results, hlo_dir=None):
    """Loads (or initialises) one prepared model and times its denoise loop in each requested mode.
    A mode whose final latents are not finite is a failed row (`error`), not a result."""
    import jax
    import numpy as np
    from flax import nnx

    from difflet_tpu import checks, distributed, runtime
    from difflet_tpu import pipeline as PL
    from difflet_tpu.mesh import format_mesh
    from difflet_tpu.config import Config
    from difflet_tpu.runner import Runner

    fam, preset, spec, cfg = plan["fam"], plan["preset"], plan["spec"], plan["cfg"]
    pipe = spec.pipeline
    inputs, cfg_inputs, cfg_batch, guidance = plan["inputs"], plan["cfg_inputs"], plan["cfg_batch"], plan["guidance"]
    analytic = float(spec.flops(cfg, cfg_inputs if cfg_batch else inputs))
    base = dict(model=f"{fam}:{preset}", family=fam, preset=preset, shape=plan["shape"], steps=plan["steps"],
                guidance=guidance, cfg_batch2=cfg_batch, batch=args.batch, experts=plan["n_experts"],
                dtype=str(np.dtype(plan["np_dtype"])), mesh=format_mesh(dict(mesh.shape)),
                devices=mesh.devices.size, processes=distributed.info().count,
                platform=mesh.devices.flat[0].platform, analytic_tflops_per_step=analytic / 1e12, seed=args.seed,
                weights=args.weights or "random", embeddings=args.embeddings or "random")
    finals = {}
    for mode in args.modes:
        row = dict(base, mode=mode)
        label = f"{fam}:{preset} {mode}"
        t0 = time.perf_counter()
        stats0 = runtime.compile_stats()
        # sp-xla on TPU: XLA's collective-matmul decomposition of the plain all_gather/psum_scatter + dot
        options = dict(XLA_CM_FLAGS) if mode == "sp-xla" and not args.cpu else None
        config = Config.from_env(expert_offload=args.offload)
        runners = []
        for e in range(plan["n_experts"]):
            if plan["dirs"]:
                from difflet_tpu import weights

                model = weights.load_transformer(plan["dirs"][e], dtype=dtype, mesh=mesh)
            else:
                model = spec.build(cfg, dtype=dtype, rngs=nnx.Rngs(args.seed + e))
            runners.append(Runner(model, mesh, config, mode=mode, compiler_options=options))
            del model  # the Runner holds the only references: an offloaded expert's device memory is freed
            if e > 0 and args.offload == "on":  # the high-noise expert (0) runs first; the others wait on the host
                runners[e].offload()
        runners[0].block_until_ready()
        row["load_s"] = time.perf_counter() - t0
        den = PL.Denoiser(pipe, runners, inputs, plan["schedule"], guidance=guidance, boundary=plan["boundary"],
                          cfg_inputs=cfg_inputs, dtype=dtype, offload=args.offload,
                          latent_guidance=pipe.latent_guidance if args.guidance is None else None)
        c0 = PL.CompileCounter.count()
        w = den.warmup(args.warmup)
        c1 = PL.CompileCounter.count()
        row["first_call_s"] = w.first_call_s
        prof = os.path.join(args.profile, f"{fam}-{preset}-{mode}".replace(":", "_")) if args.profile else None
        t0 = time.perf_counter()
        final, times = den.run(progress=Progress(label), profile_dir=prof)
        row["denoise_s"] = time.perf_counter() - t0
        row["compilations_warmup"] = c1 - c0
        row["compilations_timed"] = PL.CompileCounter.count() - c1
        row["step_ms"] = dict(median=ms(float(np.median(times))), min=ms(min(times)), max=ms(max(times)))
        row["compile_s"] = w.compile_s(float(np.median(times)))
        row["peak_memory_bytes"] = peak_memory(mesh)
        if plan["n_experts"] > 1:
            row["expert_offload"] = offload_row(den)
        row["profile"] = prof
        # every XLA compile of this row (cache loads included) and the compile cache's answers
        row["xla_compile"] = runtime.stats_since(stats0)
        if hlo_dir:
            resident = next(r for r in runners if r.resident == "device")
            row["hlo"] = dump_hlo(hlo_dir, f"{fam}-{preset}-{mode}", resident, den, mode)
        try:
            checks.check_finite(final, "final latents")
        except checks.NonFiniteError as e:
            row["sha256"] = None
            row["error"] = f"NonFiniteError: {e}"
            results.append(row)
            continue
        row["sha256"] = sha256(final)
        # every process holds the whole final latents: their hashes must agree
        row["sha256_agree"], row["sha256_processes"] = distributed.all_equal(row["sha256"])
        finals[mode] = final
        results.append(row)
    ref = "tp" if "tp" in finals else None
    for mode, final in finals.items():
        if ref and mode != ref:
            row = next(r for r in results if r["model"] == base["model"] and r["mode"] == mode)
            tp_row = next(r for r in results if r["model"] == base["model"] and r["mode"] == ref)
            row["vs_tp"] = compare(final, finals[ref])
            row["vs_tp"]["step_ratio"] = row["step_ms"]["median"] / tp_row["step_ms"]["median"]


def offload_row(den) -> dict:
    """The timed run's expert offload: the setting, whether it was on and why, the bytes per
    chip in host memory (every expert's host copy), and each switch's measured copy."""
    from difflet_tpu import runtime

    out = dict(setting=den.offload_setting, enabled=bool(den.offload), reason=den.offload_reason)
    if den.offload:
        out["host_bytes_per_chip"] = sum(r.host_bytes() for r in den.runners)
        out["placement_s"] = den.placement_s
        out["swaps"] = [dict(sw) for sw in den.swaps]
        out["swap_s"] = [sw["s"] for sw in den.swaps]
    return out


def expert_memory(mem: dict, other: int, setting: str, chip) -> tuple[dict, dict]:
    """--compile-only HBM per chip of a two-expert model and its offload report.

    `other`: the other expert's parameter bytes per chip (the experts have the same
    shapes). Off (or "auto" when both fit `chip.hbm_bytes`): it is resident, added to
    the total as `other_experts`. On: it waits in host memory (`host_experts`, not in
    the total), each switch copies it in, estimated at `runtime.H2D_BYTES_PER_S` (an
    assumption, cited there); once both experts have been offloaded the host keeps a
    copy of each (`host_bytes_per_chip`), so a switch back costs one copy too."""
    from difflet_tpu import runtime

    both = mem["total"] + other
    enabled = setting == "on" or (setting == "auto" and both > chip.hbm_bytes)
    report = dict(setting=setting, enabled=enabled, all_resident_bytes=both)
    if not enabled:
        return dict(mem, other_experts=other, total=both), report
    bw = runtime.H2D_BYTES_PER_S.get(chip.name)
    report.update(idle_expert_bytes_per_chip=other, host_bytes_per_chip=2 * other, h2d_bytes_per_s=bw,
                  swap_ms_estimate=None if bw is None else ms(other / bw),
                  h2d_source="assumption: PCIe ~1.5e10 B/s per chip (v6e 3.2e10), "
                             "https://jax-ml.github.io/scaling-book/tpus/")
    return dict(mem, other_experts=0, host_experts=other), report


def json_safe(obj):
    """`obj` with every non-finite float replaced (NaN -> None, inf -> "inf" / "-inf"), so the
    report is valid JSON (`json.dump` would write bare NaN / Infinity)."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, numbers.Integral):  # ints, numpy ints, bools
        return obj if isinstance(obj, (bool, int)) else int(obj)
    if isinstance(obj, numbers.Real):  # floats, numpy floats
        f = float(obj)
        if math.isnan(f):
            return None
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return f
    return obj


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(json_safe(data), f, indent=1, default=str, allow_nan=False)


def host_memory_bytes() -> int | None:
    """Physical memory of this machine (None if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def param_bytes(params) -> tuple[int, int]:
    """(parameter count, bytes) of a model's (abstract) parameters."""
    import jax
    import jax.numpy as jnp

    leaves = jax.tree_util.tree_leaves(params)
    count = sum(int(math.prod(x.shape)) for x in leaves)
    return count, sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)


def peak_memory(mesh):
    import jax

    peaks = []
    for d in mesh.devices.flat:
        if d.process_index != jax.process_index():
            continue  # another process's device
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - platforms without memory stats
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None


def dump_hlo(directory, name, runner, den, mode):
    import jax

    os.makedirs(directory, exist_ok=True)
    kw = den.kwargs(den.initial(), float(den.schedule.timesteps[0]))
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) if hasattr(v, "shape") else v for k, v in kw.items()}
    compiled = runner.trace(**abstract).lower().compile()
    path = os.path.join(directory, f"{name}.hlo.txt".replace(":", "_"))
    with open(path, "w") as f:
        f.write(compiled.as_text())
    return path


def print_table(results, out=None):
    out = out or sys.stdout
    hdr = (f"{'model':28} {'mode':7} {'mesh':16} {'load s':>7} {'compile s':>9} {'step ms med':>11} {'min':>8} {'max':>8} "
           f"{'denoise s':>9} {'peak GiB':>8} {'sha256':>12} {'rel L2 vs TP':>12} {'PSNR dB':>8} {'SP/TP':>6}")
    print(hdr, file=out)
    for r in results:
        if "error" in r:
            print(f"{r['model']:28} {r.get('mode', '-'):7} ERROR: {r['error']}", file=out)
            continue
        v = r.get("vs_tp", {})
        peak = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f}"
        print(f"{r['model']:28} {r['mode']:7} {r['mesh']:16} {r['load_s']:7.2f} {r['compile_s']:9.2f} "
              f"{r['step_ms']['median']:11.2f} {r['step_ms']['min']:8.2f} {r['step_ms']['max']:8.2f} "
              f"{r['denoise_s']:9.2f} {peak:>8} {r['sha256'][:12]:>12} "
              f"{('%.2e' % v['rel_l2']) if v else '-':>12} {('%.1f' % v['psnr_db']) if v else '-':>8} "
              f"{('%.3f' % v['step_ratio']) if v else '-':>6}", file=out)
    for r in results:
        o = r.get("expert_offload")
        if "error" in r or not o or not o["enabled"]:
            continue
        swaps = ", ".join(f"{1e3 * s:.1f}" for s in o["swap_s"]) or "none"
        print(f"  {r['model']} {r['mode']}: idle expert in host memory ({o['setting']}; "
              f"{o['host_bytes_per_chip'] / 2**30:.2f} GiB/chip), measured expert swaps ms: {swaps} "
              f"(not in the step times; in denoise s)", file=out)


def run_bench(args):
    """The denoise benchmark on the devices at hand (4 virtual CPU devices without a TPU);
    with --distributed / --coordinator, on every process's devices (process 0 reports)."""
    tpu = has_tpu()
    args.cpu = not tpu
    cpu_devices = args.cpu_devices or CPU_DEVICES
    from difflet_tpu import distributed

    if args.multi:
        try:
            distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   cpu_devices=cpu_devices if args.cpu else None,
                                   init_timeout_s=args.init_timeout, heartbeat_timeout_s=args.heartbeat_timeout)
        except distributed.DistributedError as e:
            raise BenchError(str(e)) from None
    elif args.cpu:
        from difflet_tpu.mesh import use_cpu_devices

        use_cpu_devices(cpu_devices)
    import jax
    import jax.numpy as jnp

    from difflet_tpu import pipeline as PL
    from difflet_tpu import runtime
    from difflet_tpu.config import Config

    me = distributed.info()
    cache_dir = args.compile_cache or Config.from_env().compile_cache
    if cache_dir:  # before the first compile; a bad directory fails here
        cache_dir = runtime.enable_compile_cache(cache_dir)
        # the flag wins over the environment for every Config made later (the Runners)
        os.environ["DIFFLET_TPU_COMPILE_CACHE"] = cache_dir
    cache_before = runtime.cache_entries(cache_dir) if cache_dir else None
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype or ("float32" if args.cpu else "bfloat16")]
    models = resolve_models(args)
    n_devices = jax.device_count() if (args.multi or not args.cpu) else min(cpu_devices, jax.device_count())
    # every refusal before any work; each model on its own mesh (cfg / data / tp)
    plans = [prepare(spec, preset, args, model_mesh(spec, preset, args, n_devices), dtype)
             for spec, preset in models]
    results = []
    for plan in plans:
        try:
            run_model(plan, args, plan["mesh"], dtype, results, hlo_dir=args.dump_hlo)
        except Exception as e:  # noqa: BLE001 - report per model, keep going
            if args.multi and distributed.peer_failure(e):
                distributed.exit_peer_lost(e, f"the {plan['fam']}:{plan['preset']} benchmark")
            results.append(dict(model=f"{plan['fam']}:{plan['preset']}", error=f"{type(e).__name__}: {str(e)[:300]}"))
    for r in results:
        if "error" not in r and not r.get("sha256_agree", True):
            r["error"] = "final latents differ between processes: " + ", ".join(
                f"{i}: {h[:12]}" for i, h in enumerate(r["sha256_processes"]))
    failed = any("error" in r for r in results)
    if not me.is_reporter:
        return 1 if failed else 0
    print_table(results)
    if args.json:
        cache = None if not cache_dir else dict(
            dir=cache_dir, entries_before=cache_before, entries_after=runtime.cache_entries(cache_dir))
        write_json(args.json, dict(kind="bench", platform="cpu" if args.cpu else "tpu", processes=me.count,
                                   devices=jax.device_count(), libtpu_init_args=os.environ.get("LIBTPU_INIT_ARGS"),
                                   compile_cache=cache, kernel_tiles=Config.from_env().kernel_tiles,
                                   results=results))
    return 1 if failed else 0


# --------------------------------------------------------------------------
# Compile-only estimates
# --------------------------------------------------------------------------


def abstract_trace(spec, cfg, inputs, mesh, config, mode, dtype):
    """(Runner, traced step) of the model with abstract weights (no memory) on `mesh`
    for `inputs` (arrays stand in as ShapeDtypeStructs): a deviceless compile's input,
    and the tile sweep's walk over the kernel sites."""
    import jax
    import numpy as np
    from flax import nnx

    from difflet_tpu import runtime
    from difflet_tpu.runner import Runner

    model = runtime.abstract_model(lambda: spec.build(cfg, dtype=dtype, rngs=nnx.Rngs(0)), mesh, spec.plan)
    runner = Runner(model, mesh, config, mode=mode)
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) if isinstance(v, np.ndarray) else v
                for k, v in inputs.items()}
    return runner, runner.trace(**abstract)


def compile_one(spec, preset, cfg, shape, variant, mesh, chip, calibration, args, batch):
    import jax.numpy as jnp

    from difflet_tpu import deviceless, estimate as E
    from difflet_tpu.config import Config

    fam = spec.name
    from difflet_tpu.mesh import _coords, format_mesh, mesh_shape, ring_hops, tp_groups

    pmode, overrides = COMPILE_VARIANTS[variant]
    # no compile cache: a deviceless compile writes entries it can never load
    config = Config.from_env(compile_cache=None, **overrides)
    P = mesh.devices.size
    inputs = spec.example_inputs(cfg, **shape, batch=batch, seed=0, dtype=jnp.bfloat16)
    analytic = float(spec.flops(cfg, inputs))
    t0 = time.perf_counter()
    runner, traced = abstract_trace(spec, cfg, inputs, mesh, config, pmode, jnp.bfloat16)
    lowered = traced.lower()
    compiled = lowered.compile(compiler_options=dict(XLA_CM_FLAGS) if pmode == "sp-xla" else None)
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        with open(os.path.join(args.dump_hlo, f"{fam}-{preset}-{variant}.hlo.txt"), "w") as f:
            f.write(text)
    mem = deviceless.memory_report(compiled)
    # a two-expert model (Wan2.2 A14B): the other expert has this one's shapes and shardings,
    # resident beside the step's or, offloaded, in host memory
    offload = None
    if spec.experts.get(preset) is not None:
        mem, offload = expert_memory(mem, runner.param_bytes(), args.offload, chip)  # the Runner's plan
    cost = compiled.cost_analysis() or {}
    raw = E.estimate(text, chip)
    cal = E.estimate(text, chip, calibration)
    ideal = analytic / (P * chip.bf16_flops)
    used = cal if args.calibrated == "yes" else raw
    sp_kernel = config.ag_kernel("pallas", "tpu") if pmode == "sp" else None
    rs_kernel = config.rs_kernel("tpu", chip) if pmode == "sp" else None
    coords = {d.id: _coords(d)[:3] for d in mesh.devices.flat}
    hops = [ring_hops(g, coords) for g in tp_groups(mesh)]
    return dict(
        model=f"{fam}:{preset}", family=fam, preset=preset, mode=variant, parallel_mode=pmode,
        ag_impl=sp_kernel, rs_impl=rs_kernel, shape=shape, batch=batch, chips=P, mesh=format_mesh(dict(mesh.shape)),
        tp_ring_max_hops=max(max(h) for h in hops), compile_s=round(compile_s, 2),
        hbm=dict(mem, capacity=chip.hbm_bytes, fits=mem["total"] <= chip.hbm_bytes),
        flops=dict(xla_per_chip=cost.get("flops"), analytic_total=analytic, analytic_per_chip=analytic / P),
        ideal_ms=ms(ideal), estimate_ms=ms(used.total), estimate_raw_ms=ms(raw.total),
        estimate_calibrated_ms=ms(cal.total), calibration=calibration.nonmatmul,
        breakdown=E.summarize(used), breakdown_raw=E.summarize(raw), schedule_overlap=E.schedule_overlap(text),
        compiler_options=XLA_CM_FLAGS if pmode == "sp-xla" else {},
        **({} if offload is None else dict(expert_offload=offload)),
    )


def run_compile_only(args):
    """Deviceless compiles for `--topology`: HBM per chip, FLOPs, collectives, estimated step time."""
    from difflet_tpu import deviceless

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other deviceless compiles on this machine
    deviceless.setup_process(args.topology)
    import jax  # noqa: F401  (after the TPU environment is set)

    from difflet_tpu import estimate as E
    from difflet_tpu import pipeline as PL

    chip = E.chip_for(args.topology)
    calibration = E.CALIBRATION.get(chip.name, E.Calibration())
    try:
        devices = deviceless.topology_devices(args.topology)
    except Exception as e:  # noqa: BLE001
        raise BenchError(f"--topology {args.topology}: libtpu did not accept it ({type(e).__name__}: {e})")
    from difflet_tpu.mesh import format_mesh, make_mesh, mesh_shape
    if args.model:
        models = [PL.resolve_model(m) for m in args.model]
    else:
        from difflet_tpu.models import specs

        models = [(s, s.released) for s in specs().values()]
    results, failed = [], False
    for spec, preset in models:
        cfg = build_config(spec, preset)
        shape = shape_for(spec, preset, args)
        _, guided = guidance_for(spec, args)
        batch = args.batch * (2 if guided else 1)
        try:
            axes = mesh_axes_for(spec, cfg, len(devices), batch, args.mesh_axes, guided)
        except BenchError as e:
            failed = True
            results.append(dict(model=f"{spec.name}:{preset}", mode="-", mesh=args.mesh or "-", error=str(e)))
            continue
        mesh = make_mesh(devices=devices, **axes)
        for variant in args.modes:
            name = f"{spec.name}:{preset}"
            print(f"compiling {name} {variant} on {format_mesh(dict(mesh.shape))} for {args.topology} ...",
                  file=sys.stderr, flush=True)
            try:
                results.append(compile_one(spec, preset, cfg, shape, variant, mesh, chip, calibration, args, batch))
            except Exception as e:  # noqa: BLE001
                failed = True
                results.append(dict(model=name, mode=variant, mesh=format_mesh(dict(mesh.shape)),
                                    error=f"{type(e).__name__}: {str(e)[:400]}"))
    for r in results:
        if "error" in r:
            continue
        tp = next((x for x in results if x.get("model") == r["model"] and x.get("mesh") == r["mesh"]
                   and x.get("mode") == "tp" and "error" not in x), None)
        if tp and r["mode"] != "tp":
            r["ratio_vs_tp"] = round(r["estimate_ms"] / tp["estimate_ms"], 3)
    print_compile_table(results, args.topology, chip, calibration)
    if args.json:
        from difflet_tpu.config import Config

        write_json(args.json, dict(kind="compile-only", topology=args.topology, chip=chip.to_dict(),
                                   calibration=calibration.__dict__, kernel_tiles=Config.from_env().kernel_tiles,
                                   note="estimates from the compiled schedule, not measurements", results=results))
    return 1 if failed else 0


def print_compile_table(results, topology, chip, calibration, out=None):
    out = out or sys.stdout
    gib = lambda b: b / 2**30
    print(f"compile-only ESTIMATES for {topology} ({chip.name}: {chip.bf16_flops / 1e12:.0f} TFLOP/s, "
          f"HBM {gib(chip.hbm_bytes):.0f} GiB at {chip.hbm_bw / 1e9:.0f} GB/s, ICI {chip.ici_link_bw / 1e9:.0f} GB/s/link; "
          f"non-matmul factor {calibration.nonmatmul})", file=out)
    print(f"{'model':28} {'mode':9} {'mesh':16} {'args GiB':>8} {'temp GiB':>8} {'out GiB':>7} {'HBM GiB':>7} {'fits':>4} "
          f"{'TF/chip xla':>11} {'TF/chip an.':>11} {'ideal ms':>8} {'est ms':>8} {'raw ms':>8} {'x TP':>5} "
          f"{'matmul':>7} {'nonmm':>7} {'pallas':>7} {'exposed':>7} {'sync':>7}  collectives (count/bytes per chip/overlapped)",
          file=out)
    for r in results:
        if "error" in r:
            print(f"{r['model']:28} {r['mode']:9} ERROR: {r['error']}", file=out)
            continue
        h, b = r["hbm"], r["breakdown"]
        coll = "; ".join(f"{k} {v['count']}/{v['bytes_per_chip'] / 1e9:.2f}GB/{v['overlapped']}"
                         for k, v in b["collectives"].items())
        xla = r["flops"]["xla_per_chip"]
        print(f"{r['model']:28} {r['mode']:9} {r['mesh']:16} {gib(h['arguments']):8.2f} {gib(h['temporaries']):8.2f} "
              f"{gib(h['outputs']):7.2f} {gib(h['total']):7.2f} {'yes' if h['fits'] else 'NO':>4} "
              f"{(xla or 0) / 1e12:11.2f} {r['flops']['analytic_per_chip'] / 1e12:11.2f} {r['ideal_ms']:8.1f} "
              f"{r['estimate_ms']:8.1f} {r['estimate_raw_ms']:8.1f} {r.get('ratio_vs_tp', 1.0):5.2f} "
              f"{b['matmul_ms']:7.1f} {b['nonmatmul_ms']:7.1f} {b['pallas_ms']:7.1f} "
              f"{b['exposed_transfer_ms']:7.1f} {b['sync_collective_ms']:7.1f}  {coll}", file=out)
    print_offload_notes(results, out)


def print_offload_notes(results, out=None):
    """One line per two-expert compile-only row: where the idle expert is, and the estimated swap."""
    out = out or sys.stdout
    gib = lambda b: b / 2**30
    for r in results:
        o = r.get("expert_offload")
        if "error" in r or not o:
            continue
        if o["enabled"]:
            bw = "an unknown bandwidth" if o["h2d_bytes_per_s"] is None else f"{o['h2d_bytes_per_s'] / 1e9:.0f} GB/s"
            swap = "-" if o["swap_ms_estimate"] is None else f"{o['swap_ms_estimate']:.0f}"
            print(f"  {r['model']} {r['mode']}: idle expert offloaded ({o['setting']}): "
                  f"{gib(o['idle_expert_bytes_per_chip']):.2f} GiB/chip not in HBM, "
                  f"{gib(o['host_bytes_per_chip']):.2f} GiB/chip in host memory (both experts' copies; all resident: "
                  f"{gib(o['all_resident_bytes']):.2f} GiB); ESTIMATED swap {swap} ms per expert switch at {bw} "
                  f"host-to-device per chip (assumed, scaling-book)", file=out)
        else:
            print(f"  {r['model']} {r['mode']}: both experts resident ({o['setting']}): HBM includes the other "
                  f"expert's {gib(r['hbm']['other_experts']):.2f} GiB/chip", file=out)


def main(argv=None):
    """`python -m difflet_tpu.bench` (see the module docstring and `--help`)."""
    ap = parser()
    args = ap.parse_args(argv)
    validate(args, ap)
    try:
        if args.compile_only:
            return run_compile_only(args)
        return run_bench(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad --model names, shapes the port refuses
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
