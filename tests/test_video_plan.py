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


def test_reused_stages_take_what_compiled_and_refuse_another_plan(tmp_path):
    ok = dict(stage="transformer tp batch 2 (tp=4)", calls_per_image=50, hbm=dict(total=GIB, arguments=GIB),
              estimate_ms=1.0, chosen=True)
    bad = dict(stage="vae decode_video, one chip", calls_per_image=1, error="JaxRuntimeError: ...")
    plan = dict(pipeline="wan", model="wan:Wan2.2-TI2V-5B", topology="v5e:2x2", height=704, width=1280, frames=121,
                stages=[ok, bad])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    got = video_plan.reused_stages(str(path), "wan:Wan2.2-TI2V-5B", "v5e:2x2", 704, 1280, 121)
    assert list(got) == ["transformer tp batch 2 (tp=4)"]  # the failed decode compiles again
    row = got["transformer tp batch 2 (tp=4)"]
    assert row["estimate_ms"] == 1.0 and row["source"] == "an earlier plan, plan.json" and "chosen" not in row
    assert "stage" not in row
    with pytest.raises(BenchError, match="not wan:Wan2.2-TI2V-5B 704x1280x81"):
        video_plan.reused_stages(str(path), "wan:Wan2.2-TI2V-5B", "v5e:2x2", 704, 1280, 81)


def test_combined_stages_sum_time_and_keep_the_largest_program():
    from difflet_tpu.bench import av_plan

    video = dict(stage="video", hbm=dict(total=5 * GIB, arguments=GIB), weights_per_chip=GIB, estimate_ms=100.0,
                 estimate_raw_ms=150.0)
    audio = dict(stage="audio", hbm=dict(total=2 * GIB, arguments=GIB // 4), weights_per_chip=GIB // 4,
                 estimate_ms=10.0, estimate_raw_ms=20.0)
    r = av_plan.combined([video, audio], [1, 3], "decode")
    assert r["estimate_ms"] == 130.0 and r["estimate_raw_ms"] == 210.0
    assert r["weights_per_chip"] == GIB + GIB // 4
    # the video program with the audio weights resident beside it
    assert r["hbm"]["total"] == 5 * GIB + GIB // 4 and r["parts"] == ["video", "audio"]
    # one transformer's two calls (LTX-2's CFG pair at batch 2, its isolation call at batch 1): its
    # weights are resident once, so the peak is the larger program alone
    b2 = dict(stage="b2", hbm=dict(total=11 * GIB, arguments=10 * GIB), weights_per_chip=10 * GIB,
              estimate_ms=800.0, estimate_raw_ms=800.0)
    b1 = dict(b2, stage="b1", hbm=dict(total=10 * GIB + GIB // 2, arguments=10 * GIB), estimate_ms=400.0)
    t = av_plan.combined([b2, b1], [1, 1], "transformer", shared=True)
    assert t["weights_per_chip"] == 10 * GIB and t["hbm"]["total"] == 11 * GIB and t["estimate_ms"] == 1200.0


@pytest.mark.parametrize("argv,message", [
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "wan", "--guidance", "1"], "--guidance cannot be"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "flux", "--reuse-stages", "x.json"],
     "--reuse-stages only applies to --pipeline wan | hunyuan_video | ltx2"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "ltx2", "--mesh", "tp=2"], "--mesh cannot be"),
])
def test_bad_av_plan_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _plan(tmp_path, *flags, env=None):
    import os

    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "difflet_tpu.bench", "--compile-only", "--topology", "v5e:2x2", "--mode", "tp",
           "--json", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert not [s for s in r["stages"] if "error" in s]
    return r, {s["stage"]: s for s in r["stages"]}


@pytest.mark.slow
def test_cli_plans_hunyuan_video_tiny(tmp_path):
    """hunyuan_video:tiny deviceless for v5e:2x2: the Llama and CLIP encoders once each, one
    batch-1 transformer call a step (embedded guidance), the decode on one chip and spread over 4
    (the one summed)."""
    r, s = _plan(tmp_path, "--pipeline", "hunyuan_video", "--model", "hunyuan_video:tiny")
    assert {"llama-3-8b (24 tokens) tp", "clip-l (77 tokens) tp", "vae decode_video, one chip"} <= set(s)
    spread = s["vae decode_video, spread over 4"]
    assert spread["chips"] == 4 and spread["chosen"] and not s["vae decode_video, one chip"].get("chosen")
    step = s["transformer tp batch 1 (tp=4)"]
    [t] = r["plans"]
    assert t["calls"] == [dict(batch=1, per_step=1)]
    assert t["denoise_ms"] == pytest.approx(50 * step["estimate_ms"], abs=1e-2)
    assert t["decode_ms"] == spread["estimate_ms"]
    assert t["encode_ms"] == pytest.approx(s["llama-3-8b (24 tokens) tp"]["estimate_ms"]
                                           + s["clip-l (77 tokens) tp"]["estimate_ms"]
                                           + t["encoder_offload"]["host_to_device_ms"], abs=1e-2)
    assert s["vae decode_video, one chip"]["input"] == [1, 4, 2, 4, 4]


