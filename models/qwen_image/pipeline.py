"""Qwen-Image prompt -> image, as diffusers' `QwenImagePipeline`
(`pipelines/qwenimage/pipeline_qwenimage.py`).

`QwenImagePipeline.from_pretrained("Qwen-Image")` (or `difflet_tpu.DiffusionPipeline`)
loads the published folder: the Qwen2 tokenizer, Qwen2.5-VL's language model as the text encoder
(difflet_tpu.encoders.decoder_lm; the vision tower is not read), the QwenImageTransformer2DModel
port under its Runner, the causal 3D AutoencoderKLQwenImage decoder and the scheduler config.

`__call__` follows diffusers: each prompt in the chat template, the encoder's last hidden state
(after its final norm) with the 34 template tokens dropped and right-padded to the longest
prompt with a 0/1 mask (`None` when every token is valid), cut at `max_sequence_length`; packed
latents [B, (h/2)(w/2), 64] and `img_shapes` [(1, h/2, w/2)] per item; sigmas `linspace(1, 1/N,
N)` with the exponential dynamic shift from the image token count and the stretch to
`shift_terminal`; the transformer gets `timestep / 1000`; true CFG when a `negative_prompt` is
given and `true_cfg_scale > 1` (default 4.0): `neg + s (pos - neg)` rescaled per token to the
conditional prediction's norm; Euler steps; then unpack to [B, C, 1, h, w],
`latents * latents_std + latents_mean`, decode, the one frame, [0, 1].
"""

from __future__ import annotations

import logging
import time

import jax.numpy as jnp
import numpy as np

from difflet_tpu import checks
from difflet_tpu.pipeline import diffusion as D
from difflet_tpu.pipeline.placement import lm_load_kind

logger = logging.getLogger(__name__)


