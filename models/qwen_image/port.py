"""Running Qwen-Image: diffusers' `QwenImageTransformer2DModel.forward` kwargs -> the step's inputs.

`prepare` validates the kwargs against the config (errors before anything
compiles), pads each token stream eagerly under SP (`Runner.rows`), and builds
on the host what diffusers computes from `img_shapes` and the text mask: the
RoPE tables (`rope.py`; cached per geometry), the joint key mask (masked text
keys and pad keys False), zero_cond_t's condition rows. `forward` is the step;
`finish` cuts the image pad off.

diffusers' forward arguments: `hidden_states` `(B, N, in_channels)` (packed
2x2 latents; the edit pipelines concatenate the condition images' tokens after
the target's), `encoder_hidden_states` `(B, L, joint_attention_dim)`,
`encoder_hidden_states_mask` `(B, L)` (1 valid, 0 masked, any pattern; None:
all valid), `timestep` `(B,)` (the pipeline's t / 1000), `img_shapes` (one
list of (frame, height, width) per item; diffusers' RoPE reads the first
item's, so the items must be equal here), `guidance` (must be None),
`additional_t_cond` `(B,)` in {0, 1} (use_additional_t_cond only),
`attention_kwargs`, `controlnet_block_samples` (refused), `return_dict`.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from difflet_tpu.port import (Prepared, call_model, check_per_sample, packed_image_grid, packed_streams, randn,
                              returned_sample, shape)

from .config import QwenImageConfig
from .rope import check_shapes, joint_tables

FORWARD_ARGS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "img_shapes",
                "guidance", "attention_kwargs", "controlnet_block_samples", "additional_t_cond", "return_dict")
TEXT_LEN = 128  # example_inputs' prompt tokens (QwenImagePipeline passes the prompt's own length, template cut)
VAE_SCALE = 8   # QwenImagePipeline: vae_scale_factor 8, latents packed 2x2 -> pixels / 16 per token side


def image_shapes(img_shapes, batch: int) -> tuple:
    """diffusers' `img_shapes` -> one item's shapes as a tuple of (frame, height, width).

    Accepts a list (or array) of one entry per item (or one entry for the batch),
    each entry a (frame, height, width) or a list of them. diffusers' QwenEmbedRope
    uses the first item's shapes for the whole batch (warning when they differ), so
    differing items are refused here."""
    if img_shapes is None:
        raise ValueError("img_shapes is required: one list of (frame, height, width) per batch item, e.g. "
                         "[[(1, height // 16, width // 16)]] * batch")
    try:
        items = [np.asarray(item) for item in (img_shapes.tolist() if hasattr(img_shapes, "tolist")
                                               else list(img_shapes))]
    except (TypeError, ValueError):
        items = []
    shapes = []
    for item in items:
        if item.dtype.kind not in "iu" and not (item.dtype.kind == "f" and np.all(item == np.round(item))):
            break
        item = item.reshape(1, 3) if item.shape == (3,) else item
        if item.ndim != 2 or item.shape[1] != 3 or item.shape[0] < 1 or np.any(item < 1):
            break
        shapes.append(tuple(tuple(int(v) for v in s) for s in item))
    else:
        if shapes and len(shapes) in (1, batch):
            if any(s != shapes[0] for s in shapes):
                raise ValueError(f"img_shapes: the items differ ({shapes}); diffusers' QwenEmbedRope uses the "
                                 f"first item's shapes for the whole batch, so pass equal shapes per item (or run "
                                 f"the items separately)")
            return shapes[0]
    raise ValueError(f"img_shapes: {img_shapes!r} is not one list of positive (frame, height, width) per batch "
                     f"item ({batch} items, or one for the batch)")


def _check(run, kw):
    """Validates every input against the config; returns (B, n_img, n_txt, shapes)."""
    c = run.cfg
    if kw.get("attention_kwargs"):
        raise ValueError("attention_kwargs (LoRA scale) is not supported by this port")
    if kw.get("controlnet_block_samples") is not None:
        raise ValueError("controlnet_block_samples: ControlNet residuals are not supported by this port")
    for name in ("hidden_states", "encoder_hidden_states", "timestep"):
        if kw.get(name) is None:
            raise ValueError(f"{name} is required")
    B, n_img, n_txt = packed_streams(c, kw["hidden_states"], kw["encoder_hidden_states"])
    mask = kw.get("encoder_hidden_states_mask")
    if mask is not None and shape(mask) != (B, n_txt):
        raise ValueError(f"encoder_hidden_states_mask: shape {shape(mask)}, expected (batch, text tokens) = "
                         f"{(B, n_txt)}")
    check_per_sample("timestep", kw["timestep"], B)
    if kw.get("guidance") is not None:
        raise ValueError("guidance must be None: QwenImageTransformer2DModel has no guidance embedder (diffusers "
                         "0.42.1's forward raises a TypeError when it is passed); use true CFG in the pipeline")
    t_cond = kw.get("additional_t_cond")
    if c.use_additional_t_cond:
        if t_cond is None:
            raise ValueError("additional_t_cond is required: this model has use_additional_t_cond "
                             "(Qwen-Image-Layered: 0 per item for RGB outputs)")
        a = np.asarray(t_cond)
        if a.shape not in ((B,), (1,)) or a.dtype.kind not in "iub" or np.any((a < 0) | (a > 1)):
            raise ValueError(f"additional_t_cond: {t_cond!r}, expected ({B},) integers in {{0, 1}} "
                             f"(rows of addition_t_embedding)")
    elif t_cond is not None:
        raise ValueError("additional_t_cond must be None: this model has no addition_t_embedding "
                         "(use_additional_t_cond=False)")
    shapes = image_shapes(kw.get("img_shapes"), B)
    total = sum(f * h * w for f, h, w in shapes)
    if total != n_img:
        raise ValueError(f"img_shapes {list(shapes)} cover {total} image tokens, hidden_states has {n_img}")
    check_shapes(shapes, n_txt, c.use_layer3d_rope)
    return B, n_img, n_txt, shapes


def prepare(run, kw: dict) -> Prepared:
    """diffusers kwargs -> the step's inputs (eager: validation, padding, tables, masks)."""
    B, n_img, n_txt, shapes = _check(run, kw)
    c = run.cfg
    hidden_states, n_img_pad = run.pad_stream(kw["hidden_states"], "image tokens")
    encoder_hidden_states, n_txt_pad = run.pad_stream(kw["encoder_hidden_states"], "text tokens")
    pad_mask = run.pad_key_mask((n_txt, n_txt_pad), (n_img, n_img_pad))

    rows = run.row_spec()
    inputs = dict(
        hidden_states=hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        timestep=np.broadcast_to(np.asarray(kw["timestep"], np.float32).reshape(-1), (B,)).copy())
    specs = dict(hidden_states=rows, encoder_hidden_states=rows, timestep=run.batch_spec())
    inputs["freqs_cos"], inputs["freqs_sin"] = run.constant(
        ("rope", shapes, n_txt, n_txt_pad, n_img_pad), lambda: joint_tables(c, shapes, n_txt, n_txt_pad, n_img_pad))
    specs["freqs_cos"] = specs["freqs_sin"] = P()

    # Joint key mask over [text | pad | image | pad]: diffusers' bool attention mask
    # [encoder_hidden_states_mask | ones(image)], and the pad keys.
    mask = kw.get("encoder_hidden_states_mask")
    if mask is not None:
        kv = np.zeros((B, n_txt_pad + n_img_pad), bool)
        kv[:, :n_txt] = np.asarray(mask) != 0
        kv[:, n_txt_pad:n_txt_pad + n_img] = True
        if not run.mask_pad_keys:
            kv[:, n_txt:n_txt_pad] = kv[:, n_txt_pad + n_img:] = True
        inputs["kv_mask"], specs["kv_mask"] = kv, run.batch_spec()  # (B, S): per sample
        key = "text"
    elif pad_mask is not None:
        inputs["kv_mask"] = pad_mask
        specs["kv_mask"] = P()
        key = "pad"
    else:
        key = None
    if c.use_additional_t_cond:
        inputs["additional_t_cond"] = np.broadcast_to(
            np.asarray(kw["additional_t_cond"]).astype(np.int32).reshape(-1), (B,)).copy()
        specs["additional_t_cond"] = run.batch_spec()
    if c.zero_cond_t:  # diffusers' modulate_index: 0 for the first shape's tokens, 1 after them
        first = shapes[0][0] * shapes[0][1] * shapes[0][2]
        inputs["cond_rows"] = run.constant(("cond_rows", first, n_img, n_img_pad),
                                           lambda: (np.arange(n_img_pad) >= first) & (np.arange(n_img_pad) < n_img))
        specs["cond_rows"] = run.row_spec(ndim=1, axis=0, batch=None)  # per token, no batch
    return Prepared(key=key, inputs=inputs, specs=specs, out_specs=rows,
                    finish=returned_sample(n_img, kw.get("return_dict", True)))


