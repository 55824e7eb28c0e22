"""Test session set-up: 4 virtual CPU devices, the CPU platform only.

Deviceless TPU compiles run in subprocesses (difflet_tpu.tools.deviceless.run_python),
so their environment never reaches this process.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
for var in [v for v in os.environ if v.startswith("DIFFLET_TPU_")]:
    del os.environ[var]  # tests choose their modes explicitly
# ... except shard_map's varying-manual-axes check, on for every Config.from_env()
# (a Runner given no config, the bench): an output declared replicated that differs
# by rank fails to trace. tests/test_conformance.py passes Config(check_vma=True).
os.environ["DIFFLET_TPU_CHECK_VMA"] = "1"
# XLA:CPU's backend (LLVM) optimisation level 0 for the tests' programs: the same HLO, compiled
# about 30% faster (tests/models/test_ltx2.py: 67 -> 47 s). Subprocesses inherit it; the deviceless
# TPU compiles drop XLA_FLAGS (difflet_tpu/tools/deviceless.py).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

from difflet_tpu.parallel.mesh import use_cpu_devices  # noqa: E402

use_cpu_devices(4)

from difflet_tpu.testing import register_toy_port  # noqa: E402

register_toy_port()  # `--model toy:tiny` in the bench tests; Runner(ToyModel(...))


# ---- compiled programs: free them before the process runs out of memory maps ----------------
# XLA:CPU maps a few memory regions per compiled kernel (~750 for one tiny pipeline's programs),
# and the test modules keep their pipelines and Runners in lru_caches. A pytest-xdist worker that
# runs a few hundred pipeline cases crosses vm.max_map_count (65530 by default) and XLA's next
# compile dies with a segmentation fault or an abort. So after a module, once the process holds
# more than half the limit, every test module's lru_caches are dropped and JAX's caches cleared.

import functools  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

TESTS = str(Path(__file__).resolve().parent)


def _map_limit() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


def _maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to watch
        return 0


def free_compiled_programs() -> None:
    import jax

    for module in list(sys.modules.values()):
        if not (getattr(module, "__file__", None) or "").startswith(TESTS):
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, functools._lru_cache_wrapper):
                obj.cache_clear()
    gc.collect()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
    yield
    if _maps() > _map_limit() // 2:
        free_compiled_programs()
