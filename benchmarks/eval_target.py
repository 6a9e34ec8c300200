"""Held-out quality of a small code target: loss, bits per byte, and sample completions.

  python benchmarks/eval_target.py --target=assets/tiny-code/target \
      --out=benchmarks/results/tiny-code/target_eval.json

Loss is measured on the validation split of the Python standard-library corpus (files held out
from training by hash of their path), in windows of --window tokens, every token scored once.
Bits per byte = total nats / ln 2 / total UTF-8 bytes of the scored text. Greedy completions of
a few held-out prompts are printed with their distinct-4-gram ratio (1.0 = no repeated 4-gram;
degenerate loops score low).

Committed results: `python benchmarks/eval_target.py
--out=benchmarks/results/tiny-code/target_eval.json` (the JSONs record the run that wrote them,
under runs/, with its --data_dir).
"""

import json
import math
import os
import sys

import numpy as np
from absl import flags

from benchmarks import text_quality  # noqa: E402
from dflash_jax.support import provenance  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "assets/tiny-code/target", "Target directory.")
flags.DEFINE_string("data_dir", "/tmp/dflash_tfds", "TFDS data dir for the stdlib corpus.")
flags.DEFINE_integer("window", 256, "Tokens per scored window.")
flags.DEFINE_integer("num_samples", 4, "Greedy completions to show.")
flags.DEFINE_integer("max_new_tokens", 96, "Tokens per completion.")
flags.DEFINE_string("out", None, "Write figures and samples as JSON here.")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    import dflash_jax as dj
    from dflash_jax.data import build_python_stdlib, decode_example
    from dflash_jax.data.prompts import encode_code_prompt, stdlib_prompts
    from dflash_jax.data.tokenizer import load_tokenizer
    from dflash_jax.models import hub
    from dflash_jax.support import console

    target_dir = hub.resolve_or_exit(FLAGS.target, what="--target")
    console.cli_startup()
    target = dj.load_target(target_dir)
    tok = load_tokenizer(target_dir)
    builder = build_python_stdlib(FLAGS.data_dir)
    source = builder.as_data_source(split="validation")
    texts = [decode_example(source[i])["text"] for i in range(len(source))]

    w = FLAGS.window

    @jax.jit
    def nll(ids, valid):  # ids [B, w+1], valid [B, w] -> summed NLL of the valid ids[:, 1:]
        hidden, _, _ = target.module.apply({"params": target.params}, ids[:, :-1])
        lg = target.module.apply({"params": target.params}, hidden, method=dj.Transformer.logits)
        logp = jax.nn.log_softmax(lg, axis=-1)
        tgt = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        # P(a temperature-1 sample equals the argmax): the acceptance probability of a one-hot
        # argmax draft, i.e. what even a perfect drafter gets per token at T = 1.
        p_top = jnp.exp(jnp.max(logp, axis=-1))
        return (-jnp.sum(jnp.where(valid, tgt, 0.0)), jnp.sum(jnp.where(valid, p_top, 0.0)))

    total_nats, total_tokens, total_bytes, total_ptop = 0.0, 0, 0, 0.0
    windows = []
    for text in texts:
        ids = [tok.eos_id] + tok.encode(text)  # scored like a document start in training
        total_bytes += len(text.encode("utf-8"))
        total_tokens += len(ids) - 1
        for start in range(0, len(ids) - 1, w):
            windows.append(ids[start : start + w + 1])
    for i in console.progress(range(0, len(windows), 16), desc="score", unit="batch"):
        ids = np.zeros((16, w + 1), np.int32)
        valid = np.zeros((16, w), bool)
        for r, chunk in enumerate(windows[i : i + 16]):
            ids[r, : len(chunk)] = chunk
            valid[r, : len(chunk) - 1] = True
        nats, ptop = nll(jnp.asarray(ids), jnp.asarray(valid))
        total_nats += float(nats)
        total_ptop += float(ptop)
    loss = total_nats / total_tokens
    mean_top_p = total_ptop / total_tokens
    bpb = total_nats / math.log(2) / total_bytes
    print(
        f"held-out: {len(texts)} files, {total_tokens} tokens, {total_bytes} bytes; "
        f"loss {loss:.3f} nats/token, perplexity {math.exp(loss):.1f}, "
        f"{bpb:.3f} bits/byte, {total_bytes / total_tokens:.2f} bytes/token; mean top-1 "
        f"probability {mean_top_p:.3f} (acceptance of a perfect one-hot draft at T=1)"
    )

    prompts = stdlib_prompts(FLAGS.data_dir, max_prompts=FLAGS.num_samples)
    samples = []
    for p in prompts:
        ids = encode_code_prompt(tok, p["prompt"], 192)
        res = dj.generate(target, None, [ids], FLAGS.max_new_tokens, stop_token_ids=[tok.eos_id])
        out = res.tokens[0]
        ratio = text_quality.distinct_ngram_ratio(out)
        samples.append(
            {
                "path": p["path"],
                "prompt_tail": tok.decode(ids)[-300:],
                "completion": tok.decode(out),
                "distinct_4gram_ratio": ratio,
            }
        )
        print(
            f"\n--- {p['path']} (distinct 4-grams {ratio:.2f}) ---\n"
            f"{tok.decode(ids)[-300:]}{console.style(tok.decode(out), sys.stdout)}"
        )
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(
                {
                    "files": len(texts),
                    "tokens": total_tokens,
                    "bytes": total_bytes,
                    "loss_nats_per_token": loss,
                    "bits_per_byte": bpb,
                    "mean_top1_probability": mean_top_p,
                    "samples": samples,
                    **provenance.record(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
