"""Running HunyuanVideo: diffusers' `HunyuanVideoTransformer3DModel.forward` kwargs
-> the step's inputs.

`prepare` validates the kwargs against the config (errors before anything
compiles), cuts the latent into patches (`padding.patchify`, the Conv3d patch
embedder as a Linear), pads both token streams eagerly under SP
(`Runner.rows`; the text mask pads with invalid tokens) and builds the RoPE
tables on the host (`rope.py`; cached per geometry). `forward` is the step;
`finish` cuts the image rows back and unpatchifies, eagerly.

`attention=` (`layers/sparse_masks.py`, docs/sparse-attention.md): the video tokens'
self-attention block-sparse, the text's full both ways. The image rows go in the
plan's order (STA: tile by tile, RoPE rows with them), padded to whole kernel
blocks, so the joint `[video | text]` mask (`sparse_masks.with_dense_tail`) is a
block mask; the output rows are put back in frame-major order.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from difflet_tpu.parallel import padding
from difflet_tpu.parallel.padding import patchify
from difflet_tpu.port import Prepared, check_size, returned_sample

from .config import HunyuanVideoConfig
from .model import Geometry, unpatchify
from .rope import joint_tables

# HunyuanVideo has no attention sink in the radial reference (its rule is Wan's only)
RADIAL_SINK = False

FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                "pooled_projections", "guidance", "attention_kwargs", "return_dict")


def _shape(name, x):
    if x is None:
        raise ValueError(f"{name} is required")
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def check_right_padded(mask) -> None:
    """Each row of the text mask is its valid tokens first (at least one), then padding (1...1 0...0):
    the token refiner reads the mask per token while joint attention counts its ones
    (diffusers does both), so a mask with holes would mean other tokens to each."""
    m = np.asarray(mask) != 0
    empty = np.nonzero(~m.any(axis=1))[0]
    if empty.size:  # no text token at all: the refiner's masked mean divides by zero
        raise ValueError(f"encoder_attention_mask row {int(empty[0])}: no valid text token (all zeros; "
                         f"{empty.size} such row(s)); every sample needs at least one valid token (1...1 0...0)")
    holes = m[:, 1:] & ~m[:, :-1]  # a valid token after a pad token
    if holes.any():
        row, col = (int(v[0]) for v in np.nonzero(holes))
        raise ValueError(f"encoder_attention_mask row {row}: token {col + 1} is valid after a padding token; "
                         f"HunyuanVideo needs the valid tokens first (right padding: 1...1 0...0), as "
                         f"diffusers' joint attention counts them")


def geometry(run, kw: dict) -> Geometry:
    """Checks every input's shape against the config; the static geometry of the step
    (token streams padded by the Runner's rule)."""
    c = run.cfg
    hs = _shape("hidden_states", kw.get("hidden_states"))
    if len(hs) != 5:
        raise ValueError(f"hidden_states must be [B, C, F, H, W], got shape {hs}")
    B, C, F, H, W = hs
    if C != c.in_channels:
        raise ValueError(f"hidden_states has {C} channels; the config has in_channels={c.in_channels}")
    if F % c.patch_size_t or H % c.patch_size or W % c.patch_size:
        raise ValueError(f"hidden_states frames/height/width {F}x{H}x{W} must be multiples of the patch "
                         f"({c.patch_size_t}, {c.patch_size}, {c.patch_size})")
    ehs = _shape("encoder_hidden_states", kw.get("encoder_hidden_states"))
    if len(ehs) != 3 or ehs[0] != B or ehs[2] != c.text_embed_dim:
        raise ValueError(f"encoder_hidden_states must be [B={B}, N_text, {c.text_embed_dim}], got {ehs}")
    n_txt = ehs[1]
    if n_txt < 1:
        raise ValueError("encoder_hidden_states has no tokens")
    m = _shape("encoder_attention_mask", kw.get("encoder_attention_mask"))
    if m != (B, n_txt):
        raise ValueError(f"encoder_attention_mask must be [B, N_text] = {(B, n_txt)}, got {m}")
    check_right_padded(kw["encoder_attention_mask"])
    pp = _shape("pooled_projections", kw.get("pooled_projections"))
    if pp != (B, c.pooled_projection_dim):
        raise ValueError(f"pooled_projections must be {(B, c.pooled_projection_dim)}, got {pp}")
    for name, needed in (("timestep", True), ("guidance", c.guidance_embeds)):
        if kw.get(name) is None and not needed:
            continue
        s = _shape(name, kw.get(name))
        if s not in ((), (1,), (B,)):
            raise ValueError(f"{name} must be a scalar, (1,) or (B,) = ({B},), got {s}")
    fp, hp, wp = F // c.patch_size_t, H // c.patch_size, W // c.patch_size
    n_img = fp * hp * wp
    video = sparse_plan(kw.get("attention"), (fp, hp, wp))
    if video is None:
        n_img_pad, n_txt_pad = run.rows(n_img, "image tokens"), run.rows(n_txt, "text tokens")
    else:  # whole kernel blocks of the plan's rows (and the Runner's multiple): the text starts on a block
        n_txt_pad = run.rows(n_txt, "text tokens")
        n_img_pad = joint_sparsity(video, n_txt_pad, run.row_multiple())[1]
    return Geometry(frames=fp, height=hp, width=wp, n_img=n_img, n_img_pad=n_img_pad, n_txt_pad=n_txt_pad,
                    single_sp=bool(run.config.sp_single))


def sparse_plan(option, grid):
    """`attention=` (a string, a `sparse_masks.SparseAttention` or None) -> the video tokens'
    block sparsity at this latent grid (`sparse_masks.plan_for`), or None for dense."""
    from difflet_tpu.layers import sparse_masks

    return sparse_masks.plan_for(option, grid, sink=RADIAL_SINK)


@functools.lru_cache(maxsize=16)
def joint_sparsity(video, n_txt_pad: int, multiple: int):
    """(the joint `[video | text]` mask of a step, its video rows): the video plan, the text
    rows dense (`sparse_masks.with_dense_tail`)."""
    from difflet_tpu.layers import sparse_masks

    return sparse_masks.with_dense_tail(video, n_txt_pad, multiple)


def _cast(x, dtype):
    """`x` in `dtype`, staying where it is (a jax array on its device, numpy on the host)."""
    return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x).astype(dtype, copy=False)


