"""`python -m difflet_tpu.bench --end-to-end PIPELINE_DIR`: a whole prompt -> image call timed by stage."""

import json
import pathlib

import pytest

from difflet_tpu.bench import cli

PIPELINE = pathlib.Path(__file__).parent / "fixtures" / "pipelines" / "flux_schnell"


def test_cold_and_warm_stage_timings(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert cli.main(["--end-to-end", str(PIPELINE), "--height", "64", "--width", "64", "--steps", "2",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["pipeline"] == "FluxPipeline" and report["image_shape"] == [1, 64, 64, 3]
    assert report["platform"] == "cpu" and "not a TPU" in report["note"]
    for name in ("cold", "warm"):
        run = report["runs"][name]
        assert len(run["denoise_steps_s"]) == 2  # one time per step of --steps
        assert run["denoise_s"] == pytest.approx(sum(run["denoise_steps_s"]))
        parts = run["tokenize_s"] + run["encode_s"] + run["denoise_s"] + run["decode_s"]
        assert 0 < parts <= run["call_s"]  # the stages happen inside the call
    table = capsys.readouterr().out
    assert "text encode" in table and "decode" in table and "cold s" in table and "warm s" in table


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "a fox"], "--prompt only applies to --end-to-end"),
    (["--end-to-end", str(PIPELINE / "transformer")], "no model_index.json"),
    (["--end-to-end", str(PIPELINE), "--model", "flux:tiny"], "--model cannot be combined with --end-to-end"),
    (["--end-to-end", str(PIPELINE), "--compile-only", "--topology", "v5e:2x2"], "--end-to-end runs the pipeline"),
    (["--end-to-end", str(PIPELINE), "--prompt", "  "], "--prompt is empty"),
    (["--end-to-end", str(PIPELINE), "--height", "60"], "--height 60: must be a positive multiple of 16"),
])
def test_bad_input_refused_before_the_work(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
