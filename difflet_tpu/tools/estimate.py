"""Step-time estimate from a compiled (scheduled) TPU HLO module: an ESTIMATE.

No TPU is needed: `jax.jit(step).trace(...).lower().compile()` for a
deviceless topology (difflet_tpu.tools.deviceless) gives the scheduled HLO, and
this module replays that schedule on a simple machine model:

* one compute stream that runs the scheduled instructions in order; an XLA
  fusion advances it by its `estimated_cycles` (backend_config) at the chip
  clock; a collective-matmul kernel of kernels/ (`all_gather_matmul`,
  `matmul_reduce_scatter`) hop by hop: each of its P ring hops takes
  max(compute, transfer), compute = max(hop FLOPs / peak, hop HBM bytes / HBM
  bandwidth), transfer = the half it sends each way / link bandwidth +
  latency, and a hop's transfer beyond its compute counts as exposed transfer
  (`Simulator.collective_matmul`); another Pallas kernel (`tpu_custom_call`)
  by a roofline of its `pl.CostEstimate` (max of flops / peak, bytes / HBM
  bandwidth, remote bytes / ICI bandwidth); other array instructions (copies,
  transposes without a cycle count) by an HBM roofline of the bytes they read
  and write; scalar bookkeeping costs nothing;
* async collectives (`collective-permute-start` / `-done`,
  `all-gather-start`, `all-reduce-start`, ...) as ICI transfers that start
  when the compute stream reaches the `-start` and that the `-done` waits
  for; transfers over the same links (same source-target pairs) queue behind
  each other, the two directions of a ring run in parallel;
* synchronous collectives (`all-reduce`, `reduce-scatter`, `all-gather`,
  `collective-permute`, `all-to-all`) block the compute stream for their
  transfer time;
* async local copies (`copy-start`, `slice-start`: HBM <-> VMEM prefetches)
  as DMA transfers at HBM bandwidth on their own queue;
* `while` loops run their body once per trip (trip count read from the
  condition: `induction < constant`), `conditional` takes its costliest
  branch, `call` inlines.

Transfer times: a collective-permute of B bytes over one link takes
`B / link_bw + latency`; a ring collective over P chips (XLA runs them
bidirectionally, two links per chip) moves `(P-1)/P * B` (all-gather on its
output, reduce-scatter on its input, all-to-all) or `2 (P-1)/P * B`
(all-reduce) per chip at `2 * link_bw`, plus `latency` per ring step.

The constants (`Chip`) and their sources are documented in
docs/benchmarks.md. The compiler's `estimated_cycles` for non-matmul fusions
(`COST_MODEL_TYPE_INVALID`) are known to run high; `Calibration.nonmatmul`
scales them (one factor, fit on the reference PR's TP rows only, see
`fit_nonmatmul_scale`). Everything here is a model of the schedule, not a
measurement.

The compiled text is read with difflet_tpu.tools.hlo (the one HLO parser).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

from difflet_tpu.parallel.chips import CHIPS, DEVICE_KINDS, Chip, chip_for_device  # noqa: F401 (re-exported)
from difflet_tpu.tools.calibration import Calibration
from difflet_tpu.tools.kernel_hops import (Op, Module, array_bytes, array_shapes, constrained_operand_shapes, parse, type_bytes, _PALLAS_COST, COLLECTIVES, FREE_OPS, MATMUL_OPS, is_pallas, group_size, permute_pairs, collective_matmul_call, collective_matmul_stream_rows, collective_matmul_weights_held, collective_matmul_kind, collective_matmul_hops)

# --------------------------------------------------------------------------
# Machine constants (the chips' own: difflet_tpu.parallel.chips)
# --------------------------------------------------------------------------


def chip_for(topology: str) -> Chip:
    gen = topology.split(":", 1)[0]
    if gen not in CHIPS:
        raise ValueError(f"no chip constants for {gen!r} (topology {topology!r}); known: {sorted(CHIPS)}")
    return CHIPS[gen]


# --------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------


@dataclasses.dataclass
class CollectiveStat:
    kind: str
    count: int = 0
    bytes: float = 0.0      # bytes sent per chip, summed over executions
    overlapped: int = 0     # async executions with compute scheduled between start and done
    sync: int = 0           # executions that block the compute stream
    seconds: float = 0.0    # modelled transfer time, summed

    def to_dict(self):
        return dataclasses.asdict(self)

_SPARSE_DENSITY = re.compile(r"splash_sparse_density_([0-9.]+)")


@dataclasses.dataclass
class Estimate:
    """Modelled time of one program execution and where it goes (seconds)."""

    total: float = 0.0
    matmul: float = 0.0          # XLA fusions that contain a dot/convolution
    nonmatmul: float = 0.0       # other XLA fusions (elementwise, norms, reductions, relayouts)
    pallas: float = 0.0          # Pallas kernels (attention, collective matmuls)
    other: float = 0.0           # copies, transposes and other unfused array ops
    sync_collective: float = 0.0  # compute stream blocked in synchronous collectives
    exposed_transfer: float = 0.0  # compute stream waiting at -done of async collectives / on a kernel's hops
    exposed_dma: float = 0.0     # compute stream waiting at -done of local async copies
    invalid: float = 0.0         # unscaled time of ops the compiler prices with COST_MODEL_TYPE_INVALID
    collectives: dict = dataclasses.field(default_factory=dict)
    pallas_kernels: dict = dataclasses.field(default_factory=dict)  # name -> seconds (computing)
    # collective-matmul kernel sites (kind and shapes) -> calls, hops, hops bound by ICI,
    # and seconds of compute, of transfer and of exposed transfer (in `exposed_transfer`)
    kernel_sites: dict = dataclasses.field(default_factory=dict)
    # block-sparse splash calls (layers/sdpa.py names their scope with the share of blocks
    # computed): density -> calls
    attention_density: dict = dataclasses.field(default_factory=dict)
    warnings: list = dataclasses.field(default_factory=list)

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["collectives"] = {k: v.to_dict() for k, v in self.collectives.items()}
        return d

    @property
    def compute(self) -> float:
        return self.matmul + self.nonmatmul + self.pallas + self.other


class Simulator:
    """Walks a compiled schedule: compute advances by estimated cycles, async collectives
    run as ICI transfers their -done waits for (see docs/benchmarks.md)."""

    def __init__(self, module: Module, chip: Chip, calibration: Calibration = Calibration(),
                 num_partitions: int = 1):
        self.m = module
        self.chip = chip
        self.cal = calibration
        self.P = num_partitions
        self.t = 0.0
        self.queues: dict = collections.defaultdict(float)  # resource -> free time
        self.pending: dict = {}   # start op name -> (finish time, kind, is_collective)
        self.est = Estimate()
        self._matmul_cache: dict = {}

    # ---- costs -----------------------------------------------------------

    def fusion_has_matmul(self, o: Op) -> bool:
        key = tuple(o.calls)
        if key not in self._matmul_cache:
            self._matmul_cache[key] = any(
                self.m.contains(c, lambda x: x.op in MATMUL_OPS) for c in o.calls)
        return self._matmul_cache[key]

    def compute_cost(self, comp: str, o: Op) -> tuple[str, float]:
        """(category, seconds) of a compute-stream instruction."""
        cyc = o.cycles
        if cyc is not None:
            s = cyc / self.chip.clock_hz
            if o.op == "fusion" and self.fusion_has_matmul(o):
                return "matmul", s
            if o.cost_type == "COST_MODEL_TYPE_INVALID":
                self.est.invalid += s  # before scaling: what the calibration factor multiplies
                s *= self.cal.nonmatmul
            return ("nonmatmul" if o.op == "fusion" else "other"), s
        if is_pallas(o):
            return "pallas", self.pallas_cost(comp, o)
        if o.op in FREE_OPS or "S(6)" in o.type.split(" ")[0] or o.out_bytes <= 64:
            return "free", 0.0
        # unfused array ops without a cycle count: HBM roofline of what they read and write
        operands = [self.m.lookup(comp, n) for n in o.operands]
        if o.op == "dynamic-update-slice" and len(operands) > 1 and operands[1] is not None:
            # in place (XLA aliases the result with operand 0; a copy would be its own op):
            # the update is read and written, the rest of the buffer is not touched
            return "other", 2 * type_bytes(operands[1].type) / self.chip.hbm_bw
        in_bytes = sum(type_bytes(x.type) for x in operands if x)
        return "other", (o.out_bytes + in_bytes) / self.chip.hbm_bw

    def pallas_cost(self, comp: str, o: Op) -> float:
        m = _PALLAS_COST.search(o.text)
        name = o.op_name.rsplit("/", 2)[-2] if "/" in o.op_name else o.name
        if not m:
            s = self.attention_cost(comp, o)
            if s is None:
                self.est.warnings.append(f"Pallas kernel {name} has no cost estimate; priced by its output bytes")
                s = 2 * o.out_bytes / self.chip.hbm_bw
        else:
            flops, _, nbytes, remote = (int(g) if g else 0 for g in m.groups())
            s = max(flops / self.chip.bf16_flops, nbytes / self.chip.hbm_bw,
                    remote / (2 * self.chip.ici_link_bw) if remote else 0.0)
        self.est.pallas_kernels[name] = self.est.pallas_kernels.get(name, 0.0) + s
        return s

    def attention_cost(self, comp: str, o: Op) -> float | None:
        """jax's splash/flash attention kernels carry no CostEstimate: a roofline
        of `4 * Sq * Skv * D` per head (QK^T and PV) and q, k, v, out read once. A
        block-sparse splash call (its scope `splash_sparse_density_<d>`, layers/sdpa.py)
        computes only its active blocks, so its FLOPs are `d` times those; its bytes
        are kept (every q, k and v block is still read at least once)."""
        refs = {}
        for n in o.operands:
            for key in ("q_ref", "k_ref", "v_ref"):
                if n == key or n.endswith("." + key):
                    x = self.m.lookup(comp, n)
                    if x is not None and array_shapes(x.type):
                        refs[key] = array_shapes(x.type)[0]
        if "k_ref" not in refs and "v_ref" in refs:  # k's operand name can be lost; v has its shape
            refs["k_ref"] = refs["v_ref"]
        if ("q_ref" not in refs or "k_ref" not in refs) and any(w in o.op_name for w in ("splash", "flash", "mha")):
            # names all lost: q, k, v are the kernel's floating operands of rank >= 3, in order
            arrays = [array_shapes(x.type)[0] for x in (self.m.lookup(comp, n) for n in o.operands)
                      if x is not None and array_shapes(x.type)]
            qkv = [a for a in arrays if a[0] in ("bf16", "f32", "f16") and len(a[1]) >= 3]
            if len(qkv) >= 2:
                refs = dict(zip(("q_ref", "k_ref", "v_ref"), qkv))
        if "q_ref" not in refs or "k_ref" not in refs:
            return None
        (qdt, q), (_, k) = refs["q_ref"], refs["k_ref"]
        flops = 4 * math.prod(q[:-1]) * k[-2] * q[-1]
        sparse = _SPARSE_DENSITY.search(o.op_name or "")
        if sparse:
            d = float(sparse.group(1))
            flops *= d
            self.est.attention_density[d] = self.est.attention_density.get(d, 0) + 1
        nbytes = 2 * array_bytes(qdt, q) + sum(array_bytes(*refs[x]) for x in refs if x != "q_ref")
        return max(flops / self.chip.bf16_flops, nbytes / self.chip.hbm_bw)

    def collective_matmul(self, comp: str, o: Op, kind: str):
        """Runs a collective-matmul kernel on the compute stream hop by hop.

        Each hop takes max(compute, transfer): compute = max(its FLOPs at peak, its
        streamed HBM bytes at HBM bandwidth) -- weight tiles and products move while the
        MXU works -- and transfer = the half it sends each way over one ICI link plus the
        hop latency (both directions in parallel, each on its own link), the same price
        as a `collective-permute` of that half. So a hop's exposed transfer is
        max(0, transfer - compute), as for a JAX ring hop whose permute has that much
        compute scheduled beside it; a whole-kernel max(sum compute, sum transfer) would
        hide it whenever some hops wait and others do not (the last hop sends nothing).
        The kernel first reads its own rows into VMEM (HBM, not overlapped), and its
        first sends queue behind permutes still in flight on the links.

        Chip numbers for v5e (CHIPS): Google Cloud's "TPU v5e" page
        (https://cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16 and 819 GB/s HBM per
        chip, 400 GB/s bidirectional ICI per chip over 4 ports, i.e. 50 GB/s one way per
        link; the model's link uses 45 GB/s (docs/benchmarks.md).
        """
        c = self.chip
        shapes = constrained_operand_shapes(o)
        if shapes is None:  # older text: the operands' own types
            shapes = [array_shapes(x.type)[0] for x in (self.m.lookup(comp, n) for n in o.operands)
                      if x is not None and array_shapes(x.type)]
        hops = collective_matmul_hops(kind, shapes, array_shapes(o.type), collective_matmul_call(o)[1],
                                      collective_matmul_stream_rows(o), collective_matmul_weights_held(o))
        name = o.op_name.rsplit("/", 2)[-2] if "/" in o.op_name else kind
        if hops is None:
            self.est.warnings.append(f"{o.name}: {kind} shapes not understood; priced as a whole-kernel roofline")
            s = self.pallas_cost(comp, o)
            self.est.pallas += s
            self.t += s
            return
        prologue = hops.prologue_hbm / c.hbm_bw
        links_free = max([0.0] + [v for k, v in self.queues.items() if k != "dma"])
        queued = max(0.0, links_free - (self.t + prologue))
        compute, transfer, exposed, bound = prologue, 0.0, 0.0, 0
        for j in range(hops.P):
            busy = max(hops.flops[j] / c.bf16_flops, hops.hbm[j] / c.hbm_bw)
            x = hops.ici[j] / c.ici_link_bw + c.ici_latency if hops.ici[j] else 0.0
            wait = max(0.0, x + (queued if j == 0 else 0.0) - busy)
            compute += busy
            transfer += x
            exposed += wait
            bound += wait > 0
        self.est.pallas += compute
        self.est.exposed_transfer += exposed
        self.est.pallas_kernels[name] = self.est.pallas_kernels.get(name, 0.0) + compute
        site = self.est.kernel_sites.setdefault(
            hops.site, dict(calls=0, hops=0, ici_bound_hops=0, compute=0.0, transfer=0.0, exposed=0.0))
        site["calls"] += 1
        site["hops"] += hops.P
        site["ici_bound_hops"] += bound
        site["compute"] += compute
        site["transfer"] += transfer
        site["exposed"] += exposed
        st = self.stat(f"{kind} (kernel)")
        st.count += 1
        st.bytes += 2 * sum(hops.ici)
        st.overlapped += 1
        st.seconds += transfer
        self.t += compute + exposed

    def transfer(self, comp: str, o: Op, kind: str) -> tuple[float, float, object]:
        """(seconds, bytes sent per chip, ICI resource) of a collective."""
        c = self.chip
        P = group_size(o, self.P)
        if kind == "collective-permute":
            arrays = array_shapes(o.type)
            nbytes = array_bytes(*arrays[0]) if arrays else 0.0
            pairs = permute_pairs(o)
            return nbytes / c.ici_link_bw + c.ici_latency, nbytes, ("permute", pairs)
        if P <= 1:
            return 0.0, 0.0, ("ring",)
        out = sum(array_bytes(*a) for a in self._results(o))
        if kind == "all-reduce":
            moved, steps = 2 * (P - 1) / P * out, 2 * (P - 1)
        elif kind == "reduce-scatter":
            ins = [self.m.lookup(comp, n) for n in o.operands]
            inb = sum(type_bytes(x.type) for x in ins if x) or out * P
            moved, steps = (P - 1) / P * inb, P - 1
        else:  # all-gather, all-to-all, collective-broadcast
            moved, steps = (P - 1) / P * out, P - 1
        return moved / (2 * c.ici_link_bw) + steps * c.ici_latency, moved, ("ring",)

    @staticmethod
    def _results(o: Op) -> list:
        """The result arrays of a (possibly combined) collective: XLA's combiners give one
        op over n operands whose type holds n results; an async `-start` op's type holds
        its n operands, then its n results (an all-reduce's are the same shapes)."""
        arrays = array_shapes(o.type)
        n = max(1, len(o.operands))
        return arrays[n:2 * n] if o.op.endswith("-start") and len(arrays) >= 2 * n else arrays[:n]

    def stat(self, kind) -> CollectiveStat:
        return self.est.collectives.setdefault(kind, CollectiveStat(kind))

    # ---- the schedule ----------------------------------------------------

    def run(self, comp: str | None = None):
        comp = comp or self.m.entry
        ops = self.m.computations[comp]
        for i, o in enumerate(ops):
            self.step(comp, ops, i, o)

    def step(self, comp, ops, i, o: Op):
        op = o.op
        if op == "while":
            cond, body = self._while_parts(o)
            trips = self.trip_count(comp, o, cond)
            for _ in range(trips):
                self.run(body)
            return
        if op == "conditional":
            branches = o.calls
            best = None
            for b in branches:  # costliest branch: simulate each from the same state
                saved = (self.t, dict(self.queues), dict(self.pending), self._snapshot())
                self.run(b)
                cand = (self.t, dict(self.queues), dict(self.pending), self._snapshot())
                if best is None or cand[0] > best[0]:
                    best = cand
                self.t, self.queues, self.pending = saved[0], collections.defaultdict(float, saved[1]), saved[2]
                self._restore(saved[3])
            self.t, self.queues, self.pending = best[0], collections.defaultdict(float, best[1]), best[2]
            self._restore(best[3])
            return
        if op == "call":
            for c in o.calls:
                self.run(c)
            return
        cm = collective_matmul_kind(o)
        if cm:
            self.collective_matmul(comp, o, cm)
            return
        kind = self._collective_kind(comp, o)
        if op.endswith("-start"):
            if kind:
                dur, nbytes, res = self.transfer(comp, o, kind)
                start = max(self.t, self.queues[res])
                if res == ("ring",):  # a ring collective uses every link
                    start = max([start] + [v for k, v in self.queues.items() if k[0] == "permute"])
                finish = start + dur
                self.queues[res] = finish
                st = self.stat(kind)
                st.count += 1
                st.bytes += nbytes
                st.seconds += dur
                done_idx = next((j for j in range(i + 1, len(ops)) if o.name in ops[j].operands
                                 and ops[j].op.endswith("-done")), None)
                if done_idx is not None and any(self._is_compute(comp, x) for x in ops[i + 1:done_idx]):
                    st.overlapped += 1
                self.pending[o.name] = (finish, kind, True)
            else:  # local DMA (copy-start, slice-start, async computations)
                arrays = [a for a in array_shapes(o.type) if array_bytes(*a) > 64]
                nbytes = min((array_bytes(*a) for a in arrays), default=0.0)
                start = max(self.t, self.queues["dma"])
                finish = start + nbytes / self.chip.hbm_bw
                self.queues["dma"] = finish
                self.pending[o.name] = (finish, op, False)
            return
        if op.endswith("-done"):
            src = next((n for n in o.operands if n in self.pending), None)
            if src is None:
                # started in an earlier loop iteration (carried through the loop state):
                # priced as if it started at the top of this body
                if kind:
                    dur, nbytes, _ = self.transfer(comp, o, kind)
                    self.est.warnings.append(f"{o.name}: start not found in {comp}; transfer priced as exposed")
                    self.t += dur
                    self.est.exposed_transfer += dur
                return
            finish, k, is_coll = self.pending.pop(src)
            wait = max(0.0, finish - self.t)
            if is_coll:
                self.est.exposed_transfer += wait
            else:
                self.est.exposed_dma += wait
            self.t += wait
            return
        if kind and op in COLLECTIVES:  # synchronous collective
            dur, nbytes, res = self.transfer(comp, o, kind)
            busy = [v for k, v in self.queues.items() if k != "dma"] if res == ("ring",) else [self.queues[res]]
            start = max([self.t] + busy)
            finish = start + dur
            self.queues[res] = finish
            st = self.stat(kind)
            st.count += 1
            st.bytes += nbytes
            st.sync += 1
            st.seconds += dur
            self.est.sync_collective += finish - self.t
            self.t = finish
            return
        cat, s = self.compute_cost(comp, o)
        if cat != "free":
            setattr(self.est, cat, getattr(self.est, cat) + s)
            self.t += s

    def _snapshot(self):
        return json.dumps(self.est.to_dict(), default=str)

    def _restore(self, snap):
        d = json.loads(snap)
        cols = {k: CollectiveStat(**v) for k, v in d.pop("collectives").items()}
        self.est = Estimate(**d)
        self.est.collectives = cols

    def _collective_kind(self, comp, o: Op) -> str | None:
        base = o.op[:-6] if o.op.endswith("-start") else o.op[:-5] if o.op.endswith("-done") else o.op
        if base in COLLECTIVES:
            return base
        if base == "async":  # async-start wrapping a computation: look inside
            for c in o.calls:
                for x in self.m.computations.get(c, []):
                    if x.op in COLLECTIVES:
                        return x.op
            if o.op.endswith("-done"):
                src = next((self.m.lookup(comp, n) for n in o.operands), None)
                if src is not None:
                    return self._collective_kind(comp, src)
        return None

    def _is_compute(self, comp, o: Op) -> bool:
        if is_pallas(o) or o.op in MATMUL_OPS:
            return True
        return o.op == "fusion" and (o.cycles or 0) > 0

    def _while_parts(self, o: Op):
        cond = re.search(r"condition=%?([\w.\-]+)", o.text).group(1)
        body = re.search(r"body=%?([\w.\-]+)", o.text).group(1)
        return cond, body

    def trip_count(self, comp: str, o: Op, cond: str) -> int:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', o.text)
        if m:
            return int(m.group(1))
        ops = self.m.computations.get(cond, [])
        idx = {x.name: x for x in ops}
        root = next((x for x in ops if x.text.lstrip().startswith("ROOT")), ops[-1] if ops else None)
        trips = None
        if root is not None:
            # fused conditions: look through one fusion level
            if root.op == "fusion" and root.calls:
                inner = self.m.computations.get(root.calls[0], [])
                r2 = next((x for x in inner if x.text.lstrip().startswith("ROOT")), None)
                trips = self._compare_trips(r2, {x.name: x for x in inner}, idx, root) if r2 else None
            else:
                trips = self._compare_trips(root, idx, idx, None)
        if trips is None:
            self.est.warnings.append(f"while {o.name}: trip count unknown, counted once")
            return 1
        limit, tuple_index, direction = trips
        init = 0
        if tuple_index is not None:
            init_op = self.m.lookup(comp, o.operands[0]) if o.operands else None
            if init_op is not None and init_op.op == "tuple":
                src = self.m.lookup(comp, init_op.operands[tuple_index]) if tuple_index < len(init_op.operands) else None
                if src is not None and src.op == "constant":
                    v = re.search(r"constant\((-?\d+)\)", src.text)
                    init = int(v.group(1)) if v else 0
        n = limit - init + (1 if direction == "LE" else 0)
        return max(n, 0)

    def _compare_trips(self, root, idx, outer_idx, fusion):
        if root is None or root.op != "compare":
            return None
        d = re.search(r"direction=(\w+)", root.text)
        direction = d.group(1) if d else "LT"
        if direction not in ("LT", "LE"):
            return None
        a, b = (root.operands + [None, None])[:2]
        const = lambda n: idx.get(n) if n in idx and idx[n].op == "constant" else None
        c = const(b)
        other = a
        if c is None and fusion is not None and b in idx and idx[b].op == "parameter":
            # a fused compare whose limit is a fusion operand
            pnum = int(re.search(r"parameter\((\d+)\)", idx[b].text).group(1))
            src = outer_idx.get(fusion.operands[pnum]) if pnum < len(fusion.operands) else None
            c = src if src is not None and src.op == "constant" else None
        if c is None:
            return None
        v = re.search(r"constant\((-?\d+)\)", c.text)
        if not v:
            return None
        tuple_index = None
        src = idx.get(other)
        if src is not None and src.op == "parameter" and fusion is not None:
            pnum = int(re.search(r"parameter\((\d+)\)", src.text).group(1))
            src = outer_idx.get(fusion.operands[pnum]) if pnum < len(fusion.operands) else None
        if src is not None and src.op == "get-tuple-element":
            ti = re.search(r"index=(\d+)", src.text)
            tuple_index = int(ti.group(1)) if ti else None
        return int(v.group(1)), tuple_index, direction


def num_partitions(text: str) -> int:
    m = re.search(r"num_partitions=(\d+)", text[:4000])
    return int(m.group(1)) if m else 1


def estimate(hlo_text: str, chip: Chip | str = "v5e", calibration: Calibration = Calibration()) -> Estimate:
    """Replays a compiled module's schedule on the machine model (see module doc)."""
    chip = CHIPS[chip] if isinstance(chip, str) else chip
    sim = Simulator(parse(hlo_text), chip, calibration, num_partitions(hlo_text))
    sim.run()
    # transfers still in flight at the end of the program finish before it returns
    tail = max([sim.t] + [f for f, _, _ in sim.pending.values()])
    sim.est.exposed_transfer += tail - sim.t
    sim.est.total = tail
    sim.est.warnings = sorted(set(sim.est.warnings))[:20]
    return sim.est


# --------------------------------------------------------------------------
# Static facts of a compiled step: overlap as scheduled
# --------------------------------------------------------------------------


def schedule_overlap(hlo_text: str) -> dict:
    """Per collective kind: async pairs in the static schedule and how many
    have compute scheduled between start and done (not multiplied by trip counts)."""
    m = parse(hlo_text)
    sim = Simulator(m, CHIPS["v5e"])
    out = collections.defaultdict(lambda: [0, 0])
    for comp, ops in m.computations.items():
        names = {o.name: i for i, o in enumerate(ops)}
        for j, o in enumerate(ops):
            if not o.op.endswith("-done"):
                continue
            kind = sim._collective_kind(comp, o)
            if not kind:
                continue
            src = next((n for n in o.operands if n in names), None)
            if src is None:
                continue
            i = names[src]
            out[kind][0] += 1
            out[kind][1] += any(sim._is_compute(comp, x) for x in ops[i + 1:j])
    return {k: dict(pairs=v[0], overlapped=v[1]) for k, v in out.items()}


def summarize(est: Estimate) -> dict:
    """A compact dict of an estimate in milliseconds (for tables and JSON)."""
    ms = lambda s: round(1e3 * s, 3)
    return dict(
        step_ms=ms(est.total), matmul_ms=ms(est.matmul), nonmatmul_ms=ms(est.nonmatmul),
        pallas_ms=ms(est.pallas), other_ms=ms(est.other), sync_collective_ms=ms(est.sync_collective),
        exposed_transfer_ms=ms(est.exposed_transfer), exposed_dma_ms=ms(est.exposed_dma),
        invalid_unscaled_ms=ms(est.invalid),
        pallas_kernels_ms={k: ms(v) for k, v in sorted(est.pallas_kernels.items())},
        kernel_sites={k: dict(calls=v["calls"], hops=v["hops"], ici_bound_hops=v["ici_bound_hops"],
                              compute_ms=ms(v["compute"]), transfer_ms=ms(v["transfer"]),
                              exposed_ms=ms(v["exposed"]))
                      for k, v in sorted(est.kernel_sites.items())},
        collectives={k: dict(count=v.count, bytes_per_chip=int(v.bytes), overlapped=v.overlapped,
                             sync=v.sync, transfer_ms=ms(v.seconds))
                     for k, v in sorted(est.collectives.items())},
        **({"attention_density": {str(k): v for k, v in sorted(est.attention_density.items())}}
           if est.attention_density else {}),
        warnings=list(est.warnings),
    )
