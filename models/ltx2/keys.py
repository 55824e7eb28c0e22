"""Checkpoint keys of the LTX-2 port: parameter path -> diffusers key and transform.

Everything follows diffusers' names (`loading.default_key_map`, as in
diffusers' `transformer_ltx2.py`): Linear `kernel` = torch `weight`
transposed, `bias`, the across-heads q/k RMSNorm `scale` = torch `weight`,
stacked blocks `transformer_blocks.{i}.`.

With `config.split_rope` (interleaved-RoPE checkpoints only; released LTX-2
configs are natively `rope_type="split"` and never permuted), each head's
channels of the RoPE attentions' q and k projections are permuted at load to
split-halves order [0, 2, ..., 1, 3, ...] (`rope.heads_permutation`): the
output columns and biases of `to_q/to_k` and the `norm_q/norm_k` weights of
`attn1`, `audio_attn1`, `audio_to_video_attn` and `video_to_audio_attn`.
The text cross-attentions (no RoPE), V, the outputs and everything else keep
the checkpoint's order.
"""

from __future__ import annotations


from difflet_tpu.layers import rope
from difflet_tpu import loading

from .config import LTX2Config

ROPE_ATTENTIONS = ("attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn")  # q/k get RoPE


def key_map(config: LTX2Config, model) -> dict:
    """Parameter path -> diffusers key: the default naming, plus (interleaved
    checkpoints with `split_rope`) each head's q/k rows, biases and q/k norm
    weights of the RoPE attentions permuted to split halves."""
    km = loading.default_key_map(model, stacked={"transformer_blocks": config.num_layers})
    heads = dict(attn1=(config.num_attention_heads, config.attention_head_dim))
    for name in ROPE_ATTENTIONS[1:]:
        heads[name] = (config.audio_num_attention_heads, config.audio_attention_head_dim)
    for name, (h, d) in heads.items():  # LTX-2's q/k norms are across heads: qk channels
        rope.RopeLayout(h, d, config.split_rope).permute_keys(
            km, qk=[f"transformer_blocks.{name}.{leaf}" for leaf in
                    ("to_q.kernel", "to_q.bias", "to_k.kernel", "to_k.bias", "norm_q.scale", "norm_k.scale")])
    return km
