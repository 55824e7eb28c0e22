"""CLIP's vision tower (transformers `CLIPVisionModel`) in Flax NNX: Wan 2.1 I2V's `image_encoder`.

Reads top to bottom like transformers `models/clip/modeling_clip.py` (`CLIPVisionEmbeddings`,
`CLIPVisionModel`): non-overlapping patches embedded by a bias-free Conv2d (here the equivalent
matmul over flattened patches), a learned class token in front, learned position embeddings,
`pre_layrnorm`, then the text tower's encoder layers (clip.py: one implementation; bidirectional
attention here, no mask).

diffusers `pipelines/wan/pipeline_wan_i2v.py` (`WanImageToVideoPipeline.encode_image`) calls
`image_encoder(**image_processor(images=image), output_hidden_states=True)` and keeps
`hidden_states[-2]`: the output of the penultimate layer, before `post_layernorm`; with a
`last_image` both images go in one batch (`encode_image([image, last_image])`). The model's
call returns `hidden_states[i]` for any `i` and runs only the layers it needs, so the last layer is
skipped for `-2`. `post_layernorm` only makes `pooler_output` (`pooler_output(last_hidden_state)`,
which Wan does not read); it is loaded and validated like every other weight.

Checkpoints saved by transformers 4.x (the published Wan2.1 I2V `image_encoder/`) prefix every
key with `vision_model.`; 5.x saves them without it; both load. Not supported: transformers'
`interpolate_pos_encoding` (diffusers does not use it): the input must be `image_size` square.

Tensor parallelism (`tp`) as the text tower: q/k/v_proj and fc1 column-parallel, out_proj and
fc2 row-parallel; the embeddings (patch, class, positions) and the LayerNorms replicated.

Preprocessing (`load_image_processor`, `preprocess`): transformers' `CLIPImageProcessorPil`
from the pipeline's `image_processor/preprocessor_config.json`. Without torchvision (never a
dependency here), transformers 5.x's `CLIPImageProcessor` (what diffusers loads) falls back to that
class, so the values are the reference's exactly. With torchvision installed it is a
torchvision-backed processor whose bicubic resize (torch's antialiased uint8 `interpolate`) differs
from Pillow's by at most 2 uint8 levels on under 6% of the values (emulated with torch 2.13 at 28
and 224 px; not run with torchvision itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from . import loading
from .clip import CLIPEncoder
from .layers import Embedding, LayerNorm, activation


@dataclass(frozen=True)
class CLIPVisionConfig:
    """The fields of transformers' `CLIPVisionConfig` this model reads, with its defaults
    (ViT-B/32's), so a `config.json` that omits a field means what transformers reads."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("image_size", "patch_size"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"CLIPVisionConfig: {name} must be an int, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"CLIPVisionConfig: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"CLIPVisionConfig: image_size {self.image_size} is not a multiple of "
                             f"patch_size {self.patch_size}")
        activation(self.hidden_act)

    @property
    def num_positions(self) -> int:
        """The class token and one token a patch."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @classmethod
    def from_dict(cls, d: dict) -> "CLIPVisionConfig":
        """From a `config.json`: a `CLIPVisionConfig` (model_type "clip_vision_model"), or a full
        `CLIPConfig`'s `vision_config`."""
        if d.get("model_type") == "clip" and "vision_config" in d:
            d = d["vision_config"]
        if d.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"expected a CLIPVisionConfig config.json (model_type 'clip_vision_model'), got "
                             f"model_type {d.get('model_type')!r}")
        return cls(**loading.known_fields(cls, d))


# Wan2.1 I2V `image_encoder/config.json` (open-clip xlm-roberta-large-vit-huge-14's vision tower).
CLIP_VIT_H_14 = CLIPVisionConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                                 image_size=224, patch_size=14, hidden_act="gelu")


