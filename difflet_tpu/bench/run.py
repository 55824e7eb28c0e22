"""The timed run on devices (a TPU slice, or CPU devices): weights, inputs, the denoise loop, sha256."""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from difflet_tpu.bench.cases import BenchError, CPU_DEVICES, build_config, guidance_for, has_tpu, model_mesh, resolve_models, shape_for, weight_dirs
from difflet_tpu.bench.report import ms, print_table, write_json


XLA_CM_FLAGS = {
    "xla_tpu_all_gather_collective_matmul_mode": "POST_SPMD",
    "xla_tpu_reduce_scatter_collective_matmul_mode": "POST_SPMD",
}


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


def prepare(spec, preset, args, mesh, dtype) -> dict:
    """Everything about one model that can be refused, before any model runs: the
    config (the checkpoint's, validated without reading a tensor), the memory it
    needs on CPU, the shape, the embeddings and the inputs. Raises BenchError."""
    import jax.numpy as jnp
    import numpy as np

    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu import runtime
    from difflet_tpu.config import Config

    fam, pipe = spec.name, spec.pipeline
    boundary = spec.experts.get(preset)
    n_experts = 2 if boundary is not None else 1
    try:
        cfg = build_config(spec, preset)
        dirs = weight_dirs(args, spec, preset) if args.weights else []
        if dirs:  # the checkpoint's own config decides the shapes
            from difflet_tpu import loading

            wcfg = loading.read_config(dirs[0])
            if wcfg["_class_name"] not in spec.class_names:
                raise BenchError(f"--weights {args.weights} holds a {wcfg['_class_name']}, not a {fam} transformer "
                                 f"(--model {fam}:{preset})")
            for d in dirs:  # every check of load_transformer, nothing read
                _, cfg = loading.check_transformer(d, dtype=dtype, mesh=mesh, config=Config.from_env())
        from flax import nnx

        from difflet_tpu import loading

        params = nnx.state(nnx.eval_shape(lambda: spec.build(cfg, dtype=dtype, rngs=nnx.Rngs(0))), nnx.Param)
        bad = loading.mesh_problems(cfg, params, mesh, spec.plan)
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
        c_in, c_out = getattr(cfg, "in_channels", None), getattr(cfg, "out_channels", None)
        latent = inputs.get("hidden_states")
        if (isinstance(c_out, int) and np.ndim(latent) == 5 and np.shape(latent)[1] == c_in != c_out):
            # unpacked video latents [B, C, F, H, W] whose channels the output does not return: the
            # latents plus condition channels (Wan / HunyuanVideo image-to-video)
            src = f"--weights {args.weights}" if dirs else f"--model {fam}:{preset}"
            raise BenchError(f"{src}: a transformer with in_channels={c_in} and out_channels={c_out} (the "
                             f"latents plus {c_in - c_out} condition channels, an image-to-video model); the "
                             f"bench's denoise loop runs text-to-video latents only: use a T2V checkpoint or "
                             f"preset, or plan it with --compile-only")
        cfg_inputs = (spec.example_inputs(cfg, **shape, batch=2 * args.batch, seed=args.seed + 1, dtype=np_dtype)
                      if cfg_batch else None)
        if cfg_inputs is not None:  # conditional rows second, the same latents
            for k in pipe.latent_keys:
                if k in cfg_inputs:
                    cfg_inputs[k] = np.concatenate([inputs[k], inputs[k]])
        emb = args.embedding_arrays
        if emb is not None:
            if cfg_batch:
                cfg_inputs = PL.apply_embeddings(cfg_inputs, emb, True, pipe.arg_names)
            else:
                inputs = PL.apply_embeddings(inputs, emb, False, pipe.arg_names)
                unused = sorted(k for k in emb if k.startswith("negative_"))
                if unused:
                    print(f"note: --embeddings: {unused} not used: {fam} runs without classifier-free guidance "
                          f"({'embedded guidance' if pipe.guidance_mode != 'cfg' else '--guidance 1'})",
                          file=sys.stderr)
        schedule = pipe.schedule(steps, inputs, preset)
        if getattr(args, "attention", None) is not None:  # block-sparse self-attention on every step
            if "attention" not in spec.extra_kwargs:
                raise BenchError(f"--attention: {fam} has no block-sparse attention (Wan, HunyuanVideo and LTX-2 have)")
            inputs = dict(inputs, attention=args.attention)
            cfg_inputs = None if cfg_inputs is None else dict(cfg_inputs, attention=args.attention)
    except ValueError as e:  # WeightsError included
        raise BenchError(str(e)) from None
    except MemoryError as e:  # the inputs themselves do not fit: refused before any model is built
        raise BenchError(f"{fam}:{preset} at {shape_text(args, spec, preset)}, --batch {args.batch}: its inputs do not "
                         f"fit this host's memory ({e}); use a smaller size or batch") from None
    return dict(fam=fam, preset=preset, spec=spec, cfg=cfg, dirs=dirs, shape=shape, mesh=mesh,
                guidance=guidance, cfg_batch=cfg_batch, steps=steps, np_dtype=np_dtype, inputs=inputs,
                cfg_inputs=cfg_inputs, schedule=schedule, boundary=boundary, n_experts=n_experts)