@pytest.mark.slow
@pytest.mark.parametrize("guidance", [1.0, None])
def test_cli_plans_ltx2_tiny(tmp_path, guidance):
    """ltx2:tiny: Gemma-3 and the connectors, the video VAE, audio VAE and vocoder summed as the
    decode; guidance 1: one batch-1 call a step; the default (3): both prompts encoded, the CFG
    pair (batch 2) and the modality-isolation call (batch 1) every step."""
    flags = ["--pipeline", "ltx2", "--model", "ltx2:tiny", "--steps", "20"]
    # guidance 1 with DIFFLET_TPU_ENCODER_STREAM=on: Gemma-3 streamed too, the plan the runtime then runs
    r, s = _plan(tmp_path, *flags, *(["--guidance", str(guidance)] if guidance else []),
                 env=dict(DIFFLET_TPU_ENCODER_STREAM="on" if guidance else "auto"))
    t = r["plans"][0]
    assert len(r["plans"]) == (2 if guidance else 1)
    decodes = ("vae decode_video, spread over 4", "audio vae decode, one chip", "vocoder, one chip")
    assert t["decode_ms"] == pytest.approx(sum(s[n]["estimate_ms"] for n in decodes), abs=1e-2)
    assert s["vocoder, one chip"]["input"] == s["audio vae decode, one chip"]["output"]
    b1 = s["transformer tp batch 1 (tp=4)"]["estimate_ms"]
    if guidance == 1.0:
        assert t["calls"] == [dict(batch=1, per_step=1)] and r["call"]["modality_scale"] == 1.0
        assert t["denoise_ms"] == pytest.approx(20 * b1, abs=1e-2)
        assert s["gemma-3-12b (32 tokens) tp"]["calls_per_image"] == 1 and "ltx2 connectors (batch 1)" in s
        streamed, group = r["plans"][1], s["gemma-3-12b streamed (32 tokens) tp"]
        e = streamed["encoder_stream"]
        assert streamed["chosen"] and not t.get("chosen") and (e["group"], e["groups"]) == (4, 1)  # 3 sliding + 1 full
        assert group["weights_per_chip"] == e["layers_bytes_per_chip"]  # one group of all 4 layers
        assert r["total_ms"] == streamed["total_ms"]  # the request's estimate: the chosen plan's
        assert streamed["encode_ms"] == pytest.approx(group["estimate_ms"] + e["host_to_device_ms"]
                                                      + s["ltx2 connectors (batch 1)"]["estimate_ms"], abs=1e-2)
    else:
        b2 = s["transformer tp batch 2 (tp=4)"]["estimate_ms"]
        assert t["calls"] == [dict(batch=2, per_step=1), dict(batch=1, per_step=1)]
        assert t["denoise_ms"] == pytest.approx(20 * (b2 + b1), abs=1e-2)
        assert s["gemma-3-12b (32 tokens) tp"]["calls_per_image"] == 2 and "ltx2 connectors (batch 2)" in s


@pytest.mark.slow
def test_cli_plans_wan_tiny_one_chip_decode_when_spread_is_off(tmp_path):
    """DIFFLET_TPU_VAE_SPREAD=off: the pipeline decodes on one chip, so the plan compiles and
    sums only that decode."""
    import os

    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "difflet_tpu.bench", "--compile-only", "--pipeline", "wan", "--model", "wan:tiny",
           "--topology", "v5e:2x2", "--mode", "tp", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, DIFFLET_TPU_VAE_SPREAD="off"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    decodes = [s for s in r["stages"] if s["stage"].startswith("vae")]
    assert [s["stage"] for s in decodes] == ["vae decode_video, one chip"] and decodes[0]["chosen"]
    [t] = r["plans"]
    assert t["decode_ms"] == decodes[0]["estimate_ms"]


