"""Reading a compiled program's optimized HLO text: the computations a `while` loop runs per
iteration, the instructions there that copy a cache-sized buffer, and the collectives per step.

What a decode step costs per iteration is what its loop body (and everything the body calls:
fusions, Pallas custom calls' wrappers, conditionals) executes; the instructions of the entry
computation run once per call. `loop_body_computations` follows `body=` / `calls=` /
`to_apply=` / branch references from every `while` of the module.

A "copy of a cache-sized buffer" is an instruction whose opcode materialises a new array (pad,
copy, copy-start, transpose, concatenate, reshape (a relayout; free reshapes are bitcasts), or a
fusion rooted in one of them) whose result has
a sequence-like dimension of the cache's capacity (up to one 512-slot tile more: a padded
cache) and at least the cache's elements per chip; in-place updates (dynamic-update-slice,
scatter fusions of a donated cache) are not copies, nor are weight prefetches into VMEM.
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Set

_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_REFS = re.compile(
    r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
COPY_OPS = ("pad", "copy", "copy-start", "transpose", "concatenate", "reshape")
COLLECTIVE_OPS = (
    "all-reduce",
    "all-reduce-start",
    "all-gather",
    "all-gather-start",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-permute-start",
    "collective-broadcast",
)


def computations(hlo_text: str) -> Dict[str, List[str]]:
    """{computation name: its instruction lines}; the entry computation is also "__entry__"."""
    comps: Dict[str, List[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        if name is None:
            m = _COMP_HEAD.match(line)
            if m and not line[:1].isspace() and not line.startswith("HloModule"):
                name = m.group(2)
                comps[name] = []
                if m.group(1):
                    comps["__entry__"] = comps[name]
            continue
        if line.strip() == "}":
            name = None
            continue
        comps[name].append(line)
    return comps


def _called(line: str) -> List[str]:
    out = _REFS.findall(line)
    for group in _BRANCHES.findall(line):
        out += [x.strip().lstrip("%") for x in group.split(",") if x.strip()]
    return out


_CONTROL_FLOW = ("while", "conditional", "call")


def loop_body_computations(hlo_text: str, into_fusions: bool = True) -> Set[str]:
    """Names of the computations run per iteration of any `while` loop (bodies, conditions
    and everything they call, transitively). into_fusions=False: only the control flow (loop
    bodies, conditional branches, called computations), not what fusions and other ops call."""
    comps = computations(hlo_text)
    todo = []
    for lines in comps.values():
        for line in lines:
            if re.search(r"\swhile\(", line):
                todo += re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)
    seen: Set[str] = set()
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            if not into_fusions:
                m = _INSTR.match(line)
                if not m or m.group(4) not in _CONTROL_FLOW:
                    continue
            todo += _called(line)
    return seen


_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*s32\[\][^ ]*\s+constant\((\d+)\)")


def trip_count(while_line: str, comps: Dict[str, List[str]]) -> int:
    """Iterations of a `while`: XLA's `known_trip_count`, else read from its condition when
    that is `counter < constant` (a `lax.scan` / `fori_loop` from 0, the one pattern the
    decode step's nested loops take), else 1."""
    known = _TRIP.search(while_line)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", while_line)
    lines = comps.get(cond.group(1), []) if cond else []
    consts = {m.group(1): int(m.group(2)) for m in map(_CONSTANT.match, lines) if m}
    for line in lines:
        root = re.match(r"^\s*ROOT\s.*\scompare\(([^)]*)\).*direction=LT", line)
        if root:
            operands = [o.strip().split()[-1].lstrip("%") for o in root.group(1).split(",")]
            if len(operands) == 2 and operands[1] in consts:
                return consts[operands[1]]
    return 1


def loop_body_multiplicity(hlo_text: str) -> Dict[str, int]:
    """{computation: times it runs per iteration of the outermost loop} for the control-flow
    computations of `loop_body_computations(into_fusions=False)`: an outermost `while`'s body
    and condition 1, a `while` nested in it (a `lax.scan` in the step: an EAGLE-3 drafter's K
    drafting steps) its parent's count x its `trip_count`, a
    conditional's branches and called computations their caller's."""
    comps = computations(hlo_text)
    mult: Dict[str, int] = {}

    def walk(c: str, m: int, inside: bool, stack=()) -> None:
        if c in stack or c not in comps:
            return
        if inside:
            mult[c] = max(mult.get(c, 0), m)
        for line in comps[c]:
            hit = _INSTR.match(line)
            if not hit or hit.group(4) not in _CONTROL_FLOW:
                continue
            n = m
            if hit.group(4) == "while":
                n = m * trip_count(line, comps) if inside else 1
            for callee in _called(line):
                walk(callee, n, inside or hit.group(4) == "while", stack + (c,))

    walk("__entry__", 1, False)
    for c in loop_body_computations(hlo_text, into_fusions=False):
        mult.setdefault(c, 1)  # loops not reached from the entry: once, as before
    return mult


def _elems(shape: str) -> int:
    n = 1
    for d in shape.split(","):
        if d:
            n *= int(d)
    return n


def instructions(lines: List[str]):
    """(name, result type text, opcode, rest of line) of each instruction line."""
    for line in lines:
        m = _INSTR.match(line)
        if m:
            yield m.group(2), m.group(3), m.group(4), m.group(5)


def _fusion_root_op(comps: Dict[str, List[str]], line: str) -> str:
    m = re.search(r"calls=%?([\w.\-]+)", line)
    if not m or m.group(1) not in comps:
        return ""
    for ln in comps[m.group(1)]:
        if ln.strip().startswith("ROOT"):
            im = _INSTR.match(ln)
            return im.group(4) if im else ""
    return ""


def _cache_like(result: str, capacity: int, min_elems: int) -> bool:
    for m in _ARRAY.finditer(result):
        dims = [int(d) for d in m.group(2).split(",") if d]
        n = _elems(m.group(2))
        if n >= min_elems and any(capacity <= d < capacity + 512 for d in dims):
            return True
    return False


def cache_sized_copies(
    hlo_text: str, capacity: int, min_elems: int, ops: Sequence[str] = COPY_OPS
) -> List[str]:
    """Instructions of the loop bodies that materialise a copy of a cache-sized array (see the
    module doc) by one of `ops`: "<computation>: <name> = <type> <op>(<root op>)".
    `ops=("copy-start",)` finds the VMEM round trips of whole caches (prefetched into VMEM,
    updated there, copied back; not yet removed)."""
    comps = computations(hlo_text)
    found = []
    for c in sorted(loop_body_computations(hlo_text)):
        for name, result, op, rest in instructions(comps[c]):
            kind = op
            if op == "fusion":
                kind = _fusion_root_op(comps, rest)
            if kind in ops and _cache_like(result, capacity, min_elems):
                found.append(f"{c}: {name} = {result.split('{')[0]} {op}({kind})")
    return found


def loop_collectives(hlo_text: str) -> List[Dict[str, str]]:
    """The collectives in loop bodies: [{"op", "type", "scope"}] (scope: the op_name metadata,
    e.g. "jit(decode)/while/body/verify/...")."""
    comps = computations(hlo_text)
    out = []
    for c in sorted(loop_body_computations(hlo_text)):
        for line in comps[c]:
            for name, result, op, rest in instructions([line]):
                if op in COLLECTIVE_OPS:
                    m = re.search(r'op_name="([^"]*)"', rest)
                    out.append(
                        {"op": op, "type": result.split("{")[0], "scope": m.group(1) if m else ""}
                    )
    return out
