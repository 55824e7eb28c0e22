"""`kernels/` and `models/` import only as difflet_tpu.kernels / difflet_tpu.models."""

import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

import difflet_tpu
import difflet_tpu.kernels
import difflet_tpu.models

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_mapped_packages_resolve_to_repo_folders():
    assert pathlib.Path(difflet_tpu.kernels.__file__).parent == ROOT / "kernels"
    assert pathlib.Path(difflet_tpu.models.__file__).parent == ROOT / "models"
    assert pathlib.Path(difflet_tpu.__file__).parent == ROOT / "difflet_tpu"


def test_no_top_level_kernels_or_models_from_this_repo():
    for name in ("kernels", "models"):
        mod = sys.modules.get(name)
        assert mod is None or ROOT not in pathlib.Path(getattr(mod, "__file__", "") or "/").parents


def test_no_source_file_imports_top_level_kernels_or_models():
    """Whether a stray `import models` shows in sys.modules depends on test order under xdist;
    reading the sources catches it every run."""
    pattern = re.compile(r"^\s*(from|import)\s+(kernels|models)(\.|\s|$)", re.M)
    bad = [str(p.relative_to(ROOT)) for folder in ("difflet_tpu", "kernels", "models", "tests", "benchmark")
           for p in (ROOT / folder).rglob("*.py") if pattern.search(p.read_text())]
    assert not bad, bad


def test_each_module_imported_once_in_a_fresh_process():
    code = f"""
import sys
import zipfile

import pytest
import difflet_tpu.kernels, difflet_tpu.models, difflet_tpu.parallel.collective_matmul, difflet_tpu.parallel.modes
mine = [n for n, m in sys.modules.items()
        if (getattr(m, '__file__', None) or '').startswith(('{ROOT}/kernels', '{ROOT}/models'))]
assert mine and all(n.startswith('difflet_tpu.') for n in mine), mine
assert 'kernels' not in sys.modules and 'models' not in sys.modules
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.slow
def test_plain_install_maps_kernels_and_models(tmp_path):
    """A non-editable install (wheel) ships kernels/ and models/ only under difflet_tpu."""
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    run = lambda *a: subprocess.run([sys.executable, "-m", "pip", *a], capture_output=True, text=True)
    out = run("wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = wheels.glob("*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"difflet_tpu", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    out = run("install", "-q", "--no-deps", "--target", str(target), str(wheel))
    assert out.returncode == 0, out.stderr[-2000:]
    code = ("import sys, difflet_tpu.kernels, difflet_tpu.models;"
            "print(difflet_tpu.kernels.__file__); print(difflet_tpu.models.__file__);"
            "assert 'kernels' not in sys.modules and 'models' not in sys.modules")
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env)
    assert out.returncode == 0, out.stderr
    k, m = out.stdout.split()
    assert k == str(target / "difflet_tpu" / "kernels" / "__init__.py")
    assert m == str(target / "difflet_tpu" / "models" / "__init__.py")
