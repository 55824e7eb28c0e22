"""Running Wan: diffusers' `WanTransformer3DModel.forward` kwargs -> the step's inputs.

`prepare` validates the kwargs against the config (errors before anything
compiles) and builds, eagerly and rank-independently:

* the patches: the Conv3d patch embedding's input as rows of (c, pt, ph, pw)
  features, tokens in (f, h, w) order (`patchify`);
* under SP, the rows padded by the Runner's one rule (`Runner.rows`): each
  rank receives its rows, pad keys are dropped in self-attention (`kv_mask`),
  pad rows get the identity rotation, the output is gathered and cut back;
* the RoPE tables (`rope.py`), cached per grid;
* the timestep in float32 (per sample, or per token for Wan2.2 TI2V, padded
  and sequence-sharded like the patches).

The text K/V cache: `Runner.encode_text(encoder_hidden_states, [image])`
computes every block's cross-attention K/V once per prompt (sharded by
heads); `runner(hidden_states, timestep, text_kv=cache)` then skips the text
projection and the 2 * layers K/V projections in every denoise step.
`Runner(..., cache_text=True)` does this by itself while the calls pass the
same `encoder_hidden_states` object (a denoise loop). `forward` runs one of
three steps by its key: "full" (K/V computed in the step), "cached" (K/V
given) and "encode" (K/V only).

`WanExperts` / `load_experts`: Wan2.2 A14B's two transformers, switched at
the pipeline's `boundary_ratio` (diffusers' `WanPipeline`).
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from difflet_tpu.parallel import padding
from difflet_tpu.config import Config
from difflet_tpu.parallel.padding import patchify
from difflet_tpu.parallel.mesh import BATCH, TP
from difflet_tpu.port import Prepared, check_size, returned
from difflet_tpu.runner import Runner

from .config import NUM_TRAIN_TIMESTEPS, TEXT_LEN_I2V, WanConfig
from .rope import rope_tables
from .schedule import expert

FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image",
                "return_dict", "attention_kwargs")
KV_NAMES = ("k", "v", "k_img", "v_img")


# --------------------------------------------------------------------------
# Eager layout helpers
# --------------------------------------------------------------------------

def _xp(x):
    return np if isinstance(x, np.ndarray) else jnp


def unpatchify(y, grid, patch_size):
    """(B, N, pt*ph*pw*C) with c innermost -> (B, C, F, H, W) (diffusers' permute)."""
    B = y.shape[0]
    f, h, w = grid
    pt, ph, pw = patch_size
    y = y.reshape(B, f, h, w, pt, ph, pw, -1)
    y = _xp(y).transpose(y, (0, 7, 1, 4, 2, 5, 3, 6))
    return y.reshape(B, y.shape[1], f * pt, h * ph, w * pw)


def _kv_spec(run) -> P:
    """The text K/V `[layers, B, L, D]`: batch over the mesh's batch axes, sharded
    by heads (TP and SP), or every head on every rank under SP with
    `Config.sp_cross_local` (cross-attention on this rank's rows with all heads)."""
    return P(None, BATCH, None, TP) if run.par.sharded and not run.par.cross_local else P(None, BATCH)


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

def _check_text(run, B, ehs, img):
    """(text_len, image_len or None) of the conditioning, checked against the config."""
    c = run.cfg
    es = tuple(ehs.shape)
    if len(es) != 3 or es[0] != B or es[2] != c.text_dim:
        raise ValueError(f"encoder_hidden_states must be ({B}, L, text_dim={c.text_dim}), got {es}")
    if c.added_kv_proj_dim is None:
        if img is not None:
            raise ValueError("encoder_hidden_states_image given, but this model has no image branch "
                             "(image_dim / added_kv_proj_dim are None)")
        return es[1], None
    if img is None:
        raise ValueError("this I2V model (added_kv_proj_dim set) needs encoder_hidden_states_image")
    if es[1] != TEXT_LEN_I2V:
        raise ValueError(f"the I2V cross-attention splits image | text tokens at L - {TEXT_LEN_I2V} "
                         f"(diffusers hard-codes the 512-token umT5 context); encoder_hidden_states has "
                         f"{es[1]} tokens: pad or cut the prompt embeddings to {TEXT_LEN_I2V}")
    ims = tuple(img.shape)
    if c.pos_embed_seq_len is not None:  # FLF2V: the first and last images' tokens, two rows per sample
        want = (2 * B, c.pos_embed_seq_len // 2, c.image_dim)
        if ims != want:
            raise ValueError(f"encoder_hidden_states_image must be {want} (first and last image per sample, "
                             f"pos_embed_seq_len={c.pos_embed_seq_len}), got {ims}")
        return es[1], c.pos_embed_seq_len
    if len(ims) != 3 or ims[0] != B or ims[2] != c.image_dim:
        raise ValueError(f"encoder_hidden_states_image must be ({B}, L_img, image_dim={c.image_dim}), "
                         f"got {ims}")
    return es[1], ims[1]


def _check_text_kv(run, kv, B):
    c = run.cfg
    want = {"k", "v"} | ({"k_img", "v_img"} if c.added_kv_proj_dim is not None else set())
    if not isinstance(kv, dict) or set(kv) != want:
        raise ValueError(f"text_kv must be encode_text's output with keys {sorted(want)}")
    ks = tuple(kv["k"].shape)
    if len(ks) != 4 or ks[0] != c.num_layers or ks[1] != B or ks[3] != c.inner_dim:
        raise ValueError(f"text_kv['k'] must be (layers={c.num_layers}, {B}, L, {c.inner_dim}), got {ks}")


def _check(run, kw):
    """(batch, grid, per_token) of a call, checked against the config (ValueError before compiling)."""
    c = run.cfg
    if kw.get("attention_kwargs"):
        raise ValueError("attention_kwargs (LoRA scale) is not supported by the Wan port")
    if kw.get("hidden_states") is None or kw.get("timestep") is None:
        raise ValueError("hidden_states and timestep are required")
    hs = tuple(kw["hidden_states"].shape)
    if len(hs) != 5:
        raise ValueError(f"hidden_states must be (batch, channels, frames, height, width), got {hs}")
    B, C, F, H, W = hs
    if C != c.in_channels:
        raise ValueError(f"hidden_states has {C} channels; the config has in_channels={c.in_channels}")
    for name, size, p in zip(("frames", "height", "width"), (F, H, W), c.patch_size):
        if size % p:
            raise ValueError(f"hidden_states {name} = {size} is not a multiple of the patch size {p}")
        if size // p > c.rope_max_seq_len:
            raise ValueError(f"hidden_states {name} = {size} gives {size // p} positions; "
                             f"the RoPE tables cover rope_max_seq_len = {c.rope_max_seq_len}")
    grid = tuple(s // p for s, p in zip((F, H, W), c.patch_size))
    N = math.prod(grid)
    ts = tuple(np.shape(kw["timestep"]))
    if ts == (B,):
        per_token = False
    elif ts == (B, N):
        per_token = True
    else:
        raise ValueError(f"timestep must be ({B},) or per token ({B}, {N}) (Wan2.2 TI2V), got {ts}")
    ehs, img = kw.get("encoder_hidden_states"), kw.get("encoder_hidden_states_image")
    if kw.get("text_kv") is not None:
        if ehs is not None or img is not None:
            raise ValueError("pass either text_kv (from encode_text) or encoder_hidden_states, not both")
        _check_text_kv(run, kw["text_kv"], B)
    else:
        if ehs is None:
            raise ValueError("encoder_hidden_states is required (or text_kv from encode_text)")
        _check_text(run, B, ehs, img)
    return B, grid, per_token


# --------------------------------------------------------------------------
# prepare / forward
# --------------------------------------------------------------------------

def _cached_text_kv(run, ehs, img):
    """`cache_text=True`: the text K/V of the previous call while the very same
    `encoder_hidden_states` (and image) objects come back, as a denoise loop
    passes them; arrays mutated in place are not detected."""
    hit = run.state.get("text_kv")
    if hit is None or hit[0] is not ehs or hit[1] is not img:
        hit = run.state["text_kv"] = (ehs, img, encode_text(run, ehs, img))
    return hit[2]


def prepare(run, kw: dict) -> Prepared:
    """diffusers kwargs (plus `text_kv=`) -> the step's inputs (eager: validation,
    patchify, padding, tables)."""
    from difflet_tpu.layers.sparse_masks import inverse_order, reorder_rows

    B, grid, per_token = _check(run, kw)
    c = run.cfg
    N = math.prod(grid)
    row_spec = run.row_spec()

    sparse = sparse_plan(kw.get("attention"), grid)
    order = None if sparse is None else sparse.order  # STA: tokens tile by tile (pad positions -1)
    patches = patchify(kw["hidden_states"], c.patch_size)
    t = kw["timestep"]
    t = _xp(t).asarray(t).astype(jnp.promote_types(run.dtype, jnp.float32))
    if order is not None:
        patches = reorder_rows(patches, order)
        if per_token:
            t = reorder_rows(t, order)
    n = N if order is None else len(order)
    patches, rows = run.pad_stream(patches, "patch tokens")
    if per_token:
        t = padding.pad_to(t, rows)
    inputs = dict(patches=patches, timestep=t)
    specs = dict(patches=row_spec, timestep=run.row_spec(2, 1) if per_token else run.batch_spec())
    inputs["freqs_cos"], inputs["freqs_sin"] = run.constant(("rope", grid, rows) + ((sparse,) if sparse else ()),
                                                            lambda: _tables(c, grid, rows, order))
    specs["freqs_cos"] = specs["freqs_sin"] = P()
    if order is None:
        kv_mask = run.pad_key_mask((N, rows))
    else:  # the tiles' pad positions and the step's pad rows
        kv_mask = run.constant(("sparse keys", rows, sparse),
                               lambda: np.concatenate([order >= 0, np.zeros(rows - n, bool)]))
    if kv_mask is not None:
        inputs["kv_mask"] = kv_mask
        specs["kv_mask"] = P()

    ehs, img = kw.get("encoder_hidden_states"), kw.get("encoder_hidden_states_image")
    text_kv = kw.get("text_kv")
    if text_kv is None and run.options["cache_text"] and not run.abstract:
        text_kv = _cached_text_kv(run, ehs, img)
    if text_kv is not None:
        key = "cached"
        inputs.update(text_kv)
        specs.update({k: _kv_spec(run) for k in text_kv})
    else:
        key = "full"
        inputs["encoder_hidden_states"], specs["encoder_hidden_states"] = ehs, run.batch_spec()
        if img is not None:
            inputs["encoder_hidden_states_image"], specs["encoder_hidden_states_image"] = img, run.batch_spec()

    def finish(out):
        out = padding.unpad(out, n, axis=1)
        if order is not None:
            out = out[:, run.constant(("sparse inverse", sparse), lambda: inverse_order(order))]
        return returned(kw.get("return_dict", True), unpatchify(out, grid, c.patch_size))

    return Prepared(key=key if sparse is None else (key, sparse), inputs=inputs, specs=specs, out_specs=row_spec,
                    finish=finish)


def sparse_plan(option, grid):
    """`attention=` (a string, a `sparse_masks.SparseAttention` or None) -> the block sparsity of
    the video self-attention at this latent grid, or None for dense (`sparse_masks.plan_for`)."""
    from difflet_tpu.layers import sparse_masks

    return sparse_masks.plan_for(option, grid, sink=True)  # the reference's Wan rule: frame 0 a sink


def _tables(c, grid, rows, order):
    """RoPE tables for the rows as the step sees them: frame-major, or reordered tile by tile
    (pad positions and pad rows: the identity rotation, cos 1 and sin 0)."""
    if order is None:
        return rope_tables(c, grid, rows)
    N = math.prod(grid)
    cos, sin = (np.asarray(x) for x in rope_tables(c, grid, N))
    pick = lambda x, fill: np.concatenate(
        [np.where((order >= 0)[:, None], x[np.maximum(order, 0)], fill),
         np.full((rows - len(order), x.shape[1]), fill, x.dtype)])
    return jnp.asarray(pick(cos, 1)), jnp.asarray(pick(sin, 0))


def forward(model, par, inputs: dict, key):
    """The step by key: "encode" -> every block's text K/V (`model.encode_text`);
    "full" -> the denoiser with K/V computed in the step; "cached" -> with K/V given;
    (key, sparsity) -> the same with block-sparse self-attention."""
    key, sparse = key if isinstance(key, tuple) else (key, None)
    if key != "cached":
        # the cache of `par.cross_local` holds every head; a "full" step gathers each
        # layer's K/V heads in its block instead (overlapped there)
        kv = model.encode_text(par, inputs["encoder_hidden_states"], inputs.get("encoder_hidden_states_image"),
                               all_heads=key == "encode" and par.cross_local)
        if key == "encode":
            return kv
    else:
        kv = {k: inputs[k] for k in KV_NAMES if k in inputs}
    return model(par, inputs["patches"], inputs["timestep"], kv, inputs["freqs_cos"], inputs["freqs_sin"],
                 inputs.get("kv_mask"), sparse=sparse)


# --------------------------------------------------------------------------
# Runner methods (PortSpec.methods): the text K/V cache
# --------------------------------------------------------------------------

def encode_text(run, encoder_hidden_states, encoder_hidden_states_image=None):
    """Every block's cross-attention K/V for one prompt (batch): a dict of
    `[layers, B, L, D]` arrays sharded by heads (under SP with
    `Config.sp_cross_local`: every head on every rank). Constant across denoise
    steps: pass it as `text_kv=` to every step of the prompt."""
    if run.abstract:
        raise ValueError("this Runner holds an abstract model (ShapeDtypeStructs): use text_kv_shapes()")
    _check_text(run, encoder_hidden_states.shape[0], encoder_hidden_states, encoder_hidden_states_image)
    inputs = {"encoder_hidden_states": encoder_hidden_states}
    if encoder_hidden_states_image is not None:
        inputs["encoder_hidden_states_image"] = encoder_hidden_states_image
    specs = {k: run.batch_spec() for k in inputs}
    # The Runner's step machinery: one compile per (key, specs), as for the denoise steps.
    return run.run_prepared(Prepared(key="encode", inputs=inputs, specs=specs, out_specs=_kv_spec(run),
                                     finish=lambda kv: kv))


def text_kv_shapes(run, batch: int, text_len: int, image_len: int | None = None, dtype=None):
    """Abstract `encode_text` output (ShapeDtypeStructs, for `trace(..., text_kv=...)`)."""
    c = run.cfg
    dtype = jnp.dtype(run.dtype if dtype is None else dtype)
    sharding = None if run.mesh is None else NamedSharding(run.mesh, run.resolve_spec(_kv_spec(run)))
    lens = {"k": text_len, "v": text_len}
    if c.added_kv_proj_dim is not None:
        lens.update(k_img=image_len, v_img=image_len)
    return {k: jax.ShapeDtypeStruct((c.num_layers, batch, n, c.inner_dim), dtype, sharding=sharding)
            for k, n in lens.items()}


# --------------------------------------------------------------------------
# Wan2.2 A14B: two experts switched by the boundary ratio
# --------------------------------------------------------------------------

class WanExperts:
    """Wan2.2's high-noise (`transformer`) and low-noise (`transformer_2`) experts.

    As diffusers' WanPipeline: the high-noise expert runs while
    t >= boundary_ratio * num_train_timesteps (1000), the low-noise one after.
    A single-expert pipeline (Wan2.1, TI2V-5B) has `low=None` and always runs `high`.
    Each expert is a `Runner` (with its own text K/V cache).
    """

    def __init__(self, high: Runner, low: Runner | None = None, boundary_ratio: float | None = None,
                 num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
        if (low is None) != (boundary_ratio is None):
            raise ValueError("two experts need a boundary_ratio, and a boundary_ratio needs two experts")
        self.high, self.low, self.boundary_ratio = high, low, boundary_ratio
        self.boundary_timestep = None if boundary_ratio is None else boundary_ratio * num_train_timesteps
        self.num_train_timesteps = num_train_timesteps

    def expert_for(self, timestep) -> str:
        """"high" or "low" for this step's timestep (all entries must agree): the one
        switch rule, `schedule.expert`, per entry."""
        which = {expert(float(t), self.boundary_ratio, self.num_train_timesteps)
                 for t in np.asarray(timestep).reshape(-1)}
        if len(which) > 1:
            raise ValueError(f"timestep entries straddle the expert boundary {self.boundary_timestep}: "
                             f"one step runs one expert")
        return "high" if which.pop() == 0 else "low"

    def runner(self, which: str) -> Runner:
        """The expert's Runner: "high" or "low"."""
        return self.high if which == "high" else self.low

    def encode_text(self, encoder_hidden_states, encoder_hidden_states_image=None):
        """Each expert's text K/V cache (the experts have their own projections)."""
        out = {"high": self.high.encode_text(encoder_hidden_states, encoder_hidden_states_image)}
        if self.low is not None:
            out["low"] = self.low.encode_text(encoder_hidden_states, encoder_hidden_states_image)
        return out

    def __call__(self, hidden_states, timestep, encoder_hidden_states=None, encoder_hidden_states_image=None,
                 return_dict: bool = True, attention_kwargs=None, *, text_kv=None):
        """One denoise step on the expert for `timestep`; `text_kv`: `encode_text`'s
        per-expert caches."""
        which = self.expert_for(timestep)
        kv = None if text_kv is None else text_kv[which]
        return self.runner(which)(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                                  return_dict, attention_kwargs, text_kv=kv)


def load_experts(pipeline_path, *, dtype=jnp.bfloat16, mesh=None, config: Config | None = None,
                 mode: str | None = None, **overrides) -> WanExperts:
    """Loads a diffusers Wan pipeline directory's transformer(s).

    Reads `model_index.json`'s `boundary_ratio`; with one, loads both
    `transformer` (high noise) and `transformer_2` (low noise).
    """
    from difflet_tpu import loading

    path = pathlib.Path(pipeline_path)
    index = path / "model_index.json"
    info = json.loads(index.read_text()) if index.exists() else {}
    boundary = info.get("boundary_ratio")
    load = lambda sub: loading.load_transformer(path / sub, dtype=dtype, mesh=mesh, config=config, **overrides)
    high = Runner(load("transformer"), mesh, config, mode)
    if boundary is None:
        return WanExperts(high)
    if not (path / "transformer_2").exists():
        raise FileNotFoundError(f"{index} sets boundary_ratio={boundary} but {path / 'transformer_2'} "
                                f"does not exist (Wan2.2 A14B has two experts)")
    return WanExperts(high, Runner(load("transformer_2"), mesh, config, mode), float(boundary))


# --------------------------------------------------------------------------
# Benchmark inputs and FLOPs
# --------------------------------------------------------------------------

def _vae_factors(config: WanConfig) -> tuple[int, int]:
    """(temporal, spatial) VAE compression: Wan2.2's VAE (48 channels) is 16x spatial."""
    return (4, 16) if config.out_channels == 48 else (4, 8)


def example_inputs(config: WanConfig, *, height: int = 480, width: int = 832, frames: int = 9, batch: int = 1,
                   seed: int = 0, dtype=np.float32, per_token: bool | None = None, text_len: int = 512,
                   image_len: int = 257) -> dict:
    """diffusers forward kwargs (numpy) for a video of `frames` x `height` x `width` pixels."""
    ft, fs = _vae_factors(config)
    check_size(f"VAE {ft}x in time, {fs}x in space, patch {config.patch_size[1]}", frames=frames, frame_step=ft,
               height=height, width=width, multiple=fs * config.patch_size[1])
    rng = np.random.default_rng(seed)
    lat = (batch, config.in_channels, (frames - 1) // ft + 1, height // fs, width // fs)
    grid = tuple(s // p for s, p in zip(lat[2:], config.patch_size))
    per_token = config.out_channels == 48 if per_token is None else per_token
    out = {"hidden_states": rng.standard_normal(lat).astype(dtype)}
    if per_token:
        t = np.full((batch, math.prod(grid)), 900.0, np.float32)
        t[:, :grid[1] * grid[2]] = 0.0  # the conditioning first frame (TI2V)
        out["timestep"] = t
    else:
        out["timestep"] = np.full((batch,), 900.0, np.float32)
    out["encoder_hidden_states"] = rng.standard_normal((batch, text_len, config.text_dim)).astype(dtype)
    if config.image_dim is not None:
        out["encoder_hidden_states_image"] = rng.standard_normal((batch, image_len, config.image_dim)).astype(dtype)
    return out


def flops(config: WanConfig, inputs: dict, *, text_kv_cached: bool = False) -> float:
    """Analytic forward FLOPs, matmuls and attention only.

    Per layer: 12*N*D^2 (q, k, v, o of attn1; q, o of attn2) + 4*N*D*F (FFN)
    + 4*L*D^2 (attn2 text K/V) + 4*N^2*D + 4*N*L*D (attention), I2V adds
    4*L_img*D^2 + 4*N*L_img*D; plus patch/text/time embedders and proj_out.
    `text_kv_cached`: the per-prompt text K/V and text projection are not counted.
    """
    c = config
    hs = inputs["hidden_states"].shape
    B = hs[0]
    N = math.prod(s // p for s, p in zip(hs[2:], c.patch_size))
    L = inputs["encoder_hidden_states"].shape[1]
    D, Fd = c.inner_dim, c.ffn_dim
    img = inputs.get("encoder_hidden_states_image")
    Li = 0 if img is None else img.shape[1]
    per_layer = 12 * N * D * D + 4 * N * D * Fd + 4 * N * N * D + 4 * N * L * D + 4 * N * Li * D
    text = c.num_layers * (4 * L * D * D + 4 * Li * D * D) + 2 * L * (c.text_dim * D + D * D)
    if Li:
        text += 2 * Li * (c.image_dim * c.image_dim + c.image_dim * D)
    t_rows = N if np.ndim(inputs["timestep"]) == 2 else 1
    emb = 2 * N * c.patch_features * D + 2 * N * D * c.out_channels * math.prod(c.patch_size)
    emb += 2 * t_rows * (c.freq_dim * D + D * D + D * 6 * D)
    total = c.num_layers * per_layer + emb + (0 if text_kv_cached else text)
    return float(B * total)
