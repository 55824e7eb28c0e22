"""The schedule-based step-time estimator on programs whose answer is known.

Synthetic HLO texts pin the model's rules exactly (fast); two deviceless
compiles for a v5e 2x2 check it on real scheduled TPU HLO: a single matmul
(the compiler's cycle count, close to its FLOPs at peak) and a ring hop
whose transfer is longer than the matmul scheduled beside it (the step is
the transfer, and the difference is exposed wait).
"""

import math

import pytest

from difflet_tpu import estimate as E

V5E = E.CHIPS["v5e"]

HEAD = "HloModule m, is_scheduled=true, num_partitions=4\n\n"


def _fusion_comp(name):
    return (f"%{name} (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {{\n"
            f"  %p0 = bf16[1024,1024]{{1,0}} parameter(0)\n"
            f"  %p1 = bf16[1024,1024]{{1,0}} parameter(1)\n"
            f"  ROOT %c = bf16[1024,1024]{{1,0}} convolution(%p0, %p1), dim_labels=bf_io->bf\n"
            f"}}\n\n")


def _mm(name, cycles, a="%a", b="%b", ctype="COST_MODEL_TYPE_CLASSIC"):
    return (f"  %{name} = bf16[1024,1024]{{1,0}} fusion({a}, {b}), kind=kOutput, calls=%mm_comp, "
            f'backend_config={{"window_config":{{"estimated_cycles":"{cycles}","cost_model_type":"{ctype}"}}}}\n')


def _elementwise(name, cycles):
    return (f"  %{name} = bf16[1024,1024]{{1,0}} fusion(%a), kind=kLoop, calls=%ew_comp, "
            f'backend_config={{"window_config":{{"estimated_cycles":"{cycles}","cost_model_type":"COST_MODEL_TYPE_INVALID"}}}}\n')


EW_COMP = ("%ew_comp (p0: bf16[1024,1024]) -> bf16[1024,1024] {\n"
           "  %p0 = bf16[1024,1024]{1,0} parameter(0)\n"
           "  ROOT %e = bf16[1024,1024]{1,0} exponential(%p0)\n}\n\n")


def _entry(body, root="%x"):
    return ("ENTRY %main (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {\n"
            "  %a = bf16[1024,1024]{1,0} parameter(0)\n"
            "  %b = bf16[1024,1024]{1,0} parameter(1)\n"
            + body + f"  ROOT %out = bf16[1024,1024]{{1,0}} copy({root})\n}}\n")


def test_single_matmul_is_its_cycles_at_the_clock():
    text = HEAD + _fusion_comp("mm_comp") + _entry(_mm("x", 150000))
    est = E.estimate(text, "v5e")
    assert est.matmul == pytest.approx(150000 / 1.5e9)
    # + the unfused copy of 2 MiB read and written at HBM bandwidth
    assert est.total == pytest.approx(1e-4 + 2 * 2**21 / V5E.hbm_bw)
    assert est.exposed_transfer == 0


def test_ring_hop_longer_than_its_matmul_exposes_the_difference():
    # 2 MiB over one link: 2**21 / 45e9 + 1 us = 47.6 us; the matmul beside it is 10 us
    body = ('  %cp = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}, u32[], u32[]) collective-permute-start(%a), '
            'channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}\n'
            + _mm("y", 15000)
            + '  %x = bf16[1024,1024]{1,0} collective-permute-done(%cp)\n')
    est = E.estimate(HEAD + _fusion_comp("mm_comp") + _entry(body), "v5e")
    transfer = 2**21 / 45e9 + 1e-6
    assert est.exposed_transfer == pytest.approx(transfer - 1e-5)
    assert est.total == pytest.approx(transfer + 2 * 2**21 / V5E.hbm_bw)
    cp = est.collectives["collective-permute"]
    assert (cp.count, cp.overlapped, cp.sync, cp.bytes) == (1, 1, 0, 2**21)


