"""Text-quality figures shared by the benchmark scripts.

Committed results: none (a helper `bench_dflash.py`, `eval_target.py` and `repetition.py`
import).
"""


def distinct_ngram_ratio(ids, n=4):
    """Distinct n-grams / n-grams of a completion: 1.0 never repeats, a loop tends to 0 (1.0 for
    completions shorter than n)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0
