"""The schedule-based step-time estimator on programs whose answer is known.

Synthetic HLO texts pin the model's rules exactly (fast), including the
collective-matmul kernels priced hop by hop (an ICI-bound kernel exposes
transfer, a compute-bound one does not, a hop sum shows waits a whole-kernel
max hides, a kernel hop and a JAX ring hop price transfer alike); deviceless
compiles for a v5e 2x2 check it on real scheduled TPU HLO: a single matmul
(the compiler's cycle count, close to its FLOPs at peak), a ring hop
whose transfer is longer than the matmul scheduled beside it (the step is
the transfer, and the difference is exposed wait), and both Pallas
collective-matmul kernels at small shapes (found, shapes and P read, hops
priced).
"""

import math

import pytest

from difflet_tpu.tools import calibration, estimate as E

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


def test_in_place_dynamic_update_slice_moves_its_update_only():
    """An unfused dynamic-update-slice writes its update into the buffer it aliases
    (XLA's collective-matmul decomposition assembles outputs so): priced as the update
    read and written, not the whole buffer."""
    body = ("  %u = bf16[64,1024]{1,0} slice(%b), slice={[0:64], [0:1024]}\n"
            "  %i = s32[] constant(0)\n"
            "  %x = bf16[1024,1024]{1,0} dynamic-update-slice(%a, %u, %i, %i)\n")
    est = E.estimate(HEAD + _entry(body), "v5e")
    update, whole = 64 * 1024 * 2, 1024 * 1024 * 2
    copy = 2 * whole / V5E.hbm_bw  # the entry's final copy
    slice_ = (update + whole) / V5E.hbm_bw  # the unfused slice reads b, writes the update
    assert est.other == pytest.approx(2 * update / V5E.hbm_bw + copy + slice_, rel=1e-6)


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


def test_combined_collectives_move_every_result():
    """XLA's combiners make one op of several: a TP block's image and text all-reduces
    become one tuple all-reduce; an async all-gather's type holds operands, then results."""
    body = _mm("y", 15000) + ('  %ar = (bf16[1024,1024]{1,0}, bf16[128,1024]{1,0}) all-reduce(%y, %b), '
                              "channel_id=1, replica_groups=mesh['tp'=4] {'tp'}, to_apply=%add\n"
                              '  %x = bf16[1024,1024]{1,0} get-tuple-element(%ar), index=0\n')
    est = E.estimate(HEAD + _fusion_comp("mm_comp") + _entry(body), "v5e")
    moved = 2 * 3 / 4 * (2**21 + 2**18)
    assert est.collectives["all-reduce"].bytes == moved
    assert est.sync_collective == pytest.approx(moved / 90e9 + 6e-6)

    body = ('  %s = ((bf16[256,1024]{1,0}, bf16[32,1024]{1,0}), (bf16[1024,1024]{1,0}, bf16[128,1024]{1,0})) '
            "all-gather-start(%a, %b), channel_id=1, replica_groups=mesh['tp'=4] {'tp'}, dimensions={0}\n"
            '  %d = (bf16[1024,1024]{1,0}, bf16[128,1024]{1,0}) all-gather-done(%s)\n'
            '  %x = bf16[1024,1024]{1,0} get-tuple-element(%d), index=0\n')
    est = E.estimate(HEAD + _entry(body), "v5e")
    assert est.collectives["all-gather"].bytes == 3 / 4 * (2**21 + 2**18)


def test_collective_group_size_on_a_multi_axis_mesh():
    """mesh['cfg'=2,'tp'=4] {'tp'}: groups of 4 (the tp ring), {'cfg'}: pairs; no braces: all 8."""
    def op(groups):
        return E.parse(HEAD + _entry(f"  %x = bf16[1024,1024]{{1,0}} all-reduce(%p), channel_id=1, "
                                     f"replica_groups={groups}, to_apply=%add\n")).computations

    for groups, want in (("mesh['cfg'=2,'tp'=4] {'tp'}", 4), ("mesh['cfg'=2,'tp'=4] {'cfg'}", 2),
                         ("mesh['cfg'=2,'data'=2,'tp'=2] {'cfg','data'}", 4), ("mesh['cfg'=2,'tp'=4]", 8)):
        ops = [o for comp in op(groups).values() for o in comp if o.op == "all-reduce"]
        assert E.group_size(ops[0], 99) == want, groups


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


