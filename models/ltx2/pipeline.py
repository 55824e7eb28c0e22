"""LTX-2 prompt -> video + audio, as diffusers' `LTX2Pipeline` (`pipelines/ltx2/pipeline_ltx2.py`).

`LTX2Pipeline.from_pretrained("Lightricks/LTX-2")` (or `difflet_tpu.DiffusionPipeline`) loads the
published folder: the Gemma tokenizer and Gemma-3 (difflet_tpu.encoders.decoder_lm, every hidden
state), the text connectors (connectors.py), the LTX2VideoTransformer3DModel port under its Runner
(video and audio streams), the video VAE decoder (vae/ltx2_video.py), the audio VAE decoder
(vae/ltx2_audio.py), the vocoder (vae/ltx2_vocoder.py) and the flow-matching Euler scheduler.

`__call__` follows diffusers' step by step:
- prompts (and `negative_prompt`, default "", when either guidance scale is > 1) tokenized with
  left padding to `max_sequence_length`, Gemma-3's hidden states stacked, the connectors -> the
  video / audio text embeddings and their mask ([negative; positive] rows);
- video latents `[B, C, 1 + (F - 1) / r_t, H / r_s, W / r_s]` normalised by the VAE's
  mean / std / scaling factor when given (random N(0, 1) from `seed` otherwise), packed to tokens;
  audio latents `[B, C, L, M]` with `L = round(F / frame_rate x sample_rate / hop / 4)`, packed
  `[B, L, C M]` and normalised when given;
- sigmas `linspace(1, 1 / N, N)` shifted by mu from the video token count (one schedule for
  both streams);
- every step: the transformer on [uncond; cond] rows, in x0 space (`x - v sigma`) the deltas of
  CFG (`(g - 1)(cond - uncond)`), STG (`s (cond - perturbed)`, the blocks of
  `spatio_temporal_guidance_blocks` perturbed) and modality isolation (`(m - 1)(cond - isolated)`,
  no audio <-> video cross-attention), each with its own audio scale, `guidance_rescale`
  (diffusers' `rescale_noise_cfg`), back to velocity, Euler steps in float32;
- the video decode (on a mesh whose devices do not divide the batch, each video's rows spread over
  them: difflet_tpu/vae/spread.py, as WanPipeline; uint8 frames off the devices for "pil") and
  `postprocess_video`; the audio latents denormalised, unpacked, decoded to a mel spectrogram and
  vocoded: `.audio` is the waveform `[B, channels, samples]` at `audio_sample_rate` (the vocoder's
  output rate).

Refused by name: torch `generator` (pass `seed` or the latents), precomputed embeddings, custom
`timesteps`, prompt enhancement, `noise_scale` / `decode_noise_scale` (random noise diffusers draws
from torch), callbacks and `attention_kwargs`. `decode_timestep` only reaches a VAE with
`timestep_conditioning`, which the video VAE port refuses at load; it changes nothing here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from difflet_tpu import arguments as A
from difflet_tpu import checks
from difflet_tpu.pipeline import diffusion as D
from difflet_tpu.pipeline.placement import lm_load_kind
from difflet_tpu.pipeline import video as V
from difflet_tpu.pipeline.diffusion import PipelineError

from . import text as ltx2_text

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LTX2PipelineOutput:
    """diffusers' `LTX2PipelineOutput`: `frames` as `VideoPipelineOutput.frames`; `audio` the
    waveform float32 `[B, channels, samples]` at `audio_sample_rate` Hz (with `"latent"`: the
    denormalised latents of both, `[B, C, T, h, w]` and `[B, C, L, M]`)."""

    frames: Any
    audio: Any
    audio_sample_rate: int
    stats: dict = dataclasses.field(default_factory=dict)  # what the call did (difflet_tpu.pipeline.caching)


def pack_latents(latents, p: int, pt: int):
    """`_pack_latents`: [B, C, F, H, W] -> [B, F/pt H/p W/p, C pt p p]."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // pt, pt, h // p, p, w // p, p).transpose(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, (f // pt) * (h // p) * (w // p), c * pt * p * p)


def unpack_latents(latents, f: int, h: int, w: int, p: int, pt: int):
    """`_unpack_latents`: the inverse of `pack_latents` (f, h, w: the patch grid)."""
    b = latents.shape[0]
    x = latents.reshape(b, f, h, w, -1, pt, p, p).transpose(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, -1, f * pt, h * p, w * p)


