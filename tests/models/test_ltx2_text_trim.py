"""LTX-2's trimmed text encode (`Config.text_trim`, models/ltx2/text.py): Gemma-3 on the prompts'
real tokens only equals the padded encode diffusers runs, on the tiny LTX-2 pipeline's Gemma-3,
tokenizer and connectors, on one device and with the encoder tensor-parallel over 4 devices.

Measured (float32): the stacked hidden states on the real tokens max abs 8.1e-6 (values up to 15),
the connectors' video / audio embeddings max abs 2.3e-6, rel L2 3.6e-7; the bounds below are
about 5x those. The pipeline with the trim against diffusers: tests/pipelines/test_ltx2_pipeline.py.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from difflet_tpu.encoders import decoder_lm
from difflet_tpu.encoders import tokenizers as T
from difflet_tpu.models.ltx2 import connectors, text

FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines" / "ltx2"


def test_trimmed_length():
    assert text.trimmed_length(np.array([[0] * 9 + [1] * 7, [0] * 13 + [1] * 3])) == 8
    assert text.trimmed_length(np.array([[0] * 61 + [1] * 3])) == 4
    assert text.trimmed_length(np.array([[0] * 8 + [1] * 8])) == 8
    assert text.trimmed_length(np.array([[0] * 7 + [1] * 9])) == 16
    assert text.trimmed_length(np.array([[0] * 3 + [1] * 9])) == 12  # at most the padded length
    assert text.trimmed_length(np.array([[0] * 15 + [1]])) == 1


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("length", [16, 64])
def test_trim_equals_the_padded_encode(tp, length):
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",)) if tp == 4 else None
    encoder = decoder_lm.from_pretrained(FOLDER / "text_encoder", dtype=jnp.float32, mesh=mesh)
    conn = connectors.from_pretrained(FOLDER / "connectors", dtype=jnp.float32, mesh=mesh)
    tokenizer = T.load_tokenizer(FOLDER / "tokenizer", "gemma")
    calls = json.loads((FOLDER / "calls.json").read_text())
    prompts = [calls[0]["prompt"], calls[0]["negative_prompt"], calls[1]["prompt"]]
    tokens = T.ltx2_tokens(tokenizer, prompts, length)
    mask = np.asarray(tokens.attention_mask)
    assert text.trimmed_length(mask) == 8  # 7, 7 and 3 real tokens: the trim cuts 8 or 56 columns
    full = text.encode_prompt(encoder, conn, tokens.input_ids, mask)
    trim = text.encode_prompt(encoder, conn, tokens.input_ids, mask, trim=True)
    real = mask.astype(bool)
    embeds, want = np.asarray(trim[0], np.float64), np.asarray(full[0], np.float64)
    assert np.abs(embeds[real] - want[real]).max() <= 5e-5
    assert not embeds[:, :length - 8].any()  # the cut columns: zeros, never read
    for what, got, ref in (("video", trim[1], full[1]), ("audio", trim[2], full[2])):
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        err, rel = float(np.abs(got - ref).max()), float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        assert err <= 1e-5 and rel <= 2e-6, f"{what}: max abs {err:.2e}, rel L2 {rel:.2e}"
    np.testing.assert_array_equal(np.asarray(trim[3]), np.asarray(full[3]))


def test_trim_refuses_what_is_not_left_padding():
    encoder = decoder_lm.from_pretrained(FOLDER / "text_encoder", dtype=jnp.float32)
    conn = connectors.from_pretrained(FOLDER / "connectors", dtype=jnp.float32)
    ids = np.ones((1, 16), np.int64)
    right = np.array([[1] * 3 + [0] * 13])
    with pytest.raises(ValueError, match="hold real tokens"):
        text.gemma_prompt_embeds(encoder, ids, right, trim=True)
    with pytest.raises(ValueError, match="padding_side is 'right'"):
        text.encode_prompt(encoder, conn, ids, right, "right", trim=True)
