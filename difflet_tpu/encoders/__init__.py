"""Text and image encoders of the diffusion pipelines, in Flax NNX, loaded from transformers folders.

* `clip`: CLIP's text tower (`CLIPTextModel`; FLUX.1's `text_encoder`, its pooled output).
* `clip_vision`: CLIP's vision tower (`CLIPVisionModel`; Wan 2.1 I2V's `image_encoder`,
  `hidden_states[-2]`), on clip's encoder layers, and its image processor.
* `t5`: the T5 v1.1 encoder (`T5EncoderModel`; FLUX.1's `text_encoder_2`) and UMT5
  (`UMT5EncoderModel`; Wan's `text_encoder`), one family.
* `decoder_lm`: decoder-only LMs used as encoders (Qwen2.5-VL's language model, Qwen-Image's
  `text_encoder`; Llama's `LlamaModel`, HunyuanVideo's `text_encoder`, read at
  `hidden_states[-3]`), one Llama-shaped family.

Each module has `from_pretrained(folder, *, dtype=jnp.bfloat16, mesh=None)`, `build(config)`,
`abstract(config, dtype, mesh)` and released-size config presets. `encode(model, input_ids,
attention_mask)` runs a text encoder, `encode_image(model, pixel_values)` the vision tower
(inputs checked, jitted, outputs checked finite).
"""

import jax.numpy as jnp

from . import clip, clip_vision, decoder_lm, t5
from .clip import CLIP_VIT_L_14, CLIPTextConfig, CLIPTextModel
from .clip_vision import CLIP_VIT_H_14, CLIPVisionConfig, CLIPVisionModel
from .decoder_lm import QWEN2_5_VL_7B, DecoderLM, DecoderLMConfig
from .loading import num_params, partition_specs
from .runtime import encode, encode_image
from .t5 import T5_V1_1_XXL, UMT5_XXL, T5Config, T5EncoderModel

_MODULES = {CLIPTextConfig: clip, CLIPVisionConfig: clip_vision, T5Config: t5, DecoderLMConfig: decoder_lm}


def abstract(config, dtype=jnp.bfloat16, mesh=None):
    """The encoder of `config` without memory (`nnx.eval_shape`): ShapeDtypeStruct parameters,
    with their `NamedSharding` on `mesh` (axis "tp") when given, for deviceless compiles."""
    if type(config) not in _MODULES:
        raise TypeError(f"not an encoder config: {type(config).__name__}")
    return _MODULES[type(config)].abstract(config, dtype, mesh)


__all__ = ["CLIP_VIT_H_14", "CLIP_VIT_L_14", "QWEN2_5_VL_7B", "T5_V1_1_XXL", "UMT5_XXL", "CLIPTextConfig",
           "CLIPTextModel", "CLIPVisionConfig", "CLIPVisionModel", "DecoderLM", "DecoderLMConfig", "T5Config",
           "T5EncoderModel", "abstract", "clip", "clip_vision", "decoder_lm", "encode", "encode_image", "num_params",
           "partition_specs", "t5"]
