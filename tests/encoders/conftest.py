"""Shared fixtures of the text-encoder tests (tests/fixtures/encoders/, made by its generate.py)."""

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "encoders"


@pytest.fixture
def fixture_dir():
    """`fixture_dir(case)` -> the folder tests/fixtures/encoders/<case>."""
    return lambda case: FIXTURES / case


@pytest.fixture
def io():
    """`io(case)` -> the case's io.npz as a dict of arrays."""
    return lambda case: dict(np.load(FIXTURES / case / "io.npz"))


@pytest.fixture
def mesh4():
    """A 1-D mesh of the 4 CPU devices (tests/conftest.py), axis "tp"."""
    return Mesh(np.array(jax.devices()[:4]), ("tp",))


@pytest.fixture
def compare():
    """`compare(got, ref, rel=..., abs=...)`: asserts max |got - ref| and the relative L2 error
    ||got - ref|| / ||ref||, float64; returns both for the report."""

    def check(got, ref, *, rel=2e-6, abs=2e-5, what=""):
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
        max_abs = float(np.abs(got - ref).max())
        rel_l2 = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        assert rel_l2 <= rel and max_abs <= abs, f"{what}: max abs {max_abs:.3e}, rel L2 {rel_l2:.3e}"
        return max_abs, rel_l2

    return check
