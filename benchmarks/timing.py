"""Timing helpers shared by the benchmark scripts (no flags, safe to import).

Committed results: none (a helper `step_costs.py` and `scale_costs.py` import).
"""

import time

import numpy as np


def median_time(fn, repeats):
    """Median seconds of `repeats` calls of fn (results blocked on), after one warm-up call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def loop_step_ms(target, drafter, ids, tokens, block_size, repeats):
    """Milliseconds per iteration of `generate`'s compiled decode loop (autoregressive when
    drafter is None), median over `repeats` runs after one that compiles."""
    import dflash_jax as dj

    times = []
    for _ in range(repeats + 1):
        res = dj.generate(target, drafter, [ids], tokens, block_size=block_size)
        times.append(res.stats["decode_s"] / max(res.stats["steps"], 1))
    return 1e3 * float(np.median(times[1:]))
