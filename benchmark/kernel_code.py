"""Generated code of every collective-matmul kernel call of a model's SP step, compiled deviceless.

`python benchmark/kernel_code.py --model flux:flux.1-dev --height 1024 --width 1024 [--frames F]
[--guidance G] [--topology v5e:2x2]`

Traces the model's SP step as `python -m difflet_tpu.tools.sweep_tiles` does
(`sweep_tiles.model_sites`: abstract weights, the TPU's kernel choices) and
compiles each distinct kernel site alone, through the dispatch, at the plan's
default column tile; prints one JSON line per site: its shapes, column tile,
chunks a half and `memory_analysis().generated_code_size_in_bytes` (issue 17:
under 2 MiB a call; docs/kernels.md, "Code size"). A few seconds a site.
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--guidance", type=float)
    ap.add_argument("--topology", default="v5e:2x2")
    args = ap.parse_args(argv)
    args.batch = 1
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from difflet_tpu.tools import deviceless

    deviceless.setup_process(args.topology)
    import jax.numpy as jnp

    from difflet_tpu.bench import cases
    from difflet_tpu.tools import sweep_tiles
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.parallel.mesh import make_mesh

    devices = deviceless.topology_devices(args.topology)
    spec, preset = PL.resolve_model(args.model)
    cfg = cases.build_config(spec, preset)
    shape = cases.shape_for(spec, preset, args)
    _, guided = cases.guidance_for(spec, args)
    batch = 2 if guided else 1
    mesh = make_mesh(devices=devices, **cases.mesh_axes_for(spec, cfg, len(devices), batch, None, guided))
    for site, calls in sweep_tiles.model_sites(spec, preset, shape, batch, mesh, jnp.bfloat16):
        tn, plan = sweep_tiles.candidates(site, 512)[0]  # the default plan's tile
        fn, shapes = sweep_tiles.site_call(site, tn, mesh, False)
        report = sweep_tiles.compile_report(sweep_tiles.traced_at(fn, shapes, site, tn))
        print(json.dumps(dict(model=f"{spec.name}:{preset}", shape=shape, batch=batch, kind=site.kind,
                              x=site.x_shapes, w=site.w_shapes, calls=calls, col_tile=tn, chunks=plan.chunks,
                              code_bytes=report["code_bytes"])), flush=True)


if __name__ == "__main__":
    main()
