"""The plans of both kernels: `unsupported_reason` None exactly where the kernel
runs, one sentence naming the rule otherwise; the chunks a half, the tiles and
the VMEM buffers they take. Pure shape logic, no devices."""

import jax.numpy as jnp
import pytest

from difflet_tpu.kernels import _common
from difflet_tpu.kernels import all_gather_matmul_stream as agk
from difflet_tpu.kernels import matmul_reduce_scatter_stream as rsk

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("x_shape,widths,dtype", [
    ((1184, 5120), [1280, 1280, 1280], BF16),    # Wan2.1-14B q/k/v, S = 4736 over 4
    ((1184, 5120), [3456], BF16),                # Wan FFN up
    ((2, 1152, 3072), [768, 768, 768, 3072], BF16),  # FLUX single block, batch 2
    ((16, 128), [128], F32),                     # halves of 8 rows are whole f32 tiles
])
def test_all_gather_matmul_supported(x_shape, widths, dtype):
    reason, plan = agk.plan(x_shape, widths, dtype, 4)
    assert reason is None and plan.vmem.limit <= _common.DEFAULT_VMEM_CAPACITY_BYTES


@pytest.mark.parametrize("x_shape,widths,dtype,axis_size,words", [
    ((1170, 5120), [1280], BF16, 4, "multiple of 16 rows"),   # Wan unpadded: 4680 / 4
    ((16, 128), [128], BF16, 4, "multiple of 16 rows"),       # halves of 8 rows: fine for f32, not bf16
    ((1184, 5120), [1280, 1000], BF16, 4, "multiples of 128"),
    ((1184, 5000), [1280], BF16, 4, "K = 5000"),
    ((1184, 5120), [1280], jnp.float16, 4, "float16"),
    ((1184, 5120), [1280], jnp.int8, 4, "int8"),
    ((256, 1184, 5120), [1280], BF16, 4, "VMEM budget exceeded"),  # even in 16-row chunks
    ((1184, 5120), [1280], BF16, 1, "at least 2 ranks"),
])
def test_all_gather_matmul_unsupported(x_shape, widths, dtype, axis_size, words):
    reason = agk.unsupported_reason(x_shape, widths, dtype, axis_size)
    assert reason is not None and words in reason, reason
    assert agk.plan(x_shape, widths, dtype, axis_size) == (reason, None)


@pytest.mark.parametrize("x_shapes,w_shapes,dtype", [
    ([(4736, 3456)], [(3456, 5120)], BF16),                           # Wan FFN down
    ([(4608, 768), (4608, 3072)], [(768, 3072), (3072, 3072)], BF16),  # FLUX single-block out
    ([(2, 64, 128)], [(128, 256)], F32),
])
def test_matmul_reduce_scatter_supported(x_shapes, w_shapes, dtype):
    reason, plan = rsk.plan(x_shapes, w_shapes, dtype, 4)
    assert reason is None and plan.vmem.limit <= _common.DEFAULT_VMEM_CAPACITY_BYTES


@pytest.mark.parametrize("x_shapes,w_shapes,dtype,words", [
    ([(4680, 3456)], [(3456, 5120)], BF16, "multiple of 16 rows"),
    ([(4736, 3456)], [(3456, 5000)], BF16, "N = 5000"),
    ([(4736, 3400)], [(3400, 5120)], BF16, "multiples of 128"),
    ([(4736, 128)] * 3, [(128, 512)] * 3, BF16, "one or two"),
    ([(4736, 128), (2368, 128)], [(128, 512)] * 2, BF16, "do not share"),
    ([(4736, 128), (4736, 128)], [(128, 512), (128, 256)], BF16, "do not share"),
    ([(256, 4736, 3456)], [(3456, 5120)], BF16, "VMEM budget exceeded"),  # even in 16-row chunks
    ([(4736, 3456)], [(3456, 5120)], jnp.float16, "float16"),
])
def test_matmul_reduce_scatter_unsupported(x_shapes, w_shapes, dtype, words):
    reason = rsk.unsupported_reason(x_shapes, w_shapes, dtype, 4)
    assert reason is not None and words in reason, reason
    assert rsk.plan(x_shapes, w_shapes, dtype, 4) == (reason, None)


def test_all_gather_matmul_sum_squares_plan():
    # Wan's q/k/v with biases and the sums of squares of q and k: supported; the plan
    # holds the ssq buffer [2, 2, B, 1, hc] f32 as Mosaic pads it ((1, hc) -> (8, 128k))
    # and the f32 epilogue temporaries; one flag per weight, else a reason.
    x, widths, bias = (1184, 5120), [1280] * 3, [(1, BF16)] * 3
    ssq = [True, True, False]
    reason, plan = agk.plan(x, widths, BF16, 4, biases=bias, sum_squares=ssq)
    assert reason is None
    bufs = {name: (shape, nbytes) for name, shape, _, nbytes in plan.vmem.buffers}
    assert bufs["ssq"] == ((2, 2, 1, 8, 640), 2 * 2 * 8 * 640 * 4)  # hc = 592 -> 640 lanes
    assert "f32 epilogue" in bufs
    _, base = agk.plan(x, widths, BF16, 4, biases=bias)
    assert "ssq" not in {b[0] for b in base.vmem.buffers}
    assert plan.vmem.limit <= _common.DEFAULT_VMEM_CAPACITY_BYTES
    reason = agk.unsupported_reason(x, widths, BF16, 4, sum_squares=[True])
    assert reason is not None and "sum_squares" in reason, reason


