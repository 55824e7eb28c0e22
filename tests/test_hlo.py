"""difflet_tpu.tools.hlo on a hand-written scheduled module."""

from difflet_tpu.tools import hlo

TEXT = """HloModule m

%fused_dot (p0: bf16[8,128], p1: bf16[128,128]) -> bf16[8,128] {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %p1 = bf16[128,128]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[8,128]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

ENTRY %main (a: bf16[8,128], w: bf16[128,128]) -> bf16[8,128] {
  %a = bf16[8,128]{1,0} parameter(0)
  %w = bf16[128,128]{1,0} parameter(1)
  %custom-call.3 = bf16[8,128]{1,0} custom-call(%a, %w), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "x"
}}, metadata={op_name="pallas_call"}
  %collective-permute-start = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) collective-permute-start(%custom-call.3), source_target_pairs={{0,1},{1,0}}
  %fusion.7 = bf16[8,128]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_dot
  %collective-permute-done = bf16[8,128]{1,0} collective-permute-done(%collective-permute-start)
  %collective-permute-start.1 = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %collective-permute-done.1 = bf16[8,128]{1,0} collective-permute-done(%collective-permute-start.1)
  ROOT %add = bf16[8,128]{1,0} add(%collective-permute-done, %collective-permute-done.1)
}
"""


def test_schedule_survives_multiline_kernel_configs():
    m = hlo.parse(TEXT)
    ops = [i.op for i in m.schedule]
    assert ops[-1] == "add" and "custom-call" in ops  # nothing after the kernel was dropped
    assert hlo.is_compute(m, m.schedule[ops.index("custom-call")])  # a Pallas kernel is compute


def test_overlap_counts_matmuls_between_start_and_done():
    m = hlo.parse(TEXT)
    assert hlo.overlapped(m) == [("collective-permute-start", 1), ("collective-permute-start.1", 0)]
