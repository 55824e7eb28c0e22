"""Images out of a pipeline: PIL conversion and PNG files written atomically.

`to_pil` is diffusers' `VaeImageProcessor.numpy_to_pil` ([0, 1] float -> `round(255 x)` uint8).
`save_png` writes to a temporary file in the destination's folder and renames it into place (`checks.write_atomic`),
so a reader never sees a partial file and an error leaves none behind. `check_writable` refuses
an unwritable destination before any work is done.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from difflet_tpu import checks


def check_image(images) -> np.ndarray:
    """A float [B, H, W, 3] (or [H, W, 3]) array in [0, 1], finite; returned as [B, H, W, 3]."""
    x = np.asarray(images)
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise ValueError(f"images must be [batch, height, width, 3] (or 1 channel), got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"images must be floating point in [0, 1], got {x.dtype}")
    bad = ~np.isfinite(x)
    if bad.any():
        raise FloatingPointError(f"images hold {int(bad.sum())} non-finite values (NaN or inf): refusing to write them")
    if x.min() < 0 or x.max() > 1:
        raise ValueError(f"images must be in [0, 1], got [{float(x.min())}, {float(x.max())}]")
    return x


def to_uint8(images) -> np.ndarray:
    return (check_image(images) * 255).round().astype(np.uint8)


def to_pil(images) -> list:
    """[B, H, W, 3] float in [0, 1] -> a list of PIL RGB images (diffusers' numpy_to_pil)."""
    from PIL import Image

    return [Image.fromarray(x[..., 0] if x.shape[-1] == 1 else x)
            for x in to_uint8(images)]


def check_writable(path, suffix: str = ".png", wrong_suffix: str = "the output must be a .png file",
                   example: str = "image.png") -> Path:
    """Refuses, before any work, a destination that cannot be written: not a `suffix` file
    (`wrong_suffix` says so), its folder missing or not writable, the path a folder, or an
    existing file that is not writable. Also the MP4 writer's check (`mp4.check_writable`)."""
    path = Path(path)
    if path.suffix.lower() != suffix:
        raise ValueError(f"{path}: {wrong_suffix}")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file name such as {path / example}")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: the folder {folder} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{path}: the file exists and is not writable")
    return path


def save_png(image, path) -> Path:
    """Writes one image ([H, W, 3] float in [0, 1], or a PIL image) to `path` atomically."""
    from PIL import Image

    path = check_writable(path)
    pil = image if isinstance(image, Image.Image) else to_pil(image)[0]
    checks.write_atomic(path, png_writer(pil), "image")
    return path


def png_paths(path, n: int) -> list[Path]:
    """One image -> `path`; several -> `stem-0.png`, `stem-1.png`, ... beside it."""
    path = Path(path)
    return [path] if n == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(n)]


def png_writer(pil):
    """A writer of `pil` as PNG for checks.write_atomic / write_all_atomic."""
    return lambda f: pil.save(f, format="PNG")


def save_pngs(images, path) -> list[Path]:
    """A batch: one image -> `path`; several -> `stem-0.png`, `stem-1.png`, ... beside it. Every
    destination is checked before the first is written, and all are written or none."""
    x = images if isinstance(images, list) else to_pil(images)
    targets = png_paths(path, len(x))
    for t in targets:
        check_writable(t)
    checks.write_all_atomic([(t, png_writer(img), "image") for img, t in zip(x, targets)])
    return targets


def open_image(image, name: str = "image"):
    """A PIL image from a PIL image, a uint8 array `[H, W, 3]` (or `[H, W]`), or an image file's
    path; ValueError naming `name` for anything else or a file that cannot be read."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise ValueError(f"`{name}`: {path} is not a file")
        try:
            with Image.open(path) as im:
                im.load()
                return im.copy()
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"`{name}`: {path} cannot be read as an image ({e})") from None
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[-1] not in (3, 4)):
            raise ValueError(f"`{name}` as an array must be uint8 [H, W, 3] (or [H, W], [H, W, 4]), got "
                             f"{image.dtype} {image.shape}")
        return Image.fromarray(image)
    raise ValueError(f"`{name}` must be a PIL image, a uint8 [H, W, 3] array or an image file's path, got "
                     f"{type(image).__name__}")


def preprocess(image, height: int, width: int, name: str = "image") -> np.ndarray:
    """diffusers' `VaeImageProcessor.preprocess(image, height, width)` for one image: resized to
    width x height (Lanczos, as its `resample` default), [0, 1] then [-1, 1]: float32 `[1, 3, H, W]`.
    Images that are not RGB are converted to RGB first (diffusers would fail on RGBA / L)."""
    from PIL import Image

    im = open_image(image, name)
    if im.width < 1 or im.height < 1:
        raise ValueError(f"`{name}` is empty ({im.width}x{im.height})")
    if im.mode != "RGB":
        im = im.convert("RGB")
    im = im.resize((int(width), int(height)), resample=Image.Resampling.LANCZOS, reducing_gap=None)
    x = np.asarray(im).astype(np.float32) / 255.0
    return (2.0 * x - 1.0).transpose(2, 0, 1)[None]
