"""The prompt -> image plan (`--compile-only --pipeline`): the placement arithmetic on tiny
numbers, the end-to-end sums, the CLI's refusals, and (slow) the stage compiles on small
configs for a v5e:2x2 topology (deviceless)."""

from __future__ import annotations

import pytest

from difflet_tpu.bench import cli, pipeline_plan
from difflet_tpu.parallel.chips import Chip
from difflet_tpu.pipeline import placement
from difflet_tpu.tools import deviceless

GIB = 2**30
STAGES = [dict(name="t5", component="t5", kind=placement.ENCODE, total=3 * GIB),
          dict(name="transformer", component="transformer", kind=placement.DENOISE, total=10 * GIB),
          dict(name="vae", component="vae", kind=placement.DECODE, total=2 * GIB)]
WEIGHTS = {"t5": 3 * GIB, "transformer": 9 * GIB, "vae": GIB // 2}


def test_stage_peaks_count_the_other_parts_resident():
    resident = placement.stage_peaks(STAGES, WEIGHTS, {"t5"}, offload=False)
    assert resident == {"t5": 3 * GIB + 9 * GIB + GIB // 2, "transformer": 10 * GIB + 3 * GIB + GIB // 2,
                        "vae": 2 * GIB + 3 * GIB + 9 * GIB}
    off = placement.stage_peaks(STAGES, WEIGHTS, {"t5"}, offload=True)
    # the encoder leaves the denoise and decode stages; its own stage is unchanged
    assert off == {"t5": resident["t5"], "transformer": resident["transformer"] - 3 * GIB,
                   "vae": resident["vae"] - 3 * GIB}


def test_decide():
    peaks = placement.stage_peaks(STAGES, WEIGHTS, {"t5"}, offload=False)  # worst: vae, 14 GiB
    assert placement.decide("auto", peaks, 16 * GIB, True)[0] is False
    on, why = placement.decide("auto", peaks, 13 * GIB, True)
    assert on and "vae stage needs 14.00 GiB" in why and "over" in why
    assert placement.decide("auto", peaks, None, True) == (False, "auto: no device memory limit or host memory "
                                                                  "kind known")
    assert placement.decide("auto", peaks, 13 * GIB, False)[0] is False
    assert placement.decide("on", peaks, 64 * GIB, True) == (True, "on")
    assert placement.decide("off", peaks, GIB, True) == (False, "off")
    with pytest.raises(ValueError, match="no host memory kind"):
        placement.decide("on", peaks, GIB, False)
    with pytest.raises(ValueError, match="'host': use one of auto, on, off"):
        placement.decide("host", peaks, GIB, True)


def _row(total, weights, est):
    return dict(hbm=dict(total=total, arguments=weights), weights_per_chip=weights, estimate_ms=est)


def test_plan_totals_offload_and_the_ten_percent():
    chip = Chip("v5e", clock_hz=1.5e9, bf16_flops=197e12, hbm_bw=819e9, hbm_bytes=14 * GIB, ici_link_bw=45e9,
                ici_latency=1e-6)
    p = dict(steps=28, calls_per_step=1, encoders=[("clip", None, 77, False, 1), ("t5", None, 512, False, 2)])
    rows = {"clip": _row(GIB // 4, GIB // 8, 1.0), "t5": _row(3 * GIB, 3 * GIB, 20.0), "vae": _row(2 * GIB, GIB, 50.0)}
    transformer = dict(_row(10 * GIB, 9 * GIB, 100.0), mode="tp")
    t = pipeline_plan.plan_totals(rows, p, transformer, "auto", chip)
    # resident: the transformer stage needs 10 + 1/8 + 3 + 1 = 14.125 GiB > 14: the encoders go to host
    assert t["encoder_offload"]["enabled"] and t["fits"]
    assert t["peaks_resident"]["transformer"] == 10 * GIB + GIB // 8 + 3 * GIB + GIB
    assert t["peaks"]["transformer"] == 11 * GIB
    load_ms = (3 * GIB + GIB // 8) / 1.5e10 * 1e3  # runtime.H2D_BYTES_PER_S["v5e"]
    assert t["encoder_offload"]["host_to_device_ms"] == pytest.approx(load_ms, abs=1e-3)
    assert t["encode_ms"] == pytest.approx(1.0 + 2 * 20.0 + load_ms, abs=1e-3)
    assert t["denoise_ms"] == 28 * 100.0
    share = (t["encode_ms"] + 50.0) / 2800.0
    assert t["encode_decode_share"] == pytest.approx(share, abs=1e-4) and t["within_10_percent"] == (share <= 0.1)
    off = pipeline_plan.plan_totals(rows, p, transformer, "off", chip)
    assert not off["encoder_offload"]["enabled"] and not off["fits"]  # forced resident: over the 14 GiB
    assert off["encode_ms"] == 41.0


@pytest.mark.parametrize("argv,message", [
    (["--pipeline", "flux"], "--pipeline plans deviceless"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "sdxl"], "invalid choice: 'sdxl'"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "flux", "--model", "flux"], "--model cannot be"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "flux", "--batch", "2"], "plans batch 1"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "flux", "--height", "1000"], "--height 1000"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "qwen_image", "--mesh", "tp=2"],
     "--mesh cannot be"),
    (["--compile-only", "--topology", "v5e:2x2", "--encoder-offload", "on"], "only applies to --pipeline"),
    (["--compile-only", "--topology", "v5e:2x2", "--pipeline", "flux", "--encoder-offload", "host"],
     "invalid choice: 'host'"),
])
def test_bad_pipeline_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_pipeline_flags_parse(monkeypatch):
    monkeypatch.setenv("DIFFLET_TPU_ENCODER_OFFLOAD", "on")
    ap = cli.parser()
    args = ap.parse_args(["--compile-only", "--topology", "v6e:2x2", "--pipeline", "qwen_image"])
    cli.validate(args, ap)
    assert args.modes == ["tp", "sp-pallas"] and args.encoder_offload == "on"


