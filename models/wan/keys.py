"""Checkpoint keys of the Wan port: parameter path -> diffusers key and transform.

Everything follows diffusers' names (`loading.default_key_map`, as in
diffusers' `transformer_wan.py`): Linear `kernel` = torch `weight`
transposed, `bias`, norm `scale` = torch `weight`, stacked blocks
`blocks.{i}.`, except:

* `patch_embedding`: the Conv3d weight as a Linear over patches flattened
  `(c, pt, ph, pw)` ("conv_as_linear").
* the parameters diffusers keeps in float32 (`_keep_in_fp32_modules`,
  `KEEP_FP32`) keep the model's float32 dtype whatever the load dtype.
* split-halves RoPE (`config.split_rope`): self-attention's q/k rows, biases
  and across-heads `norm_q/norm_k` weights are permuted per head
  (`RopeLayout`; the norm's sum of squares is invariant to a channel
  permutation applied to it and its weight). Cross-attention has no RoPE.
"""

from __future__ import annotations

import dataclasses

from difflet_tpu.layers.rope import RopeLayout
from difflet_tpu.layers import nn
from difflet_tpu import loading

from .config import WanConfig

# Parameters diffusers keeps in float32 (`_keep_in_fp32_modules`).
KEEP_FP32 = ("condition_embedder.time_embedder.", "scale_shift_table", "blocks.scale_shift_table",
             "blocks.norm2.", "condition_embedder.image_embedder.norm1.",
             "condition_embedder.image_embedder.norm2.")

SPLIT_ROPE_PARAMS = ("blocks.attn1.to_q.kernel", "blocks.attn1.to_q.bias", "blocks.attn1.to_k.kernel",
                     "blocks.attn1.to_k.bias", "blocks.attn1.norm_q.scale", "blocks.attn1.norm_k.scale")


def key_map(config: WanConfig, model) -> dict[str, loading.Key]:
    """Parameter path -> diffusers key (the Conv3d patch embedding, the float32-kept
    parameters and the split-halves RoPE permutation included)."""
    km = loading.default_key_map(model, stacked={"blocks": config.num_layers})
    km["patch_embedding.kernel"] = loading.Key("patch_embedding.weight", "conv_as_linear")
    fp32 = str(nn.fp32(model.dtype))  # the model builds these with nn.fp32(dtype)
    for path in km:
        if any(path == p or path.startswith(p) for p in KEEP_FP32):
            km[path] = dataclasses.replace(km[path], dtype=fp32)
    rope = RopeLayout(config.num_attention_heads, config.attention_head_dim, config.split_rope)
    return rope.permute_keys(km, qk=SPLIT_ROPE_PARAMS)
