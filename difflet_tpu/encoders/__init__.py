"""Text encoders of the diffusion pipelines, in Flax NNX, loaded from transformers folders.

* `clip`: CLIP's text tower (`CLIPTextModel`; FLUX.1's `text_encoder`, its pooled output).
* `t5`: the T5 v1.1 encoder (`T5EncoderModel`; FLUX.1's `text_encoder_2`) and UMT5
  (`UMT5EncoderModel`; Wan's `text_encoder`), one family.
* `decoder_lm`: decoder-only LMs used as encoders (Qwen2.5-VL's language model; Qwen-Image's
  `text_encoder`), one Llama-shaped family.

Each module has `from_pretrained(folder, *, dtype=jnp.bfloat16, mesh=None)`, `build(config)`,
`abstract(config, dtype, mesh)` and released-size config presets. `encode(model, input_ids,
attention_mask)` runs one (inputs checked, jitted, outputs checked finite).
"""

import jax.numpy as jnp

from . import clip, decoder_lm, t5
from .clip import CLIP_VIT_L_14, CLIPTextConfig, CLIPTextModel
from .decoder_lm import QWEN2_5_VL_7B, DecoderLM, DecoderLMConfig
from .loading import num_params, partition_specs
from .runtime import encode
from .t5 import T5_V1_1_XXL, UMT5_XXL, T5Config, T5EncoderModel

_MODULES = {CLIPTextConfig: clip, T5Config: t5, DecoderLMConfig: decoder_lm}


def abstract(config, dtype=jnp.bfloat16, mesh=None):
    """The encoder of `config` without memory (`nnx.eval_shape`): ShapeDtypeStruct parameters,
    with their `NamedSharding` on `mesh` (axis "tp") when given, for deviceless compiles."""
    if type(config) not in _MODULES:
        raise TypeError(f"not an encoder config: {type(config).__name__}")
    return _MODULES[type(config)].abstract(config, dtype, mesh)


__all__ = ["CLIP_VIT_L_14", "QWEN2_5_VL_7B", "T5_V1_1_XXL", "UMT5_XXL", "CLIPTextConfig", "CLIPTextModel",
           "DecoderLM", "DecoderLMConfig", "T5Config", "T5EncoderModel", "abstract", "clip", "decoder_lm", "encode",
           "num_params", "partition_specs", "t5"]
