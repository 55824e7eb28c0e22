"""Checkpoint keys of the FLUX port: parameter path -> diffusers key and transform.

Everything follows diffusers' names (`loading.default_key_map`): Linear
`kernel` = torch `weight` transposed, `bias`, per-head RMSNorm `scale` = torch
`weight`, stacked blocks `transformer_blocks.{i}.` / `single_transformer_blocks.{i}.`.

With `config.split_rope` (the default), each head's channels of the q and k
projections are permuted at load to split-halves order [0, 2, ..., 1, 3, ...]
(`heads_permutation`): the output columns and biases of
`attn.to_q/to_k` (both block kinds) and `attn.add_q_proj/add_k_proj` (double
blocks), and the per-head `norm_q/norm_k/norm_added_q/norm_added_k` weights
(`rope_permutation`). V, the outputs and everything else keep the
checkpoint's order.

The single blocks' `proj_out` is one torch Linear over cat([attn (D), mlp (4D)])
(`single_transformer_blocks.{i}.proj_out.weight` [D, 5D]); the port holds it as
two row-parallel kernels, `proj_out.attn` = input features [0, D) and
`proj_out.mlp` = [D, 5D) (`Key(in_range=...)`), the bias with `proj_out.mlp`.
The loader reads each device's rows of each range only; nothing depends on P.
"""

from __future__ import annotations


from difflet_tpu.layers.rope import RopeLayout
from difflet_tpu import loading

from .config import FluxConfig

_DOUBLE_QK = ("attn.to_q", "attn.to_k", "attn.add_q_proj", "attn.add_k_proj")
_DOUBLE_NORMS = ("attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k")
_SINGLE_QK = ("attn.to_q", "attn.to_k")
_SINGLE_NORMS = ("attn.norm_q", "attn.norm_k")


def key_map(config: FluxConfig, model) -> dict[str, loading.Key]:
    """Parameter path -> diffusers key (split-halves RoPE permutation and the packed
    single-block proj_out halves included)."""
    km = loading.default_key_map(model, stacked={"transformer_blocks": config.num_layers,
                                                 "single_transformer_blocks": config.num_single_layers})
    D, M, L = config.inner_dim, config.mlp_hidden_dim, config.num_single_layers
    packed = "single_transformer_blocks.{i}.proj_out"
    km["single_transformer_blocks.proj_out.attn.kernel"] = loading.Key(f"{packed}.weight", "linear", layers=L,
                                                                       in_range=(0, D))
    km["single_transformer_blocks.proj_out.mlp.kernel"] = loading.Key(f"{packed}.weight", "linear", layers=L,
                                                                      in_range=(D, D + M))
    km["single_transformer_blocks.proj_out.mlp.bias"] = loading.Key(f"{packed}.bias", layers=L)
    rope = RopeLayout(config.num_attention_heads, config.attention_head_dim, config.split_rope)
    for prefix, qk, norms in (("transformer_blocks", _DOUBLE_QK, _DOUBLE_NORMS),
                              ("single_transformer_blocks", _SINGLE_QK, _SINGLE_NORMS)):
        rope.permute_keys(km, qk=[f"{prefix}.{m}.{leaf}" for m in qk for leaf in ("kernel", "bias")],
                          head_norms=[f"{prefix}.{m}.scale" for m in norms])
    return km