# The chunks a half the all-gather plan takes: one where the halves fit (every released
# shape but the long videos), else the fewest that fit, preferring chunks that tile the half.
@pytest.mark.parametrize("x_shape,widths,kw,chunks", [
    ((1184, 5120), [1280, 1280, 1280], {}, (1, 592)),                    # Wan 480x832x9 q/k/v
    ((8192, 5120), [1280, 1280, 1280], {}, (4, 1024)),                   # Wan 480x832x81 q/k/v
    ((8192, 5120), [1280, 1280, 1280], dict(biases=[(1, BF16)] * 3, sum_squares=[True, True, False]), (4, 1024)),
])
def test_all_gather_matmul_chunks(x_shape, widths, kw, chunks):
    # 4096-row halves: 4 chunks of 1024 rows (3 of 1376 would overlap by 32)
    reason, plan = agk.plan(x_shape, widths, BF16, 4, **kw)
    assert reason is None
    assert (plan.chunks, plan.chunk_rows, plan.overlap_rows, plan.window) == chunks + (0, 3)
    assert plan.vmem.limit <= _common.DEFAULT_VMEM_CAPACITY_BYTES


def test_stream_blocks_are_validated():
    for bad in (dict(window=1), dict(chunk_rows=0), dict(col_tile_limit=64), dict(window=2.0),
                dict(depth_tile_limit=64), dict(weights_in_vmem="yes")):
        with pytest.raises(ValueError):
            _common.StreamBlocks(**bad)
    reason = agk.unsupported_reason((8192, 5120), [1280], BF16, 4, blocks=_common.StreamBlocks(chunk_rows=1000))
    assert "multiple of 16" in reason
    reason = agk.unsupported_reason((8192, 5120), [1280], BF16, 4, blocks=_common.StreamBlocks(chunk_rows=4096))
    assert "VMEM budget exceeded" in reason
    # a chunk size asked for is kept; the last chunk shifted back to end at the half
    _, plan = agk.plan((8192, 5120), [1280], BF16, 4, blocks=_common.StreamBlocks(chunk_rows=1024, window=2))
    assert (plan.chunks, plan.window, [plan.chunk_offset(c) for c in range(4)]) == (4, 2, [0, 1024, 2048, 3072])


@pytest.mark.parametrize("x_shape,widths,blocks,held", [
    ((128, 3072), [768] * 3, {}, True),                          # FLUX text q/k/v: 128 rows a step
    ((1184, 5120), [1280] * 3, {}, False),                       # Wan q/k/v: 1184 rows a step
    ((128, 3072), [768] * 3, dict(weights_in_vmem=False), False),
    ((1184, 5120), [1280] * 3, dict(weights_in_vmem=True), True),
])
def test_streaming_all_gather_holds_the_weights_in_vmem_when_rows_are_few(x_shape, widths, blocks, held):
    reason, plan = agk.plan(x_shape, widths, BF16, 4, blocks=_common.StreamBlocks(**blocks))
    assert reason is None and plan.weights_in_vmem == held
    wbuf = {name: shape for name, shape, *_ in plan.vmem.buffers}["wbuf"]
    assert wbuf[0] == (sum(widths) // plan.col_tile if held else 2)


# The chunks a half the reduce-scatter plan takes (as the all-gather's): chunks that tile
# the half exactly, within the chip's VMEM.
@pytest.mark.parametrize("x_shapes,w_shapes,plan_want", [
    ([(4736, 1280)], [(1280, 5120)], (1, 592)),                 # Wan 480x832x9 attention out
    ([(32768, 1280)], [(1280, 5120)], (4, 1024)),               # Wan 480x832x81 attention out
    ([(75776, 3456)], [(3456, 5120)], (8, 1184)),               # Wan 720x1280x81 FFN down
])
def test_matmul_reduce_scatter_chunks(x_shapes, w_shapes, plan_want):
    reason, plan = rsk.plan(x_shapes, w_shapes, BF16, 4)
    assert reason is None
    assert (plan.chunks, plan.chunk_rows, plan.overlap_rows, plan.window) == plan_want + (0, 3)
    assert plan.vmem.limit <= _common.DEFAULT_VMEM_CAPACITY_BYTES


def test_streaming_reduce_scatter_plan_reasons():
    x, w = [(32768, 1280)], [(1280, 5120)]
    assert "multiple of 16" in rsk.unsupported_reason(x, w, BF16, 4, blocks=_common.StreamBlocks(chunk_rows=1000))
    assert "VMEM budget exceeded" in rsk.unsupported_reason(x, w, BF16, 4,
                                                            blocks=_common.StreamBlocks(chunk_rows=4096))
    assert "multiple of 128" in rsk.unsupported_reason(x, [(1280, 5100)], BF16, 4)
    assert "one or two" in rsk.unsupported_reason(x * 3, w * 3, BF16, 4)
    # a bias [N] adds its row to the plan
    _, plan = rsk.plan(x, w, BF16, 4, bias=(1, BF16))
    assert ("bbuf", (1, 5120), "bfloat16", 10240) in plan.vmem.buffers
