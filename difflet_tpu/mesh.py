"""Device meshes whose ring order follows the physical ICI links.

The sequence-parallel rings send each chunk to ring neighbours
(`axis_index +- 1`), so neighbours in the mesh must be neighbours on the chip
interconnect. On a v5e 2x2 (no wraparound links), `jax.make_mesh` orders a
4-ring as devices 0,1,3,2, every hop a direct link; `np.array(devices)` gives
0,1,2,3, whose hops 1->2 and 3->0 are diagonal (two ICI hops on shared links).
"""

from __future__ import annotations

import os
import sys

TP = "tp"  # the tensor/sequence-parallel axis; `cfg` and `dp` axes may join it later


def make_mesh(tp: int | None = None, devices=None):
    """A 1-D mesh with axis `tp` over `tp` devices (all of them by default).

    Devices are ordered by `jax.make_mesh`, which follows the physical
    topology on TPU, so axis neighbours are ICI neighbours.
    """
    import jax

    devices = list(jax.devices() if devices is None else devices)
    tp = len(devices) if tp is None else tp
    if tp < 1 or tp > len(devices):
        raise ValueError(f"make_mesh: tp={tp} but {len(devices)} devices are available")
    return jax.make_mesh((tp,), (TP,), devices=devices[:tp],
                         axis_types=(jax.sharding.AxisType.Auto,))


def ring_order(mesh) -> list[int]:
    """Device ids in the order of the mesh's `tp` axis (the ring order)."""
    return [d.id for d in mesh.devices.reshape(-1)]


def use_cpu_devices(n: int) -> None:
    """Makes `n` virtual CPU devices available, for tests and the CPU bench.

    Call before jax creates its backends. Sets the CPU platform only when no
    platform was chosen (a machine with libtpu installed would otherwise try to
    open a TPU). Raises if jax already runs with fewer devices.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "jax" in sys.modules:
        import jax
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            have = jax.device_count()
            if have < n:
                raise RuntimeError(
                    f"jax was initialised with {have} devices before use_cpu_devices({n}); "
                    f"call it before any jax computation, or set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax")
            return
        jax.config.update("jax_num_cpu_devices", n)
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
