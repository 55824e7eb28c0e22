"""Sound out of LTX-2: the MP4's AAC track and the WAV (difflet_tpu/pipeline/audio.py, mp4.py) and
`python -m difflet_tpu.generate` on the tiny LTX-2 folder with `--audio-out`.

AAC is lossy, so the track is compared by correlation with the waveform written (> 0.9, on a
non-silent waveform; a different waveform of the same kind correlates < 0.5, so the bound tells
them apart). Its length is exact: the MP4's edit list trims the encoder's priming and padding,
so the file decodes back to the samples written (checked for lengths around one AAC frame). The
WAV is 16-bit PCM: equal to the waveform within half a quantisation step (0.5 / 32767).

The generate tests run a copy of tests/fixtures/pipelines/ltx2 whose audio VAE says
`mel_hop_length` 4 instead of 160 (a config value, no weights change): the tiny vocoder makes 6
samples per mel frame at a declared 24 kHz, i.e. 4000 mel frames a second, so only with 16000 Hz /
hop 4 do the pipeline's audio latents (`round(F / fps x sample_rate / hop / 4)`) span the video as
they do for the published LTX-2 (16 kHz / hop 160 mels, 240 samples per mel frame at 24 kHz).
With the fixture as it is, 5 frames of video get 5 ms of sound.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import generate
from difflet_tpu.pipeline import audio, mp4
from difflet_tpu.pipeline.diffusion import DiffusionPipeline

jax.devices()  # the session's CPU devices exist before main() runs in this process
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
LTX2, WAN = FIXTURES / "ltx2", str(FIXTURES / "wan_t2v")
RATE = 24000
TINY = ["--height", "32", "--width", "64", "--steps", "2", "--max-sequence-length", "16", "--seed", "3"]


def corr(a, b) -> float:
    return float(np.corrcoef(np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel())[0, 1])


def signal_like(n, seed=0, channels=2):
    """A tone per channel plus low-passed noise (a 16-tap Hann filter: mostly below 3 kHz), peak ~0.8."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / RATE
    noise = np.convolve(rng.standard_normal(n + 15), np.hanning(16) / 8, mode="valid")[:n]
    tone = np.stack([0.4 * np.sin(2 * np.pi * (300 + 200 * c) * (1 + seed / 10) * t) for c in range(channels)])
    return (tone + 0.4 * noise[None]).clip(-1, 1).astype(np.float32)


def video(frames=5):
    return (np.random.default_rng(1).random((frames, 32, 64, 3)) * 255).astype(np.uint8)


@pytest.mark.parametrize("n", [1023, 1024, 1025, 4974, 24000])
def test_mp4_audio_track_reads_back(tmp_path, n):
    wave = signal_like(n)
    path = mp4.write_mp4(video(), tmp_path / "a.mp4", fps=24, audio=wave, sample_rate=RATE)
    frames, fps, got, rate = mp4.read_mp4(path, audio=True)
    assert frames.shape == (5, 32, 64, 3) and fps == 24.0
    assert rate == RATE and got.shape == wave.shape  # every sample, no priming, no padding
    assert min(corr(got[c], wave[c]) for c in range(2)) > 0.9
    assert corr(got, signal_like(n, seed=7)) < 0.5  # another waveform of the same kind
    assert mp4.read_mp4(path)[0].shape == frames.shape  # without audio=True: (frames, fps) as before
    assert [p.name for p in tmp_path.iterdir()] == ["a.mp4"]


def test_mono_track_and_video_only_files(tmp_path):
    wave = signal_like(4000, channels=1)[0]  # 1-D: mono
    _, _, got, rate = mp4.read_mp4(mp4.write_mp4(video(), tmp_path / "m.mp4", 24, wave, RATE), audio=True)
    assert got.shape == (1, 4000) and rate == RATE and corr(got, wave) > 0.9
    assert mp4.read_mp4(mp4.write_mp4(video(), tmp_path / "v.mp4", 24), audio=True)[2:] == (None, None)


def test_wav_equals_the_waveform_to_16_bits(tmp_path):
    wave = signal_like(3000)
    wave[0, :10] = [1.5, -1.5, 1.0, -1.0, 0.5 / 32767, 0, 0, 0, 0, 0]  # clipped as diffusers; exact ends
    got, rate = audio.read_wav(audio.save_wav(wave, tmp_path / "s.wav", RATE))
    assert rate == RATE and got.shape == wave.shape and got.dtype == np.float32
    assert np.abs(got - wave.clip(-1, 1)).max() <= 0.5 / 32767 + 1e-7
    assert got[0, :4].tolist() == [1.0, -1.0, 1.0, -1.0]


