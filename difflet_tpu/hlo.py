"""Reading a compiled (scheduled) HLO module's text: the instruction order of
each computation, what each fusion calls, and which async collectives have a
matmul scheduled between their start and done.

The TPU compiler prints computations in schedule order, so the ENTRY
computation's instruction list is the order the chip runs them.
"""

from __future__ import annotations

import dataclasses
import re

_COMP = re.compile(r"^(ENTRY )?%?(?P<name>[\w.\-]+) (?:\(.*\) -> .*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<type>.+?) (?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Instr:
    name: str
    op: str
    type: str
    text: str

    @property
    def calls(self) -> list[str]:
        return _CALLS.findall(self.text)

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


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str

    @property
    def schedule(self) -> list[Instr]:
        return self.computations[self.entry]

    def contains_matmul(self, comp: str, _seen=None) -> bool:
        """A computation (or anything it calls) has a dot/convolution or a Pallas kernel."""
        _seen = set() if _seen is None else _seen
        if comp in _seen or comp not in self.computations:
            return False
        _seen.add(comp)
        for ins in self.computations[comp]:
            if is_matmul_op(ins):
                return True
            if any(self.contains_matmul(c, _seen) for c in ins.calls):
                return True
        return False

    def is_compute(self, ins: Instr) -> bool:
        """A matmul, a fusion containing one, or a Pallas kernel."""
        if is_matmul_op(ins):
            return True
        return ins.op == "fusion" and any(self.contains_matmul(c) for c in ins.calls)


def is_matmul_op(ins: Instr) -> bool:
    """A dot, a convolution or a Pallas TPU kernel."""
    return ins.op in ("dot", "convolution") or (
        ins.op == "custom-call" and "tpu_custom_call" in ins.text)


def parse(text: str) -> Module:
    """The computations of a compiled module's text, instructions in schedule order."""
    comps: dict[str, list[Instr]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m and not line.startswith(" "):
                current = m.group("name")
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.rstrip() == "}":  # a kernel's backend_config can continue on a line starting "}}"
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(Instr(m.group("name"), m.group("op"), m.group("type"), line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry)


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
    return [(s.name, sum(module.is_compute(x) for x in sched[a + 1:b]))
            for a, b, s in async_pairs(module, kind, comp)]
