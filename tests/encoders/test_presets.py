"""Released sizes: parameter counts from the configs, abstract (deviceless) models, and the
collectives GSPMD inserts for the tensor-parallel layout."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from difflet_tpu import encoders
from difflet_tpu.encoders import clip, decoder_lm, loading, t5


def clip_count(c):
    d, f = c.hidden_size, c.intermediate_size
    layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
    return (c.vocab_size + c.max_position_embeddings) * d + c.num_hidden_layers * layer + 2 * d


def t5_count(c):
    d, inner, f = c.d_model, c.num_heads * c.d_kv, c.d_ff
    layer = 4 * d * inner + 3 * d * f + 2 * d
    tables = (c.num_layers if c.per_layer_relative_bias else 1) * c.relative_attention_num_buckets * c.num_heads
    return c.vocab_size * d + c.num_layers * layer + tables + d


def lm_count(c):
    d, hd, f = c.hidden_size, c.dim, c.intermediate_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    layer = (d * q + q) + 2 * (d * kv + kv) + q * d + 3 * d * f + 2 * d
    return c.vocab_size * d + c.num_hidden_layers * layer + d


# (module, preset, count formula, exact count, published size)
PRESETS = {
    "clip_vit_l_14": (clip, clip.CLIP_VIT_L_14, clip_count, 123_060_480, 123.1e6),  # CLIP-L text tower
    "t5_v1_1_xxl": (t5, t5.T5_V1_1_XXL, t5_count, 4_762_310_656, 4.76e9),  # T5-XXL encoder
    "umt5_xxl": (t5, t5.UMT5_XXL, t5_count, 5_680_910_336, 5.68e9),  # Wan's umt5-xxl encoder
    "qwen2_5_vl_7b": (decoder_lm, decoder_lm.QWEN2_5_VL_7B, lm_count, 7_070_619_136, 7.07e9),  # LM, no vision
}


@pytest.mark.parametrize("name", PRESETS)
def test_parameter_count(name):
    _, config, formula, exact, published = PRESETS[name]
    model = encoders.abstract(config)
    n = loading.num_params(model)
    assert n == formula(config) == exact
    assert abs(n - published) / published < 2e-3


@pytest.mark.parametrize("name,seq", [("clip_vit_l_14", 77), ("t5_v1_1_xxl", 512), ("umt5_xxl", 512),
                                      ("qwen2_5_vl_7b", 256)])
def test_abstract_sharded_forward_shapes(name, seq, mesh4):
    """The abstract model on a tp=4 mesh: bf16 ShapeDtypeStructs with their NamedShardings, and
    the forward traced (not run) at the released size."""
    _, config, *_ = PRESETS[name]
    model = encoders.abstract(config, jnp.bfloat16, mesh4)
    params = loading.flat_params(model)
    assert all(isinstance(v.get_value(), jax.ShapeDtypeStruct) for v in params.values())
    column = [k for k in params if re.search(r"\.(q_proj|q|fc1|wi_0|gate_proj)\.kernel$", k)]
    row = [k for k in params if re.search(r"\.(out_proj|o|fc2|wo|down_proj)\.kernel$", k)]
    assert column and row
    for k in column:
        assert params[k].get_value().sharding == NamedSharding(mesh4, P(None, "tp"))
    for k in row:
        assert params[k].get_value().sharding == NamedSharding(mesh4, P("tp", None))
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((2, seq), jnp.int32)
    out = jax.eval_shape(lambda s, i: nnx.merge(graphdef, s)(i, jnp.ones(i.shape, jnp.int32)), state, ids)
    width = getattr(config, "hidden_size", None) or config.d_model
    first = jax.tree.leaves(out)[0]
    assert first.shape == (2, seq, width) and first.dtype == jnp.bfloat16


COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


@pytest.mark.parametrize("case,module", [("clip", clip), ("t5", t5), ("umt5", t5), ("qwen2_5_vl", decoder_lm)])
def test_megatron_collectives(case, module, fixture_dir, mesh4):
    """Under tp=4 GSPMD partitions the forward with one all-reduce after each row-parallel
    product (attention output, MLP output: 2 a layer) and no other collective."""
    model = module.from_pretrained(fixture_dir(case), dtype=jnp.float32, mesh=mesh4)
    graphdef, state = nnx.split(model)
    ids = jnp.ones((2, 12), jnp.int32)
    hlo = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m)).lower(state, ids, ids).compile().as_text()
    assert Counter(COLLECTIVE.findall(hlo)) == {"all-reduce": 2 * 2}