STAGE_CODE = r"""
import dataclasses, json
from difflet_tpu.tools import deviceless
deviceless.setup_process("v5e:2x2")
from difflet_tpu.bench import pipeline_plan as PP
from difflet_tpu.encoders import t5
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.tools import estimate as E
from difflet_tpu.tools.calibration import Factors
from difflet_tpu.vae import AutoencoderKLConfig
devices = deviceless.topology_devices("v5e:2x2")
chip, cal = E.chip_for("v5e:2x2"), Factors()  # uncalibrated: the raw replay
config = dataclasses.replace(t5.T5_V1_1_XXL, num_layers=4, d_model=512, d_ff=1024, num_heads=8, vocab_size=1024)
mesh = make_mesh(4, devices)
tp = PP.compile_encoder_tp(config, 128, False, mesh, chip, cal)
seg = PP.compile_encoder_segments(config, 128, devices, chip, cal)
vae = PP.compile_vae(AutoencoderKLConfig(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                                         up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4), 64, 64, mesh,
                     chip, cal)
print(json.dumps(dict(tp=tp, seg=seg, vae=vae)))
"""


@pytest.mark.slow
def test_stage_compiles_on_small_configs():
    """A 4-layer T5 both ways and a small VAE, compiled for v5e:2x2: TP all-reduces twice a layer;
    the segments' time is 4 x one segment + 3 hops and chip 0 holds the embedding."""
    r = deviceless.run_python(STAGE_CODE, "v5e:2x2", timeout=900)
    tp, seg, vae = r["tp"], r["seg"], r["vae"]
    assert tp["breakdown"]["collectives"]["all-reduce"]["count"] == 2 * 4
    assert tp["estimate_ms"] > 0 and tp["hbm"]["total"] >= tp["weights_per_chip"] > 0
    assert seg["estimate_ms"] == pytest.approx(4 * seg["segment_ms"] + 3 * seg["hop_ms"], abs=2e-3)
    assert not seg["breakdown"]["collectives"]  # one chip, no collective
    embed = 1024 * 512 * 2
    assert seg["weights_per_chip"] > embed and seg["hbm"]["total"] > embed
    assert vae["estimate_ms"] > 0 and vae["hbm"]["total"] > vae["weights_per_chip"] > 0