class QwenImagePipeline(D.DiffusionPipeline):
    components = {
        "scheduler": ("scheduler", ["FlowMatchEulerDiscreteScheduler"], None),
        "text_encoder": ("text_encoder", ["Qwen2_5_VLForConditionalGeneration"], None),
        "tokenizer": ("tokenizer", ["Qwen2Tokenizer", "Qwen2TokenizerFast"], "qwen2"),
        "transformer": ("transformer", ["QwenImageTransformer2DModel"], None),
        "vae": ("vae", ["AutoencoderKLQwenImage"], None),
    }
    refused = {
        "generator": None,  # torch generators: pass `seed` (jax.random) or `latents`
        "prompt_embeds": None, "prompt_embeds_mask": None,
        "negative_prompt_embeds": None, "negative_prompt_embeds_mask": None,
        "attention_kwargs": None,
        "callback_on_step_end": None, "callback_on_step_end_tensor_inputs": ["latents"],
    }

    max_sequence_limit = 1024  # as QwenImagePipeline checks it

    @classmethod
    def load(cls, path, index, *, mesh, dtype, config, runner_options):
        from difflet_tpu.encoders import decoder_lm, loading
        from difflet_tpu.encoders import tokenizers as T

        self = cls(path, index, D.scheduler_config(path / "scheduler"))
        self.tokenizer = T.load_tokenizer(path / "tokenizer", "qwen2")
        lm_config = decoder_lm.DecoderLMConfig.from_dict(loading.read_config(path / "text_encoder"))
        lm_mesh = D.encoder_mesh(decoder_lm, lm_config, mesh)
        self.text_encoder = decoder_lm.from_pretrained(path / "text_encoder", dtype=dtype, mesh=lm_mesh,
                                                       memory_kind=lm_load_kind(config.encoder_stream, lm_mesh))
        self.load_denoiser(path, mesh=mesh, dtype=dtype, config=config, runner_options=runner_options)
        self.init_encoder_home([self.text_encoder], config, stream=self.text_encoder)
        return self

    @classmethod
    def config_problems(cls, c, raw: dict) -> list[str]:
        """The components fit each other, from the configs alone (FluxPipeline.config_problems)."""
        from difflet_tpu.encoders import decoder_lm

        hidden = decoder_lm.DecoderLMConfig.from_dict(raw["text_encoder"]).hidden_size
        z = D.folder_latent_channels(raw["vae"])
        problems = []
        if c.joint_attention_dim != hidden:
            problems.append(f"transformer joint_attention_dim {c.joint_attention_dim} != text_encoder hidden_size "
                            f"{hidden}")
        if c.in_channels != 4 * z:
            problems.append(f"transformer in_channels {c.in_channels} != 4 x the VAE's z_dim {z}")
        if c.guidance_embeds:
            problems.append("a guidance-distilled transformer (guidance_embeds) is not supported by this pipeline")
        return problems

    # ---- diffusers' QwenImagePipeline methods ---------------------------------

    def encode_prompt(self, prompt, num_images_per_prompt: int = 1, max_sequence_length: int = 512,
                      name: str = "prompt"):
        """(prompt_embeds [B n, L, D], prompt_embeds_mask [B n, L] int32 or None when all valid)."""
        from difflet_tpu.encoders import runtime
        from difflet_tpu.encoders import tokenizers as T

        start = time.perf_counter()
        tokens = T.qwen_image_tokens(self.tokenizer, prompt, name, allow_empty=name != "prompt")
        self.timings.tokenize += time.perf_counter() - start
        start = time.perf_counter()
        hidden = runtime.encode(self.text_encoder_for(self.text_encoder), tokens.input_ids, tokens.attention_mask)
        embeds, mask = T.drop_template(hidden, tokens.attention_mask, max_sequence_length)
        embeds = D.wait(jnp.repeat(embeds, num_images_per_prompt, axis=0))
        checks.check_finite(embeds, f"the {name} embeddings of text_encoder (the text encode)")
        self.timings.encode += time.perf_counter() - start
        mask = np.repeat(mask, num_images_per_prompt, axis=0)
        return embeds, (None if mask.all() else mask)

    def __call__(self, prompt=None, negative_prompt=None, true_cfg_scale: float = 4.0, height: int | None = None,
                 width: int | None = None, num_inference_steps: int = 50, sigmas=None,
                 guidance_scale: float | None = None, num_images_per_prompt: int = 1, latents=None,
                 output_type: str = "pil", return_dict: bool = True, max_sequence_length: int = 512,
                 seed: int | None = None, **unsupported):
        """diffusers' QwenImagePipeline.__call__ (same names, defaults and results), plus `seed`
        (random latents from `jax.random`). Arguments this port does not honour are refused."""
        from difflet_tpu.encoders import tokenizers as T

        call = self.start_call(unsupported, prompt=prompt, output_type=output_type, height=height, width=width,
                               num_inference_steps=num_inference_steps, num_images_per_prompt=num_images_per_prompt,
                               max_sequence_length=max_sequence_length, max_sequence_limit=self.max_sequence_limit, sigmas=sigmas,
                               latents=latents, seed=seed,
                               scales=dict(guidance_scale=(guidance_scale, False), true_cfg_scale=(true_cfg_scale, True)),
                               negatives=dict(negative_prompt=negative_prompt))
        prompts, batch, num_images_per_prompt = call.prompts, call.batch, call.num_images_per_prompt
        has_neg = negative_prompt is not None
        if float(true_cfg_scale) > 1 and not has_neg:
            logger.warning("true_cfg_scale is passed as %s, but classifier-free guidance is not enabled since no "
                           "negative_prompt is provided.", true_cfg_scale)
        elif float(true_cfg_scale) <= 1 and has_neg:
            logger.warning(" negative_prompt is passed but classifier-free guidance is not enabled since "
                           "true_cfg_scale <= 1")
        if guidance_scale is not None:  # as diffusers: only guidance-distilled transformers read it
            logger.warning("guidance_scale is passed as %s, but ignored since the model is not guidance-distilled.",
                           guidance_scale)
        do_true_cfg = float(true_cfg_scale) > 1 and has_neg
        negatives = (D.match_batch(T.as_prompt_list(negative_prompt, "negative_prompt", allow_empty=True),
                                   len(prompts), "negative_prompt") if do_true_cfg else None)

        self._stage("encode")
        self.encoders_in()
        max_sequence_length = call.max_sequence_length
        prompt_embeds, prompt_mask = self.encode_prompt(prompts, num_images_per_prompt, max_sequence_length)
        if do_true_cfg:
            neg_embeds, neg_mask = self.encode_prompt(negatives, num_images_per_prompt, max_sequence_length,
                                                      name="negative_prompt")
        img_shapes = [[(1, call.h // 2, call.w // 2)]] * batch
        self.encoders_out(dict(hidden_states=call.latents, timestep=np.ones((batch,), np.float32),
                               encoder_hidden_states=prompt_embeds, encoder_hidden_states_mask=prompt_mask,
                               img_shapes=img_shapes))

        def predict(latents, timestep):
            v = self.run_transformer(self.transformer, "cond", hidden_states=latents, timestep=timestep,
                                     encoder_hidden_states=prompt_embeds, encoder_hidden_states_mask=prompt_mask,
                                     img_shapes=img_shapes).sample
            if do_true_cfg:
                neg = self.run_transformer(self.transformer, "uncond", hidden_states=latents, timestep=timestep,
                                           encoder_hidden_states=neg_embeds, encoder_hidden_states_mask=neg_mask,
                                           img_shapes=img_shapes).sample
                v = D.true_cfg_rescaled(v, neg, float(true_cfg_scale))
            return v

        # [B, C, 1, h, w]: the VAE's decode un-scales (latents / (1 / latents_std) + latents_mean), keeps frame 0
        return self.denoise_and_decode(
            call, predict, lambda x: D.unpack_latents(x, call.height, call.width, self.vae_scale_factor)[:, :, None],
            return_dict)


PIPELINE = QwenImagePipeline
