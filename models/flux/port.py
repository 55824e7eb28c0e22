"""Running FLUX: diffusers' `FluxTransformer2DModel.forward` kwargs -> the step's inputs.

`prepare` validates the kwargs against the config (errors before anything
compiles), pads each stream eagerly under SP (`Runner.rows`), and builds on
the host what diffusers computes from scalars and ids: the timestep /
guidance sinusoids (cast to the model dtype before the x1000, as
`CombinedTimestepGuidanceTextProjEmbeddings` does) and the RoPE tables
(`layers.rope.position_tables`; cached while the ids stay the same). `forward` is the step.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from difflet_tpu.layers.rope import RopeLayout, position_tables
from difflet_tpu.port import (Prepared, call_model, check_per_sample, packed_image_grid, packed_streams, randn,
                              returned_sample, shape)
from jax.sharding import PartitionSpec as P

from .config import ROPE_THETA, FluxConfig
from .model import timestep_proj

FORWARD_ARGS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
                "txt_ids", "guidance", "joint_attention_kwargs", "controlnet_block_samples",
                "controlnet_single_block_samples", "return_dict", "controlnet_blocks_repeat")
STEP_KWARGS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
               "txt_ids", "guidance")


def _check(run, kw):
    c = run.cfg
    extra = {k: v for k, v in kw.items() if k not in STEP_KWARGS}
    if extra.get("joint_attention_kwargs"):
        raise ValueError("joint_attention_kwargs (IP-Adapter, LoRA scale) is not supported by this port")
    for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
        if extra.get(name) is not None:
            raise ValueError(f"{name}: ControlNet residuals are not supported by this port")
    if extra.get("controlnet_blocks_repeat"):
        raise ValueError("controlnet_blocks_repeat: ControlNet residuals are not supported by this port")
    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
                 "txt_ids"):
        if kw.get(name) is None:
            raise ValueError(f"{name} is required")
    B, n_img, n_txt = packed_streams(c, kw["hidden_states"], kw["encoder_hidden_states"])
    pooled = shape(kw["pooled_projections"])
    if pooled != (B, c.pooled_projection_dim):
        raise ValueError(f"pooled_projections: shape {pooled}, expected ({B}, {c.pooled_projection_dim})")
    for name in ("timestep", "guidance"):
        if kw.get(name) is not None:
            check_per_sample(name, kw[name], B)
    if c.guidance_embeds and kw.get("guidance") is None:
        raise ValueError("guidance is required: this model has a guidance embedder (FLUX.1-dev style, "
                         "guidance_embeds=True); pass the raw guidance scale, e.g. [3.5]")
    if not c.guidance_embeds and kw.get("guidance") is not None:
        raise ValueError("guidance must be None: this model has no guidance embedder (FLUX.1-schnell "
                         "style, guidance_embeds=False)")
    for name, n in (("img_ids", n_img), ("txt_ids", n_txt)):
        s = shape(kw[name])
        if len(s) == 3:  # deprecated batched ids: diffusers takes [0]
            s = s[1:]
        if s != (n, len(c.axes_dims_rope)):
            raise ValueError(f"{name}: shape {shape(kw[name])}, expected ({n}, {len(c.axes_dims_rope)})")
    return B, n_img, n_txt


def _tables(run, txt_ids, img_ids, n_txt_pad, n_img_pad):
    """cos, sin [S_pad, head_dim] for [txt_pad | img_pad] (pad rows: cos 1, sin 0), in
    split-halves order when the model's q/k are; cached by the ids."""
    txt_ids = np.asarray(txt_ids, np.float32)
    img_ids = np.asarray(img_ids, np.float32)
    txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
    img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    h = hashlib.sha256()
    for a in (txt_ids, img_ids):
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    c = run.cfg

    def make():
        hd = c.attention_head_dim
        cos = np.ones((n_txt_pad + n_img_pad, hd), np.float32)
        sin = np.zeros((n_txt_pad + n_img_pad, hd), np.float32)
        for ids, start in ((txt_ids, 0), (img_ids, n_txt_pad)):
            ct, st = position_tables(ids, c.axes_dims_rope, ROPE_THETA)
            cos[start:start + len(ids)] = ct
            sin[start:start + len(ids)] = st
        rope = RopeLayout(c.num_attention_heads, hd, c.split_rope)
        return rope.table(cos), rope.table(sin)

    return run.constant(("rope", h.hexdigest(), n_txt_pad, n_img_pad), make)


