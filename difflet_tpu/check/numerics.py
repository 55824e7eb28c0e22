"""Every port at its tiny preset against float64 references that ship with the package.

The reference of a port is its own forward in float64 on CPU (one device,
`jax_enable_x64`), from the weights `nnx.Rngs(0)` gives the tiny preset (built
in float32 on the host CPU, so every platform starts from the same bits) and
the port's `example_inputs` at its `tiny_shape`, seed 0; the bf16 rows'
reference starts from those weights and inputs rounded to bf16 (so it
measures the bf16 arithmetic, not the rounding of the inputs, which alone
moves HunyuanVideo's and LTX-2's tiny outputs by ~50%). `write_references`
makes them (`python -m difflet_tpu.check.numerics --write`); the ports
themselves are checked against diffusers in the test suite (tests/fixtures),
so this check is about the platform and the parallel modes: one device, TP
and SP on the mesh, in float32 (matmuls at full float32 precision) and bf16
(weights and inputs cast), each within `TOL` of the float64 output.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

REF_DIR = pathlib.Path(__file__).resolve().parent / "references"
# max |out - ref| / max |ref| per output, against float64. float32: summation order and
# transcendental approximations differ by platform; bf16: 8 bits of mantissa through every block.
TOL = {"float32": 1e-4, "bfloat16": 3e-2}
MODES = ("one device", "tp", "sp")


def tiny(spec):
    """(config, float32 model on the host CPU, numpy inputs) of a port's tiny preset."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from difflet_tpu.bench.cases import build_config

    cfg = build_config(spec, "tiny")
    with jax.default_device(jax.devices("cpu")[0]):
        model = spec.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    inputs = spec.example_inputs(cfg, **spec.tiny_shape, batch=1, seed=0, dtype=np.float32)
    # An embedded guidance is cast to the model dtype before its x1000, as diffusers casts it:
    # 3.5 -> 3504 in bf16, which alone moves FLUX's tiny output by 39% (its sinusoids are that
    # sensitive). 4.0 -> 4000 is a bf16 value, so the bf16 rows measure bf16 arithmetic through
    # the blocks, not that one rounding.
    if "guidance" in inputs:
        inputs["guidance"] = np.full_like(np.asarray(inputs["guidance"]), 4.0)
    return cfg, model, inputs


def cast(model, inputs, dtype, device=None):
    """The model's floating parameters and the floating inputs as `dtype` (on `device`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
    put = (lambda x: jax.device_put(x, device)) if device is not None else (lambda x: x)
    state = jax.tree.map(lambda x: put(x.astype(dtype) if floating(x) else x), nnx.state(model))
    model = nnx.merge(nnx.graphdef(model), state)
    np_dtype = np.float64 if dtype == jnp.float64 else dtype
    out = {k: (np.asarray(v).astype(np_dtype) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v)
           for k, v in inputs.items()}
    return model, out


def outputs(out) -> list:
    import numpy as np

    arrays = out.to_tuple() if hasattr(out, "to_tuple") else tuple(out)
    return [np.asarray(a, np.float64) for a in arrays]


def write_references(ports, out_dir=REF_DIR):
    """float64 outputs of each port's tiny preset on one CPU device (needs x64: run in a
    process of its own, `python -m difflet_tpu.check.numerics --write`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from difflet_tpu import models
    from difflet_tpu.runner import Runner

    if not jax.config.jax_enable_x64:
        raise RuntimeError("write_references needs jax_enable_x64 (set before any array is made)")
    os.makedirs(out_dir, exist_ok=True)
    for name in ports:
        spec = models.spec(name)
        _, model, inputs = tiny(spec)
        arrays = {}
        for prefix, start in (("float32", None), ("bfloat16", jnp.bfloat16)):
            m, inp = (model, inputs) if start is None else cast(model, inputs, start)
            m64, in64 = cast(m, inp, jnp.float64)
            with jax.default_device(jax.devices("cpu")[0]):
                outs = outputs(Runner(m64, None)(**in64))
            for i, o in enumerate(outs):
                if not np.isfinite(o).all():
                    raise RuntimeError(f"{name}: the float64 reference is not finite")
                arrays[f"{prefix}_out{i}"] = o
        np.savez(os.path.join(out_dir, f"{name}.npz"), **arrays)
        print(f"wrote {name}: {[(k, v.shape) for k, v in arrays.items()]}")


