"""Where DFlash and autoregressive greedy decoding part in bfloat16, and why.

  python benchmarks/experiments/bf16_divergence/bf16_divergence.py   # the bundled pair, 16 prompts
  python benchmarks/experiments/bf16_divergence/bf16_divergence.py \
      --out=benchmarks/results/tiny-code/bf16_divergence.json

In float32 the two decoders give the same tokens. In bfloat16 a 16-token verify pass and a
1-token step sum in a different order and round differently, so where the target's two best
tokens are (nearly) tied the argmax can differ between them, and from there the texts part.
For every prompt where they part, this script takes the first differing position and reports,
from a full bfloat16 forward over the common prefix: the ranks of the two tokens, their logit
gap, and the bfloat16 rounding scale of that gap,

    tol = 2^-8 * sum_i |h_i| * |W[a, i] - W[d, i]|

(h: the final normed hidden state, W: the LM head rows of the AR token a and the DFlash token
d): how much the gap moves when h is perturbed by one bfloat16 rounding step (relative 2^-8)
in each component. A *near-tie*: both tokens are the target's top 2 and their gap is <= tol.

Settings: "bfloat16" (bf16 weights and compute), and "bf16 weights, float32 compute"
(`load_target(dtype="float32", param_dtype="bfloat16")`: same weight memory, float32
activations and KV cache), with decode throughput and KV-cache bytes per token for the cost.
Prompts: code-completion prompts from the held-out stdlib files (as `bench_dflash.py`), or
`--prompt_file` JSONL.
"""

import json
import os

import numpy as np
from absl import flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

FLAGS = flags.FLAGS


def define_flags():
    """The CLI's flags (defined only when run as a script: the test imports this module beside
    other benchmarks that define --out too)."""
    flags.DEFINE_string("target", os.path.join(ROOT, "assets/tiny-code/target"), "Target dir.")
    flags.DEFINE_string("drafter", os.path.join(ROOT, "assets/tiny-code/drafter"), "Drafter dir.")
    flags.DEFINE_string("prompt_file", None, "JSONL prompts instead of held-out stdlib prompts.")
    flags.DEFINE_string("data_dir", "/tmp/dflash_tfds", "TFDS data dir for the stdlib corpus.")
    flags.DEFINE_integer("num_prompts", 16, "Prompts.")
    flags.DEFINE_integer("max_new_tokens", 48, "New tokens per prompt.")
    flags.DEFINE_integer("max_prompt_tokens", 256, "Prompts are cut to their last N tokens.")
    flags.DEFINE_integer("block_size", None, "Verify block size (default: the drafter's).")
    flags.DEFINE_string("out", None, "Write the figures as JSON here.")


SETTINGS = {
    "bfloat16": dict(dtype="bfloat16", param_dtype="bfloat16"),
    "bf16 weights, float32 compute": dict(dtype="float32", param_dtype="bfloat16"),
}