def test_hop_shorter_than_its_matmul_is_hidden_and_directions_run_in_parallel():
    body = ('  %f = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}, u32[], u32[]) collective-permute-start(%a), '
            'source_target_pairs={{0,1},{1,2},{2,3},{3,0}}\n'
            '  %g = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}, u32[], u32[]) collective-permute-start(%b), '
            'source_target_pairs={{0,3},{1,0},{2,1},{3,2}}\n'
            + _mm("y", 150000)
            + '  %fd = bf16[1024,1024]{1,0} collective-permute-done(%f)\n'
            + '  %x = bf16[1024,1024]{1,0} collective-permute-done(%g)\n')
    est = E.estimate(HEAD + _fusion_comp("mm_comp") + _entry(body), "v5e")
    assert est.exposed_transfer == 0
    assert est.collectives["collective-permute"].overlapped == 2


def test_same_direction_transfers_queue():
    body = ''.join(f'  %s{i} = (bf16[1024,1024]{{1,0}}, bf16[1024,1024]{{1,0}}, u32[], u32[]) collective-permute-start(%a), '
                   'source_target_pairs={{0,1},{1,2},{2,3},{3,0}}\n' for i in range(2))
    body += ('  %d0 = bf16[1024,1024]{1,0} collective-permute-done(%s0)\n'
             '  %x = bf16[1024,1024]{1,0} collective-permute-done(%s1)\n')
    est = E.estimate(HEAD + _entry(body), "v5e")
    assert est.exposed_transfer == pytest.approx(2 * (2**21 / 45e9 + 1e-6))


def test_synchronous_all_reduce_blocks_at_both_ring_directions():
    body = _mm("y", 15000) + ('  %x = bf16[1024,1024]{1,0} all-reduce(%y), channel_id=1, '
                              "replica_groups=mesh['tp'=4] {'tp'}, to_apply=%add\n")
    est = E.estimate(HEAD + _fusion_comp("mm_comp") + _entry(body), "v5e")
    moved = 2 * 3 / 4 * 2**21
    assert est.sync_collective == pytest.approx(moved / 90e9 + 6e-6)
    ar = est.collectives["all-reduce"]
    assert (ar.count, ar.sync, ar.bytes) == (1, 1, moved)


def test_while_body_counts_its_trip_count_from_the_condition():
    text = HEAD + _fusion_comp("mm_comp") + (
        "%cond (p: (s32[], bf16[1024,1024])) -> pred[] {\n"
        "  %p = (s32[], bf16[1024,1024]{1,0}) parameter(0)\n"
        "  %i = s32[] get-tuple-element(%p), index=0\n"
        "  %n = s32[] constant(7)\n"
        "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}\n\n"
        "%body (p: (s32[], bf16[1024,1024])) -> (s32[], bf16[1024,1024]) {\n"
        "  %p = (s32[], bf16[1024,1024]{1,0}) parameter(0)\n"
        "  %h = bf16[1024,1024]{1,0} get-tuple-element(%p), index=1\n"
        + _mm("m", 3000, "%h", "%h") +
        "  %i = s32[] get-tuple-element(%p), index=0\n"
        "  ROOT %t = (s32[], bf16[1024,1024]{1,0}) tuple(%i, %m)\n}\n\n") + _entry(
        "  %zero = s32[] constant(2)\n"
        "  %init = (s32[], bf16[1024,1024]{1,0}) tuple(%zero, %a)\n"
        "  %w = (s32[], bf16[1024,1024]{1,0}) while(%init), condition=%cond, body=%body\n"
        "  %x = bf16[1024,1024]{1,0} get-tuple-element(%w), index=1\n")
    est = E.estimate(text, "v5e")
    assert est.matmul == pytest.approx(5 * 3000 / 1.5e9)  # 2..6: five trips
    assert not est.warnings


