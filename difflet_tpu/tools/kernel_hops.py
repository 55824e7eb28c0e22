"""Reading a compiled schedule's ops for the estimate: which are collectives, which
are Pallas kernels, and what one collective-matmul kernel call costs hop by hop.

`collective_matmul_hops` prices one call of the streaming all-gather + matmul or
matmul + reduce-scatter kernel (kernels/) from its operands: P ring hops, each
max(compute, transfer) (docs/benchmarks.md, "The estimate: model, constants, sources").
"""

from __future__ import annotations

import dataclasses
import math
import re

# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------

from difflet_tpu.tools.hlo import (Instr as Op, Module, array_bytes, array_shapes,  # noqa: F401
                             constrained_operand_shapes, parse, type_bytes)

# Attributes only the estimate reads.
_PALLAS_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"(\d+)","bytes_accessed":"(\d+)"'
                          r'(?:,"remote_bytes_transferred":"(\d+)")?')
_PAIRS = re.compile(r"source_target_pairs=\{([\d,{} ]*)\}")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:\s*\{([^}]*)\})?")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]+)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")

# --------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "collective-broadcast")
FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
            "replica-id", "after-all", "opt-barrier", "iota", "add-dependency", "domain"}
MATMUL_OPS = ("dot", "convolution")


def is_pallas(o: Op) -> bool:
    return o.op == "custom-call" and "tpu_custom_call" in o.text


def group_size(o: Op, default: int) -> int:
    """Participants of a collective, from its replica_groups."""
    m = _GROUPS_MESH.search(o.text)
    if m:  # mesh['cfg'=2,'tp'=4] {'tp'}: a group spans the axes in braces (all of them without)
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'(\w+)'", m.group(2)) if m.group(2) else list(sizes)
        return math.prod(int(sizes[a]) for a in axes if a in sizes) or default
    m = _GROUPS_LIST.search(o.text)
    if m:
        return len(m.group(1).split(","))
    m = _GROUPS_IOTA.search(o.text)
    if m:
        return int(m.group(2))
    return default


