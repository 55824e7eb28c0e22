"""One denoise step per released model at its bench shape: compiled, estimated, timed.

Every case (`CASES`: each port's released preset at the reference PR's step
shape, batch 1, guidance off where the pipeline would run CFG) compiles once
per mode with abstract weights (`bench.compile_only.abstract_trace`): its
HBM per chip and the estimator's raw breakdown come from that program. On a
TPU, when it fits the chips' memory, the model is then built with random
weights made directly on the mesh (each parameter in its own sharding, no
host copy), and `iters` steps are timed (median, each waited on) after two
untimed ones.
"""

from __future__ import annotations

import statistics
import time

# Every case of benchmark/estimates.py (name -> (model, shape, guidance)): their sites on a TPU.
SITE_CASES = {
    "wan": ("wan:Wan2.1-T2V-14B", dict(height=480, width=832, frames=9), 1.0),
    "flux": ("flux:flux.1-dev", dict(height=1024, width=1024, frames=1), None),
    "hunyuan_video": ("hunyuan_video:hunyuan-video", dict(height=320, width=512, frames=61), None),
    "ltx2": ("ltx2:ltx-2.0", dict(height=480, width=704, frames=49), 1.0),
    "wan_81": ("wan:Wan2.1-T2V-14B", dict(height=480, width=832, frames=81), 1.0),
    "wan_720p_81": ("wan:Wan2.1-T2V-14B", dict(height=720, width=1280, frames=81), 1.0),
    "hunyuan_video_544p": ("hunyuan_video:hunyuan-video", dict(height=544, width=960, frames=129), None),
    "hunyuan_video_720p": ("hunyuan_video:hunyuan-video", dict(height=720, width=1280, frames=129), None),
    "ltx2_121": ("ltx2:ltx-2.0", dict(height=480, width=704, frames=121), 1.0),
    "wan_cfg": ("wan:Wan2.1-T2V-14B", dict(height=480, width=832, frames=9), 5.0),
    "ltx2_cfg": ("ltx2:ltx-2.0", dict(height=480, width=704, frames=49), 3.0),
    "qwen_image": ("qwen_image:qwen-image", dict(height=1024, width=1024, frames=1), 1.0),
    "qwen_image_1328": ("qwen_image:qwen-image", dict(height=1328, width=1328, frames=1), 1.0),
}
# The released models' step rows (batch 1, as the PR's), one per model.
CASES = {n: SITE_CASES[n] for n in ("wan", "flux", "hunyuan_video", "ltx2", "qwen_image")}
MODES = ("tp", "sp", "sp-pallas")  # the bench's compile-only variants: sp = the JAX rings


def random_state(abstract_state, seed=0):
    """Random arrays for an abstract model's state, each made on its own sharding."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(abstract_state)
    key = jax.random.key(seed)
    out = []
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.ShapeDtypeStruct):
            out.append(x)
            continue
        make = lambda k, s=x: (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype) \
            if jnp.issubdtype(s.dtype, jnp.floating) else jnp.zeros(s.shape, s.dtype)
        out.append(jax.jit(make, out_shardings=x.sharding)(jax.random.fold_in(key, i)))
    return jax.tree.unflatten(treedef, out)


def check_step(name, mesh_axes, devices, *, mode, modes=MODES, chip=None, iters=5, log=print) -> list:
    """Rows (one per parallel mode) for one case. mode: "tpu" (compiled, estimated, timed
    where it fits) or "compile" (deviceless: compiled and estimated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from difflet_tpu import runtime
    from difflet_tpu.bench import cases
    from difflet_tpu.bench.compile_only import COMPILE_VARIANTS, abstract_trace
    from difflet_tpu.bench.run import XLA_CM_FLAGS
    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import format_mesh, make_mesh
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.runner import Runner
    from difflet_tpu.tools import estimate as E

    model, shape, guidance = CASES[name]
    spec, preset = PL.resolve_model(model)
    cfg = cases.build_config(spec, preset)
    batch = 1
    inputs = spec.example_inputs(cfg, **shape, batch=batch, seed=0, dtype=jnp.bfloat16)
    axes = cases.mesh_axes_for(spec, cfg, len(devices), batch, mesh_axes, False)
    mesh = make_mesh(devices=devices, **axes)
    limit = runtime.device_memory_limit(list(mesh.devices.flat)) if mode == "tpu" else (chip.hbm_bytes if chip else None)
    rows = []
    for variant in modes:
        pmode, overrides = COMPILE_VARIANTS[variant]
        row = dict(what="step", name=f"{name} {'x'.join(str(v) for v in shape.values())}", model=model, impl=variant,
                   mesh=format_mesh(dict(mesh.shape)), measured_ms=None)
        t = time.perf_counter()
        try:
            config = Config.from_env(compile_cache=None, **overrides)
            opts = dict(XLA_CM_FLAGS) if pmode == "sp-xla" else None
            runner, traced = abstract_trace(spec, cfg, inputs, mesh, config, pmode, jnp.bfloat16)
            lowered = traced.lower()
            compiled = lowered.compile(compiler_options=opts) if opts else lowered.compile()
            mem = runtime.memory_report(compiled)
            est = E.estimate(compiled.as_text(), chip)
            row.update(hbm_bytes=mem["total"], breakdown_raw=E.summarize(est), estimate_raw_ms=round(1e3 * est.total, 3),
                       compile_s=round(time.perf_counter() - t, 1))
            if mode == "tpu":
                if limit is not None and mem["total"] > limit:
                    row["skipped"] = f"needs {mem['total'] / 2**30:.2f} GiB per chip, the chips have {limit / 2**30:.2f}"
                else:
                    state = random_state(nnx.state(runner.model))
                    live = Runner(nnx.merge(nnx.graphdef(runner.model), state), mesh, config, mode=pmode,
                                  compiler_options=opts)
                    del state
                    prep = live.prepare(live.spec_kwargs((), inputs))
                    times = []
                    for i in range(iters + 2):
                        t0 = time.perf_counter()
                        out = jax.block_until_ready(live.run_prepared(prep))
                        if i >= 2:
                            times.append(time.perf_counter() - t0)
                    arrays = out.to_tuple() if hasattr(out, "to_tuple") else tuple(out)
                    if not all(np.isfinite(np.asarray(a, np.float32)).all() for a in arrays):
                        raise FloatingPointError("the step's output has NaN or inf")
                    row["measured_ms"] = round(1e3 * statistics.median(times), 3)
                    del live
        except Exception as e:  # noqa: BLE001 - a failed row, the others still run
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        log(f"step {row['name']} {variant}: " + (row.get("error") or row.get("skipped") or
                                                 f"est. raw {row['estimate_raw_ms']} ms, measured {row['measured_ms']}"))
        rows.append(row)
    return rows
