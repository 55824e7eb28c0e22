"""`python -m difflet_tpu.generate` on the tiny Wan pipeline folders (and HunyuanVideo's, LTX-2's): an
H.264 MP4 that reads back (PyAV) with the frame count, size and rate asked for and the pipeline's
frames (within H.264's loss), image-to-video with `--image`, the timings file; bad input refused
before any loading with a nonzero exit and no file."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import generate
from difflet_tpu.pipeline import mp4
from difflet_tpu.pipeline.diffusion import DiffusionPipeline

jax.devices()  # the session's CPU devices exist before main() runs in this process
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
T2V, I2V, TI2V = (str(FIXTURES / n) for n in ("wan_t2v", "wan_i2v", "wan22_ti2v"))
TINY = ["--height", "32", "--width", "48", "--steps", "2", "--max-sequence-length", "16", "--seed", "5"]


def test_writes_an_mp4_that_reads_back_as_asked(tmp_path, capsys):
    out, timings = tmp_path / "clip.mp4", tmp_path / "t.json"
    assert generate.main([T2V, "--prompt", "a cat walking", "--frames", "9", *TINY, "--out", str(out),
                          "--json", str(timings)]) == 0
    err = capsys.readouterr().err
    assert "denoise step 2/2" in err and "decode" in err and f"wrote {out}" in err
    frames, fps = mp4.read_mp4(out)
    assert frames.shape == (9, 32, 48, 3) and fps == 16.0
    # the same call in-process (float32 on CPU, seed 5): the file holds its frames, up to H.264's loss
    pipe = DiffusionPipeline.from_pretrained(T2V, dtype=jnp.float32)
    want = pipe(prompt="a cat walking", height=32, width=48, num_frames=9, num_inference_steps=2,
                max_sequence_length=16, seed=5, output_type="np").frames[0]
    # H.264 in yuv420p keeps luma at full resolution (chroma at a quarter: on these noise-like tiny
    # frames most of the RGB difference), so compare luma (BT.601 weights)
    luma = np.array([0.299, 0.587, 0.114])
    err = np.abs(frames.astype(np.float64) @ luma - (want * 255) @ luma).mean(axis=(1, 2))
    shifted = np.abs(frames[1:].astype(np.float64) @ luma - (want[:-1] * 255) @ luma).mean()
    assert err.max() < 6.0 and shifted > 2 * err.mean(), (err, shifted)  # ~3 measured; frames in order
    report = json.loads(timings.read_text())
    assert report["pipeline"] == "WanPipeline" and report["video_shape"] == [1, 9, 32, 48, 3] and report["fps"] == 16
    assert len(report["denoise_steps_s"]) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_frames_rounded_as_diffusers_and_fps(tmp_path, caplog):
    out = tmp_path / "c.mp4"
    assert generate.main([T2V, "--prompt", "a cat", "--frames", "7", *TINY, "--fps", "8", "--out", str(out)]) == 0
    assert "5 frames instead of 7" in caplog.text  # diffusers' warning, saying the count made
    frames, fps = mp4.read_mp4(out)
    assert frames.shape[0] == 5 and fps == 8.0


def test_image_to_video(tmp_path):
    out = tmp_path / "i2v.mp4"
    image = str(FIXTURES / "wan_i2v" / "image.png")
    assert generate.main([I2V, "--prompt", "a robot", "--image", image, "--frames", "5", "--height", "32",
                          "--width", "48", "--steps", "1", "--out", str(out)]) == 0
    assert mp4.read_mp4(out)[0].shape == (5, 32, 48, 3)


def test_ti2v_folder_takes_an_image(tmp_path):
    """Wan2.2 TI2V-5B's WanPipeline folder: --image runs WanImageToVideoPipeline on it, at 24 fps."""
    out = tmp_path / "ti2v.mp4"
    image = str(FIXTURES / "wan22_ti2v" / "image.png")
    assert generate.main([TI2V, "--prompt", "a robot", "--image", image, "--frames", "5", "--height", "64",
                          "--width", "64", "--steps", "1", "--out", str(out)]) == 0
    frames, fps = mp4.read_mp4(out)
    assert frames.shape == (5, 64, 64, 3) and fps == 24.0


