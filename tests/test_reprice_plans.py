"""The committed prompt -> image plans are priced by today's calibration constants
(benchmark/reprice_plans.py), and a stale one is caught."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("reprice_plans", ROOT / "benchmark" / "reprice_plans.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_plans_are_priced_by_todays_constants():
    assert _module().main(["--check"]) == 0


def test_a_stale_plan_is_caught(tmp_path, monkeypatch):
    mod = _module()
    for path in mod.PLANS.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    stale = tmp_path / "flux_v5e.json"
    report = json.loads(stale.read_text())
    report["stages"][0]["estimate_ms"] += 1.0
    stale.write_text(json.dumps(report))
    monkeypatch.setattr(mod, "PLANS", tmp_path)
    assert mod.main(["--check"]) == 1


def test_the_10_percent_share_is_recomputed_from_the_stages():
    mod = _module()
    report = json.loads((mod.PLANS / "flux_v5e.json").read_text())
    for plan in mod.reprice(report)["plans"]:
        assert plan["encode_decode_share"] == round((plan["encode_ms"] + plan["decode_ms"]) / plan["denoise_ms"], 4)
        assert plan["within_10_percent"] == (plan["encode_decode_share"] <= 0.10)
