"""`python -m difflet_tpu.check` (CPU path, and the TPU path compiled deviceless) and the
estimate's calibration per kind of work (constants, `--from-check`, the README table)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from difflet_tpu.tools import calibration

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "DIFFLET_TPU_", "TPU_"))}


def test_check_cpu_quick_runs_to_completion_and_times_nothing(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "difflet_tpu.check", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["kind"] == "difflet-tpu check" and rep["passed"] and rep["timed"] is False
    assert "No TPU was found" in rep["note"] and "NOTHING WAS TIMED" in rep["note"]
    md = (tmp_path / "r.md").read_text()
    assert "NOTHING WAS TIMED" in md and "PASSED" in md
    rows = rep["ports"] + rep["sites"] + rep["streaming"]
    assert all(r.get("measured_ms") is None for r in rows)
    # wan's tiny preset, one device / TP / SP, against the shipped float64 reference
    assert [r["mode"] for r in rep["ports"]] == ["one device", "tp", "sp"]
    assert all(r["rel_err"] <= r["tol"] == 1e-4 for r in rep["ports"])
    # both kernels (interpret mode) against the plain collectives at two of Wan's sites
    kernels = [r for r in rep["sites"] if r["impl"] == "kernel"]
    assert len(kernels) == 2 and all(r["rel_err_vs_plain"] <= r["tol"] for r in kernels)
    assert {r["site"].split(" ")[0] for r in kernels} == {"all_gather_matmul", "matmul_reduce_scatter"}
    # the streaming kernels, exact, at the chunk counts asked for
    assert [(r["kind"], r["chunks"], r["max_abs_err"]) for r in rep["streaming"]] == [
        ("ag", 1, 0.0), ("ag", 3, 0.0), ("rs", 2, 0.0)]
    assert rep["steps_note"].startswith("no TPU")
    with pytest.raises(ValueError, match="no TPU was found, nothing was timed"):
        calibration.check_points(rep)


def test_check_refuses_bad_input_before_any_work(tmp_path):
    for argv, msg in [(["--only", "ports,nope"], "unknown section 'nope'"), (["--ports", "sd3"], "unknown port 'sd3'"),
                      (["--iters", "0"], "--iters 0: must be >= 1"), (["--topology", "v5e:2x2"], "go together"),
                      (["--json", str(tmp_path / "no" / "r.json")], "does not exist")]:
        proc = subprocess.run([sys.executable, "-m", "difflet_tpu.check", *argv], capture_output=True, text=True,
                              timeout=120, env=_env())
        assert proc.returncode == 2 and msg in proc.stderr, (argv, proc.stderr[-2000:])


def test_a_wrong_kernel_and_a_wrong_port_fail_their_rows(monkeypatch):
    import jax

    from difflet_tpu.check import numerics, sites
    from difflet_tpu.kernels import matmul_reduce_scatter_stream as rss
    from difflet_tpu.kernels import tiles as kernel_tiles
    from difflet_tpu.parallel.mesh import make_mesh

    mesh = make_mesh(devices=jax.devices()[:4], tp=4)
    site = sites.shrink(kernel_tiles.Site("rs", [(1, 4736, 1280)], [(1280, 5120)], "bfloat16", 4))
    assert all("error" not in r for r in sites.check_site(site, mesh, mode="cpu"))
    real = rss.matmul_reduce_scatter_stream
    monkeypatch.setattr(rss, "matmul_reduce_scatter_stream", lambda *a, **k: real(*a, **k) * 1.1)
    rows = {r["impl"]: r for r in sites.check_site(site, mesh, mode="cpu")}
    assert "differs from the plain collectives" in rows["kernel"]["error"]
    assert "error" not in rows["ring"]
    ref = numerics.read_reference("wan", "float32")
    monkeypatch.setattr(numerics, "read_reference", lambda name, dtype: [r * 1.001 for r in ref])
    (row,) = numerics.check_port("wan", None, ("float32",), ("one device",), log=lambda s: None)
    assert "against float64" in row["error"]


def _breakdown(rng):
    b = dict(matmul_ms=rng.uniform(1, 100), nonmatmul_ms=rng.uniform(1, 50), other_ms=rng.uniform(0, 5),
             sync_collective_ms=rng.uniform(0, 40), exposed_transfer_ms=rng.uniform(0, 20),
             pallas_ms=rng.uniform(0, 60), exposed_dma_ms=rng.uniform(0, 1))
    return b


def test_from_check_refits_a_synthetic_report(tmp_path):
    truth = calibration.Factors(matmul=0.8, nonmatmul=0.6, transfer=1.3, pallas=1.15)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(12):
        b = _breakdown(rng)
        t = calibration.terms(b)  # measured = the true factors' price, computed independently
        meas = 0.8 * t["matmul"] + 0.6 * t["nonmatmul"] + 1.3 * t["transfer"] + 1.15 * t["pallas"] + t["fixed"]
        rows.append(dict(what="step" if i % 2 else "site", name=f"p{i}", impl=("tp", "kernel")[i % 2 == 0],
                         measured_ms=meas, breakdown_raw=b))
    rows.append(dict(what="site", name="failed", impl="ring", measured_ms=1.0, breakdown_raw=_breakdown(rng),
                     error="differs"))  # failed rows are not fit
    report = dict(kind="difflet-tpu check", platform="tpu", chip=dict(name="v5e"),
                  sites=[r for r in rows if r["what"] == "site"], steps=[r for r in rows if r["what"] == "step"])
    f = calibration.fit(calibration.check_points(report))
    assert f.as_dict() == pytest.approx(truth.as_dict(), abs=1e-3)
    assert max(abs(x) for x in f.band) < 1e-3
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    proc = subprocess.run([sys.executable, "-m", "difflet_tpu.tools.calibration", "--from-check", str(path)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Factors(matmul=0.8, nonmatmul=0.6, transfer=1.3, pallas=1.15" in proc.stdout
    path.write_text(json.dumps(dict(kind="bench")))
    proc = subprocess.run([sys.executable, "-m", "difflet_tpu.tools.calibration", "--from-check", str(path)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and "not a `python -m difflet_tpu.check` report" in proc.stderr


def test_calibration_constants_are_the_fit_of_the_committed_results():
    pts = calibration.load_reference_points(str(ROOT / "benchmark" / "results"))
    kinds = {p.kind for p in pts if p.fit}
    assert kinds == {"tp step", "ring sp step", "kernel sp step", "op ring", "op kernel"}
    assert sum(p.fit for p in pts) == 18 and len(pts) == 20
    f = calibration.fit(pts)
    c = calibration.CALIBRATION["v5e"]
    assert f.as_dict() == c.as_dict() and f.band == c.band
    # every residual is inside the band the README quotes
    assert all(c.band[0] - 1e-3 <= calibration.residual(p, c) <= c.band[1] + 1e-3 for p in pts if p.fit)


def _expected(b, c):
    """The calibrated step from a raw breakdown, written out (the reference for `expected_ms`)."""
    return (c.matmul * b["matmul_ms"] + c.nonmatmul * (b["nonmatmul_ms"] + b["other_ms"])
            + c.transfer * (b["sync_collective_ms"] + b["exposed_transfer_ms"]) + c.pallas * b["pallas_ms"]
            + b["exposed_dma_ms"])


def _mesh_raw(name, mode):
    mesh = json.loads((ROOT / f"benchmark/results/meshes/{name}.json").read_text())
    return next(r for r in mesh["results"] if r["mode"] == mode)["breakdown_raw"]


def test_readme_table_comes_from_the_constants():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "estimates.py"), "readme", "--check"],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    wan = {r["mode"]: r for r in json.loads((ROOT / "benchmark/results/wan.json").read_text())["results"]}
    c = calibration.CALIBRATION["v5e"]
    tp = _expected(wan["tp"]["breakdown_raw"], c)
    line = next(l for l in (ROOT / "README.md").read_text().splitlines() if l.startswith("| Wan2.1-14B 480x832x9 |"))
    assert line.split("|")[2].strip() == f"{tp:.0f}"
    # the bigger-slices paragraph: the v5e-8 cfg=2,tp=4 plan re-priced from its raw replay by the same constants
    v5e8 = _expected(_mesh_raw("wan9_v5e2x4_cfg2tp4", "sp-pallas"), c)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Wan2.1-14B 480x832x9 with CFG is {v5e8:.0f} ms per step on a v5e-8 as `cfg=2,tp=4`" in readme
    assert "fitted band -21% .. +14%" in readme


def test_benchmarks_doc_tables_come_from_the_constants():
    for script in ("estimates.py", "meshes.py"):  # the results table, the bigger-slices tables
        proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / script), "table", "--check"],
                              capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = doc.split("<!-- bigger slices tables: python benchmark/meshes.py table -->")[1].split(
        "<!-- end of bigger slices tables -->")[0]
    rows = {tuple(x.strip() for x in l.split("|")[1:6]): l.split("|") for l in block.splitlines()
            if l.startswith("| v") and l.count("|") == 14}
    assert len(rows) == 22
    # v5e: the raw replay priced with today's per-kind factors; v6e (no fitted factors): the raw replay
    c = calibration.CALIBRATION["v5e"]
    v5e4 = _expected(_mesh_raw("wan9_v5e2x2_cfgb2", "sp-pallas"), c)
    v5e8 = _expected(_mesh_raw("wan9_v5e2x4_cfg2tp4", "sp-pallas"), c)
    row = rows[("v5e:2x2", "wan:Wan2.1-T2V-14B (480x832x9)", "2", "`tp=4`", "sp-pallas")]
    assert row[7].strip() == f"{v5e4:.1f}" and row[8].strip() == "per-kind fit"
    assert "v6e" not in calibration.CALIBRATION
    row = rows[("v6e:2x2", "wan:Wan2.1-T2V-14B (480x832x9)", "2", "`tp=4`", "sp-pallas")]
    assert row[7].strip() == f"{_mesh_raw('wan9_v6e2x2_tp4', 'sp-pallas')['step_ms']:.1f}"
    assert row[8].strip() == "uncalibrated (raw)"
    assert f"**{v5e8 / v5e4:.3f}x**" in " ".join(block.split())
    assert "still carries the old single factor" not in doc


def test_site_cases_are_the_benchmark_cases():
    sys.path.insert(0, str(ROOT / "benchmark"))
    try:
        import estimates
    finally:
        sys.path.pop(0)
    from difflet_tpu.check.__main__ import SITE_CASES

    assert list(SITE_CASES) == list(estimates.CASES)
    for name, (model, flags, _) in estimates.CASES.items():
        m, shape, guidance = SITE_CASES[name]
        f = dict(zip(flags[::2], flags[1::2]))
        assert m == model and shape["height"] == int(f["--height"]) and shape["width"] == int(f["--width"])
        assert shape["frames"] == int(f.get("--frames", 1)) and guidance == (1.0 if "--guidance" in f else guidance)
        assert (guidance == 1.0) == ("--guidance" in f)


@pytest.mark.slow
def test_check_tpu_path_compiles_deviceless_for_v5e(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "difflet_tpu.check", "--compile-only", "--topology", "v5e:2x2",
                           "--only", "streaming,sites,steps", "--cases", "wan", "--json", str(out)],
                          capture_output=True, text=True, timeout=3600, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["platform"] == "deviceless" and rep["timed"] is False and rep["passed"]
    assert len(rep["streaming"]) == 6 and {r["chunks"] for r in rep["streaming"]} == {1, 2, 3}
    kernels = [r for r in rep["sites"] if r["impl"] == "kernel"]
    # Wan 480x832x9 (the lightest compile: LTX-2's took twice as long): its 3 collective-matmul sites
    assert len(kernels) >= 3 and all(r["breakdown_raw"]["kernel_sites"] for r in kernels)
    assert {r["impl"] for r in rep["steps"]} == {"tp", "sp", "sp-pallas"}
    assert all(r["estimate_raw_ms"] > 0 and r["measured_ms"] is None for r in rep["steps"] + rep["sites"])
