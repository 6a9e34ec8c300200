"""What the compiler says about a program: memory plan (HBM per device), cost analysis,
collectives parsed from the compiled HLO; out-of-memory compiles as results."""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any, Dict, List, Optional


_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COLLECTIVE = re.compile(
    r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute|collective-broadcast)(-start)?\("
)


def _shapes(text: str) -> List[int]:
    out = []
    for dt, dims in _ARRAY.findall(text):
        out.append(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt])
    return out


def _group_size(line: str) -> Optional[int]:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota form [groups, size]
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)  # explicit groups
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # named mesh axes
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(int(sizes.get(a, 1)) for a in axes)
    return None


def collectives(hlo_text: str) -> List[Dict[str, Any]]:
    """The collectives of a compiled HLO module, grouped by (op, bytes, group size), with
    `bytes` = the per-device size of the collective's result (an all-gather's gathered array,
    an all-reduce's reduced one) and `moved_bytes` = what one device sends in a ring algorithm:
    all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, permute 1x."""
    groups: Dict[tuple, Dict[str, Any]] = {}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        result, op, start = m.groups()
        sizes = _shapes(result)
        if not sizes:
            continue
        if start and op in ("all-gather", "collective-permute") and len(sizes) >= 2:
            nbytes = sizes[1] if op == "collective-permute" else sum(sizes[len(sizes) // 2 :])
        elif start and op in ("all-gather", "reduce-scatter", "all-to-all"):
            nbytes = max(sizes)
        else:
            nbytes = sum(sizes)
        n = _group_size(line)
        factor = {"all-reduce": 2.0}.get(op, 1.0)
        if n and op != "collective-permute":
            factor *= (n - 1) / n
        key = (op, nbytes, n)
        g = groups.setdefault(
            key, dict(op=op, bytes=nbytes, group_size=n, count=0, moved_bytes=0.0)
        )
        g["count"] += 1
        g["moved_bytes"] += factor * nbytes
    return sorted(groups.values(), key=lambda g: -g["moved_bytes"])


def _hbm_numbers(message: str) -> Dict[str, float]:
    """Byte figures the TPU compiler's RESOURCE_EXHAUSTED message gives (used / available)."""
    unit = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    num = lambda v, u: float(v) * unit[u.upper()[:1] if u else ""]
    out = {}
    m = re.search(r"Used ([\d.]+)([KMGT]?)\S* of ([\d.]+)([KMGT]?)\S* hbm", message)
    if m:
        out["required"], out["available"] = num(*m.group(1, 2)), num(*m.group(3, 4))
    m = re.search(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)", message)
    if m:
        out.setdefault("required", num(*m.group(1, 2)))
        out.setdefault("available", num(*m.group(3, 4)))
    return out


def compile_stats(
    lower_fn, capacity: Optional[int], hlo_path: Optional[str] = None, keep_text: bool = False
) -> Dict[str, Any]:
    """Compiles `lower_fn()` and reads the memory plan, cost analysis and collectives. A
    RESOURCE_EXHAUSTED compile gives fits=False with the compiler's numbers, not an error.
    hlo_path: also write the compiled program's optimized HLO text there; keep_text: return it
    as "hlo_text", and the program as lowered (before optimization) as "lowered_hlo_text" (for
    the caller to read and drop)."""
    t0 = time.perf_counter()
    try:
        lowered = lower_fn()
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - only out-of-memory is a result; others re-raise
        msg = str(e)
        if "RESOURCE_EXHAUSTED" not in msg and "Ran out of memory" not in msg:
            raise
        nums = _hbm_numbers(msg)
        return {
            "fits": False,
            "hbm_bytes": {"total": nums.get("required")},
            "hbm_capacity_bytes": nums.get("available", capacity),
            "flops": None,
            "bytes_accessed": None,
            "collectives": [],
            "compile_s": time.perf_counter() - t0,
            "error": " ".join(msg.split())[:600],
        }
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    hbm = {
        "arguments": int(mem.argument_size_in_bytes),
        "outputs": int(mem.output_size_in_bytes),
        "aliased": int(mem.alias_size_in_bytes),
        "temporaries": int(mem.temp_size_in_bytes),
        "generated_code": int(mem.generated_code_size_in_bytes),
    }
    # Live at the peak: inputs, outputs not aliased to (donated) inputs, scratch, code.
    hbm["total"] = (
        hbm["arguments"]
        + hbm["outputs"]
        - hbm["aliased"]
        + hbm["temporaries"]
        + hbm["generated_code"]
    )
    text = compiled.as_text()
    if hlo_path:
        os.makedirs(os.path.dirname(os.path.abspath(hlo_path)), exist_ok=True)
        with open(hlo_path, "w") as f:
            f.write(text)
    out = {
        "fits": None if capacity is None else hbm["total"] <= capacity,
        "hbm_bytes": hbm,
        "hbm_capacity_bytes": capacity,
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "collectives": collectives(text),
        "compile_s": compile_s,
        # Compiled Pallas kernels (Mosaic custom calls) in the program.
        "mosaic_kernels": text.count('custom_call_target="tpu_custom_call"'),
    }
    if keep_text:
        out["hlo_text"] = text
        out["lowered_hlo_text"] = lowered.as_text(dialect="hlo")
    return out


def tree_bytes_per_device(tree, shardings) -> int:
    import jax
    import numpy as np

    total = 0
    for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)):
        shard = s.shard_shape(np.shape(x))
        total += math.prod(shard) * np.dtype(x.dtype).itemsize
    return total


def tree_bytes(tree) -> int:
    import jax
    import numpy as np

    return sum(
        math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
    )


def moved_bytes(stats) -> float:
    return sum(c["moved_bytes"] for c in stats["collectives"])
