"""Both JAX rings compiled for a real v5e-4 (deviceless): every transfer has a
matmul scheduled beside it, i.e. the overlap is in the compiled schedule."""

import pytest

from difflet_tpu import deviceless

CODE = """
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from difflet_tpu import collective_matmul as cm, deviceless, hlo
mesh = deviceless.topology_mesh('v5e:2x2')
S, K, N = 4736, 5120, 1280 * 4
sd = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
ag = jax.shard_map(lambda x, a, b, c: tuple(cm.all_gather_matmul(x, [a, b, c], assemble='{assemble}')), mesh=mesh,
                   in_specs=(P('tp', None),) + (P(None, 'tp'),) * 3, out_specs=(P(None, 'tp'),) * 3, check_vma=False)
rs = jax.shard_map(lambda x, w: cm.matmul_reduce_scatter([(x, w)]), mesh=mesh,
                   in_specs=(P(None, 'tp'), P('tp', None)), out_specs=P('tp', None), check_vma=False)
out = {{}}
for name, f, args in [('ag', ag, [sd((S, K), P('tp', None))] + [sd((K, N), P(None, 'tp'))] * 3),
                      ('rs', rs, [sd((S, N), P(None, 'tp')), sd((N, K), P('tp', None))])]:
    c = jax.jit(f).trace(*args).lower().compile()
    m = hlo.parse(c.as_text())
    out[name] = dict(overlap=hlo.overlapped(m), mem=deviceless.memory_report(c))
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("assemble", ["concat", "dus"])
def test_rings_overlap_transfers_with_matmuls_on_v5e(assemble):
    out = deviceless.run_python(CODE.format(assemble=assemble))
    for name, hops in (("ag", 3), ("rs", 3)):
        overlap = out[name]["overlap"]
        print(name, assemble, overlap, out[name]["mem"])
        # two directions per hop; each start has >= 1 matmul before its done
        assert len(overlap) == 2 * hops, overlap
        assert all(n >= 1 for _, n in overlap), overlap