def test_streamed_encoder_keeps_the_transformer():
    """Gemma-3 streams its layers from host memory (as the runtime's encoder_stream): the
    transformer and the connectors stay, each encode pays its groups and one copy of the layers."""
    from difflet_tpu.bench import av_plan
    from difflet_tpu.bench import pipeline_plan as PP

    rows = {"gemma": _row(7 * GIB, 6 * GIB, 50.0), "connectors": _row(3 * GIB, 2 * GIB, 20.0),
            "vae": _row(4 * GIB, GIB, 300.0)}
    p = dict(steps=20, calls_per_step=1, encoders=[("gemma", None, 1024, True, 2), ("connectors", None, 0, False, 1)])
    step = dict(_row(10 * GIB, 10 * GIB, 160.0), mode="sp-pallas")
    plan = PP.plan_totals(rows, p, step, "auto", CHIP)
    stream = dict(_row(GIB, GIB // 2, 6.0), group=6, groups=8, layers_bytes_per_chip=5 * GIB, states_bytes=GIB // 4)
    t = av_plan.streamed_encoder(plan, rows, p, step, CHIP, "gemma", stream, "auto: over")
    assert t["peaks"] == {"gemma": GIB + GIB // 4 + 2 * GIB + 10 * GIB + GIB, "connectors": 3 * GIB + 10 * GIB + GIB,
                          "transformer": 10 * GIB + 2 * GIB + GIB, "vae": 4 * GIB + 10 * GIB + 2 * GIB}
    assert t["fits"] and not t["transformer_staged"] and not t["encoder_offload"]["enabled"]
    copy = 2 * 5 * GIB / 1.5e10 * 1e3  # two prompts, each copying the layers once
    assert t["encoder_stream"]["host_to_device_ms"] == pytest.approx(copy, abs=1e-3)
    assert t["encode_ms"] == pytest.approx(2 * 8 * 6.0 + copy + 20.0, abs=1e-2)
    assert t["total_ms"] == pytest.approx(t["encode_ms"] + 20 * 160.0 + 300.0, abs=1e-2)
    assert t["decode_room"]["moved"] == []
    # a decode over 16 GiB beside them: the connectors leave for it (the runtime's with_room), and
    # with a bigger one the transformer too; their copies back are paid at the next encode
    for vae, moved, peak in ((5 * GIB, ["encoders"], 5 * GIB + 10 * GIB),
                             (7 * GIB, ["encoders", "transformer"], 7 * GIB)):
        r = av_plan.streamed_encoder(plan, dict(rows, vae=_row(vae, GIB, 300.0)), p, step, CHIP, "gemma", stream, "")
        back = (2 * GIB + (10 * GIB if "transformer" in moved else 0)) / 1.5e10 * 1e3
        assert r["decode_room"]["moved"] == moved and r["peaks"]["vae"] == peak and r["fits"]
        assert r["transformer_staged"] == ("transformer" in moved)
        assert r["encode_ms"] == pytest.approx(t["encode_ms"] + back, abs=1e-2)


def test_transformer_staged_outside_the_denoise():
    """Gemma-3 + connectors do not fit beside the resident transformer: the staged plan drops
    the transformer for the encode and the decode (as the runtime's transformer_offload) and
    pays one copy of it back a video."""
    from difflet_tpu.bench import av_plan
    from difflet_tpu.bench import pipeline_plan as PP

    rows = {"gemma": _row(7 * GIB, 6 * GIB, 50.0), "connectors": _row(3 * GIB, 2 * GIB, 20.0),
            "vae": _row(4 * GIB, GIB, 300.0)}
    p = dict(steps=20, calls_per_step=1, encoders=[("gemma", None, 1024, True, 1), ("connectors", None, 0, False, 1)])
    step = dict(_row(10 * GIB, 10 * GIB, 160.0), mode="sp-pallas")
    plan = PP.plan_totals(rows, p, step, "auto", CHIP)
    assert plan["encoder_offload"]["enabled"] and not plan["fits"]  # gemma 7 + 2 + 10 + 1 = 20 GiB
    t = av_plan.staged_transformer(plan, rows, p, step, CHIP)
    assert t["peaks"] == {"gemma": 7 * GIB + 2 * GIB + GIB, "connectors": 3 * GIB + 6 * GIB + GIB,
                          "transformer": 10 * GIB + GIB, "vae": 4 * GIB}
    assert t["fits"] and t["transformer_staged"]
    move = 10 * GIB / 1.5e10 * 1e3  # runtime.H2D_BYTES_PER_S["v5e"]
    assert t["transformer_move_ms"] == pytest.approx(move, abs=1e-3)
    assert t["encode_ms"] == pytest.approx(plan["encode_ms"] + move, abs=1e-2)
    assert t["total_ms"] == pytest.approx(t["encode_ms"] + 20 * 160.0 + 300.0, abs=1e-2)
