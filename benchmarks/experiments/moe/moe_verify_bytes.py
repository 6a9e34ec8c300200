"""How much of a mixture-of-experts target one DFlash verify pass reads, against one
autoregressive step: the fraction of experts touched, the weight bytes per step and the
break-even acceptance length, at block sizes 16 / 8 / 4 (issue 28).

    python benchmarks/experiments/moe/moe_verify_bytes.py [--model=qwen3_30b_a3b] [--batch=1]
        [--blocks=16,8,4,2] [--tau=6.1] [--json_out=benchmarks/results/moe/FILE.json]

A MODEL, not a measurement. Assumptions (stated in the JSON):
- routing is uniform and independent across tokens: a token picks k of E experts, so one
  expert is left untouched by T tokens with probability (1 - k/E)^T and a pass over T tokens
  touches the fraction 1 - (1 - k/E)^T of every MoE layer's experts (real routers are
  skewed and correlated within a block, which touches fewer: this is an upper bound on the
  typical case, exact in expectation only for uniform routing);
- a decode step is bound by weight bytes (batch and block small), and the expert kernels read
  only the experts that have tokens (a grouped matmul that skips empty groups; XLA's dense
  ragged_dot lowering may read them all);
- the KV cache and the drafter's reads are left out of the step bytes except where named
  (`drafter_bytes`), so the projected speedup tau * bytes_AR / (bytes_verify + bytes_drafter)
  is an upper bound under these assumptions.
Parameter bytes come from the preset's abstract parameters (dflash_jax/dry_run/presets.py).
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import app, flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "qwen3_30b_a3b", "a MoE preset of dflash_jax/dry_run/presets.py")
flags.DEFINE_integer("batch", 1, "sequences per step")
flags.DEFINE_string("blocks", "16,8,4,2", "verify block sizes (tokens per sequence per pass)")
flags.DEFINE_float("tau", 6.1, "acceptance length for the projected speedup")
flags.DEFINE_string("json_out", "", "write the result here")


def touched_fraction(tokens: int, top_k: int, num_experts: int) -> float:
    """Expected fraction of one layer's experts that `tokens` uniformly routed tokens touch."""
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def main(argv):
    del argv
    import jax

    from dflash_jax import dry_run
    from dflash_jax.dry_run.presets import abstract_params
    from dflash_jax.support import provenance

    tcfg, dcfg = dry_run.build_configs(FLAGS.model)
    if not tcfg.is_moe:
        raise app.UsageError(f"{FLAGS.model} is not a mixture-of-experts preset")
    tparams, dparams = abstract_params(tcfg, dcfg)
    nbytes = lambda x: math.prod(x.shape) * x.dtype.itemsize
    flat = jax.tree_util.tree_flatten_with_path(tparams)[0]
    expert = sum(nbytes(x) for p, x in flat if "experts" in jax.tree_util.keystr(p))
    embed = sum(nbytes(x) for p, x in flat if "embed_tokens" in jax.tree_util.keystr(p))
    total = sum(nbytes(x) for _, x in flat)
    # One step reads every non-expert weight but the embedding table (one row per token).
    dense = total - expert - embed
    drafter = sum(nbytes(x) for x in jax.tree_util.tree_leaves(dparams))
    e, k = tcfg.num_experts, tcfg.num_experts_per_tok
    ar_frac = touched_fraction(FLAGS.batch, k, e)
    ar_bytes = dense + expert * ar_frac
    rows = []
    for block in [int(b) for b in FLAGS.blocks.split(",")]:
        frac = touched_fraction(FLAGS.batch * block, k, e)
        verify = dense + expert * frac
        rows.append(
            {
                "block_size": block,
                "tokens_per_pass": FLAGS.batch * block,
                "experts_touched_fraction": frac,
                "verify_weight_bytes": verify,
                "verify_over_ar_bytes": verify / ar_bytes,
                # DFlash pays (by bytes) iff tau exceeds this: (verify + drafter) / AR.
                "break_even_tau": (verify + drafter) / ar_bytes,
                # If this block reached tau (capped at the block size): an upper bound, as a
                # smaller block accepts fewer tokens per pass than a larger one.
                "tau_used": min(FLAGS.tau, block),
                "speedup_if_tau": min(FLAGS.tau, block) * ar_bytes / (verify + drafter),
            }
        )
    out = {
        **provenance.record(),
        "model": FLAGS.model,
        "batch": FLAGS.batch,
        "tau": FLAGS.tau,
        "num_experts": e,
        "num_experts_per_tok": k,
        "param_bytes_total": total,
        "expert_bytes": expert,
        "embedding_bytes": embed,
        "other_weight_bytes": dense,
        "drafter_bytes": drafter,
        "ar_experts_touched_fraction": ar_frac,
        "ar_weight_bytes": ar_bytes,
        "blocks": rows,
        "assumptions": (
            "uniform independent routing (touched = 1 - (1 - k/E)^T); weight-bytes-bound "
            "steps; expert kernels read only experts with tokens; KV cache reads left out; "
            "speedup_if_tau = min(tau, block) * AR bytes / (verify + drafter bytes), an upper "
            "bound for blocks below the one tau was measured at"
        ),
    }
    gb = 1e9
    print(
        f"{FLAGS.model}, batch {FLAGS.batch}: weights {total / gb:.2f} GB "
        f"(experts {expert / gb:.2f}, embedding {embed / gb:.2f}, other {dense / gb:.2f}); "
        f"drafter {drafter / gb:.2f} GB"
    )
    print(f"  AR step: {ar_frac:.3f} of the experts, {ar_bytes / gb:.2f} GB of weights")
    for r in rows:
        print(
            f"  verify block {r['block_size']:>2}: {r['experts_touched_fraction']:.3f} of the "
            f"experts, {r['verify_weight_bytes'] / gb:.2f} GB ({r['verify_over_ar_bytes']:.2f}x "
            f"AR); break-even tau {r['break_even_tau']:.2f}; speedup if tau were "
            f"{r['tau_used']:g}: {r['speedup_if_tau']:.2f}x"
        )
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
