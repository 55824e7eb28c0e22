"""The decoder-only LM as Gemma-3 (LTX-2's text encoder), against transformers' float32
`hidden_states` of `Gemma3ForConditionalGeneration` (tests/fixtures/encoders/gemma3): every entry,
as LTX2Pipeline stacks them, with LTX-2's left padding and with right padding."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from difflet_tpu.encoders import decoder_lm
from difflet_tpu.encoders.decoder_lm import DecoderLMConfig
from difflet_tpu.encoders.runtime import encode

CASE = "gemma3"


def run(model, data, pre):
    return jnp.stack(encode(model, data[pre + "in.input_ids"], data[pre + "in.attention_mask"],
                            output_hidden_states=True))


def test_config_reads_gemma3_differences(fixture_dir):
    c = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32).config
    assert (c.norm_offset, c.embed_scale, c.sandwich_norm, c.qk_norm) == (True, True, True, True)
    assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (c.sliding_window, c.query_pre_attn_scalar, c.head_dim, c.hidden_act) == (4, 24.0, 16, "gelu_pytorch_tanh")
    assert (c.rope_theta, c.rope_scaling_factor, c.rope_local_theta) == (1e6, 8.0, 1e4)


@pytest.mark.parametrize("pre", ["", "right."])  # LTX2Pipeline's left padding; right padding
def test_parity_every_hidden_state(pre, fixture_dir, io, compare):
    model = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32)
    data = io(CASE)
    got = run(model, data, pre)
    assert got.shape == (4, 2, 12, 64)  # embeddings + 3 layers (the last one final-normed)
    compare(got, data[pre + "out.hidden_states"], what=f"{pre}hidden_states")
    # the plain call is hidden_states[-1]
    compare(encode(model, data[pre + "in.input_ids"], data[pre + "in.attention_mask"]), got[-1], rel=0, abs=0,
            what="last")


@pytest.mark.parametrize("change", ["sliding_window", "rope_scaling_factor", "rope_local_theta", "qk_norm",
                                    "sandwich_norm", "query_pre_attn_scalar"])
def test_each_difference_matters(change, fixture_dir, io):
    """Undoing any one of Gemma-3's differences moves the output away from transformers' (the
    fixture exercises each of them)."""
    model = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32)
    c = model.config
    if change in ("sliding_window", "rope_scaling_factor", "rope_local_theta"):  # read by the forward
        other = {"sliding_window": 64, "rope_scaling_factor": 1.0, "rope_local_theta": c.rope_theta}[change]
        model.config = DecoderLMConfig(**{**c.__dict__, change: other})
    for layer in model.layers:
        if change == "qk_norm":
            layer.self_attn.qk_norm = False
        elif change == "sandwich_norm":
            layer.sandwich = False
        elif change == "query_pre_attn_scalar":
            layer.self_attn.scaling = c.head_dim ** -0.5
    data = io(CASE)
    got = np.asarray(run(model, data, ""))
    assert np.abs(got - data["out.hidden_states"]).max() > 1e-2


def test_sharded_tp4_equals_one_device(fixture_dir, io, compare, mesh4):
    data = io(CASE)
    one = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32)
    tp = decoder_lm.from_pretrained(fixture_dir(CASE), dtype=jnp.float32, mesh=mesh4)
    attn = tp.layers[0].self_attn
    assert attn.q_proj.kernel[...].sharding.spec == P(None, "tp")
    assert attn.q_norm.weight[...].sharding.is_fully_replicated
    assert tp.layers[2].mlp.down_proj.kernel[...].sharding.spec == P("tp", None)
    for pre in ("", "right."):
        got = run(tp, data, pre)
        compare(got, run(one, data, pre), rel=1e-6, abs=2e-5, what=f"tp4 vs one device {pre}")
        compare(got, data[pre + "out.hidden_states"], what=f"tp4 vs transformers {pre}")


def test_sliding_window_mask_definition():
    """transformers' `sliding_window_overlay`: key j visible from query i iff j > i - window."""
    m = np.asarray(decoder_lm.sliding_window_mask(6, 3))[0, 0] & np.tril(np.ones((6, 6), bool))
    want = np.array([[i - 3 < j <= i for j in range(6)] for i in range(6)])
    np.testing.assert_array_equal(m, want)


def test_unsupported_gemma3_options_refused():
    base = dict(model_type="gemma3_text", vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        DecoderLMConfig.from_dict({**base, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        DecoderLMConfig.from_dict({**base, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="RoPE 'yarn' for full_attention"):
        DecoderLMConfig.from_dict({**base, "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}})
    with pytest.raises(ValueError, match="2 layer_types for 1 layers"):
        DecoderLMConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, layer_types=("full_attention",) * 2)