def prepare(run, kw: dict) -> Prepared:
    """diffusers kwargs -> the step's inputs (eager: validation, padding, tables)."""
    B, n_img, n_txt = _check(run, kw)
    dtype = run.dtype
    hidden_states, n_img_pad = run.pad_stream(kw["hidden_states"], "image tokens")
    encoder_hidden_states, n_txt_pad = run.pad_stream(kw["encoder_hidden_states"], "text tokens")
    kv_mask = run.pad_key_mask((n_txt, n_txt_pad), (n_img, n_img_pad))

    def proj(x):  # diffusers: x.to(model dtype) * 1000, then Timesteps(256)
        return timestep_proj(np.broadcast_to(np.asarray(x).reshape(-1), (B,)), dtype)

    rows = run.row_spec()
    inputs = dict(
        hidden_states=hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        pooled_projections=kw["pooled_projections"],
        timesteps_proj=proj(kw["timestep"]),
        guidance_proj=proj(kw["guidance"]) if kw.get("guidance") is not None else np.zeros((B, 256), np.float32))
    inputs["freqs_cos"], inputs["freqs_sin"] = _tables(run, kw["txt_ids"], kw["img_ids"], n_txt_pad, n_img_pad)
    specs = {k: run.batch_spec() for k in inputs}  # pooled, timestep and guidance: (B, ...)
    specs["hidden_states"] = specs["encoder_hidden_states"] = rows
    specs["freqs_cos"] = specs["freqs_sin"] = P()
    if kv_mask is not None:
        inputs["kv_mask"] = kv_mask
        specs["kv_mask"] = P()
    return Prepared(key=kv_mask is not None, inputs=inputs, specs=specs, out_specs=rows,
                    finish=returned_sample(n_img, kw.get("return_dict", True)))


forward = call_model  # the step: `FluxTransformer2DModel.__call__(par, **inputs)`


# --------------------------------------------------------------------------
# Benchmark inputs and FLOPs
# --------------------------------------------------------------------------

def example_inputs(config: FluxConfig, *, height: int = 1024, width: int = 1024, frames=None, batch: int = 1,
                   seed: int = 0, dtype=np.float32, text_len: int = 512, abstract: bool = False) -> dict:
    """diffusers forward kwargs for a `height x width` image (numpy, or ShapeDtypeStructs).

    As the FluxPipeline makes them: VAE 8x and 2x2 packing -> (H/16) x (W/16)
    image tokens of in_channels features, `text_len` T5 tokens (512), timestep
    1.0 (sigma at the first step, /1000 as the pipeline passes it), guidance 3.5
    (dev only), img_ids (0, row, col), txt_ids zeros. `frames` is ignored (images).
    """
    del frames
    h, w = packed_image_grid(height, width)
    n = h * w
    c = config
    img_ids = np.zeros((h, w, 3), np.float32)
    img_ids[..., 1] = np.arange(h)[:, None]
    img_ids[..., 2] = np.arange(w)[None, :]
    shapes = dict(hidden_states=((batch, n, c.in_channels), dtype),
                  encoder_hidden_states=((batch, text_len, c.joint_attention_dim), dtype),
                  pooled_projections=((batch, c.pooled_projection_dim), dtype),
                  timestep=((batch,), np.float32),
                  img_ids=((n, 3), np.float32), txt_ids=((text_len, 3), np.float32))
    if c.guidance_embeds:
        shapes["guidance"] = ((batch,), np.float32)
    if abstract:
        return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}
    rng = np.random.default_rng(seed)
    out = {k: randn(rng, shapes[k][0], dtype) for k in ("hidden_states", "encoder_hidden_states", "pooled_projections")}
    out["timestep"] = np.full((batch,), 1.0, np.float32)
    out["img_ids"] = img_ids.reshape(n, 3)
    out["txt_ids"] = np.zeros((text_len, 3), np.float32)
    if c.guidance_embeds:
        out["guidance"] = np.full((batch,), 3.5, np.float32)
    return out


def flops(config: FluxConfig, inputs: dict) -> float:
    """Analytic forward FLOPs: linears 2*n*d_in*d_out,
    attention 4*S^2*D per block; softmax, norms and RoPE ignored."""
    c = config
    B, n_img = shape(inputs["hidden_states"])[:2]
    n_txt = shape(inputs["encoder_hidden_states"])[1]
    N = n_img + n_txt
    D, F = c.inner_dim, c.mlp_hidden_dim
    double = sum(2 * n * (4 * D * D + 2 * D * 4 * D) for n in (n_img, n_txt))
    single = 2 * N * (3 * D * D + D * F + (D + F) * D)
    attn = 4 * N * N * D
    blocks = c.num_layers * (double + attn) + c.num_single_layers * (single + attn)
    embed = 2 * n_img * c.in_channels * D + 2 * n_txt * c.joint_attention_dim * D + 2 * n_img * D * c.out_features
    temb = 2 * (256 * D + D * D) * (2 if c.guidance_embeds else 1) + 2 * (c.pooled_projection_dim * D + D * D)
    modulation = 2 * D * (c.num_layers * 12 * D + c.num_single_layers * 3 * D + 2 * D)
    return float(B * (blocks + embed + temb + modulation))
