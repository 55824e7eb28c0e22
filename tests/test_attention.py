import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import deviceless
from difflet_tpu.attention import attention, reference_attention


def numpy_attention(q, k, v, mask):
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def inputs(B=2, Sq=9, Skv=11, H=3, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Sq, H, D)).astype(np.float32)
    k = rng.standard_normal((B, Skv, H, D)).astype(np.float32)
    v = rng.standard_normal((B, Skv, H, D)).astype(np.float32)
    mask = np.ones((B, Skv), bool)
    mask[0, 7:] = False  # different valid lengths per batch item
    mask[1, 4:] = False
    return q, k, v, mask


def test_xla_mask_semantics_against_numpy():
    q, k, v, mask = inputs()
    ref = numpy_attention(q, k, v, mask)
    got = np.asarray(attention(q, k, v, mask))
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    # masked keys never matter: replace them and the output is bit-identical
    k2, v2 = k.copy(), v.copy()
    k2[~mask] = 100.0
    v2[~mask] = -7.0
    np.testing.assert_array_equal(np.asarray(attention(q, k2, v2, mask)), got)
    # no mask = every key
    np.testing.assert_allclose(np.asarray(attention(q, k, v)), numpy_attention(q, k, v, np.ones_like(mask)),
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(reference_attention(q, k, v, mask)), ref, rtol=2e-5, atol=2e-5)


def test_one_dimensional_mask_broadcasts():
    q, k, v, _ = inputs()
    m = np.arange(11) < 5
    np.testing.assert_allclose(np.asarray(attention(q, k, v, m)), numpy_attention(q, k, v, np.stack([m, m])),
                               rtol=2e-5, atol=2e-5)


def test_bad_shapes():
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match="not \\[B, S, H, D\\]"):
        attention(q, k[..., :8], v, None)
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, None, impl="flash3")


@pytest.mark.slow
def test_splash_interpret_mode_against_numpy():
    q, k, v, mask = inputs(B=2, Sq=130, Skv=200, H=2, D=128, seed=1)
    got = np.asarray(attention(q, k, v, mask, impl="splash", interpret=True))
    np.testing.assert_allclose(got, numpy_attention(q, k, v, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_splash_compiles_for_v5e_at_a_real_shape():
    """10 heads x 4736 tokens x 128 (Wan2.1-14B self-attention per rank), bf16."""
    out = deviceless.run_python("""
import json, jax, jax.numpy as jnp
from difflet_tpu import deviceless, hlo
from difflet_tpu.attention import attention
dev = deviceless.topology_devices('v5e:2x2')[0]
s = jax.sharding.SingleDeviceSharding(dev)
a = jax.ShapeDtypeStruct((1, 4736, 10, 128), jnp.bfloat16, sharding=s)
m = jax.ShapeDtypeStruct((1, 4736), jnp.bool_, sharding=s)
c = jax.jit(lambda q, k, v, m: attention(q, k, v, m, impl='splash')).trace(a, a, a, m).lower().compile()
mod = hlo.parse(c.as_text())
kernels = [i for i in mod.schedule if i.op == 'custom-call' and 'tpu_custom_call' in i.text]
print(json.dumps(dict(mem=deviceless.memory_report(c), kernels=len(kernels))))
""")
    print("splash v5e HBM per chip:", out["mem"])
    assert out["kernels"] >= 1  # the Pallas kernel, not an XLA fallback
    assert out["mem"]["total"] < 16 * 2**30
    # q, k, v and the output at 4736x10x128 bf16 are 12.1 MB each; no S^2 score matrix
    assert out["mem"]["temporaries"] < 4736 * 4736 * 10 * 2


def test_splash_under_shard_map_check_vma():
    """jax's splash kernel declares no manual-axis types for its output; inside
    shard_map(check_vma=True) (heads split over 2 ranks, interpret mode) it runs
    and its output is typed varying over the ranks: declared replicated, it fails."""
    from jax.sharding import PartitionSpec as P

    from difflet_tpu.mesh import TP, make_mesh

    q, k, v, mask = inputs(B=2, Sq=130, Skv=200, H=2, D=16, seed=2)
    heads = P(None, None, TP)

    def sharded(out_spec):
        return jax.jit(jax.shard_map(lambda q, k, v, m: attention(q, k, v, m, impl="splash", interpret=True),
                                     mesh=make_mesh(2), in_specs=(heads, heads, heads, P()), out_specs=out_spec,
                                     check_vma=True))

    got = np.asarray(sharded(heads)(q, k, v, mask))
    np.testing.assert_allclose(got, numpy_attention(q, k, v, mask), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"out_specs.*replicated"):
        sharded(P())(q, k, v, mask)
