"""`python -m difflet_tpu.bench`: smoke run of the rings on 4 virtual CPU devices.

(The denoise benchmark replaces this once the model ports land.) It runs the
toy model of difflet_tpu.testing on one device, under TP and under SP, and
prints step times and the SP/TP difference.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m difflet_tpu.bench", description=__doc__)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)

    from difflet_tpu.mesh import use_cpu_devices

    use_cpu_devices(args.devices)
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from difflet_tpu import layout, runtime
    from difflet_tpu.config import Config
    from difflet_tpu.mesh import TP, make_mesh
    from difflet_tpu.parallel import Parallel
    from difflet_tpu.testing import PLAN, ToyConfig, ToyModel

    c = ToyConfig(dim=256, heads=8, ffn=1024, layers=4, in_channels=64)
    model = ToyModel(c, nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((1, 1000, c.in_channels)).astype(np.float32)
    mesh = make_mesh(args.devices)
    xp, pad = layout.pad_tokens(x, 2 * args.devices)
    mask = layout.key_mask(x.shape[1], xp.shape[1], batch=1)
    results = {}
    for mode in ("tp", "sp"):
        par = Parallel.for_mesh(mesh, Config(), mode=mode)
        rows = P(None, TP, None) if par.seq_sharded else P()
        step, state = runtime.compile_step(model, lambda m, p, a, b: m(p, a, b), par, mesh, PLAN,
                                           in_specs=(rows, P()), out_specs=rows)
        out = jax.block_until_ready(step(state, xp, mask))
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            out = jax.block_until_ready(step(state, xp, mask))
            times.append(time.perf_counter() - t)
        results[mode] = (np.asarray(layout.unpad(out, x.shape[1])), float(np.median(times)))
    a, b = results["sp"][0], results["tp"][0]
    err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    print(f"{'mode':6} {'step ms (median)':>18}")
    for mode, (_, t) in results.items():
        print(f"{mode:6} {t * 1e3:18.2f}")
    print(f"SP vs TP relative L2: {err:.2e}")


if __name__ == "__main__":
    main()
