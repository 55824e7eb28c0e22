"""Videos out of a pipeline: H.264 MP4 files written atomically with PyAV, and read back.

`write_mp4(frames, path, fps)` encodes uint8 `[F, H, W, 3]` frames (or float frames in [0, 1],
converted as diffusers' `export_to_video` does: `round(255 x)`) with libx264 into a temporary
file beside `path` and renames it into place (`checks.write_atomic`): a reader never sees a
partial file, and an error leaves none behind. `check_writable` refuses a destination before
any work. H.264 in yuv420p needs even sizes; the pipelines' sizes are multiples of 16.
`read_mp4(path)` decodes a file back to `([F, H, W, 3] uint8, fps)` (PyAV), for tests and
for a person checking what was written.

With `audio=` (float `[channels, samples]`, LTX-2's waveform) and `sample_rate=`, the file also
gets an AAC track (`pipeline/audio.py`) beside the video, in the same atomic write; its length is
the waveform's (the MP4's edit list trims the encoder's priming and padding, so it decodes back to
exactly the samples written). `read_mp4(path, audio=True)` returns the track too.
"""

from __future__ import annotations

import fractions
import os
from pathlib import Path

import numpy as np

from difflet_tpu import checks

CRF = 18  # libx264's constant quality: visually near lossless, a few MB per 81-frame 720p clip


def check_writable(path) -> Path:
    """Refuses, before any work, a destination that cannot be written: not .mp4, a folder, its
    folder missing or not writable, or an existing file that is not writable (`images.check_writable`)."""
    from difflet_tpu.pipeline import images

    suffix = Path(path).suffix
    return images.check_writable(path, ".mp4", f"the output must be an .mp4 file (H.264); got "
                                              f"{suffix or 'no suffix'!r}", "video.mp4")


def as_uint8_frames(frames) -> np.ndarray:
    """`[F, H, W, 3]` uint8 as given, or float in [0, 1] (finite) as `round(255 x)`; a list of
    PIL images is stacked."""
    if isinstance(frames, list) and frames and hasattr(frames[0], "convert"):
        frames = np.stack([np.asarray(f.convert("RGB")) for f in frames])
    x = np.asarray(frames)
    if x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"frames must be [frames, height, width, 3], got shape {x.shape}")
    if x.dtype == np.uint8:
        return x
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"frames must be uint8 or floating point in [0, 1], got {x.dtype}")
    bad = ~np.isfinite(x)
    if bad.any():
        raise FloatingPointError(f"frames hold {int(bad.sum())} non-finite values: refusing to write them")
    if x.min() < 0 or x.max() > 1:
        raise ValueError(f"float frames must be in [0, 1], got [{float(x.min())}, {float(x.max())}]")
    return (x * 255).round().astype(np.uint8)


def check_fps(fps) -> fractions.Fraction:
    if isinstance(fps, bool) or not isinstance(fps, (int, float, np.integer, np.floating)) \
            or not np.isfinite(fps) or not 0 < fps <= 240:
        raise ValueError(f"fps must be a number in (0, 240], got {fps!r}")
    return fractions.Fraction(fps).limit_denominator(1001)


def write_mp4(frames, path, fps=16, audio=None, sample_rate=None) -> Path:
    """One video (`[F, H, W, 3]` uint8 or float in [0, 1], or a list of PIL frames) to `path`
    as H.264 (yuv420p) at `fps`, with `audio` (`[channels, samples]` at `sample_rate` Hz) as an
    AAC track when given, atomically."""
    path = check_writable(path)
    checks.write_atomic(path, mp4_writer(frames, fps, audio, sample_rate), "video")
    return path


def mp4_writer(frames, fps=16, audio=None, sample_rate=None):
    """A writer of `frames` (and `audio`) as an MP4 into an open binary file (for
    `checks.write_atomic` / `write_all_atomic`); everything is checked here, before anything is
    written."""
    import av

    from difflet_tpu.pipeline import audio as A

    rate = check_fps(fps)
    x = as_uint8_frames(frames)
    if x.shape[1] % 2 or x.shape[2] % 2:
        raise ValueError(f"H.264 (yuv420p) needs even sizes, got {x.shape[2]}x{x.shape[1]}")
    if (audio is None) != (sample_rate is None):
        raise ValueError("audio and sample_rate go together: give both for a sound track, or neither")
    if audio is not None:
        audio, sample_rate = A.check_aac(audio, sample_rate)

    def write(f):
        with av.open(f, mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=rate)
            stream.width, stream.height, stream.pix_fmt = x.shape[2], x.shape[1], "yuv420p"
            stream.options = {"crf": str(CRF)}
            track = A.add_aac_stream(container, audio.shape[0], sample_rate) if audio is not None else None
            for frame in x:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())  # flush the encoder
            if track is not None:
                A.encode_aac(container, track, audio, sample_rate)

    return write


def mp4_paths(path, n: int) -> list[Path]:
    """One video -> `path`; several -> `stem-0.mp4`, `stem-1.mp4`, ... beside it."""
    path = Path(path)
    return [path] if n == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(n)]


def save_mp4s(videos, path, fps=16, audio=None, sample_rate=None) -> list[Path]:
    """A batch of videos (and of waveforms, one per video) to `mp4_paths(path, len(videos))`:
    every destination checked before the first is written, and all written or none."""
    videos = list(videos)
    targets = mp4_paths(path, len(videos))
    for t in targets:
        check_writable(t)
    sounds = [None] * len(videos) if audio is None else list(audio)
    if len(sounds) != len(videos):
        raise ValueError(f"{len(videos)} videos but {len(sounds)} waveforms: give one waveform per video")
    checks.write_all_atomic([(t, mp4_writer(v, fps, a, sample_rate if a is not None else None), "video")
                             for v, a, t in zip(videos, sounds, targets)])
    return targets


def read_mp4(path, audio: bool = False) -> tuple:
    """`([F, H, W, 3] uint8, frames per second)` of a video file; with `audio=True` also its first
    audio track as float32 `[channels, samples]` and its sample rate (None, None: no track)."""
    import av

    from difflet_tpu.pipeline import audio as A

    with av.open(os.fspath(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        fps = float(stream.average_rate) if stream.average_rate else float("nan")
    if not audio:
        return np.stack(frames), fps
    with av.open(os.fspath(path)) as container:  # a second pass: decode() reads the file to its end
        wave, rate = A.decode_audio(container, container.streams.audio[0]) if container.streams.audio else (None, None)
    return np.stack(frames), fps, wave, rate
