"""Running LTX-2: diffusers' `LTX2VideoTransformer3DModel.forward` kwargs -> the step's inputs.

`prepare` validates the kwargs against the config (errors before anything
compiles), pads the video rows eagerly under SP (`Runner.rows`: 2310 -> 2312
at P=4) with a pad-key mask, and builds the RoPE tables on the host
(`layers.rope.fractional`, as diffusers' `LTX2AudioVideoRotaryPosEmbed`; cached per geometry
or coordinates, placed once). The audio rows and the text stay replicated
(TP) while the video rows are sequence-sharded. `forward` is the step;
`finish` cuts the video pad off and returns `(sample, audio_sample)`, as
diffusers' forward does.

`attention=` (`layers/sparse_masks.py`, docs/sparse-attention.md): the video
stream's self-attention (attn1) block-sparse over the latent grid (num_frames,
height, width); STA puts the video rows, their RoPE rows, per-token timesteps and
keyframe marks tile by tile, as Wan's port does, and the output rows back. The
audio self-attention, the text cross-attentions and a2v / v2a stay dense.
"""

from __future__ import annotations

import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from difflet_tpu.layers import sparse_masks
from difflet_tpu.parallel import padding
from difflet_tpu.parallel.mesh import BATCH, TP
from difflet_tpu.port import Prepared, returned

from difflet_tpu.layers.rope import fractional as rope
from .config import LTX2Config, config_from_diffusers

FORWARD_ARGS = (
    "hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states", "timestep",
    "audio_timestep", "sigma", "audio_sigma", "encoder_attention_mask", "audio_encoder_attention_mask",
    "num_frames", "height", "width", "fps", "audio_num_frames", "video_coords", "audio_coords",
    "isolate_modalities", "spatio_temporal_guidance_blocks", "perturbation_mask", "use_cross_timestep",
    "attention_kwargs", "video_self_attention_mask", "video_keyframes_mask", "return_dict")

REPLICATED = P()
CHANNELS = P(None, None, TP)  # RoPE tables: this rank's heads


def _cast(x, dtype):
    if isinstance(x, jax.Array):
        return x.astype(dtype)
    return np.asarray(x).astype(dtype)


def _expect(name, x, shape):
    got = tuple(x.shape)
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise ValueError(f"{name}: shape {got} does not match the config, expected {want}")


def _timestep(name, t, batch, tokens):
    """(B,) [or (B, tokens) per token]; scalars and (B, 1) are accepted as diffusers flattens them."""
    if not hasattr(t, "reshape"):  # a Python number
        t = np.asarray(t, np.float32)
    shape = tuple(t.shape)
    size = math.prod(shape)
    if size == batch:
        return t.reshape(batch)
    if tokens is not None and size == batch * tokens:
        return t.reshape(batch, tokens)
    per_token = f" or (B, {tokens}) per token" if tokens is not None else ""
    raise ValueError(f"{name}: shape {shape} is not (B,) = ({batch},){per_token}")


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _rope_tables(run, video_coords, audio_coords, kw, fps, nv_pad, sparse=None):
    """name -> (cos, sin) of the four RoPEs (video, audio and the a2v/v2a ones), video
    rows padded to `nv_pad` (pad rows are zeros: never used, their keys are masked), in
    `sparse.order` (STA) if given. Cached per geometry, or per coordinates when the caller
    passes them."""
    order = None if sparse is None else sparse.order
    c = run.cfg
    if video_coords is None:
        video_key = ("grid", int(kw["num_frames"]), int(kw["height"]), int(kw["width"]), fps)
    else:
        video_coords = np.asarray(video_coords, np.float32)
        video_key = ("coords", _digest(video_coords))
    if audio_coords is None:
        audio_key = ("grid", int(kw["audio_num_frames"]))
    else:
        audio_coords = np.asarray(audio_coords, np.float32)
        audio_key = ("coords", _digest(audio_coords))

    def make():
        vc, ac = video_coords, audio_coords
        if vc is None:
            vc = rope.video_coords(1, int(kw["num_frames"]), int(kw["height"]), int(kw["width"]), fps,
                                   patch_size=c.patch_size, patch_size_t=c.patch_size_t,
                                   scale_factors=c.vae_scale_factors, causal_offset=c.causal_offset)
        if ac is None:
            ac = rope.audio_coords(1, int(kw["audio_num_frames"]), patch_size_t=c.audio_patch_size_t,
                                   scale_factor=c.audio_scale_factor, causal_offset=c.causal_offset,
                                   hop_length=c.audio_hop_length, sampling_rate=c.audio_sampling_rate)
        vc, ac = np.asarray(vc, np.float32), np.asarray(ac, np.float32)
        common = dict(theta=c.rope_theta, double_precision=c.rope_double_precision, rope_type=c.rope_type,
                      split_rope=c.split_rope)
        hw = (c.base_height, c.base_width)
        out = {
            "video": rope.tables(vc, dim=c.inner_dim, max_positions=(c.pos_embed_max_pos, *hw), **common),
            "audio": rope.tables(ac, dim=c.audio_inner_dim, max_positions=(c.audio_pos_embed_max_pos,), **common),
            "ca_video": rope.tables(vc[:, 0:1], dim=c.audio_cross_attention_dim,
                                    max_positions=(c.cross_pos_embed_max_pos, *hw), **common),
            "ca_audio": rope.tables(ac[:, 0:1], dim=c.audio_cross_attention_dim,
                                    max_positions=(c.cross_pos_embed_max_pos,), **common),
        }
        for name in ("video", "ca_video"):
            tables = out[name] if order is None else (sparse_masks.reorder_rows(t, order) for t in out[name])
            out[name] = tuple(padding.pad_to(t, nv_pad) for t in tables)
        return out

    return run.constant(("rope", video_key, audio_key, nv_pad) + (() if order is None else (sparse,)), make)


