"""FLUX.1 prompt -> image, as diffusers' `FluxPipeline` (`pipelines/flux/pipeline_flux.py`).

`FluxPipeline.from_pretrained("FLUX.1-dev")` (or `difflet_tpu.DiffusionPipeline`)
loads the published folder: CLIP tokenizer + CLIPTextModel (pooled prompt embedding), T5
tokenizer + T5EncoderModel (the prompt embeddings), the FluxTransformer2DModel port under its
Runner, the AutoencoderKL decoder and the FlowMatchEulerDiscreteScheduler config.

`__call__` follows diffusers' step by step: the prompts (`prompt_2` for T5, defaulting to
`prompt`), `num_images_per_prompt` copies; packed latents [B, (h/2)(w/2), 64] with
`latent_image_ids` (0, row, column) and `text_ids` zeros; sigmas `linspace(1, 1/N, N)` shifted
by mu from the image token count (FLUX.1-dev's dynamic shifting; FLUX.1-schnell's static
shift 1); the transformer gets `timestep / 1000` and, for guidance-distilled FLUX.1-dev,
`guidance = guidance_scale` embedded; true CFG (`negative_prompt` and `true_cfg_scale > 1`) runs
the negative prompt too and combines `neg + s (pos - neg)`; Euler steps; then unpack,
`latents / scaling_factor + shift_factor`, decode, [0, 1].
"""

from __future__ import annotations

import logging
import time

import jax.numpy as jnp
import numpy as np

from difflet_tpu import checks
from difflet_tpu.pipeline import diffusion as D
from difflet_tpu.pipeline.diffusion import PipelineError

logger = logging.getLogger(__name__)


