"""Per-chip constants of the TPU generations the planner and the estimator know.

The runtime reads them to choose a site's implementation (`Parallel`: is a
ring's hop bound by ICI or by the MXU?); the estimator (difflet_tpu.tools.estimate)
prices compiled schedules with the same numbers. Sources: Google Cloud's TPU
v5e and v6e system architecture pages (peak bf16 FLOP/s, HBM capacity and
bandwidth, ICI bandwidth), as tabled in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip constants of the machine model (sources: docs/benchmarks.md)."""

    name: str
    clock_hz: float         # TensorCore clock: estimated_cycles -> seconds
    bf16_flops: float       # peak bf16 FLOP/s per chip
    hbm_bw: float           # HBM bytes/s
    hbm_bytes: int          # HBM capacity
    ici_link_bw: float      # bytes/s one way per ICI link
    ici_latency: float      # seconds per hop / ring step

    def to_dict(self):
        return dataclasses.asdict(self)


CHIPS = {
    "v5e": Chip("v5e", clock_hz=1.5e9, bf16_flops=197e12, hbm_bw=819e9, hbm_bytes=16 * 2**30,
                ici_link_bw=45e9, ici_latency=1e-6),
    "v6e": Chip("v6e", clock_hz=1.75e9, bf16_flops=918e12, hbm_bw=1640e9, hbm_bytes=32 * 2**30,
                ici_link_bw=90e9, ici_latency=1e-6),
}


# jax `Device.device_kind` -> CHIPS key (real and deviceless topology devices report the same)
DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def chip_for_device(device) -> Chip | None:
    """The constants of `device`'s chip, or None for a device this model has none for (CPU, other TPUs)."""
    gen = DEVICE_KINDS.get(getattr(device, "device_kind", ""))
    return None if gen is None else CHIPS[gen]