@pytest.mark.parametrize("wave,rate,match", [
    (np.zeros((3, 100), np.float32), RATE, "1 or 2 channels"),
    (np.zeros((2, 0), np.float32), RATE, "at least one sample"),
    (np.full((2, 10), np.nan, np.float32), RATE, "non-finite"),
    (np.zeros((2, 10), np.int16), RATE, "floating point"),
    (np.zeros((2, 10), np.float32), 23000, "AAC track takes the sampling rates"),
    (np.zeros((2, 10), np.float32), 24000.0, "whole number of Hz"),
    (np.zeros((2, 10), np.float32), None, "audio and sample_rate go together"),
])
def test_bad_audio_refused_and_nothing_written(tmp_path, wave, rate, match):
    with pytest.raises((ValueError, FloatingPointError), match=match):
        mp4.write_mp4(video(), tmp_path / "x.mp4", 24, wave, rate)
    assert list(tmp_path.iterdir()) == []


def tiny_ltx2(tmp_path) -> Path:
    """The LTX-2 fixture folder with the audio VAE's mel hop 4 (see the module docstring)."""
    folder = tmp_path / "ltx2"
    folder.mkdir()
    for child in LTX2.iterdir():
        if child.name != "audio_vae":
            (folder / child.name).symlink_to(child.resolve())
    (folder / "audio_vae").mkdir()
    for f in (LTX2 / "audio_vae").iterdir():
        if f.name != "config.json":
            (folder / "audio_vae" / f.name).symlink_to(f.resolve())
    config = json.loads((LTX2 / "audio_vae" / "config.json").read_text())
    assert (config["sample_rate"], config["mel_hop_length"]) == (16000, 160)
    (folder / "audio_vae" / "config.json").write_text(json.dumps({**config, "mel_hop_length": 4}))
    return folder


@pytest.fixture
def stg_block_1(monkeypatch):
    """The tiny transformer has 2 blocks; diffusers' default STG block is 28 (generate has no flag for it)."""
    call_kwargs = generate.call_kwargs
    monkeypatch.setattr(generate, "call_kwargs",
                        lambda args, video=False: {**call_kwargs(args, video), "spatio_temporal_guidance_blocks": [1]})


