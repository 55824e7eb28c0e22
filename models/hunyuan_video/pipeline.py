"""HunyuanVideo prompt -> video, as diffusers' `HunyuanVideoPipeline`
(`pipelines/hunyuan_video/pipeline_hunyuan_video.py`, diffusers 0.42.1).

`DiffusionPipeline.from_pretrained("hunyuanvideo-community/HunyuanVideo")` loads the published
folder: the Llama tokenizer and `LlamaModel` (difflet_tpu.encoders.decoder_lm), the CLIP tokenizer
and `CLIPTextModel` (encoders.clip, its pooled output), the HunyuanVideoTransformer3DModel port
under its Runner, the AutoencoderKLHunyuanVideo decoder (difflet_tpu.vae.hunyuan_video) and the
FlowMatchEuler scheduler (shift 7.0).

`__call__` follows diffusers' step by step:
- each prompt in `prompt_template["template"]`, tokenized to `max_sequence_length + crop_start`
  (padded, truncated); the Llama `hidden_states[-3]` (`num_hidden_layers_to_skip` 2) with the
  mask, both cropped by `crop_start` (the template's tokens before the prompt: 95 for the
  published Llama 3 tokenizer);
- CLIP's pooled output of `prompt` (diffusers 0.42.1 passes `prompt`, not `prompt_2`, to CLIP:
  `prompt_2` and `negative_prompt_2` are checked and have no effect, as there);
- latents float32 `[B, C, (F - 1) // 4 + 1, H / 8, W / 8]`; sigmas `linspace(1, 0, N + 1)[:-1]`
  (or `sigmas`) through the scheduler's shift;
- every step: `guidance = guidance_scale * 1000` embedded (in the transformer's dtype), the
  timestep `t`; with `true_cfg_scale > 1` and a negative prompt the negative rows run in the same
  batch (`neg + s (cond - neg)`, what diffusers computes in two calls); the Euler step in float32;
- `latents / scaling_factor`, the VAE's default decode (temporal tiles past 4 latent frames; on a
  mesh whose devices do not divide the batch each video's rows spread over them,
  difflet_tpu/vae/spread.py, as WanPipeline; uint8 frames off the devices for "pil"),
  `postprocess_video`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax.numpy as jnp
import numpy as np

from difflet_tpu import arguments as A
from difflet_tpu.pipeline import diffusion as D
from difflet_tpu.pipeline.placement import lm_load_kind
from difflet_tpu.pipeline import video as V
from difflet_tpu.pipeline.diffusion import PipelineError

logger = logging.getLogger(__name__)

# diffusers' DEFAULT_PROMPT_TEMPLATE (pipeline_hunyuan_video.py)
DEFAULT_PROMPT_TEMPLATE = {
    "template": (
        "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
        "1. The main content and theme of the video."
        "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
        "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
        "4. background environment, light, style and atmosphere."
        "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
    ),
    "crop_start": 95,
}
NUM_HIDDEN_LAYERS_TO_SKIP = 2  # _get_llama_prompt_embeds' default: hidden_states[-3]


@dataclasses.dataclass(frozen=True)
class HunyuanCall:
    """One `__call__`'s checked arguments."""

    output_type: str
    prompts: list
    negatives: list | None
    num_videos_per_prompt: int
    template: str
    crop_start: int
    max_sequence_length: int
    do_true_cfg: bool
    true_cfg_scale: float
    guidance_scale: float
    sampler: object
    latents: object


