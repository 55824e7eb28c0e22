"""`kernels/` and `models/` import only as difflet_tpu.kernels / difflet_tpu.models."""

import pathlib
import subprocess
import sys

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


def test_each_module_imported_once_in_a_fresh_process():
    code = f"""
import sys
import difflet_tpu.kernels, difflet_tpu.models, difflet_tpu.collective_matmul, difflet_tpu.parallel
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
