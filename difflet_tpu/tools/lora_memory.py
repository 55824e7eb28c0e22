"""Compile-only HBM of a LoRA on a released model (deviceless TPU compile; no chip, no weights).

`python -m difflet_tpu.tools.lora_memory --preset flux.1-dev --rank 64 --topology v5e:2x2` prints,
per chip, for an adapter of rank `rank` on every Linear the port's key map loads from a
`*.weight` (what peft's "all-linear" targets): the parameters the step reads (unchanged by a
LoRA: the fused weights replace them, same shapes and shardings), the base copies kept for an
exact unload (difflet_tpu/loading/lora.py), the factors, and the compiled fuse's own HBM for the
largest parameter (arguments + outputs + temporaries, the peak while one parameter is fused).
"""

from __future__ import annotations

import argparse
import json
import math


def measure(preset: str, rank: int, topology: str, tp: int | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from difflet_tpu import models, runtime
    from difflet_tpu.config import Config
    from difflet_tpu.loading import lora
    from difflet_tpu.parallel.modes import param_specs
    from difflet_tpu.tools import deviceless

    spec = next(s for s in models.specs().values() if preset in s.presets)
    cfg = spec.config_from_diffusers(dict(spec.presets[preset]), split_rope=Config.from_env().split_rope)
    mesh = deviceless.topology_mesh(topology, tp)
    model = runtime.abstract_model(lambda: spec.build(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh, spec.plan)
    state = nnx.state(model, nnx.Param)
    leaves = {lora.leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    specs = {lora.leaf_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        param_specs(state, spec.plan), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]}
    targets = {t.path for ts in lora.linear_targets(spec.key_map(cfg, model)).values() for t in ts}
    per_chip = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # noqa: E731
    factor_bytes, largest = 0, max(sorted(targets), key=lambda p: math.prod(leaves[p].shape))
    for p in targets:
        x = leaves[p]
        factor_bytes += 4 * rank * (x.shape[-2] + x.shape[-1] + 1) * (x.shape[0] if x.ndim == 3 else 1)
    x = leaves[largest]
    sa, sb, ss = lora.factor_specs(specs[largest], x.ndim)
    lead = x.shape[:-2]
    sds = lambda shape, s: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, s))  # noqa: E731
    fuse = lora._fuse.trace(x, sds(lead + (x.shape[-2], rank), sa), sds(lead + (rank, x.shape[-1]), sb),
                            sds(lead + (rank,), ss)).lower().compile()
    return {"preset": preset, "rank": rank, "topology": topology, "tp": mesh.shape["tp"],
            "params_per_chip": runtime.tree_bytes_per_device(state),
            "base_copies_per_chip": sum(per_chip(leaves[p]) for p in targets),
            "lora_parameters": len(targets), "factors_host_float32_total": factor_bytes,
            "largest_parameter": largest, "largest_shape": list(x.shape),
            "largest_spec": [None if a is None else str(a) for a in tuple(specs[largest])],
            "fuse_largest_compiled": runtime.memory_report(fuse)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="flux.1-dev")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--tp", type=int, default=None)
    args = ap.parse_args()
    from difflet_tpu.tools import deviceless

    deviceless.setup_process(args.topology)
    print(json.dumps(measure(args.preset, args.rank, args.topology, args.tp)))


if __name__ == "__main__":
    main()
