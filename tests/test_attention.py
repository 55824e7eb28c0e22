import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.tools import deviceless
from difflet_tpu.layers.sdpa import attention, reference_attention


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
from difflet_tpu.tools import deviceless
from difflet_tpu.tools import hlo
from difflet_tpu.layers.sdpa import attention
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

    from difflet_tpu.parallel.mesh import TP, make_mesh

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


# Per-rank sequence lengths of the ports (benchmark/attention_blocks.py CASES): FLUX 1024^2,
# Qwen-Image 1024^2 / 1328^2, LTX-2 480x704x49 / x121, Wan 480x832x9 / x81, 720x1280x81,
# HunyuanVideo 320x512x61, 544x960x129, 720x1280x129 (+ text), and short text keys.
PORT_LENGTHS = (4608, 4224, 7017, 2310, 5280, 4680, 10496, 32760, 67576, 75600, 119056)


def test_splash_blocks_table_at_the_ports_lengths():
    from difflet_tpu.layers import sdpa as A

    for n in PORT_LENGTHS:
        for skv in (n, 512, 1024):
            b = A.splash_blocks(n, skv)
            assert b.validate() is b
            assert b.sq >= n and b.skv >= skv and b.sq % b.block_q == 0 and b.skv % b.block_kv == 0
            # keys never pad beyond the 128-rounded length; queries only within PAD_CAP (none
            # when an exact block of >= 1024 rows exists)
            assert b.skv == -(-skv // A.LANE) * A.LANE
            base = -(-n // A.LANE) * A.LANE
            assert b.sq - base <= A.PAD_CAP * base
            assert b.block_q >= 1024 or b.block_q == base  # big query blocks: k/v re-read rarely
            assert b.block_q * b.block_kv <= A.MAX_BLOCK_PAIR and b.block_kv_compute <= A.MAX_KV_COMPUTE
    long = A.splash_blocks(119056, 119056)  # 76 x 1568 = 133 x 896 = 119168: no padding beyond 128
    assert (long.block_q, long.block_kv, long.block_kv_compute, long.sq, long.skv) == (1568, 896, 128, 119168, 119168)
    assert A.splash_blocks(32760, 32760).block_q == 2048 and A.splash_blocks(75600, 75600).sq == 75776
    assert long.smem_metadata_bytes() <= A.SMEM_METADATA_BUDGET
    # 128 x 1201 keys (1201 prime): exact 128-row key blocks would break the SMEM bound, so keys pad
    odd = A.splash_blocks(128 * 1201, 128 * 1201)
    assert odd.block_kv > 128 and odd.skv > 128 * 1201 and odd.smem_metadata_bytes() <= A.SMEM_METADATA_BUDGET
    # what validation rejects: 128-row blocks at 720p (block-mask metadata beyond SMEM),
    # 2048 x 2048 blocks (v5e's 16 MiB scoped VMEM), splash's own divisibility rules
    with pytest.raises(ValueError, match="SMEM"):
        A.SplashBlocks(128, 128, 128, 119168, 119168).validate()
    with pytest.raises(ValueError, match="VMEM"):
        A.SplashBlocks(2048, 2048, 512, 120832, 120832).validate()
    with pytest.raises(ValueError, match="multiple"):
        A.SplashBlocks(512, 512, 384, 4608, 4608).validate()
    with pytest.raises(ValueError, match="whole blocks"):
        A.SplashBlocks(512, 512, 512, 4680, 4608).validate()
    # one exact block of 1024-2048 rows (a multiple of 16): no padding (Wan's cross-attention on
    # one rank's 1184 rows, Config.sp_cross_local)
    assert A.splash_blocks(1184, 512) == A.SplashBlocks(1184, 512, 512, 1184, 512)
    assert A.splash_blocks(1190, 512).sq == 1280  # not a multiple of 16: the 128-rounded block
    # short sequences: one block of the 128-rounded length
    small = A.splash_blocks(130, 200)
    assert (small.block_q, small.block_kv, small.sq, small.skv) == (256, 256, 256, 256)


@pytest.mark.parametrize("blocks", [(128, 256, 128, 384, 768), (160, 256, 256, 320, 768)])
def test_splash_interpret_mode_with_several_unequal_blocks(blocks):
    """Explicit block sizes (3 q blocks of 128, or 2 of 160 -- not a multiple of 128, like
    the exact q blocks of long sequences --, 3 kv blocks of 256 in 128- or 256-wide compute
    chunks, padded) give the same numbers: block sizes change the schedule, not the math."""
    from difflet_tpu.layers.sdpa import SplashBlocks, _splash

    q, k, v, mask = inputs(B=2, Sq=300, Skv=520, H=1, D=128, seed=3)
    mask[1] = np.arange(520) < 500  # valid keys in the second and third kv blocks too
    blocks = SplashBlocks(*blocks)
    got = np.asarray(_splash(q, k, v, jnp.asarray(mask), True, blocks))
    np.testing.assert_allclose(got, numpy_attention(q, k, v, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a real-size deviceless compile: 4-12 s on a loaded 2-core machine
def test_splash_at_hunyuan_720p_materialises_no_s_squared_array():
    """HunyuanVideo 720x1280x129: 118,800 video + 256 text tokens, 24 / 4 heads per rank,
    bf16, compiled deviceless for v5e (the splash call alone): no array of the compiled
    program -- argument, constant, temporary or mask -- comes near one S^2 score matrix,
    and the temporaries stay O(S) (the padded, head-major q, k, v copies)."""
    S, H, D = 33 * 45 * 80 + 256, 6, 128
    out = deviceless.run_python(f"""
import json, re, time, math
import jax, jax.numpy as jnp
from difflet_tpu.tools import deviceless
from difflet_tpu.layers.sdpa import attention, splash_blocks
dev = deviceless.topology_devices('v5e:2x2')[0]
s = jax.sharding.SingleDeviceSharding(dev)
a = jax.ShapeDtypeStruct((1, {S}, {H}, {D}), jnp.bfloat16, sharding=s)
m = jax.ShapeDtypeStruct((1, {S}), jnp.bool_, sharding=s)
t = time.time()
c = jax.jit(lambda q, k, v, m: attention(q, k, v, m, impl='splash')).trace(a, a, a, m).lower().compile()
text = c.as_text()
shapes = re.findall(r'\\b(?:bf16|f32|s32|s8|s16|pred|u8)\\[([0-9,]*)\\]', text)
sizes = [math.prod(int(d) for d in dims.split(',') if d) for dims in shapes]
vmem = [int(x) for x in re.findall(r'"used_scoped_memory_configs":\\[\\{{[^\\]]*?"size":"(\\d+)"', text)]
b = splash_blocks({S}, {S})
print(json.dumps(dict(mem=deviceless.memory_report(c), largest=max(sizes), kernels=text.count('tpu_custom_call'),
                      vmem=max(vmem), padded=max(b.sq, b.skv), seconds=time.time() - t)))
""")
    print("HunyuanVideo 720p splash call on v5e:", out)
    assert out["kernels"] >= 1
    s2 = S * S  # one head's score matrix has S^2 elements (2 S^2 bytes in bf16)
    assert out["largest"] < s2 / 100  # largest array: a padded q/k/v copy, H * S * D
    assert out["largest"] <= H * out["padded"] * D
    assert out["mem"]["temporaries"] < 2 * s2 / 20
    assert out["mem"]["temporaries"] <= 4 * H * out["padded"] * D * 2 + out["padded"] * 128 * 4  # O(S)
    assert out["vmem"] <= 16 * 2**20
