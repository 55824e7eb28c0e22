"""The prompt -> video plan (`--compile-only --pipeline wan`): the two-expert placement
arithmetic on given rows, the CLI's refusals, and (slow) the whole CLI path on `wan:tiny`
compiled deviceless for v5e:2x2."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from difflet_tpu.bench import cli, video_plan
from difflet_tpu.bench.cases import BenchError
from difflet_tpu.parallel.chips import Chip

GIB = 2**30
CHIP = Chip("v5e", clock_hz=1.5e9, bf16_flops=197e12, hbm_bw=819e9, hbm_bytes=16 * GIB, ici_link_bw=45e9,
            ici_latency=1e-6)
P = dict(steps=50, calls_per_step=1, encoders=[("umt5-xxl", None, 512, True, 2)])


def _row(total, weights, est):
    return dict(hbm=dict(total=total, arguments=weights), weights_per_chip=weights, estimate_ms=est)


def test_one_expert_is_plan_totals():
    rows = {"umt5-xxl": _row(3 * GIB, 3 * GIB, 20.0), "vae": _row(5 * GIB, GIB // 4, 3000.0)}
    transformer = dict(_row(11 * GIB, 10 * GIB, 2000.0), mode="sp-pallas")
    [t] = video_plan.expert_plans(rows, P, transformer, "auto", CHIP)
    assert t["experts"] == "one" and t["denoise_ms"] == 50 * 2000.0
    assert t["encode_ms"] == pytest.approx(2 * 20.0 + t["encoder_offload"]["host_to_device_ms"], abs=1e-3)
    assert t["encode_decode_share"] == pytest.approx((t["encode_ms"] + 3000.0) / 100000.0, abs=1e-4)


def test_two_experts_resident_or_staged():
    """compile_one's row with the other expert resident (`other_experts`): both experts do not
    fit 16 GiB beside the rest, so the staged plan is chosen and pays 2 copies of one expert."""
    rows = {"umt5-xxl": _row(3 * GIB, 3 * GIB, 20.0), "vae": _row(5 * GIB, GIB // 4, 3000.0)}
    hbm = dict(total=11 * GIB + 7 * GIB, arguments=7 * GIB, other_experts=7 * GIB)
    transformer = dict(hbm=hbm, weights_per_chip=7 * GIB, estimate_ms=2000.0, mode="tp")
    resident, staged = video_plan.expert_plans(rows, P, transformer, "auto", CHIP)
    assert resident["experts"] == "both resident" and not resident["fits"] and not resident.get("chosen")
    # the transformer stage: its program (18 GiB with both experts) alone is over 16 GiB
    assert resident["peaks"]["transformer"] >= 18 * GIB
    assert staged["chosen"] and staged["fits"]
    # one expert resident: every stage fits beside the encoder and the VAE, nothing else moves
    assert not staged["encoder_offload"]["enabled"]
    assert staged["peaks"]["transformer"] == 11 * GIB + 3 * GIB + GIB // 4
    # the decode stage sees one expert resident, not two
    assert staged["peaks_resident"]["vae"] == 5 * GIB + 3 * GIB + 7 * GIB
    move = 2 * 7 * GIB / 1.5e10 * 1e3  # runtime.H2D_BYTES_PER_S["v5e"]
    assert staged["expert_move_ms"] == pytest.approx(move, abs=1e-3)
    assert staged["denoise_ms"] == pytest.approx(50 * 2000.0 + move, abs=1e-2)
    assert staged["total_ms"] == pytest.approx(staged["encode_ms"] + staged["denoise_ms"] + 3000.0, abs=1e-2)
    r2, s2 = video_plan.expert_plans(rows, P, transformer, "auto", dataclasses.replace(CHIP, hbm_bytes=64 * GIB))
    assert r2["chosen"] and r2["fits"] and not s2.get("chosen")


def test_resolve_models():
    spec, preset, vae, scale, shape, enc = video_plan.resolve(None)
    assert (preset, scale, shape, enc.vocab_size, enc.per_layer_relative_bias) == \
        ("Wan2.1-T2V-14B", 8, (480, 832, 81), 256384, True)
    _, preset, vae, scale, shape, _ = video_plan.resolve("wan:Wan2.2-TI2V-5B")
    assert (vae["z_dim"], vae["patch_size"], scale, shape) == (48, 2, 16, (704, 1280, 121))
    with pytest.raises(BenchError, match="no plan for 'Wan2.1-I2V-14B-480P'"):
        video_plan.resolve("wan:Wan2.1-I2V-14B-480P")
    with pytest.raises(BenchError, match="plans a Wan model"):
        video_plan.resolve("flux")


@pytest.mark.parametrize("argv,message", [
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "flux", "--frames", "81"], "--frames cannot be"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "wan", "--model", "wan", "--model", "wan"],
     "plans one model"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "wan", "--mesh", "tp=2"], "--mesh cannot be"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "wan", "--decode-rows", "/nonexistent.json"],
     "no such file"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "flux", "--decode-rows", "x.json"],
     "only applies to --pipeline wan"),
])
def test_bad_video_plan_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_cli_plans_wan_tiny(tmp_path):
    """The whole CLI path on wan:tiny, deviceless for v5e:2x2: every stage compiles, both decode
    rows are there (one chip, spread over 4), the plan sums 50 steps of one batch-2 call."""
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "difflet_tpu.bench", "--compile-only", "--pipeline", "wan", "--model", "wan:tiny",
           "--topology", "v5e:2x2", "--mode", "tp", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    names = [s["stage"] for s in r["stages"]]
    assert not [s for s in r["stages"] if "error" in s]
    assert "vae decode_video, one chip" in names and "vae decode_video, spread over 4" in names
    spread = next(s for s in r["stages"] if s["stage"] == "vae decode_video, spread over 4")
    assert spread["chosen"] and spread["chips"] == 4 and spread["latents"] == [1, 4, 2, 4, 4]
    [t] = r["plans"]
    step = next(s for s in r["stages"] if s["stage"].startswith("transformer tp"))
    assert t["denoise_ms"] == pytest.approx(50 * step["estimate_ms"], abs=1e-2)
    assert t["decode_ms"] == spread["estimate_ms"]
    for key in ("fits", "encode_ms", "denoise_ms", "decode_ms", "encode_decode_share", "total_ms"):
        assert key in t
    assert (r["height"], r["width"], r["frames"]) == (32, 32, 5)


def test_reused_decode_rows_match_shape_placement_and_program(tmp_path):
    hbm = dict(total=5 * GIB, arguments=GIB // 8)
    row = dict(shape="720p", height=720, width=1280, frames=81, latents=[1, 16, 21, 90, 160], placement="width",
               chips=4, output="uint8", hbm=hbm, estimate_ms=3500.0, estimate_raw_ms=5800.0, compile_s=2500.0)
    path = tmp_path / "vae_spread_v5e.json"
    other = dict(row, placement="one", chips=1, output="float32")
    path.write_text(json.dumps(dict(topology="v5e:2x2", rows=[row, other])))
    r = video_plan.reused_decode(str(path), video_plan.WAN21_VAE, "v5e:2x2", 720, 1280, 81, "width")
    assert r["estimate_ms"] == 3500.0 and r["placement"] == "spread width" and r["weights_per_chip"] == GIB // 8
    assert str(path) in r["source"]
    # float32 frames are another program; another shape, topology or VAE: compiled instead
    assert video_plan.reused_decode(str(path), video_plan.WAN21_VAE, "v5e:2x2", 720, 1280, 81, "one") is None
    assert video_plan.reused_decode(str(path), video_plan.WAN21_VAE, "v5e:2x2", 480, 832, 81, "width") is None
    assert video_plan.reused_decode(str(path), video_plan.WAN21_VAE, "v6e:2x2", 720, 1280, 81, "width") is None
    assert video_plan.reused_decode(str(path), video_plan.WAN22_VAE, "v5e:2x2", 720, 1280, 81, "width") is None