def _hidden_logits_head(target, ids):
    """(final normed hidden [T, H], float32 logits [T, V], LM head rows [V, H]) of one
    full forward over `ids`, as float64 numpy."""
    import jax.numpy as jnp

    n = len(ids)
    # Right-padded to a multiple of 128 (causal: the first n positions do not see the padding)
    # so that one compiled program serves many lengths.
    padded = np.zeros((1, -(-n // 128) * 128), np.int32)
    padded[0, :n] = ids
    hidden, logits = _forward(target.module, target.params, jnp.asarray(padded))
    p = target.params
    w = (
        p["embed_tokens"]["embedding"]
        if target.config.tie_word_embeddings
        else p["lm_head"]["kernel"].T
    )
    f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    return f64(hidden[0, :n]), f64(logits[0, :n]), f64(w)


def _forward(module, params, ids):
    import jax

    if module not in _FORWARD:

        def fwd(params, ids):
            hidden, _, _ = module.apply({"params": params}, ids)
            return hidden, module.apply({"params": params}, hidden, method="logits")

        _FORWARD[module] = jax.jit(fwd)
    return _FORWARD[module](params, ids)


_FORWARD = {}


def near_tie_share(target, prompt, continuation) -> tuple:
    """(near-tie positions, positions) over the positions that predict `continuation` after
    `prompt`: how often the target's top two tokens are within bf16 rounding at all, the base
    rate against which the divergences are judged."""
    h, logits, w = _hidden_logits_head(target, list(prompt) + list(continuation))
    rows = range(len(prompt) - 1, len(prompt) - 1 + len(continuation))
    n = 0
    for t in rows:
        top = np.argsort(-logits[t], kind="stable")[:2]
        gap = logits[t, top[0]] - logits[t, top[1]]
        n += gap <= 2.0**-8 * np.sum(np.abs(h[t]) * np.abs(w[top[0]] - w[top[1]]))
    return int(n), len(rows)


def divergence_at(target, prefix, a, d) -> dict:
    """The target's view of position len(prefix) (the token after `prefix`), where AR chose
    `a` and DFlash `d`: ranks, logit gap, its bf16 rounding scale `tol`, near_tie."""
    h, logits, w = _hidden_logits_head(target, prefix)
    h, logits = h[-1], logits[-1]
    order = np.argsort(-logits, kind="stable")
    rank = {int(t): int(np.flatnonzero(order == t)[0]) for t in (a, d)}
    gap = abs(float(logits[a] - logits[d]))
    tol = 2.0**-8 * float(np.sum(np.abs(h) * np.abs(w[a] - w[d])))
    return {
        "position": len(prefix),
        "ar_token": int(a),
        "dflash_token": int(d),
        "ranks": [rank[int(a)], rank[int(d)]],
        "gap": gap,
        "tol": tol,
        "top2_gap": float(logits[order[0]] - logits[order[1]]),
        "near_tie": sorted(rank.values()) == [0, 1] and gap <= tol,
    }


def compare(target, drafter, prompts, max_new_tokens, block_size=None) -> dict:
    """DFlash and AR greedy outputs per prompt (batch 1, as infer.py runs them); for each
    prompt where they part, `divergence_at` its first differing position."""
    from dflash_jax.frontend import textgen

    records, spec_s, spec_tok, ar_s, ar_tok = [], 0.0, 0, 0.0, 0
    ties = [0, 0]  # near-tie positions, positions (AR continuations)
    for i, prompt in enumerate(prompts):
        c = textgen.compare(
            target,
            drafter,
            [prompt],
            warmup=False,
            stop_token_ids=(),
            max_new_tokens=max_new_tokens,
            block_size=block_size,
        )
        spec, ar = c.spec, c.ar
        s, r = spec.tokens[0], ar.tokens[0]
        spec_s += spec.stats["decode_s"]
        spec_tok += sum(spec.acceptance_lengths[0])
        ar_s += ar.stats["decode_s"]
        ar_tok += sum(ar.acceptance_lengths[0])
        rec = {"prompt": i, "identical": s == r}
        ties[0], ties[1] = np.add(ties, near_tie_share(target, prompt, r))
        if s != r:
            n = min(len(s), len(r))
            j = next((k for k in range(n) if s[k] != r[k]), n)
            if j < n:
                rec.update(divergence_at(target, list(prompt) + r[:j], r[j], s[j]))
            else:  # one stopped earlier (a stop token differs only in length): report it
                rec.update(position=len(prompt) + j, near_tie=False, length_only=True)
        records.append(rec)
    parted = [r for r in records if not r["identical"]]
    return {
        "prompts": len(records),
        "identical": len(records) - len(parted),
        "divergent": len(parted),
        "near_ties": sum(bool(r.get("near_tie")) for r in parted),
        "records": records,
        "near_tie_positions": int(ties[0]),
        "positions": int(ties[1]),
        "dflash_tokens_per_s": spec_tok / max(spec_s, 1e-9),
        "ar_tokens_per_s": ar_tok / max(ar_s, 1e-9),
    }


def load_prompts(
    tok, prompt_file=None, data_dir="/tmp/dflash_tfds", num_prompts=16, max_prompt_tokens=256
):
    """Token-id prompts: `prompt_file` JSONL, or held-out stdlib code-completion prompts."""
    from dflash_jax.data.prompts import benchmark_prompts

    return benchmark_prompts(tok, prompt_file, data_dir, num_prompts, max_prompt_tokens)


def main(argv):
    del argv
    import jax.numpy as jnp

    import dflash_jax as dj
    from dflash_jax.data.tokenizer import load_tokenizer
    from dflash_jax.frontend import textgen

    if FLAGS.out:
        from dflash_jax.support.checks import writable_file

        writable_file(FLAGS.out, "--out")
    prompts = load_prompts(
        load_tokenizer(FLAGS.target),
        FLAGS.prompt_file,
        FLAGS.data_dir,
        FLAGS.num_prompts,
        FLAGS.max_prompt_tokens,
    )
    out = {
        "target": FLAGS.target,
        "drafter": FLAGS.drafter,
        "max_new_tokens": FLAGS.max_new_tokens,
        "settings": {},
    }
    for name, kw in SETTINGS.items():
        target = dj.load_target(FLAGS.target, **kw)
        drafter = dj.load_drafter(FLAGS.drafter, target=target)
        cfg = target.config
        textgen.warm_up(
            target,
            drafter,
            prompts[:1],
            compare_ar=True,  # compiles both
            max_new_tokens=FLAGS.max_new_tokens,
            block_size=FLAGS.block_size,
        )
        res = compare(target, drafter, prompts, FLAGS.max_new_tokens, FLAGS.block_size)
        res["kv_cache_bytes_per_token"] = (
            2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
        )
        out["settings"][name] = res
        print(
            f"\n{name}: DFlash == AR on {res['identical']}/{res['prompts']} prompts "
            f"({FLAGS.max_new_tokens} new tokens); {res['divergent']} part, "
            f"{res['near_ties']} of them at a near-tie; near-ties are "
            f"{res['near_tie_positions']}/{res['positions']} of all generated positions"
        )
        for r in res["records"]:
            if r["identical"]:
                continue
            if r.get("length_only"):
                print(f"  prompt {r['prompt']}: same tokens, different length")
                continue
            print(
                f"  prompt {r['prompt']}: position {r['position']}, AR {r['ar_token']} vs "
                f"DFlash {r['dflash_token']} (ranks {r['ranks']}), gap {r['gap']:.4f} "
                f"<= tol {r['tol']:.4f}: {r['gap'] <= r['tol']}; near-tie {r['near_tie']}"
            )
        print(
            f"  decode: DFlash {res['dflash_tokens_per_s']:.0f} tok/s, AR "
            f"{res['ar_tokens_per_s']:.0f} tok/s; KV cache "
            f"{res['kv_cache_bytes_per_token']} bytes/token"
        )
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            from dflash_jax.support import provenance

            json.dump({**out, **provenance.record()}, f, indent=1)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
