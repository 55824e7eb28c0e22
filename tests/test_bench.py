"""`python -m difflet_tpu.bench`: tiny presets in every mode, the JSON report,
SP vs TP parity in float32, bad flags, and --compile-only on a small config."""

import json
import os
import subprocess
import sys

import pytest

from difflet_tpu import models
from difflet_tpu.bench import cases, cli, run

ROW_FIELDS = ("model", "mode", "load_s", "compile_s", "step_ms", "denoise_s", "peak_memory_bytes", "sha256",
              "compilations_timed", "steps", "shape", "dtype")


def _run(tmp_path, *argv):
    out = tmp_path / "r.json"
    rc = cli.main([*argv, "--json", str(out)])
    return rc, json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))


def _check_rows(data, modes):
    rows = data["results"]
    assert [r["mode"] for r in rows] == modes
    for r in rows:
        assert "error" not in r, r
        for f in ROW_FIELDS:
            assert f in r, (f, r)
        assert set(r["step_ms"]) == {"median", "min", "max"}
        assert r["step_ms"]["min"] <= r["step_ms"]["median"] <= r["step_ms"]["max"]
        assert len(r["sha256"]) == 64
        assert r["compilations_timed"] == 0, "a timed step recompiled"
    tp = rows[0]
    for r in rows[1:]:
        v = r["vs_tp"]
        assert v["rel_l2"] < 1e-5, (r["mode"], v)
        assert float(v["psnr_db"]) > 80  # "inf" (a string in the JSON) when the latents are identical
        assert v["step_ratio"] == pytest.approx(r["step_ms"]["median"] / tp["step_ms"]["median"])
    return rows


def test_toy_every_mode_json_and_parity(tmp_path, capsys):
    rc, data = _run(tmp_path, "--model", "toy:tiny", "--mode", "all", "--steps", "2")
    assert rc == 0
    _check_rows(data, ["tp", "sp", "sp-xla"])
    assert data["kernel_tiles"] is None  # no column-tile table steered the kernels
    out = capsys.readouterr()
    assert "SP/TP" in out.out and "toy:tiny" in out.out
    assert "2/2" in out.err  # the progress bar


@pytest.mark.slow
@pytest.mark.parametrize("family", models.PORTS)
def test_port_tiny_presets_every_mode(tmp_path, family):
    rc, data = _run(tmp_path, "--model", f"{family}:tiny", "--mode", "all", "--steps", "2")
    assert rc == 0
    rows = _check_rows(data, ["tp", "sp", "sp-xla"])
    assert rows[0]["cfg_batch2"] == (models.spec(family).pipeline.guidance_mode == "cfg")


def test_mode_default_follows_DIFFLET_TPU_SP(monkeypatch):
    monkeypatch.delenv("DIFFLET_TPU_SP", raising=False)
    assert cli.parse_modes(None) == ["tp", "sp"]
    monkeypatch.setenv("DIFFLET_TPU_SP", "1")
    assert cli.parse_modes(None) == ["sp"]
    monkeypatch.setenv("DIFFLET_TPU_SP", "0")
    assert cli.parse_modes(None) == ["tp"]
    assert cli.parse_modes("all") == ["tp", "sp", "sp-xla"]
    assert cli.parse_modes("sp,tp") == ["sp", "tp"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--warmup", "0"], "--warmup must be >= 1"),
    (["--mode", "ring"], "unknown mode 'ring'"),
    (["--compile-only"], "--compile-only needs --topology"),
    (["--topology", "v5e:2x2"], "--topology only applies to --compile-only"),
    (["--compile-only", "--topology", "v5e:2x2", "--weights", "."], "cannot be combined with --compile-only"),
    (["--weights", "/nonexistent/dir"], "not a directory"),
    (["--embeddings", "/nonexistent.npz"], "no such file"),
    (["--height", "-8"], "--height must be positive"),
    (["--dtype", "float16"], "invalid choice"),
    (["--mode", "sp-pallas"], "compile-only variant"),
    (["--mesh", "pp=2,tp=2"], "unknown axis 'pp'"),
    (["--mesh", "cfg=2,tp=x"], "not AXIS=SIZE"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--coordinator", "127.0.0.1:1234"], "go together"),
    (["--compile-only", "--topology", "v5e:2x2", "--distributed"], "no --distributed"),
    (["--cpu-devices", "0"], "--cpu-devices must be >= 1"),
])
def test_bad_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_mesh_choice():
    wan, flux = models.spec("wan"), models.spec("flux")
    wcfg = cases.build_config(wan, wan.released)
    fcfg = cases.build_config(flux, flux.released)
    assert cases.mesh_axes_for(wan, wcfg, 16, 2, None, True) == dict(cfg=2, data=1, tp=8)  # 40 heads: no 16-ring
    assert cases.mesh_axes_for(wan, wcfg, 8, 2, None, True) == dict(cfg=1, data=1, tp=8)   # one ring over all
    assert cases.mesh_axes_for(wan, wcfg, 8, 2, {"cfg": 2}, True) == dict(cfg=2, data=1, tp=4)
    assert cases.mesh_axes_for(flux, fcfg, 16, 1, None) == dict(cfg=1, data=1, tp=8)
    assert cases.mesh_axes_for(flux, fcfg, 16, 2, None) == dict(cfg=1, data=2, tp=8)
    assert cases.mesh_axes_for(wan, wcfg, 16, 4, {"cfg": 2, "data": 2, "tp": 4}, True) == dict(cfg=2, data=2, tp=4)
    with pytest.raises(cases.BenchError, match="do not divide over tp=16"):
        cases.mesh_axes_for(wan, wcfg, 16, 2, {"tp": 16}, True)
    with pytest.raises(cases.BenchError, match="do not split over cfg x data = 4"):
        cases.mesh_axes_for(wan, wcfg, 16, 2, {"cfg": 2, "data": 2}, True)
    with pytest.raises(cases.BenchError, match="no CFG batch"):
        cases.mesh_axes_for(flux, fcfg, 8, 2, {"cfg": 2})