def sparse_plan(option, grid):
    """`attention=` (a string, a `sparse_masks.SparseAttention` or None) -> the video self-attention's
    block sparsity at the latent grid (frames, height, width) after the patch, or None for dense
    (`sparse_masks.plan_for`; radial without Wan's first-frame sink)."""
    return sparse_masks.plan_for(option, grid, sink=False)


def _sparse(kw, c, nv):
    """The call's video block sparsity (None: dense); it needs the latent grid."""
    option = kw.get("attention")
    if option is None or option == "dense":
        return None
    if kw["video_coords"] is not None or any(kw[k] is None for k in ("num_frames", "height", "width")):
        raise sparse_masks.SparsityError("block-sparse attention on LTX-2 is planned over the latent grid: give "
                                         "num_frames, height and width (not video_coords)")
    return sparse_plan(option, (-(-int(kw["num_frames"]) // c.patch_size_t), -(-int(kw["height"]) // c.patch_size),
                                -(-int(kw["width"]) // c.patch_size)))


def prepare(run, kwargs: dict) -> Prepared:
    """diffusers kwargs -> the step's inputs (eager: validation, RoPE tables, SP padding)."""
    kw = {k: kwargs.get(k) for k in FORWARD_ARGS + ("attention",)}
    for name in ("video_self_attention_mask", "attention_kwargs"):
        if kw[name] is not None:
            raise NotImplementedError(f"{name} is not supported by the LTX-2 port")
    c, dtype = run.cfg, run.dtype
    tdtype = jnp.promote_types(dtype, jnp.float32)
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
                 "timestep"):
        if kw[name] is None:
            raise TypeError(f"missing required LTX-2 forward kwarg {name!r}")

    hs, ahs = kw["hidden_states"], kw["audio_hidden_states"]
    ehs, aehs = kw["encoder_hidden_states"], kw["audio_encoder_hidden_states"]
    _expect("hidden_states", hs, (None, None, c.in_channels))
    B, nv = hs.shape[0], hs.shape[1]
    _expect("audio_hidden_states", ahs, (B, None, c.audio_in_channels))
    na = ahs.shape[1]
    _expect("encoder_hidden_states", ehs, (B, None, c.text_dim))
    _expect("audio_encoder_hidden_states", aehs, (B, None, c.audio_text_dim))

    # timesteps: (B,) or per token (B, N)
    timestep = _timestep("timestep", kw["timestep"], B, nv)
    audio_timestep = kw["audio_timestep"]
    if audio_timestep is None:
        if timestep.ndim == 2 and nv != na:
            raise ValueError("timestep is per video token; pass audio_timestep ((B,) or (B, audio tokens))")
        audio_timestep = timestep
    audio_timestep = _timestep("audio_timestep", audio_timestep, B, na)
    sigma = None if kw["sigma"] is None else _timestep("sigma", kw["sigma"], B, None)
    audio_sigma = sigma if kw["audio_sigma"] is None else _timestep("audio_sigma", kw["audio_sigma"], B, None)
    use_cross_timestep = bool(kw["use_cross_timestep"])
    prompt_adaln = c.prompt_modulation and c.use_prompt_adaln_single
    if (prompt_adaln or use_cross_timestep) and sigma is None:
        raise ValueError("sigma is required (prompt AdaLN of LTX-2.3 or use_cross_timestep=True)")
    video_ca_timestep = audio_sigma if use_cross_timestep else timestep
    audio_ca_timestep = sigma if use_cross_timestep else audio_timestep

    # RoPE coordinates
    video_coords, audio_coords = kw["video_coords"], kw["audio_coords"]
    if video_coords is None:
        for name in ("num_frames", "height", "width"):
            if kw[name] is None:
                raise TypeError(f"{name} is required when video_coords is not given")
        grid = (-(-int(kw["num_frames"]) // c.patch_size_t) * -(-int(kw["height"]) // c.patch_size)
                * -(-int(kw["width"]) // c.patch_size))
        if grid != nv:
            raise ValueError(f"num_frames x height x width = {kw['num_frames']}x{kw['height']}x{kw['width']} "
                             f"gives {grid} video tokens, hidden_states has {nv}")
    else:
        _expect("video_coords", video_coords, (None, 3, nv, 2))
    if audio_coords is None:
        if kw["audio_num_frames"] is None:
            raise TypeError("audio_num_frames is required when audio_coords is not given")
        grid = -(-int(kw["audio_num_frames"]) // c.audio_patch_size_t)
        if grid != na:
            raise ValueError(f"audio_num_frames={kw['audio_num_frames']} gives {grid} audio tokens, "
                             f"audio_hidden_states has {na}")
    else:
        _expect("audio_coords", audio_coords, (None, 1, na, 2))

    # Block-sparse video self-attention: STA's rows tile by tile (pad positions -1)
    sparse = _sparse(kw, c, nv)
    order = None if sparse is None else sparse.order
    n_rows = nv if order is None else len(order)
    rows_of = (lambda x: x) if order is None else (lambda x: sparse_masks.reorder_rows(x, order))

    # Sequence parallelism: the video rows by the Runner's pad rule; audio and text replicated
    nv_pad = run.rows(n_rows, "video tokens")
    fps = 24.0 if kw["fps"] is None else float(kw["fps"])
    tables = _rope_tables(run, video_coords, audio_coords, kw, fps, nv_pad, sparse)

    rows = run.row_spec()
    inputs, specs = {}, {}

    batch = run.batch_spec()  # every input but the RoPE tables and the pad / layer masks: (B, ...)

    def put(name, value, spec=batch):
        if value is not None:
            inputs[name], specs[name] = value, spec

    put("hidden_states", padding.pad_to(rows_of(_cast(hs, dtype)), nv_pad), rows)
    put("audio_hidden_states", _cast(ahs, dtype))
    put("encoder_hidden_states", _cast(ehs, dtype))
    put("audio_encoder_hidden_states", _cast(aehs, dtype))
    for name, t in (("timestep", timestep), ("video_ca_timestep", video_ca_timestep)):
        t = _cast(t, tdtype)
        if t.ndim == 2 and t.shape[1] == nv:  # per video token: sharded like the rows
            put(name, padding.pad_to(rows_of(t), nv_pad), run.row_spec(2))
        else:
            put(name, t)
    put("audio_timestep", _cast(audio_timestep, tdtype))
    put("audio_ca_timestep", _cast(audio_ca_timestep, tdtype))
    if prompt_adaln:
        put("sigma", _cast(sigma, tdtype))
        put("audio_sigma", _cast(audio_sigma, tdtype))
    for name, mask, length in (("encoder_attention_mask", kw["encoder_attention_mask"], ehs.shape[1]),
                               ("audio_encoder_attention_mask", kw["audio_encoder_attention_mask"],
                                aehs.shape[1])):
        if mask is None:
            continue
        _expect(name, mask, (B, length))
        if np.all(np.asarray(mask) == 1):
            continue  # all valid: diffusers' bias is 0 everywhere, adding it changes nothing
        put(name, _cast(mask, dtype))
    if order is None:
        put("video_kv_mask", run.pad_key_mask((nv, nv_pad)), REPLICATED)
    else:  # the tiles' pad positions and the step's pad rows (self-attention and v2a's keys)
        put("video_kv_mask", run.constant(("sparse keys", nv_pad, sparse), lambda: np.concatenate(
            [order >= 0, np.zeros(nv_pad - n_rows, bool)])), REPLICATED)
    for name, (cos, sin) in tables.items():
        # one table for the batch (the grid), or per sample (the caller's coordinates)
        spec = CHANNELS if cos.shape[0] == 1 else P(BATCH, None, TP)
        put(f"rope_{name}_cos", cos, spec)
        put(f"rope_{name}_sin", sin, spec)
    if run.par.cross_local:
        # a2v's queries on this rank's video rows with every head (model.SP_LOCAL_PLAN):
        # their table by rows, every channel
        spec = run.row_spec(batch=None if tables["ca_video"][0].shape[0] == 1 else 0)
        put("rope_ca_video_local_cos", tables["ca_video"][0], spec)
        put("rope_ca_video_local_sin", tables["ca_video"][1], spec)

    # LTX-2.5 keyframe marker
    km = kw["video_keyframes_mask"]
    if km is not None and c.use_keyframes_abs_pos_embedding:
        if len(km.shape) == 2:
            km = km[..., None]
        _expect("video_keyframes_mask", km, (B, nv, 1))
        put("video_keyframes_mask", padding.pad_to(rows_of(_cast(km, dtype)), nv_pad), rows)

    # Spatio-temporal guidance (LTX2PerturbedAttnProcessor only, as diffusers)
    stg = list(kw["spatio_temporal_guidance_blocks"] or [])
    if stg and c.perturbed_attn:
        if any(not 0 <= i < c.num_layers for i in stg):
            raise ValueError(f"spatio_temporal_guidance_blocks {stg} outside 0..{c.num_layers - 1}")
        pm = kw["perturbation_mask"]
        pm = np.zeros((B,), dtype) if pm is None else pm
        if math.prod(pm.shape) != B:
            raise ValueError(f"perturbation_mask: {pm.shape} is not (B,) or (B, 1, 1) with B={B}")
        put("perturbation_mask", _cast(pm, dtype).reshape(B))
        put("stg_layers", np.isin(np.arange(c.num_layers), stg), REPLICATED)

    def finish(out):
        sample, audio_sample = out
        sample = padding.unpad(sample, n_rows)
        if order is not None:
            sample = sample[:, run.constant(("sparse inverse", sparse), lambda: sparse_masks.inverse_order(order))]
        return returned(kwargs.get("return_dict", True), sample, audio_sample)

    isolate = bool(kw["isolate_modalities"])
    return Prepared(key=isolate if sparse is None else (isolate, sparse), inputs=inputs, specs=specs,
                    out_specs=(rows, batch), finish=finish)


def forward(model, par, inputs: dict, key):
    """The step: the model on the prepared inputs (`LTX2VideoTransformer3DModel.__call__`);
    `key` is `isolate_modalities` (no a2v / v2a cross-attention), or (it, the video
    self-attention's block sparsity)."""
    isolate, sparse = key if isinstance(key, tuple) else (key, None)
    return model(par, inputs, isolate_modalities=isolate, sparse=sparse)


# --------------------------------------------------------------------------
# Benchmark inputs and FLOPs
# --------------------------------------------------------------------------

def _port_config(config) -> LTX2Config:
    return config if isinstance(config, LTX2Config) else config_from_diffusers(config)


def latent_shape(config, *, height: int, width: int, frames: int, fps: float = 24.0):
    """(latent frames, latent height, latent width, audio latents) of a pixel-space request, as the pipeline computes them."""
    c = _port_config(config)
    f = (frames - 1) // c.vae_scale_factors[0] + 1
    h, w = height // c.vae_scale_factors[1], width // c.vae_scale_factors[2]
    audio = round(frames / fps * c.audio_sampling_rate / c.audio_hop_length / c.audio_scale_factor)
    return f, h, w, audio


def example_inputs(config, *, height: int = 480, width: int = 704, frames: int = 49, batch: int = 1,
                   seed: int = 0, dtype=np.float32, fps: float = 24.0, text_tokens: int = 1024) -> dict:
    """diffusers forward kwargs of the right shapes (numpy), e.g. the benchmark
    480x704x49 @ 24 fps: 2310 video, 51 audio and 1024 text tokens.

    No text masks: the pipeline's connectors replace padding with learned
    registers, so its masks are all ones, whose additive bias is zero (the
    Runner drops such masks; a traced mask has no values to inspect and
    would take the slower biased-attention path)."""
    c = _port_config(config)
    f, h, w, na = latent_shape(c, height=height, width=width, frames=frames, fps=fps)
    f, h, w = -(-f // c.patch_size_t), -(-h // c.patch_size), -(-w // c.patch_size)
    nv = f * h * w
    rng = np.random.default_rng(seed)
    randn = lambda *s: rng.standard_normal(s).astype(dtype)
    sigma = np.full((batch,), 0.75, np.float32)
    out = dict(
        hidden_states=randn(batch, nv, c.in_channels),
        audio_hidden_states=randn(batch, na, c.audio_in_channels),
        encoder_hidden_states=randn(batch, text_tokens, c.text_dim),
        audio_encoder_hidden_states=randn(batch, text_tokens, c.audio_text_dim),
        timestep=sigma * c.timestep_scale_multiplier, sigma=sigma * c.timestep_scale_multiplier,
        num_frames=f, height=h, width=w, fps=fps, audio_num_frames=na)
    if c.prompt_modulation:
        out["use_cross_timestep"] = True
    return out


def flops(config, inputs: dict) -> float:
    """Analytic forward FLOPs: linears `2 n d_in d_out`, attention
    `4 Sq Skv (H d_h)`; norms, softmax and RoPE ignored."""
    c = _port_config(config)
    B, nv = inputs["hidden_states"].shape[:2]
    na = inputs["audio_hidden_states"].shape[1]
    L = inputs["encoder_hidden_states"].shape[1]
    La = inputs["audio_encoder_hidden_states"].shape[1]
    D, Da = c.inner_dim, c.audio_inner_dim
    lin = (8 * nv * D * D + 8 * na * Da * Da              # self-attention
           + 4 * nv * D * D + 4 * L * D * c.cross_attention_dim      # text cross-attention (video)
           + 4 * na * Da * Da + 4 * La * Da * c.audio_cross_attention_dim
           + 4 * nv * D * Da + 4 * na * Da * Da           # a2v: q, o on video; k, v on audio
           + 4 * na * Da * Da + 4 * nv * D * Da           # v2a: q, o on audio; k, v on video
           + 16 * nv * D * D + 16 * na * Da * Da)         # FFN
    if c.gated_attn:
        lin += 2 * (2 * nv * D * c.num_attention_heads) + 2 * nv * D * c.audio_num_attention_heads
    if c.audio_gated_attn:
        lin += 3 * 2 * na * Da * c.audio_num_attention_heads
    attn = (4 * nv * nv * D + 4 * na * na * Da + 4 * nv * L * D + 4 * na * La * Da + 8 * nv * na * Da)
    total = c.num_layers * (lin + attn)
    total += 2 * nv * (c.in_channels * D + D * c.video_out_channels)
    total += 2 * na * (c.audio_in_channels * Da + Da * c.audio_output_channels)
    if c.use_prompt_embeddings:
        total += 2 * L * (c.caption_channels * D + D * D) + 2 * La * (c.caption_channels * Da + Da * Da)
    return float(B * total)
