"""Both collective-matmul kernels in TPU interpret mode on 4 CPU devices, race
detector on, against numpy; the racy variant (one receive slot too few) must be
flagged; the dispatch in difflet_tpu.collective_matmul must use the kernel when
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
AG_CASES = [
    ("f32-1w-nobatch", dict(dtype="float32", batch=[], S=128, K=128, widths=[256], col_tile=128, row_tile=8), 0.0),
    ("f32-2w-b2", dict(dtype="float32", batch=[2], S=128, K=256, widths=[128, 384], col_tile=128, row_tile=8), 0.0),
    ("bf16-3w-b1", dict(dtype="bfloat16", batch=[1], S=256, K=128, widths=[128, 256, 128], col_tile=128,
                        row_tile=16), 1e-2),
    ("bf16-4w-b2", dict(dtype="bfloat16", batch=[2], S=256, K=128, widths=[128, 256, 384, 128], col_tile=128,
                        row_tile=16), 1e-2),
    ("f32-2w-default-tiles", dict(dtype="float32", batch=[1], S=64, K=128, widths=[256, 512]), 0.0),
]

RS_CASES = [
    ("f32-1p-nobatch", dict(dtype="float32", batch=[], S=128, N=256, widths=[128], col_tile=128, row_tile=8), 0.0),
    ("f32-2p-b2", dict(dtype="float32", batch=[2], S=128, N=384, widths=[128, 256], col_tile=128, row_tile=8), 0.0),
    ("bf16-1p-b2", dict(dtype="bfloat16", batch=[2], S=256, N=256, widths=[256], col_tile=128, row_tile=16), 2e-2),
    ("bf16-2p-b1", dict(dtype="bfloat16", batch=[1], S=256, N=384, widths=[128, 128], col_tile=128,
                        row_tile=16), 2e-2),
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


# Row-chunked calls (long sequences: each call holds one chunk of every rank's rows in
# VMEM, writing its rows of the one output buffer, aliased from call to call).
RS_CHUNK_CASES = [
    ("f32-1p-2chunks", dict(dtype="float32", batch=[], S=256, N=256, widths=[128], col_tile=128, row_tile=8,
                            chunks=2), 0.0),
    ("f32-2p-b2-3chunks-uneven", dict(dtype="float32", batch=[2], S=320, N=256, widths=[128, 256],
                                      col_tile=128, row_tile=8, chunks=3), 0.0),  # 80 rows: 32+32+16
    ("bf16-1p-2chunks-L3", dict(dtype="bfloat16", batch=[1], S=512, N=256, widths=[256], col_tile=128,
                                row_tile=16, chunks=2, layers=3, at=[2, 0]), 2e-2),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,tol", RS_CHUNK_CASES, ids=[c[0] for c in RS_CHUNK_CASES])
def test_matmul_reduce_scatter_row_chunks(name, spec, tol):
    check_ok(dict(kind="rs", **spec), tol)


@pytest.mark.slow
def test_race_detector_flags_chunked_calls_with_one_receive_slot_too_few():
    r = run_case(dict(kind="rs", dtype="float32", batch=[], S=256, N=256, widths=[128], col_tile=128, row_tile=8,
                      chunks=2, slots=2))
    assert not r["ok"], "the race detector did not flag a chunked kernel with one receive slot too few"
    assert "RACE DETECTED" in r["error"], r["error"][-2000:]


# Stacked weights [L, ...] read at a runtime layer index (a block scan's), first,
# middle and last layer; float32 exact. Directly and through the dispatch
# (LayerWeight).
STACKED_CASES = [
    ("ag-3w-L3", dict(kind="ag", dtype="float32", batch=[1], S=128, K=128, widths=[128, 256, 128], layers=3,
                      at=[0, 1, 2], col_tile=128, row_tile=8)),
    ("ag-dispatch-L4", dict(kind="ag_dispatch", dtype="float32", batch=[], S=64, K=128, widths=[128, 256],
                            layers=4, at=[3, 0])),
    ("rs-2p-L3", dict(kind="rs", dtype="float32", batch=[1], S=128, N=256, widths=[128, 256], layers=3,
                      at=[0, 1, 2], col_tile=128, row_tile=8)),
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
    ("ag", dict(dtype="float32", batch=[], S=128, K=128, widths=[256], col_tile=128, row_tile=8)),
    ("rs", dict(dtype="float32", batch=[], S=128, N=256, widths=[128], col_tile=128, row_tile=8)),
])
def test_race_detector_flags_one_receive_slot_too_few(kind, spec):
    # The same case passes with the default 3 slots (above); with 2, a neighbour
    # running ahead overwrites a slot still being read, and the detector must say so.
    r = run_case(dict(kind=kind, slots=2, **spec))
    assert not r["ok"], "the race detector did not flag a kernel with one receive slot too few"
    assert r["error_type"] == "JaxRuntimeError", r["error_type"]
    assert "RACE DETECTED" in r["error"], r["error"][-2000:]


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
    ("f32-bias-gelu-2w", dict(dtype="float32", batch=[1], S=128, K=128, widths=[128, 256], bias=[True, True],
                              act=[None, "gelu_tanh"], col_tile=128, row_tile=8), 1e-6, 0.0),
    ("f32-gelu-nobias", dict(dtype="float32", batch=[], S=64, K=128, widths=[256], bias=[False],
                             act=["gelu_tanh"]), 1e-6, 0.0),
    # stacked [L, K, n] weights and [L, n] biases at several runtime layer indices
    ("f32-stacked-L3", dict(dtype="float32", batch=[], S=128, K=128, widths=[128, 256, 128],
                            bias=[True, False, True], act=["gelu_tanh", None, "gelu_tanh"], layers=3, at=[0, 1, 2],
                            col_tile=128, row_tile=8), 1e-6, 0.0),
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


@pytest.mark.slow
def test_race_detector_flags_the_fused_epilogue_kernel_with_one_slot_too_few():
    r = run_case(dict(kind="ag_epi", slots=2, dtype="float32", batch=[], S=128, K=128, widths=[256], bias=[True],
                      act=["gelu_tanh"], col_tile=128, row_tile=8))
    assert not r["ok"], "the race detector did not flag the epilogue kernel with one receive slot too few"
    assert "RACE DETECTED" in r["error"], r["error"][-2000:]
