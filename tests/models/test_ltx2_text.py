"""LTX-2's text path (models/ltx2/text.py: Gemma-3 every hidden state, stacked and flattened, then
the connectors) against the same lines of diffusers' LTX2Pipeline run on the tiny fixtures
(tests/fixtures/encoders/ltx2_connectors/chain.npz), on one device and with the text encoder
tensor-parallel over 4 devices."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from difflet_tpu.encoders import decoder_lm
from difflet_tpu.models.ltx2 import connectors, text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "encoders"


def check(got, ref, *, rel=5e-6, abs=5e-5, what=""):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    max_abs = float(np.abs(got - ref).max())
    rel_l2 = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel_l2 <= rel and max_abs <= abs, f"{what}: max abs {max_abs:.3e}, rel L2 {rel_l2:.3e}"


@pytest.mark.parametrize("tp", [1, 4])
def test_text_path_parity(tp):
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",)) if tp == 4 else None
    encoder = decoder_lm.from_pretrained(FIXTURES / "gemma3", dtype=jnp.float32, mesh=mesh)
    conn = connectors.from_pretrained(FIXTURES / "ltx2_connectors", mesh=mesh)
    data = np.load(FIXTURES / "ltx2_connectors" / "chain.npz")
    embeds, video, audio, mask = text.encode_prompt(encoder, conn, data["in.input_ids"], data["in.attention_mask"])
    check(embeds, data["out.prompt_embeds"], what="prompt_embeds (channel-major stack)")
    check(video, data["out.video"], what="video text embedding")
    check(audio, data["out.audio"], what="audio text embedding")
    np.testing.assert_array_equal(np.asarray(mask), data["out.attention_mask"])


def test_mismatched_encoder_and_connectors_refused():
    encoder = decoder_lm.from_pretrained(FIXTURES / "gemma3", dtype=jnp.float32)
    conn = connectors.from_pretrained(FIXTURES / "ltx2_connectors")
    conn.config = connectors.LTX2TextConnectorsConfig(**{**conn.config.__dict__, "text_proj_in_factor": 5})
    with pytest.raises(ValueError, match="text_proj_in_factor 5"):
        text.encode_prompt(encoder, conn, np.zeros((1, 12), np.int64), np.ones((1, 12), np.int64))


def test_from_prompts_parity():
    """Strings -> ids (left padding, <bos>, truncation at max_sequence_length) -> Gemma-3 ->
    stacked hidden states, against diffusers' `LTX2Pipeline._get_gemma_prompt_embeds` itself
    (tests/fixtures/encoders/ltx2_connectors/prompts.npz; one prompt truncated, one with
    leading / trailing spaces)."""
    from difflet_tpu.encoders import tokenizers as T

    data = np.load(FIXTURES / "ltx2_connectors" / "prompts.npz")
    prompts = [str(data[f"in.prompt{i}"]) for i in range(3)]
    tokenizer = T.load_tokenizer(FIXTURES / "gemma3_tokenizer", "gemma")
    tokens = T.ltx2_tokens(tokenizer, prompts, max_sequence_length=12)
    np.testing.assert_array_equal(tokens.input_ids, data["out.input_ids"])
    np.testing.assert_array_equal(tokens.attention_mask, data["out.prompt_attention_mask"])
    assert tokens.removed[1] and not tokens.removed[0] and not tokens.removed[2]
    assert tokens.input_ids[2, 0] == tokenizer.pad_token_id and tokens.input_ids[2, -3] == tokenizer.bos_token_id
    encoder = decoder_lm.from_pretrained(FIXTURES / "gemma3", dtype=jnp.float32)
    embeds = text.gemma_prompt_embeds(encoder, tokens.input_ids, tokens.attention_mask)
    check(embeds, data["out.prompt_embeds"], what="prompt_embeds from strings")
