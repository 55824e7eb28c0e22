"""Prompt -> image: a diffusers pipeline folder loaded and run as diffusers runs it.

`DiffusionPipeline.from_pretrained(path, mesh=None, dtype=jnp.bfloat16, config=None)` reads
`model_index.json`, picks the pipeline class by its `_class_name`
(`FluxPipeline` -> difflet_tpu.models.flux.pipeline, `QwenImagePipeline` ->
difflet_tpu.models.qwen_image.pipeline), checks the whole folder before loading anything
(every missing subfolder or file is named in one error), then loads the tokenizers
(difflet_tpu.encoders.tokenizers), the text encoders (difflet_tpu.encoders), the transformer
(`difflet_tpu.load_transformer` + the port's `Runner`, TP or SP on `mesh` as `config` says),
the VAE (difflet_tpu.vae) and the scheduler config.

What the pipelines share lives here: the folder checks, the flow-matching schedule from the
scheduler config (difflet_tpu.pipeline.schedules, which computes what diffusers'
`FlowMatchEulerDiscreteScheduler.set_timesteps` does), the Euler loop (`x + (sigma_next - sigma)
v` in float32, the latents kept in the transformer's dtype between steps as diffusers does), the
2x2 latent packing, `diffusers`' argument checks (arguments the port cannot honour are refused by
name), random latents from `seed` (`jax.random`: they cannot equal torch's, so parity tests pass
`latents=`), postprocessing to [0, 1] / PIL, and the per-stage timings.

Text encoders are placed on `mesh` (tensor-parallel) when their heads divide over its `tp`
axis, else on one device; their outputs go to the transformer's mesh when the Runner places its
inputs.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from difflet_tpu import arguments as A
from difflet_tpu import checks
from difflet_tpu.arguments import ArgumentError as PipelineError  # one type for every refusal before the work
from difflet_tpu.pipeline import samplers
from difflet_tpu.pipeline import folder_checks
from difflet_tpu.pipeline import schedules as S
from difflet_tpu.pipeline.caching import CachedLoop
from difflet_tpu.pipeline.lora import LoraLoaderMixin
from difflet_tpu.pipeline.placement import PlacementMixin

logger = logging.getLogger(__name__)

# model_index.json `_class_name` -> the module whose `PIPELINE` class (or `PIPELINES[name]`) runs it
PIPELINES = {
    "FluxPipeline": "difflet_tpu.models.flux.pipeline",
    "QwenImagePipeline": "difflet_tpu.models.qwen_image.pipeline",
    "WanPipeline": "difflet_tpu.models.wan.pipeline",
    "WanImageToVideoPipeline": "difflet_tpu.models.wan.pipeline",
    "HunyuanVideoPipeline": "difflet_tpu.models.hunyuan_video.pipeline",
    "LTX2Pipeline": "difflet_tpu.models.ltx2.pipeline",
}


@dataclasses.dataclass
class PipelineOutput:
    """diffusers' `FluxPipelineOutput` / `QwenImagePipelineOutput`: `images` is a list of PIL
    images (`output_type="pil"`), a float32 [B, H, W, 3] array in [0, 1] (`"np"`), or the packed
    latents [B, N, 4 C] (`"latent"`). `stats`: what the call did (transformer passes, step cache:
    difflet_tpu.pipeline.caching)."""

    images: Any
    stats: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Timings:
    """Seconds per stage of the last call (each stage waited on before its clock stops)."""

    tokenize: float = 0.0
    encode: float = 0.0
    steps: list = dataclasses.field(default_factory=list)  # one per denoise step
    decode: float = 0.0
    encoder_moves: float = 0.0  # text encoders between host and device memory (Config.encoder_offload)
    expert_moves: float = 0.0  # two-expert pipelines: experts between host and device memory (Config.expert_offload)
    transformer_moves: float = 0.0  # the transformer back from host memory after the encode (Config.transformer_offload)
    encoder_stream: float = 0.0  # inside `encode`: the streamed LM's layers copied in (Config.encoder_stream)

    def as_dict(self) -> dict:
        return {"tokenize_s": self.tokenize, "encode_s": self.encode, "denoise_steps_s": list(self.steps),
                "denoise_s": float(sum(self.steps)), "decode_s": self.decode,
                "encoder_moves_s": self.encoder_moves, "expert_moves_s": self.expert_moves,
                "transformer_moves_s": self.transformer_moves, "encoder_stream_s": self.encoder_stream}


# --------------------------------------------------------------------------
# The folder
# --------------------------------------------------------------------------

# component kind -> the files (any one of the tuples) its folder must hold
WEIGHTS = [("model.safetensors",), ("model.safetensors.index.json",)]
DIFFUSERS_WEIGHTS = [("diffusion_pytorch_model.safetensors",), ("diffusion_pytorch_model.safetensors.index.json",)]
FOLDER_FILES = {
    "image_encoder": [("config.json",)],
    "image_processor": [("preprocessor_config.json",)],
    "scheduler": [("scheduler_config.json",)],
    "text_encoder": [("config.json",)],
    "transformer": [("config.json",)],
    "vae": [("config.json",)],
}
WEIGHT_FILES = {"image_encoder": WEIGHTS, "text_encoder": WEIGHTS, "transformer": DIFFUSERS_WEIGHTS, "vae": DIFFUSERS_WEIGHTS}


def read_model_index(path: Path) -> dict:
    """`path/model_index.json`, or a PipelineError saying what `path` is instead."""
    if not path.exists():
        raise PipelineError(f"{path}: no such folder (expected a diffusers pipeline folder with model_index.json)")
    if not path.is_dir():
        raise PipelineError(f"{path}: not a folder (expected a diffusers pipeline folder with model_index.json)")
    index_path = path / "model_index.json"
    if not index_path.is_file():
        config = path / "config.json"
        if config.is_file():
            try:
                name = json.loads(config.read_text()).get("_class_name")
            except (OSError, ValueError):
                name = None
            if name:
                raise PipelineError(
                    f"{path} is a single {name} folder, not a pipeline: pass the pipeline folder above it (the one "
                    f"with model_index.json, scheduler/, text_encoder/, transformer/, vae/ ...); a transformer "
                    f"alone loads with difflet_tpu.load_transformer")
        subs = sorted(p.name for p in path.iterdir() if p.is_dir())
        hint = f" (it has {subs})" if subs else ""
        raise PipelineError(f"{path}: no model_index.json, so this is not a diffusers pipeline folder{hint}; "
                            f"pass the folder a pipeline's save_pretrained wrote (e.g. a FLUX.1-dev checkout)")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as e:
        raise PipelineError(f"{index_path}: cannot read it ({e})") from None
    if not isinstance(index, dict) or "_class_name" not in index:
        raise PipelineError(f"{index_path}: no _class_name (expected one of {sorted(PIPELINES)})")
    return index


def pipeline_class(path: Path, index: dict):
    name = index["_class_name"]
    if name not in PIPELINES:
        raise PipelineError(f"{path}: model_index.json names {name!r}; supported: {sorted(PIPELINES)}")
    module = importlib.import_module(PIPELINES[name])
    return getattr(module, "PIPELINES", {name: module.PIPELINE})[name]


def folder_vae_scale_factor(path: Path) -> int:
    """The VAE's spatial factor from `vae/config.json` alone (checks before loading)."""
    try:
        c = json.loads((path / "vae" / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PipelineError(f"{path / 'vae' / 'config.json'}: cannot read it ({e})") from None
    if "temperal_downsample" in c:
        return 2 ** len(c["temperal_downsample"])
    return 2 ** (len(c.get("block_out_channels", [0] * 4)) - 1)


def check_folder(path: Path, index: dict, components: dict) -> None:
    """Every component of `components` ({name: (kind, [accepted classes], tokenizer family)})
    is listed in model_index.json with an accepted class and has its folder and files; all
    problems in one PipelineError."""
    from difflet_tpu.encoders import tokenizers as T

    problems = []
    for name, (kind, classes, family) in components.items():
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1]):
            problems.append(f"model_index.json has no {name!r} entry (expected one of {classes})")
        elif entry[1] not in classes:
            problems.append(f"model_index.json: {name} is {entry[1]!r}, this pipeline runs {' or '.join(classes)}")
        sub = path / name
        if not sub.is_dir():
            problems.append(f"{name}/ is missing")
            continue
        if kind == "tokenizer":
            problems += [f"{name}/: {p}" for p in T.folder_problems(sub, family)]
            continue
        for files in (FOLDER_FILES[kind], WEIGHT_FILES.get(kind)):
            if files and not any(all((sub / f).is_file() for f in s) for s in files):
                problems.append(f"{name}/ has no {' or '.join(' + '.join(s) for s in files)}")
    if problems:
        raise PipelineError(f"{path} ({index['_class_name']}): " + "; ".join(problems))


