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

from difflet_tpu.parallel.mesh import use_cpu_devices  # noqa: E402

use_cpu_devices(4)

from difflet_tpu.testing import register_toy_port  # noqa: E402

register_toy_port()  # `--model toy:tiny` in the bench tests; Runner(ToyModel(...))
