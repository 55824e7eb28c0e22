"""difflet_tpu.encoders.tokenizers against the ids diffusers' pipelines produced
(tests/fixtures/pipelines: FluxPipeline's CLIP and T5 calls, QwenImagePipeline's templated call)."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from difflet_tpu.encoders import tokenizers as T

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"


def calls(name):
    meta = json.loads((FIXTURES / name / "calls.json").read_text())
    return meta["calls"], np.load(FIXTURES / name / "io.npz")


@pytest.fixture(scope="module")
def clip():
    return T.load_tokenizer(FIXTURES / "flux_dev" / "tokenizer", "clip")


@pytest.fixture(scope="module")
def t5():
    return T.load_tokenizer(FIXTURES / "flux_dev" / "tokenizer_2", "t5")


@pytest.fixture(scope="module")
def qwen():
    return T.load_tokenizer(FIXTURES / "qwen_image" / "tokenizer", "qwen2")


@pytest.mark.parametrize("name", ["flux_dev", "flux_schnell"])
def test_flux_ids_match_diffusers(name):
    clip = T.load_tokenizer(FIXTURES / name / "tokenizer", "clip")
    t5 = T.load_tokenizer(FIXTURES / name / "tokenizer_2", "t5")
    cs, z = calls(name)
    for call, c in cs.items():
        kw = c["kwargs"]
        got = T.clip_tokens(clip, kw["prompt"])
        np.testing.assert_array_equal(got.input_ids, z[f"{call}.clip_input_ids"])
        assert got.input_ids.dtype == np.int32 and got.input_ids.shape[1] == 77
        got = T.t5_tokens(t5, kw["prompt"], kw.get("max_sequence_length", 512))
        np.testing.assert_array_equal(got.input_ids, z[f"{call}.t5_input_ids"])


def test_qwen_image_ids_match_diffusers(qwen):
    cs, z = calls("qwen_image")
    for call, c in cs.items():
        kw = c["kwargs"]
        sides = [("", kw["prompt"])] + ([("negative_", kw["negative_prompt"])] if "negative_prompt" in kw else [])
        for pre, prompt in sides:
            got = T.qwen_image_tokens(qwen, prompt)
            np.testing.assert_array_equal(got.input_ids, z[f"{call}.{pre}input_ids"])
            np.testing.assert_array_equal(got.attention_mask, z[f"{call}.{pre}attention_mask"])
            # the template's system turn is the 34 tokens QwenImagePipeline drops
            lengths = got.attention_mask.sum(1) - T.QWEN_IMAGE_TEMPLATE_START_IDX
            np.testing.assert_array_equal(lengths, z[f"{call}.{pre}prompt_embeds_mask"].sum(1))


def test_qwen_drop_template_matches_diffusers_mask(qwen):
    """drop_template on hidden states that encode their own position: the kept positions are each
    row's valid tokens past the template, the mask equals the one diffusers returned."""
    cs, z = calls("qwen_image")
    kw = cs["no_cfg_batch2"]["kwargs"]
    tok = T.qwen_image_tokens(qwen, kw["prompt"])
    b, n = tok.input_ids.shape
    hidden = np.broadcast_to(np.arange(n, dtype=np.float32)[None, :, None] + 1, (b, n, 2)).copy()
    h, mask = T.drop_template(hidden, tok.attention_mask)
    np.testing.assert_array_equal(mask, z["no_cfg_batch2.prompt_embeds_mask"])
    assert h.shape == (2, mask.shape[1], 2)
    for r in range(b):
        k = int(mask[r].sum())
        np.testing.assert_array_equal(np.asarray(h)[r, :k, 0], np.arange(34, 34 + k) + 1)  # right padding
        assert not np.asarray(h)[r, k:].any()
    h, mask = T.drop_template(hidden, tok.attention_mask, max_sequence_length=5)
    assert h.shape[1] == 5 and mask.shape == (2, 5)


def test_truncation_warning_lists_removed_text(clip, t5, caplog):
    _, z = calls("flux_dev")
    long = json.loads((FIXTURES / "flux_dev" / "calls.json").read_text())["calls"]["batch2"]["kwargs"]["prompt"][1]
    with caplog.at_level(logging.WARNING, logger=T.__name__):
        got = T.clip_tokens(clip, ["a cat", long])
    assert got.removed[0] == "" and got.removed[1]
    assert "soft shadows" in got.removed[1] and "soft shadows" in caplog.text
    assert "painting" not in got.removed[1]  # the prompt's start is kept
    got = T.t5_tokens(t5, long, 16)
    assert got.removed[0].endswith("soft shadows") and "painting" not in got.removed[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=T.__name__):
        got = T.t5_tokens(t5, "a cat", 16)
    assert got.removed == [""] and not caplog.text


@pytest.mark.parametrize("bad", ["", "   ", [], ["a cat", ""], None, 3, ["a cat", 4]])
def test_bad_prompts(clip, t5, qwen, bad):
    for call in (lambda: T.clip_tokens(clip, bad), lambda: T.t5_tokens(t5, bad),
                 lambda: T.qwen_image_tokens(qwen, bad)):
        with pytest.raises(T.TokenizerError, match="prompt"):
            call()


def test_negative_prompt_may_be_empty(qwen):
    got = T.qwen_image_tokens(qwen, "", name="negative_prompt", allow_empty=True)
    assert got.attention_mask.sum() == 34 + 5  # template only: "<|im_end|>\n<|im_start|>assistant\n"


def test_max_sequence_length_checked(t5):
    for bad in (0, 513, 16.0):
        with pytest.raises(T.TokenizerError, match="max_sequence_length"):
            T.t5_tokens(t5, "a cat", bad)


def test_missing_folder_and_files(tmp_path):
    with pytest.raises(T.TokenizerError, match=r"nope: no such folder.*vocab\.json \+ merges\.txt"):
        T.load_tokenizer(tmp_path / "nope", "clip")
    d = tmp_path / "tokenizer"
    shutil.copytree(FIXTURES / "flux_dev" / "tokenizer", d)
    (d / "merges.txt").unlink()
    with pytest.raises(T.TokenizerError, match=r"tokenizer: missing the vocabulary files of a CLIPTokenizer.*merges"):
        T.load_tokenizer(d, "clip")
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(T.TokenizerError, match="no tokenizer_config.json"):
        T.load_tokenizer(d, "clip")


def test_wrong_folder_refused():
    with pytest.raises(T.TokenizerError, match="declares 'T5Tokenizer', expected CLIPTokenizer"):
        T.load_tokenizer(FIXTURES / "flux_dev" / "tokenizer_2", "clip")
    with pytest.raises(T.TokenizerError, match="unknown tokenizer family"):
        T.load_tokenizer(FIXTURES / "flux_dev" / "tokenizer", "gpt2")