# --------------------------------------------------------------------------
# Collective-matmul kernels, hop by hop (Wan2.1-14B shapes, v5e, P = 4)
# --------------------------------------------------------------------------

PEAK, HBM, LINK, LAT = 197e12, 819e9, 45e9, 1e-6


# the calls' instruction names (kernels/*_stream.py: one chunk of 592 rows a half)
AG_CALL, RS_CALL = "%all_gather_matmul_stream_1chunks_592rows.3", "%matmul_reduce_scatter_stream_1chunks_592rows.3"


def _kernel(kind, operands, out, flops=1, nbytes=1, hc=592):
    """A compiled-looking Pallas collective-matmul call (text as the TPU compiler prints it),
    named as kernels/*_stream.py name it: one chunk of hc rows a half."""
    out_t = out[0] if len(out) == 1 else "(" + ", ".join(out) + ")"
    names = ", ".join(f"%op{i}" for i in range(len(operands)))
    name = f"{kind}_stream_1chunks_{hc}rows"
    return (f'  %{name}.3 = {out_t} custom-call({names}), custom_call_target="tpu_custom_call", '
            f'operand_layout_constraints={{{", ".join(operands)}}}, frontend_attributes={{kernel_metadata={{\n'
            '"mesh_axes":"[\\"tp\\"]"\n'
            f'}}}}, metadata={{op_name="jit(f)/shard_map/{name}/pallas_call"}}, backend_config={{"custom_call_config":'
            f'{{"body":"xx","cost_estimate":{{"flops":"{flops}","transcendentals":"0",'
            f'"bytes_accessed":"{nbytes}"}}}}}}\n')


def _ag(widths, s=1184, K=5120, P=4):
    ops = [f"s32[{2 + 2 * P}]{{0}}", f"bf16[1,{s},{K}]{{2,1,0}}"] + [f"bf16[{K},{n}]{{1,0}}" for n in widths]
    return _kernel("all_gather_matmul", ops, [f"bf16[1,{P * s},{n}]{{2,1,0}}" for n in widths])


def _program(body, root, computations=""):
    return HEAD + computations + ("ENTRY %main (a: bf16[1024,1024]) -> bf16[1024,1024] {\n"
                   "  %a = bf16[1024,1024]{1,0} parameter(0)\n" + body + f"  ROOT %out = tuple({root})\n}}\n")


