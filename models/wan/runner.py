"""Running the Wan port: diffusers' forward kwargs in, diffusers' sample out.

`Runner(model, mesh, config, mode)(hidden_states, timestep, encoder_hidden_states,
encoder_hidden_states_image=None)` takes diffusers' layouts and returns the
sample `(B, C_out, F, H, W)`. Around the one compiled step (one `jax.jit` of
one `shard_map`), everything rank-independent happens eagerly:

* validation against the config, before anything compiles;
* patchify (the Conv3d patch embedding's input as rows of (c, pt, ph, pw)
  features, tokens in (f, h, w) order);
* under SP, row padding (`Config.sp_pad`, default on): the sequence is
  padded so each ring half is whole 16-row tiles (4680 -> 4736 at P=4), each
  rank receives its rows; pad keys are dropped in self-attention, pad rows get
  the identity rotation, the output is gathered and cut back. With padding
  off the sequence must already split into 2P halves;
* RoPE tables, computed as diffusers does (float64 angles, float32 tables),
  permuted to split-halves order when the checkpoint was permuted at load;
  cached per grid.

Text K/V cache: `runner.encode_text(encoder_hidden_states, [image])` computes
every block's cross-attention K/V once per prompt (sharded by heads);
`runner(hidden_states, timestep, text_kv=cache)` then skips the text
projection and the 2 * layers K/V projections in every denoise step.
`Runner(..., cache_text=True)` does this by itself while the calls pass the
same `encoder_hidden_states` object (a denoise loop).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from difflet_tpu import collective_matmul as cm
from difflet_tpu import layout, runtime
from difflet_tpu.config import Config
from difflet_tpu.mesh import TP
from difflet_tpu.parallel import Parallel, check_divisible

from difflet_tpu.models.wan.config import NUM_TRAIN_TIMESTEPS, TEXT_LEN_I2V, WanConfig
from difflet_tpu.models.wan.model import PLAN

SP_TILE_ROWS = 16  # a bf16 sublane tile: each ring half is a whole number of these
AG_DEFAULT = "pallas"  # Wan's all-gather-matmul default on TPU (reference PR)


# --------------------------------------------------------------------------
# Eager layout helpers
# --------------------------------------------------------------------------

def _xp(x):
    return np if isinstance(x, np.ndarray) else jnp


def patchify(x, patch_size):
    """(B, C, F, H, W) -> (B, F'H'W', C*pt*ph*pw), features (c, pt, ph, pw), tokens (f, h, w)."""
    B, C, F, H, W = x.shape
    pt, ph, pw = patch_size
    x = x.reshape(B, C, F // pt, pt, H // ph, ph, W // pw, pw)
    x = _xp(x).transpose(x, (0, 2, 4, 6, 1, 3, 5, 7))
    return x.reshape(B, (F // pt) * (H // ph) * (W // pw), C * pt * ph * pw)


def unpatchify(y, grid, patch_size):
    """(B, N, pt*ph*pw*C) with c innermost -> (B, C, F, H, W) (diffusers' permute)."""
    B = y.shape[0]
    f, h, w = grid
    pt, ph, pw = patch_size
    y = y.reshape(B, f, h, w, pt, ph, pw, -1)
    y = _xp(y).transpose(y, (0, 7, 1, 4, 2, 5, 3, 6))
    return y.reshape(B, y.shape[1], f * pt, h * ph, w * pw)


def rope_tables(config: WanConfig, grid, rows: int | None = None, split: bool | None = None):
    """cos/sin `[rows, head_dim]` float32 for the (f, h, w) token grid.

    As diffusers' WanRotaryPosEmbed: per axis (t/h/w = head_dim - 2*(head_dim//6),
    2*(head_dim//6), ...) the angles pos * 10000^(-2i/d_axis) in float64, cos/sin
    interleaved (repeat 2) and stored as float32, axes concatenated. Rows past
    the grid (padding) get the identity rotation (cos 1, sin 0). `split`
    (default: the config's) permutes the channels to split-halves order.
    """
    split = config.split_rope if split is None else split
    F, H, W = grid
    n = F * H * W
    rows = n if rows is None else rows
    parts_cos, parts_sin = [], []
    for dim, size, axis in zip(config.rope_dims, (F, H, W), range(3)):
        freqs = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        ang = np.outer(np.arange(size, dtype=np.float64), freqs)
        c = np.repeat(np.cos(ang), 2, axis=1).astype(np.float32)
        s = np.repeat(np.sin(ang), 2, axis=1).astype(np.float32)
        shape = [1, 1, 1, dim]
        shape[axis] = size
        parts_cos.append(np.broadcast_to(c.reshape(shape), (F, H, W, dim)))
        parts_sin.append(np.broadcast_to(s.reshape(shape), (F, H, W, dim)))
    cos = np.ones((rows, config.attention_head_dim), np.float32)
    sin = np.zeros((rows, config.attention_head_dim), np.float32)
    cos[:n] = np.concatenate(parts_cos, axis=-1).reshape(n, -1)
    sin[:n] = np.concatenate(parts_sin, axis=-1).reshape(n, -1)
    if split:
        perm = layout.rope_permutation(config.attention_head_dim)
        cos, sin = cos[:, perm], sin[:, perm]
    return cos, sin


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What one call looks like, derived from its inputs (validated)."""

    batch: int
    grid: tuple  # tokens per axis after patching (f, h, w)
    tokens: int  # N
    rows: int    # N padded (SP) or N
    per_token: bool
    text_len: int
    image_len: int | None


# --------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------

class Runner:
    """Runs a Wan port on one device, under TP or under SP.

    model: from `build` or `weights.load_transformer`; mesh: a `tp` mesh or
    None (one device); config: the `Config` toggles (default: environment);
    mode: "tp", "sp" or "sp-xla" to override the config's TP/SP choice.
    """

    def __init__(self, model, mesh=None, config: Config | None = None, mode: str | None = None, *,
                 cache_text: bool = False):
        self.model = model
        # cache_text: reuse the text K/V while a call passes the very same
        # encoder_hidden_states (and image) objects as the previous one, as a
        # denoise loop does; arrays mutated in place are not detected.
        self.cache_text = cache_text
        self._text_cache = None
        self.cfg: WanConfig = model.config
        self.mesh = mesh
        self.config = Config.from_env() if config is None else config
        self.par = Parallel.for_mesh(mesh, self.config, mode=mode, ag_default=AG_DEFAULT)
        self.size = self.par.size
        if mesh is not None:
            # Heads and every sharded width must divide over tp: errors before compiling.
            self.par.local_heads(self.cfg.num_attention_heads)
            from flax import nnx

            state = nnx.state(model)
            check_divisible(PLAN, state, self.size)
            if not _is_abstract(state):
                runtime.place(model, mesh, PLAN)
        self._steps = {}
        self._tables = {}

    # ---- specs ------------------------------------------------------------

    @property
    def _rows_spec(self):
        return P(None, TP, None) if self.par.seq_sharded else P()

    @property
    def _kv_spec(self):
        return P(None, None, None, TP) if self.par.sharded else P()

    def _step(self, kind: str, shapes: Shapes, has_mask: bool):
        key = (kind, shapes.per_token, shapes.image_len is not None, has_mask)
        if key in self._steps:
            return self._steps[key]
        rows = self._rows_spec
        ts = (P(None, TP) if self.par.seq_sharded else P()) if shapes.per_token else P()
        kv = self._kv_spec
        if kind == "encode":
            def fn(model, par, ctx, img):
                return model.encode_text(par, ctx, img)

            specs, out = (P(), P()), kv
        elif kind == "cached":
            def fn(model, par, patches, timestep, text_kv, cos, sin, mask):
                return model(par, patches, timestep, text_kv, cos, sin, mask)

            specs, out = (rows, ts, kv, P(), P(), P()), rows
        else:  # "full": text K/V computed inside the step
            def fn(model, par, patches, timestep, ctx, img, cos, sin, mask):
                return model(par, patches, timestep, model.encode_text(par, ctx, img), cos, sin, mask)

            specs, out = (rows, ts, P(), P(), P(), P(), P()), rows
        if self.mesh is None:
            step = runtime.compile_step(self.model, fn, self.par)
        else:
            step = runtime.compile_step(self.model, fn, self.par, self.mesh, PLAN, in_specs=specs,
                                        out_specs=out)
        self._steps[key] = step
        return step

    # ---- validation -------------------------------------------------------

    def shapes(self, hidden_states, timestep, encoder_hidden_states=None, encoder_hidden_states_image=None,
               text_kv=None) -> Shapes:
        """Checks the inputs against the config (ValueError before compiling)."""
        c = self.cfg
        hs = tuple(hidden_states.shape)
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
        ts = tuple(np.shape(timestep))
        if ts == (B,):
            per_token = False
        elif ts == (B, N):
            per_token = True
        else:
            raise ValueError(f"timestep must be ({B},) or per token ({B}, {N}) (Wan2.2 TI2V), got {ts}")
        text_len = image_len = None
        if text_kv is not None:
            if encoder_hidden_states is not None or encoder_hidden_states_image is not None:
                raise ValueError("pass either text_kv (from encode_text) or encoder_hidden_states, not both")
            text_len, image_len = self._check_text_kv(text_kv, B)
        else:
            if encoder_hidden_states is None:
                raise ValueError("encoder_hidden_states is required (or text_kv from encode_text)")
            text_len, image_len = self._check_text(B, encoder_hidden_states, encoder_hidden_states_image)
        return Shapes(B, grid, N, self._rows(N), per_token, text_len, image_len)

    def _check_text(self, B, ehs, img):
        c = self.cfg
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
        if len(ims) != 3 or ims[0] != B or ims[2] != c.image_dim:
            raise ValueError(f"encoder_hidden_states_image must be ({B}, L_img, image_dim={c.image_dim}), "
                             f"got {ims}")
        return es[1], ims[1]

    def _check_text_kv(self, kv, B):
        c = self.cfg
        want = {"k", "v"} | ({"k_img", "v_img"} if c.added_kv_proj_dim is not None else set())
        if not isinstance(kv, dict) or set(kv) != want:
            raise ValueError(f"text_kv must be encode_text's output with keys {sorted(want)}")
        ks = tuple(kv["k"].shape)
        if len(ks) != 4 or ks[0] != c.num_layers or ks[1] != B or ks[3] != c.inner_dim:
            raise ValueError(f"text_kv['k'] must be (layers={c.num_layers}, {B}, L, {c.inner_dim}), got {ks}")
        return ks[2], (kv["k_img"].shape[2] if "k_img" in kv else None)

    def _rows(self, N: int) -> int:
        """Rows of the compiled sequence: N, or N padded for the SP rings."""
        if not self.par.seq_sharded:
            return N
        if self.config.sp_pad:
            return layout.padded_length(N, 2 * self.size * SP_TILE_ROWS)
        if N % (2 * self.size):
            raise ValueError(f"sequence parallelism over tp={self.size}: {N} patch tokens do not split; "
                             f"{cm.split_rule(self.size)} (or enable DIFFLET_TPU_SP_PAD=1, "
                             f"Config(sp_pad=True), which pads it)")
        return N

    # ---- eager preparation -----------------------------------------------

    def _put(self, x, spec):
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _time_dtype(self):
        return jnp.promote_types(self.model.dtype, jnp.float32)

    def _rope(self, shapes: Shapes):
        key = (shapes.grid, shapes.rows)
        if key not in self._tables:
            cos, sin = rope_tables(self.cfg, shapes.grid, shapes.rows)
            self._tables[key] = (self._put(cos, P()), self._put(sin, P()))
        return self._tables[key]

    def _mask(self, shapes: Shapes):
        if shapes.rows == shapes.tokens:
            return None
        return self._put(layout.key_mask(shapes.tokens, shapes.rows), P())

    def _prepare(self, shapes: Shapes, hidden_states, timestep):
        pad = shapes.rows - shapes.tokens
        patches = patchify(hidden_states, self.cfg.patch_size)
        t = _xp(timestep).asarray(timestep).astype(self._time_dtype())
        if pad:
            patches, _ = layout.pad_tokens(patches, shapes.rows, axis=1)
            if shapes.per_token:
                t, _ = layout.pad_tokens(t, shapes.rows, axis=1)
        ts = (P(None, TP) if self.par.seq_sharded else P()) if shapes.per_token else P()
        return self._put(patches, self._rows_spec), self._put(t, ts)

    # ---- calls ------------------------------------------------------------

    def encode_text(self, encoder_hidden_states, encoder_hidden_states_image=None):
        """Every block's cross-attention K/V for one prompt (batch): a dict of
        `[layers, B, L, D]` arrays sharded by heads. Constant across denoise
        steps: pass it as `text_kv=` to every step of the prompt."""
        B = encoder_hidden_states.shape[0]
        self._check_text(B, encoder_hidden_states, encoder_hidden_states_image)
        shapes = Shapes(B, (0, 0, 0), 0, 0, False, encoder_hidden_states.shape[1],
                        None if encoder_hidden_states_image is None else encoder_hidden_states_image.shape[1])
        step, state = self._step("encode", shapes, False)
        img = None if encoder_hidden_states_image is None else self._put(encoder_hidden_states_image, P())
        return step(state, self._put(encoder_hidden_states, P()), img)

    def __call__(self, hidden_states, timestep, encoder_hidden_states=None, encoder_hidden_states_image=None,
                 return_dict: bool = True, attention_kwargs=None, *, text_kv=None):
        """diffusers' `WanTransformer3DModel.forward` kwargs -> the sample (B, C_out, F, H, W).

        `return_dict` is accepted for signature compatibility; the sample array
        is returned either way. `text_kv`: `encode_text`'s cache for this prompt.
        """
        if attention_kwargs:
            raise ValueError("attention_kwargs (LoRA scale) is not supported by the Wan port")
        shapes = self.shapes(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                             text_kv)
        patches, t = self._prepare(shapes, hidden_states, timestep)
        cos, sin = self._rope(shapes)
        mask = self._mask(shapes)
        if text_kv is None and self.cache_text:
            hit = self._text_cache
            if hit is None or hit[0] is not encoder_hidden_states or hit[1] is not encoder_hidden_states_image:
                kv = self.encode_text(encoder_hidden_states, encoder_hidden_states_image)
                hit = self._text_cache = (encoder_hidden_states, encoder_hidden_states_image, kv)
            text_kv = hit[2]
        if text_kv is not None:
            step, state = self._step("cached", shapes, mask is not None)
            out = step(state, patches, t, text_kv, cos, sin, mask)
        else:
            step, state = self._step("full", shapes, mask is not None)
            img = None if encoder_hidden_states_image is None else self._put(encoder_hidden_states_image, P())
            out = step(state, patches, t, self._put(encoder_hidden_states, P()), img, cos, sin, mask)
        out = layout.unpad(out, shapes.tokens, axis=1)
        return unpatchify(out, shapes.grid, self.cfg.patch_size)

    # ---- abstract tracing (deviceless compiles) ---------------------------

    def _abstract(self, shape, dtype, spec):
        sharding = None if self.mesh is None else NamedSharding(self.mesh, spec)
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)

    def text_kv_shapes(self, batch: int, text_len: int, image_len: int | None = None, dtype=None):
        """Abstract `encode_text` output (for `trace(..., text_kv=...)`)."""
        c = self.cfg
        dtype = self.model.dtype if dtype is None else dtype
        kv = {k: self._abstract((c.num_layers, batch, text_len, c.inner_dim), dtype, self._kv_spec)
              for k in ("k", "v")}
        if c.added_kv_proj_dim is not None:
            for k in ("k_img", "v_img"):
                kv[k] = self._abstract((c.num_layers, batch, image_len, c.inner_dim), dtype, self._kv_spec)
        return kv

    def trace(self, hidden_states, timestep, encoder_hidden_states=None, encoder_hidden_states_image=None,
              *, text_kv=None):
        """`jax.stages.Traced` of the step for abstract (ShapeDtypeStruct) inputs
        in diffusers' layout; `.lower().compile()` it for a deviceless compile."""
        shapes = self.shapes(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                             text_kv)
        c = self.cfg
        B, R = shapes.batch, shapes.rows
        patches = self._abstract((B, R, c.patch_features), hidden_states.dtype, self._rows_spec)
        tspec = (P(None, TP) if self.par.seq_sharded else P()) if shapes.per_token else P()
        t = self._abstract((B, R) if shapes.per_token else (B,), self._time_dtype(), tspec)
        cos = sin = self._abstract((R, c.attention_head_dim), jnp.float32, P())
        mask = None if R == shapes.tokens else self._abstract((R,), jnp.bool_, P())
        if text_kv is not None:
            step, state = self._step("cached", shapes, mask is not None)
            return step.trace(state, patches, t, text_kv, cos, sin, mask)
        step, state = self._step("full", shapes, mask is not None)
        ctx = self._abstract(encoder_hidden_states.shape, encoder_hidden_states.dtype, P())
        img = None
        if encoder_hidden_states_image is not None:
            img = self._abstract(encoder_hidden_states_image.shape, encoder_hidden_states_image.dtype, P())
        return step.trace(state, patches, t, ctx, img, cos, sin, mask)


def _is_abstract(state) -> bool:
    leaves = jax.tree_util.tree_leaves(state)
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


# --------------------------------------------------------------------------
# Wan2.2 A14B: two experts switched by the boundary ratio
# --------------------------------------------------------------------------

class WanExperts:
    """Wan2.2's high-noise (`transformer`) and low-noise (`transformer_2`) experts.

    As diffusers' WanPipeline: the high-noise expert runs while
    t >= boundary_ratio * num_train_timesteps (1000), the low-noise one after.
    A single-expert pipeline (Wan2.1, TI2V-5B) has `low=None` and always runs `high`.
    """

    def __init__(self, high: Runner, low: Runner | None = None, boundary_ratio: float | None = None,
                 num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
        if (low is None) != (boundary_ratio is None):
            raise ValueError("two experts need a boundary_ratio, and a boundary_ratio needs two experts")
        self.high, self.low, self.boundary_ratio = high, low, boundary_ratio
        self.boundary_timestep = None if boundary_ratio is None else boundary_ratio * num_train_timesteps

    def expert_for(self, timestep) -> str:
        """"high" or "low" for this step's timestep (all entries must agree)."""
        if self.boundary_timestep is None:
            return "high"
        t = np.asarray(timestep)
        high = t >= self.boundary_timestep
        if high.all():
            return "high"
        if not high.any():
            return "low"
        raise ValueError(f"timestep entries straddle the expert boundary {self.boundary_timestep}: "
                         f"one step runs one expert")

    def runner(self, which: str) -> Runner:
        return self.high if which == "high" else self.low

    def encode_text(self, encoder_hidden_states, encoder_hidden_states_image=None):
        """Each expert's text K/V cache (the experts have their own projections)."""
        out = {"high": self.high.encode_text(encoder_hidden_states, encoder_hidden_states_image)}
        if self.low is not None:
            out["low"] = self.low.encode_text(encoder_hidden_states, encoder_hidden_states_image)
        return out

    def __call__(self, hidden_states, timestep, encoder_hidden_states=None, encoder_hidden_states_image=None,
                 return_dict: bool = True, attention_kwargs=None, *, text_kv=None):
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
    from difflet_tpu import weights

    path = pathlib.Path(pipeline_path)
    index = path / "model_index.json"
    info = json.loads(index.read_text()) if index.exists() else {}
    boundary = info.get("boundary_ratio")
    load = lambda sub: weights.load_transformer(path / sub, dtype=dtype, mesh=mesh, config=config, **overrides)
    high = Runner(load("transformer"), mesh, config, mode)
    if boundary is None:
        return WanExperts(high)
    if not (path / "transformer_2").exists():
        raise FileNotFoundError(f"{index} sets boundary_ratio={boundary} but {path / 'transformer_2'} "
                                f"does not exist (Wan2.2 A14B has two experts)")
    return WanExperts(high, Runner(load("transformer_2"), mesh, config, mode), float(boundary))


# --------------------------------------------------------------------------
# Bench helpers
# --------------------------------------------------------------------------

def _vae_factors(config: WanConfig) -> tuple[int, int]:
    """(temporal, spatial) VAE compression: Wan2.2's VAE (48 channels) is 16x spatial."""
    return (4, 16) if config.out_channels == 48 else (4, 8)


def example_inputs(config: WanConfig, *, height: int = 480, width: int = 832, frames: int = 9, batch: int = 1,
                   seed: int = 0, dtype=np.float32, per_token: bool | None = None, text_len: int = 512,
                   image_len: int = 257) -> dict:
    """diffusers forward kwargs (numpy) for a video of `frames` x `height` x `width` pixels."""
    ft, fs = _vae_factors(config)
    if (frames - 1) % ft or height % (fs * config.patch_size[1]) or width % (fs * config.patch_size[2]):
        raise ValueError(f"frames must be 1 + {ft}k and height/width multiples of {fs * config.patch_size[1]}")
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
    """Analytic forward FLOPs (porting-brief section 8), matmuls and attention only.

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