@pytest.mark.parametrize("name", ["hunyuan_video", "ltx2"])
def test_other_video_folders_write_pil_frames(tmp_path, name, monkeypatch):
    """generate asks for "pil" frames (uint8 off the devices): every video VAE's decode_video takes
    `uint8` (HunyuanVideo's and LTX-2's did not: generate failed at the decode). The frames are the
    in-process "np" call's, up to H.264's loss (luma)."""
    if name == "ltx2":  # the tiny transformer has 2 blocks; diffusers' default STG block is 28
        call_kwargs = generate.call_kwargs
        monkeypatch.setattr(generate, "call_kwargs", lambda args, video=False: {
            **call_kwargs(args, video), "spatio_temporal_guidance_blocks": [1]})
    out, folder = tmp_path / "v.mp4", str(FIXTURES / name)
    size = dict(hunyuan_video=(16, 16), ltx2=(32, 64))[name]
    assert generate.main([folder, "--prompt", "a cat", "--frames", "5", "--height", str(size[0]), "--width",
                          str(size[1]), "--steps", "2", "--max-sequence-length", "16", "--out", str(out)]) == 0
    frames, fps = mp4.read_mp4(out)
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=jnp.float32)
    want = pipe(**generate.call_kwargs(generate.parser().parse_args(
        [folder, "--prompt", "a cat", "--frames", "5", "--height", str(size[0]), "--width", str(size[1]), "--steps",
         "2", "--max-sequence-length", "16", "--out", str(out)]), video=True) | dict(output_type="np")).frames[0]
    assert frames.shape == (5, *size, 3) and fps == 24.0
    luma = np.array([0.299, 0.587, 0.114])
    assert np.abs(frames.astype(np.float64) @ luma - (np.asarray(want) * 255) @ luma).mean() < 6.0


@pytest.mark.parametrize("argv,match", [
    ([T2V, "--prompt", "a cat", "--out", "{tmp}/x.png"], "makes a video: the output must be a .mp4 file"),
    ([T2V, "--prompt", "a cat", "--out", "{tmp}/x.avi"], "makes a video: the output must be a .mp4 file"),
    ([T2V, "--prompt", "a cat", "--image", "{img}", "--out", "{tmp}/x.mp4"], "text-to-video pipeline"),
    ([I2V, "--prompt", "a cat", "--out", "{tmp}/x.mp4"], "give the first frame with --image"),
    ([I2V, "--prompt", "a cat", "--image", "{tmp}/missing.png", "--out", "{tmp}/x.mp4"], "is not a file"),
    ([I2V, "--prompt", "a cat", "--image", "{notimg}", "--out", "{tmp}/x.mp4"], "cannot be read as an image"),
    ([T2V, "--prompt", "a cat", "--frames", "0", "--out", "{tmp}/x.mp4"], "--frames 0"),
    ([T2V, "--prompt", "a cat", "--fps", "0", "--out", "{tmp}/x.mp4"], "fps must be"),
    ([T2V, "--prompt", "a cat", "--true-cfg", "4", "--out", "{tmp}/x.mp4"], "--true-cfg"),
    ([T2V, "--prompt", "a cat", "--out", "{tmp}/x.mp4", "--json", "{tmp}/x.mp4"], "--json"),
    ([T2V, "--prompt", "a cat", "--out", "{tmp}/nofolder/x.mp4"], "does not exist"),
    ([str(FIXTURES / "flux_schnell"), "--prompt", "a cat", "--frames", "9", "--out", "{tmp}/x.png"],
     "makes images"),
])
def test_refused_before_loading(argv, match, tmp_path, capsys, monkeypatch):
    notimg = tmp_path / "notes.png"
    notimg.write_text("not a picture")
    argv = [a.format(tmp=tmp_path, img=FIXTURES / "wan_i2v" / "image.png", notimg=notimg) for a in argv]
    monkeypatch.setattr(generate, "load", lambda args: pytest.fail("loaded despite bad input"))
    assert generate.main(argv) != 0
    assert match in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.png"]  # nothing written
