"""LTX-2's text path after tokenization, as diffusers' `LTX2Pipeline` runs it
(`_get_gemma_prompt_embeds`, then `self.connectors(prompt_embeds, prompt_attention_mask,
padding_side=...)`): the Gemma-3 text encoder (encoders/decoder_lm.py) on left-padded ids with
every hidden state kept, stacked on a last axis and flattened channel-major
(`torch.stack(hidden_states, -1).flatten(2, 3)`: feature `d * (layers + 1) + l`), then the text
connectors (connectors.py) -> the video and audio text embeddings and the mask the transformer
cross-attends with.

The tokenizer call itself (`padding="max_length"`, `max_length=max_sequence_length`, left padding,
eos as pad when the tokenizer has none) is the caller's.
"""

from __future__ import annotations

import jax.numpy as jnp

from difflet_tpu.encoders.runtime import encode

from . import connectors as connectors_module


def gemma_prompt_embeds(text_encoder, input_ids, attention_mask):
    """`[B, S]` ids and 0/1 mask -> `[B, S, hidden_size * (num_hidden_layers + 1)]` (float32 for a
    float32 encoder), as `LTX2Pipeline._get_gemma_prompt_embeds` after its tokenizer call."""
    states = encode(text_encoder, input_ids, attention_mask, output_hidden_states=True)
    stacked = jnp.stack(states, axis=-1)  # [B, S, D, L + 1]
    return stacked.reshape(stacked.shape[0], stacked.shape[1], -1)


def encode_prompt(text_encoder, connectors, input_ids, attention_mask, padding_side: str = "left"):
    """-> (prompt_embeds, video_text_embedding, audio_text_embedding, connector_attention_mask)."""
    c = connectors.config
    layers = text_encoder.config.num_hidden_layers + 1
    if (text_encoder.config.hidden_size, layers) != (c.caption_channels, c.text_proj_in_factor):
        raise ValueError(f"LTX-2 text path: the text encoder gives {text_encoder.config.hidden_size} x {layers} "
                         f"hidden states, the connectors expect caption_channels {c.caption_channels} x "
                         f"text_proj_in_factor {c.text_proj_in_factor}")
    embeds = gemma_prompt_embeds(text_encoder, input_ids, attention_mask)
    video, audio, mask = connectors_module.encode(connectors, embeds, jnp.asarray(attention_mask), padding_side)
    return embeds, video, audio, mask