class HunyuanVideoPipeline(V.VideoPipeline):
    default_height = 720
    default_width = 1280
    default_num_frames = 129
    fps = 24
    components = {
        "scheduler": ("scheduler", ["FlowMatchEulerDiscreteScheduler"], None),
        "text_encoder": ("text_encoder", ["LlamaModel"], None),
        "tokenizer": ("tokenizer", ["LlamaTokenizerFast", "LlamaTokenizer", "PreTrainedTokenizerFast"], "llama"),
        "text_encoder_2": ("text_encoder", ["CLIPTextModel"], None),
        "tokenizer_2": ("tokenizer", ["CLIPTokenizer", "CLIPTokenizerFast"], "clip"),
        "transformer": ("transformer", ["HunyuanVideoTransformer3DModel"], None),
        "vae": ("vae", ["AutoencoderKLHunyuanVideo"], None),
    }
    refused = {
        "generator": None,  # torch generators: pass `seed` (jax.random) or `latents`
        "prompt_embeds": None, "pooled_prompt_embeds": None, "prompt_attention_mask": None,
        "negative_prompt_embeds": None, "negative_pooled_prompt_embeds": None, "negative_prompt_attention_mask": None,
        "attention_kwargs": None,
        "callback_on_step_end": None, "callback_on_step_end_tensor_inputs": ["latents"],
    }

    @classmethod
    def load(cls, path, index, *, mesh, dtype, config, runner_options):
        from difflet_tpu.encoders import clip, decoder_lm, loading
        from difflet_tpu.encoders import tokenizers as T
        from difflet_tpu.pipeline import samplers

        self = cls(path, index, samplers.scheduler_from_folder(path / "scheduler"))
        self.tokenizer = T.load_tokenizer(path / "tokenizer", "llama")
        self.tokenizer_2 = T.load_tokenizer(path / "tokenizer_2", "clip")
        lm_config = decoder_lm.DecoderLMConfig.from_dict(loading.read_config(path / "text_encoder"))
        clip_config = clip.CLIPTextConfig.from_dict(loading.read_config(path / "text_encoder_2"))
        lm_mesh = D.encoder_mesh(decoder_lm, lm_config, mesh)
        self.text_encoder = decoder_lm.from_pretrained(path / "text_encoder", dtype=dtype, mesh=lm_mesh,
                                                       memory_kind=lm_load_kind(config.encoder_stream, lm_mesh))
        self.text_encoder_2 = clip.from_pretrained(path / "text_encoder_2", dtype=dtype,
                                                   mesh=D.encoder_mesh(clip, clip_config, mesh))
        self.load_denoiser(path, mesh=mesh, dtype=dtype, config=config, runner_options=runner_options)
        self.init_encoder_home([self.text_encoder, self.text_encoder_2], config, stream=self.text_encoder)
        self.init_expert_home(config)
        return self

    @classmethod
    def config_problems(cls, c, raw: dict) -> list[str]:
        """The components fit each other, from the configs alone (before any weight is read)."""
        from difflet_tpu.encoders import clip, decoder_lm

        lm = decoder_lm.DecoderLMConfig.from_dict(raw["text_encoder"])
        clip_hidden = clip.CLIPTextConfig.from_dict(raw["text_encoder_2"]).hidden_size
        z = D.folder_latent_channels(raw["vae"])
        problems = []
        if c.text_embed_dim != lm.hidden_size:
            problems.append(f"transformer text_embed_dim {c.text_embed_dim} != text_encoder hidden_size {lm.hidden_size}")
        if c.pooled_projection_dim != clip_hidden:
            problems.append(f"transformer pooled_projection_dim {c.pooled_projection_dim} != text_encoder_2 "
                            f"hidden_size {clip_hidden}")
        if c.in_channels != z or c.out_channels != z:
            problems.append(f"transformer in/out channels {c.in_channels}/{c.out_channels} != the VAE's "
                            f"latent_channels {z}")
        if c.image_condition_type is not None:
            problems.append(f"the transformer has image_condition_type {c.image_condition_type!r} "
                            f"(HunyuanVideoImageToVideoPipeline's), not text-to-video's None")
        if lm.num_hidden_layers < NUM_HIDDEN_LAYERS_TO_SKIP:
            problems.append(f"text_encoder has {lm.num_hidden_layers} layers; "
                            f"hidden_states[-{NUM_HIDDEN_LAYERS_TO_SKIP + 1}] needs at least {NUM_HIDDEN_LAYERS_TO_SKIP}")
        return problems

    @property
    def vae_scale_factor_temporal(self) -> int:
        return self.vae.config.temporal_compression_ratio

    @property
    def vae_scale_factor_spatial(self) -> int:
        return self.vae.config.spatial_compression_ratio

    # ---- prompts ----------------------------------------------------------------

    def encode_prompt(self, prompts: list, call: HunyuanCall, name: str = "prompt"):
        """diffusers' `encode_prompt`: (prompt_embeds [B n, L, D] = Llama hidden_states[-3] cropped,
        pooled_prompt_embeds [B n, D'] = CLIP pooled, prompt_attention_mask [B n, L])."""
        from difflet_tpu.encoders import runtime
        from difflet_tpu.encoders import tokenizers as T

        start = time.perf_counter()
        allow_empty = name != "prompt"
        tokens = T.hunyuan_video_tokens(self.tokenizer, prompts, call.template, call.crop_start,
                                        call.max_sequence_length, name, allow_empty)
        clip_ids = T.clip_tokens(self.tokenizer_2, prompts, name, allow_empty).input_ids
        self.timings.tokenize += time.perf_counter() - start
        start = time.perf_counter()
        hidden = runtime.encode(self.text_encoder_for(self.text_encoder), tokens.input_ids, tokens.attention_mask,
                                hidden_state=-(NUM_HIDDEN_LAYERS_TO_SKIP + 1))
        _, pooled = runtime.encode(self.text_encoder_2, clip_ids)  # no mask, as diffusers
        crop = call.crop_start
        embeds, mask = hidden[:, crop:], tokens.attention_mask[:, crop:]
        if not mask.any(axis=1).all():
            raise PipelineError(f"`{name}`: after cropping the template's first {crop} tokens (prompt_template "
                                f"crop_start) a prompt has no token left; crop_start must count only the "
                                f"template's tokens before the prompt")
        n = call.num_videos_per_prompt
        embeds, pooled = D.wait((jnp.repeat(embeds, n, axis=0), jnp.repeat(pooled, n, axis=0)))
        self.timings.encode += time.perf_counter() - start
        return embeds, pooled, np.repeat(mask, n, axis=0)

    # ---- the call ---------------------------------------------------------------

    def __call__(self, prompt=None, prompt_2=None, negative_prompt=None, negative_prompt_2=None, height: int = 720,
                 width: int = 1280, num_frames: int = 129, num_inference_steps: int = 50, sigmas=None,
                 true_cfg_scale: float = 1.0, guidance_scale: float = 6.0, num_videos_per_prompt: int = 1,
                 latents=None, output_type: str = "pil", return_dict: bool = True,
                 prompt_template: dict = DEFAULT_PROMPT_TEMPLATE, max_sequence_length: int = 256,
                 seed: int | None = None, **unsupported):
        """diffusers' HunyuanVideoPipeline.__call__ (same names, defaults and results), plus `seed`
        (random latents from `jax.random`; parity runs pass `latents`). Arguments this port does
        not honour are refused by name."""
        call = self.start_hunyuan_call(unsupported, prompt=prompt, prompt_2=prompt_2, negative_prompt=negative_prompt,
                                       negative_prompt_2=negative_prompt_2, height=height, width=width,
                                       num_frames=num_frames, num_inference_steps=num_inference_steps, sigmas=sigmas,
                                       true_cfg_scale=true_cfg_scale, guidance_scale=guidance_scale,
                                       num_videos_per_prompt=num_videos_per_prompt, latents=latents,
                                       output_type=output_type, prompt_template=prompt_template,
                                       max_sequence_length=max_sequence_length, seed=seed)
        conds = self.encode_call(call)
        latents = self.denoise_video(call, conds)
        return self.finish(latents, call.output_type, return_dict)

    def start_hunyuan_call(self, unsupported: dict, *, prompt, prompt_2, negative_prompt, negative_prompt_2, height,
                           width, num_frames, num_inference_steps, sigmas, true_cfg_scale, guidance_scale,
                           num_videos_per_prompt, latents, output_type, prompt_template, max_sequence_length,
                           seed) -> HunyuanCall:
        """Every check before any work (diffusers' `check_inputs` and more), and what they give."""
        from difflet_tpu.encoders import tokenizers as T
        from difflet_tpu.pipeline import samplers

        self.check_refused(unsupported)
        output_type = self.check_video_output_type(output_type)
        if prompt is None:
            raise PipelineError("`prompt` is required (prompt_embeds are not supported by this port)")
        prompts = A.prompts(prompt)
        for name, p in (("prompt_2", prompt_2), ("negative_prompt_2", negative_prompt_2)):
            A.negative_prompt(p, name)  # diffusers checks it; its CLIP call reads `prompt`
        height, width = A.size("height", height, 16), A.size("width", width, 16)  # diffusers' check_inputs
        num_frames = A.count("num_frames", num_frames, "frames")
        num_videos_per_prompt = A.count("num_videos_per_prompt", num_videos_per_prompt, "batch")
        guidance_scale = A.scale("guidance_scale", guidance_scale)
        true_cfg_scale = A.scale("true_cfg_scale", true_cfg_scale)
        template, crop_start = self.check_template(prompt_template)
        max_sequence_length = A.integer("max_sequence_length", max_sequence_length, minimum=1)
        do_true_cfg = true_cfg_scale > 1 and negative_prompt is not None
        negatives = A.negative_prompt(negative_prompt)
        if negatives is not None:
            negatives = D.match_batch(negatives, len(prompts), "negative_prompt")
            if not do_true_cfg:
                negatives = None  # diffusers encodes it only with true_cfg_scale > 1
        if sigmas is not None:
            sigmas = np.asarray(sigmas, np.float64)
            if sigmas.ndim != 1 or not sigmas.size or not np.isfinite(sigmas).all():
                raise PipelineError(f"`sigmas` must be a non-empty list of finite numbers, got {sigmas!r}")
            num_inference_steps = len(sigmas)
        else:
            num_inference_steps = A.count("num_inference_steps", num_inference_steps, "steps")
            sigmas = np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1]
        sampler = samplers.make_sampler(self.scheduler_config, num_inference_steps, sigmas=sigmas)
        batch = len(prompts) * num_videos_per_prompt
        shape = self.latent_shape(batch, self.transformer_config.in_channels, num_frames, int(height), int(width))
        x = self.initial_video_latents(latents, seed, shape)
        from difflet_tpu.models.hunyuan_video.port import joint_sparsity, sparse_plan

        def plan(option, grid):  # the video's mask, and the joint one with the text (its SMEM bound)
            video = sparse_plan(option, grid)
            if video is not None:
                run = self.transformer
                joint_sparsity(video, run.rows(int(max_sequence_length), "text tokens"), run.row_multiple())

        c = self.transformer_config
        self.check_attention_grid((shape[2] // c.patch_size_t, shape[3] // c.patch_size, shape[4] // c.patch_size),
                                  plan)
        return HunyuanCall(output_type, prompts, negatives, num_videos_per_prompt, template, crop_start,
                           int(max_sequence_length), do_true_cfg, float(true_cfg_scale), float(guidance_scale),
                           sampler, x)

    @staticmethod
    def check_template(prompt_template) -> tuple[str, int]:
        """diffusers' `check_inputs` on `prompt_template` (a dict with "template"), plus: a "{}"
        for the prompt and an int `crop_start` >= 0 (diffusers derives a missing one from a
        max_length-padded tokenization of the template, which this port does not reproduce)."""
        if not isinstance(prompt_template, dict):
            raise PipelineError(f"`prompt_template` has to be of type `dict` but is {type(prompt_template)}")
        if "template" not in prompt_template:
            raise PipelineError(f"`prompt_template` has to contain a key `template` but only found "
                                f"{list(prompt_template)}")
        template, crop_start = prompt_template["template"], prompt_template.get("crop_start")
        if not isinstance(template, str) or "{}" not in template:
            raise PipelineError("`prompt_template['template']` must be a string with '{}' where the prompt goes")
        if crop_start is None:
            raise PipelineError("`prompt_template` without `crop_start` is not supported: give the count of the "
                                "template's tokens before the prompt (95 for the published template and tokenizer)")
        if isinstance(crop_start, bool) or not isinstance(crop_start, (int, np.integer)) or crop_start < 0:
            raise PipelineError(f"`prompt_template['crop_start']` must be an int >= 0, got {crop_start!r}")
        return template, int(crop_start)

    def encode_call(self, call: HunyuanCall) -> dict:
        """The transformer's text inputs for the call: [negative; positive] rows with true CFG."""
        self._stage("encode")
        self.encoders_in()
        embeds, pooled, mask = self.encode_prompt(call.prompts, call)
        if call.do_true_cfg:
            n_embeds, n_pooled, n_mask = self.encode_prompt(call.negatives, call, name="negative_prompt")
            embeds = jnp.concatenate([n_embeds, embeds])
            pooled = jnp.concatenate([n_pooled, pooled])
            mask = np.concatenate([n_mask, mask])
        conds = dict(encoder_hidden_states=embeds.astype(self.dtype), pooled_projections=pooled.astype(self.dtype),
                     encoder_attention_mask=jnp.asarray(mask, self.dtype))
        self.encoders_out(self.step_kwargs(call, call.latents, np.float32(1000.0), conds))
        return conds

    def step_kwargs(self, call: HunyuanCall, latents, t, conds: dict) -> dict:
        """The transformer's arguments for one step (both true-CFG rows): diffusers' `timestep`
        (t in float32) and `guidance` (guidance_scale in the transformer's dtype, times 1000)."""
        rows = 2 if call.do_true_cfg else 1
        x = jnp.concatenate([latents] * rows) if rows > 1 else latents
        b = x.shape[0]
        guidance = jnp.full((b,), call.guidance_scale, self.dtype) * jnp.asarray(1000.0, self.dtype)
        return dict(hidden_states=x.astype(self.dtype), timestep=np.full((b,), t, np.float32), guidance=guidance,
                    **conds)

    def denoise_video(self, call: HunyuanCall, conds: dict):
        def predict(latents, i, t):
            out = self.run_transformer(self.transformer, "rows", **self.step_kwargs(call, latents, t, conds),
                                       return_dict=False)[0]
            if call.do_true_cfg:
                neg, pos = jnp.split(out, 2)
                out = D.true_cfg(pos, neg, jnp.float32(call.true_cfg_scale).astype(out.dtype))
            return out

        self._stage("denoise", steps=len(call.sampler))
        return self.denoise(call.latents, call.sampler, predict)

    @staticmethod
    def check_video_output_type(output_type) -> str:
        if output_type not in ("np", "pil", "latent"):
            raise PipelineError(f"`output_type` must be 'np', 'pil' or 'latent', got {output_type!r}")
        return output_type


PIPELINES = {"HunyuanVideoPipeline": HunyuanVideoPipeline}
PIPELINE = HunyuanVideoPipeline