class PatchEmbedding(nnx.Module):
    """torch `nn.Conv2d(C, D, kernel_size=p, stride=p, bias=False)`, `weight` `[D, C, p, p]` as
    torch keeps it (replicated): each non-overlapping patch flattened (C, then rows, then columns)
    times the flattened kernel. `[B, C, H, W] -> [B, (H/p)(W/p), D]`, patches row-major as
    transformers' `flatten(2).transpose(1, 2)`."""

    def __init__(self, config: CLIPVisionConfig, *, dtype, rngs: nnx.Rngs):
        c, p, d = config.num_channels, config.patch_size, config.hidden_size
        self.patch_size = p
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (d, c, p, p), dtype) / math.sqrt(c * p * p),
                                tp_spec=P())

    def __call__(self, pixel_values):
        b, c, h, w = pixel_values.shape
        p = self.patch_size
        weight = self.weight[...]
        x = pixel_values.astype(weight.dtype).reshape(b, c, h // p, p, w // p, p)
        x = x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)
        return x @ weight.reshape(weight.shape[0], -1).T


class CLIPVisionEmbeddings(nnx.Module):
    def __init__(self, config: CLIPVisionConfig, *, dtype, rngs: nnx.Rngs):
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (config.hidden_size,), dtype), tp_spec=P())
        self.patch_embedding = PatchEmbedding(config, dtype=dtype, rngs=rngs)
        self.position_embedding = Embedding(config.num_positions, config.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, pixel_values):
        patch_embeds = self.patch_embedding(pixel_values)
        class_embeds = jnp.broadcast_to(self.class_embedding[...], (patch_embeds.shape[0], 1, patch_embeds.shape[-1]))
        embeddings = jnp.concatenate([class_embeds.astype(patch_embeds.dtype), patch_embeds], axis=1)
        return embeddings + self.position_embedding.weight[...][None]


