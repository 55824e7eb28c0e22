"""No collective-matmul site falls back to the JAX ring at any benchmark shape.

Every case of benchmark/estimates.py (the results table's shapes and the long
videos of issue 14) is traced, not compiled, at its released model size on a
4-device `tp` ring with both Pallas kernels forced (`sp_kernel` and
`sp_rs_kernel` "pallas"), bf16, abstract weights. The dispatch
(difflet_tpu.collective_matmul) asks `ag_kernel_choice` / `rs_kernel_choice`
for every site's shapes as the step traces; this test records every answer. The
kernels' plans are chip-independent but for VMEM, 128 MiB on both v5e and v6e
(the default of `_common.vmem_capacity_bytes` off TPU), so one walk covers
both. A long sequence is allowed to take a streaming kernel (all-gather or
reduce-scatter) or several row-chunk calls; a fallback is not.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from difflet_tpu import bench, runtime
from difflet_tpu import pipeline as PL
from difflet_tpu.config import Config
from difflet_tpu import collective_matmul as cm
from difflet_tpu.mesh import make_mesh
from difflet_tpu.runner import Runner

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_difflet_estimates", _ROOT / "benchmark" / "estimates.py")
estimates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(estimates)

CASES = sorted(n for n, (_, _, modes) in estimates.CASES.items() if modes == "all" or "sp-pallas" in modes)


def _record(monkeypatch):
    """Every site's answer: ("ag", shapes, reason, choice) from the all-gather dispatch
    (`collective_matmul.ag_kernel_choice`: resident, stream or chunks) and ("rs", shapes,
    reason, choice) from the reduce-scatter's (`collective_matmul.rs_kernel_choice`)."""
    seen = []
    orig_ag = cm.ag_kernel_choice

    def ag(*a, **k):
        choice, reason = orig_ag(*a, **k)
        seen.append(("ag", repr(a[:2]), reason, choice))
        return choice, reason

    orig_rs = cm.rs_kernel_choice

    def rs(*a, **k):
        choice, reason = orig_rs(*a, **k)
        seen.append(("rs", repr(a[:2]), reason, choice))
        return choice, reason

    monkeypatch.setattr(cm, "ag_kernel_choice", ag)
    monkeypatch.setattr(cm, "rs_kernel_choice", rs)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_every_kernel_site_runs_the_kernel(name, monkeypatch):
    cmd = estimates.command(name, "v5e:2x2", "/nonexistent")
    ap = bench.parser()
    args = ap.parse_args(cmd[3:])
    spec, preset = PL.resolve_model(args.model[0])
    shape = bench.shape_for(spec, preset, args)
    cfg = bench.build_config(spec, preset)
    batch = 2 if name.endswith("_cfg") else 1  # the CFG cases' step is one batch-2 call
    mesh = make_mesh(4)
    seen = _record(monkeypatch)
    inputs = spec.example_inputs(cfg, **shape, batch=batch, seed=0, dtype=jnp.bfloat16)
    model = runtime.abstract_model(lambda: spec.build(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh, spec.plan)
    runner = Runner(model, mesh, Config(sp=True, sp_kernel="pallas", sp_rs_kernel="pallas"), mode="sp")
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) if isinstance(v, np.ndarray) else v
                for k, v in inputs.items()}
    runner.trace(**abstract)
    assert {k for k, *_ in seen} == {"ag", "rs"}, seen  # both kernels were asked
    bad = [s for s in seen if s[2] is not None]
    assert not bad, "\n".join(f"{k} {shapes}: {reason}" for k, shapes, reason, _ in bad)
    assert all(c in ("resident", "stream", "chunks") for *_, c in seen), seen
    print(name, {kind: sorted({c for k, *_, c in seen if k == kind}) for kind in ("ag", "rs")})