def _ag_hop(n, s=1184, K=5120):
    """(compute, transfer) of one all-gather hop: FLOPs vs HBM; one half each way."""
    compute = max(2 * s * K * n / PEAK, 2 * (K * n + s * n) / HBM)
    return compute, 2 * (s // 2) * K / LINK + LAT


def test_ici_bound_kernel_shows_its_hops_exposed_transfer():
    # Wan's cross-attention q gather: ~79 us of matmul per hop against ~136 us to move a half
    c, x = _ag_hop(1280)
    assert c == pytest.approx(78.8e-6, rel=1e-3) and x == pytest.approx(135.7e-6, rel=1e-3)
    est = E.estimate(_program(_ag([1280]), AG_CALL), "v5e")
    prologue = 2 * 1184 * 5120 / HBM  # own rows into VMEM before hop 0
    assert est.exposed_transfer == pytest.approx(3 * (x - c))
    assert est.pallas == pytest.approx(prologue + 4 * c)
    assert est.total == pytest.approx(prologue + 3 * x + c)
    site, = est.kernel_sites.values()
    assert (site["calls"], site["hops"], site["ici_bound_hops"]) == (1, 4, 3)
    assert est.pallas_kernels == {"all_gather_matmul_stream_1chunks_592rows": pytest.approx(prologue + 4 * c)}
    k = est.collectives["all_gather_matmul (kernel)"]
    assert (k.count, k.bytes) == (1, 3 * 2 * 2 * 592 * 5120)  # 3 hops x two halves


def test_compute_bound_kernel_hides_its_transfers():
    # Wan's q/k/v gather: three 1280-wide weights per hop, 236 us against 136 us
    c, x = _ag_hop(3 * 1280)
    assert c > x
    est = E.estimate(_program(_ag([1280] * 3), AG_CALL), "v5e")
    assert est.exposed_transfer == 0
    assert est.total == pytest.approx(2 * 1184 * 5120 / HBM + 4 * c)
    assert next(iter(est.kernel_sites.values()))["ici_bound_hops"] == 0


def test_hop_sum_shows_waits_a_whole_kernel_max_hides():
    # 1920 columns: 118 us of matmul per hop against 136 us of transfer. Over the kernel the
    # MXU has more work (4 x 118 = 473 us) than the links (3 x 136 = 407 us), so
    # max(total compute, total transfer) calls it compute-bound; but every hop that sends
    # waits for its halves: 3 x 18 us exposed.
    c, x = _ag_hop(1920)
    assert 4 * c > 3 * x and x > c
    est = E.estimate(_program(_ag([1920]), AG_CALL), "v5e")
    assert est.exposed_transfer == pytest.approx(3 * (x - c))
    assert est.total - 2 * 1184 * 5120 / HBM == pytest.approx(3 * x + c)
    assert est.total - 2 * 1184 * 5120 / HBM > max(4 * c, 3 * x)


def test_reduce_scatter_kernel_hops():
    # Wan's attention out: x [4736, 1280] per rank, w [1280, 5120] -> out [1184, 5120]; each hop
    # sends one accumulator half (592 x 5120) each way; the last hop writes out, sends nothing
    ops = ["s32[10]{0}", "bf16[1,4736,1280]{2,1,0}", "bf16[1280,5120]{1,0}"]
    est = E.estimate(_program(_kernel("matmul_reduce_scatter", ops, ["bf16[1,1184,5120]{2,1,0}"]),
                              RS_CALL), "v5e")
    x = 2 * 592 * 5120 / LINK + LAT
    c = [max((2 * 1184 * 1280 * 5120 + (1184 * 5120 if j else 0)) / PEAK,
             2 * (1280 * 5120 + (1184 * 1280 if j < 3 else 1184 * 5120)) / HBM) for j in range(4)]
    prologue = 2 * 1184 * 1280 / HBM  # hop 0's rows
    assert est.exposed_transfer == pytest.approx(sum(x - cj for cj in c[:3]))
    assert est.total == pytest.approx(prologue + 3 * x + c[3])
    # two pairs (FLUX / HunyuanVideo single blocks): FLOPs over the hops are the kernel's CostEstimate
    two = E.collective_matmul_hops("matmul_reduce_scatter", [
        ("s32", (10,)), ("bf16", (1, 4608, 192)), ("bf16", (1, 4608, 768)), ("bf16", (192, 3072)),
        ("bf16", (768, 3072))], [("bf16", (1, 1152, 3072))])
    B, S, s, N = 1, 4608, 1152, 3072
    assert two.P == 4 and sum(two.flops) == 2 * B * S * 960 * N + B * S * N + B * (S - s) * N
    assert sum(two.hbm) + two.prologue_hbm == 2 * (B * S * 960 + 4 * 960 * N + B * s * N)


def test_stacked_weights_price_as_their_one_layer():
    # A block scan passes the stack [L, K, n] and the layer index (an s32[1] operand): the
    # kernel reads one layer, so the hops are those of the plain [K, n] weight.
    x, out = ("bf16", (1, 1184, 5120)), [("bf16", (1, 4736, 1280))]
    plain = E.collective_matmul_hops("all_gather_matmul", [("s32", (10,)), x, ("bf16", (5120, 1280))], out)
    stacked = E.collective_matmul_hops("all_gather_matmul", [("s32", (10,)), ("s32", (1,)), x,
                                                             ("bf16", (40, 5120, 1280))], out)
    assert stacked == plain and plain is not None
    xs, out = [("bf16", (1, 4736, 1280))], [("bf16", (1, 1184, 5120))]
    plain = E.collective_matmul_hops("matmul_reduce_scatter", [("s32", (10,))] + xs + [("bf16", (1280, 5120))], out)
    stacked = E.collective_matmul_hops("matmul_reduce_scatter", [("s32", (10,)), ("s32", (1,))] + xs
                                       + [("bf16", (40, 1280, 5120))], out)
    assert stacked == plain and plain is not None


def test_fused_epilogue_biases_do_not_change_the_hops():
    # The all-gather kernel's fused epilogue adds bias operands after the weights ([n] or a
    # stacked [L, n]); the hops are those of the weights alone (one weight per output).
    x = ("bf16", (1, 1184, 5120))
    out = [("bf16", (1, 4736, 1280))] * 2
    ws = [("bf16", (40, 5120, 1280))] * 2
    plain = E.collective_matmul_hops("all_gather_matmul", [("s32", (10,)), ("s32", (1,)), x] + ws, out)
    biased = E.collective_matmul_hops("all_gather_matmul", [("s32", (10,)), ("s32", (1,)), x] + ws
                                      + [("bf16", (40, 1280)), ("bf16", (1, 1280))], out)
    assert biased == plain and plain is not None and "n=1280+1280" in plain.site
    # per-row sums of squares of some outputs (`sum_squares`): extra [B, 2P, 1, h] f32 results
    ssq = E.collective_matmul_hops("all_gather_matmul", [("s32", (10,)), ("s32", (1,)), x] + ws
                                   + [("bf16", (40, 1280)), ("bf16", (1, 1280))],
                                   out + [("f32", (1, 8, 1, 592))] * 2)
    assert ssq == plain
    # q / k written head-major ([B, n / 128, S, 128]) with norm weights [128] and the RoPE
    # tables f32 [S, 128] after the biases: the same hops as the row-major products
    heads = E.collective_matmul_hops("all_gather_matmul", [("s32", (10,)), ("s32", (1,)), x] + ws
                                     + [("bf16", (40, 1280))] * 2 + [("bf16", (1, 128))] * 2
                                     + [("f32", (4736, 128))] * 2, [("bf16", (1, 10, 4736, 128))] * 2)
    assert heads == plain


def test_kernel_hops_and_jax_ring_hops_price_transfer_alike():
    # The same three hops as a JAX ring: per hop both halves as permutes (one per direction)
    # with the hop's matmul scheduled between start and done, then the last hop's matmul.
    c, x = _ag_hop(1280)
    cycles = round(c * 1.5e9)
    half = "bf16[1,592,5120]{2,1,0}"
    body = ""
    for j in range(3):
        body += (f"  %f{j} = ({half}, {half}, u32[], u32[]) collective-permute-start(%a), "
                 "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}\n"
                 f"  %b{j} = ({half}, {half}, u32[], u32[]) collective-permute-start(%a), "
                 "source_target_pairs={{0,3},{1,0},{2,1},{3,2}}\n"
                 + _mm(f"m{j}", cycles) +
                 f"  %fd{j} = {half} collective-permute-done(%f{j})\n"
                 f"  %bd{j} = {half} collective-permute-done(%b{j})\n")
    body += _mm("m3", cycles)
    ring = E.estimate(_program(body, "%m3", _fusion_comp("mm_comp")), "v5e")
    kernel = E.estimate(_program(_ag([1280]), AG_CALL), "v5e")
    assert ring.exposed_transfer == pytest.approx(3 * (x - cycles / 1.5e9))
    assert kernel.exposed_transfer == pytest.approx(ring.exposed_transfer, rel=1e-5)
    assert ring.collectives["collective-permute"].seconds == pytest.approx(
        kernel.collectives["all_gather_matmul (kernel)"].seconds * 2)  # permutes count per direction


def test_kernel_sends_queue_behind_a_permute_in_flight():
    # a half still on the links when the (compute-bound) q/k/v kernel starts delays its first hop
    c, x = _ag_hop(3 * 1280)
    half = "bf16[1,592,5120]{2,1,0}"
    body = (f"  %p = ({half}, {half}, u32[], u32[]) collective-permute-start(%a), "
            "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}\n" + _ag([1280] * 3)
            + f"  %pd = {half} collective-permute-done(%p)\n")
    est = E.estimate(_program(body, AG_CALL + ", %pd"), "v5e")
    prologue = 2 * 1184 * 5120 / HBM
    queued = x - prologue  # the permute started with the kernel, its rows load meanwhile
    assert est.exposed_transfer == pytest.approx(max(0.0, queued + x - c))
    assert est.total == pytest.approx(prologue + 4 * c + max(0.0, queued + x - c))


def test_unreadable_kernel_shapes_fall_back_with_a_warning():
    bad = _kernel("all_gather_matmul", ["s32[10]{0}", "bf16[1184,5120]{1,0}"], ["bf16[4736,1280]{1,0}"],
                  flops=2 * 10**9)
    est = E.estimate(_program(bad, AG_CALL), "v5e")
    assert est.pallas == pytest.approx(2e9 / PEAK)
    assert any("shapes not understood" in w for w in est.warnings)


def test_fit_recovers_a_known_nonmatmul_scale():
    rows = []
    for nonmm, rest in [(0.05, 0.2), (0.08, 0.1), (0.02, 0.3)]:
        e = E.Estimate(total=nonmm + rest, nonmatmul=nonmm, invalid=nonmm)
        rows.append((e, rest + 0.63 * nonmm))
    assert calibration.fit_nonmatmul_scale(rows) == pytest.approx(0.63)


# --------------------------------------------------------------------------
# Real compiled programs (deviceless v5e 2x2)
# --------------------------------------------------------------------------

KNOWN = """
import json, jax, jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from difflet_tpu.tools import deviceless
from difflet_tpu.tools import calibration, estimate as E
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
    from difflet_tpu.tools import deviceless

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


KERNELS = """
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from difflet_tpu.tools import deviceless
from difflet_tpu.tools import calibration, estimate as E
from difflet_tpu.kernels import all_gather_matmul_stream as agk, matmul_reduce_scatter_stream as rsk
mesh = deviceless.topology_mesh('v5e:2x2')
sd = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
def ag(s, K, n):
    f = jax.shard_map(lambda x, w: agk.all_gather_matmul_stream(x, [w], axis_name='tp')[0], mesh=mesh,
                      in_specs=(P('tp'), P(None, 'tp')), out_specs=P(None, 'tp'), check_vma=False)
    return jax.jit(f).trace(sd((4 * s, K), P('tp')), sd((K, 4 * n), P(None, 'tp'))).lower().compile()
def rs(S, k, N):
    f = jax.shard_map(lambda x, w: rsk.matmul_reduce_scatter_stream([(x, w)], axis_name='tp'), mesh=mesh,
                      in_specs=(P(None, 'tp'), P('tp')), out_specs=P('tp'), check_vma=False)
    return jax.jit(f).trace(sd((S, 4 * k), P(None, 'tp')), sd((4 * k, N), P('tp'))).lower().compile()
out = {}
for name, c in [('ag_ici', ag(256, 1024, 128)), ('ag_mxu', ag(512, 2048, 4096)), ('rs_ici', rs(1024, 128, 1024))]:
    out[name] = E.estimate(c.as_text(), 'v5e').to_dict()
print(json.dumps(out))
"""


def test_known_answers_on_compiled_collective_matmul_kernels(monkeypatch):
    """Both kernels compiled for v5e:2x2: the estimator finds them, reads P and their
    shapes from the compiled text and prices them hop by hop."""
    from difflet_tpu.tools import deviceless

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    out = deviceless.run_python(KERNELS)
    # all-gather, 256 rows x 1024 per rank, 128 columns: 0.3 us of matmul vs 6.8 us per half
    ici = out["ag_ici"]
    (site, k), = ici["kernel_sites"].items()
    assert site == "all_gather_matmul x[1,256,1024] -> n=128 (P=4)"
    assert (k["calls"], k["hops"], k["ici_bound_hops"]) == (1, 4, 3), k
    c, x = _ag_hop(128, s=256, K=1024)
    assert k["exposed"] == pytest.approx(3 * (x - c)), k
    assert ici["exposed_transfer"] >= k["exposed"]
    # all-gather, 512 x 2048 per rank, 4096 columns: 44 us of matmul vs 24 us per half
    mxu = out["ag_mxu"]
    (site, k), = mxu["kernel_sites"].items()
    c, x = _ag_hop(4096, s=512, K=2048)
    assert c > x and k["ici_bound_hops"] == 0 and k["exposed"] == 0, k
    assert k["compute"] == pytest.approx(2 * 512 * 2048 / HBM + 4 * c)
    # reduce-scatter, 1024 rows x 128 per rank -> 256 x 1024: each accumulator half 5.8 us
    (site, k), = out["rs_ici"]["kernel_sites"].items()
    assert site == "matmul_reduce_scatter x[1,1024,128] -> N=1024 (P=4)"
    assert (k["hops"], k["ici_bound_hops"]) == (4, 3), k
    assert k["transfer"] == pytest.approx(3 * (2 * 128 * 1024 / LINK + LAT))


def test_chip_constants_match_the_public_specs():
    assert V5E.bf16_flops == 197e12 and V5E.hbm_bw == 819e9 and V5E.hbm_bytes == 16 * 2**30
    assert math.isclose(V5E.ici_link_bw, 45e9)
    with pytest.raises(ValueError, match="no chip constants"):
        E.chip_for("v9x:2x2")


def _kernel_call(name):
    """A Pallas kernel's custom call as the compiled schedule names it (only the name is read)."""
    return E.Op(name=name, op="custom-call", type="bf16[1]", text='custom_call_target="tpu_custom_call"')


def test_streaming_all_gather_kernel_is_priced_by_steps():
    # kernels/all_gather_matmul_stream/: one call, P C steps of 2 hc rows each; the
    # name carries C and hc. Wan 480x832x81 q: 4096-row halves in 4 chunks of 1024.
    o = _kernel_call("all_gather_matmul_stream_4chunks_1024rows.3")
    assert E.collective_matmul_call(o) == ("all_gather_matmul", 4)
    assert E.collective_matmul_stream_rows(o) == 1024
    assert E.collective_matmul_stream_rows(_kernel_call("all_gather_matmul_3chunks.5")) is None
    head = [("s32", (10,)), ("s32", (1,)), ("s32", (10,))]
    x, out, wq = ("bf16", (1, 8192, 5120)), [("bf16", (1, 32768, 1280))], ("bf16", (40, 5120, 1280))
    whole = E.collective_matmul_hops("all_gather_matmul", head + [x, wq], out)
    stream = E.collective_matmul_hops("all_gather_matmul", head + [x, wq], out, chunks=4, stream_rows=1024)
    assert stream.P == 16 and "streaming 4 chunks of 1024 rows" in stream.site
    assert sum(stream.flops) == pytest.approx(sum(whole.flops))  # chunks tile the halves: no overlap
    assert sum(stream.ici) == pytest.approx(sum(whole.ici))
    assert [bool(i) for i in stream.ici] == [True, True, True, False] * 4
    weight = 2 * 1280 * 5120
    # own rows read once (prologue + 3 loads), the weights once per step instead of once per hop
    assert sum(stream.hbm) + stream.prologue_hbm == pytest.approx(sum(whole.hbm) + whole.prologue_hbm
                                                                   + 12 * weight)
    assert stream.prologue_hbm == pytest.approx(whole.prologue_hbm / 4)


def test_streaming_all_gather_with_weights_in_vmem_reads_them_once():
    # "..._wvmem" (kernels/all_gather_matmul_stream/, few rows a step): the weights are
    # read at step 0 only. FLUX's text q/k/v at tp=4: 128 rows a rank, one chunk of 64.
    o = _kernel_call("all_gather_matmul_stream_1chunks_64rows_wvmem.2")
    assert E.collective_matmul_call(o) == ("all_gather_matmul", 1)
    assert E.collective_matmul_stream_rows(o) == 64 and E.collective_matmul_weights_held(o)
    assert not E.collective_matmul_weights_held(_kernel_call("all_gather_matmul_stream_1chunks_64rows.2"))
    head = [("s32", (10,)), ("s32", (1,)), ("s32", (10,))]
    x, w, out = ("bf16", (1, 128, 3072)), ("bf16", (19, 3072, 768)), [("bf16", (1, 512, 768))]
    streamed = E.collective_matmul_hops("all_gather_matmul", head + [x, w], out, stream_rows=64)
    held = E.collective_matmul_hops("all_gather_matmul", head + [x, w], out, stream_rows=64, weights_held=True)
    weight = 2 * 3072 * 768
    assert "weights in VMEM" in held.site and held.flops == streamed.flops and held.ici == streamed.ici
    assert held.hbm[0] == streamed.hbm[0]
    assert [a - b for a, b in zip(streamed.hbm[1:], held.hbm[1:])] == [weight] * 3


def test_streaming_reduce_scatter_kernel_is_priced_by_steps():
    # kernels/matmul_reduce_scatter_stream.py: one call, P C steps of 2 hc rows each; the
    # name carries C and hc. Wan 480x832x81 attention out: 4096-row halves in 4 chunks of 1024.
    o = _kernel_call("matmul_reduce_scatter_stream_4chunks_1024rows.3")
    assert E.collective_matmul_call(o) == ("matmul_reduce_scatter", 4)
    assert E.collective_matmul_stream_rows(o) == 1024
    assert E.collective_matmul_stream_rows(_kernel_call("matmul_reduce_scatter_3chunks.5")) is None
    head = [("s32", (10,)), ("s32", (1,))]
    x, w, out = ("bf16", (1, 32768, 1280)), ("bf16", (40, 1280, 5120)), [("bf16", (1, 8192, 5120))]
    whole = E.collective_matmul_hops("matmul_reduce_scatter", head + [x, w], out)
    stream = E.collective_matmul_hops("matmul_reduce_scatter", head + [x, w], out, chunks=4, stream_rows=1024)
    assert stream.P == 16 and "streaming 4 chunks of 1024 rows" in stream.site and "row chunks" not in stream.site
    assert sum(stream.flops) == pytest.approx(sum(whole.flops))  # chunks tile the halves: no overlap
    assert sum(stream.ici) == pytest.approx(sum(whole.ici))
    assert [bool(i) for i in stream.ici] == [True, True, True, False] * 4
    weight = 2 * 1280 * 5120
    # x rows and out once each, the weights once per step instead of once per hop
    assert sum(stream.hbm) + stream.prologue_hbm == pytest.approx(sum(whole.hbm) + whole.prologue_hbm
                                                                   + 12 * weight)
    assert stream.prologue_hbm == pytest.approx(whole.prologue_hbm / 4)
    # a bias operand ([N]) is not priced
    biased = E.collective_matmul_hops("matmul_reduce_scatter", head + [x, w, ("bf16", (5120,))], out, chunks=4,
                                      stream_rows=1024)
    assert biased == stream