def scheduler_config(folder: Path):
    """The checked scheduler config of `scheduler/` (difflet_tpu.pipeline.samplers: FlowMatchEuler or
    UniPC by `_class_name`), refusing the options this port does not implement (Karras / exponential /
    beta sigmas, inverted sigmas, stochastic sampling ...) and bad values rather than ignoring them."""
    try:
        return samplers.scheduler_from_folder(folder / "scheduler_config.json")
    except ValueError as e:
        raise PipelineError(str(e)) from None


def check_configs(path: Path, index: dict, pipeline_cls, *, mesh=None, dtype=jnp.bfloat16, config=None) -> None:
    """Everything the folder's configs say, before any weight is read (difflet_tpu.pipeline.folder_checks)."""
    scheduler_config(path / "scheduler")
    folder_checks.check_configs(path, index, pipeline_cls, mesh=mesh, dtype=dtype, config=config)


def encoder_mesh(module, config, mesh):
    """`mesh` when the encoder's heads and sharded widths divide over its `tp` axis (its
    `abstract` checks that without memory), else None (one device)."""
    if mesh is None or "tp" not in mesh.axis_names:
        return None
    try:
        module.abstract(config, mesh=mesh)
    except ValueError as e:
        logger.info("%s: on one device (%s)", type(config).__name__, e)
        return None
    return mesh


