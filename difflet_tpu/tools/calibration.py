"""The estimate's calibration: fitted factors and the reference PR's measured step times.

Every figure the bench, the README and docs/benchmarks.md call "calibrated"
uses the constants here, and only these.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Calibration:
    """At most one fitted factor: scales the compiler's cycle estimate of
    non-matmul fusions (`COST_MODEL_TYPE_INVALID`). 1.0 = uncalibrated."""

    nonmatmul: float = 1.0
    source: str = "uncalibrated"


# The fitted factor per chip (see docs/benchmarks.md for the fit and its residuals):
# `python benchmark/estimates.py table` fits it on the reference PR's four TP rows.
CALIBRATION: dict = {
    "v5e": Calibration(nonmatmul=0.739, source="least squares on the reference PR's v5e-4 TP rows "
                       "(Wan, FLUX, HunyuanVideo, LTX-2), the ports compiled in benchmark/results"),
}

# Measured v5e-4 step times of the reference PR (ms per denoise step, batch 1):
# family -> (shape, TP, SP with JAX rings, SP with the PR's defaults). HunyuanVideo's
# ring column is the PR's dual-stream-only SP (its single-stream ring SP: 500.7).
# The PR's own LTX-2 default was its ring. Calibration fits on the TP column only.
REFERENCE_PR = {
    "wan": ("480x832x9", 360.7, 292.4, 249.2),
    "flux": ("1024x1024", 175.2, 156.5, 140.6),
    "hunyuan_video": ("320x512x61", 549.9, 516.1, 478.0),
    "ltx2": ("480x704x49", 218.0, 192.1, 192.1),
}


def fit_nonmatmul_scale(rows: Iterable[tuple], chip=None) -> float:
    """The one factor `k` on the time of ops the compiler prices with its
    non-matmul cost model (`Estimate.invalid`) that makes `total - (1 - k) *
    invalid` match measured step times (least squares over `(estimate at
    k=1, measured seconds)` rows), clipped to [0.2, 1.5].

    Exposed waits can change when non-matmul time shrinks; the fit treats
    them as fixed, which is exact for TP (synchronous all-reduces) — the rows
    it is meant to be fit on.
    """
    rows = list(rows)
    # measured = (total - invalid) + k * invalid
    num = sum(e.invalid * (meas - (e.total - e.invalid)) for e, meas in rows)
    den = sum(e.invalid ** 2 for e, _ in rows)
    if den == 0:
        return 1.0
    return float(min(1.5, max(0.2, num / den)))
