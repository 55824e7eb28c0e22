"""Wan 2.1 / 2.2 prompt -> video, as diffusers' `WanPipeline` (`pipelines/wan/pipeline_wan.py`).

`WanPipeline.from_pretrained("Wan2.1-T2V-14B-Diffusers")` (or `difflet_tpu.DiffusionPipeline`)
loads the published folder: the T5 tokenizer and UMT5-XXL (difflet_tpu.encoders.t5), the
WanTransformer3DModel port under its Runner (and `transformer_2`, Wan2.2-A14B's low-noise
expert, when `model_index.json` sets `boundary_ratio`), the AutoencoderKLWan decoder (Wan 2.1's
16 channels or Wan 2.2's 48) and the scheduler the folder names (UniPC with flow sigmas, as
published, or flow-matching Euler).

`__call__` follows diffusers' step by step:
- prompts cleaned as `prompt_clean` (ftfy, HTML unescaping twice, whitespace), tokenized to
  `max_sequence_length` (padded), encoded with the mask, every position past a prompt's tokens
  set to zero; `negative_prompt` (default "") the same when `guidance_scale > 1`;
- latents float32 `[B, C, 1 + (F - 1) / 4, H / 8, W / 8]` (Wan 2.2's VAE: / 16);
- every step: the expert for `t` (high noise while `t >= boundary_ratio * 1000`, with
  `guidance_scale`; low noise after, with `guidance_scale_2`), the timestep `t` per sample or,
  with `expand_timesteps` (Wan2.2 TI2V-5B), per token; the unconditional and conditional rows
  run as one batch (`uncond + g (cond - uncond)`, what diffusers computes in two calls; a `cfg`
  mesh axis puts them on two rings); the scheduler's step in float32;
- `latents / (1 / latents_std) + latents_mean`, the decode, `postprocess_video`.

Each expert's text K/V is computed once per call (`Runner.encode_text`), not in every step.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from difflet_tpu import arguments as A
from difflet_tpu import checks
from difflet_tpu.pipeline import diffusion as D
from difflet_tpu.pipeline import video as V
from difflet_tpu.pipeline.diffusion import PipelineError

from .schedule import expert

logger = logging.getLogger(__name__)


def basic_clean(text: str) -> str:
    try:
        import ftfy
    except ImportError:  # diffusers skips ftfy when it is not installed; it is a dependency here
        ftfy = None
    if ftfy is not None:
        text = ftfy.fix_text(text)
    return html.unescape(html.unescape(text)).strip()


def whitespace_clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def prompt_clean(text: str) -> str:
    """diffusers' Wan `prompt_clean`."""
    return whitespace_clean(basic_clean(text))


@jax.jit
def cfg_combine(rows, scale):
    """[uncond; cond] rows -> `uncond + g (cond - uncond)` (diffusers' Wan pipelines)."""
    uncond, cond = jnp.split(rows, 2)
    return uncond + scale.astype(rows.dtype) * (cond - uncond)


