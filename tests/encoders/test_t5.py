"""T5EncoderModel / UMT5EncoderModel against transformers' float32 outputs (tests/fixtures/encoders/t5, umt5)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from difflet_tpu.encoders import t5
from difflet_tpu.encoders.runtime import encode

# "" = with the right-padding mask (Wan's UMT5 call); "nomask." = without (FluxPipeline's T5 call).
CASES = [(case, pre) for case in ("t5", "umt5") for pre in ("", "nomask.")]


def run(model, data, pre):
    return encode(model, data[pre + "in.input_ids"], data.get(pre + "in.attention_mask"))


@pytest.mark.parametrize("case,pre", CASES)
def test_parity(case, pre, fixture_dir, io, compare):
    model = t5.from_pretrained(fixture_dir(case), dtype=jnp.float32)
    assert model.config.per_layer_relative_bias == (case == "umt5")
    data = io(case)
    compare(run(model, data, pre), data[pre + "out.last_hidden_state"], what=f"{case} {pre}last_hidden_state")


def test_mask_matters(io):
    """The masked and unmasked references differ on the unpadded row too (the padded keys
    change every query), so each parity case checks the mask handling."""
    data = io("t5")
    a, b = data["out.last_hidden_state"], data["nomask.out.last_hidden_state"]
    assert np.abs(a[1, :11] - b[1, :11]).max() > 1e-2


def bucket_reference(rel, bidirectional, num_buckets, max_distance):
    """The T5 bucket rule written out per element in Python floats (mesh-tensorflow's
    `_relative_position_bucket`)."""
    n, ret = num_buckets, 0
    if bidirectional:
        n //= 2
        ret += n if rel > 0 else 0
        rel = abs(rel)
    else:
        rel = max(-rel, 0)
    max_exact = n // 2
    if rel < max_exact:
        return ret + rel
    large = max_exact + int(math.log(rel / max_exact) / math.log(max_distance / max_exact) * (n - max_exact))
    return ret + min(large, n - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (64, 256)])
def test_relative_position_bucket(bidirectional, num_buckets, max_distance):
    rel = np.arange(-600, 601)
    got = t5.relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                      max_distance=max_distance)
    # float64 vs float32 log may disagree exactly at a bucket boundary; away from them they agree
    want = np.array([bucket_reference(int(r), bidirectional, num_buckets, max_distance) for r in rel])
    assert (got == want).mean() > 0.995 and np.abs(got - want).max() <= 1
    assert got.min() >= 0 and got.max() == num_buckets - 1


@pytest.mark.parametrize("case", ["t5", "umt5"])
def test_sharded_tp4_equals_one_device(case, fixture_dir, io, compare, mesh4):
    data = io(case)
    one = t5.from_pretrained(fixture_dir(case), dtype=jnp.float32)
    tp = t5.from_pretrained(fixture_dir(case), dtype=jnp.float32, mesh=mesh4)
    ff = tp.encoder.block[1].layer[1].DenseReluDense
    assert ff.wi_0.kernel[...].sharding.spec == P(None, "tp") and ff.wo.kernel[...].sharding.spec == P("tp", None)
    assert ff.wo.kernel[...].sharding.shard_shape(ff.wo.kernel[...].shape) == (16, 32)
    for pre in ("", "nomask."):
        got = run(tp, data, pre)
        compare(got, run(one, data, pre), rel=1e-6, abs=5e-6, what=f"tp4 vs one device {pre}")
        compare(got, data[pre + "out.last_hidden_state"], what=f"tp4 vs transformers {pre}")


def test_bfloat16_keeps_wo_float32(fixture_dir, io, compare):
    """As transformers' `_keep_in_fp32_modules = ["wo"]`: in bf16 the wo kernels stay float32."""
    data = io("t5")
    model = t5.from_pretrained(fixture_dir("t5"))
    ff = model.encoder.block[0].layer[1].DenseReluDense
    assert ff.wi_0.kernel[...].dtype == jnp.bfloat16 and ff.wo.kernel[...].dtype == jnp.float32
    out = run(model, data, "")
    assert out.dtype == jnp.bfloat16
    compare(out, data["out.last_hidden_state"], rel=3e-2, abs=0.2, what="bf16")