class FluxPipeline(D.DiffusionPipeline):
    components = {
        "scheduler": ("scheduler", ["FlowMatchEulerDiscreteScheduler"], None),
        "text_encoder": ("text_encoder", ["CLIPTextModel"], None),
        "tokenizer": ("tokenizer", ["CLIPTokenizer", "CLIPTokenizerFast"], "clip"),
        "text_encoder_2": ("text_encoder", ["T5EncoderModel"], None),
        "tokenizer_2": ("tokenizer", ["T5TokenizerFast", "T5Tokenizer"], "t5"),
        "transformer": ("transformer", ["FluxTransformer2DModel"], None),
        "vae": ("vae", ["AutoencoderKL"], None),
    }
    # FluxPipeline.__call__ arguments this port does not honour, with diffusers' defaults
    refused = {
        "generator": None,  # torch generators: pass `seed` (jax.random) or `latents`
        "prompt_embeds": None, "pooled_prompt_embeds": None,
        "negative_prompt_embeds": None, "negative_pooled_prompt_embeds": None,
        "ip_adapter_image": None, "ip_adapter_image_embeds": None,
        "negative_ip_adapter_image": None, "negative_ip_adapter_image_embeds": None,
        "joint_attention_kwargs": None,
        "callback_on_step_end": None, "callback_on_step_end_tensor_inputs": ["latents"],
    }

    max_sequence_limit = 512  # T5's, as FluxPipeline checks it

    @classmethod
    def load(cls, path, index, *, mesh, dtype, config, runner_options):
        from difflet_tpu.encoders import clip, loading, t5
        from difflet_tpu.encoders import tokenizers as T

        self = cls(path, index, D.scheduler_config(path / "scheduler"))
        self.tokenizer = T.load_tokenizer(path / "tokenizer", "clip")
        self.tokenizer_2 = T.load_tokenizer(path / "tokenizer_2", "t5")
        clip_config = clip.CLIPTextConfig.from_dict(loading.read_config(path / "text_encoder"))
        t5_config = t5.T5Config.from_dict(loading.read_config(path / "text_encoder_2"))
        self.text_encoder = clip.from_pretrained(path / "text_encoder", dtype=dtype,
                                                 mesh=D.encoder_mesh(clip, clip_config, mesh))
        self.text_encoder_2 = t5.from_pretrained(path / "text_encoder_2", dtype=dtype,
                                                 mesh=D.encoder_mesh(t5, t5_config, mesh))
        self.load_denoiser(path, mesh=mesh, dtype=dtype, config=config, runner_options=runner_options)
        self.init_encoder_home([self.text_encoder, self.text_encoder_2], config)
        return self

    @classmethod
    def config_problems(cls, c, raw: dict) -> list[str]:
        """The components fit each other (widths, latent channels), from the configs alone: `c`
        the transformer's port config, `raw` {component: its config.json}."""
        from difflet_tpu.encoders import clip, t5

        d_model = t5.T5Config.from_dict(raw["text_encoder_2"]).d_model
        hidden = clip.CLIPTextConfig.from_dict(raw["text_encoder"]).hidden_size
        z = D.folder_latent_channels(raw["vae"])
        problems = []
        if c.joint_attention_dim != d_model:
            problems.append(f"transformer joint_attention_dim {c.joint_attention_dim} != text_encoder_2 d_model {d_model}")
        if c.pooled_projection_dim != hidden:
            problems.append(f"transformer pooled_projection_dim {c.pooled_projection_dim} != text_encoder "
                            f"hidden_size {hidden}")
        if c.in_channels != 4 * z:
            problems.append(f"transformer in_channels {c.in_channels} != 4 x the VAE's latent channels {z}")
        return problems

    # ---- diffusers' FluxPipeline methods -------------------------------------

    def encode_prompt(self, prompt, prompt_2=None, num_images_per_prompt: int = 1, max_sequence_length: int = 512,
                      name: str = "prompt"):
        """(prompt_embeds [B n, T, D] from T5, pooled_prompt_embeds [B n, D'] from CLIP, text_ids [T, 3])."""
        from difflet_tpu.encoders import runtime
        from difflet_tpu.encoders import tokenizers as T

        start = time.perf_counter()
        allow_empty = name != "prompt"  # an empty negative prompt is a prompt, as in diffusers
        prompts = T.as_prompt_list(prompt, name, allow_empty=allow_empty)
        prompts_2 = prompts if prompt_2 is None else T.as_prompt_list(prompt_2, name + "_2", allow_empty=allow_empty)
        if len(prompts_2) != len(prompts):
            raise PipelineError(f"`{name}_2` has {len(prompts_2)} prompts, `{name}` {len(prompts)}")
        clip_ids = T.clip_tokens(self.tokenizer, prompts, name, allow_empty).input_ids
        t5_ids = T.t5_tokens(self.tokenizer_2, prompts_2, max_sequence_length, name + "_2", allow_empty).input_ids
        self.timings.tokenize += time.perf_counter() - start
        start = time.perf_counter()
        # FluxPipeline passes no attention mask to either encoder
        _, pooled = runtime.encode(self.text_encoder, clip_ids)
        prompt_embeds = runtime.encode(self.text_encoder_2, t5_ids)
        pooled = jnp.repeat(pooled, num_images_per_prompt, axis=0)
        prompt_embeds = jnp.repeat(prompt_embeds, num_images_per_prompt, axis=0)
        prompt_embeds, pooled = D.wait((prompt_embeds, pooled))
        checks.check_finite(prompt_embeds, f"the {name} embeddings of text_encoder_2 (the text encode)")
        checks.check_finite(pooled, f"the pooled {name} embeddings of text_encoder (the text encode)")
        self.timings.encode += time.perf_counter() - start
        text_ids = np.zeros((prompt_embeds.shape[1], 3), np.float32)
        return prompt_embeds, pooled, text_ids

    @staticmethod
    def prepare_latent_image_ids(height: int, width: int) -> np.ndarray:
        """[(h/2)(w/2), 3] float32: (0, row, column) of each packed latent."""
        ids = np.zeros((height, width, 3), np.float32)
        ids[..., 1] = np.arange(height)[:, None]
        ids[..., 2] = np.arange(width)[None, :]
        return ids.reshape(height * width, 3)

    def __call__(self, prompt=None, prompt_2=None, negative_prompt=None, negative_prompt_2=None,
                 true_cfg_scale: float = 1.0, height: int | None = None, width: int | None = None,
                 num_inference_steps: int = 28, sigmas=None, guidance_scale: float = 3.5,
                 num_images_per_prompt: int = 1, latents=None, output_type: str = "pil", return_dict: bool = True,
                 max_sequence_length: int = 512, seed: int | None = None, **unsupported):
        """diffusers' FluxPipeline.__call__ (same names, defaults and results), plus `seed`
        (random latents from `jax.random`). Arguments this port does not honour are refused."""
        from difflet_tpu.encoders import tokenizers as T

        # everything checked before the work
        call = self.start_call(unsupported, prompt=prompt, output_type=output_type, height=height, width=width,
                               num_inference_steps=num_inference_steps, num_images_per_prompt=num_images_per_prompt,
                               max_sequence_length=max_sequence_length, max_sequence_limit=self.max_sequence_limit, sigmas=sigmas,
                               latents=latents, seed=seed,
                               scales=dict(guidance_scale=(guidance_scale, self.transformer_config.guidance_embeds),
                                           true_cfg_scale=(true_cfg_scale, True)),
                               negatives=dict(negative_prompt=negative_prompt, negative_prompt_2=negative_prompt_2))
        prompts, batch, num_images_per_prompt = call.prompts, call.batch, call.num_images_per_prompt
        do_true_cfg = float(true_cfg_scale) > 1 and negative_prompt is not None
        if negative_prompt is not None and not do_true_cfg:  # as QwenImagePipeline warns
            logger.warning("negative_prompt is passed but true CFG is not enabled since true_cfg_scale (%s) <= 1",
                           true_cfg_scale)

        self._stage("encode")
        self.encoders_in()
        max_sequence_length = call.max_sequence_length
        prompt_embeds, pooled, text_ids = self.encode_prompt(prompts, prompt_2, num_images_per_prompt,
                                                             max_sequence_length)
        if do_true_cfg:
            negatives = D.match_batch(T.as_prompt_list(negative_prompt, "negative_prompt", allow_empty=True),
                                      len(prompts), "negative_prompt")
            negatives_2 = None if negative_prompt_2 is None else D.match_batch(
                T.as_prompt_list(negative_prompt_2, "negative_prompt_2", allow_empty=True), len(prompts),
                "negative_prompt_2")
            neg_embeds, neg_pooled, neg_text_ids = self.encode_prompt(negatives, negatives_2, num_images_per_prompt,
                                                                      max_sequence_length, name="negative_prompt")
        img_ids = self.prepare_latent_image_ids(call.h // 2, call.w // 2)
        guidance = (np.full((batch,), guidance_scale, np.float32) if self.transformer_config.guidance_embeds
                    else None)
        self.encoders_out(dict(hidden_states=call.latents, timestep=np.ones((batch,), np.float32), guidance=guidance,
                               img_ids=img_ids, pooled_projections=pooled, encoder_hidden_states=prompt_embeds,
                               txt_ids=text_ids))

        def predict(latents, timestep):
            kw = dict(hidden_states=latents, timestep=timestep, guidance=guidance, img_ids=img_ids)
            v = self.run_transformer(self.transformer, "cond", **kw, pooled_projections=pooled,
                                     encoder_hidden_states=prompt_embeds, txt_ids=text_ids).sample
            if do_true_cfg:
                neg = self.run_transformer(self.transformer, "uncond", **kw, pooled_projections=neg_pooled,
                                           encoder_hidden_states=neg_embeds, txt_ids=neg_text_ids).sample
                v = D.true_cfg(v, neg, float(true_cfg_scale))
            return v

        # the VAE's decode un-scales (latents / scaling_factor + shift_factor) first
        return self.denoise_and_decode(
            call, predict, lambda x: D.unpack_latents(x, call.height, call.width, self.vae_scale_factor), return_dict)


PIPELINE = FluxPipeline
