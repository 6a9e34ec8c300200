"""tau of the bundled pair's drafter over its target quantized to int8 against the float target,
on held-out code prompts (issue 29, item 4): the drafter was trained on the float target's
hidden states, so a quantized target could accept fewer of its drafts.

    python benchmarks/experiments/quantized/quantized_tau.py --num_prompts=32 \\
        --max_new_tokens=64 --block_size=16 \\
        --json_out=benchmarks/results/quantized/tiny_code_int8_tau.json

Prompts: functions cut from the held-out (validation) stdlib files
(`dflash_jax.data.prompts.benchmark_prompts`, as benchmarks/bench_dflash.py). For each target
(float32; int8 per output channel, `dflash_jax.quantize_target`), greedy DFlash and
autoregressive decoding of the same target run on the same prompts; every DFlash output is
checked against that target's own autoregressive output (lossless w.r.t. the quantized model).
Printed and written: tau (committed tokens per target pass, over all steps of all prompts, and
the mean of the per-prompt means), and how many of the int8 target's greedy tokens equal the
float target's (the quantized model is another model).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FLAGS = flags.FLAGS
flags.DEFINE_integer("num_prompts", 32, "Held-out prompts.", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.", lower_bound=1)
flags.DEFINE_integer("max_prompt_tokens", 256, "Prompts are cut to their last N tokens.")
flags.DEFINE_integer("block_size", 16, "Draft block size.", lower_bound=2)
flags.DEFINE_integer("batch_size", 8, "Prompts per generate call.", lower_bound=1)
flags.DEFINE_string("data_dir", "/tmp/dflash_tfds", "TFDS data dir for the stdlib corpus.")
flags.DEFINE_string("json_out", None, "Write the figures (and provenance) here.")


def run(target, drafter, prompts, **kw):
    """(outputs, acceptance lengths per prompt) over `prompts` in batches."""
    import dflash_jax as dj

    outs, acc = [], []
    for i in range(0, len(prompts), FLAGS.batch_size):
        res = dj.generate(target, drafter, prompts[i : i + FLAGS.batch_size], **kw)
        outs += [list(map(int, t)) for t in res.tokens]
        acc += [list(map(int, a)) for a in res.acceptance_lengths]
    return outs, acc


def main(argv):
    del argv
    sys.path.insert(0, ROOT)
    from dflash_jax.frontend import textgen
    from dflash_jax.support import console, provenance

    console.cli_startup()
    import dflash_jax as dj
    from dflash_jax.data.prompts import benchmark_prompts

    pair = os.path.join(ROOT, "assets", "tiny-code")
    target = dj.load_target(os.path.join(pair, "target"), dtype="float32")
    drafter = dj.load_drafter(os.path.join(pair, "drafter"), target=target)
    text = textgen.load_text(os.path.join(pair, "target"))
    prompts = benchmark_prompts(
        text.tokenizer, None, FLAGS.data_dir, FLAGS.num_prompts, FLAGS.max_prompt_tokens
    )
    kw = dict(max_new_tokens=FLAGS.max_new_tokens, stop_token_ids=text.stop_token_ids)
    rows, ar_outputs = {}, {}
    for name, t in (("float32", target), ("int8", dj.quantize_target(target))):
        ar, _ = run(t, None, prompts, **kw)
        out, acc = run(t, drafter, prompts, block_size=FLAGS.block_size, **kw)
        steps = [a for seq in acc for a in seq]
        rows[name] = {
            "tau_steps": float(np.mean(steps)),
            "tau_per_prompt_mean": float(np.mean([np.mean(a) for a in acc if a])),
            "steps": len(steps),
            "tokens": int(sum(steps)),
            "identical_to_ar": all(a == b for a, b in zip(ar, out)),
        }
        ar_outputs[name] = ar
        print(
            f"{name:8s} tau {rows[name]['tau_steps']:.3f} (per-prompt mean "
            f"{rows[name]['tau_per_prompt_mean']:.3f}) over {len(steps)} steps; DFlash == AR: "
            f"{rows[name]['identical_to_ar']}",
            flush=True,
        )
    same = [
        sum(x == y for x, y in zip(a, b)) / max(len(a), 1)
        for a, b in zip(ar_outputs["float32"], ar_outputs["int8"])
    ]
    identical = sum(a == b for a, b in zip(ar_outputs["float32"], ar_outputs["int8"]))
    print(
        f"int8 greedy outputs identical to float32's: {identical}/{len(prompts)} prompts; "
        f"position-wise agreement {np.mean(same):.3f}"
    )
    result = {
        **provenance.record(),  # command, commit, dirty, date, machine (test_figure_sources)
        "settings": {
            "pair": "assets/tiny-code",
            "prompts": len(prompts),
            "prompt_source": "held-out stdlib validation files (benchmark_prompts)",
            "max_new_tokens": FLAGS.max_new_tokens,
            "block_size": FLAGS.block_size,
            "batch_size": FLAGS.batch_size,
            "compute_dtype": "float32",
            "int8": "decoder linears per output channel (symmetric), embedding/LM head float32",
        },
        "targets": rows,
        "int8_vs_float32_ar": {
            "identical_prompts": int(identical),
            "positionwise_agreement": float(np.mean(same)),
        },
    }
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {FLAGS.json_out}")
    if not all(r["identical_to_ar"] for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
