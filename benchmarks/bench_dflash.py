"""DFlash vs autoregressive decoding on held-out code prompts: tau, acceptance, throughput.

  python benchmarks/bench_dflash.py --target=assets/tiny-code/target \
      --drafter=assets/tiny-code/drafter --out_dir=benchmarks/results/tiny-code

Sweeps block sizes, temperatures, denoise steps and batch sizes; for each setting runs DFlash and
the autoregressive baseline side by side (same process, same prompts), after a warm-up that
compiles both programs (compile time is reported apart), `--repeats` times, and reports medians.
Writes results.json, results.md (a Markdown table) and PNG plots (acceptance-length histogram,
per-position acceptance, speedup per setting).

Prompts: functions cut from the held-out (validation) files of the Python standard library
corpus (`dflash_jax.data.prompts.benchmark_prompts`), never from training files; or
`--prompt_file` JSONL.

Committed results: `python benchmarks/bench_dflash.py --target=assets/tiny-code/target
--drafter=assets/tiny-code/drafter --out_dir=benchmarks/results/tiny-code --num_prompts=100
--max_new_tokens=64 --repeats=3` (`benchmarks/results/tiny-code/results.{json,md}`, the plots
beside them).
"""

import itertools
import json
import os

import numpy as np
from absl import flags

from benchmarks import text_quality  # noqa: E402
from dflash_jax.support import provenance  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "assets/tiny-code/target", "Target directory or hub id.")
flags.DEFINE_string("drafter", "assets/tiny-code/drafter", "Drafter directory or hub id.")
flags.DEFINE_string("out_dir", "benchmarks/results/tiny-code", "Where results go.")
flags.DEFINE_string("prompt_file", None, "JSONL prompts instead of the held-out stdlib prompts.")
flags.DEFINE_string("data_dir", "/tmp/dflash_tfds", "TFDS data dir for the stdlib corpus.")
flags.DEFINE_integer("num_prompts", 100, "Held-out prompts to use.")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens per prompt.")
flags.DEFINE_integer("max_prompt_tokens", 256, "Prompts are cut to their last N tokens.")
flags.DEFINE_list("block_sizes", ["4", "8", "16"], "Block sizes.")
flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures.")
flags.DEFINE_list("denoise_steps", ["1", "2"], "Drafter denoising passes.")
flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
flags.DEFINE_integer("repeats", 3, "Timed repeats (median reported).")
flags.DEFINE_bool("quick", False, "A few prompts and settings (smoke run).")


def load_prompts(tok):
    from dflash_jax.data.prompts import benchmark_prompts

    prompts = benchmark_prompts(
        tok, FLAGS.prompt_file, FLAGS.data_dir, FLAGS.num_prompts, FLAGS.max_prompt_tokens
    )
    if not prompts:
        raise SystemExit("no prompts")
    return prompts


def run_setting(dj, target, drafter, prompts, batch, **kw):
    """Runs all prompts in batches; returns acceptance lengths, tokens/s and timings."""
    batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    batches = [b for b in batches if len(b) == batch] or batches[:1]
    acc, tokens, seconds, compile_s, outputs = [], 0, 0.0, 0.0, []
    for b in batches:
        res = dj.generate(target, drafter, b, **kw)
        compile_s += res.stats["compile_s"]
        acc += [a for seq in res.acceptance_lengths for a in seq]
        tokens += sum(sum(seq) for seq in res.acceptance_lengths)
        seconds += res.stats["decode_s"]
        outputs += res.tokens
    return {
        "acceptance": acc,
        "tokens": tokens,
        "decode_s": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "compile_s": compile_s,
        "outputs": outputs,
    }


