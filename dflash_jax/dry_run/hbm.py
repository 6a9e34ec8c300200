"""The HBM model of a decode step: what one step must read and write (the floor, analytic) and
what the compiled step reads and writes in HBM (counted in the optimized HLO of its loop body).

Why not the cost analysis: XLA's `bytes accessed` counts VMEM prefetch copies and reads from VMEM
as traffic, so a 16-row matmul is counted at several times its weights while a 1-row one is
counted once, which inflates DFlash's 16-row draft and verify against AR's 1-row step.

**The compiled count** (`hbm_traffic`). The instructions run per iteration of the decode
`while` loop (its body and the control flow it calls, not the inside of fusions, which runs
out of registers and VMEM) are walked once: one iteration is one decode step; a loop nested in
the step (an EAGLE-3 drafter's K drafting steps, a `lax.scan`) is walked once and charged its
`known_trip_count` times (`hlo.loop_body_multiplicity`). Each instruction is charged the bytes of its operands and results that live in HBM (memory space 0: a TPU
layout without `S(n)`, n >= 1; `S(1)` is VMEM), with these rules:
- no traffic: parameter, get-tuple-element, tuple, bitcast, constant, the `-done` halves of
  async pairs, and the control-flow ops themselves (their computations are walked instead);
- a fusion's operand that the fused computation only slices (`slice`, `dynamic-slice`,
  `gather`, directly, through a bitcast view, or inside a nested fusion: a scanned layer's
  slice of the stacked weights, a cache [B,S,K*D] viewed as [B,S,K,D] and sliced to the block)
  is charged the slices' sizes, not the whole array;
- an in-place update (a fusion rooted in `dynamic-update-slice` or `scatter` whose updated
  array is a fusion parameter, the loop-carried cache) is charged the update written (and its
  operands read), not the array;
- a Pallas kernel (`custom-call`) is charged every HBM operand and result at full size, except
  an output aliased to an input (`output_to_operand_aliasing`: the DMA cache-write kernel writes
  its new rows into the aliased cache): that pair is charged nothing and the kernel's other
  operands (the rows) are charged once. So a decode-attention kernel's cache operand is charged
  at the cache's capacity, an upper bound on what it reads (the filled prefix);
- except a kernel named in `DECLARED_BYTES_KERNELS`, which reads only part of an operand by
  design (the routed grouped matmul: the weights of at most min(E, M) experts of [E, K, N]; the
  decode attention over a scanned stack's cache [L, ...]: one layer, picked by its index maps) and
  declares the bytes of the grid it runs in its cost estimate (derived from that grid, held
  against its index maps' DMAs in tests/test_grouped_matmul.py): it is charged the declared
  `bytes_accessed` (never more than its operands and results). Given `routed_share` (a MoE
  step: the expected share of the experts its tokens route to, `routed_fraction`, the floor's
  statistic), the routed kernel's weight part, declared for its A = min(E, M) slots (a bound:
  the experts it can fetch), is charged at the experts it fetches on average instead: it
  fetches the blocks of the experts with rows only (the tail slots repeat a block, no DMA),
  so share x E of a chip's E experts; the bound stays in `hbm_bytes_bound`;
- `copy-start` (an asynchronous copy: HBM <-> VMEM) is charged its source and destination
  where they are in HBM: a prefetch of a whole cache into VMEM shows here at the cache's size;
  `slice-start` (an asynchronous slice: weights streamed into VMEM piece by piece) its slice.
What the count is not: the compiler's own schedule (prefetched weights are charged once, as
they are read once), HBM traffic inside a Pallas kernel that the HLO cannot see beyond its
operands, or any cache effect. It is a count of the program's HBM operands, for comparing
programs with each other and with the floor; tested on single-op programs whose traffic is
known (tests/test_tpu_compile.py).

**The floor** (`floor_bytes`), per chip per step: the target's weights once (the embedding
table, read by row, excluded; the LM head counted separately; a MoE target's experts at the
share its step's tokens route to, `routed_fraction`), the LM head once for the verify
plus once per drafter pass, the drafter's weights once per pass, the KV cache read over the
filled prefix (context tokens, not the capacity) and the new rows written, and the drafter's
context K/V likewise (read per pass, block rows written).
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Tuple

from dflash_jax.dry_run.compiled import _DTYPE_BYTES
from dflash_jax.dry_run.hlo import (
    _INSTR,
    computations,
    loop_body_computations,
    loop_body_multiplicity,
    trip_count,
)

# One array type with its layout: bf16[1,34304,128]{2,1,0:T(8,128)(2,1)S(1)}
_TYPED = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
_NO_TRAFFIC = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "copy-done",
    "slice-done",
    "all-gather-done",
    "all-reduce-done",
    "collective-permute-done",
    "send-done",
    "recv-done",
    "async-done",
    "while",
    "conditional",
    "call",
}
_SLICING = ("slice", "dynamic-slice", "gather")
# Pallas kernels charged the bytes their cost estimate declares (module doc).
DECLARED_BYTES_KERNELS = ("dflash_routed_gmm", "dflash_decode_attention_tpu_stacked")
_DECLARED = re.compile(r'"cost_estimate":\{[^}]*"bytes_accessed":"?(\d+)')
_IN_PLACE = ("dynamic-update-slice", "scatter")


def _array_bytes(type_text: str, hbm_only: bool = True) -> List[int]:
    """Sizes of the array types in `type_text` (a tuple gives several), HBM-resident only."""
    out = []
    for dt, dims, layout in _TYPED.findall(type_text):
        if hbm_only and layout and re.search(r"S\(([1-9]\d*)\)", layout):
            continue
        out.append(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt])
    return out


def _operands(rest: str) -> List[str]:
    """Operand names of an instruction (the text after its opcode's parenthesis)."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return re.findall(r"%([\w.\-]+)", rest[: i - 1])


def _types(lines: List[str]) -> Dict[str, str]:
    """{instruction name: its result type text} of a computation (parameters included)."""
    out = {}
    for line in lines:
        m = _INSTR.match(line)
        if m:
            out[m.group(2)] = m.group(3)
    return out


class _Fused:
    """What a fused computation does with each parameter: the bytes it slices out of it (None:
    used whole) and, for an in-place update of parameter p, (p, update bytes)."""

    def __init__(self, lines: List[str], comps: Optional[Dict[str, List[str]]] = None):
        types = _types(lines)
        params: Dict[int, str] = {}
        uses: Dict[str, List[Tuple[str, str, str, List[str], str]]] = {}
        root = None
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, rtype, op, rest = m.group(2), m.group(3), m.group(4), m.group(5)
            if op == "parameter":
                params[int(re.match(r"(\d+)", rest).group(1))] = name
            ops = _operands(rest)
            for o in ops:
                uses.setdefault(o, []).append((name, op, rtype, ops, rest))
            if m.group(1):
                root = (name, op, ops)

        def sliced_out(p) -> Optional[int]:
            """The bytes the uses of `p` slice out of it (None: some use reads it whole)."""
            u = [slices(p, *use) for use in uses.get(p, [])]
            return sum(u) if u and all(x is not None for x in u) else None

        def slices(p, name, op, rtype, ops, rest) -> Optional[int]:
            """The bytes one use of parameter `p` slices out of it (None: used whole). A
            bitcast (a view of the same bytes: a cache [B,S,K*D] seen as [B,S,K,D]) slices
            what its own uses slice. A nested fusion that only slices its own parameter (a
            scanned layer's weights: `dynamic-slice` of the stack inside the dot's operand
            fusion) slices this one."""
            if op in _SLICING and ops[0] == p:
                return sum(_array_bytes(rtype, False))
            if op == "bitcast" and ops == [p]:
                return sliced_out(name)
            if op == "fusion" and comps is not None:
                fm = re.search(r"calls=%?([\w.\-]+)", rest)
                if fm and fm.group(1) in comps:
                    inner = _Fused(comps[fm.group(1)], comps)
                    got = [inner.sliced.get(j) for j, o in enumerate(ops) if o == p]
                    if got and all(g is not None for g in got):
                        return sum(got)
            return None

        self.sliced = {i: sliced_out(p) for i, p in params.items()}
        self.in_place: Optional[Tuple[int, int]] = None
        if root and root[1] in _IN_PLACE and root[2]:
            target = root[2][0]
            idx = [i for i, p in params.items() if p == target]
            upd = root[2][1] if root[1] == "dynamic-update-slice" else root[2][-1]
            if idx and upd in types:
                self.in_place = (idx[0], sum(_array_bytes(types[upd], False)))


def _scope(rest: str) -> str:
    m = re.search(r'op_name="([^"]*)"', rest)
    return m.group(1) if m else ""


def _routed_expected(ops: List[str], types: Dict[str, str], declared: int, share: float) -> int:
    """A routed grouped-matmul call's bytes with its weight part at the experts it fetches on
    average (share x E) instead of its A slots: operands (offsets [E + 1], ids [A], count,
    [layer], rows, weights [.., E, K, N]), so one expert's weights are the weights operand's
    bytes over E (over L x E for a stack of L layers)."""
    dims = [_TYPED.search(types.get(o, "")) for o in ops]
    shape = lambda d: [int(x) for x in d.group(2).split(",") if x] if d else []  # noqa: E731
    if len(dims) < 5 or len(shape(dims[0])) != 1 or len(shape(dims[1])) != 1:
        return declared
    e, slots = shape(dims[0])[0] - 1, shape(dims[1])[0]
    weights = shape(dims[-1])
    if e <= 0 or len(weights) < 3 or weights[-3] != e:
        return declared
    expert = math.prod(weights[-3:]) // e * _DTYPE_BYTES[dims[-1].group(1)]
    return max(0, int(round(declared - (slots - share * e) * expert)))


def hbm_traffic(
    hlo_text: str, top: int = 12, routed_share: Optional[float] = None
) -> Dict[str, Any]:
    """HBM bytes one iteration of the program's decode loop reads and writes (module doc).
    Returns {"hbm_bytes", "by_op": {opcode: bytes}, "top_ops": [{"name", "op", "bytes",
    "type", "scope"}] (the `top` largest instructions)}; with `routed_share`, the routed
    grouped-matmul kernels at the experts they fetch on average (module doc) and
    "hbm_bytes_bound", the count with their declared bound."""
    comps = computations(hlo_text)
    fused: Dict[str, _Fused] = {}
    rows = []
    over_bound = 0  # bytes the declared bounds of routed kernels exceed their expected reads
    times = loop_body_multiplicity(hlo_text)
    for c in sorted(times):
        types = _types(comps[c])
        for line in comps[c]:
            m = _INSTR.match(line)
            if not m:
                continue
            name, rtype, op, rest = m.group(2), m.group(3), m.group(4), m.group(5)
            if op in _NO_TRAFFIC:
                continue
            ops = _operands(rest)
            reads = [sum(_array_bytes(types.get(o, ""))) for o in ops]
            writes = sum(_array_bytes(rtype))
            kind = op
            if op == "fusion":
                fm = re.search(r"calls=%?([\w.\-]+)", rest)
                f = fused.get(fm.group(1)) if fm else None
                if f is None and fm and fm.group(1) in comps:
                    f = fused[fm.group(1)] = _Fused(comps[fm.group(1)], comps)
                if f is not None:
                    for i, sliced in f.sliced.items():
                        if sliced is not None and i < len(reads) and reads[i]:
                            reads[i] = min(reads[i], sliced)
                    if f.in_place is not None and f.in_place[0] < len(reads):
                        p, upd = f.in_place
                        if reads[p]:  # the updated array is in HBM: the update written
                            reads[p], writes, kind = 0, min(writes, upd), "in-place update"
            elif op == "custom-call":
                kind = "kernel"
                at = rest.find("output_to_operand_aliasing={")
                # {{}: (1, {})} or {{0}: (3, {}), {1}: (4, {})}: the aliased operand numbers.
                spec = rest[at : at + 400].split("frontend_attributes")[0] if at >= 0 else ""
                for pair in re.findall(r"\}:\s*\((\d+),", spec):
                    i = int(pair)
                    if i < len(reads) and reads[i]:
                        writes = max(0, writes - reads[i])
                        reads[i] = 0
                declared = _DECLARED.search(rest)
                if declared and any(k in name or k in _scope(rest) for k in DECLARED_BYTES_KERNELS):
                    total = min(sum(reads) + writes, int(declared.group(1)))
                    if routed_share is not None and "dflash_routed_gmm" in name + _scope(rest):
                        expected = min(total, _routed_expected(ops, types, total, routed_share))
                        over_bound += (total - expected) * times[c]
                        total = expected
                    reads, writes, kind = [total], 0, "kernel (declared bytes)"
            elif op == "copy-start":
                # Result (destination, source, context): the destination's write if in HBM.
                parts = re.findall(r"\w+\[[\d,]*\](?:\{[^}]*\})?", rtype)
                writes = sum(_array_bytes(parts[0])) if parts else 0
            elif op == "slice-start":
                # ((operand), destination, context): an asynchronous slice (weights streamed
                # into VMEM piece by piece): the slice read, and written if it lands in HBM.
                parts = re.findall(r"\w+\[[\d,]*\](?:\{[^}]*\})?", rtype)
                dest = parts[-2] if len(parts) >= 2 else ""
                reads = [sum(_array_bytes(dest, hbm_only=False))]
                writes = sum(_array_bytes(dest))
            elif op.endswith("-start"):
                writes = 0  # async collectives: the operands read; results land with -done
            total = (sum(reads) + writes) * times[c]
            if total:
                rows.append(
                    {
                        "name": name,
                        "op": kind,
                        "bytes": total,
                        "type": rtype.split("{")[0][:80],
                        "scope": _scope(rest),
                    }
                )
    by_op: Dict[str, int] = {}
    for r in rows:
        by_op[r["op"]] = by_op.get(r["op"], 0) + r["bytes"]
    rows.sort(key=lambda r: -r["bytes"])
    out = {
        "hbm_bytes": sum(r["bytes"] for r in rows),
        "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
        "top_ops": rows[:top],
    }
    if routed_share is not None:
        out["hbm_bytes_bound"] = out["hbm_bytes"] + over_bound
    return out


# Latency of one ICI hop: "How to Scale Your Model" (https://jax-ml.github.io/scaling-book,
# "A note on ICI latency", as summarised at
# https://vorushin.github.io/blog/tpu-gpu-collective-primitives: moving one byte between two
# TPU v5p chips takes as long as moving ~45 KB, i.e. ~1 us at 4.5e10 B/s per direction).
ICI_HOP_LATENCY_S = 1e-6


def _hops(op: str, n: Optional[int]) -> int:
    """ICI hops a small collective waits for on a bidirectional ring of n chips: a gather,
    scatter or all-to-all ceil((n-1)/2); an all-reduce twice that (reduce-scatter then
    all-gather); a permute one."""
    base = op.replace("-start", "")
    if base == "collective-permute":
        return 1
    half = math.ceil(((n or 2) - 1) / 2)
    return 2 * half if base == "all-reduce" else half


def loop_collective_latency(hlo_text: str, hop_s: float = ICI_HOP_LATENCY_S) -> Tuple[int, float]:
    """(collectives per loop iteration, their summed latency in seconds: hops x hop_s each,
    no overlap with each other or with compute). A collective in a loop nested in the step (a
    scanned layer stack's body) counts its trip count times."""
    from dflash_jax.dry_run.compiled import _group_size
    from dflash_jax.dry_run.hlo import COLLECTIVE_OPS

    comps = computations(hlo_text)
    times = dict(loop_body_multiplicity(hlo_text))
    grew = True
    while grew:  # fusions and calls run as often as the computation that calls them
        grew = False
        for c, n in list(times.items()):
            for line in comps.get(c, ()):
                for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
                    if callee not in times:
                        times[callee], grew = n, True
    count, latency = 0, 0.0
    # Every computation a step runs, fusions included (the compiler fuses some collectives).
    for c in sorted(loop_body_computations(hlo_text)):
        for line in comps[c]:
            m = _INSTR.match(line)
            if m and m.group(4) in COLLECTIVE_OPS:
                count += times.get(c, 1)
                latency += _hops(m.group(4), _group_size(line)) * hop_s * times.get(c, 1)
    return count, latency


def routed_fraction(num_experts: int, top_k: int, tokens: int) -> float:
    """The expected share of a MoE layer's experts that `tokens` tokens route to, each token
    to top_k distinct experts, tokens independent and uniform over the experts:
    1 - (1 - top_k / E)^tokens (1 token: exactly top_k / E). Real routers are skewed, so a
    batch touches fewer on average; this is the floor's assumption, stated."""
    if num_experts <= 0 or top_k <= 0:
        return 1.0
    return 1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** max(tokens, 0)


def floor_bytes(
    *,
    body_weight_bytes: int,
    lm_head_bytes: int,
    drafter_weight_bytes: int,
    cache_bytes: int,
    ctx_bytes: int,
    capacity: int,
    context: int,
    rows: int,
    passes: int,
    head_passes: Optional[int] = None,
    recurrent_bytes: int = 0,
) -> int:
    """The analytic floor of one decode step per chip (module doc). *_bytes are per chip:
    the target's weights without embedding and LM head, its LM head, the drafter's weights, the
    target's KV cache and the drafter's context cache at `capacity` positions. rows: positions
    a step writes (AR 1, DFlash the block); passes: drafter passes per step (0 for AR; an
    EAGLE-3 drafter: its K sequential steps); head_passes: of those, the passes that read the
    target's LM head (default all: a DFlash drafter shares it; EAGLE-3 has its own, 0).
    recurrent_bytes: a hybrid target's per-sequence recurrent states (delta-rule states and
    convolution windows), read once and written once a step (`cache_bytes` then holds only its
    full-attention layers' K/V)."""
    per_pos = cache_bytes / capacity
    per_ctx = ctx_bytes / capacity
    head_passes = passes if head_passes is None else head_passes
    return int(
        body_weight_bytes
        + lm_head_bytes * (1 + head_passes)
        + drafter_weight_bytes * passes
        + per_pos * (context + rows)
        + 2 * recurrent_bytes
        + (per_ctx * (context * passes + rows) if passes else 0)
    )


# An instruction line with or without the `%` of names (jax's unoptimized HLO text has none).
_ANY_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")


# The FLOPs a Pallas kernel declares (its `cost_estimate`, in the custom call's backend config).
_KERNEL_FLOPS = re.compile(r'"cost_estimate":\s*\{[^}]*?"flops":\s*"?(\d+)')


def _declared_flops(lines: List[str], j: int) -> int:
    """The FLOPs the kernel of the custom call at lines[j] declares (0: none), its backend
    config read up to the next instruction (the lowered text may spread it over lines)."""
    text = lines[j]
    for line in lines[j + 1 :]:
        if _ANY_INSTR.match(line):
            break
        text += line
    declared = _KERNEL_FLOPS.search(text)
    return int(declared.group(1)) if declared else 0


def loop_dot_flops(hlo_text: str, nested_trips: bool = True, kernels: bool = False) -> int:
    """FLOPs of the matmuls one iteration of the program's decode loop runs: 2 x result
    elements x contracted size of every `dot` in the entry's `while` bodies and everything they
    call (fusions and calls included, each call site counted; a nested loop's body times its
    trips, `hlo.trip_count`: a scanned layer stack's body once per layer; once with
    `nested_trips=False`, as XLA's cost analysis counts it; with `kernels`, the FLOPs each
    Pallas kernel declares too). Read
    from the program as lowered (before optimization: XLA:GPU turns 1-row matmuls into
    reductions) for backends whose compiled cost analysis gives no FLOPs (XLA:GPU here). The
    attention kernels' (custom calls') FLOPs are not counted."""
    comps = computations(hlo_text)
    memo: Dict[str, int] = {}

    def flops(c: str, stack=()) -> int:
        if c in memo:
            return memo[c]
        if c in stack or c not in comps:
            return 0
        types = {}
        total = 0
        lines = comps[c]
        for j, line in enumerate(lines):
            m = _ANY_INSTR.match(line)
            if not m:
                continue
            name, rtype, op, rest = m.group(2), m.group(3), m.group(4), m.group(5)
            types[name] = rtype
            if kernels and op == "custom-call":
                total += _declared_flops(lines, j)
            if op == "dot":
                first = rest.split(",")[0].split(")")[0].split()
                lhs_name = first[-1].lstrip("%") if first else ""
                dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
                lhs = _TYPED.search(types.get(lhs_name, "") or " ".join(first))
                out = _TYPED.search(rtype)
                if dims and lhs and out:
                    shape = [int(d) for d in lhs.group(2).split(",") if d]
                    k = math.prod(shape[int(i)] for i in dims.group(1).split(",") if i)
                    n = math.prod(int(d) for d in out.group(2).split(",") if d)
                    total += 2 * n * k
            trips = trip_count(line, comps) if op == "while" and nested_trips else 1
            for key, callee in re.findall(
                r"(calls|to_apply|body|true_computation|false_computation)=%?([\w.\-]+)", rest
            ):
                total += flops(callee, stack + (c,)) * (trips if key == "body" else 1)
        memo[c] = total
        return total

    bodies = [
        b
        for line in comps.get("__entry__", [])
        if re.search(r"\swhile\(", line)
        for b in re.findall(r"body=%?([\w.\-]+)", line)
    ]
    return sum(flops(b) for b in bodies)