class CLIPVisionModel(nnx.Module):
    """`(pixel_values [B, C, S, S] float, hidden_state=-2) -> [B, 1 + (S/p)^2, D]`: transformers'
    `hidden_states[hidden_state]` with `output_hidden_states=True` (`hidden_states[0]` is the
    `pre_layrnorm` output, `hidden_states[num_hidden_layers]` the last layer's = `last_hidden_state`;
    negative indices count from the end). The default, -2, is what Wan 2.1 I2V reads."""

    def __init__(self, config: CLIPVisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config, dtype=dtype, rngs=rngs)
        self.pre_layrnorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)  # transformers' spelling
        self.encoder = CLIPEncoder(config, dtype=dtype, rngs=rngs)
        self.post_layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def check_tp(self, tp: int):
        if self.config.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {self.config.num_attention_heads} does not divide over tp={tp}")

    def check_inputs(self, pixel_values, hidden_state: int = -2):
        c, s = self.config.num_channels, self.config.image_size
        shape, dtype = getattr(pixel_values, "shape", None), getattr(pixel_values, "dtype", None)
        if shape is None or dtype is None:
            raise TypeError(f"CLIPVisionModel: pixel_values must be a float array [batch, {c}, {s}, {s}], got "
                            f"{type(pixel_values).__name__}")
        if len(shape) != 4 or shape[0] < 1 or tuple(shape[1:]) != (c, s, s):
            raise ValueError(f"CLIPVisionModel: pixel_values must be [batch, {c}, {s}, {s}] (image_size {s}; "
                             f"resize with the pipeline's image_processor), got shape {tuple(shape)}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"CLIPVisionModel: pixel_values must be floating (the image processor's normalised "
                            f"values), got {dtype}")
        n = self.config.num_hidden_layers
        if not isinstance(hidden_state, int) or not -(n + 1) <= hidden_state <= n:
            raise ValueError(f"CLIPVisionModel: hidden_state must be an int in [-{n + 1}, {n}] (hidden_states has "
                             f"{n + 1} entries), got {hidden_state!r}")

    def __call__(self, pixel_values, hidden_state: int = -2):
        self.check_inputs(pixel_values, hidden_state)
        hidden_states = self.pre_layrnorm(self.embeddings(pixel_values))
        num_layers = hidden_state % (self.config.num_hidden_layers + 1)
        return self.encoder(hidden_states, None, num_layers=num_layers)

    def pooler_output(self, last_hidden_state):
        """transformers' `pooler_output`: `post_layernorm` of the class token of `last_hidden_state`."""
        return self.post_layernorm(last_hidden_state[:, 0])


def build(config: CLIPVisionConfig, dtype=jnp.float32, seed: int = 0) -> CLIPVisionModel:
    return CLIPVisionModel(config, dtype=loading.dtype_of(dtype), rngs=nnx.Rngs(seed))


def abstract(config: CLIPVisionConfig, dtype=jnp.bfloat16, mesh=None) -> CLIPVisionModel:
    """The model without memory (ShapeDtypeStruct parameters, sharded on `mesh` if given)."""
    return loading.abstract(lambda: build(config, dtype), mesh)


# Checkpoint keys this model does not read: the `position_ids` buffer some checkpoints saved.
SKIP_KEYS = (r"(^|\.)embeddings\.position_ids$",)


def from_pretrained(folder, *, dtype=jnp.bfloat16, mesh=None) -> CLIPVisionModel:
    """A transformers `CLIPVisionModel` folder (e.g. Wan2.1 I2V `image_encoder/`; diffusers'
    example loads it in float32: pass `dtype=jnp.float32` to match); keys with or without the
    `vision_model.` prefix of transformers 4.x checkpoints."""
    config = CLIPVisionConfig.from_dict(loading.read_config(folder))
    return loading.load(lambda: build(config, dtype), folder, candidates=lambda k: [k, f"vision_model.{k}"],
                        skip=SKIP_KEYS, mesh=mesh)


# --------------------------------------------------------------------------
# Preprocessing: the pipeline's `image_processor/`
# --------------------------------------------------------------------------

class ImageProcessorError(ValueError):
    """An image processor folder that cannot be read, or an image that cannot be processed."""


_PROCESSOR_CLASSES = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")


def load_image_processor(folder):
    """transformers' `CLIPImageProcessorPil` with the settings of `folder/preprocessor_config.json`
    (Wan2.1 I2V `image_processor/`: resize the shortest edge to 224 bicubic, center-crop 224,
    rescale by 1/255, normalise with OpenAI CLIP's mean and std)."""
    import json

    path = Path(folder) / "preprocessor_config.json"
    try:
        declared = json.loads(path.read_text(encoding="utf-8")).get("image_processor_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ImageProcessorError(f"{path}: cannot read it ({e})") from None
    if declared is not None and declared not in _PROCESSOR_CLASSES:
        raise ImageProcessorError(f"{path} declares {declared!r}, expected one of {_PROCESSOR_CLASSES}")
    from transformers import CLIPImageProcessorPil

    try:
        return CLIPImageProcessorPil.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - transformers raises many types; all name the folder here
        raise ImageProcessorError(f"{folder}: CLIPImageProcessorPil cannot load it ({type(e).__name__}: {e})") from None


def _as_pil(image, i: int):
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (str, Path)):
        try:
            with Image.open(image) as f:
                f.load()
                return f.copy()
        except (OSError, UnidentifiedImageError) as e:
            raise ImageProcessorError(f"image {i}: cannot read {str(image)!r} as an image ({e})") from None
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ImageProcessorError(f"image {i}: a numpy image must be uint8 [H, W] or [H, W, 1|3|4] (the processor "
                                      f"rescales by 1/255 itself), got dtype {image.dtype}")
        if image.ndim == 3 and image.shape[-1] == 1:
            image = image[..., 0]
        if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[-1] not in (3, 4)):
            raise ImageProcessorError(f"image {i}: a numpy image must be [H, W] or [H, W, 1|3|4], got shape "
                                      f"{image.shape}")
        return Image.fromarray(image)
    raise ImageProcessorError(f"image {i}: expected a PIL image, a uint8 numpy array or a file path, got "
                              f"{type(image).__name__}")


def preprocess(processor, images) -> np.ndarray:
    """`processor(images=images, return_tensors="np")["pixel_values"]`, float32 `[B, 3, S, S]`, for one
    image or a list (Wan's `encode_image([image, last_image])` is a list of two). Images: PIL images,
    uint8 numpy arrays `[H, W]` / `[H, W, 1|3|4]` (made PIL images, so every input takes the same
    path), or file paths; the processor converts them to RGB (`do_convert_rgb`: transparent pixels
    over white)."""
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ImageProcessorError("no image given")
    pil = []
    for i, image in enumerate(items):
        image = _as_pil(image, i)
        if image.width < 1 or image.height < 1:
            raise ImageProcessorError(f"image {i} is empty ({image.width}x{image.height})")
        pil.append(image)
    out = processor(images=pil, return_tensors="np")["pixel_values"]
    return np.asarray(out, np.float32)
