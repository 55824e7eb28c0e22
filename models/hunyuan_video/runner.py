"""Running the port: diffusers' forward keyword arguments in, diffusers' `sample` out.

`Runner(model, mesh, config, mode)` validates the inputs against the config
(errors before anything compiles), cuts the latent into patches and pads both
token streams eagerly (under SP each to a multiple of 2P, so every rank
compiles one identical program), runs the step (one `jax.jit` of one
`shard_map`), then cuts the output back and unpatchifies it, also eagerly.
"""

from __future__ import annotations

import dataclasses

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
from difflet_tpu.parallel import Parallel

from .config import HunyuanVideoConfig
from .model import Geometry, patchify, unpack_proj_out, unpatchify
from .plan import PLAN

# This model's all-gather-matmul default on TPU under SP (the reference PR measured the
# Pallas kernel at 478.0 ms vs 500.7 ms for the ring at 320x512x61); off TPU the JAX ring.
AG_DEFAULT = "pallas"

STEP_INPUTS = ("patches", "timestep", "encoder_hidden_states", "encoder_attention_mask", "pooled_projections",
               "guidance")


def _is_abstract(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


class Runner:
    """Runs a HunyuanVideo port on one device (`mesh=None`), under TP or under SP.

    Args:
      model: a built or loaded `HunyuanVideoTransformer3DModel` (or an abstract one
        from `runtime.abstract_model`, for `trace`).
      mesh: a `tp` mesh (`difflet_tpu.make_mesh`); None runs on one device.
      config: `difflet_tpu.Config` (default: the environment): `sp`, `sp_single`,
        the collective-matmul kernels.
      mode: overrides the config's choice: "tp", "sp" or "sp-xla".
      pad: under SP, pad each token stream to a multiple of 2P (False: refuse
        token counts SP cannot split, with the rule in the error).
    """

    def __init__(self, model, mesh=None, config: Config | None = None, mode: str | None = None, *, pad=True):
        self.model = model
        self.cfg: HunyuanVideoConfig = model.config
        self.config = Config.from_env() if config is None else config
        self.mesh = mesh
        par = Parallel.for_mesh(mesh, self.config, mode=mode, ag_default=AG_DEFAULT)
        if mesh is None and jax.default_backend() == "tpu":
            par = dataclasses.replace(par, attn_impl="splash")
        self.par = par
        self.pad = pad
        self.dtype = jnp.dtype(model.dtype)
        if par.sharded:
            self._check_divisible(par.size)
            leaves = jax.tree_util.tree_leaves(nnx.state(model))
            if leaves and not any(_is_abstract(x) for x in leaves):
                runtime.place(model, mesh, PLAN)
        unpack_proj_out(model, mesh if par.sharded else None)  # once, in place (see model.PackedProjOut)
        self._steps = {}

    # ---- checks ----------------------------------------------------------

    def _check_divisible(self, size: int):
        c = self.cfg
        if c.num_attention_heads % size:
            raise ValueError(f"HunyuanVideo: {c.num_attention_heads} attention heads do not divide over "
                             f"tp={size} ranks (TP and SP split heads, and the single blocks' proj_out per head)")
        for name, width in (("inner dim", c.inner_dim), ("MLP width", c.mlp_dim)):
            if width % size:
                raise ValueError(f"HunyuanVideo: {name} {width} does not divide over tp={size} ranks")

    def geometry(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                 pooled_projections, guidance=None) -> Geometry:
        """Checks every input's shape against the config; the static geometry of the step."""
        c = self.cfg

        def shape(name, x):
            if x is None:
                raise ValueError(f"{name} is required")
            return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)

        hs = shape("hidden_states", hidden_states)
        if len(hs) != 5:
            raise ValueError(f"hidden_states must be [B, C, F, H, W], got shape {hs}")
        B, C, F, H, W = hs
        if C != c.in_channels:
            raise ValueError(f"hidden_states has {C} channels; the config has in_channels={c.in_channels}")
        if F % c.patch_size_t or H % c.patch_size or W % c.patch_size:
            raise ValueError(f"hidden_states frames/height/width {F}x{H}x{W} must be multiples of the patch "
                             f"({c.patch_size_t}, {c.patch_size}, {c.patch_size})")
        ehs = shape("encoder_hidden_states", encoder_hidden_states)
        if len(ehs) != 3 or ehs[0] != B or ehs[2] != c.text_embed_dim:
            raise ValueError(f"encoder_hidden_states must be [B={B}, N_text, {c.text_embed_dim}], got {ehs}")
        n_txt = ehs[1]
        if n_txt < 1:
            raise ValueError("encoder_hidden_states has no tokens")
        m = shape("encoder_attention_mask", encoder_attention_mask)
        if m != (B, n_txt):
            raise ValueError(f"encoder_attention_mask must be [B, N_text] = {(B, n_txt)}, got {m}")
        pp = shape("pooled_projections", pooled_projections)
        if pp != (B, c.pooled_projection_dim):
            raise ValueError(f"pooled_projections must be {(B, c.pooled_projection_dim)}, got {pp}")
        for name, x, needed in (("timestep", timestep, True), ("guidance", guidance, c.guidance_embeds)):
            if x is None and not needed:
                continue
            s = shape(name, x)
            if s not in ((), (1,), (B,)):
                raise ValueError(f"{name} must be a scalar, (1,) or (B,) = ({B},), got {s}")
        fp, hp, wp = F // c.patch_size_t, H // c.patch_size, W // c.patch_size
        n_img = fp * hp * wp
        n_img_pad, n_txt_pad = n_img, n_txt
        if self.par.seq_sharded:
            mult = self.row_multiple()
            if self.pad:
                n_img_pad, n_txt_pad = layout.padded_length(n_img, mult), layout.padded_length(n_txt, mult)
            else:
                for name, n in (("image tokens", n_img), ("text tokens", n_txt)):
                    if n % mult:
                        raise ValueError(f"SP cannot split {n} {name} over tp={self.par.size} (multiple of "
                                         f"{mult} needed): {cm.split_rule(self.par.size)} (or run with pad=True)")
        return Geometry(frames=fp, height=hp, width=wp, n_img=n_img, n_img_pad=n_img_pad, n_txt_pad=n_txt_pad,
                        single_sp=bool(self.config.sp_single))

    def row_multiple(self) -> int:
        """Under SP each token stream is padded to a multiple of this: 2P (each rank's shard
        splits in two ring halves), times a sublane tile when a Pallas kernel is selected
        (its halves must be whole (8 | 16, 128) tiles; 8 rows for float32, 16 for bfloat16)."""
        mult = 2 * self.par.size
        if "pallas" in (self.par.ag_impl, self.par.rs_impl):
            mult *= 8 * (4 // self.dtype.itemsize)
        return mult

    # ---- eager input preparation -------------------------------------------

    def _specs(self):
        rows = P(None, TP, None) if self.par.seq_sharded else P()
        return (rows, P(), P(), P(), P(), P()), rows

    def prepare(self, geom: Geometry, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                pooled_projections, guidance=None):
        """The step's inputs (patches, padded streams), eagerly; ShapeDtypeStructs for abstract inputs."""
        c, dtype = self.cfg, self.dtype
        B = hidden_states.shape[0]
        n_patch = c.in_channels * c.patch_volume
        shapes = dict(patches=(B, geom.n_img_pad, n_patch), timestep=(B,),
                      encoder_hidden_states=(B, geom.n_txt_pad, c.text_embed_dim),
                      encoder_attention_mask=(B, geom.n_txt_pad), pooled_projections=(B, c.pooled_projection_dim),
                      guidance=(B,))
        dtypes = dict(patches=dtype, timestep=jnp.float32, encoder_hidden_states=dtype,
                      encoder_attention_mask=jnp.float32, pooled_projections=dtype, guidance=jnp.float32)
        if _is_abstract(hidden_states):
            in_specs, _ = self._specs()
            out = []
            for name, spec in zip(STEP_INPUTS, in_specs):
                sharding = NamedSharding(self.mesh, spec) if self.mesh is not None else None
                out.append(jax.ShapeDtypeStruct(shapes[name], dtypes[name], sharding=sharding))
            return tuple(out)

        def vec(x):
            x = jnp.asarray(0.0 if x is None else x, jnp.float32).reshape(-1)
            return jnp.broadcast_to(x, (B,))

        patches = patchify(hidden_states, c.patch_size_t, c.patch_size)
        patches, _ = layout.pad_tokens(patches, geom.n_img_pad)
        text, _ = layout.pad_tokens(encoder_hidden_states, geom.n_txt_pad)
        mask, _ = layout.pad_tokens(encoder_attention_mask, geom.n_txt_pad)  # pad text tokens: invalid
        return (jnp.asarray(patches, dtype), vec(timestep), jnp.asarray(text, dtype),
                jnp.asarray(mask, jnp.float32), jnp.asarray(pooled_projections, dtype), vec(guidance))

    # ---- the step -----------------------------------------------------------

    def step(self, geom: Geometry):
        """The compiled step for `geom` and the model state to call it with."""
        if geom not in self._steps:
            def fn(model, par, *inputs):
                return model(par, geom, *inputs)

            in_specs, out_specs = self._specs()
            self._steps[geom] = runtime.compile_step(self.model, fn, self.par, self.mesh, PLAN,
                                                     in_specs=in_specs, out_specs=out_specs)
        return self._steps[geom]

    def __call__(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, pooled_projections,
                 guidance=None, attention_kwargs=None, return_dict=True):
        """diffusers' `forward` keyword arguments; returns `sample` `[B, C_out, F, H, W]`."""
        if attention_kwargs:
            raise ValueError(f"attention_kwargs {sorted(attention_kwargs)} are not supported (no LoRA scale)")
        kwargs = dict(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                      encoder_attention_mask=encoder_attention_mask, pooled_projections=pooled_projections,
                      guidance=guidance)
        geom = self.geometry(**kwargs)
        inputs = self.prepare(geom, **kwargs)
        step, state = self.step(geom)
        out = step(state, *inputs)
        out = layout.unpad(out, geom.n_img)  # image rows of the joint sequence / padded stream
        c = self.cfg
        return unpatchify(out, geom.frames, geom.height, geom.width, c.patch_size_t, c.patch_size)

    def trace(self, **abstract_kwargs):
        """`jax.stages.Traced` of the step for abstract (ShapeDtypeStruct) diffusers kwargs,
        e.g. for a deviceless compile: `runner.trace(**inputs).lower().compile()`."""
        kwargs = {k: abstract_kwargs.get(k) for k in ("hidden_states", "timestep", "encoder_hidden_states",
                                                      "encoder_attention_mask", "pooled_projections", "guidance")}
        geom = self.geometry(**kwargs)
        inputs = self.prepare(geom, **kwargs)
        step, state = self.step(geom)
        return step.trace(state, *inputs)


# --------------------------------------------------------------------------
# Bench helpers
# --------------------------------------------------------------------------

def latent_shape(config: HunyuanVideoConfig, height: int, width: int, frames: int, batch: int = 1):
    """The latent `[B, C_in, F, H, W]` of a `frames` x `height` x `width` video (VAE 4x temporal, 8x spatial)."""
    if (frames - 1) % 4 or height % 16 or width % 16:
        raise ValueError(f"video {frames}x{height}x{width}: frames must be 4k+1, height and width multiples of 16")
    return (batch, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)


def example_inputs(config: HunyuanVideoConfig, *, height: int = 320, width: int = 512, frames: int = 61,
                   batch: int = 1, seed: int = 0, dtype=np.float32, text_tokens: int = 256,
                   valid_text_tokens: int | None = None) -> dict:
    """diffusers forward kwargs (numpy) for a video of `frames` x `height` x `width` pixels:
    the latent, 256 LLM text tokens (the pipeline's max_sequence_length), pooled CLIP,
    timestep and (guidance-distilled models) guidance = 6.0 * 1000."""
    rng = np.random.default_rng(seed)
    shape = latent_shape(config, height, width, frames, batch)
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
    """Analytic forward FLOPs (porting brief section 8: a Linear over n tokens costs
    2*n*d_in*d_out, attention 4*S_q*S_k*D), embedders and modulation included."""
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
