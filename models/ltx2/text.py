"""LTX-2's text path after tokenization, as diffusers' `LTX2Pipeline` runs it
(`_get_gemma_prompt_embeds`, then `self.connectors(prompt_embeds, prompt_attention_mask,
padding_side=...)`): the Gemma-3 text encoder (encoders/decoder_lm.py) on left-padded ids with
every hidden state kept, stacked on a last axis and flattened channel-major
(`torch.stack(hidden_states, -1).flatten(2, 3)`: feature `d * (layers + 1) + l`), then the text
connectors (connectors.py) -> the video and audio text embeddings and the mask the transformer
cross-attends with.

The tokenizer call itself (`padding="max_length"`, `max_length=max_sequence_length`, left padding,
eos as pad when the tokenizer has none) is the caller's.

`trim=True` (`Config.text_trim`, off by default) runs Gemma-3 on the prompts' real tokens only:
the left columns that are padding in every row are cut (the kept width rounded up to a power of
two, so a few shapes compile), each kept token at its untrimmed position id (the same RoPE
angles), and the cut columns come back as zeros. Exact up to float rounding: a real token never
attends to padding (masked keys, causal), and the connectors read only the real tokens (the
masked mean / range or the masked RMS, then the registers or masked keys), so what the padding
rows hold never reaches the output (tests/models/test_ltx2_text_trim.py measures it).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from difflet_tpu.encoders.runtime import encode

from . import connectors as connectors_module


def trimmed_length(attention_mask) -> int:
    """The columns a trimmed encode keeps: the longest row's real tokens rounded up to a power of
    two, at most the padded length."""
    mask = np.asarray(attention_mask)
    real = int(mask.sum(-1).max())
    return min(mask.shape[1], 1 << max(real - 1, 0).bit_length())


def gemma_prompt_embeds(text_encoder, input_ids, attention_mask, trim: bool = False):
    """`[B, S]` ids and 0/1 mask -> `[B, S, hidden_size * (num_hidden_layers + 1)]` (float32 for a
    float32 encoder), as `LTX2Pipeline._get_gemma_prompt_embeds` after its tokenizer call; `trim`:
    the encoder runs on the kept columns only, the padding columns are zeros (module docstring)."""
    length = input_ids.shape[1]
    keep = trimmed_length(attention_mask) if trim else length
    if keep < length:
        cut = np.asarray(attention_mask)[:, :length - keep]
        if cut.any():
            raise ValueError(f"a trimmed encode cuts the first {length - keep} columns, but they hold real tokens "
                             f"(the prompts must be left-padded)")
        positions = np.broadcast_to(np.arange(length - keep, length), (input_ids.shape[0], keep))
        states = encode(text_encoder, np.asarray(input_ids)[:, -keep:], np.asarray(attention_mask)[:, -keep:],
                        positions, output_hidden_states=True)
    else:
        states = encode(text_encoder, input_ids, attention_mask, output_hidden_states=True)
    stacked = jnp.stack(states, axis=-1)  # [B, keep, D, L + 1]
    stacked = stacked.reshape(stacked.shape[0], stacked.shape[1], -1)
    return jnp.pad(stacked, ((0, 0), (length - keep, 0), (0, 0))) if keep < length else stacked


def encode_prompt(text_encoder, connectors, input_ids, attention_mask, padding_side: str = "left",
                  trim: bool = False):
    """-> (prompt_embeds, video_text_embedding, audio_text_embedding, connector_attention_mask);
    `trim`: the trimmed Gemma-3 encode (left padding only)."""
    c = connectors.config
    layers = text_encoder.config.num_hidden_layers + 1
    if (text_encoder.config.hidden_size, layers) != (c.caption_channels, c.text_proj_in_factor):
        raise ValueError(f"LTX-2 text path: the text encoder gives {text_encoder.config.hidden_size} x {layers} "
                         f"hidden states, the connectors expect caption_channels {c.caption_channels} x "
                         f"text_proj_in_factor {c.text_proj_in_factor}")
    if trim and padding_side != "left":
        raise ValueError(f"a trimmed encode cuts left padding; padding_side is {padding_side!r}")
    embeds = gemma_prompt_embeds(text_encoder, input_ids, attention_mask, trim=trim)
    video, audio, mask = connectors_module.encode(connectors, embeds, jnp.asarray(attention_mask), padding_side)
    return embeds, video, audio, mask
