"""The decoder-only LM family as Llama (transformers `LlamaModel`, HunyuanVideo's `text_encoder`),
against transformers' float32 `hidden_states[-3]` and `last_hidden_state` as diffusers'
HunyuanVideoPipeline calls it (tests/fixtures/pipelines/hunyuan_video: the template-formatted,
right-padded prompts with their mask)."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from difflet_tpu.encoders import decoder_lm
from difflet_tpu.encoders import tokenizers as T
from difflet_tpu.encoders.runtime import encode

FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines" / "hunyuan_video"
CALLS = ("embedded", "true_cfg", "sigmas_videos2")


@pytest.fixture(scope="module")
def data():
    return dict(np.load(FOLDER / "io.npz"))


@pytest.fixture(scope="module")
def model():
    return decoder_lm.from_pretrained(FOLDER / "text_encoder", dtype=jnp.float32)


def test_llama_config_is_a_family_member(model):
    c = model.config
    assert (c.mrope_section, c.attention_bias, c.num_hidden_layers, c.rope_theta, c.rms_norm_eps) == \
        (None, False, 4, 500000.0, 1e-5)


@pytest.mark.parametrize("call", CALLS)
def test_hidden_states_minus_3_and_last(call, model, data, compare):
    """`hidden_state=-3` (HunyuanVideo's num_hidden_layers_to_skip 2: layer 2 of 4, no final
    norm) and the default (after the final norm) against transformers, padding included."""
    ids, mask = data[f"{call}.input_ids"], data[f"{call}.attention_mask"]
    assert (mask == 0).any() == (call != "sigmas_videos2")  # padded, or truncated
    compare(encode(model, ids, mask, hidden_state=-3), data[f"{call}.llama_hidden_states_m3"],
            what=f"{call} hidden_states[-3]")
    compare(encode(model, ids, mask), data[f"{call}.llama_last_hidden_state"], what=f"{call} last_hidden_state")


def test_tokenizer_call_matches_diffusers(data):
    """LlamaTokenizerFast from the folder, called as _get_llama_prompt_embeds calls it."""
    import json

    tok = T.load_tokenizer(FOLDER / "tokenizer", "llama")
    calls = json.loads((FOLDER / "calls.json").read_text())
    for call in CALLS:
        kw = calls["calls"][call]["kwargs"]
        template = kw["prompt_template"]
        got = T.hunyuan_video_tokens(tok, kw["prompt"], template["template"], template["crop_start"],
                                     kw["max_sequence_length"])
        np.testing.assert_array_equal(got.input_ids, data[f"{call}.input_ids"])
        np.testing.assert_array_equal(got.attention_mask, data[f"{call}.attention_mask"])


def test_tp4_equals_one_device(model, data, compare, mesh4):
    tp = decoder_lm.from_pretrained(FOLDER / "text_encoder", dtype=jnp.float32, mesh=mesh4)
    assert tp.layers[0].self_attn.q_proj.kernel[...].sharding.spec == P(None, "tp")
    ids, mask = data["true_cfg.input_ids"], data["true_cfg.attention_mask"]
    got = encode(tp, ids, mask, hidden_state=-3)
    compare(got, encode(model, ids, mask, hidden_state=-3), rel=1e-6, abs=5e-6, what="tp4 vs one device")
    compare(got, data["true_cfg.llama_hidden_states_m3"], what="tp4 vs transformers")


def test_hidden_state_index_checked(model, data):
    with pytest.raises(ValueError, match=r"hidden_state must be an int in \[-5, 4\]"):
        encode(model, data["embedded.input_ids"], data["embedded.attention_mask"], hidden_state=-6)
