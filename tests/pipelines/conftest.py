"""Fixtures shared by the pipeline tests."""

import pytest

from difflet_tpu.pipeline import placement


@pytest.fixture
def decided_peaks(monkeypatch):
    """The peaks (stage -> bytes per chip) every `placement.decide` call of the test was given,
    the decisions themselves unchanged."""
    need, real = {}, placement.decide

    def spy(setting, peaks, *a):
        need.update(peaks)
        return real(setting, peaks, *a)

    monkeypatch.setattr(placement, "decide", spy)
    return need