forward = call_model  # the step: `QwenImageTransformer2DModel.__call__(par, **inputs)`


# --------------------------------------------------------------------------
# Benchmark inputs and FLOPs
# --------------------------------------------------------------------------

def example_inputs(config: QwenImageConfig, *, height: int = 1024, width: int = 1024, frames=None, batch: int = 1,
                   seed: int = 0, dtype=np.float32, text_len: int = TEXT_LEN) -> dict:
    """diffusers forward kwargs for a `height x width` image, as QwenImagePipeline makes them.

    VAE 8x and 2x2 packing -> (H/16) x (W/16) tokens of in_channels features,
    img_shapes [[(1, H/16, W/16)]] per item, `text_len` prompt tokens, timestep
    1.0 (sigma at the first step, t / 1000 as the pipeline passes it). At batch 1
    no text mask (the pipeline passes None when every token is valid); at batch 2
    (true CFG: rows [negative, positive]) a long 0/1 mask whose first row, the
    negative prompt, is half as long. use_additional_t_cond: additional_t_cond 0
    (QwenImageLayeredPipeline's `is_rgb`). `frames` is ignored (images).
    """
    del frames
    h, w = packed_image_grid(height, width)
    c = config
    rng = np.random.default_rng(seed)
    out = dict(hidden_states=randn(rng, (batch, h * w, c.in_channels), dtype),
               encoder_hidden_states=randn(rng, (batch, text_len, c.joint_attention_dim), dtype),
               timestep=np.full((batch,), 1.0, np.float32),
               img_shapes=[[(1, h, w)]] * batch)
    if batch > 1:
        mask = np.ones((batch, text_len), np.int64)
        mask[0, max(1, text_len // 2):] = 0
        out["encoder_hidden_states_mask"] = mask
    if c.use_additional_t_cond:
        out["additional_t_cond"] = np.zeros((batch,), np.int64)
    return out


def flops(config: QwenImageConfig, inputs: dict) -> float:
    """Analytic forward FLOPs: linears 2*n*d_in*d_out, attention 4*S^2*D per block;
    softmax, norms and RoPE ignored."""
    c = config
    B, n_img = shape(inputs["hidden_states"])[:2]
    n_txt = shape(inputs["encoder_hidden_states"])[1]
    S, D, F = n_img + n_txt, c.inner_dim, c.mlp_dim
    stream = lambda n: 2 * n * (4 * D * D + 2 * D * F)
    mods = 2 * D * 6 * D * (3 if c.zero_cond_t else 2)
    block = stream(n_img) + stream(n_txt) + 4 * S * S * D + mods
    temb = 2 * (256 * D + D * D) * (2 if c.zero_cond_t else 1)
    embed = 2 * n_img * c.in_channels * D + 2 * n_txt * c.joint_attention_dim * D
    out = 2 * D * 2 * D + 2 * n_img * D * c.out_features
    return float(B * (c.num_layers * block + temb + embed + out))