def row_error(e: Exception, plan: dict, args) -> str:
    """A model's failed row as the table shows it; a step that does not fit the devices' memory
    (XLA's allocation refused: nothing ran) names the size and batch that asked for it."""
    text = f"{type(e).__name__}: {str(e)[:300]}"
    if "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e):
        return (f"does not fit the devices' memory at {shape_text(args, plan['spec'], plan['preset'])}, --batch "
                f"{args.batch}: use a smaller size or batch, or plan it with --compile-only --topology ({text})")
    return text


def shape_text(args, spec, preset) -> str:
    """The size a run asked for, as the flags name it."""
    try:
        shape = shape_for(spec, preset, args)
    except (BenchError, ValueError):
        shape = {k: getattr(args, k) for k in ("height", "width", "frames") if getattr(args, k) is not None}
    return " ".join(f"--{k} {v}" for k, v in shape.items())


def run_model(plan, args, mesh, dtype, results, hlo_dir=None):
    """Loads (or initialises) one prepared model and times its denoise loop in each requested mode.
    A mode whose final latents are not finite is a failed row (`error`), not a result."""
    import numpy as np
    from flax import nnx

    from difflet_tpu import checks, runtime
    from difflet_tpu.parallel import distributed
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.parallel.mesh import format_mesh
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
                weights=args.weights or "random", embeddings=args.embeddings or "random",
                attention=getattr(args, "attention", None) or "dense")
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
                from difflet_tpu import loading

                model = loading.load_transformer(plan["dirs"][e], dtype=dtype, mesh=mesh)
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
                          latent_guidance=pipe.latent_guidance if args.guidance is None else None,
                          cache=getattr(args, "cache", None))
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
        if den.step_cache is not None:  # the timed run's transformer passes and per-step decisions
            row["step_cache"] = den.step_cache.stats()
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

    out = dict(setting=den.offload_setting, enabled=bool(den.offload), reason=den.offload_reason)
    if den.offload:
        out["host_bytes_per_chip"] = sum(r.host_bytes() for r in den.runners)
        out["placement_s"] = den.placement_s
        out["swaps"] = [dict(sw) for sw in den.swaps]
        out["swap_s"] = [sw["s"] for sw in den.swaps]
    return out


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
    from difflet_tpu import checks

    return checks.write_atomic(path, compiled.as_text(), "--dump-hlo")


def run_args(args) -> dict:
    """What every process of a multi-process bench must agree on: its arguments but the
    process id and the paths each host may name its own way (outputs only process 0 writes
    or each host keeps: --json, --profile, --dump-hlo, --compile-cache; the --weights and
    --embeddings paths), the DIFFLET_TPU_* environment (the Config) and the content of
    --embeddings (a digest). Weights that differ show as differing final latents (sha256)."""
    import numpy as np

    own = ("process_id", "json", "profile", "dump_hlo", "compile_cache", "weights", "embeddings",
           "embedding_arrays", "mesh_axes", "modes", "offload", "multi", "cpu")  # the last five: derived
    out = {k: v for k, v in vars(args).items() if k not in own}
    out["environment"] = {k: v for k, v in os.environ.items()  # the Config, but each host's cache directory
                          if k.startswith("DIFFLET_TPU_") and k != "DIFFLET_TPU_COMPILE_CACHE"}
    if args.embedding_arrays is not None:
        h = hashlib.sha256()
        for k in sorted(args.embedding_arrays):
            a = np.ascontiguousarray(args.embedding_arrays[k])
            h.update(f"{k}{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
        out["embeddings_sha256"] = h.hexdigest()
    return out


def run_bench(args):
    """The denoise benchmark on the devices at hand (4 virtual CPU devices without a TPU);
    with --distributed / --coordinator, on every process's devices (process 0 reports)."""
    tpu = has_tpu()
    args.cpu = not tpu
    cpu_devices = args.cpu_devices or CPU_DEVICES
    from difflet_tpu.parallel import distributed

    if args.multi:
        try:
            distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   cpu_devices=cpu_devices if args.cpu else None,
                                   init_timeout_s=args.init_timeout, heartbeat_timeout_s=args.heartbeat_timeout)
            # before any collective: processes started differently would run different programs
            distributed.check_same_run(run_args(args), args.init_timeout, "bench arguments")
        except distributed.DistributedError as e:
            raise BenchError(str(e)) from None
    elif args.cpu:
        from difflet_tpu.parallel.mesh import use_cpu_devices

        use_cpu_devices(cpu_devices)
    import jax
    import jax.numpy as jnp

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
            results.append(dict(model=f"{plan['fam']}:{plan['preset']}", error=row_error(e, plan, args)))
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