def rescale_noise_cfg(noise_cfg, noise_pred_text, guidance_rescale):
    """diffusers' `rescale_noise_cfg` (per-sample std, unbiased as torch's)."""
    axes = tuple(range(1, noise_cfg.ndim))
    std_text = jnp.std(noise_pred_text, axis=axes, keepdims=True, ddof=1)
    std_cfg = jnp.std(noise_cfg, axis=axes, keepdims=True, ddof=1)
    return guidance_rescale * (noise_cfg * (std_text / std_cfg)) + (1 - guidance_rescale) * noise_cfg


@jax.jit
def guide(x, sigma, cond, uncond, stg, isolated, scales):
    """x0-space guidance of one stream: `scales` = (cfg, stg, modality, rescale); absent
    predictions are None-free (their scale makes the delta 0). Returns the velocity."""
    g, s, m, r = scales[0], scales[1], scales[2], scales[3]
    to_x0 = lambda v: x - v * sigma
    c = to_x0(cond)
    guided = c + (g - 1) * (c - to_x0(uncond)) + s * (c - to_x0(stg)) + (m - 1) * (c - to_x0(isolated))
    guided = jnp.where(r > 0, rescale_noise_cfg(guided, c, r), guided)
    return (x - guided) / sigma


@jax.jit
def euler(x, v, dt):
    return (x.astype(jnp.float32) + dt * v.astype(jnp.float32)).astype(x.dtype)


