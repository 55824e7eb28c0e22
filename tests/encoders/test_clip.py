"""CLIPTextModel against transformers' float32 outputs (tests/fixtures/encoders/clip*)."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from difflet_tpu.encoders import clip
from difflet_tpu.encoders.runtime import encode

# clip: eos_token_id 2 (FLUX.1-dev's config, pooled row = argmax id); clip_eos: first eos id.
# "" = FluxPipeline's call (no mask), "masked." = with the right-padding mask.
CASES = [(case, pre) for case in ("clip", "clip_eos") for pre in ("", "masked.")]


def run(model, data, pre):
    return encode(model, data[pre + "in.input_ids"], data.get(pre + "in.attention_mask"))


@pytest.mark.parametrize("case,pre", CASES)
def test_parity(case, pre, fixture_dir, io, compare):
    model = clip.from_pretrained(fixture_dir(case), dtype=jnp.float32)
    data = io(case)
    last, pooled = run(model, data, pre)
    compare(last, data[pre + "out.last_hidden_state"], what="last_hidden_state")
    compare(pooled, data[pre + "out.pooler_output"], what="pooler_output")


def test_pooled_rows_differ_between_rules(io):
    """The inputs are built so that the legacy argmax rule and the first-eos rule pick different
    rows (else the parity could not tell the rules apart)."""
    ids = io("clip_eos")["in.input_ids"]
    assert (np.argmax(ids, -1) != np.argmax(ids == 100, -1)).any()
    ids = io("clip")["in.input_ids"]
    assert (np.argmax(ids, -1) != np.argmax(ids == 2, -1)).any()


@pytest.mark.parametrize("case", ["clip", "clip_eos"])
def test_sharded_tp4_equals_one_device(case, fixture_dir, io, compare, mesh4):
    data = io(case)
    one = clip.from_pretrained(fixture_dir(case), dtype=jnp.float32)
    tp = clip.from_pretrained(fixture_dir(case), dtype=jnp.float32, mesh=mesh4)
    q = tp.encoder.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == P(None, "tp") and q.sharding.shard_shape(q.shape) == (32, 8)
    o = tp.encoder.layers[1].self_attn.out_proj.kernel[...]
    assert o.sharding.spec == P("tp", None)
    for pre in ("", "masked."):
        for got, ref, name in zip(run(tp, data, pre), run(one, data, pre), ("last_hidden_state", "pooler_output")):
            compare(got, ref, rel=1e-6, abs=5e-6, what=f"tp4 vs one device {pre}{name}")
            compare(got, data[pre + "out." + name], what=f"tp4 vs transformers {pre}{name}")


def test_bfloat16_close_to_float32(fixture_dir, io, compare):
    """The default dtype: bf16 weights and activations, float32 norms and softmax."""
    data = io("clip")
    model = clip.from_pretrained(fixture_dir("clip"))
    assert model.encoder.layers[0].mlp.fc1.kernel[...].dtype == jnp.bfloat16
    last, pooled = run(model, data, "")
    assert last.dtype == jnp.bfloat16
    compare(last, data["out.last_hidden_state"], rel=3e-2, abs=0.2, what="bf16 last_hidden_state")
    compare(pooled, data["out.pooler_output"], rel=3e-2, abs=0.2, what="bf16 pooler_output")


def test_sequence_longer_than_positions_refused(fixture_dir):
    model = clip.from_pretrained(fixture_dir("clip"), dtype=jnp.float32)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 16"):
        encode(model, np.zeros((1, 17), np.int32))
