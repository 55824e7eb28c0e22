"""Compiling for a real TPU topology on a machine without one.

With libtpu installed, `jax.experimental.topologies.get_topology_desc`
returns the devices of a TPU slice that does not exist here; a mesh on them
and `jax.jit(f).trace(abstract inputs).lower().compile()` run the real TPU
compiler (Mosaic included). Abstract inputs use no memory, so released model
sizes compile on a laptop. libtpu must see `TPU_ACCELERATOR_TYPE` and
`TPU_WORKER_HOSTNAMES` before jax initialises, so this runs in a process of
its own: `run_python` starts one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

# topology name -> TPU_ACCELERATOR_TYPE libtpu expects
_GENERATION = {"v5e": "v5litepod-{n}", "v6e": "v6e-{n}", "v5p": "v5p-{n2}", "v4": "v4-{n2}"}


from difflet_tpu.runtime import memory_report  # noqa: E402,F401 (re-exported for the tools)


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
    """"v5e:2x2" -> ("v5e", (2, 2))."""
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)*)", topology)
    if not m:
        raise ValueError(f"topology {topology!r} is not of the form v5e:2x2")
    return m.group(1), tuple(int(d) for d in m.group(2).split("x"))


def accelerator_type(topology: str) -> str:
    """The TPU_ACCELERATOR_TYPE libtpu expects for a topology ("v5e:2x2" -> "v5litepod-4")."""
    gen, dims = parse_topology(topology)
    if gen not in _GENERATION:
        raise ValueError(f"unknown TPU generation {gen!r}; known: {sorted(_GENERATION)}")
    n = 1
    for d in dims:
        n *= d
    return _GENERATION[gen].format(n=n, n2=2 * n)


def tpu_env(topology: str = "v5e:2x2", base=None) -> dict:
    """Environment for a deviceless-compile process."""
    env = dict(os.environ if base is None else base)
    env["TPU_ACCELERATOR_TYPE"] = accelerator_type(topology)
    env["TPU_WORKER_HOSTNAMES"] = "localhost"
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    # libtpu takes a machine-wide lock; deviceless compiles never touch a chip,
    # so two of them (a test and a bench, say) may run side by side.
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env.setdefault("TPU_STDERR_LOG_LEVEL", "3")
    env.setdefault("TPU_MIN_LOG_LEVEL", "3")
    return env


def setup_process(topology: str = "v5e:2x2") -> None:
    """Sets this process up for deviceless compilation; call before importing jax."""
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise RuntimeError("deviceless compilation must be set up before jax initialises; "
                               "use difflet_tpu.tools.deviceless.run_python from a process that already did")
    os.environ.update({k: v for k, v in tpu_env(topology).items()
                       if k.startswith("TPU_")})
    os.environ.pop("JAX_PLATFORMS", None)
    os.environ.pop("XLA_FLAGS", None)


def topology_devices(topology: str = "v5e:2x2"):
    """The (deviceless) devices of a TPU topology; call in a process set up by `setup_process`."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology, "tpu").devices


def compile_target(topology: str):
    """What a compile-only command sets up first, in this process (before jax initialises):
    the TPU environment of `topology`, then (devices, chip, calibration): its deviceless
    devices, its chip (`estimate.chip_for`) and that chip's calibration factors. A
    ValueError naming the topology when libtpu does not accept it."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other deviceless compiles on this machine
    setup_process(topology)
    import jax  # noqa: F401  (after the TPU environment is set)

    from difflet_tpu.tools import estimate as E
    from difflet_tpu.tools.calibration import CALIBRATION, Factors

    chip = E.chip_for(topology)
    calibration = CALIBRATION.get(chip.name, Factors())
    try:
        devices = topology_devices(topology)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--topology {topology}: libtpu did not accept it ({type(e).__name__}: {e})") from None
    return devices, chip, calibration


def topology_mesh(topology: str = "v5e:2x2", tp: int | None = None, *, cfg: int = 1, data: int = 1):
    """A (`cfg`, `data`,) `tp` mesh on the devices of a TPU topology, each `tp` ring in ICI order."""
    from difflet_tpu.parallel.mesh import make_mesh

    return make_mesh(tp, topology_devices(topology), cfg=cfg, data=data)


def run_python(code: str, topology: str = "v5e:2x2", timeout: float = 1800) -> dict:
    """Runs `code` in a fresh deviceless-TPU Python process; it must print one
    JSON object on its last stdout line, which is returned."""
    proc = subprocess.run([sys.executable, "-c", code], env=tpu_env(topology), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"deviceless process failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    if not lines:
        raise RuntimeError(f"deviceless process printed nothing:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])