class WanPipeline(V.VideoPipeline):
    components = {
        "scheduler": ("scheduler", ["UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"], None),
        "text_encoder": ("text_encoder", ["UMT5EncoderModel", "T5EncoderModel"], None),
        "tokenizer": ("tokenizer", ["T5TokenizerFast", "T5Tokenizer", "AutoTokenizer"], "t5"),
        "transformer": ("transformer", ["WanTransformer3DModel"], None),
        "vae": ("vae", ["AutoencoderKLWan"], None),
    }
    optional = {"transformer_2": ("transformer", ["WanTransformer3DModel"], None)}
    refused = {
        "generator": None,  # torch generators: pass `seed` (jax.random) or `latents`
        "prompt_embeds": None, "negative_prompt_embeds": None,
        "attention_kwargs": None,
        "callback_on_step_end": None, "callback_on_step_end_tensor_inputs": ["latents"],
    }

    @classmethod
    def folder_components(cls, index: dict) -> dict:
        """`transformer_2` is part of the folder when model_index.json names a class for it (Wan2.2-A14B)."""
        out = dict(cls.components)
        for name, spec in cls.optional.items():
            entry = index.get(name)
            if isinstance(entry, list) and len(entry) == 2 and entry[1]:
                out[name] = spec
        return out

    @classmethod
    def load(cls, path, index, *, mesh, dtype, config, runner_options):
        from difflet_tpu.encoders import loading, t5
        from difflet_tpu.encoders import tokenizers as T

        from difflet_tpu.pipeline import samplers

        self = cls(path, index, samplers.scheduler_from_folder(path / "scheduler"))
        self.boundary_ratio = index.get("boundary_ratio")
        self.expand_timesteps = bool(index.get("expand_timesteps", False))
        self.fps = 24 if self.expand_timesteps else 16  # Wan2.2 TI2V-5B: 24 fps; Wan 2.1, 2.2 A14B: 16 fps
        if self.boundary_ratio is not None and "transformer_2" not in cls.folder_components(index):
            raise PipelineError(f"{path}: model_index.json sets boundary_ratio={self.boundary_ratio} but names no "
                                f"transformer_2 (Wan2.2-A14B's low-noise expert)")
        self.tokenizer = T.load_tokenizer(path / "tokenizer", "t5")
        t5_config = t5.T5Config.from_dict(loading.read_config(path / "text_encoder"))
        self.text_encoder = t5.from_pretrained(path / "text_encoder", dtype=dtype,
                                               mesh=D.encoder_mesh(t5, t5_config, mesh))
        self.load_denoiser(path, mesh=mesh, dtype=dtype, config=config, runner_options=runner_options)
        self.experts = [self.transformer]
        if self.boundary_ratio is not None:
            self.experts.append(self.load_runner(path / "transformer_2", mesh=mesh, dtype=dtype, config=config,
                                                 runner_options=runner_options))
            self.transformer_2 = self.experts[1]
        self.init_encoder_home([self.text_encoder], config)
        self.init_expert_home(config)
        return self

    @classmethod
    def config_problems(cls, c, raw: dict) -> list[str]:
        """The components fit each other, from the configs alone (before any weight is read)."""
        z = D.folder_latent_channels(raw["vae"])
        problems = []
        d_model = raw["text_encoder"].get("d_model")
        if c.text_dim != d_model:
            problems.append(f"transformer text_dim {c.text_dim} != text_encoder d_model {d_model}")
        expand = c.in_channels == z  # text-to-video, or TI2V's image over latent frame 0
        if c.in_channels != cls.latent_channels_in(z, expand) or c.out_channels != z:
            problems.append(f"transformer in/out channels {c.in_channels}/{c.out_channels} do not fit the VAE's "
                            f"z_dim {z} (expected {cls.latent_channels_in(z, expand)}/{z})")
        if "transformer_2" in raw:
            t2 = raw["transformer_2"]
            if (t2.get("in_channels"), t2.get("out_channels"), list(t2.get("patch_size", []))) != \
                    (c.in_channels, c.out_channels, list(c.patch_size)):
                problems.append("transformer_2's channels or patch size differ from transformer's")
        return problems

    def sampler(self, num_inference_steps: int):
        """The folder's scheduler (`scheduler_config.json`'s `_class_name`) set to the call's steps."""
        from difflet_tpu.pipeline import samplers

        return samplers.make_sampler(self.scheduler_config, num_inference_steps)

    @staticmethod
    def latent_channels_in(z: int, expand_timesteps: bool = False) -> int:
        """The transformer's input channels: the latents alone (text-to-video)."""
        return z

    # ---- diffusers' WanPipeline methods ----------------------------------------

    def encode_prompt(self, prompt, num_videos_per_prompt: int = 1, max_sequence_length: int = 512,
                      name: str = "prompt"):
        """`_get_t5_prompt_embeds`: [B n, max_sequence_length, d_model] in the transformer's dtype,
        zero past each prompt's tokens."""
        from difflet_tpu.encoders import runtime
        from difflet_tpu.encoders import tokenizers as T

        start = time.perf_counter()
        prompts = [prompt_clean(p) for p in T.as_prompt_list(prompt, name, allow_empty=name != "prompt")]
        tokens = T.t5_tokens(self.tokenizer, prompts, max_sequence_length, name, allow_empty=name != "prompt")
        self.timings.tokenize += time.perf_counter() - start
        start = time.perf_counter()
        hidden = runtime.encode(self.text_encoder, tokens.input_ids, tokens.attention_mask)
        mask = jnp.asarray(tokens.attention_mask > 0, hidden.dtype)[..., None]
        embeds = jnp.repeat((hidden * mask).astype(self.dtype), num_videos_per_prompt, axis=0)
        embeds = D.wait(embeds)
        self.timings.encode += time.perf_counter() - start
        checks.check_finite(embeds, f"the {name} embeddings (the text encoder)")
        return embeds

    def __call__(self, prompt=None, negative_prompt=None, height: int = 480, width: int = 832, num_frames: int = 81,
                 num_inference_steps: int = 50, guidance_scale: float = 5.0, guidance_scale_2: float | None = None,
                 num_videos_per_prompt: int = 1, latents=None, output_type: str = "np", return_dict: bool = True,
                 max_sequence_length: int = 512, seed: int | None = None, **unsupported):
        """diffusers' WanPipeline.__call__ (same names, defaults and results), plus `seed` (random
        latents from `jax.random`). Arguments this port does not honour are refused."""
        call = self.start_video_call(unsupported, prompt=prompt, negative_prompt=negative_prompt, height=height,
                                     width=width, num_frames=num_frames, num_inference_steps=num_inference_steps,
                                     guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                                     num_videos_per_prompt=num_videos_per_prompt, output_type=output_type,
                                     max_sequence_length=max_sequence_length, latents=latents, seed=seed)
        conds = self.encode_call(call)
        latents = self.denoise_video(call, conds)
        return self.finish(latents, call.output_type, return_dict)

    # ---- the parts the image-to-video pipeline shares --------------------------------

    def start_video_call(self, unsupported: dict, *, prompt, negative_prompt, height, width, num_frames,
                         num_inference_steps, guidance_scale, guidance_scale_2, num_videos_per_prompt, output_type,
                         max_sequence_length, latents, seed, channels: int | None = None) -> "VideoCall":
        """Every check before any work, in diffusers' order, and what they give."""
        self.check_refused(unsupported)
        self.timings = D.Timings()
        guidance_scale = A.scale("guidance_scale", guidance_scale)
        guidance_scale_2 = A.scale("guidance_scale_2", guidance_scale_2, required=False)
        A.negative_prompt(negative_prompt)  # checked whether or not guidance reads it
        if self.boundary_ratio is None and guidance_scale_2 is not None:
            raise PipelineError("`guidance_scale_2` is only supported when the pipeline's `boundary_ratio` is not "
                                "None (a Wan2.2-A14B folder)")
        if self.boundary_ratio is not None and guidance_scale_2 is None:
            guidance_scale_2 = guidance_scale
        output_type = self.check_video_output_type(output_type)
        height, width = self.check_video_size(height, width, tuple(self.transformer_config.patch_size[1:]))
        num_frames = self.check_frames(num_frames)
        num_inference_steps = A.count("num_inference_steps", num_inference_steps, "steps")
        num_videos_per_prompt = A.count("num_videos_per_prompt", num_videos_per_prompt, "batch")
        max_sequence_length = A.max_sequence_length(max_sequence_length, 512)
        prompts = A.prompts(prompt)
        do_cfg = guidance_scale > 1.0
        negatives = None
        if do_cfg:
            negatives = D.match_batch(A.negative_prompt("" if negative_prompt is None else negative_prompt),
                                      len(prompts), "negative_prompt")
        elif negative_prompt is not None:
            logger.warning("negative_prompt is passed but classifier-free guidance is not enabled since "
                           "guidance_scale <= 1")
        batch = A.integer("videos per call (prompts x num_videos_per_prompt)", len(prompts) * num_videos_per_prompt,
                          limit="batch")
        z = D.vae_latent_channels(self.vae)
        shape = self.latent_shape(batch, z if channels is None else channels, num_frames, height, width)
        sampler = self.sampler(num_inference_steps)
        x = self.initial_video_latents(latents, seed, shape)
        self.check_attention_grid(shape)
        return VideoCall(output_type, height, width, num_frames, prompts, negatives, batch, num_videos_per_prompt,
                         int(max_sequence_length), do_cfg, float(guidance_scale),
                         None if guidance_scale_2 is None else float(guidance_scale_2), sampler, x)

    def check_attention_grid(self, shape) -> None:
        """The call's block-sparse attention planned now (`CachedLoop.check_attention_grid`,
        models/wan/port.sparse_plan)."""
        from difflet_tpu.models.wan.port import sparse_plan

        p = self.transformer_config.patch_size
        super().check_attention_grid(tuple(n // q for n, q in zip(shape[2:], p)), sparse_plan)

    def encode_call(self, call: "VideoCall") -> dict:
        """The prompt embeddings of the call: [negative; positive] rows with CFG, else positive."""
        self._stage("encode")
        self.encoders_in()
        embeds = self.encode_prompt(call.prompts, call.num_videos_per_prompt, call.max_sequence_length)
        if call.do_cfg:
            neg = self.encode_prompt(call.negatives, call.num_videos_per_prompt, call.max_sequence_length,
                                     name="negative_prompt")
            embeds = jnp.concatenate([neg, embeds])
        conds = {"encoder_hidden_states": embeds, **self.image_conditions(call)}
        self.encoders_out(self.step_kwargs(call, call.latents, np.float32(999.0), conds))
        return conds

    def image_conditions(self, call: "VideoCall") -> dict:
        """The transformer's image tokens (text-to-video: none)."""
        return {}

    def step_kwargs(self, call: "VideoCall", latents, t, conds: dict) -> dict:
        """The transformer's arguments for one step (both CFG rows)."""
        rows = 2 if call.do_cfg else 1
        x = self.model_input(call, latents)
        x = jnp.concatenate([x] * rows) if rows > 1 else x
        b = x.shape[0]
        if self.expand_timesteps:
            _, _, f, h, w = latents.shape
            p = self.transformer_config.patch_size
            n = (f // p[0]) * (h // p[1]) * (w // p[2])
            timestep = np.broadcast_to(self.token_timesteps(call, t, (f, h, w)), (b, n)).copy()
        else:
            timestep = np.full((b,), t, np.float32)
        return dict(hidden_states=x.astype(self.dtype), timestep=timestep, **conds)

    def model_input(self, call: "VideoCall", latents):
        """The transformer's input rows from the latents (text-to-video: the latents)."""
        return latents

    def token_timesteps(self, call: "VideoCall", t, grid) -> np.ndarray:
        """`expand_timesteps`: the timestep per token (text-to-video: `t` everywhere)."""
        f, h, w = grid
        p = self.transformer_config.patch_size
        return np.full(((f // p[0]) * (h // p[1]) * (w // p[2]),), t, np.float32)

    def denoise_video(self, call: "VideoCall", conds: dict):
        """The loop: each step's expert (its text K/V computed at its first step), the CFG rows
        in one call, the scheduler's step."""
        text_kv = {}

        def predict(latents, i, t):
            e = expert(float(t), self.boundary_ratio)
            kw = self.step_kwargs(call, latents, t, conds)
            self.activate_expert(e, kw, i)
            runner = self.experts[e]
            if e not in text_kv:
                text_kv[e] = runner.encode_text(kw.pop("encoder_hidden_states"),
                                                kw.pop("encoder_hidden_states_image", None))
            else:
                kw.pop("encoder_hidden_states")
                kw.pop("encoder_hidden_states_image", None)
            out = self.run_transformer(runner, "rows", **kw, text_kv=text_kv[e], return_dict=False)[0]
            if call.do_cfg:
                scale = call.guidance_scale if e == 0 else call.guidance_scale_2
                out = cfg_combine(out, jnp.float32(scale))
            return out

        self._stage("denoise", steps=len(call.sampler))
        return self.denoise(call.latents, call.sampler, predict)


@dataclasses.dataclass(frozen=True)
class VideoCall:
    """One `__call__`'s checked arguments (`WanPipeline.start_video_call`)."""

    output_type: str
    height: int
    width: int
    num_frames: int
    prompts: list
    negatives: list | None
    batch: int
    num_videos_per_prompt: int
    max_sequence_length: int
    do_cfg: bool
    guidance_scale: float
    guidance_scale_2: float | None
    sampler: object
    latents: object
    images: tuple = ()  # image-to-video: the images CLIP's vision tower reads



class WanImageToVideoPipeline(WanPipeline):
    """diffusers' `WanImageToVideoPipeline` (`pipelines/wan/pipeline_wan_i2v.py`): Wan 2.1 I2V
    (CLIP's vision tower, `image_encoder`, gives `encoder_hidden_states_image`: its
    `hidden_states[-2]`), Wan 2.2 I2V-A14B (no image encoder, two experts) and Wan 2.2 TI2V-5B
    (`expand_timesteps`).

    The image is resized to the call's size (Lanczos) and encoded by the VAE as the first frame
    of a video whose other frames are zeros (or whose last frame is `last_image`); its
    normalised latents condition every step: concatenated after the noise latents with 4 mask
    channels (1 where a frame is given; Wan 2.1 / 2.2 I2V, in_channels = 2 z + 4), or, with
    `expand_timesteps`, written over latent frame 0 with timestep 0 on its tokens (TI2V)."""

    components = dict(WanPipeline.components)
    optional = dict(WanPipeline.optional,
                    image_encoder=("image_encoder", ["CLIPVisionModel"], None),
                    image_processor=("image_processor", ["CLIPImageProcessor", "CLIPImageProcessorFast"], None))
    refused = dict(WanPipeline.refused, image_embeds=None)
    vae_encoder = True  # the conditioning image is encoded

    @classmethod
    def load(cls, path, index, *, mesh, dtype, config, runner_options):
        from difflet_tpu.encoders import clip_vision, loading

        self = super().load(path, index, mesh=mesh, dtype=dtype, config=config, runner_options=runner_options)
        parts = cls.folder_components(index)
        self.image_encoder = self.image_processor = None
        if self.transformer_config.image_dim is not None:
            if "image_processor" not in parts:
                raise PipelineError(f"{path}: the transformer reads CLIP image tokens but model_index.json names no "
                                    f"image_processor")
            vision = clip_vision.CLIPVisionConfig.from_dict(loading.read_config(path / "image_encoder"))
            self.image_processor = clip_vision.load_image_processor(path / "image_processor")
            self.image_encoder = clip_vision.from_pretrained(path / "image_encoder", dtype=dtype,
                                                             mesh=D.encoder_mesh(clip_vision, vision, mesh))
            self.init_encoder_home([self.text_encoder, self.image_encoder], config)
        return self

    @staticmethod
    def latent_channels_in(z: int, expand_timesteps: bool = False) -> int:
        """The noise latents, then (not TI2V) the 4 mask channels and the condition's z."""
        return z if expand_timesteps else 2 * z + 4

    @classmethod
    def config_problems(cls, c, raw: dict) -> list[str]:
        problems = super().config_problems(c, raw)
        if c.image_dim is not None:
            if "image_encoder" not in raw:
                problems.append(f"the transformer reads CLIP image tokens (image_dim {c.image_dim}) but "
                                f"model_index.json names no image_encoder")
            elif raw["image_encoder"].get("hidden_size") != c.image_dim:
                problems.append(f"image_encoder hidden_size {raw['image_encoder'].get('hidden_size')} != transformer "
                                f"image_dim {c.image_dim}")
        return problems

    def encode_image(self, images) -> "jax.Array":
        """`hidden_states[-2]` of CLIP's vision tower for the (first, last) images, [n, L_img, D]."""
        from difflet_tpu.encoders import clip_vision, runtime

        start = time.perf_counter()
        pixels = clip_vision.preprocess(self.image_processor, images)
        embeds = D.wait(runtime.encode_image(self.image_encoder, pixels).astype(self.dtype))
        self.timings.encode += time.perf_counter() - start
        return embeds

    def __call__(self, image=None, prompt=None, negative_prompt=None, height: int = 480, width: int = 832,
                 num_frames: int = 81, num_inference_steps: int = 50, guidance_scale: float = 5.0,
                 guidance_scale_2: float | None = None, num_videos_per_prompt: int = 1, latents=None,
                 last_image=None, output_type: str = "np", return_dict: bool = True, max_sequence_length: int = 512,
                 seed: int | None = None, **unsupported):
        """diffusers' WanImageToVideoPipeline.__call__ (same names, defaults and results), plus `seed`.
        `image` / `last_image`: PIL images, uint8 arrays [H, W, 3] or image file paths."""
        from difflet_tpu.pipeline import images as I

        if image is None:
            raise PipelineError("`image` is required: the first frame to animate (a PIL image, an [H, W, 3] "
                                "uint8 array or an image file)")
        if last_image is not None and self.expand_timesteps:
            raise PipelineError("`last_image` is not used by an expand_timesteps (Wan2.2 TI2V) pipeline: diffusers "
                                "ignores it there, so it is refused rather than dropped")
        if last_image is not None and self.image_encoder is not None \
                and self.transformer_config.pos_embed_seq_len is None:
            raise PipelineError("`last_image` with CLIP image tokens needs an FLF2V transformer (its image position "
                                "embedding, pos_embed_seq_len); this folder's transformer has none")
        if last_image is None and self.transformer_config.pos_embed_seq_len is not None:
            raise PipelineError("this FLF2V transformer (pos_embed_seq_len) reads a first and a last image: give "
                                "`last_image`")
        call = self.start_video_call(unsupported, prompt=prompt, negative_prompt=negative_prompt, height=height,
                                     width=width, num_frames=num_frames, num_inference_steps=num_inference_steps,
                                     guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                                     num_videos_per_prompt=num_videos_per_prompt, output_type=output_type,
                                     max_sequence_length=max_sequence_length, latents=latents, seed=seed)
        first = I.preprocess(image, call.height, call.width, "image")
        last = None if last_image is None else I.preprocess(last_image, call.height, call.width, "last_image")
        call = dataclasses.replace(call, images=(image,) if last_image is None else (image, last_image))
        self.condition = self.prepare_condition(call, first, last)
        conds = self.encode_call(call)
        latents = self.denoise_video(call, conds)
        if self.expand_timesteps:
            latents = self.with_first_frame(latents)
        return self.finish(latents, call.output_type, return_dict)

    def image_conditions(self, call) -> dict:
        """Wan 2.1 I2V: CLIP's `hidden_states[-2]` of the image, the same rows for every video and
        both CFG rows (diffusers repeats it per prompt, which fails with num_videos_per_prompt > 1;
        here every video gets it)."""
        if self.image_encoder is None:
            return {}
        embeds = self.encode_image(list(call.images))  # [n images, L, D]: the images of one sample, in order
        return {"encoder_hidden_states_image": jnp.tile(embeds, (call.batch * (2 if call.do_cfg else 1), 1, 1))}

    def prepare_condition(self, call, first, last):
        """`prepare_latents`' condition: the VAE's mode of [image, zeros.., (last image)], normalised;
        with `expand_timesteps` the image alone (one latent frame)."""
        self._stage("encode image")
        start = time.perf_counter()
        first = jnp.asarray(first)[:, :, None]
        if self.expand_timesteps:
            video = first
        else:
            n_zero = call.num_frames - 1 - (last is not None)
            parts = [first, jnp.zeros(first.shape[:2] + (n_zero,) + first.shape[3:], first.dtype)]
            video = jnp.concatenate(parts + ([jnp.asarray(last)[:, :, None]] if last is not None else []), axis=2)
        cond = self.vae.scale(self.vae.encode(video.astype(self.vae.dtype)))
        cond = jnp.repeat(cond.astype(jnp.float32), call.batch, axis=0)
        self.timings.encode += time.perf_counter() - start
        checks.check_finite(cond, "the image condition (the VAE's encode)")
        if self.expand_timesteps:
            return cond
        b, _, f, h, w = call.latents.shape
        ft = self.vae_scale_factor_temporal
        given = np.zeros(call.num_frames, np.float32)
        given[0] = 1.0
        if last is not None:
            given[-1] = 1.0
        # frame 0's flag repeated `ft` times, then one flag per frame: `ft` mask channels per latent frame
        mask = np.concatenate([np.repeat(given[:1], ft), given[1:]]).reshape(f, ft).T  # [ft, f]
        mask = np.broadcast_to(mask[None, :, :, None, None], (b, ft, f, h, w))
        return jnp.concatenate([jnp.asarray(mask, jnp.float32), cond], axis=1)

    def with_first_frame(self, latents):
        """TI2V: latent frame 0 is the image's condition (`(1 - mask) condition + mask latents`)."""
        return latents.at[:, :, :1].set(self.condition.astype(latents.dtype))

    def model_input(self, call, latents):
        if self.expand_timesteps:
            return self.with_first_frame(latents)
        return jnp.concatenate([latents, self.condition], axis=1)

    def token_timesteps(self, call, t, grid) -> np.ndarray:
        """TI2V: timestep 0 on the first latent frame's tokens (the given image), `t` elsewhere."""
        ts = super().token_timesteps(call, t, grid)
        p = self.transformer_config.patch_size
        ts[:(grid[1] // p[1]) * (grid[2] // p[2])] = 0.0
        return ts


PIPELINES = {"WanPipeline": WanPipeline, "WanImageToVideoPipeline": WanImageToVideoPipeline}
PIPELINE = WanPipeline