class LTX2Pipeline(V.VideoPipeline):
    components = {
        "scheduler": ("scheduler", ["FlowMatchEulerDiscreteScheduler"], None),
        "text_encoder": ("text_encoder", ["Gemma3ForConditionalGeneration"], None),
        "tokenizer": ("tokenizer", ["GemmaTokenizer", "GemmaTokenizerFast"], "gemma"),
        "connectors": ("transformer", ["LTX2TextConnectors"], None),
        "transformer": ("transformer", ["LTX2VideoTransformer3DModel"], None),
        "vae": ("vae", ["AutoencoderKLLTX2Video"], None),
        "audio_vae": ("vae", ["AutoencoderKLLTX2Audio"], None),
        "vocoder": ("vae", ["LTX2Vocoder"], None),
    }
    refused = {
        "generator": None,  # torch generators: pass `seed` (jax.random) or the latents
        "sigmas": None, "timesteps": None,
        "noise_scale": 0.0, "decode_noise_scale": None,
        "prompt_embeds": None, "prompt_attention_mask": None,
        "negative_prompt_embeds": None, "negative_prompt_attention_mask": None,
        "system_prompt": None, "enable_prompt_enhancement": False, "prompt_max_new_tokens": None,
        "prompt_enhancement_kwargs": None, "prompt_enhancement_seed": 10, "min_seconds": 1.0, "max_seconds": 20.0,
        "attention_kwargs": None,
        "callback_on_step_end": None, "callback_on_step_end_tensor_inputs": ["latents"],
    }
    default_height, default_width, default_num_frames, fps = 512, 768, 121, 24
    max_sequence_limit = 1024
    makes_audio = True  # `.audio` / `.audio_sample_rate`: generate muxes it into the MP4

    @classmethod
    def load(cls, path, index, *, mesh, dtype, config, runner_options):
        from difflet_tpu.encoders import decoder_lm, loading
        from difflet_tpu.encoders import tokenizers as T
        from difflet_tpu.pipeline import samplers
        from difflet_tpu.vae import AutoencoderKLLTX2Audio, LTX2Vocoder

        from . import connectors

        self = cls(path, index, samplers.scheduler_from_folder(path / "scheduler"))
        self.tokenizer = T.load_tokenizer(path / "tokenizer", "gemma")
        lm_config = decoder_lm.DecoderLMConfig.from_dict(loading.read_config(path / "text_encoder"))
        lm_mesh = D.encoder_mesh(decoder_lm, lm_config, mesh)
        self.text_encoder = decoder_lm.from_pretrained(path / "text_encoder", dtype=dtype, mesh=lm_mesh,
                                                        memory_kind=lm_load_kind(config.encoder_stream, lm_mesh))
        # the connectors (replicated) read the encoder's output where it is: its mesh or one device
        self.connectors = connectors.from_pretrained(path / "connectors", dtype=dtype, mesh=lm_mesh)
        self.transformer = self.load_runner(path / "transformer", mesh=mesh, dtype=dtype, config=config,
                                            runner_options=runner_options)
        self.transformer_config = self.transformer.cfg
        self.vae = D.load_vae(path / "vae", dtype=dtype, mesh=mesh)
        self.vae_scale_factor = self.vae.spatial_compression_ratio
        self.dtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(jnp.float32)
        self.audio_vae = AutoencoderKLLTX2Audio.from_pretrained(path / "audio_vae", dtype=dtype, mesh=mesh)
        self.vocoder = LTX2Vocoder.from_pretrained(path / "vocoder", dtype=dtype, mesh=mesh)
        self.init_encoder_home([self.text_encoder, self.connectors], config, stream=self.text_encoder)
        self.text_trim = config.text_trim  # Gemma-3 on the real tokens only (models/ltx2/text.py)
        return self

    @classmethod
    def config_problems(cls, c, raw: dict) -> list[str]:
        """The components fit each other, from the configs alone (before any weight is read)."""
        problems = []
        vae, conn = raw["vae"], raw["connectors"]
        audio = raw["audio_vae"]
        if c.in_channels != vae.get("latent_channels") * c.patch_size_t * c.patch_size ** 2:
            problems.append(f"transformer in_channels {c.in_channels} != the video VAE's latent_channels "
                            f"{vae.get('latent_channels')} x its patch")
        audio_in = audio.get("latent_channels", 8) * (audio.get("mel_bins", 64) // 4)
        if c.audio_in_channels != audio_in:
            problems.append(f"transformer audio_in_channels {c.audio_in_channels} != the audio VAE's latent_channels "
                            f"x mel_bins / 4 = {audio_in}")
        for stream, dim in (("video", c.text_dim), ("audio", c.audio_text_dim)):
            width = conn.get(f"{stream}_connector_num_attention_heads", 0) * conn.get(
                f"{stream}_connector_attention_head_dim", 0)
            if dim != width:
                problems.append(f"the transformer reads {stream} text embeddings of width {dim}, the connectors give "
                                f"{width}")
        return problems

    # ---- diffusers' LTX2Pipeline properties ----------------------------------------

    @property
    def vae_scale_factor_temporal(self) -> int:
        return self.vae.temporal_compression_ratio

    @property
    def vae_scale_factor_spatial(self) -> int:
        return self.vae.spatial_compression_ratio

    @property
    def audio_sample_rate(self) -> int:
        """The waveform's rate: the vocoder's `output_sampling_rate`."""
        return self.vocoder.sample_rate

    def audio_latent_frames(self, num_frames: int, frame_rate: float) -> int:
        """`round(num_frames / frame_rate x sample_rate / mel_hop_length / 4)`, as diffusers."""
        c = self.audio_vae.config
        per_second = c.sample_rate / c.mel_hop_length / float(self.audio_vae.temporal_compression_ratio)
        return round(num_frames / frame_rate * per_second)

    def encode_prompt(self, prompts, num_videos_per_prompt: int, max_sequence_length: int, name: str = "prompt"):
        """`_get_gemma_prompt_embeds` (tokens, Gemma-3's stacked hidden states): [B n, S, D (L + 1)]
        and the mask [B n, S]."""
        from difflet_tpu.encoders import tokenizers as T

        start = time.perf_counter()
        tokens = T.ltx2_tokens(self.tokenizer, prompts, max_sequence_length, name, allow_empty=name != "prompt")
        self.timings.tokenize += time.perf_counter() - start
        start = time.perf_counter()
        embeds = ltx2_text.gemma_prompt_embeds(self.text_encoder_for(self.text_encoder), tokens.input_ids, tokens.attention_mask,
                                               trim=self.text_trim)
        embeds = D.wait(jnp.repeat(embeds.astype(self.dtype), num_videos_per_prompt, axis=0))
        self.timings.encode += time.perf_counter() - start
        checks.check_finite(embeds, f"the {name} embeddings (the text encoder)")
        return embeds, np.repeat(tokens.attention_mask, num_videos_per_prompt, axis=0)

    def __call__(self, prompt=None, negative_prompt=None, height: int = 512, width: int = 768,
                 num_frames: int | None = None, frame_rate: float = 24.0, motion_speed: float = 1.0,
                 num_inference_steps: int = 30, guidance_scale: float = 3.0, stg_scale: float = 1.0,
                 modality_scale: float = 3.0, guidance_rescale: float = 0.7, audio_guidance_scale: float | None = 7.0,
                 audio_stg_scale: float | None = 1.0, audio_modality_scale: float | None = 3.0,
                 audio_guidance_rescale: float | None = 0.7, spatio_temporal_guidance_blocks=(28,),
                 num_videos_per_prompt: int = 1, latents=None, audio_latents=None, decode_timestep=0.0,
                 use_cross_timestep: bool = True, output_type: str = "pil", return_dict: bool = True,
                 max_sequence_length: int = 1024, seed: int | None = None, **unsupported):
        """diffusers' LTX2Pipeline.__call__ (same names, defaults and results), plus `seed` (random
        latents from `jax.random`). Arguments this port does not honour are refused."""
        self.check_refused(unsupported)
        self.timings = D.Timings()
        scales = {k: A.scale(k, v, required=False) for k, v in dict(
            guidance_scale=guidance_scale, stg_scale=stg_scale, modality_scale=modality_scale,
            guidance_rescale=guidance_rescale, audio_guidance_scale=audio_guidance_scale,
            audio_stg_scale=audio_stg_scale, audio_modality_scale=audio_modality_scale,
            audio_guidance_rescale=audio_guidance_rescale).items()}
        for k in ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale"):
            if scales[k] is None:
                raise PipelineError(f"`{k}` must be a finite real number, got None")
            # diffusers: `audio_x = audio_x or x` (None and 0 take the video value)
            scales["audio_" + k] = scales["audio_" + k] or scales[k]
        frame_rate = A.scale("frame_rate", frame_rate, minimum=1e-6)
        motion_speed = A.scale("motion_speed", motion_speed, minimum=1e-6)
        for value in decode_timestep if isinstance(decode_timestep, (list, tuple)) else [decode_timestep]:
            A.scale("decode_timestep", value)  # a number or one per video; no effect without timestep conditioning
        if not isinstance(use_cross_timestep, (bool, np.bool_)):
            raise PipelineError(f"`use_cross_timestep` must be True or False, got {use_cross_timestep!r}")
        do_cfg = scales["guidance_scale"] > 1.0 or scales["audio_guidance_scale"] > 1.0
        do_stg = scales["stg_scale"] > 0.0 or scales["audio_stg_scale"] > 0.0
        do_mod = scales["modality_scale"] > 1.0 or scales["audio_modality_scale"] > 1.0
        stg_blocks = None
        if do_stg:
            stg_blocks = list(spatio_temporal_guidance_blocks or [])
            if not stg_blocks:
                raise PipelineError("Spatio-Temporal Guidance (STG) is specified (stg_scale or audio_stg_scale > 0) but "
                                    "no STG blocks are supplied in `spatio_temporal_guidance_blocks`")
            c = self.transformer_config
            bad = [b for b in stg_blocks if not isinstance(b, (int, np.integer)) or not 0 <= b < c.num_layers]
            if bad:
                raise PipelineError(f"`spatio_temporal_guidance_blocks` {bad} are not blocks 0..{c.num_layers - 1}")
            if not c.perturbed_attn:
                raise PipelineError("STG (stg_scale or audio_stg_scale > 0) needs a transformer with perturbed_attn; "
                                    "this one has none (pass stg_scale=0 and audio_stg_scale=0)")
        output_type = self.check_video_output_type(output_type)
        height, width = A.size("height", height, 32), A.size("width", width, 32)  # diffusers' check_inputs
        num_frames = A.count("num_frames", self.default_num_frames if num_frames is None else num_frames, "frames")
        num_inference_steps = A.count("num_inference_steps", num_inference_steps, "steps")
        num_videos_per_prompt = A.count("num_videos_per_prompt", num_videos_per_prompt, "batch")
        max_sequence_length = A.max_sequence_length(max_sequence_length, self.max_sequence_limit)
        prompts = A.prompts(prompt)
        negatives = None
        if do_cfg:
            negatives = D.match_batch(A.negative_prompt(negative_prompt or ""), len(prompts), "negative_prompt")
        else:
            A.negative_prompt(negative_prompt)
        batch = A.integer("videos per call (prompts x num_videos_per_prompt)", len(prompts) * num_videos_per_prompt,
                          limit="batch")

        # latents: the shapes diffusers infers, checked before any work
        c = self.transformer_config
        p, pt = c.patch_size, c.patch_size_t
        shape = self.latent_shape(batch, self.vae.config.latent_channels, num_frames, height, width)
        _, _, lf, lh, lw = shape
        if lf % pt or lh % p or lw % p:
            raise PipelineError(f"the latent grid {lf} x {lh} x {lw} does not divide by the transformer's patch "
                                f"{pt} x {p} x {p}")
        audio_frames = self.audio_latent_frames(num_frames, frame_rate)
        ac = self.audio_vae.config
        audio_shape = (batch, ac.latent_channels, audio_frames, ac.mel_bins // self.audio_vae.mel_compression_ratio)
        if audio_latents is not None and getattr(audio_latents, "ndim", None) == 4 and \
                audio_latents.shape[2] != audio_frames:
            raise PipelineError(f"`audio_latents` has {audio_latents.shape[2]} audio latent frames, but num_frames="
                                f"{num_frames} at frame_rate={frame_rate} is {audio_frames} audio latent frames "
                                f"(the audio would not match the video's length)")
        from difflet_tpu.models.ltx2.port import sparse_plan

        self.check_attention_grid((lf // pt, lh // p, lw // p), sparse_plan)
        x = self.initial_video_latents(latents, seed, shape)
        if latents is not None:  # given latents are the VAE's: normalised as diffusers' prepare_latents
            x = self.normalize_latents(x)
        x = pack_latents(x, p, pt)
        if audio_latents is not None:
            a = jnp.asarray(A.latents(audio_latents, audio_shape, "audio_latents"), jnp.float32)
            a = self.normalize_audio_latents(a.transpose(0, 2, 1, 3).reshape(batch, audio_frames, -1))
        else:
            key = jax.random.key(A.seed(seed) + 1 if seed is not None else
                                 int(np.random.SeedSequence().generate_state(1)[0]))
            a = jax.random.normal(key, audio_shape, jnp.float32).transpose(0, 2, 1, 3).reshape(batch, audio_frames, -1)
        schedule = self.schedule(num_inference_steps, x.shape[1])

        # the text
        self._stage("encode")
        self.encoders_in()
        embeds, mask = self.encode_prompt(prompts, num_videos_per_prompt, max_sequence_length)
        if do_cfg:
            neg, neg_mask = self.encode_prompt(negatives, num_videos_per_prompt, max_sequence_length,
                                               "negative_prompt")
            embeds, mask = jnp.concatenate([neg, embeds]), np.concatenate([neg_mask, mask])
        from . import connectors as connectors_module

        video_text, audio_text, text_mask = connectors_module.encode(self.connectors, embeds, jnp.asarray(mask), "left")
        text = dict(encoder_hidden_states=video_text.astype(self.dtype),
                    audio_encoder_hidden_states=audio_text.astype(self.dtype), encoder_attention_mask=text_mask,
                    audio_encoder_attention_mask=text_mask)
        positive = {k: v[batch:] for k, v in text.items()} if do_cfg else text
        grid = dict(num_frames=lf // pt, height=lh // p, width=lw // p, fps=frame_rate / motion_speed,
                    audio_num_frames=audio_frames, use_cross_timestep=use_cross_timestep)
        self.encoders_out(dict(hidden_states=jnp.concatenate([x] * (2 if do_cfg else 1)).astype(self.dtype),
                               audio_hidden_states=jnp.concatenate([a] * (2 if do_cfg else 1)).astype(self.dtype),
                               timestep=np.full((x.shape[0] * (2 if do_cfg else 1),), 1000.0, np.float32),
                               sigma=np.full((x.shape[0] * (2 if do_cfg else 1),), 1000.0, np.float32),
                               **text, **grid))

        video_scales = jnp.asarray([scales[k] for k in ("guidance_scale", "stg_scale", "modality_scale",
                                                       "guidance_rescale")], jnp.float32)
        audio_scales = jnp.asarray([scales["audio_" + k] for k in ("guidance_scale", "stg_scale", "modality_scale",
                                                                  "guidance_rescale")], jnp.float32)
        if not do_cfg:
            video_scales, audio_scales = video_scales.at[0].set(1.0), audio_scales.at[0].set(1.0)
        if not do_stg:
            video_scales, audio_scales = video_scales.at[1].set(0.0), audio_scales.at[1].set(0.0)
        if not do_mod:
            video_scales, audio_scales = video_scales.at[2].set(1.0), audio_scales.at[2].set(1.0)

        def run(slot, xv, xa, t, kw, **extra):  # slot: the step's call, each with its own step cache
            b = xv.shape[0]
            ts = np.full((b,), t, np.float32)
            out = self.run_transformer(self.transformer, slot, hidden_states=xv.astype(self.dtype),
                                       audio_hidden_states=xa.astype(self.dtype), timestep=ts, sigma=ts, **kw, **grid,
                                       **extra).to_tuple()
            return out[0].astype(jnp.float32), out[1].astype(jnp.float32)

        self._stage("denoise", steps=len(schedule))
        self.timings.steps = []
        self.start_step_cache()
        for i, t in enumerate(schedule.timesteps):
            start = time.perf_counter()
            self.step_index = i
            sigma = jnp.float32(schedule.sigmas[i])
            if do_cfg:
                v, va = run("rows", jnp.concatenate([x, x]), jnp.concatenate([a, a]), t, text)
                (uv, v), (ua, va) = jnp.split(v, 2), jnp.split(va, 2)
            else:
                v, va = run("rows", x, a, t, text)
                uv, ua = v, va
            sv, sa = run("stg", x, a, t, positive, spatio_temporal_guidance_blocks=stg_blocks) if do_stg else (v, va)
            mv, ma = run("modality", x, a, t, positive, isolate_modalities=True) if do_mod else (v, va)
            v = guide(x, sigma, v, uv, sv, mv, video_scales)
            va = guide(a, sigma, va, ua, sa, ma, audio_scales)
            dt = jnp.float32(schedule.dt(i))
            x, a = jax.block_until_ready((euler(x, v, dt), euler(a, va, dt)))
            self.timings.steps.append(time.perf_counter() - start)
            self._stage("step", index=i, total=len(schedule), seconds=self.timings.steps[-1])

        latents = unpack_latents(x, lf // pt, lh // p, lw // p, p, pt)
        return self.finish_av(latents, a, output_type, return_dict)

    def normalize_latents(self, latents):
        """`_normalize_latents`: `(x - mean) scaling_factor / std` per channel."""
        shape = (1, -1, 1, 1, 1)
        mean = self.vae.latents_mean[...].astype(jnp.float32).reshape(shape)
        std = self.vae.latents_std[...].astype(jnp.float32).reshape(shape)
        return (latents - mean) * self.vae.config.scaling_factor / std

    def normalize_audio_latents(self, packed):
        """`_normalize_audio_latents` on the packed `[B, L, C M]` latents."""
        mean = self.audio_vae.latents_mean[...].astype(jnp.float32)
        std = self.audio_vae.latents_std[...].astype(jnp.float32)
        return (packed - mean) / std

    def finish_av(self, latents, audio_latents, output_type: str, return_dict: bool):
        """Both outputs as diffusers returns them (the latents checked finite first)."""
        for what, z in (("video", latents), ("audio", audio_latents)):
            if not bool(jnp.isfinite(z).all()):
                raise FloatingPointError(f"the denoised {what} latents have non-finite values (the denoise loop "
                                         f"produced NaN or inf; the VAEs were not run)")
        self.final_latents, self.final_audio_latents = latents, audio_latents
        if output_type == "latent":
            ac = self.audio_vae.config
            mean = self.audio_vae.latents_mean[...].astype(jnp.float32)
            std = self.audio_vae.latents_std[...].astype(jnp.float32)
            b, length, _ = audio_latents.shape
            audio = (audio_latents * std + mean).reshape(b, length, ac.latent_channels, -1).transpose(0, 2, 1, 3)
            frames = self.vae.denormalize(latents)
        else:
            frames = self.decode_frames(latents, output_type)  # spread over the mesh (vae/spread.py)
            # The audio VAE and the vocoder stay one chip's worth of work (replicated, or the batch
            # sharded when it divides): at 480x704x49 and 24 fps the audio is 51 latent frames, a
            # 201 x 64 mel spectrogram; the audio decoder's widest map is 128 channels x 201 x 64
            # (3.3 MB in bfloat16) and the vocoder's 256 channels x 6030 steps (3 MB); about 0.09
            # TFLOP (audio decoder) + 0.27 TFLOP (vocoder), under 2 ms of a v5e chip at peak (an
            # estimate), against the video decode's ~1 s (the reference PR's measured 1.08 s).
            # Split over 4 chips, each of their dozens of small convolutions would wait on a halo
            # exchange costing about what the convolution does.
            self._stage("decode audio")
            start = time.perf_counter()
            audio = np.asarray(self.vocoder.vocode(self.audio_vae.decode_audio(audio_latents)))
            self.timings.decode += time.perf_counter() - start
            checks.check_finite(audio, "the waveform (the audio VAE's decode and the vocoder)")
        if not return_dict:
            return frames, audio
        return LTX2PipelineOutput(frames=frames, audio=audio, audio_sample_rate=self.audio_sample_rate)


PIPELINES = {"LTX2Pipeline": LTX2Pipeline}
PIPELINE = LTX2Pipeline