# --------------------------------------------------------------------------
# The VAE (difflet_tpu.vae): AutoencoderKL (FLUX.1) and the causal 3D AutoencoderKLQwenImage
# --------------------------------------------------------------------------


def load_vae(folder: Path, *, dtype, mesh, encoder: bool = False):
    """The decoder of `vae/` (difflet_tpu.vae picks the class by `_class_name`), and its encoder
    when `encoder` (image-to-video): parameters replicated on `mesh`."""
    from difflet_tpu import vae

    return vae.from_pretrained(folder, dtype=dtype, mesh=mesh, **({"encoder": True} if encoder else {}))


def vae_scale_factor(vae) -> int:
    """diffusers' pipelines: 2 ** (len(block_out_channels) - 1) for AutoencoderKL,
    2 ** len(temperal_downsample) for AutoencoderKLQwenImage."""
    c = vae.config
    if hasattr(c, "temperal_downsample"):
        return 2 ** len(c.temperal_downsample)
    return 2 ** (len(c.block_out_channels) - 1)


def vae_latent_channels(vae) -> int:
    c = vae.config
    return c.z_dim if hasattr(c, "z_dim") else c.latent_channels


def folder_latent_channels(vae_config: dict) -> int:
    """`vae_latent_channels` from `vae/config.json` (diffusers' defaults when absent)."""
    if "z_dim" in vae_config or vae_config.get("_class_name") == "AutoencoderKLQwenImage":
        return vae_config.get("z_dim", 16)
    return vae_config.get("latent_channels", 4)


# --------------------------------------------------------------------------
# Latents (diffusers' FluxPipeline / QwenImagePipeline static methods)
# --------------------------------------------------------------------------


