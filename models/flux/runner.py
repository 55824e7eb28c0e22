"""Running the FLUX port: diffusers' forward kwargs in, diffusers' sample out.

`Runner(model, mesh, config, mode)(**kwargs)` validates the kwargs against the
model's config (errors before anything compiles), pads each stream eagerly under
SP, builds on the host what diffusers computes from scalars and ids -- the
timestep / guidance sinusoids (cast to the model dtype before the x1000) and the
RoPE tables (float64, permuted to split-halves order when the checkpoint was
loaded that way; cached while the ids stay the same) -- calls the compiled step
(one `jit` of one `shard_map`) and cuts the pad off the output, eagerly.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from difflet_tpu import collective_matmul as cm
from difflet_tpu import layout, runtime
from difflet_tpu.config import Config
from difflet_tpu.mesh import TP
from difflet_tpu.parallel import Parallel, check_divisible

from .config import FluxConfig
from .transformer_flux import PLAN, rope_tables, timestep_proj

# FLUX's all-gather-matmul implementation under SP on TPU when Config.sp_kernel
# is unset: the Pallas kernel (the reference PR measured 156.5 -> 140.6 ms a step
# at 1024x1024 on v5e-4). Off TPU the JAX ring runs unless chosen explicitly.
AG_DEFAULT = "pallas"

FORWARD_KWARGS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
                  "txt_ids", "guidance")


def _step(model, par, hidden_states, encoder_hidden_states, pooled_projections, timesteps_proj, guidance_proj,
          cos, sin):
    return model(par, hidden_states, encoder_hidden_states, pooled_projections, timesteps_proj, guidance_proj,
                 cos, sin)


def _step_masked(model, par, hidden_states, encoder_hidden_states, pooled_projections, timesteps_proj,
                 guidance_proj, cos, sin, kv_mask):
    return model(par, hidden_states, encoder_hidden_states, pooled_projections, timesteps_proj, guidance_proj,
                 cos, sin, kv_mask)


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _is_abstract(x):
    return isinstance(x, jax.ShapeDtypeStruct)


class Runner:
    """Runs a FLUX port model on one device (mesh None), under TP or under SP.

    Args:
      model: a `FluxTransformer2DModel` (loaded, or abstract for deviceless compiles).
      mesh: a `tp` mesh (None: one device).
      config: a `difflet_tpu.Config` (default: the environment); `sp` picks SP over
        TP, `sp_kernel` / `sp_rs_kernel` the ring implementations. The q/k layout
        (split-halves RoPE or not) is the model's own (`model.config.split_rope`),
        fixed when its weights were loaded.
      mode: overrides the config's choice: "tp", "sp" or "sp-xla".
      pad: under SP, pad a stream whose length is not a multiple of 2P (and mask
        its pad keys); False refuses such inputs with the rule instead.
      compiler_options: XLA options for the step's compile (e.g. TPU
        collective-matmul modes, or a lower CPU optimisation level in tests);
        the compiled executables are then cached per input signature.

    The Runner never changes the model's parameters (it only places them with
    `PLAN` if they are not yet on `mesh`), so one loaded model serves Runners of
    any P, and its parameters can be saved (orbax) at any time.
    """

    def __init__(self, model, mesh=None, config: Config | None = None, mode: str | None = None, *,
                 pad: bool = True, compiler_options: dict | None = None):
        self.model = model
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self._compiled = {}
        self.cfg: FluxConfig = model.config
        self.config = Config.from_env() if config is None else config
        self.mesh = mesh
        self.par = Parallel.for_mesh(mesh, self.config, mode=mode, ag_default=AG_DEFAULT)
        self.pad = bool(pad)
        self.mask_pad_keys = True  # tests turn this off to show the mask matters
        self.ranks = self.par.size
        self.par.local_heads(self.cfg.num_attention_heads)  # clear error: heads % P
        if mesh is not None:
            check_divisible(PLAN, nnx.state(model, nnx.Param), self.ranks)
            if not any(_is_abstract(x) for x in jax.tree_util.tree_leaves(nnx.state(model))):
                runtime.place(model, mesh, PLAN)  # a no-op for a model loaded onto this mesh
        self._steps = {}
        for masked, fn in ((False, _step), (True, _step_masked)):
            rows = P(None, TP) if self.par.seq_sharded else P()
            rep = P()
            in_specs = (rows, rows, rep, rep, rep, rep, rep) + ((rep,) if masked else ())
            self._steps[masked] = runtime.compile_step(model, fn, self.par, mesh, PLAN, in_specs=in_specs,
                                                       out_specs=rows)
        self._table_cache = (None, None)

    # ---- padding rule ------------------------------------------------------

    def stream_multiple(self, dtype) -> int:
        """Each stream's length is padded to a multiple of this under SP: 2P (two ring
        halves a rank), times the dtype's sublane rows when a Pallas kernel is chosen
        (its unsupported_reason wants whole (8|16, 128) tiles a half)."""
        if not self.par.seq_sharded:
            return 1
        kernels = self.par.mode == "sp" and "pallas" in (self.par.ag_impl, self.par.rs_impl)
        unit = 8 * (4 // jnp.dtype(dtype).itemsize) if kernels else 1
        return 2 * self.ranks * unit

    # ---- inputs ------------------------------------------------------------

    def _check(self, kw):
        c = self.cfg
        extra = {k: v for k, v in kw.items() if k not in FORWARD_KWARGS}
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
        hs, ehs, pooled = (_shape(kw[n]) for n in ("hidden_states", "encoder_hidden_states",
                                                    "pooled_projections"))
        if len(hs) != 3 or hs[-1] != c.in_channels:
            raise ValueError(f"hidden_states: shape {hs}, expected (batch, image tokens, in_channels={c.in_channels}) "
                             f"(2x2-packed latents)")
        B, n_img = hs[0], hs[1]
        if len(ehs) != 3 or ehs[0] != B or ehs[-1] != c.joint_attention_dim:
            raise ValueError(f"encoder_hidden_states: shape {ehs}, expected ({B}, text tokens, "
                             f"joint_attention_dim={c.joint_attention_dim})")
        n_txt = ehs[1]
        if n_img < 1 or n_txt < 1:
            raise ValueError(f"empty stream: {n_img} image and {n_txt} text tokens")
        if pooled != (B, c.pooled_projection_dim):
            raise ValueError(f"pooled_projections: shape {pooled}, expected ({B}, {c.pooled_projection_dim})")
        for name in ("timestep", "guidance"):
            if kw.get(name) is None:
                continue
            s = _shape(kw[name])
            if len(s) > 1 or (len(s) == 1 and s[0] not in (1, B)):
                raise ValueError(f"{name}: shape {s}, expected ({B},) (or one value for the batch)")
        if c.guidance_embeds and kw.get("guidance") is None:
            raise ValueError("guidance is required: this model has a guidance embedder (FLUX.1-dev style, "
                             "guidance_embeds=True); pass the raw guidance scale, e.g. [3.5]")
        if not c.guidance_embeds and kw.get("guidance") is not None:
            raise ValueError("guidance must be None: this model has no guidance embedder (FLUX.1-schnell "
                             "style, guidance_embeds=False)")
        ids = {}
        for name, n in (("img_ids", n_img), ("txt_ids", n_txt)):
            s = _shape(kw[name])
            if len(s) == 3:  # deprecated batched ids: diffusers takes [0]
                s = s[1:]
            if s != (n, len(c.axes_dims_rope)):
                raise ValueError(f"{name}: shape {_shape(kw[name])}, expected ({n}, {len(c.axes_dims_rope)})")
            ids[name] = s
        if self.par.seq_sharded:
            two_p = 2 * self.ranks
            for stream, n in (("image", n_img), ("text", n_txt)):
                if n % two_p and not self.pad:
                    raise ValueError(f"SP cannot split the {stream} stream of {n} tokens over tp={self.ranks}: "
                                     f"each stream is sequence-sharded on its own and "
                                     f"{cm.split_rule(self.ranks)}; or let the Runner pad it (pad=True)")
        return B, n_img, n_txt

    def _tables(self, txt_ids, img_ids, n_txt_pad, n_img_pad):
        """cos, sin [S_pad, head_dim] for [txt_pad | img_pad] (pad rows: cos 1, sin 0), in
        split-halves order when the model's q/k are; device arrays, cached by the ids."""
        txt_ids = np.asarray(txt_ids, np.float32)
        img_ids = np.asarray(img_ids, np.float32)
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        h = hashlib.sha256()
        for a in (txt_ids, img_ids):
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
        key = (h.hexdigest(), n_txt_pad, n_img_pad)
        if self._table_cache[0] == key:
            return self._table_cache[1]
        c = self.cfg
        hd = c.attention_head_dim
        cos = np.ones((n_txt_pad + n_img_pad, hd), np.float32)
        sin = np.zeros((n_txt_pad + n_img_pad, hd), np.float32)
        for ids, start in ((txt_ids, 0), (img_ids, n_txt_pad)):
            ct, st = rope_tables(ids, c.axes_dims_rope)
            cos[start:start + len(ids)] = ct
            sin[start:start + len(ids)] = st
        if c.split_rope:
            perm = layout.rope_permutation(hd)
            cos, sin = cos[:, perm], sin[:, perm]
        tables = self._replicated(cos), self._replicated(sin)
        self._table_cache = (key, tables)
        return tables

    def _replicated(self, a):
        if self.mesh is None:
            return jnp.asarray(a)
        return jax.device_put(a, NamedSharding(self.mesh, P()))

    def _prepare(self, kw, abstract: bool):
        B, n_img, n_txt = self._check(kw)
        c = self.cfg
        dtype = self.model.dtype
        mult = self.stream_multiple(dtype)
        n_img_pad, n_txt_pad = layout.padded_length(n_img, mult), layout.padded_length(n_txt, mult)
        S = n_txt_pad + n_img_pad
        masked = self.mask_pad_keys and (n_img_pad > n_img or n_txt_pad > n_txt)
        hd = c.attention_head_dim
        if abstract:
            rows = P(None, TP) if self.par.seq_sharded else P()

            def sds(shape, dt, spec=P()):
                sh = None if self.mesh is None else NamedSharding(self.mesh, spec)
                return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

            hs, ehs = kw["hidden_states"], kw["encoder_hidden_states"]
            args = [sds((B, n_img_pad, c.in_channels), hs.dtype, rows),
                    sds((B, n_txt_pad, c.joint_attention_dim), ehs.dtype, rows),
                    sds((B, c.pooled_projection_dim), kw["pooled_projections"].dtype),
                    sds((B, 256), jnp.float32), sds((B, 256), jnp.float32),
                    sds((S, hd), jnp.float32), sds((S, hd), jnp.float32)]
            if masked:
                args.append(sds((S,), jnp.bool_))
            return masked, n_img, args

        def proj(x):  # diffusers: x.to(model dtype) * 1000, then Timesteps(256)
            x = np.asarray(x)
            return timestep_proj(np.broadcast_to(x.reshape(-1), (B,)), dtype)

        hs, _ = layout.pad_tokens(kw["hidden_states"], mult) if mult > 1 else (kw["hidden_states"], 0)
        ehs, _ = layout.pad_tokens(kw["encoder_hidden_states"], mult) if mult > 1 else (kw["encoder_hidden_states"], 0)
        timestep = proj(kw["timestep"])
        guidance = proj(kw["guidance"]) if kw.get("guidance") is not None else np.zeros((B, 256), np.float32)
        cos, sin = self._tables(kw["txt_ids"], kw["img_ids"], n_txt_pad, n_img_pad)
        args = [hs, ehs, kw["pooled_projections"], timestep, guidance, cos, sin]
        if masked:
            mask = np.concatenate([layout.key_mask(n_txt, n_txt_pad), layout.key_mask(n_img, n_img_pad)])
            args.append(mask)
        return masked, n_img, args

    # ---- running -----------------------------------------------------------

    def __call__(self, hidden_states=None, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                 img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None,
                 controlnet_block_samples=None, controlnet_single_block_samples=None, return_dict=True,
                 controlnet_blocks_repeat=False):
        """diffusers' `FluxTransformer2DModel.forward` kwargs; returns the sample
        `[B, N_img, patch_size**2 * out_channels]` (a 1-tuple if return_dict=False)."""
        kw = dict(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                  pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids, txt_ids=txt_ids,
                  guidance=guidance, joint_attention_kwargs=joint_attention_kwargs,
                  controlnet_block_samples=controlnet_block_samples,
                  controlnet_single_block_samples=controlnet_single_block_samples,
                  controlnet_blocks_repeat=controlnet_blocks_repeat)
        masked, n_img, args = self._prepare(kw, abstract=False)
        step, state = self._steps[masked]
        if self.compiler_options is None:
            out = step(state, *args)
        else:
            sig = (masked,) + tuple((tuple(np.shape(a)), str(jnp.result_type(a))) for a in args)
            if sig not in self._compiled:
                self._compiled[sig] = step.trace(state, *args).lower().compile(
                    compiler_options=self.compiler_options)
            out = self._compiled[sig](state, *args)
        out = layout.unpad(out, n_img)
        return out if return_dict else (out,)

    def trace(self, **kwargs):
        """The `jax.stages.Traced` step for abstract kwargs (ShapeDtypeStructs), for
        deviceless compiles: `runner.trace(**inputs).lower().compile()`."""
        masked, _, args = self._prepare(kwargs, abstract=True)
        step, state = self._steps[masked]
        return step.trace(state, *args)


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
    if height % 16 or width % 16:
        raise ValueError(f"height and width must be multiples of 16 (VAE 8x, 2x2 packing), got {height}x{width}")
    h, w = height // 16, width // 16
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
    out = {k: rng.standard_normal(shapes[k][0]).astype(np.float32).astype(dtype)
           for k in ("hidden_states", "encoder_hidden_states", "pooled_projections")}
    out["timestep"] = np.full((batch,), 1.0, np.float32)
    out["img_ids"] = img_ids.reshape(n, 3)
    out["txt_ids"] = np.zeros((text_len, 3), np.float32)
    if c.guidance_embeds:
        out["guidance"] = np.full((batch,), 3.5, np.float32)
    return out


def flops(config: FluxConfig, inputs: dict) -> float:
    """Analytic forward FLOPs (porting-brief section 8): linears 2*n*d_in*d_out,
    attention 4*S^2*D per block; softmax, norms and RoPE ignored."""
    c = config
    B, n_img = _shape(inputs["hidden_states"])[:2]
    n_txt = _shape(inputs["encoder_hidden_states"])[1]
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