def test_generate_muxes_the_sound_and_writes_the_wav(tmp_path, stg_block_1):
    folder = tiny_ltx2(tmp_path)
    out, wav, report = tmp_path / "clip.mp4", tmp_path / "sound.wav", tmp_path / "t.json"
    assert generate.main([str(folder), "--prompt", "a dog barking", "--frames", "5", *TINY, "--out", str(out),
                          "--audio-out", str(wav), "--json", str(report)]) == 0
    frames, fps, got, rate = mp4.read_mp4(out, audio=True)
    vocoder = json.loads((folder / "vocoder" / "config.json").read_text())
    assert frames.shape == (5, 32, 64, 3) and fps == 24.0 and rate == vocoder["output_sampling_rate"] == RATE
    # the same call in-process (float32 on CPU, seed 3): the MP4 and the WAV hold its waveform
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=jnp.float32)
    want = pipe(prompt="a dog barking", height=32, width=64, num_frames=5, num_inference_steps=2,
                max_sequence_length=16, seed=3, spatio_temporal_guidance_blocks=[1], output_type="np")
    wave = np.asarray(want.audio)[0]
    # the frames, up to H.264's loss (luma, as test_generate_video.py; "pil" frames leave the devices as uint8)
    luma = np.array([0.299, 0.587, 0.114])
    assert np.abs(frames.astype(np.float64) @ luma - (np.asarray(want.frames[0]) * 255) @ luma).mean() < 6.0
    assert want.audio_sample_rate == RATE and got.shape == wave.shape == (2, (4 * 208 - 3) * 6)
    assert np.sqrt(np.mean(wave ** 2)) > 0.05  # not silent
    # the tracks' lengths: 4974 samples (207.25 ms) against 5 / 24 s (208.33 ms). The pipeline's audio
    # is (4 round(25 F / fps) - 3) mel frames, up to 20 + 30 ms shorter than the video for the published
    # LTX-2; the mux adds nothing (exact length, above). Within one AAC frame (1024 samples, 42.7 ms) here.
    assert abs(got.shape[1] / rate - frames.shape[0] / fps) <= audio.AAC_FRAME / rate
    assert min(corr(got[c], wave[c]) for c in range(2)) > 0.9, [corr(got[c], wave[c]) for c in range(2)]
    assert corr(got, wave[:, ::-1]) < 0.5  # the same samples reversed: the bound sees the order
    pcm, wav_rate = audio.read_wav(wav)
    assert wav_rate == RATE and pcm.shape == wave.shape and np.abs(pcm - wave.clip(-1, 1)).max() <= 0.5 / 32767 + 1e-7
    r = json.loads(report.read_text())
    assert r["pipeline"] == "LTX2Pipeline" and r["audio"] == [str(wav)] and r["audio_shape"] == [1, *wave.shape]
    assert r["audio_sample_rate"] == RATE and r["fps"] == 24 and len(r["denoise_steps_s"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4", "ltx2", "sound.wav", "t.json"]


def test_generate_batch_names_and_fps_is_the_frame_rate(tmp_path, stg_block_1):
    """--batch 2: clip-0/-1.mp4 and sound-0/-1.wav, each WAV the track of its MP4; --fps 25 is the
    call's frame_rate (the audio is 4 round(5 / 25 x 1000) - 3 = 797 mel frames, not 24 fps' 829)."""
    folder = tiny_ltx2(tmp_path)
    assert generate.main([str(folder), "--prompt", "rain on a roof", "--frames", "5", *TINY, "--batch", "2",
                          "--fps", "25", "--out", str(tmp_path / "clip.mp4"),
                          "--audio-out", str(tmp_path / "sound.wav")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip-0.mp4", "clip-1.mp4", "ltx2", "sound-0.wav",
                                                          "sound-1.wav"]
    tracks, wavs = [], []
    for i in range(2):
        frames, fps, got, rate = mp4.read_mp4(tmp_path / f"clip-{i}.mp4", audio=True)
        pcm, _ = audio.read_wav(tmp_path / f"sound-{i}.wav")
        assert frames.shape == (5, 32, 64, 3) and fps == 25.0 and got.shape == pcm.shape == (2, 797 * 6)
        tracks.append(got)
        wavs.append(pcm)
    # each MP4 has its own video's sound (the tiny vocoder's waveforms share much: 0.67 measured between them)
    c = [[corr(t, w) for w in wavs] for t in tracks]
    assert min(c[0][0], c[1][1]) > 0.9 and c[0][0] > c[0][1] + 0.1 and c[1][1] > c[1][0] + 0.1, c


@pytest.mark.parametrize("argv,match", [
    ([WAN, "--audio-out", "{tmp}/s.wav", "--out", "{tmp}/x.mp4"], "--audio-out: WanPipeline makes no sound"),
    ([str(LTX2), "--audio-out", "{tmp}/s.mp3", "--out", "{tmp}/x.mp4"], "must be a .wav file"),
    ([str(LTX2), "--audio-out", "{tmp}/x.mp4", "--out", "{tmp}/x.mp4"], "must be a .wav file"),
    ([str(LTX2), "--audio-out", "{tmp}/link.wav", "--out", "{tmp}/x.mp4"], "is also the --out output"),
    ([str(LTX2), "--audio-out", "{tmp}/s.wav", "--out", "{tmp}/x.mp4", "--json", "{tmp}/s.wav"],
     "is also the --audio-out output"),
    ([str(LTX2), "--audio-out", "{tmp}/nofolder/s.wav", "--out", "{tmp}/x.mp4"], "does not exist"),
    ([str(LTX2), "--guidance-2", "3", "--out", "{tmp}/x.mp4"], "--guidance-2: LTX2Pipeline has no second"),
])
def test_refused_before_loading(argv, match, tmp_path, capsys, monkeypatch):
    (tmp_path / "link.wav").symlink_to(tmp_path / "x.mp4")  # a dangling link to the --out file
    monkeypatch.setattr(generate, "load", lambda args: pytest.fail("loaded despite bad input"))
    assert generate.main([a.format(tmp=tmp_path) for a in argv[:1]] + ["--prompt", "a dog"] +
                         [a.format(tmp=tmp_path) for a in argv[1:]]) != 0
    assert match in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.wav"]  # nothing written
    assert not os.path.exists(tmp_path / "x.mp4")
