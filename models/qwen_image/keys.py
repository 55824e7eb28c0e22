"""Checkpoint keys of the Qwen-Image port: parameter path -> diffusers key and transform.

Everything follows diffusers' names (`loading.default_key_map`): Linear
`kernel` = torch `weight` transposed, `bias`, norm `scale` = torch `weight`,
`time_text_embed.addition_t_embedding.weight` as is, stacked blocks
`transformer_blocks.{i}.`. One rename: the modulation linears are
`img_mod.1` / `txt_mod.1` in diffusers (index 1 of `Sequential(SiLU, Linear)`)
and `img_mod.linear` / `txt_mod.linear` here (the shared `AdaLN`).

With `config.split_rope` (the default), each head's channels of the q and k
projections are permuted at load to split-halves order [0, 2, ..., 1, 3, ...]
(`rope.heads_permutation`): the output columns and biases of
`attn.to_q/to_k/add_q_proj/add_k_proj`, and the per-head
`norm_q/norm_k/norm_added_q/norm_added_k` weights (`rope.rope_permutation`).
V, the outputs and everything else keep the checkpoint's order.
"""

from __future__ import annotations

import dataclasses

from difflet_tpu.layers import rope
from difflet_tpu import loading

from .config import QwenImageConfig

_QK = ("attn.to_q", "attn.to_k", "attn.add_q_proj", "attn.add_k_proj")
_NORMS = ("attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k")


def key_map(config: QwenImageConfig, model) -> dict[str, loading.Key]:
    """Parameter path -> diffusers key (the modulation rename and the split-halves RoPE
    permutation included)."""
    km = loading.default_key_map(model, stacked={"transformer_blocks": config.num_layers})
    for mod in ("img_mod", "txt_mod"):
        for leaf, torch_leaf in (("kernel", "weight"), ("bias", "bias")):
            path = f"transformer_blocks.{mod}.linear.{leaf}"
            km[path] = dataclasses.replace(km[path], template=f"transformer_blocks.{{i}}.{mod}.1.{torch_leaf}")
    if not config.split_rope:
        return km
    heads, hd = config.num_attention_heads, config.attention_head_dim
    qk_perm = tuple(int(i) for i in rope.heads_permutation(heads, hd))
    norm_perm = tuple(int(i) for i in rope.rope_permutation(hd))
    for m in _QK:
        for leaf in ("kernel", "bias"):
            path = f"transformer_blocks.{m}.{leaf}"
            km[path] = dataclasses.replace(km[path], perm=qk_perm)
    for m in _NORMS:
        path = f"transformer_blocks.{m}.scale"
        km[path] = dataclasses.replace(km[path], perm=norm_perm)
    return km
