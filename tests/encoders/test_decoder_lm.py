"""The decoder-only LM as Qwen2.5-VL's language model, against transformers' float32
`hidden_states[-1]` of `Qwen2_5_VLForConditionalGeneration` (tests/fixtures/encoders/qwen2_5_vl)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from difflet_tpu.encoders import decoder_lm
from difflet_tpu.encoders.decoder_lm import DecoderLMConfig
from difflet_tpu.encoders.layers import RMSNorm
from difflet_tpu.encoders.runtime import encode

CASE = "qwen2_5_vl"


def run(model, data, pre):
    return encode(model, data[pre + "in.input_ids"], data[pre + "in.attention_mask"])


@pytest.mark.parametrize("pre", ["", "left."])  # QwenImagePipeline's right padding; left padding
def test_parity(pre, fixture_dir, io, compare):
    model = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32)
    c = model.config
    assert (c.num_key_value_heads, c.mrope_section, c.attention_bias) == (4, (1, 1, 2), True)
    data = io(CASE)
    compare(run(model, data, pre), data[pre + "out.hidden_states_last"], what=f"{pre}hidden_states[-1]")


def test_left_padding_shifts_positions_only(fixture_dir, io, compare):
    """transformers 5 gives text-only input arange positions whatever the mask (transformers 4.x:
    cumsum(mask) - 1). For a contiguous run of real tokens the two differ by a constant shift,
    which RoPE cannot see (scores depend on position differences), and the left-padding queries
    attend to nothing (zero attention output), so their positions do not matter either: the
    left-padded row's real tokens reproduce the right-padded row's outputs, under either rule."""
    data = io(CASE)
    right, left = data["out.hidden_states_last"], data["left.out.hidden_states_last"]
    compare(left[1, 5:], right[1, :7], rel=2e-6, what="transformers: left vs right padded row")
    model = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32)
    ids, mask = jnp.asarray(data["left.in.input_ids"]), jnp.asarray(data["left.in.attention_mask"])
    cumsum = jnp.where(mask == 1, jnp.cumsum(mask, -1) - 1, 1)
    compare(model(ids, mask, position_ids=cumsum), left, rel=2e-6, what="cumsum positions vs arange reference")


def test_mrope_streams_follow_mrope_section():
    """With three different position streams, frequency j of cos/sin comes from the stream of its
    `mrope_section` chunk (transformers' `recomposition_frequencies`, written out in numpy)."""
    cfg = DecoderLMConfig(vocab_size=8, hidden_size=48, intermediate_size=8, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, rope_theta=1000.0, mrope_section=(4, 6, 2))
    rng = np.random.default_rng(0)
    pos = rng.integers(0, 50, size=(3, 2, 5))
    cos, sin = decoder_lm.rope_cos_sin(cfg, jnp.asarray(pos), jnp.float32)
    inv_freq = 1.0 / 1000.0 ** (np.arange(0, 24, 2) / 24)
    freqs = pos[..., None] * inv_freq  # [3, B, S, 12]
    chunks = np.split(freqs, np.cumsum(cfg.mrope_section)[:-1], axis=-1)
    want = np.concatenate([c[i % 3] for i, c in enumerate(chunks)], axis=-1)
    want = np.concatenate([want, want], axis=-1)
    np.testing.assert_allclose(np.asarray(cos), np.cos(want), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin), np.sin(want), atol=2e-5)


def test_sharded_tp4_equals_one_device(fixture_dir, io, compare, mesh4):
    data = io(CASE)
    one = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32)
    tp = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32, mesh=mesh4)
    attn = tp.layers[0].self_attn
    k = attn.k_proj.kernel[...]
    assert k.sharding.spec == P(None, "tp") and k.sharding.shard_shape(k.shape) == (64, 8)  # one KV head a device
    assert attn.k_proj.bias[...].sharding.spec == P("tp")
    assert tp.layers[1].mlp.down_proj.kernel[...].sharding.spec == P("tp", None)
    assert tp.embed_tokens.weight[...].sharding.is_fully_replicated
    for pre in ("", "left."):
        got = run(tp, data, pre)
        compare(got, run(one, data, pre), rel=1e-6, abs=5e-6, what=f"tp4 vs one device {pre}")
        compare(got, data[pre + "out.hidden_states_last"], what=f"tp4 vs transformers {pre}")


def test_bfloat16_close_to_float32(fixture_dir, io, compare):
    data = io(CASE)
    model = decoder_lm.from_pretrained(fixture_dir(CASE))
    out = run(model, data, "")
    assert out.dtype == jnp.bfloat16
    compare(out, data["out.hidden_states_last"], rel=3e-2, abs=0.2, what="bf16")


def test_position_ids_shape_checked(fixture_dir):
    model = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"position_ids must be \[batch, seq\] or \[3, 2, 5\]"):
        model(jnp.zeros((2, 5), jnp.int32), position_ids=jnp.zeros((2, 2, 5), jnp.int32))


# Gemma-style flags (not in Qwen2.5-VL): checked against their definitions.

def test_rms_norm_offset_matches_gemma_formula():
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    norm = RMSNorm(16, eps=1e-6, offset=True)
    norm.weight[...] = jnp.asarray(np.linspace(-0.5, 0.5, 16, dtype=np.float32))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * (1 + np.linspace(-0.5, 0.5, 16))
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


def test_embed_scale_multiplies_embeddings_by_sqrt_hidden():
    """embed_scale=True equals embed_scale=False with the table pre-multiplied by sqrt(hidden)."""
    cfg = DecoderLMConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, embed_scale=True, norm_offset=True,
                          hidden_act="gelu_pytorch_tanh")
    scaled = decoder_lm.build(cfg)
    plain = decoder_lm.build(DecoderLMConfig(**{**cfg.__dict__, "embed_scale": False}))
    nnx.update(plain, nnx.state(scaled))
    plain.embed_tokens.weight[...] = scaled.embed_tokens.weight[...] * np.float32(4.0)
    ids = jnp.asarray(np.arange(10).reshape(2, 5), jnp.int32)
    np.testing.assert_allclose(np.asarray(scaled(ids)), np.asarray(plain(ids)), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(scaled(ids)), np.asarray(decoder_lm.build(cfg, seed=1)(ids)))


def test_config_from_flat_transformers4_json(fixture_dir):
    """Qwen-Image's published config.json is transformers 4.x's flat form (the text fields at
    the top, RoPE under `rope_scaling` with type "mrope"/"default", `rope_theta` beside it)."""
    import json

    nested = json.loads((fixture_dir(CASE) / "config.json").read_text())
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat = {**{k: v for k, v in nested.items() if k != "text_config"}, **text, "model_type": "qwen2_5_vl",
            "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    assert DecoderLMConfig.from_dict(flat) == DecoderLMConfig.from_dict(nested)
    with pytest.raises(ValueError, match="unsupported RoPE type 'yarn'"):
        DecoderLMConfig.from_dict({**flat, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="mrope_section"):
        DecoderLMConfig.from_dict({**flat, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 1]}})