def test_cfg_mesh_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFLET_TPU_MESH", "cfg=2,tp=2")
    rc, data = _run(tmp_path, "--model", "wan:tiny", "--mode", "tp,sp", "--steps", "2")
    assert rc == 0
    rows = _check_rows(data, ["tp", "sp"])
    assert all(r["mesh"] == "cfg=2,tp=2" and r["cfg_batch2"] and r["sha256_agree"] for r in rows)
    assert data["processes"] == 1
    rc, data = _run(tmp_path, "--model", "wan:tiny", "--mode", "tp", "--steps", "2", "--mesh", "tp=3")
    assert rc == 2


def test_unknown_model_and_impossible_shape(capsys):
    assert cli.main(["--model", "sdxl"]) == 2
    assert "unknown model 'sdxl'" in capsys.readouterr().err
    assert cli.main(["--model", "toy:huge"]) == 2
    assert "no preset 'huge'" in capsys.readouterr().err
    assert cli.main(["--model", "flux:tiny", "--frames", "9"]) == 2
    assert "--frames must be 1" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_only_on_a_small_config(tmp_path):
    out = tmp_path / "co.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "DIFFLET_TPU_"))}
    argv = ["--compile-only", "--topology", "v5e:2x2", "--model", "toy:toy-small", "--mode", "tp,sp,sp-xla",
            "--json", str(out)]
    script = ("import sys; from difflet_tpu import testing; from difflet_tpu.bench import cli; testing.register_toy_port(); "
              f"sys.exit(cli.main({argv!r}))")
    proc = subprocess.run([sys.executable, "-c", script],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["kind"] == "compile-only" and "estimate" in data["note"]
    rows = {r["mode"]: r for r in data["results"]}
    assert set(rows) == {"tp", "sp", "sp-xla"}
    for r in rows.values():
        assert r["hbm"]["fits"] and r["hbm"]["total"] > 0
        assert r["flops"]["xla_per_chip"] > 0 and r["flops"]["analytic_per_chip"] > 0
        assert r["estimate_ms"] > r["ideal_ms"] > 0
        assert r["breakdown"]["collectives"]
    assert "all-reduce" in rows["tp"]["breakdown"]["collectives"]
    cp = rows["sp"]["breakdown"]["collectives"]["collective-permute"]
    assert cp["count"] > 0 and cp["overlapped"] == cp["count"]
    assert rows["sp-xla"]["compiler_options"] == run.XLA_CM_FLAGS
    assert "ESTIMATES for v5e:2x2" in proc.stdout


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_weights_of_another_family_are_refused(capsys):
    assert cli.main(["--model", "flux:tiny", "--weights", os.path.join(FIXTURES, "wan_t2v", "transformer")]) == 2
    assert "not a flux transformer" in capsys.readouterr().err


@pytest.mark.slow
def test_weights_and_embeddings_files(tmp_path):
    import numpy as np

    emb = tmp_path / "emb.npz"
    rng = np.random.default_rng(3)
    np.savez(emb, prompt_embeds=rng.standard_normal((1, 512, 24)).astype(np.float32),
             negative_prompt_embeds=rng.standard_normal((1, 512, 24)).astype(np.float32))
    rc, data = _run(tmp_path, "--model", "wan:tiny", "--weights", os.path.join(FIXTURES, "wan_t2v", "transformer"),
                    "--embeddings", str(emb), "--mode", "tp,sp", "--steps", "2")
    assert rc == 0
    rows = _check_rows(data, ["tp", "sp"])
    assert rows[0]["weights"].endswith("transformer") and rows[0]["embeddings"] == str(emb)


@pytest.mark.slow
def test_no_arguments_runs_every_tiny_preset_in_tp_and_sp(tmp_path, monkeypatch, capsys):
    import time

    monkeypatch.delenv("DIFFLET_TPU_SP", raising=False)
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    assert cli.main([]) == 0
    print(f"no-argument run: {time.perf_counter() - t0:.1f} s")  # README's main command; < 2 min on 2 idle cores
    out = capsys.readouterr().out
    for fam in models.PORTS:
        for mode in ("tp", "sp"):
            assert any(line.startswith(f"{fam}:tiny") and f" {mode} " in line for line in out.splitlines()), (fam, mode)


def test_profile_and_dump_hlo_write_their_directories(tmp_path):
    prof, hlo = tmp_path / "prof", tmp_path / "hlo"
    rc, data = _run(tmp_path, "--model", "toy:tiny", "--mode", "tp", "--steps", "2", "--profile", str(prof),
                    "--dump-hlo", str(hlo))
    assert rc == 0
    row = data["results"][0]
    assert os.path.isdir(row["profile"]) and any(files for _, _, files in os.walk(row["profile"]))
    text = open(row["hlo"]).read()
    assert "HloModule" in text and "ENTRY" in text
    assert os.listdir(prof) == [os.path.basename(row["profile"])]  # no temporary directory left beside it


def test_a_failed_profiled_run_leaves_no_trace_directory(tmp_path, monkeypatch):
    """The trace is written into a temporary directory and renamed on success: a run that fails
    after its first traced step leaves nothing at --profile's target (before: a partial trace)."""
    class Fails(run.Progress):
        def __call__(self, i, n, dt):
            if i == 2:
                raise RuntimeError("stopped after a traced step")

    prof = tmp_path / "prof"
    monkeypatch.setattr(run, "Progress", Fails)
    rc, data = _run(tmp_path, "--model", "toy:tiny", "--mode", "tp", "--steps", "3", "--profile", str(prof))
    assert rc == 1 and "stopped after a traced step" in data["results"][0]["error"]
    assert os.listdir(prof) == []


def test_compare_and_sha256():
    import numpy as np

    a = {"hidden_states": np.linspace(-1, 1, 100, dtype=np.float32)}
    b = {"hidden_states": a["hidden_states"] + 1e-3}
    c = run.compare(b, a)
    assert c["rel_l2"] == pytest.approx(1e-3 / np.sqrt(np.mean(a["hidden_states"] ** 2)), rel=1e-3)
    assert c["psnr_db"] == pytest.approx(10 * np.log10(4 / 1e-6), rel=1e-3)  # range 2, mse 1e-6
    assert run.compare(a, a)["psnr_db"] == float("inf")
    assert run.sha256(a) == run.sha256({"hidden_states": a["hidden_states"].copy()}) != run.sha256(b)


def test_bytes_per_device_counts_each_shard():
    # The second expert's weights the compile-only report adds for Wan2.2 A14B:
    # runtime.bytes_per_device of an abstract model on 4 devices, against the sum over
    # parameters of size / (ranks each is sharded over) from the port's plan.
    import math

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from difflet_tpu import runtime
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.parallel.modes import param_specs

    spec = models.spec("wan")
    mesh = make_mesh(4)
    for preset in ("tiny", "Wan2.2-T2V-A14B"):
        cfg = cases.build_config(spec, preset)
        build = lambda: spec.build(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        state = nnx.state(nnx.eval_shape(build))
        specs = param_specs(state, spec.plan)
        want = 0
        for leaf, ps in zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=lambda x: x is not None
                                                                    and type(x).__name__ == "PartitionSpec")):
            ranks = math.prod(mesh.shape[a] for a in ps if a is not None)
            want += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize // ranks
        got = runtime.bytes_per_device(runtime.abstract_model(build, mesh, spec.plan))
        assert got == want
        full = sum(math.prod(l.shape) * jnp.dtype(l.dtype).itemsize for l in jax.tree.leaves(state))
        assert full / 4 <= got < full
    assert 6.5 * 2**30 < got < 7.0 * 2**30  # one A14B expert, bf16, over 4 chips (~14.3 B parameters)


def test_a_step_that_does_not_fit_memory_names_the_size(capsys):
    """FLUX's tiny preset at 16384x16384 is 1,048,576 image tokens: its attention needs ~8 TiB,
    which XLA refuses to allocate (nothing runs). The row names the size and batch that asked for it."""
    rc = cli.main(["--model", "flux:tiny", "--height", "16384", "--width", "16384", "--steps", "1", "--mode", "tp"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "does not fit the devices' memory at --height 16384 --width 16384" in out and "--batch 1" in out
    assert "Out of memory allocating" in out  # XLA's own words kept
