"""tau at temperature 1 with DFlash drafts taken as the drafter's argmax (verified as one-hot
proposals) or sampled from the drafter (verified by rejection sampling against it, the
reference package's rule): `generate(draft_sampling="argmax" | "sample")`, on the bundled pair
(assets/tiny-code, the code prompts of tests/_pair.py) and on SmolLM2-135M-Instruct with its
shipped drafter (MT-Bench first turns, one per category, through the chat template).

    python benchmarks/experiments/draft_sampling/draft_sampling_tau.py --pairs=tiny,smollm2 \\
        --seeds=2 --max_new_tokens=128

Per pair and rule, over `--seeds` seeds (the same seeds for both rules): tau over all steps
of all prompts, and the mean over prompts of each prompt's mean acceptance length (z-lab's
way). Both rules are lossless; they differ in how many drafts are accepted.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, ROOT)
FLAGS = flags.FLAGS
PAIRS = ("tiny", "smollm2")
RULES = ("argmax", "sample")


def define_flags():
    flags.DEFINE_list("pairs", list(PAIRS), f"Which pairs: {', '.join(PAIRS)}.")
    flags.DEFINE_integer("seeds", 2, "Seeds per pair and rule.")
    flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
    flags.DEFINE_float("temperature", 1.0, "Sampling temperature (> 0).")
    flags.DEFINE_integer("num_prompts", 8, "SmolLM2: MT-Bench rows, spread over its categories.")
    flags.DEFINE_string("json_out", None, "Also write the figures here.")


def tiny_pair():
    """The bundled pair and the code prompts of tests/_pair.py (token ids)."""
    import dflash_jax as dj
    from dflash_jax.data import load_tokenizer

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _pair import CODE, PAIR

    target = dj.load_target(os.path.join(PAIR, "target"))
    drafter = dj.load_drafter(os.path.join(PAIR, "drafter"), target=target)
    tok = load_tokenizer(os.path.join(PAIR, "target"))
    return target, drafter, [list(tok.encode(p)) for p in CODE], []


def smollm2_pair(num_prompts):
    """SmolLM2-135M-Instruct, its shipped drafter, MT-Bench first turns through the chat
    template (every 80 / num_prompts-th row: the categories come 10 rows each), stop ids."""
    from benchmarks import drafter_grid, eval_tau

    import dflash_jax as dj

    target_dir, _, labels, dirs = drafter_grid.resolve_pair(
        "smollm2-135m-instruct", [os.path.join(ROOT, "assets/smollm2-135m-instruct/drafter")]
    )
    target, drafters, tok, render, _, stop = drafter_grid.load_pair(target_dir, labels, dirs)
    turns, _ = eval_tau.load_prompts("mt_bench", None, "auto", 80)
    turns = turns[:: max(1, len(turns) // num_prompts)][:num_prompts]
    del dj
    return target, drafters[labels[0]], drafter_grid.chat_prompts(tok, render, turns), stop


def measure(target, drafter, prompts, stop, rule, seeds):
    """(tau over all steps, mean of per-prompt means, steps) over `seeds` runs."""
    import dflash_jax as dj

    steps, per_prompt = [], []
    for seed in range(seeds):
        res = dj.generate(
            target,
            drafter,
            prompts,
            FLAGS.max_new_tokens,
            temperature=FLAGS.temperature,
            seed=seed,
            stop_token_ids=stop,
            draft_sampling=rule,
        )
        for acc in res.acceptance_lengths:
            if acc:
                steps += acc
                per_prompt.append(float(np.mean(acc)))
    return float(np.mean(steps)), float(np.mean(per_prompt)), len(steps)


def main(argv):
    del argv
    bad = [p for p in FLAGS.pairs if p not in PAIRS]
    if bad or not FLAGS.pairs:
        raise ValueError(f"--pairs: choose from {', '.join(PAIRS)}, got {FLAGS.pairs}")
    if FLAGS.seeds < 1 or FLAGS.max_new_tokens < 1 or not FLAGS.temperature > 0:
        raise ValueError("--seeds and --max_new_tokens must be >= 1, --temperature > 0")
    from dflash_jax.support import console

    console.cli_startup()
    rows = []
    for name in FLAGS.pairs:
        target, drafter, prompts, stop = (
            tiny_pair() if name == "tiny" else smollm2_pair(FLAGS.num_prompts)
        )
        for rule in RULES:
            tau, tau_pp, n = measure(target, drafter, prompts, stop, rule, FLAGS.seeds)
            rows.append(
                dict(pair=name, rule=rule, tau=tau, tau_per_prompt=tau_pp, steps=n,
                     prompts=len(prompts), seeds=FLAGS.seeds, temperature=FLAGS.temperature,
                     max_new_tokens=FLAGS.max_new_tokens)
            )  # fmt: skip
            print(
                f"{name:8s} draft_sampling={rule:6s} T={FLAGS.temperature:g}: tau {tau:.3f} "
                f"(per-prompt mean {tau_pp:.3f}; {n} steps, {len(prompts)} prompts x "
                f"{FLAGS.seeds} seeds, {FLAGS.max_new_tokens} new tokens)",
                flush=True,
            )
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
