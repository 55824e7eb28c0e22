"""Compiled for a real v5e-4 (deviceless): both JAX rings have a matmul
scheduled beside every transfer, i.e. the overlap is in the compiled schedule;
a scanned model's Pallas kernels read their layer out of the stacked weights
(no per-layer weight copy feeds them)."""

import pytest

from difflet_tpu.tools import deviceless

CODE = """
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from difflet_tpu.parallel import collective_matmul as cm
from difflet_tpu.tools import deviceless
from difflet_tpu.tools import hlo
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


STACKED = """
import json, jax, jax.numpy as jnp
from flax import nnx
from difflet_tpu import runtime, testing
from difflet_tpu.tools import deviceless
from difflet_tpu.tools import hlo
from difflet_tpu.config import Config
from difflet_tpu.runner import Runner
spec = testing.register_toy_port()
# 2 layers; every width per rank a multiple of 128 and 64-row halves: both kernels run
cfg = spec.config_from_diffusers(dict(dim=512, heads=4, ffn=1024, layers=2, in_channels=8, tokens=512))
mesh = deviceless.topology_mesh("v5e:2x2")
model = runtime.abstract_model(lambda: spec.build(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh, spec.plan)
inputs = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16 if k == "hidden_states" else v.dtype)
          for k, v in spec.example_inputs(cfg).items()}
run = Runner(model, mesh, Config(check_vma=True, sp_kernel="pallas", sp_rs_kernel="pallas"), "sp")
m = hlo.parse(run.trace(**inputs).lower().compile().as_text())
is_ds = lambda i: i.op == "dynamic-slice"
kernels = []
for comp, ops in m.computations.items():
    for ins in ops:
        if ins.op == "custom-call" and "tpu_custom_call" in ins.text:
            feeds = [m.lookup(comp, o) for o in ins.operands]
            kernels.append(dict(
                name=ins.name, shapes=hlo.constrained_operand_shapes(ins), feeds=[f and f.op for f in feeds],
                sliced=[f.name for f in feeds if f is not None and (is_ds(f) or f.op == "fusion" and any(
                    m.contains(c, is_ds) for c in f.calls))]))
print(json.dumps(kernels))
"""


@pytest.mark.slow
def test_scanned_kernels_read_the_stacked_weights_on_v5e():
    """A 2-layer toy under SP with both Pallas kernels: no dynamic-slice (fusion)
    feeds a kernel, i.e. no per-layer copy of a weight is made for it; the
    kernels take the stacks [2, K, n] and the layer index instead, straight
    from the scan's loop state (not a copy of the stack into VMEM either)."""
    kernels = deviceless.run_python(STACKED, timeout=900)
    cm = [k for k in kernels if k["name"].startswith(("all_gather_matmul", "matmul_reduce_scatter"))]
    assert len(cm) == 4, [k["name"] for k in kernels]  # q/k/v, out, ff up, ff down
    for k in kernels:
        assert not k["sliced"], k
    for k in cm:
        weights = [op for (dt, dims), op in zip(k["shapes"], k["feeds"]) if dt == "bf16" and len(dims) == 3
                   and dims[0] == 2]
        assert weights and set(weights) == {"get-tuple-element"}, k
