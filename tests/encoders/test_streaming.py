"""A decoder LM's encode with its layers streamed from host memory (encoders/streaming.py, the
`Config.encoder_stream` path) against the same model's whole-program encode and transformers'
`hidden_states` (tests/fixtures/encoders/gemma3, llama): every group size, one device and tp=4,
with position ids (LTX-2's trimmed encode) and a `hidden_state` that stops early (HunyuanVideo's
`hidden_states[-3]`)."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import runtime
from difflet_tpu.encoders import decoder_lm, streaming
from difflet_tpu.encoders.runtime import encode


HUNYUAN = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines" / "hunyuan_video"


def load(fixture_dir, case, mesh=None):
    folder = HUNYUAN / "text_encoder" if case == "llama" else fixture_dir(case)
    return decoder_lm.from_pretrained(folder, dtype=jnp.float32, mesh=mesh)


@pytest.mark.parametrize("group", [1, 2, None])  # None: the default (the Gemma-3 fixture's 3 layers: one group)
@pytest.mark.parametrize("tp", [False, True])
def test_gemma3_every_hidden_state(group, tp, fixture_dir, io, compare, mesh4):
    data = io("gemma3")
    whole = load(fixture_dir, "gemma3", mesh4 if tp else None)
    ref = encode(whole, data["in.input_ids"], data["in.attention_mask"], output_hidden_states=True)
    stream = streaming.LayerStream(load(fixture_dir, "gemma3", mesh4 if tp else None), group)
    got = encode(stream, data["in.input_ids"], data["in.attention_mask"], output_hidden_states=True)
    assert len(got) == len(ref) == 4
    for i, (g, r) in enumerate(zip(got, ref)):
        compare(g, r, rel=1e-6, abs=5e-5, what=f"hidden_states[{i}] streamed vs whole")
    compare(jnp.stack(got), data["out.hidden_states"], what="streamed vs transformers")
    if tp:  # the layers keep their tp shardings in host memory
        spec = stream._host[0][0]["self_attn"]["q_proj"]["kernel"].sharding.spec
        assert tuple(spec) == (None, "tp")


def test_parameters_leave_the_devices_and_come_back_per_group(fixture_dir, io, mesh4, monkeypatch):
    """After the stream is made every layer and the embedding table are in host memory; an encode
    copies each group once and holds at most one on the devices."""
    data = io("gemma3")
    stream = streaming.LayerStream(load(fixture_dir, "gemma3", mesh4), 1)
    assert stream.memory_kinds() == {runtime.HOST_MEMORY_KIND}
    assert stream.model.embed_tokens.weight[...].sharding.memory_kind == runtime.HOST_MEMORY_KIND
    layer_bytes = stream.bytes_per_chip()
    assert layer_bytes == sum(runtime.tree_bytes_per_device(h) for h in stream._host) > 0
    copies, forward = [], streaming._group_forward

    def spy(graphdef, params, hidden, kinds, sliding):
        kinds_on_device = {x.sharding.memory_kind for x in jax.tree.leaves(params)}
        copies.append((runtime.tree_bytes_per_device(params), kinds_on_device))
        return forward(graphdef, params, hidden, kinds, sliding)

    monkeypatch.setattr(streaming, "_group_forward", spy)
    encode(stream, data["in.input_ids"], data["in.attention_mask"], output_hidden_states=True)
    assert len(copies) == 3 and sum(b for b, _ in copies) == layer_bytes
    assert all(k == {"device"} for _, k in copies)


def test_positions_as_the_trimmed_encode_gives_them(fixture_dir, io, compare):
    data = io("gemma3")
    ids, mask = data["in.input_ids"], data["in.attention_mask"]
    positions = np.broadcast_to(np.arange(ids.shape[1]) + 5, ids.shape)
    ref = encode(load(fixture_dir, "gemma3"), ids, mask, positions, output_hidden_states=True)
    got = encode(streaming.LayerStream(load(fixture_dir, "gemma3"), 2), ids, mask, positions,
                 output_hidden_states=True)
    compare(jnp.stack(got), jnp.stack(ref), rel=1e-6, abs=5e-5, what="position ids")


def test_llama_stops_at_the_hidden_state_asked(fixture_dir, compare, mesh4, monkeypatch):
    """`hidden_state=-3` (HunyuanVideo) runs only the layers it needs: later groups are not copied."""
    data = dict(np.load(HUNYUAN / "io.npz"))
    ids, mask = data["true_cfg.input_ids"], data["true_cfg.attention_mask"]
    ref = encode(load(fixture_dir, "llama", mesh4), ids, mask, hidden_state=-3)
    stream = streaming.LayerStream(load(fixture_dir, "llama", mesh4), 1)
    calls, forward = [], streaming._group_forward
    monkeypatch.setattr(streaming, "_group_forward", lambda *a: calls.append(1) or forward(*a))
    got = encode(stream, ids, mask, hidden_state=-3)
    assert len(calls) == stream.layers_for(-3) == stream.config.num_hidden_layers - 2
    compare(got, ref, rel=1e-6, abs=5e-5, what="hidden_states[-3] streamed vs whole")
    compare(got, data["true_cfg.llama_hidden_states_m3"], what="hidden_states[-3] streamed vs transformers")


def test_bad_group_refused(fixture_dir):
    with pytest.raises(ValueError, match="group 9 must be in"):
        streaming.LayerStream(load(fixture_dir, "gemma3"), 9)


def test_default_group_is_the_layer_type_period():
    config = decoder_lm.DecoderLMConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=12, num_attention_heads=2,
        num_key_value_heads=2, sliding_window=4,
        layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 2)
    model = decoder_lm.build(config)
    assert streaming.default_group(model) == 6
    llama = decoder_lm.build(decoder_lm.DecoderLMConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                                        num_hidden_layers=10, num_attention_heads=2,
                                                        num_key_value_heads=2))
    assert streaming.default_group(llama) == 4
    three = decoder_lm.build(dataclasses.replace(config, num_hidden_layers=3, layer_types=config.layer_types[:3]))
    assert streaming.default_group(three) == 3  # at most every layer
