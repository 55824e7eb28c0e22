"""No collective-matmul site falls back to the JAX ring at any benchmark shape.

Every case of benchmark/estimates.py (the results table's shapes and the long
videos of issue 14) is traced, not compiled, at its released model size on a
4-device `tp` ring with both Pallas kernels forced (`sp_kernel` and
`sp_rs_kernel` "pallas"), bf16, abstract weights: the tile sweep's walk
(`sweep_tiles.model_sites`), which records every kernel call the dispatch
(difflet_tpu.parallel.collective_matmul) makes; a site the kernels do not take would be
planned onto the ring with a notice (`site_plan._NOTICED`). The kernels' plans are
chip-independent but for VMEM, 128 MiB on both v5e and v6e (the default of
`_common.vmem_capacity_bytes` off TPU), so one walk covers both. A long
sequence takes several chunks a half; a fallback is not allowed.
"""

import importlib.util
import pathlib

import jax.numpy as jnp
import pytest

from difflet_tpu.bench import cases, cli
from difflet_tpu.tools import sweep_tiles
from difflet_tpu.parallel import site_plan
from difflet_tpu.pipeline import denoise as PL
from difflet_tpu.parallel.mesh import make_mesh

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_difflet_estimates", _ROOT / "benchmark" / "estimates.py")
estimates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(estimates)

CASES = sorted(n for n, (_, _, modes) in estimates.CASES.items() if modes == "all" or "sp-pallas" in modes)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_every_kernel_site_runs_the_kernel(name):
    cmd = estimates.command(name, "v5e:2x2", "/nonexistent")
    args = cli.parser().parse_args(cmd[3:])
    spec, preset = PL.resolve_model(args.model[0])
    shape = cases.shape_for(spec, preset, args)
    batch = 2 if name.endswith("_cfg") else 1  # the CFG cases' step is one batch-2 call
    site_plan._NOTICED.clear()
    # the sweep's walk: the SP step traced with both kernels forced, every kernel call recorded
    sites = sweep_tiles.model_sites(spec, preset, shape, batch, make_mesh(4), jnp.bfloat16)
    assert {site.kind for site, _ in sites} == {"ag", "rs"}, sites  # both kernels ran
    assert not site_plan._NOTICED, f"a site fell back to the ring: {sorted(site_plan._NOTICED)}"
    print(name, {kind: sum(site.kind == kind for site, _ in sites) for kind in ("ag", "rs")}, "sites")
