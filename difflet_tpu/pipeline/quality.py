"""PSNR and SSIM of two images or videos in [0, 1] (the step cache's quality gate).

scikit-image is not a dependency, so both are written here in numpy (and scipy's Gaussian
filter; scipy comes with jax):

- PSNR: `10 log10(1 / MSE)` over every value (data range 1), +inf for equal inputs.
- SSIM: Wang, Bovik, Sheikh, Simoncelli, "Image quality assessment: from error visibility to
  structural similarity", IEEE TIP 2004, eq. (13), with its constants K1 = 0.01, K2 = 0.03 and
  the Gaussian window of sigma 1.5 (11 x 11: truncated at 3.5 sigma); the local statistics are
  population (not sample) moments, the borders reflected and then cropped by the window's
  radius before the mean, as scikit-image's `structural_similarity(gaussian_weights=True,
  use_sample_covariance=False, data_range=1)` computes it. Per channel of every frame, then the
  mean.
"""

from __future__ import annotations

import numpy as np

SIGMA, TRUNCATE, K1, K2 = 1.5, 3.5, 0.01, 0.03


def as_pixels(images) -> np.ndarray:
    """float64 [..., H, W, C] in [0, 1] from a pipeline's "np" output or (lists of) PIL images."""
    if isinstance(images, (list, tuple)):
        return np.stack([as_pixels(x) for x in images])
    x = np.asarray(images)
    return x.astype(np.float64) / 255.0 if x.dtype == np.uint8 else x.astype(np.float64)


def psnr(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else float(10 * np.log10(1.0 / mse))


def ssim(a, b) -> float:
    """Mean SSIM over the channels of every image of `a` and `b`, [..., H, W, C] in [0, 1]."""
    from scipy.ndimage import gaussian_filter

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim < 3:
        raise ValueError(f"ssim: two [..., H, W, C] arrays of one shape expected, got {a.shape} and {b.shape}")
    h, w, c = a.shape[-3:]
    a, b = a.reshape(-1, h, w, c), b.reshape(-1, h, w, c)
    pad = int(TRUNCATE * SIGMA + 0.5)
    c1, c2 = K1 ** 2, K2 ** 2
    values = []
    for x, y in zip(a, b):
        for ch in range(c):
            f = lambda z: gaussian_filter(z, SIGMA, truncate=TRUNCATE, mode="reflect")
            xs, ys = x[..., ch], y[..., ch]
            mx, my = f(xs), f(ys)
            vx, vy, cxy = f(xs * xs) - mx * mx, f(ys * ys) - my * my, f(xs * ys) - mx * my
            s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
            crop = s[pad:h - pad, pad:w - pad] if h > 2 * pad and w > 2 * pad else s
            values.append(crop.mean())
    return float(np.mean(values))
