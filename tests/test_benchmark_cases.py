"""benchmark/estimates.py's cases: every command line parses and validates as the
bench would run it (the whole-model compiles themselves take minutes; not run here)."""

import importlib.util
import pathlib

import pytest

from difflet_tpu.bench import cases, cli
from difflet_tpu.pipeline import denoise as PL

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_difflet_estimates", _ROOT / "benchmark" / "estimates.py")
estimates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(estimates)

LONG = ("wan_81", "wan_720p_81", "hunyuan_video_544p", "hunyuan_video_720p", "ltx2_121")


@pytest.mark.parametrize("name", sorted(estimates.CASES))
def test_estimates_case_command_parses(name, tmp_path):
    cmd = estimates.command(name, "v5e:2x2", tmp_path, hlo_dir=tmp_path / "hlo")
    assert cmd[1:3] == ["-m", "difflet_tpu.bench"]
    ap = cli.parser()
    args = ap.parse_args(cmd[3:])
    cli.validate(args, ap)  # exits (SystemExit) on a bad flag or combination
    assert args.compile_only and args.topology == "v5e:2x2"
    spec, preset = PL.resolve_model(args.model[0])
    shape = cases.shape_for(spec, preset, args)
    if name in LONG:  # TP and SP side by side at the long shapes
        assert {"tp", "sp-pallas"} <= set(args.modes) and "sp" in args.modes
        assert shape["frames"] > 49


def test_long_cases_frame_rules():
    """Wan / HunyuanVideo frames are 4k+1, LTX-2's 8k+1; sizes on the latent grids."""
    for name in LONG:
        model, flags, _ = estimates.CASES[name]
        f = dict(zip(flags[::2], flags[1::2]))
        frames, h, w = int(f["--frames"]), int(f["--height"]), int(f["--width"])
        step = 8 if model.startswith("ltx2") else 4
        grid = 32 if model.startswith("ltx2") else 16
        assert (frames - 1) % step == 0 and h % grid == 0 and w % grid == 0, name