def prepare(run, kw: dict) -> Prepared:
    """diffusers kwargs -> the step's inputs (eager: validation, patches, padding, tables)."""
    if kw.get("attention_kwargs"):
        raise ValueError(f"attention_kwargs {sorted(kw['attention_kwargs'])} are not supported (no LoRA scale)")
    geom = geometry(run, kw)
    c, dtype = run.cfg, run.dtype
    B = _shape("hidden_states", kw["hidden_states"])[0]

    def vec(x):  # scalar, (1,) or (B,) -> (B,) float32
        return np.broadcast_to(np.asarray(0.0 if x is None else x, np.float32).reshape(-1), (B,))

    patches = patchify(kw["hidden_states"], (c.patch_size_t, c.patch_size, c.patch_size))
    video = sparse_plan(kw.get("attention"), (geom.frames, geom.height, geom.width))
    order = None if video is None else video.order  # STA: the image rows tile by tile (-1: pad)
    if order is not None:
        from difflet_tpu.layers.sparse_masks import reorder_rows

        patches = reorder_rows(patches, order)
    inputs = dict(
        patches=_cast(padding.pad_to(patches, geom.n_img_pad), dtype),
        timestep=vec(kw["timestep"]),
        encoder_hidden_states=_cast(padding.pad_to(kw["encoder_hidden_states"], geom.n_txt_pad), dtype),
        # pad text tokens are invalid: zeros in the mask
        encoder_attention_mask=_cast(padding.pad_to(kw["encoder_attention_mask"], geom.n_txt_pad), np.float32),
        pooled_projections=_cast(kw["pooled_projections"], dtype),
        guidance=vec(kw.get("guidance")))
    inputs["freqs_cos"], inputs["freqs_sin"] = run.constant(
        ("rope", geom.frames, geom.height, geom.width, geom.n_joint) + ((video,) if order is not None else ()),
        lambda: joint_tables(c, geom.frames, geom.height, geom.width, geom.n_joint, order))
    rows = run.row_spec()
    # the text is whole on every rank (the token refiner runs on every rank); every input but the
    # RoPE tables has the batch first
    specs = {k: run.batch_spec() for k in inputs}
    specs["patches"] = rows
    specs["freqs_cos"] = specs["freqs_sin"] = P()
    if order is not None:  # each image row's frame-major token: the key mask (and token_replace) by row
        inputs["image_rows"] = run.constant(("sparse image rows", video, geom.n_img_pad), lambda: np.concatenate(
            [order, np.full(geom.n_img_pad - len(order), -1)]).astype(np.int32))
        specs["image_rows"] = P()
    # the image rows of the joint sequence / padded stream (frame-major again), unpatchified
    unpatch = lambda out: unpatchify(out, geom.frames, geom.height, geom.width, c.patch_size_t, c.patch_size)
    if order is None:
        finish = returned_sample(geom.n_img, kw.get("return_dict", True), unpatch)
    else:
        from difflet_tpu.layers.sparse_masks import inverse_order

        inverse = run.constant(("sparse inverse", video), lambda: inverse_order(order))
        finish = returned_sample(geom.n_img, kw.get("return_dict", True), lambda out: unpatch(out[:, inverse]))
    key = geom if video is None else (geom, joint_sparsity(video, geom.n_txt_pad, run.row_multiple())[0])
    return Prepared(key=key, inputs=inputs, specs=specs, out_specs=rows, finish=finish)