def main(argv):
    del argv
    from dflash_jax.models import hub
    from dflash_jax.support import console

    target_dir = hub.resolve_or_exit(FLAGS.target, what="--target")
    drafter_dir = hub.resolve_or_exit(FLAGS.drafter, what="--drafter")
    console.cli_startup()
    import dflash_jax as dj
    from dflash_jax.frontend import textgen

    target = dj.load_target(target_dir)
    drafter = dj.load_drafter(drafter_dir, target=target)
    text = textgen.load_text(target_dir)  # tokenizer and stop ids, as infer.py uses them
    tok = text.tokenizer
    prompts = load_prompts(tok)
    blocks = [int(x) for x in FLAGS.block_sizes]
    temps = [float(x) for x in FLAGS.temperatures]
    denoise = [int(x) for x in FLAGS.denoise_steps]
    batches = [int(x) for x in FLAGS.batch_sizes]
    if FLAGS.quick:
        prompts, blocks, temps, denoise, batches = (
            prompts[:4],
            blocks[-1:],
            temps[:1],
            denoise[:1],
            batches[:1],
        )
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    print(
        f"{len(prompts)} prompts, median prompt length "
        f"{int(np.median([len(p) for p in prompts]))} tokens",
        flush=True,
    )

    rows, text_stats = [], None
    bar = console.progress(
        total=len(temps) * len(batches) * len(blocks) * len(denoise),
        desc="settings",
        unit="setting",
    )
    for temp, batch in itertools.product(temps, batches):
        common = dict(
            max_new_tokens=FLAGS.max_new_tokens,
            temperature=temp,
            seed=0,
            stop_token_ids=text.stop_token_ids,
        )
        textgen.warm_up(target, None, prompts[:batch], **common)
        ar_runs = [
            run_setting(dj, target, None, prompts, batch, **common) for _ in range(FLAGS.repeats)
        ]
        ar_tps = float(np.median([r["tokens_per_s"] for r in ar_runs]))
        if temp == 0 and text_stats is None:
            # How repetitive the target's own greedy completions are (not a property of DFlash,
            # which reproduces them token for token, checked below).
            ratios = [text_quality.distinct_ngram_ratio(o) for o in ar_runs[0]["outputs"]]
            text_stats = {
                "distinct_4gram_median": float(np.median(ratios)),
                "share_below_0.5": float(np.mean(np.asarray(ratios) < 0.5)),
                "completions": len(ratios),
            }
            print(
                f"greedy completions: distinct-4-gram ratio median "
                f"{text_stats['distinct_4gram_median']:.2f}, "
                f"{100 * text_stats['share_below_0.5']:.0f}% below 0.5",
                flush=True,
            )
        for bs, steps in itertools.product(blocks, denoise):
            bar.update(1)
            if steps > bs - 1:
                continue
            kw = dict(common, block_size=bs, denoise_steps=steps)
            warm = textgen.warm_up(target, drafter, prompts[:batch], **kw)
            runs = [
                run_setting(dj, target, drafter, prompts, batch, **kw) for _ in range(FLAGS.repeats)
            ]
            acc = runs[0]["acceptance"]
            if temp == 0 and runs[0]["outputs"] != ar_runs[0]["outputs"]:
                raise SystemExit(
                    f"bs={bs} denoise={steps} batch={batch}: greedy DFlash output "
                    "differs from autoregressive decoding"
                )
            tps = float(np.median([r["tokens_per_s"] for r in runs]))
            hist = np.bincount(acc, minlength=bs + 1)[1 : bs + 1]
            per_pos = [float(np.mean(np.asarray(acc) > k)) for k in range(1, bs)]
            row = {
                "block_size": bs,
                "temperature": temp,
                "denoise_steps": steps,
                "batch": batch,
                "tau": float(np.mean(acc)),
                "dflash_tokens_per_s": tps,
                "ar_tokens_per_s": ar_tps,
                "speedup": tps / ar_tps,
                "compile_s": warm.stats["compile_s"],
                "steps": len(acc),
                "acceptance_histogram": hist.tolist(),
                "per_position_acceptance": per_pos,
            }
            rows.append(row)
            print(
                f"bs={bs:2d} T={temp:g} denoise={steps} batch={batch}: tau {row['tau']:.2f}  "
                f"DFlash {tps:8.1f} tok/s  AR {ar_tps:8.1f} tok/s  speedup "
                f"{row['speedup']:.2f}x  (compile {row['compile_s']:.1f}s)",
                flush=True,
            )
    bar.close()

    meta = {
        "target": FLAGS.target,
        "drafter": FLAGS.drafter,
        "num_prompts": len(prompts),
        "max_new_tokens": FLAGS.max_new_tokens,
        "repeats": FLAGS.repeats,
        **provenance.record(),  # command, commit, dirty, date, machine, env
        "backend": __import__("jax").default_backend(),
        "greedy_text": text_stats,
        "greedy_identical_to_ar": 0.0 in temps,
    }
    with open(os.path.join(FLAGS.out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    write_markdown(rows, meta, os.path.join(FLAGS.out_dir, "results.md"))
    plot(rows, FLAGS.out_dir)
    print(f"wrote {FLAGS.out_dir}/results.json, results.md and plots")


def write_markdown(rows, meta, path):
    lines = [
        f"Command: `{meta['command']}` ({meta['date']}, commit {meta['commit']}"
        f"{' + uncommitted changes' if meta['dirty'] else ''}, backend {meta['backend']}, "
        f"{meta['num_prompts']} prompts, {meta['max_new_tokens']} new tokens, median of "
        f"{meta['repeats']})",
        "",
    ]
    if meta.get("greedy_text"):
        g = meta["greedy_text"]
        lines += [
            f"Every greedy DFlash completion was token-identical to autoregressive "
            f"decoding. The target's greedy completions: distinct-4-gram ratio median "
            f"{g['distinct_4gram_median']:.2f}, {100 * g['share_below_0.5']:.0f}% of "
            f"{g['completions']} below 0.5 (repetitive).",
            "",
        ]
    lines += [
        "| block | temp | denoise | batch | tau | DFlash tok/s | AR tok/s | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['block_size']} | {r['temperature']:g} | {r['denoise_steps']} | "
            f"{r['batch']} | {r['tau']:.2f} | {r['dflash_tokens_per_s']:.1f} | "
            f"{r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f}x |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main_rows = [r for r in rows if r["denoise_steps"] == 1 and r["batch"] == rows[0]["batch"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in main_rows:
        label = f"bs={r['block_size']}, T={r['temperature']:g}"
        h = np.asarray(r["acceptance_histogram"], float)
        axes[0].plot(np.arange(1, len(h) + 1), h / max(h.sum(), 1), marker="o", label=label)
        axes[1].plot(
            np.arange(1, r["block_size"]), r["per_position_acceptance"], marker="o", label=label
        )
    axes[0].set(
        xlabel="tokens committed per target pass",
        ylabel="fraction of steps",
        title="Acceptance-length histogram",
    )
    axes[1].set(
        xlabel="draft position k",
        ylabel="P(draft k accepted)",
        title="Per-position acceptance",
        ylim=(0, 1.02),
    )
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "acceptance.png"), dpi=110)

    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.5), 4))
    labels = [
        f"bs{r['block_size']}\nT{r['temperature']:g} d{r['denoise_steps']}\nB{r['batch']}"
        for r in rows
    ]
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r["speedup"], f"tau {r['tau']:.1f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel="speedup over autoregressive", title="DFlash speedup (decode tok/s ratio)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speedup.png"), dpi=110)


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