def pack_latents(latents):
    """[B, C, H, W] -> [B, (H/2)(W/2), 4 C]: 2x2 patches, channel-major within a patch."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents, height: int, width: int, vae_scale_factor: int):
    """[B, N, 4 C] -> [B, C, h, w] with h = 2 (height // (2 vae_scale_factor)) (and w alike)."""
    b, _, channels = latents.shape
    h = 2 * (int(height) // (vae_scale_factor * 2))
    w = 2 * (int(width) // (vae_scale_factor * 2))
    x = latents.reshape(b, h // 2, w // 2, channels // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, h, w)


# --------------------------------------------------------------------------
# The base class
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """One `__call__`'s checked arguments (`DiffusionPipeline.start_call`); h, w: the latent grid."""

    output_type: str
    height: int
    width: int
    num_images_per_prompt: int
    prompts: list
    batch: int
    h: int
    w: int
    schedule: S.Schedule
    latents: Any
    max_sequence_length: int


class DiffusionPipeline(CachedLoop, LoraLoaderMixin, PlacementMixin):
    """Base of the text-to-image pipelines; `from_pretrained` picks the subclass."""

    # set by subclasses: {component: (kind, accepted classes, tokenizer family or None)}
    components: dict = {}
    # diffusers __call__ arguments the port refuses, with their defaults (a default passed
    # changes nothing and is accepted)
    refused: dict = {}
    default_sample_size = 128
    vae_encoder = False  # whether the pipeline encodes images with the VAE (image-to-video)
    max_sequence_limit = 512  # the text encoder's longest `max_sequence_length`

    @classmethod
    def config_problems(cls, transformer_config, raw_configs: dict) -> list[str]:
        """What the components' configs say does not fit (widths); set by subclasses."""
        return []

    def __init__(self, path: Path, index: dict, scheduler: S.SchedulerConfig):
        self.path = path
        self.model_index = index
        self.scheduler_config = scheduler
        self.timings = Timings()
        self.on_stage: Callable[[str, dict], None] | None = None  # progress hook (difflet_tpu.generate)

    # ---- loading -------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, mesh=None, dtype=jnp.bfloat16, config=None, runner_options: dict | None = None):
        """A pipeline folder (model_index.json, scheduler/, text_encoder/, ...). `mesh`: a
        `difflet_tpu.make_mesh` mesh for the transformer (TP, or SP per `config`), None for one
        device; `dtype`: parameter dtype of the encoders, transformer and VAE; `config`: a
        `difflet_tpu.Config` (default: the environment); `runner_options`: keyword arguments of
        the transformer's `Runner` (e.g. `compiler_options`, `mode`)."""
        path = Path(path)
        index = read_model_index(path)
        pipeline_cls = pipeline_class(path, index)
        if cls is not DiffusionPipeline and not issubclass(pipeline_cls, cls):
            if cls.__module__ != pipeline_cls.__module__:
                raise PipelineError(f"{path} holds a {index['_class_name']}, not a {cls.__name__}")
            # a sibling pipeline of the same family on the same folder, as diffusers allows
            # (WanImageToVideoPipeline on Wan2.2 TI2V-5B's WanPipeline folder)
            pipeline_cls = cls
        check_folder(path, index, pipeline_cls.folder_components(index))
        try:
            floating = dtype is None or jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:  # not a dtype at all (a misspelt name)
            floating = False
        if not floating:
            raise PipelineError(f"dtype must be a floating-point dtype (jnp.bfloat16, jnp.float32), got {dtype!r}")
        if config is None:
            from difflet_tpu.config import Config

            config = Config.from_env()
        check_configs(path, index, pipeline_cls, mesh=mesh, dtype=dtype, config=config)
        pipe = pipeline_cls.load(path, index, mesh=mesh, dtype=dtype, config=config,
                                 runner_options=dict(runner_options or {}))
        pipe.default_cache = config.step_cache  # the calls' `cache=` default (difflet_tpu.pipeline.caching)
        return pipe

    @classmethod
    def folder_components(cls, index: dict) -> dict:
        """The components `index` (model_index.json) makes part of the folder: `components`."""
        return cls.components

    def load_denoiser(self, path: Path, *, mesh, dtype, config, runner_options) -> None:
        """The transformer (`transformer/`, as a `Runner`) and the VAE (`vae/`) of a pipeline folder."""
        self.transformer = self.load_runner(path / "transformer", mesh=mesh, dtype=dtype, config=config,
                                            runner_options=runner_options)
        self.transformer_config = self.transformer.cfg
        self.vae = load_vae(path / "vae", dtype=dtype, mesh=mesh, **({"encoder": True} if self.vae_encoder else {}))
        self.vae_scale_factor = vae_scale_factor(self.vae)
        self.dtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(jnp.float32)

    @staticmethod
    def load_runner(folder: Path, *, mesh, dtype, config, runner_options):
        """A transformer folder as a `Runner` holding the only reference to its parameters."""
        from difflet_tpu.loading import load_transformer
        from difflet_tpu.runner import Runner

        transformer = load_transformer(folder, dtype=dtype, mesh=mesh, config=config)
        return Runner(transformer, mesh, config, **runner_options)

    def _runners(self) -> list:
        """The transformer Runners: a two-expert pipeline's experts, else its one transformer
        (LoRA adapters and the parts' homes act on each)."""
        return getattr(self, "experts", None) or [self.transformer]

    # ---- shared call pieces ----------------------------------------------------

    def start_call(self, unsupported: dict, *, prompt, output_type, height, width, num_inference_steps,
                   num_images_per_prompt, max_sequence_length, max_sequence_limit: int, sigmas, latents,
                   seed, scales: dict | None = None, negatives: dict | None = None) -> Call:
        """`__call__`'s checks before any work (difflet_tpu.arguments, in diffusers' order), and what
        they give: the schedule and the initial packed latents. `scales`: name -> (value, required);
        `negatives`: name -> a negative prompt, checked even when guidance will not read it."""
        self.check_refused(unsupported)
        self.timings = Timings()
        for name, (value, required) in (scales or {}).items():
            A.scale(name, value, required=required)
        for name, value in (negatives or {}).items():
            A.negative_prompt(value, name)
        output_type = self.check_output_type(output_type)
        height, width = self.check_size(height, width)
        num_inference_steps = A.count("num_inference_steps", num_inference_steps, "steps")
        num_images_per_prompt = A.count("num_images_per_prompt", num_images_per_prompt, "batch")
        max_sequence_length = A.max_sequence_length(max_sequence_length, max_sequence_limit)
        prompts = A.prompts(prompt)
        batch = A.integer("images per call (prompts x num_images_per_prompt)", len(prompts) * num_images_per_prompt,
                          limit="batch")
        h, w = 2 * (height // (self.vae_scale_factor * 2)), 2 * (width // (self.vae_scale_factor * 2))
        schedule = self.schedule(num_inference_steps, (h // 2) * (w // 2), sigmas)
        x = self.initial_latents(latents, seed, batch, self.transformer_config.in_channels // 4, h, w, self.dtype)
        return Call(output_type, height, width, num_images_per_prompt, prompts, batch, h, w, schedule, x,
                    max_sequence_length)

    def denoise_and_decode(self, call: Call, predict: Callable, to_vae: Callable, return_dict: bool):
        """The denoise loop from `call`'s latents, then (unless `output_type="latent"`) the VAE's decode of
        `to_vae(latents)` and postprocessing; returned as diffusers does."""
        self._stage("denoise", steps=len(call.schedule))
        b = call.latents.shape[0]
        # the image transformers take t / 1000
        x = self.denoise(call.latents, call.schedule,
                         lambda x, i, t: predict(x, np.full((b,), np.float32(t) / np.float32(1000), np.float32)))
        checks.check_finite(x, "the latents after the denoise (the transformer's steps)")
        self.final_latents = x  # the packed latents before decoding, for inspection
        if call.output_type == "latent":
            image = x
        else:
            self._stage("decode")
            start = time.perf_counter()
            image = wait(self.vae.decode(to_vae(x)))
            self.timings.decode = time.perf_counter() - start
            image = self.postprocess(image, call.output_type)
        return PipelineOutput(images=image) if return_dict else (image,)

    def _stage(self, stage: str, **info) -> None:
        if self.on_stage is not None:
            self.on_stage(stage, info)

    def check_refused(self, kwargs: dict) -> None:
        """Refuses by name every diffusers argument this port does not honour (given a value
        other than diffusers' default), and any argument diffusers does not have."""
        unknown = [k for k in kwargs if k not in self.refused]
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {unknown}")
        bad = [k for k, v in kwargs.items() if not _is_default(v, self.refused[k])]
        if bad:
            raise PipelineError(f"{type(self).__name__}: {bad} are not supported by this port (the diffusers "
                                f"arguments {', '.join(bad)} would change the result, so they are refused, not ignored)")

    def check_size(self, height, width) -> tuple[int, int]:
        """diffusers' default size (default_sample_size x vae_scale_factor) and the 2x2 packing's
        rule, as an error: height and width must be multiples of 2 x vae_scale_factor (16)."""
        default = self.default_sample_size * self.vae_scale_factor
        return tuple(A.size(name, default if v is None else v, 2 * self.vae_scale_factor)
                     for name, v in (("height", height), ("width", width)))

    def schedule(self, num_inference_steps: int, image_seq_len: int, sigmas=None) -> S.Schedule:
        """FluxPipeline / QwenImagePipeline step 5: sigmas linspace(1, 1/N, N) unless given,
        mu = calculate_shift(image_seq_len, ...) from the scheduler config, set_timesteps."""
        cfg = self.scheduler_config
        if sigmas is not None:
            sigmas = np.asarray(sigmas, np.float64)
            if sigmas.ndim != 1 or len(sigmas) != num_inference_steps or not np.isfinite(sigmas).all():
                raise PipelineError(f"`sigmas` must be {num_inference_steps} finite numbers (num_inference_steps), "
                                    f"got {np.asarray(sigmas).tolist()}")
            if (sigmas <= 0).any() or (sigmas > 1).any():
                raise PipelineError(f"`sigmas` must be in (0, 1], got {sigmas.tolist()}")
        with np.errstate(divide="ignore", invalid="ignore"):
            schedule = S.shifted_linear(cfg, num_inference_steps, image_seq_len, sigmas)
        if not np.isfinite(schedule.sigmas).all():
            # e.g. one step with shift_terminal (Qwen-Image): diffusers' stretch divides 0 by 0
            raise PipelineError(f"the schedule for num_inference_steps={num_inference_steps}"
                                f"{'' if sigmas is None else f', sigmas={sigmas.tolist()}'} is not finite "
                                f"({schedule.sigmas.tolist()}); diffusers would denoise with NaN")
        return schedule

    @staticmethod
    def initial_latents(latents, seed, batch: int, channels: int, h: int, w: int, dtype):
        """The given packed latents [batch, (h/2)(w/2), 4 channels] (checked), or N(0, 1) from
        `seed` drawn [batch, channels, h, w] and packed, as diffusers' prepare_latents draws then
        packs (h, w: the latent grid)."""
        shape = (batch, (h // 2) * (w // 2), channels * 4)
        if latents is not None:  # the packed shape [batch, (h/2)(w/2), 4 C]
            return jnp.asarray(A.latents(latents, shape), dtype)
        seed = int(np.random.SeedSequence().generate_state(1)[0]) if seed is None else A.seed(seed)
        noise = jax.random.normal(jax.random.key(seed), (batch, channels, h, w), jnp.float32)
        return pack_latents(noise).astype(dtype)

    @staticmethod
    def postprocess(image, output_type: str):
        """VaeImageProcessor.postprocess: the VAE's [B, 3, H, W] in [-1, 1] -> [0, 1] float32
        [B, H, W, 3] (`"np"`) or PIL images (`"pil"`); a non-finite image is an error."""
        from difflet_tpu.pipeline import images

        x = np.asarray(jnp.asarray(image, jnp.float32)).transpose(0, 2, 3, 1)
        if not np.isfinite(x).all():
            raise checks.NonFiniteError(f"the decoded image has {int((~np.isfinite(x)).sum())} non-finite values "
                                        f"(the VAE's decode)")
        x = np.clip(x * 0.5 + 0.5, 0.0, 1.0).astype(np.float32)
        return images.to_pil(x) if output_type == "pil" else x

    @staticmethod
    def check_output_type(output_type) -> str:
        if output_type not in ("pil", "np", "latent"):
            raise PipelineError(f"`output_type` must be 'pil', 'np' or 'latent', got {output_type!r}")
        return output_type


def wait(tree):
    return jax.block_until_ready(tree)


def match_batch(prompts: list, batch: int, name: str) -> list:
    """A negative prompt per prompt: one given for all (repeated) or exactly `batch`."""
    if len(prompts) == batch:
        return prompts
    if len(prompts) == 1:
        return prompts * batch
    raise PipelineError(f"`{name}` has {len(prompts)} prompts for {batch} prompts: give one, or one per prompt")


@jax.jit
def true_cfg(positive, negative, scale):
    """FluxPipeline's true CFG: neg + s (pos - neg)."""
    return negative + scale * (positive - negative)


@jax.jit
def true_cfg_rescaled(positive, negative, scale):
    """QwenImagePipeline's true CFG: neg + s (pos - neg), rescaled per token to the
    conditional prediction's norm over channels."""
    comb = negative + scale * (positive - negative)
    cond_norm = jnp.linalg.norm(positive.astype(jnp.float32), axis=-1, keepdims=True)
    noise_norm = jnp.linalg.norm(comb.astype(jnp.float32), axis=-1, keepdims=True)
    return (comb * (cond_norm / noise_norm)).astype(comb.dtype)


def _is_default(value, default) -> bool:
    if value is default:
        return True
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - arrays and other objects that do not compare to a plain default
        return False


def timed(fn, *args, **kwargs):
    """`fn(...)` waited on, and the seconds it took."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start
