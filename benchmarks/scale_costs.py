"""How the cost of a DFlash step, relative to an autoregressive step, falls as the target grows.

  python benchmarks/scale_costs.py --json_out=benchmarks/results/tiny-code/scale_costs.json \
      --plot=benchmarks/results/tiny-code/scale_costs.png
  (--from_json=FILE --plot=PNG redraws the plot of a saved run without timing anything)

DFlash pays for a drafter pass and a (block_size)-token verify pass per step; it wins when that
costs little more than one autoregressive step, i.e. when a target forward is bound by reading
its weights rather than by arithmetic. The bundled 5.8M-parameter target is compute-bound on
this CPU (a block-16 step costs ~4.5 autoregressive steps). This script times both decoders'
compiled loops (`generate`, ms per loop iteration, median of --repeats after a compile run) for
randomly initialised Qwen3-architecture targets of growing width and depth, each with a
2-layer block-16 drafter of its width (the bundled pair's shape), and reports per size: the
step ratio, the speedup at --tau (the bundled pair's measured tau), the tau a 3x speedup needs,
and the ceiling (every draft accepted). Per-iteration cost does not depend on the weights'
values, so random weights time the same as trained ones.

Committed results: `python benchmarks/scale_costs.py
--json_out=benchmarks/results/tiny-code/scale_costs.json
--plot=benchmarks/results/tiny-code/scale_costs.png`.
"""

import json
import os

import numpy as np
from absl import app, flags

from benchmarks.timing import loop_step_ms  # noqa: E402
from dflash_jax.support import provenance  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "sizes",
    ["256x6", "512x8", "1024x12", "1536x16"],
    "Targets as WIDTHxLAYERS (head_dim 64, half as many KV heads, MLP 3x width).",
)
flags.DEFINE_integer("vocab_size", 4096, "Vocabulary (the bundled tokenizer's).")
flags.DEFINE_integer("block_size", 16, "DFlash block size.")
flags.DEFINE_integer("drafter_layers", 2, "Drafter layers.")
flags.DEFINE_integer("drafter_taps", 3, "Target layers tapped.")
flags.DEFINE_float("tau", 4.0, "Mean acceptance length to quote speedups at.")
flags.DEFINE_integer("context", 256, "Prompt tokens.")
flags.DEFINE_integer("tokens", 64, "Tokens generated per timed run.")
flags.DEFINE_integer("repeats", 3, "Timed runs per decoder and size (median).")
flags.DEFINE_string("json_out", None, "Write the figures here.")
flags.DEFINE_string("plot", None, "Write a PNG of step ratio and speedup against size here.")
flags.DEFINE_string("from_json", None, "Only redraw --plot from a JSON this script wrote.")


def parse_size(text):
    try:
        width, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise app.UsageError(f"--sizes entries look like 512x8 (width x layers), got {text!r}")
    if width % 128 or layers < 1:
        raise app.UsageError(f"width must be a multiple of 128 and layers >= 1, got {text!r}")
    return width, layers


def plot(rows, bs, tau, backend, path):
    """Step ratio and speedups against target size, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = np.array([r["params"] / 1e6 for r in rows])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.plot(p, [r["step_over_ar"] for r in rows], "o-")
    a1.axhline(1.0, color="gray", lw=0.8, ls="--")
    a1.set(
        xscale="log",
        xlabel="target parameters (M)",
        ylabel=f"block-{bs} DFlash step / AR step",
        title="cost of one DFlash step",
    )
    a2.plot(p, [r["speedup_at_tau"] for r in rows], "o-", label=f"at tau {tau:g}")
    a2.plot(p, [r["ceiling"] for r in rows], "s--", label=f"ceiling (tau {bs})")
    a2.axhline(1.0, color="gray", lw=0.8, ls="--")
    a2.axhline(3.0, color="C3", lw=0.8, ls=":", label="3x goal")
    a2.set(
        xscale="log",
        yscale="log",
        xlabel="target parameters (M)",
        ylabel="speedup over AR",
        title=f"{backend} speedup model",
    )
    ticks = [0.5, 1, 2, 3, 4, 6, 8, 12, 16]
    a2.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    a2.minorticks_off()
    a2.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    import jax

    import dflash_jax as dj

    if FLAGS.from_json:
        with open(FLAGS.from_json) as f:
            saved = json.load(f)
        if not FLAGS.plot:
            raise app.UsageError("--from_json redraws a plot: give --plot")
        plot(saved["rows"], saved["block_size"], saved["tau"], saved["backend"], FLAGS.plot)
        return
    sizes = [parse_size(s) for s in FLAGS.sizes]
    bs = FLAGS.block_size
    ids = np.random.RandomState(0).randint(0, FLAGS.vocab_size, FLAGS.context).tolist()
    rows = []
    print(
        f"backend {jax.default_backend()}, block {bs}, context {FLAGS.context}, "
        f"{FLAGS.tokens} new tokens, quoting speedups at tau {FLAGS.tau}"
    )
    print(
        "  target | params | AR step ms | DFlash step ms | step/AR | speedup at tau | "
        "tau for 3x | ceiling"
    )
    from dflash_jax.models.target import init_params
    from dflash_jax.support import console

    for width, layers in console.progress(sizes, desc="target sizes", unit="size"):
        heads = width // 64
        cfg = dj.ModelConfig(
            vocab_size=FLAGS.vocab_size,
            hidden_size=width,
            intermediate_size=3 * width,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=max(1, heads // 2),
            head_dim=64,
            max_position_embeddings=FLAGS.context + FLAGS.tokens + 2 * bs,
            tie_word_embeddings=True,
        )
        target = dj.Target(cfg, init_params(cfg, 0))
        dcfg = dj.make_drafter_config(
            cfg,
            num_layers=FLAGS.drafter_layers,
            num_taps=min(FLAGS.drafter_taps, layers),
            block_size=bs,
            mask_token_id=FLAGS.vocab_size - 1,
        )
        drafter = dj.Drafter(dcfg, dj.init_drafter_params(dcfg, 0))
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(target.params))
        ar = loop_step_ms(target, None, ids, FLAGS.tokens, None, FLAGS.repeats)
        step = loop_step_ms(target, drafter, ids, FLAGS.tokens, bs, FLAGS.repeats)
        ratio = step / ar
        row = {
            "width": width,
            "layers": layers,
            "params": int(n_params),
            "ar_step_ms": ar,
            "dflash_step_ms": step,
            "step_over_ar": ratio,
            "speedup_at_tau": FLAGS.tau / ratio,
            "tau_for_3x": 3 * ratio,
            "ceiling": bs / ratio,
        }
        rows.append(row)
        print(
            f"  {width:4d}x{layers:<2d} | {n_params / 1e6:5.1f}M | {ar:10.2f} | {step:14.2f} | "
            f"{ratio:7.2f} | {row['speedup_at_tau']:13.2f}x | {row['tau_for_3x']:10.2f} | "
            f"{row['ceiling']:.1f}x",
            flush=True,
        )
        del target, drafter
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    "backend": jax.default_backend(),
                    "block_size": bs,
                    "tau": FLAGS.tau,
                    "context": FLAGS.context,
                    "tokens": FLAGS.tokens,
                    "rows": rows,
                    **provenance.record(),
                },
                f,
                indent=1,
            )
    if FLAGS.plot:
        plot(rows, bs, FLAGS.tau, jax.default_backend(), FLAGS.plot)


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
