"""What one bench case is: the model and preset, its shape, guidance, mesh and Config."""

from __future__ import annotations

import glob
import os
import sys


CPU_DEVICES = 4


MODES = ("tp", "sp", "sp-xla")


class BenchError(Exception):
    """A bad flag or an impossible combination, reported before anything runs."""


def has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


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


def weights_model(path, cpu: bool):
    """The (spec, preset) of `--weights DIR` given without `--model`: the port from
    the checkpoint's `_class_name`, the preset "tiny" on CPU (its shapes; the
    checkpoint's config decides the model), the released one on TPU."""
    from difflet_tpu import models
    from difflet_tpu import loading

    if not os.path.isfile(os.path.join(path, "config.json")):
        if os.path.isdir(os.path.join(path, "transformer_2")):
            raise BenchError(f"--weights {path} holds two experts (transformer/, transformer_2/): name the "
                             "pipeline with --model (wan:Wan2.2-T2V-A14B or wan:Wan2.2-I2V-A14B)")
        raise BenchError(f"--weights {path}: no config.json (expected a diffusers transformer directory)")
    cls = loading.read_config(path)["_class_name"]
    try:
        spec = models.spec_for_class(cls)
    except ValueError:
        raise BenchError(f"--weights {path} holds a {cls}, which no port supports "
                         f"(supported: {', '.join(sorted(c for s in models.specs().values() for c in s.class_names))})"
                         ) from None
    preset = "tiny" if cpu else spec.released
    print(f"--weights {path}: a {cls}; running {spec.name}:{preset} (give --model to choose)", file=sys.stderr)
    return spec, preset


def resolve_models(args):
    """--model (or --weights' own model, or every port) as (spec, preset) pairs."""
    from difflet_tpu import models
    from difflet_tpu.pipeline import denoise as PL

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
    from difflet_tpu import loading
    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import make_mesh

    try:
        cfg = build_config(spec, preset)
        if args.weights:
            wcfg = loading.read_config(weight_dirs(args, spec, preset)[0])
            if wcfg["_class_name"] in spec.class_names:  # otherwise prepare refuses it
                cfg = spec.config_from_diffusers(wcfg, split_rope=Config.from_env().split_rope)
    except ValueError as e:  # WeightsError included
        raise BenchError(str(e)) from None
    _, guided = guidance_for(spec, args)
    axes = mesh_axes_for(spec, cfg, n_devices, args.batch * (2 if guided else 1), args.mesh_axes, guided)
    return make_mesh(**axes)
