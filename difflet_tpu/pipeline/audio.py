"""Sound out of a pipeline (LTX-2's waveform): 16-bit PCM WAV files, and the AAC track of an MP4.

`check_audio(audio, sample_rate)` takes a waveform as the pipelines give one per video (float
`[channels, samples]`, mono or stereo; a 1-D array is mono) and clips it to [-1, 1] as diffusers'
`encode_video` does (diffusers/utils/export_utils.py; LTX-2's vocoder ends in tanh, so this
only guards against other sources). `wav_writer` / `save_wav` write it as 16-bit PCM
(`round(32767 x)`, the standard library's `wave`) atomically (`checks.write_atomic`), and
`read_wav` reads one back. `add_aac_stream` / `encode_aac` put it into an open PyAV container as
AAC-LC (FFmpeg's `aac` encoder, fed float planar `fltp` frames of its frame size through PyAV's
`AudioResampler`): `mp4.mp4_writer(..., audio=, sample_rate=)` muxes it beside the video.
"""

from __future__ import annotations

import os
import wave
from pathlib import Path

import numpy as np

from difflet_tpu import checks

# The sampling rates AAC has (ISO/IEC 14496-3's sampling frequency index); the encoder refuses others.
AAC_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)
AAC_FRAME = 1024  # samples per channel in one AAC-LC frame
# 128 kbit/s per channel: FFmpeg's default (~100 kbit/s for stereo at 24 kHz) keeps a tone but
# drops much of a noise-like waveform (correlation 0.54 measured on white noise, 0.98 at this rate);
# the track stays a small part of the file (H.264 at CRF 18 is several Mbit/s at 720p).
AAC_BIT_RATE_PER_CHANNEL = 128_000
LAYOUTS = {1: "mono", 2: "stereo"}


def check_audio(audio, sample_rate) -> tuple[np.ndarray, int]:
    """A waveform `[channels, samples]` (1 or 2 channels; 1-D: mono) of finite floats and its
    rate (an integer number of Hz) -> (float32 `[channels, samples]` clipped to [-1, 1], rate)."""
    x = np.asarray(audio)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.shape[0] not in LAYOUTS or x.shape[1] == 0:
        raise ValueError(f"audio must be a waveform [channels, samples] with 1 or 2 channels and at least one "
                         f"sample, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"audio must be floating point in [-1, 1], got {x.dtype}")
    bad = ~np.isfinite(x)
    if bad.any():
        raise FloatingPointError(f"the audio holds {int(bad.sum())} non-finite values: refusing to write them")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or not 0 < sample_rate <= 384000:
        raise ValueError(f"sample_rate must be a whole number of Hz in (0, 384000], got {sample_rate!r}")
    return np.clip(x, -1.0, 1.0).astype(np.float32), int(sample_rate)


def check_wav_writable(path) -> Path:
    """`images.check_writable` with the .wav suffix: refused before any work."""
    from difflet_tpu.pipeline import images

    suffix = Path(path).suffix
    return images.check_writable(path, ".wav", f"the audio output must be a .wav file (16-bit PCM); got "
                                              f"{suffix or 'no suffix'!r}", "sound.wav")


def wav_paths(path, n: int) -> list[Path]:
    """One waveform -> `path`; several -> `stem-0.wav`, `stem-1.wav`, ... (as images and videos)."""
    from difflet_tpu.pipeline import images

    return images.png_paths(path, n)


def to_pcm16(audio) -> np.ndarray:
    """Clipped [-1, 1] floats -> int16 `round(32767 x)` (at most half a step, 1.5e-5, off)."""
    return np.round(audio * 32767.0).astype(np.int16)


def wav_writer(audio, sample_rate):
    """A writer of the waveform as a 16-bit PCM WAV into an open binary file (for
    `checks.write_atomic` / `write_all_atomic`); the waveform and rate are checked here."""
    x, rate = check_audio(audio, sample_rate)
    pcm = np.ascontiguousarray(to_pcm16(x).T).astype("<i2")  # interleaved, little-endian

    def write(f):
        with wave.open(f, "wb") as w:  # closes the WAV writer, not `f`
            w.setnchannels(x.shape[0])
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(pcm.tobytes())

    return write


def save_wav(audio, path, sample_rate) -> Path:
    """One waveform to `path` as 16-bit PCM, atomically."""
    path = check_wav_writable(path)
    checks.write_atomic(path, wav_writer(audio, sample_rate), "audio")
    return path


def read_wav(path) -> tuple[np.ndarray, int]:
    """`(float32 [channels, samples] = int16 / 32767, sample rate)` of a 16-bit PCM WAV file."""
    with wave.open(os.fspath(path), "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: {8 * w.getsampwidth()}-bit samples; read_wav reads 16-bit PCM")
        channels, rate = w.getnchannels(), w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    return pcm.reshape(-1, channels).T.astype(np.float32) / 32767.0, rate


def check_aac(audio, sample_rate) -> tuple[np.ndarray, int]:
    """`check_audio`, and a rate AAC has."""
    x, rate = check_audio(audio, sample_rate)
    if rate not in AAC_RATES:
        raise ValueError(f"an AAC track takes the sampling rates {', '.join(map(str, AAC_RATES))} Hz; got {rate}")
    return x, rate


def add_aac_stream(container, channels: int, sample_rate: int):
    """An AAC-LC stream in `container` (before anything is muxed: MP4 writes its header first)."""
    stream = container.add_stream("aac", rate=sample_rate)
    stream.layout = LAYOUTS[channels]
    stream.bit_rate = AAC_BIT_RATE_PER_CHANNEL * channels
    return stream


def encode_aac(container, stream, audio: np.ndarray, sample_rate: int) -> None:
    """`audio` (checked: float32 `[channels, samples]`) through the resampler into the encoder's
    format, layout and frame size, encoded and muxed; the encoder flushed."""
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio), format="fltp", layout=LAYOUTS[audio.shape[0]])
    frame.sample_rate, frame.pts = sample_rate, 0
    cc = stream.codec_context
    resampler = av.AudioResampler(format=cc.format.name if cc.format else "fltp", layout=cc.layout.name,
                                  rate=sample_rate, frame_size=cc.frame_size or AAC_FRAME)
    for chunk in resampler.resample(frame) + resampler.resample(None):  # None: the resampler's tail
        container.mux(stream.encode(chunk))
    container.mux(stream.encode())  # flush the encoder


def decode_audio(container, stream) -> tuple[np.ndarray, int]:
    """Every sample of an audio stream as float32 `[channels, samples]`, and its rate."""
    import av

    rate = stream.codec_context.sample_rate
    resampler = av.AudioResampler(format="fltp", layout=stream.codec_context.layout.name, rate=rate)
    chunks = [c.to_ndarray() for f in container.decode(stream) for c in resampler.resample(f)]
    chunks += [c.to_ndarray() for c in resampler.resample(None)]
    channels = stream.codec_context.channels
    return (np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), np.float32)), rate