def permute_pairs(o: Op) -> tuple:
    m = _PAIRS.search(o.text)
    if not m:
        return ()
    return tuple(sorted(tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", m.group(0))))


# --------------------------------------------------------------------------
# Collective-matmul kernels, hop by hop
# --------------------------------------------------------------------------

COLLECTIVE_MATMUL_KERNELS = ("all_gather_matmul", "matmul_reduce_scatter")
_FLOAT_DTYPES = ("bf16", "f32", "f16")


_KERNEL_NAME = re.compile(r"(?:^|/)(" + "|".join(COLLECTIVE_MATMUL_KERNELS)
                          + r")_stream_(\d+)chunks_(\d+)rows(_wvmem)?(?:$|/)")


def _kernel_name(o: Op):
    """The `_KERNEL_NAME` match of a collective-matmul kernel call (its instruction
    name or op_name, from `pallas_call(name=...)`: "<kind>_stream_<C>chunks_<hc>rows",
    "_wvmem" when an all-gather holds its weights in VMEM), else None."""
    if not is_pallas(o):
        return None
    for name in (o.name.split(".")[0], o.op_name):
        m = _KERNEL_NAME.search(name)
        if m:
            return m
    return None


def collective_matmul_call(o: Op) -> tuple[str, int] | None:
    """(kind, chunks C) for a call of a collective-matmul kernel of kernels/
    ("all_gather_matmul" / "matmul_reduce_scatter"), else None."""
    m = _kernel_name(o)
    return None if m is None else (m.group(1), int(m.group(2)))


def collective_matmul_stream_rows(o: Op) -> int | None:
    """The chunk rows hc of a collective-matmul kernel call, else None."""
    m = _kernel_name(o)
    return None if m is None else int(m.group(3))


def collective_matmul_weights_held(o: Op) -> bool:
    """True for an all-gather call that holds its weights in VMEM ("..._wvmem": read
    from HBM once a call, not once a step; kernels/all_gather_matmul_stream/)."""
    m = _kernel_name(o)
    return m is not None and bool(m.group(4))


def collective_matmul_kind(o: Op) -> str | None:
    """"all_gather_matmul" / "matmul_reduce_scatter" for the Pallas kernels of kernels/, else None."""
    call = collective_matmul_call(o)
    return None if call is None else call[0]


@dataclasses.dataclass(frozen=True)
class KernelHops:
    """One collective-matmul kernel call as its ring hops (per chip; hop j = 0..P-1).

    flops[j]: the MXU work of hop j (both halves); hbm[j]: the HBM bytes streamed
    during hop j (weight tiles, products / next rows); ici[j]: bytes sent at hop j
    in EACH direction (one half, over one link; the two directions use different
    links and run in parallel), 0 at the last hop; prologue_hbm: bytes read before
    hop 0 can compute (this rank's rows into VMEM)."""

    kind: str
    site: str
    P: int
    flops: tuple
    hbm: tuple
    ici: tuple
    prologue_hbm: float


def collective_matmul_hops(kind: str, operands: list, outputs: list, chunks: int = 1,
                           stream_rows: int | None = None, weights_held: bool = False) -> KernelHops | None:
    """The steps ("hops") of kernels/all_gather_matmul_stream/ or
    kernels/matmul_reduce_scatter_stream.py from the call's operand and result
    shapes ((dtype, dims) each, as the compiled text prints them) and its name's
    C = `chunks` chunks of hc = `stream_rows` rows a half (None: one chunk a half,
    hc = s/2); None if they do not look like that kernel's. The P C steps are the
    "hops" (P of the result counts them); the FLOPs and HBM bytes over all of them
    are the kernels' own `pl.CostEstimate`.

    all-gather + matmul: x [B, s, K], w_i [K, n_i] (, bias_i) -> out_i [B, S, n_i] (or head-major
      [B, n_i / D, S, D]), P = S / s.
      Each step multiplies 2 hc rows by every weight, streams every weight once
      (at step 0 only when `weights_held`, "..._wvmem") and writes 2 hc rows of
      products; it sends hc rows each way, except at a chunk's last hop (j = P-1),
      which instead loads the next own chunk (2 hc rows of x). The prologue is the
      first chunk's 2 hc rows. Bias operands (after the weights) are read once per
      call, a few KiB, and not priced; nor is the epilogue's VPU/EUP work (bias, GELU,
      the head-major epilogue's norm, RoPE and scale), nor its RoPE rows (2 hc x D
      float32 a step), nor the rows' sums of squares (small f32 results).
    matmul + reduce-scatter: x_i [B, S, k_i], w_i [k_i, N] (, bias) -> out [B, s, N], P = S / s.
      Each step multiplies 2 hc rows by every weight, adds the sums that arrived,
      streams every weight once and the next step's 2 hc rows of x, and sends hc
      rows x N of sums each way, except at a chunk's last hop, which writes its
      2 hc rows of out instead; the prologue is step 0's rows.
    A weight may come stacked, [L, K, n_i] / [L, k_i, N] (a block scan's layers,
    the layer index a scalar operand): the kernel reads one layer, priced as above.
    """
    floats = [(dt, d) for dt, d in operands if dt in _FLOAT_DTYPES]
    layer = lambda w: w[1:] if len(w) == 3 else w  # a stacked weight's one layer
    outs = [(dt, d) for dt, d in outputs if dt in _FLOAT_DTYPES]
    if not floats or not outs:
        return None
    dt = floats[0][0]
    isz = array_bytes(dt, (1,))
    C = chunks
    last = lambda t: t % P == P - 1
    if kind == "all_gather_matmul":
        # operands x, w_1..w_m, then the epilogue's biases (norm weights, RoPE tables): one weight
        # per product output, [B, S, n_i] or head-major [B, n_i / D, S, D] (not the sums of
        # squares, [B, 2 P C, 1, hc])
        outs = [o for o in outs if len(o[1]) == 3 or (len(o[1]) == 4 and o[1][2] != 1)]
        (_, x), ws = floats[0], [layer(d) for _, d in floats[1:1 + len(outs)]]
        if len(x) != 3 or not ws or any(len(w) != 2 or w[0] != x[2] for w in ws):
            return None
        B, s, K = x
        S = outs[0][1][-2]
        if s <= 0 or S % s:
            return None
        P, n = S // s, sum(w[1] for w in ws)
        hc = stream_rows or s // 2
        T = P * C
        flops = (2 * B * 2 * hc * K * n,) * T
        hbm = tuple(isz * ((K * n if t == 0 or not weights_held else 0) + B * 2 * hc * n
                           + (B * 2 * hc * K if last(t) and t + 1 < T else 0)) for t in range(T))
        ici = tuple(0.0 if last(t) else isz * B * hc * K for t in range(T))
        site = (f"all_gather_matmul x[{B},{s},{K}] -> n={'+'.join(str(w[1]) for w in ws)} (P={P}"
                + (f", streaming {C} chunks of {hc} rows" if C > 1 else "")
                + (", weights in VMEM" if weights_held else "") + ")")
        return KernelHops(kind, site, T, flops, hbm, ici, isz * B * 2 * hc * K)
    if kind == "matmul_reduce_scatter":
        if len(floats) % 2 and len(floats[-1][1]) in (1, 2) and floats[-1][1][-1] == outs[0][1][-1]:
            floats = floats[:-1]  # a bias ([N] or [L, N]): a few KiB, not priced
        if len(floats) % 2:
            return None
        npairs = len(floats) // 2
        xs, ws = [d for _, d in floats[:npairs]], [layer(d) for _, d in floats[npairs:]]
        if any(len(x) != 3 or len(w) != 2 or x[2] != w[0] for x, w in zip(xs, ws)):
            return None
        B, S, _ = xs[0]
        N, s = ws[0][1], outs[0][1][-2]
        if s <= 0 or S % s:
            return None
        P, k = S // s, sum(x[2] for x in xs)
        hc = stream_rows or s // 2
        T = P * C
        flops = tuple(2 * B * 2 * hc * k * N + B * 2 * hc * N * (npairs - 1) + (B * 2 * hc * N if t % P else 0)
                      for t in range(T))
        hbm = tuple(isz * (k * N + (B * 2 * hc * k if t + 1 < T else 0) + (B * 2 * hc * N if last(t) else 0))
                    for t in range(T))
        ici = tuple(0.0 if last(t) else isz * B * hc * N for t in range(T))
        site = (f"matmul_reduce_scatter x[{B},{S},{'+'.join(str(x[2]) for x in xs)}] -> N={N} (P={P}"
                + (f", streaming {C} chunks of {hc} rows" if C > 1 else "") + ")")
        return KernelHops(kind, site, T, flops, hbm, ici, isz * B * 2 * hc * k)
    return None