def read_reference(name, dtype="float32") -> list:
    """The float64 outputs for a run in `dtype` (its weights and inputs rounded to it)."""
    import numpy as np

    path = REF_DIR / f"{name}.npz"
    if not path.exists():
        raise FileNotFoundError(f"no float64 reference for {name} at {path} "
                                f"(python -m difflet_tpu.check.numerics --write makes it)")
    with np.load(path) as z:
        return [z[f"{dtype}_out{i}"] for i in range(sum(f.startswith(dtype + "_") for f in z.files))]


def rel_err(outs, refs) -> float:
    import numpy as np

    if len(outs) != len(refs):
        return float("inf")
    worst = 0.0
    for o, r in zip(outs, refs):
        if o.shape != r.shape or not np.isfinite(o).all():
            return float("inf")
        worst = max(worst, float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30)))
    return worst


def check_port(name, mesh_axes, dtypes=("float32", "bfloat16"), modes=MODES, log=print) -> list:
    """One row per (mode, dtype): the port's tiny preset against its float64 reference."""
    import jax
    import jax.numpy as jnp

    from difflet_tpu import models
    from difflet_tpu.bench import cases
    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import format_mesh, make_mesh
    from difflet_tpu.runner import Runner

    spec = models.spec(name)
    refs = {d: read_reference(name, d) for d in dtypes}
    cfg, model, inputs = tiny(spec)
    rows = []
    mesh = None
    try:
        axes = cases.mesh_axes_for(spec, cfg, jax.device_count(), 1, mesh_axes, False)
        mesh = make_mesh(**axes)
    except Exception as e:  # noqa: BLE001 - the one-device rows still run
        mesh_error = f"{type(e).__name__}: {e}"
    for dtype in dtypes:
        dt = jnp.dtype(dtype)
        for mode in modes:
            row = dict(what="port", port=name, preset="tiny", mode=mode, dtype=dtype, tol=TOL[dtype],
                       mesh="1 device" if mode == "one device" else (format_mesh(dict(mesh.shape)) if mesh else None))
            t = time.perf_counter()
            try:
                if mode != "one device" and mesh is None:
                    raise ValueError(f"no mesh for {name} on these devices: {mesh_error}")
                m, inp = cast(model, inputs, dt, jax.devices()[0] if mode == "one device" else None)
                run = Runner(m, None if mode == "one device" else mesh, Config.from_env(compile_cache=None),
                             mode=None if mode == "one device" else mode)
                with jax.default_matmul_precision("float32" if dtype == "float32" else "default"):
                    outs = outputs(run(**inp))
                err = rel_err(outs, refs[dtype])
                row["rel_err"] = err
                if not err <= TOL[dtype]:
                    row["error"] = f"rel. error {err:.3g} against float64 > {TOL[dtype]}"
            except Exception as e:  # noqa: BLE001 - a failed row, the others still run
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row["seconds"] = round(time.perf_counter() - t, 2)
            log(f"port {name} {mode} {dtype}: " + (row.get("error") or f"rel. error {row['rel_err']:.2e}"))
            rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.check.numerics",
                                 description="writes the float64 references of the ports' tiny presets")
    ap.add_argument("--write", action="store_true", required=True)
    ap.add_argument("--ports", help="comma list (default: every port)")
    args = ap.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_enable_x64", True)
    from difflet_tpu import models

    write_references(args.ports.split(",") if args.ports else models.PORTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
