"""`python -m difflet_tpu.generate` on the fixture pipeline folders: a PNG whose pixels are the
pipeline's (seeded) image, the timings file; bad input refused with a nonzero exit and no file."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from difflet_tpu import generate
from difflet_tpu.pipeline.diffusion import DiffusionPipeline

import jax

jax.devices()  # the session's 4 CPU devices exist before main() runs in this process
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
SCHNELL = str(FIXTURES / "flux_schnell")


def test_writes_the_pipelines_image_and_timings(tmp_path, capsys):
    out, timings = tmp_path / "cat.png", tmp_path / "t.json"
    argv = [SCHNELL, "--prompt", "a photo of a cat", "--height", "32", "--width", "48", "--steps", "2",
            "--seed", "3", "--out", str(out), "--json", str(timings)]
    assert generate.main(argv) == 0
    err = capsys.readouterr().err
    assert "denoise step 2/2" in err and "decode" in err and f"wrote {out}" in err
    png = np.asarray(Image.open(out))
    assert png.shape == (32, 48, 3) and png.dtype == np.uint8
    # the same call in-process (float32 on CPU, seed 3): the PNG holds round(255 x) of its image
    pipe = DiffusionPipeline.from_pretrained(SCHNELL, dtype=jnp.float32)
    want = pipe(prompt="a photo of a cat", height=32, width=48, num_inference_steps=2, seed=3, output_type="np")
    assert np.abs(png.astype(int) - (want.images[0] * 255).round()).max() <= 1
    report = json.loads(timings.read_text())
    assert report["pipeline"] == "FluxPipeline" and report["devices"] == 1 and report["image_shape"] == [1, 32, 48, 3]
    assert len(report["denoise_steps_s"]) == 2 and all(t > 0 for t in report["denoise_steps_s"])
    for k in ("tokenize_s", "encode_s", "decode_s", "load_s", "peak_device_memory_bytes"):
        assert k in report
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_batch_writes_one_file_per_image(tmp_path):
    out = tmp_path / "img.png"
    assert generate.main([SCHNELL, "--prompt", "a cat", "--height", "32", "--width", "32", "--steps", "1",
                          "--batch", "2", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img-0.png", "img-1.png"]


def _no_model_index(tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(FIXTURES / "flux_schnell", d)
    (d / "model_index.json").unlink()
    return str(d)


@pytest.mark.parametrize("case,match", [
    ("empty_prompt", "prompt` is empty"),
    ("height_30", "--height 30: must be a positive multiple of 16"),
    ("unwritable_out", "does not exist"),
    ("no_model_index", "no model_index.json"),
    ("not_png", "must be a .png"),
    ("nan_guidance", "--guidance nan: must be a finite real number"),
])
def test_bad_input_refused(tmp_path, capsys, case, match):
    out = tmp_path / "x.png"
    argv = {"empty_prompt": [SCHNELL, "--prompt", ""],
            "height_30": [SCHNELL, "--prompt", "a cat", "--height", "30"],
            "unwritable_out": [SCHNELL, "--prompt", "a cat"],
            "no_model_index": [_no_model_index(tmp_path), "--prompt", "a cat"],
            "not_png": [SCHNELL, "--prompt", "a cat"],
            "nan_guidance": [SCHNELL, "--prompt", "a cat", "--guidance", "nan"]}[case]
    target = {"unwritable_out": tmp_path / "missing" / "x.png", "not_png": tmp_path / "x.jpg"}.get(case, out)
    before = set(tmp_path.rglob("*"))
    assert generate.main(argv + ["--out", str(target), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert re.search(f"error: .*{match}", err), err
    assert not target.exists() and set(tmp_path.rglob("*")) == before


def test_read_only_folder_refused(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        assert generate.main([SCHNELL, "--prompt", "a cat", "--out", str(d / "x.png")]) == 1
        assert "not writable" in capsys.readouterr().err and not (d / "x.png").exists()
    finally:
        d.chmod(0o700)


def test_failure_during_the_work_leaves_no_file(tmp_path, capsys, monkeypatch):
    """A non-finite image (here: a VAE that returns NaN) is an error, and nothing is written."""
    from difflet_tpu.pipeline import diffusion as D

    real = D.load_vae

    def nan_vae(folder, *, dtype, mesh):
        vae = real(folder, dtype=dtype, mesh=mesh)
        monkeypatch.setattr(vae, "decode", lambda z: jnp.full((z.shape[0], 3, 32, 32), jnp.nan), raising=False)
        return vae

    monkeypatch.setattr(D, "load_vae", nan_vae)
    out = tmp_path / "x.png"
    assert generate.main([SCHNELL, "--prompt", "a cat", "--height", "32", "--width", "32", "--steps", "1",
                          "--out", str(out)]) == 1
    assert "non-finite" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        generate.main([SCHNELL, "--out", "x.png"])  # no --prompt
    assert e.value.code == 2


def test_a_first_run_shows_only_the_projects_lines(tmp_path):
    """A fresh process on a machine without a TPU (JAX_PLATFORMS and TRANSFORMERS_VERBOSITY unset):
    stderr holds only generate's own lines, not libtpu's TPU_WORKER_HOSTNAMES error or
    transformers' "PyTorch was not found"."""
    import subprocess
    import sys

    if generate.has_tpu():
        pytest.skip("a TPU machine runs on the TPU")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TRANSFORMERS_VERBOSITY", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "difflet_tpu.generate", SCHNELL, "--prompt", "a cat", "--height", "32",
                           "--width", "32", "--steps", "1", "--out", str(tmp_path / "x.png")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("[generate] ") for line in lines), proc.stderr[-3000:]
