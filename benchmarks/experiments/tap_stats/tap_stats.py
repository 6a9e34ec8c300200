"""What a drafter is trained on: the target's tapped hidden states and the regenerated data.

  python benchmarks/experiments/tap_stats/tap_stats.py --target=smollm2-135m-instruct \
      --layers=1,14,27 --responses=runs/smollm2/regen/responses_1.jsonl --max_new_tokens=256 \
      --json_out=benchmarks/results/smollm2/tap_stats.json

Taps: over the first `--rows` training rows of `--responses` (their first `--tokens` tokens,
position 0 left out: attention-sink tokens carry activations ~100x the rest), per tapped layer,
the median per-token RMS and the share of the squared norm that its `--top` largest dimensions
carry (massive activations: what `drafter.fc_init=tap_rms` rescales). Data: conversations,
answer tokens, answer tokens per conversation, share of answers stopped by the token cap.
"""

import json

import numpy as np
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m-instruct", "Target directory, GGUF or name.")
flags.DEFINE_list("layers", ["1", "14", "27"], "Tapped layers (the drafter's target_layer_ids).")
flags.DEFINE_string("responses", None, "Regenerated chat rows (JSONL of regenerate_chat).")
flags.DEFINE_integer("max_new_tokens", 256, "The regeneration's cap (for the capped share).")
flags.DEFINE_integer("rows", 4, "Rows whose taps are measured.")
flags.DEFINE_integer("tokens", 256, "Tokens of each row measured.")
flags.DEFINE_integer("top", 5, "Largest dimensions whose energy share is reported.")
flags.DEFINE_string("json_out", None, "Write the figures here.")


def data_stats(rows, cap):
    answers = [len(t["response_ids"]) for r in rows for t in r["turns"]]
    return {
        "conversations": len(rows),
        "answer_tokens": int(sum(answers)),
        "tokens_with_prompts": int(sum(len(r["input_ids"]) for r in rows)),
        "answer_tokens_per_conversation": sum(answers) / max(len(rows), 1),
        "capped_share": sum(a >= cap for a in answers) / max(len(answers), 1),
    }


def tap_stats(taps, hidden, layers, top):
    """taps [N, len(layers) * hidden] (position 0 of each row already left out)."""
    out = {}
    for i, layer in enumerate(layers):
        x = taps[:, i * hidden : (i + 1) * hidden].astype(np.float64)
        dim_rms = np.sqrt((x**2).mean(0))
        big = np.argsort(-dim_rms)[:top]
        out[str(layer)] = {
            "token_rms_median": float(np.median(np.sqrt((x**2).mean(1)))),
            "top_dims": big.tolist(),
            "top_dims_energy_share": float((x[:, big] ** 2).sum() / (x**2).sum()),
        }
    return out


def main(argv):
    del argv
    import dflash_jax as dj
    from dflash_jax.models.transformer import Transformer
    from dflash_jax.support import checks, provenance

    if not FLAGS.responses:
        raise ValueError("--responses is required (regenerated chat rows)")
    checks.int_param("--rows", FLAGS.rows, lo=1)
    checks.int_param("--tokens", FLAGS.tokens, lo=2)
    layers = [int(x) for x in FLAGS.layers]
    with open(FLAGS.responses) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    target = dj.load_target(FLAGS.target)
    tmod = Transformer(target.config)
    taps = []
    for r in rows[: FLAGS.rows]:
        ids = np.asarray([r["input_ids"][: FLAGS.tokens]], np.int32)
        t = tmod.apply({"params": target.params}, ids, layers, method="taps")
        taps.append(np.asarray(t)[0, 1:])
    rec = {
        "data": data_stats(rows, FLAGS.max_new_tokens),
        "taps": tap_stats(np.concatenate(taps), target.config.hidden_size, layers, FLAGS.top),
    }
    print(json.dumps(rec, indent=1))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({**provenance.record(), **rec, "target": FLAGS.target}, f, indent=1)


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)
