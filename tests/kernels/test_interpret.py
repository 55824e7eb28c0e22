"""Both collective-matmul kernels in TPU interpret mode on 4 CPU devices, race
detector on, against numpy; a racy variant (one credit too few) must be
flagged; the dispatch in difflet_tpu.parallel.collective_matmul must use the kernel when
it can and fall back to the ring (one warning per shape) when it cannot.

Each case runs in a process of its own (_interpret_case.py): one process that
ran many failing interpret-mode cases once hung, and a failed kernel call
leaves effect tokens behind.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SEM_LEAK = "has non-zero count"


def run_case(spec, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "DIFFLET_TPU_"))}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_interpret_case.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, f"case printed no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    result["output"] = proc.stdout + proc.stderr
    return result


def check_ok(spec, tol):
    r = run_case(spec)
    assert r["ok"], f"{r['error_type']}: {r['error']}\n{r['traceback']}"
    assert SEM_LEAK not in r["output"], r["output"][-3000:]
    assert "RACE DETECTED" not in r["output"]
    assert max(r["rel_err"]) <= tol, r["rel_err"]
    if "ref_err" in r:  # collective_matmul's plain reference agrees with numpy as well
        assert max(r["ref_err"]) <= tol, r["ref_err"]
    return r


# (name, spec, tolerance). float32 values are small integers: exact products, tolerance 0.
# The kernels' default plan: one chunk a half (as at every released shape but the long videos).
AG_CASES = [
    ("f32-2w-b2", dict(dtype="float32", batch=[2], S=128, K=256, widths=[128, 384], col_tile=128, row_tile=8), 0.0),
    ("bf16-4w-b2", dict(dtype="bfloat16", batch=[2], S=256, K=128, widths=[128, 256, 384, 128], col_tile=128,
                        row_tile=16), 1e-2),
    ("f32-2w-default-tiles", dict(dtype="float32", batch=[1], S=64, K=128, widths=[256, 512]), 0.0),
]

RS_CASES = [
    ("f32-2p-b2", dict(dtype="float32", batch=[2], S=128, N=384, widths=[128, 256], col_tile=128, row_tile=8), 0.0),
    ("bf16-1p-b2", dict(dtype="bfloat16", batch=[2], S=256, N=256, widths=[256], col_tile=128, row_tile=16), 2e-2),
    ("f32-1p-default-tiles", dict(dtype="float32", batch=[1], S=64, N=256, widths=[128]), 0.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol", AG_CASES, ids=[c[0] for c in AG_CASES])
def test_all_gather_matmul_interpret(name, spec, tol):
    check_ok(dict(kind="ag", **spec), tol)


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol", RS_CASES, ids=[c[0] for c in RS_CASES])
def test_matmul_reduce_scatter_interpret(name, spec, tol):
    check_ok(dict(kind="rs", **spec), tol)


# Stacked weights [L, ...] read at a runtime layer index (a block scan's), through
# the dispatch (LayerWeight); float32 exact. (Directly: the "stacked" kernel cases below.)
STACKED_CASES = [
    ("ag-dispatch-L4", dict(kind="ag_dispatch", dtype="float32", batch=[], S=64, K=128, widths=[128, 256],
                            layers=4, at=[3, 0])),
    ("rs-dispatch-L4", dict(kind="rs_dispatch", dtype="float32", batch=[], S=64, N=256, widths=[128], layers=4,
                            at=[3, 0])),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec", STACKED_CASES, ids=[c[0] for c in STACKED_CASES])
def test_stacked_weights_read_at_the_layer_index(name, spec):
    r = check_ok(spec, 0.0)
    assert len(r["rel_err"]) == len(spec["at"]) * (len(spec["widths"]) if spec["kind"].startswith("ag") else 1)
    assert r["warnings"] == []  # the dispatch ran the kernel, not the ring


@pytest.mark.slow
@pytest.mark.parametrize("kind,spec", [
    ("ag_dispatch", dict(dtype="float32", batch=[2], S=128, K=128, widths=[128, 256])),
    ("rs_dispatch", dict(dtype="float32", batch=[2], S=128, N=256, widths=[128, 128])),
])
def test_dispatch_runs_the_kernel_when_supported(kind, spec):
    r = check_ok(dict(kind=kind, **spec), 0.0)
    assert r["reason"] is None
    assert r["warnings"] == []


@pytest.mark.slow
@pytest.mark.parametrize("kind,spec,why", [
    # 32 rows over 4 ranks: halves of 4 rows, not whole (8, 128) tiles
    ("ag_fallback", dict(dtype="float32", batch=[], S=32, K=128, widths=[128]), "multiple of 8"),
    # a width that is not a multiple of 128
    ("ag_fallback", dict(dtype="float32", batch=[1], S=64, K=128, widths=[128, 96]), "multiples of 128"),
    ("rs_fallback", dict(dtype="float32", batch=[], S=32, N=128, widths=[128]), "multiple of"),
    ("rs_fallback", dict(dtype="float32", batch=[2], S=64, N=192, widths=[128]), "not a multiple of 128"),
])
def test_unsupported_shape_falls_back_to_the_ring_with_one_warning(kind, spec, why):
    r = check_ok(dict(kind=kind, **spec), 0.0)
    assert r["reason"] is not None and why in r["reason"], r["reason"]
    # traced twice (two jits), warned once
    assert len(r["warnings"]) == 1, r["warnings"]
    assert "using the JAX ring" in r["warnings"][0] and r["reason"] in r["warnings"][0]


# Fused epilogues (bias, GELU tanh) on the kernel's float32 tile, against float64
# numpy act(x @ w + b) and against the unfused path (the kernel's bare products,
# then the same epilogue as an XLA pass). float32: integer x, w, b, so the
# product and bias are exact and only GELU rounds; the fused result must equal
# the unfused one bit for bit. bf16: one rounding (fused) instead of two.
EPILOGUE_CASES = [
    ("f32-gelu-nobias", dict(dtype="float32", batch=[], S=64, K=128, widths=[256], bias=[False],
                             act=["gelu_tanh"]), 1e-6, 0.0),
    # through collective_matmul: Epilogue(LayerWeight bias) with LayerWeight weights
    ("f32-dispatch-stacked-L4", dict(dtype="float32", batch=[2], S=64, K=128, widths=[128, 256],
                                     bias=[True, True], act=[None, "gelu_tanh"], layers=4, at=[3, 0],
                                     dispatch=True), 1e-6, 0.0),
    ("bf16-bias-gelu", dict(dtype="bfloat16", batch=[1], S=256, K=128, widths=[128, 256], bias=[True, True],
                            act=["gelu_tanh", None], col_tile=128, row_tile=16), 1e-2, 2e-2),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol,unfused_tol", EPILOGUE_CASES, ids=[c[0] for c in EPILOGUE_CASES])
def test_fused_epilogue_matches_float64_and_the_unfused_path(name, spec, tol, unfused_tol):
    r = check_ok(dict(kind="ag_epi", **spec), tol)
    assert max(r["unfused_err"]) <= unfused_tol, r["unfused_err"]
    assert len(r["rel_err"]) == len(spec.get("at", [0])) * len(spec["widths"])
    assert r["warnings"] == []  # the dispatch ran the kernel, not the ring


# Row sums of squares (`sum_squares`, for the across-heads q/k RMSNorm) of some
# weights' outputs, over each rank's columns, on rings of 2 and 4 (the 4 CPU
# devices), with biases, GELU and stacked weights. ssq_err: against float64 numpy
# sums of the squares of the output the kernel returned (only the float32
# summation differs); ssq_unfused_err: against collective_matmul.row_sum_squares
# of the unfused path's output; ssq_ref_err: against the float64 reference's
# squares (adds the output's own rounding: 0 in float32 integer cases without
# GELU; bf16 rounds the output to 2^-9, so the squares' sum is within ~2^-8).
SSQ_CASES = [
    # (name, spec, ssq_err / ssq_unfused_err tolerance, ssq_ref_err tolerance)
    ("f32-ring4-3w-some-ssq", dict(ring=4, dtype="float32", batch=[1], S=128, K=128, widths=[256, 128, 256],
                                   bias=[True, True, False], act=[None, "gelu_tanh", "gelu_tanh"],
                                   ssq=[True, False, True], col_tile=128, row_tile=8), 1e-6, 1e-6),
    ("f32-ring2-b2-all-ssq", dict(ring=2, dtype="float32", batch=[2], S=64, K=128, widths=[128, 384],
                                  bias=[True, True], act=[None, None], ssq=[True, True], col_tile=128,
                                  row_tile=8), 1e-6, 1e-6),
    # through collective_matmul (Epilogue(LayerWeight bias, sum_squares=True), LayerWeight weights)
    ("f32-ring2-dispatch-stacked-L4", dict(ring=2, dtype="float32", batch=[2], S=64, K=128, widths=[128, 256],
                                           bias=[True, True], act=[None, None], ssq=[True, False], layers=4,
                                           at=[3, 0], dispatch=True), 1e-6, 1e-6),
    ("bf16-ring4-qkv", dict(ring=4, dtype="bfloat16", batch=[1], S=256, K=128, widths=[256, 256, 256],
                            bias=[True, True, True], act=[None, None, None], ssq=[True, True, False],
                            col_tile=128, row_tile=16), 1e-6, 2 ** -7),
    ("bf16-ring2-dispatch", dict(ring=2, dtype="bfloat16", batch=[], S=128, K=256, widths=[128, 256],
                                 bias=[True, True], act=[None, None], ssq=[True, True], dispatch=True), 1e-6, 2 ** -7),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol,ref_tol", SSQ_CASES, ids=[c[0] for c in SSQ_CASES])
def test_sum_squares_match_float64_and_the_unfused_path(name, spec, tol, ref_tol):
    out_tol = 1e-6 if spec["dtype"] == "float32" else 1e-2
    r = check_ok(dict(kind="ag_epi", **spec), out_tol)
    if spec["dtype"] == "float32":
        assert max(r["unfused_err"]) == 0.0, r["unfused_err"]  # the outputs themselves: as without ssq
    n_ssq = len(spec.get("at", [0])) * sum(spec["ssq"])
    assert len(r["ssq_err"]) == n_ssq and r["ssq_dtype"] == ["float32"] * n_ssq
    assert max(r["ssq_err"]) <= tol, r["ssq_err"]
    # the unfused path's ssq is XLA's sum of the same outputs' squares (bf16: it may skip the bf16 round trip)
    assert max(r["ssq_unfused_err"]) <= (tol if spec["dtype"] == "float32" else 2 ** -7), r["ssq_unfused_err"]
    assert max(r["ssq_ref_err"]) <= ref_tol, r["ssq_ref_err"]
    assert r["warnings"] == []  # the dispatch ran the kernel, not the ring


# The streaming all-gather kernel (kernels/all_gather_matmul_stream/): one call, each
# half in C row chunks through a window of W VMEM slots per direction, guarded by
# credits. f32 cases exact (small integers). "ragged": the chunk rows do not divide
# the half, so the last chunk is shifted back and overlaps the one before.
STREAM_CASES = [
    # (name, spec, tolerance, chunks a half the plan must take)
    ("ring4-1chunk", dict(kind="ag", ring=4, dtype="float32", batch=[], S=128, K=128, widths=[256],
                          chunk_rows=16, col_tile=128, row_tile=8), 0.0, 1),
    ("ring4-2chunks", dict(kind="ag", ring=4, dtype="float32", batch=[], S=128, K=128, widths=[256],
                           chunk_rows=8, col_tile=128, row_tile=8), 0.0, 2),
    # 40-row halves in chunks of 16: 0, 16, 24 (the last overlaps by 8 rows)
    ("ring4-3chunks-ragged-b2-2w", dict(kind="ag", ring=4, dtype="float32", batch=[2], S=320, K=256,
                                        widths=[128, 384], chunk_rows=16, col_tile=128, row_tile=8), 0.0, 3),
    ("ring2-3chunks-window2", dict(kind="ag", ring=2, dtype="float32", batch=[], S=96, K=128, widths=[256, 128],
                                   chunk_rows=8, window=2, col_tile=128, row_tile=8), 0.0, 3),
    ("ring4-4chunks-window4", dict(kind="ag", ring=4, dtype="float32", batch=[1], S=256, K=128, widths=[128],
                                   chunk_rows=8, window=4, col_tile=128, row_tile=8), 0.0, 4),
    ("bf16-ring4-2chunks-3w", dict(kind="ag", ring=4, dtype="bfloat16", batch=[1], S=256, K=128,
                                   widths=[128, 256, 128], chunk_rows=16, col_tile=128, row_tile=16), 1e-2, 2),
    ("ring4-2chunks-stacked-L3", dict(kind="ag", ring=4, dtype="float32", batch=[], S=128, K=128,
                                      widths=[128, 256], layers=3, at=[2, 0], chunk_rows=8, col_tile=128,
                                      row_tile=8), 0.0, 2),
    # K = 256 in two depth chunks of 128, every step of the runtime loop through the accumulator
    ("ring4-2chunks-depth-chunks", dict(kind="ag", ring=4, dtype="float32", batch=[1], S=128, K=256,
                                        widths=[128, 256], chunk_rows=8, col_tile=128, row_tile=8,
                                        depth_tile=128), 0.0, 2),
    # every weight tile held in VMEM (loaded at step 0, read in place by the 7 later steps),
    # stacked weights read at each layer index, ragged chunks with a batch of 2
    ("ring4-2chunks-stacked-L3-weights-in-vmem", dict(kind="ag", ring=4, dtype="float32", batch=[], S=128, K=128,
                                                      widths=[128, 256], layers=3, at=[2, 0], chunk_rows=8,
                                                      col_tile=128, row_tile=8, weights_in_vmem=True), 0.0, 2),
    ("ring4-3chunks-ragged-b2-2w-weights-in-vmem", dict(kind="ag", ring=4, dtype="float32", batch=[2], S=320,
                                                        K=256, widths=[128, 384], chunk_rows=16, col_tile=128,
                                                        row_tile=8, weights_in_vmem=True), 0.0, 3),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol,chunks", STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
def test_streaming_all_gather_matmul(name, spec, tol, chunks):
    r = check_ok(spec, tol)
    assert r["chunks"] == chunks, r["chunks"]


# ... with fused epilogues: bias, GELU, sums of squares (assembled from the chunks'
# slabs, the overlap dropped), against float64 numpy and the kernel's unfused
# path (f32: bit for bit).
STREAM_EPILOGUE_CASES = [
    ("f32-ring4-3chunks-ragged-stacked", dict(ring=4, dtype="float32", batch=[1], S=320, K=128, widths=[128, 256],
                                              bias=[True, False], act=[None, "gelu_tanh"], ssq=[True, True],
                                              layers=3, at=[2, 0], chunk_rows=16, col_tile=128, row_tile=8),
     1e-6, 1e-6, 3),
    ("bf16-ring2-qkv-2chunks", dict(ring=2, dtype="bfloat16", batch=[], S=128, K=128, widths=[256, 256, 256],
                                    bias=[True, True, True], act=[None, None, None], ssq=[True, True, False],
                                    chunk_rows=16, col_tile=128, row_tile=16), 1e-6, 2 ** -7, 2),
    # bias, GELU and sums of squares with the weights (and the depth chunks) held in VMEM
    ("f32-ring4-1chunk-weights-in-vmem", dict(ring=4, dtype="float32", batch=[1], S=128, K=256, widths=[128, 256],
                                              bias=[True, True], act=[None, "gelu_tanh"], ssq=[True, False],
                                              col_tile=128, row_tile=8, depth_tile=128, weights_in_vmem=True),
     1e-6, 1e-6, 1),
    # one M operand of 2 B hc = 64 rows (both directions, a batch of 2, 16-row ragged chunks) in
    # row tiles of 24, 24, 16 that straddle the 16-row segments: the sums of squares cut at them
    ("f32-ring4-3chunks-ragged-b2-straddling-tiles", dict(ring=4, dtype="float32", batch=[2], S=320, K=256,
                                                          widths=[128, 256], bias=[True, False],
                                                          act=[None, "gelu_tanh"], ssq=[True, True], chunk_rows=16,
                                                          col_tile=128, row_tile=24, depth_tile=128),
     1e-6, 1e-6, 3),
    # the epilogue on the depth-chunk sums (K = 384: three chunks of 128)
    ("f32-ring4-2chunks-depth-chunks", dict(ring=4, dtype="float32", batch=[1], S=128, K=384, widths=[128, 256],
                                            bias=[True, True], act=[None, "gelu_tanh"], ssq=[True, False],
                                            chunk_rows=8, col_tile=128, row_tile=8, depth_tile=128),
     1e-6, 1e-6, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol,ref_tol,chunks", STREAM_EPILOGUE_CASES,
                         ids=[c[0] for c in STREAM_EPILOGUE_CASES])
def test_streaming_epilogues_match_float64_and_the_unfused_path(name, spec, tol, ref_tol, chunks):
    f32 = spec["dtype"] == "float32"
    r = check_ok(dict(kind="ag_epi", **spec), 1e-6 if f32 else 1e-2)
    assert r["chunks"] == chunks, r["chunks"]
    if f32:
        assert max(r["unfused_err"]) == 0.0, r["unfused_err"]
    n_ssq = len(spec.get("at", [0])) * sum(spec["ssq"])
    assert len(r["ssq_err"]) == n_ssq and r["ssq_dtype"] == ["float32"] * n_ssq
    assert max(r["ssq_err"]) <= tol, r["ssq_err"]
    assert max(r["ssq_ref_err"]) <= ref_tol, r["ssq_ref_err"]


# q / k / v written head-major by the all-gather kernel (`Heads`, `layers.attention.HeadsOut`):
# per-head RMSNorm, split-halves RoPE from the gathered rows' tables, q's 1/sqrt(D), next
# to a row-major GELU weight (rings of 2 through the dispatch, 4 on the kernel itself).
# rel_err against float64 numpy; unfused_err against the
# kernel's products followed by `HeadsOut` as XLA passes (float32: the norm's mean of
# squares summed in another order; bf16: that may flip one rounding in rare elements).
HEADS_CASES = [
    # (name, spec, rel_err tolerance, unfused_err tolerance)
    ("f32-ring2-dispatch-qkv-mlp", dict(ring=2, dtype="float32", batch=[1], S=128, K=128,
                                        widths=[256, 256, 256, 128], heads=[[1, 1, 1], [1, 1, 0], [0, 0, 0], None],
                                        act=[None, None, None, "gelu_tanh"]), 1e-5, 1e-6),
    ("bf16-ring2-b2-dispatch", dict(ring=2, dtype="bfloat16", batch=[2], S=128, K=256, widths=[256, 256, 128],
                                    heads=[[1, 1, 1], [1, 1, 0], [0, 0, 0]]), 3e-2, 2 ** -7),
    # the kernel itself: 24-row halves in ragged 16-row chunks (the second shifted back to overlap
    # the first by 8 rows), a batch of 2, row tiles of 24 that straddle the segments, the norm
    # without RoPE, RoPE without the norm
    ("f32-ring4-2chunks-ragged-b2", dict(ring=4, dtype="float32", batch=[2], S=192, K=128, widths=[128, 128, 128],
                                         heads=[[1, 1, 1], [1, 0, 0], [0, 1, 0]], chunk_rows=16, col_tile=128,
                                         row_tile=24), 1e-5, 1e-6),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol,unfused_tol", HEADS_CASES, ids=[c[0] for c in HEADS_CASES])
def test_head_major_epilogue_matches_float64_and_the_unfused_path(name, spec, tol, unfused_tol):
    r = check_ok(dict(kind="ag_heads", **spec), tol)
    assert max(r["unfused_err"]) <= unfused_tol, r["unfused_err"]
    assert r["warnings"] == []  # the kernel ran, not the ring
    if "chunk_rows" not in spec:  # through the dispatch: its kernel call wrote the heads itself
        want = [None if f is None else True for f in spec["heads"]]
        assert [[h is not None for h in call] for call in r["kernel_heads"]] == [[w is not None for w in want]], r
    else:
        assert r["chunks"] == 2, r["chunks"]


# One credit too few: the send at step P (chunk 1's first, where nothing but the
# credit orders the receiver's reads of that slot before the write) goes without
# its credit, and the receiver does not signal it. The same shapes pass above.
@pytest.mark.slow
@pytest.mark.parametrize("name,spec", [
    ("ring4-2chunks", dict(kind="ag", ring=4, dtype="float32", batch=[], S=128, K=128, widths=[256], chunk_rows=8,
                           col_tile=128, row_tile=8, skip_credit=4)),
    ("ring2-3chunks-window2", dict(kind="ag", ring=2, dtype="float32", batch=[], S=96, K=128, widths=[256, 128],
                                   chunk_rows=8, window=2, col_tile=128, row_tile=8, skip_credit=2)),
    # the variant that holds its weights in VMEM and sums the depth in chunks (rows 3a, 3b)
    ("ring4-2chunks-weights-in-vmem-depth-chunks", dict(kind="ag", ring=4, dtype="float32", batch=[], S=128, K=256,
                                                        widths=[256], chunk_rows=8, col_tile=128, row_tile=8,
                                                        depth_tile=128, weights_in_vmem=True, skip_credit=4)),
    ("epilogue-ring4-3chunks-ragged", dict(kind="ag_epi", ring=4, dtype="float32", batch=[1], S=320, K=128,
                                           widths=[128, 256], bias=[True, False], act=[None, "gelu_tanh"],
                                           ssq=[True, True], chunk_rows=16, col_tile=128, row_tile=8,
                                           skip_credit=4)),
    ("heads-ring4-3chunks-ragged", dict(kind="ag_heads", ring=4, dtype="float32", batch=[1], S=320, K=128,
                                        widths=[256, 128], heads=[[1, 1, 1], None], chunk_rows=16, col_tile=128,
                                        row_tile=8, skip_credit=4)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_race_detector_flags_the_streaming_kernel_with_one_credit_too_few(name, spec):
    r = run_case(spec)
    assert not r["ok"], "the race detector did not flag a streaming kernel with one credit too few"
    assert r["error_type"] == "JaxRuntimeError", r["error_type"]
    assert "RACE DETECTED" in r["error"], r["error"][-2000:]


# The streaming reduce-scatter kernel (kernels/matmul_reduce_scatter_stream.py): one call,
# each direction's partial sums in C row chunks through a window of W VMEM slots, guarded
# by credits. f32 cases exact (small integers, bit for bit against numpy and the plain
# reference). "ragged": 40-row halves in chunks of 16 (0, 16, 24; the last overlaps).
RS_STREAM_CASES = [
    ("ring4-1chunk", dict(kind="rs", ring=4, dtype="float32", batch=[], S=128, N=256, widths=[128],
                          chunk_rows=16, col_tile=128, row_tile=8), 0.0, 1),
    ("ring4-2chunks", dict(kind="rs", ring=4, dtype="float32", batch=[], S=128, N=256, widths=[128],
                           chunk_rows=8, col_tile=128, row_tile=8), 0.0, 2),
    ("ring4-3chunks-ragged-b2-2pairs-bias", dict(kind="rs", ring=4, dtype="float32", batch=[2], S=320, N=384,
                                                 widths=[128, 256], bias=True, chunk_rows=16, col_tile=128,
                                                 row_tile=8), 0.0, 3),
    ("ring2-3chunks-window2", dict(kind="rs", ring=2, dtype="float32", batch=[], S=96, N=256, widths=[128],
                                   chunk_rows=8, window=2, col_tile=128, row_tile=8), 0.0, 3),
    ("bf16-ring4-2chunks-2pairs", dict(kind="rs", ring=4, dtype="bfloat16", batch=[1], S=256, N=256,
                                       widths=[128, 128], chunk_rows=16, col_tile=128, row_tile=16), 2e-2, 2),
    ("ring4-2chunks-stacked-L3", dict(kind="rs", ring=4, dtype="float32", batch=[], S=128, N=256, widths=[128],
                                      layers=3, at=[2, 0], chunk_rows=8, col_tile=128, row_tile=8), 0.0, 2),
    # the products' one M operand (2 directions x 2 batches of 16 rows) in row tiles of 24, 24, 16
    # that straddle the segment boundaries (16, and 32 between the directions)
    ("ring4-2chunks-b2-2pairs-bias-tiles-straddle", dict(kind="rs", ring=4, dtype="float32", batch=[2], S=256,
                                                         N=256, widths=[128, 256], bias=True, chunk_rows=16,
                                                         col_tile=128, row_tile=24), 0.0, 2),
    # each pair's depth in chunks of 128 summed in f32 (k_i = 256 and 384: 2 and 3 chunks), with the
    # one-M-operand row tiles straddling the segments
    ("ring4-2chunks-b2-2pairs-depth-chunks", dict(kind="rs", ring=4, dtype="float32", batch=[2], S=256, N=256,
                                                  widths=[256, 384], bias=True, chunk_rows=16, col_tile=128,
                                                  row_tile=24, depth_tile=128), 0.0, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol,chunks", RS_STREAM_CASES, ids=[c[0] for c in RS_STREAM_CASES])
def test_streaming_matmul_reduce_scatter(name, spec, tol, chunks):
    r = check_ok(spec, tol)
    assert r["chunks"] == chunks, r["chunks"]


# One credit too few (as for the all-gather above): the send at step P, chunk 1's first
# hop, where nothing but the credit orders the receiver's use of that slot before the write.
@pytest.mark.slow
@pytest.mark.parametrize("name,spec", [
    ("ring4-2chunks", dict(kind="rs", ring=4, dtype="float32", batch=[], S=128, N=256, widths=[128],
                           chunk_rows=8, col_tile=128, row_tile=8, skip_credit=4)),
    ("ring2-3chunks-window2", dict(kind="rs", ring=2, dtype="float32", batch=[], S=96, N=256, widths=[128],
                                   chunk_rows=8, window=2, col_tile=128, row_tile=8, skip_credit=2)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_race_detector_flags_the_streaming_reduce_scatter_with_one_credit_too_few(name, spec):
    r = run_case(spec)
    assert not r["ok"], "the race detector did not flag a streaming kernel with one credit too few"
    assert r["error_type"] == "JaxRuntimeError", r["error_type"]
    assert "RACE DETECTED" in r["error"], r["error"][-2000:]


# The dispatch (collective_matmul, impl="pallas") with a chip VMEM of 8 MiB + ~0.5 MB:
# whole halves (0.56 MB of buffers) do not fit, so the kernel runs 2 chunks of 16 rows
# a half (0.38 MB).
@pytest.mark.slow
def test_dispatch_streams_when_the_halves_do_not_fit():
    r = check_ok(dict(kind="ag_dispatch", dtype="float32", batch=[2], S=256, K=128, widths=[128, 256],
                      vmem_capacity=8 * 2**20 + 500_000), 0.0)
    assert r["chunks"] == 2, r["chunks"]
    assert r["warnings"] == []


# The same for the reduce-scatter, with a chip VMEM of 8 MiB + 0.9 MB: whole-half
# accumulators (1.38 MB of buffers) do not fit, so the kernel runs 2 chunks of 16 rows
# a half (0.88 MB).
@pytest.mark.slow
def test_dispatch_streams_the_reduce_scatter_when_its_accumulators_do_not_fit():
    r = check_ok(dict(kind="rs_dispatch", dtype="float32", batch=[2], S=256, N=256, widths=[128],
                      vmem_capacity=8 * 2**20 + 900_000), 0.0)
    assert r["chunks"] == 2, r["chunks"]
    assert r["warnings"] == []