def test_pallas_kernel_roofline_and_multiline_attributes():
    # flops-bound: 2e9 flops / 197e12; the continuation line starting with "}" must not end ENTRY
    body = ('  %k = bf16[1024,1024]{1,0} custom-call(%a, %b), custom_call_target="tpu_custom_call", '
            'frontend_attributes={kernel_metadata={\n"mesh_axes":"[]"\n}}, metadata={op_name="jit(f)/mykernel/pallas_call"}, '
            'backend_config={"custom_call_config":{"body":"xx","cost_estimate":{"flops":"2000000000",'
            '"transcendentals":"0","bytes_accessed":"4194304","remote_bytes_transferred":"0"}}}\n'
            + _elementwise("x", 3000))
    est = E.estimate(HEAD + EW_COMP + _entry(body), "v5e")
    assert est.pallas == pytest.approx(2e9 / 197e12)
    assert est.pallas_kernels == {"mykernel": pytest.approx(2e9 / 197e12)}
    assert est.nonmatmul == pytest.approx(3000 / 1.5e9)
    half = E.estimate(HEAD + EW_COMP + _entry(body), "v5e", E.Calibration(nonmatmul=0.5))
    assert half.nonmatmul == pytest.approx(1500 / 1.5e9)


def test_fit_recovers_a_known_nonmatmul_scale():
    rows = []
    for nonmm, rest in [(0.05, 0.2), (0.08, 0.1), (0.02, 0.3)]:
        e = E.Estimate(total=nonmm + rest, nonmatmul=nonmm, invalid=nonmm)
        rows.append((e, rest + 0.63 * nonmm))
    assert E.fit_nonmatmul_scale(rows) == pytest.approx(0.63)


# --------------------------------------------------------------------------
# Real compiled programs (deviceless v5e 2x2)
# --------------------------------------------------------------------------

KNOWN = """
import json, jax, jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from difflet_tpu import deviceless, estimate as E
mesh = deviceless.topology_mesh('v5e:2x2')
sd = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
out = {}
# 1. one matmul, 2048x4096 @ 4096x4096 on each chip
mm = jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P('tp'), P()), out_specs=P('tp'), check_vma=False)
c = jax.jit(mm).trace(sd((4 * 2048, 4096), P('tp')), sd((4096, 4096), P())).lower().compile()
out['mm'] = E.estimate(c.as_text(), 'v5e').to_dict()
# 2. a ring hop of 32 MiB while a 1024x1024 @ 1024x1024 matmul runs
def ring(x, a, b):
    nxt = lax.ppermute(x, 'tp', [(i, (i + 1) % 4) for i in range(4)])
    return nxt, a @ b
f = jax.shard_map(ring, mesh=mesh, in_specs=(P('tp'), P('tp'), P()), out_specs=(P('tp'), P('tp')), check_vma=False)
c = jax.jit(f).trace(sd((4 * 4096, 4096), P('tp')), sd((4 * 1024, 1024), P('tp')), sd((1024, 1024), P())).lower().compile()
out['ring'] = E.estimate(c.as_text(), 'v5e').to_dict()
out['ring_overlap'] = E.schedule_overlap(c.as_text())
print(json.dumps(out))
"""


def test_known_answers_on_compiled_v5e_programs(monkeypatch):
    from difflet_tpu import deviceless

    # several engineers' deviceless compiles share this machine's libtpu lockfile
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    out = deviceless.run_python(KNOWN)
    mm = out["mm"]
    ideal = 2 * 2048 * 4096 * 4096 / 197e12  # 349 us at peak
    assert ideal <= mm["matmul"] <= 1.25 * ideal, mm
    assert mm["total"] <= mm["matmul"] * 1.2 + 5e-5, mm
    ring = out["ring"]
    transfer = 4096 * 4096 * 2 / 45e9 + 1e-6  # 746 us over one link
    small = 2 * 1024 ** 3 / 197e12             # ~11 us of matmul
    assert ring["collectives"]["collective-permute"]["count"] == 1
    # the step is the transfer (plus the unfused copy of the received buffer after it)
    assert ring["total"] - ring["other"] - ring["exposed_dma"] == pytest.approx(transfer, rel=0.02), ring
    assert ring["exposed_transfer"] >= transfer - 10 * small, ring
    assert ring["matmul"] < 3 * small


def test_chip_constants_match_the_public_specs():
    assert V5E.bf16_flops == 197e12 and V5E.hbm_bw == 819e9 and V5E.hbm_bytes == 16 * 2**30
    assert math.isclose(V5E.ici_link_bw, 45e9)
    with pytest.raises(ValueError, match="no chip constants"):
        E.chip_for("v9x:2x2")
