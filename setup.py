"""Package layout only; metadata lives in pyproject.toml.

`kernels/` and `models/` are top-level folders of the repo but install only as
`difflet_tpu.kernels` and `difflet_tpu.models`: PyPI has unrelated top-level
packages named `kernels` (transformers probes for it at import time) and
`models`, so ours must never be importable under those names.
"""
from setuptools import find_packages, setup

MAPPED = {"difflet_tpu.kernels": "kernels", "difflet_tpu.models": "models"}

packages = find_packages(include=["difflet_tpu", "difflet_tpu.*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{p}" for p in find_packages(folder)]

# the check's float64 references of the ports' tiny presets (difflet_tpu/check/numerics.py)
setup(packages=packages, package_dir=MAPPED, package_data={"difflet_tpu.check": ["references/*.npz"]})
