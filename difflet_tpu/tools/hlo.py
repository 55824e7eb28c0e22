"""Reading a compiled (scheduled) HLO module's text: the instruction order of
each computation, what each fusion calls, and which async collectives have a
matmul scheduled between their start and done.

The TPU compiler prints computations in schedule order, so the ENTRY
computation's instruction list is the order the chip runs them.
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "token": 0,
}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY )?%?(?P<name>[\w.\-]+) \(.*\) -> .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<type>.+?) (?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+(?:, ?%[\w.\-]+)*)\}?")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_COST_TYPE = re.compile(r'"cost_model_type":"(\w+)"')
_OPNAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")


def array_shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in an HLO type string (tuples flattened)."""
    out = []
    for dt, dims in _ARRAY.findall(type_str):
        out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def array_bytes(dtype: str, dims) -> float:
    return _DTYPE_BYTES[dtype] * math.prod(dims)


def type_bytes(type_str: str) -> float:
    return sum(array_bytes(dt, d) for dt, d in array_shapes(type_str))


@dataclasses.dataclass
class Instr:
    name: str
    op: str
    type: str
    text: str

    @property
    def calls(self) -> list[str]:
        out = []
        for group in _CALLS.findall(self.text):
            out += [c.strip().lstrip("%") for c in group.split(",")]
        return out

    @property
    def operands(self) -> list[str]:
        args = self.text.split(self.op + "(", 1)[1]
        depth, end = 1, 0
        for end, ch in enumerate(args):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        return _OPERAND.findall(args[:end])

    @property
    def cycles(self) -> int | None:
        m = _CYCLES.search(self.text)
        return int(m.group(1)) if m else None

    @property
    def cost_type(self) -> str | None:
        m = _COST_TYPE.search(self.text)
        return m.group(1) if m else None

    @property
    def op_name(self) -> str:
        m = _OPNAME.search(self.text)
        return m.group(1) if m else ""

    @property
    def out_bytes(self) -> float:
        return type_bytes(self.type)


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str

    def __post_init__(self):
        self.index = {c: {o.name: o for o in ops} for c, ops in self.computations.items()}

    @property
    def schedule(self) -> list[Instr]:
        return self.computations[self.entry]

    def lookup(self, comp: str, name: str) -> Instr | None:
        return self.index.get(comp, {}).get(name)

    def contains(self, comp: str, pred, _seen=None) -> bool:
        _seen = set() if _seen is None else _seen
        if comp in _seen or comp not in self.computations:
            return False
        _seen.add(comp)
        return any(pred(o) or any(self.contains(c, pred, _seen) for c in o.calls)
                   for o in self.computations[comp])


def constrained_operand_shapes(ins: Instr) -> list[tuple[str, tuple[int, ...]]] | None:
    """(dtype, dims) of each operand of a custom call, in order, from its
    `operand_layout_constraints={...}` (the compiled text prints one array per
    operand there, e.g. a Pallas kernel's); None if it has none."""
    key = "operand_layout_constraints={"
    i = ins.text.find(key)
    if i < 0:
        return None
    i += len(key)
    depth, j = 1, i
    while j < len(ins.text) and depth:
        depth += ins.text[j] == "{"
        depth -= ins.text[j] == "}"
        j += 1
    return array_shapes(ins.text[i:j - 1])


def parse(text: str) -> Module:
    """Computations of an HLO module's text, instructions in schedule order.

    Instructions may span lines (Pallas kernels print multi-line attributes);
    a computation ends at a line that is exactly `}`.
    """
    comps: dict[str, list[Instr]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP_HEAD.match(line)
            if m:
                current = m.group("name")
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}" and not line.startswith(" "):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(Instr(m.group("name"), m.group("op"), m.group("type"), line))
        elif comps[current]:
            comps[current][-1].text += "\n" + line
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry)




def is_matmul_op(ins: Instr) -> bool:
    """A dot, a convolution or a Pallas TPU kernel."""
    return ins.op in ("dot", "convolution") or (
        ins.op == "custom-call" and "tpu_custom_call" in ins.text)


def contains_matmul(module: Module, comp: str) -> bool:
    """A computation (or anything it calls) has a dot/convolution or a Pallas kernel."""
    return module.contains(comp, is_matmul_op)


def is_compute(module: Module, ins: Instr) -> bool:
    """A matmul, a fusion containing one, or a Pallas kernel."""
    if is_matmul_op(ins):
        return True
    return ins.op == "fusion" and any(contains_matmul(module, c) for c in ins.calls)


def async_pairs(module: Module, kind: str = "collective-permute", comp: str | None = None):
    """(start index, done index, start instr) for each `<kind>-start` in a computation."""
    sched = module.computations[comp or module.entry]
    where = {ins.name: i for i, ins in enumerate(sched)}
    out = []
    for i, ins in enumerate(sched):
        if ins.op == f"{kind}-done":
            start = next((o for o in ins.operands if o in where), None)
            if start is not None and sched[where[start]].op == f"{kind}-start":
                out.append((where[start], i, sched[where[start]]))
    return sorted(out, key=lambda t: t[0])


def overlapped(module: Module, kind: str = "collective-permute", comp: str | None = None):
    """For each async `<kind>`: (start name, number of matmuls scheduled between start and done)."""
    sched = module.computations[comp or module.entry]
    return [(s.name, sum(is_compute(module, x) for x in sched[a + 1:b]))
            for a, b, s in async_pairs(module, kind, comp)]
