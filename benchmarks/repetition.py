"""How repetitive a target's greedy completions are, against the real code that follows the prompt.

  python benchmarks/repetition.py --target=assets/tiny-code/target \
      --out=benchmarks/results/tiny-code/repetition.json

For the benchmark's held-out code prompts (as in bench_dflash.py), compares the distinct-4-gram
ratio of the target's greedy completion with that of the same number of tokens of the file's real
continuation, per prompt-length cut (`--prompt_tokens`), so "degenerate repetition" is judged
against how repetitive real code is, and so it shows whether long prompts (positions past the
target's training length) are what make it loop.

Committed results: `python benchmarks/repetition.py
--out=benchmarks/results/tiny-code/repetition.json` (the JSONs record the run that wrote them,
under runs/, with its --data_dir).
"""

import json
import os

import numpy as np
from absl import flags

from benchmarks import text_quality  # noqa: E402
from dflash_jax.support import provenance  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "assets/tiny-code/target", "Target directory.")
flags.DEFINE_string("data_dir", "/tmp/dflash_tfds", "TFDS data dir for the stdlib corpus.")
flags.DEFINE_string(
    "prompt_file",
    None,
    'JSONL of {"prompt", "reference"} (the text that '
    "really follows the prompt) instead of the held-out stdlib prompts.",
)
flags.DEFINE_integer("num_prompts", 100, "Held-out prompts.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens per completion (and of the reference).")
flags.DEFINE_list("prompt_tokens", ["256", "128"], "Prompt cuts (last N tokens) to compare.")
flags.DEFINE_integer("batch_size", 10, "Prompts per generate call.")
flags.DEFINE_float(
    "threshold", 0.5, "A completion below this distinct-4-gram ratio counts as repetitive."
)
flags.DEFINE_string("out", None, "Write the figures as JSON here.")


def summarize(ratios, threshold):
    r = np.asarray(ratios)
    return {
        "median": float(np.median(r)),
        "mean": float(r.mean()),
        "share_below": float((r < threshold).mean()),
        "n": int(r.size),
    }


def load_pairs():
    """(prompt, the text that really follows it) pairs: from --prompt_file, or the benchmark's
    held-out stdlib prompts, each followed by the rest of its file."""
    if FLAGS.prompt_file:
        with open(FLAGS.prompt_file) as f:
            items = [json.loads(line) for line in f if line.strip()]
        return [(it["prompt"], it["reference"]) for it in items][: FLAGS.num_prompts]
    from dflash_jax.data import build_python_stdlib, decode_example, load_split
    from dflash_jax.data.prompts import BENCHMARK_PROMPTS, code_prompts

    source = load_split(build_python_stdlib(FLAGS.data_dir), "validation")
    examples = [decode_example(source[i]) for i in range(len(source))]
    prompts = code_prompts(examples, max_prompts=FLAGS.num_prompts, **BENCHMARK_PROMPTS)
    texts = {ex["path"]: ex["text"] for ex in examples}
    pairs = []
    for p in prompts:  # the prompt is a verbatim slice of its file
        text, prompt = texts[p["path"]], p["prompt"].rstrip()
        at = text.find(prompt)
        pairs.append((p["prompt"], text[at + len(prompt) :] if at >= 0 else ""))
    return pairs


def main(argv):
    del argv
    import dflash_jax as dj
    from dflash_jax.data.prompts import encode_code_prompt
    from dflash_jax.data.tokenizer import load_tokenizer
    from dflash_jax.models import hub
    from dflash_jax.support import console

    target_dir = hub.resolve_or_exit(FLAGS.target, what="--target")
    console.cli_startup()
    target = dj.load_target(target_dir)
    tok = load_tokenizer(target_dir)
    n = FLAGS.max_new_tokens
    pairs = load_pairs()
    refs = [tok.encode(reference)[:n] for _, reference in pairs]
    keep = [i for i, r in enumerate(refs) if len(r) == n]
    if not keep:
        raise SystemExit(f"no prompt has {n} tokens of reference continuation")
    report = {
        "reference": summarize(
            [text_quality.distinct_ngram_ratio(refs[i]) for i in keep], FLAGS.threshold
        )
    }
    print(
        f"{len(keep)} prompts with {n} reference tokens; real continuations: distinct-4-gram "
        f"median {report['reference']['median']:.2f}, "
        f"{100 * report['reference']['share_below']:.0f}% below {FLAGS.threshold}"
    )
    for cut in [int(x) for x in FLAGS.prompt_tokens]:
        prompts = [encode_code_prompt(tok, pairs[i][0], cut) for i in keep]
        outs = []
        for s in console.progress(
            range(0, len(prompts), FLAGS.batch_size), desc=f"greedy, prompts of {cut}", unit="batch"
        ):
            res = dj.generate(target, None, prompts[s : s + FLAGS.batch_size], n)
            outs += res.tokens
        ratios = [text_quality.distinct_ngram_ratio(o) for o in outs]
        key = f"greedy_prompt{cut}"
        report[key] = summarize(ratios, FLAGS.threshold)
        report[key]["median_prompt_tokens"] = float(np.median([len(p) for p in prompts]))
        r = report[key]
        print(
            f"greedy, prompts cut to {cut} tokens (median {r['median_prompt_tokens']:.0f}): "
            f"distinct-4-gram median {r['median']:.2f}, {100 * r['share_below']:.0f}% below "
            f"{FLAGS.threshold}",
            flush=True,
        )
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(dict(report, **provenance.record()), f, indent=1)


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