def forward(model, par, inputs: dict, key):
    """The step: the model on the prepared inputs (see `HunyuanVideoTransformer3DModel.__call__`);
    key: the Geometry, or (Geometry, the joint block-sparse mask)."""
    geom, sparse = key if isinstance(key, tuple) else (key, None)
    return model(par, geom, **inputs, sparse=sparse)


def runner_geometry(run, *args, **kwargs) -> Geometry:
    """`Runner.geometry(**diffusers_kwargs)`: the static geometry of the step these
    kwargs compile (padded stream lengths included), after the same checks."""
    return geometry(run, run.spec_kwargs(args, kwargs))


# --------------------------------------------------------------------------
# Benchmark inputs and FLOPs
# --------------------------------------------------------------------------

def latent_shape(config: HunyuanVideoConfig, height: int, width: int, frames: int, batch: int = 1):
    """The latent `[B, C_in, F, H, W]` of a `frames` x `height` x `width` video (VAE 4x temporal, 8x spatial)."""
    check_size("VAE 4x in time, 8x in space, patch 2", frames=frames, frame_step=4, height=height, width=width,
               multiple=16)
    return (batch, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)


def example_inputs(config: HunyuanVideoConfig, *, height: int = 320, width: int = 512, frames: int = 61,
                   batch: int = 1, seed: int = 0, dtype=np.float32, text_tokens: int = 256,
                   valid_text_tokens: int | None = None, abstract: bool = False) -> dict:
    """diffusers forward kwargs (numpy, or ShapeDtypeStructs) for a video of `frames` x
    `height` x `width` pixels, as HunyuanVideoPipeline makes them: the latent, 256 LLM
    text tokens (the pipeline's max_sequence_length, 3/4 of them valid), pooled CLIP,
    timestep and (guidance-distilled models) guidance = 6.0 * 1000."""
    shape = latent_shape(config, height, width, frames, batch)
    shapes = dict(hidden_states=(shape, dtype), timestep=((batch,), np.float32),
                  encoder_hidden_states=((batch, text_tokens, config.text_embed_dim), dtype),
                  encoder_attention_mask=((batch, text_tokens), np.float32),
                  pooled_projections=((batch, config.pooled_projection_dim), dtype))
    if config.guidance_embeds:
        shapes["guidance"] = ((batch,), np.float32)
    if abstract:
        return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}
    rng = np.random.default_rng(seed)
    valid = text_tokens * 3 // 4 if valid_text_tokens is None else valid_text_tokens
    mask = np.zeros((batch, text_tokens), np.float32)
    mask[:, :valid] = 1.0
    out = dict(hidden_states=rng.standard_normal(shape).astype(dtype),
               timestep=np.full((batch,), 900.0, np.float32),
               encoder_hidden_states=rng.standard_normal((batch, text_tokens, config.text_embed_dim)).astype(dtype),
               encoder_attention_mask=mask,
               pooled_projections=rng.standard_normal((batch, config.pooled_projection_dim)).astype(dtype))
    if config.guidance_embeds:
        out["guidance"] = np.full((batch,), 6000.0, np.float32)
    return out


def flops(config: HunyuanVideoConfig, inputs: dict) -> float:
    """Analytic forward FLOPs: a Linear over n tokens costs 2*n*d_in*d_out, attention
    4*S_q*S_k*D; embedders and modulation included, softmax, norms and RoPE ignored."""
    c = config
    B, _, F, H, W = tuple(inputs["hidden_states"].shape)
    Nt = tuple(inputs["encoder_hidden_states"].shape)[1]
    Ni = (F // c.patch_size_t) * (H // c.patch_size) * (W // c.patch_size)
    N, D, Fm, Dt = Ni + Nt, c.inner_dim, c.mlp_dim, c.text_embed_dim
    lin = lambda n, i, o: 2.0 * B * n * i * o
    attn = lambda sq, sk: 4.0 * B * sq * sk * D
    temb = lin(1, 256, D) + lin(1, D, D)
    total = lin(Ni, c.in_channels * c.patch_volume, D)                              # x_embedder
    total += temb + lin(1, c.pooled_projection_dim, D) + lin(1, D, D)                # time_text_embed
    total += temb * (c.guidance_embeds + c.token_replace)
    total += temb + lin(1, Dt, D) + lin(1, D, D) + lin(Nt, Dt, D)                   # refiner embed + proj_in
    total += c.num_refiner_layers * (lin(Nt, D, 4 * D) + lin(Nt, D, 2 * int(D * c.mlp_ratio))
                                     + attn(Nt, Nt) + lin(1, D, 2 * D))
    mods = 1 + c.token_replace
    total += c.num_layers * (lin(N, D, 4 * D) + lin(N, D, 2 * Fm) + attn(N, N) + lin(mods + 1, D, 6 * D))
    total += c.num_single_layers * (lin(N, D, 3 * D + Fm) + lin(N, D + Fm, D) + attn(N, N) + lin(mods, D, 3 * D))
    total += lin(1, D, 2 * D) + lin(Ni, D, c.patch_volume * c.out_channels)         # norm_out, proj_out
    return float(total)
