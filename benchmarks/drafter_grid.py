"""tau of one target and its drafters over a grid of decoding settings, by real decoding.

  python benchmarks/drafter_grid.py --target=smollm2-135m-instruct \
      --drafter=assets/smollm2-135m-instruct/drafter --datasets=mt_bench,humaneval \
      --num_prompts=8 --max_new_tokens=128 --batch_size=8 \
      --json_out=benchmarks/results/smollm2/grid.json

`--drafter` takes several, comma-separated (DFlash or EAGLE-3 drafter directories, or
`prompt_lookup[:N-M]`),
measured side by side on the same prompts against the same autoregressive runs: rows are then
`<drafter>:<setting>` (the directory's base name), and a second table gives each drafter's tau
over the first one's, per setting and dataset.

Settings (`--settings`, comma-separated): `t0` / `t1` (temperature 0 or 1), `b16` / `b8` (block
size), then optionally `tree16` / `tree64` (verify a draft tree of that many nodes) or
`denoise2` (two drafter passes), e.g. `t0_b16_tree64`. The first turn of each row (MT-Bench:
turn 1) through the target's chat template, `--batch_size` prompts per `generate` call. Per
temperature and batch the autoregressive baseline runs once, with the same seed as every
setting: at temperature 0 every DFlash output must equal it token for token (counted, and a
failure of the run if not); at 1 the tokens differ (equal in distribution), so only tau is
reported. No timing (on a CPU the verify is compute-bound: `benchmarks/step_costs.py`).

Writes the JSON (provenance, per setting and dataset: tau per response (z-lab's mean), tau over
steps, the acceptance-length histogram, identical outputs), a Markdown table (`.md`) and a bar
chart (`.png`) beside it, whole (all three or none; Ctrl-C / SIGTERM: one line, exit 130 /
143). Flags, datasets and output paths are checked before any model loads (one line, exit 2); a
setting with no drafter steps reports "no data", not a tau of 0.

Committed results: `python benchmarks/drafter_grid.py --target=smollm2-135m-instruct
--drafter=assets/smollm2-135m-instruct/drafter --datasets=mt_bench,humaneval --num_prompts=4
--max_new_tokens=64 --batch_size=4 --json_out=benchmarks/results/smollm2/grid.json`
(`benchmarks/results/smollm2/grid.{json,md,png}`); the DFlash 2 comparison's command
(`benchmarks/results/smollm2/dflash2_vs_dflash.json`) is in
`benchmarks/results/smollm2/README.md` and in its JSON.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys

import numpy as np
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if __name__ == "__main__":  # Ctrl-C / SIGTERM from here on: one line, exit 130 / 143
    from dflash_jax.support import interrupts

    interrupts.guard("interrupted: nothing was written")

from benchmarks import eval_tau  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    """The flags (defined when run as a script, so tests can import this module)."""
    flags.DEFINE_string("target", "smollm2-135m-instruct", "Target directory, GGUF or name.")
    flags.DEFINE_list(
        "drafter",
        ["assets/smollm2-135m-instruct/drafter"],
        "Drafter directories (or prompt_lookup[:N-M]), compared side by side.",
    )
    flags.DEFINE_list("datasets", ["mt_bench", "humaneval"], "Datasets (eval_tau's sources).")
    flags.DEFINE_list(
        "settings",
        ["t0_b16", "t0_b8", "t0_b16_tree16", "t0_b16_tree64", "t0_b16_denoise2", "t1_b16", "t1_b8"],
        "Decoding settings: t{0,1}_b{N}[_tree{B}|_denoise{K}].",
    )
    flags.DEFINE_integer("num_prompts", 8, "Rows per dataset (the first ones).")
    flags.DEFINE_integer("max_new_tokens", 128, "Tokens per response.")
    flags.DEFINE_integer("batch_size", 8, "Prompts per generate call.")
    flags.DEFINE_integer("seed", 0, "Sampling seed (temperature 1).")
    flags.DEFINE_string("json_out", None, "Write the results here (.md and .png beside it).")


SETTING = re.compile(r"t(?P<t>[01])_b(?P<b>\d+)(?:_tree(?P<tree>\d+)|_denoise(?P<k>\d+))?")


def parse_setting(name: str) -> dict:
    """'t0_b16_tree64' -> {temperature, block_size, tree_budget, denoise_steps}; ValueError."""
    m = SETTING.fullmatch(name.strip())
    if m is None:
        raise ValueError(
            f"--settings: {name!r} is not t{{0,1}}_b{{N}}[_tree{{B}}|_denoise{{K}}], "
            "e.g. t0_b16_tree64"
        )
    return {
        "temperature": float(m["t"]),
        "block_size": int(m["b"]),
        "tree_budget": int(m["tree"]) if m["tree"] else None,
        "denoise_steps": int(m["k"]) if m["k"] else 1,
    }


def run_grid(target, drafter, prompts, settings, max_new_tokens, batch_size, stop, seed=0):
    """{setting: {"acceptance": [[...] per prompt], "identical": n or None}} for token-id
    `prompts`, every setting against one autoregressive run per temperature and batch.
    `drafter`: one drafter, or {label: drafter} (then {label: {setting: ...}}, every drafter
    against the same autoregressive runs)."""
    from dflash_jax.decoding.generation import generate

    many = isinstance(drafter, dict)
    drafters = drafter if many else {"": drafter}
    out = {
        label: {name: {"acceptance": [], "identical": 0} for name in settings} for label in drafters
    }
    for b0 in range(0, len(prompts), batch_size):
        batch = prompts[b0 : b0 + batch_size]
        padded = batch + [batch[-1]] * (batch_size - len(batch))  # one program per shape
        ar = {}
        for label, d in drafters.items():
            for name, s in settings.items():
                t = s["temperature"]
                if t not in ar:
                    ar[t] = generate(target, None, padded, max_new_tokens, temperature=t,
                                     seed=seed + b0, stop_token_ids=stop)  # fmt: skip
                res = generate(
                    target, d, padded, max_new_tokens, temperature=t, seed=seed + b0,
                    stop_token_ids=stop, block_size=s["block_size"],
                    tree_budget=s["tree_budget"], denoise_steps=s["denoise_steps"],
                )  # fmt: skip
                n = len(batch)
                got = out[label][name]
                got["acceptance"] += [list(map(int, a)) for a in res.acceptance_lengths[:n]]
                same = sum(a == b for a, b in zip(res.tokens[:n], ar[t].tokens[:n]))
                got["identical"] += same
                if t == 0 and same != n:
                    raise AssertionError(
                        f"{label or 'drafter'} {name}: greedy decoding differs from AR "
                        f"({same}/{n} equal)"
                    )
    for label in drafters:
        for name, s in settings.items():
            if s["temperature"] > 0:
                out[label][name]["identical"] = None  # not expected token for token
    return out if many else out[""]


def drafter_label(spec: str) -> str:
    """A drafter's name in the tables: its directory's base name, or the prompt-lookup spec."""
    from dflash_jax.drafters import prompt_lookup

    looked_up = prompt_lookup.from_spec(spec) is not None  # never by a directory's name
    return spec if looked_up else os.path.basename(os.path.normpath(spec))


NO_DATA = "no data (no drafter steps)"


def fmt_tau(tau) -> str:
    """A tau for the tables, or `NO_DATA` where there were no steps to average."""
    return NO_DATA if tau is None else f"{tau:.3f}"


def ratios(results, labels, settings, datasets) -> str:
    """Markdown: per setting and dataset, each drafter's tau over the first drafter's ("no data"
    where either had no steps)."""
    head = labels[0]
    lines = [
        "| setting | drafter | " + " | ".join(f"{d} tau / {head}'s" for d in datasets) + " |",
        "|---|---|" + "---|" * len(datasets),
    ]
    for name in settings:
        base = results[f"{head}:{name}"]
        for label in labels[1:]:
            per = results[f"{label}:{name}"]
            cells = " | ".join(
                NO_DATA
                if per[d]["tau"] is None or not base[d]["tau"]
                else f"{per[d]['tau'] / base[d]['tau']:.3f}"
                for d in datasets
            )
            lines.append(f"| {name} | {label} | {cells} |")
    return "\n".join(lines) + "\n"


def summarize(acceptance):
    """tau (z-lab's mean over responses), tau over steps, the steps and their histogram of
    acceptance lengths [[...] per prompt]; the taus None where there was no step (no data:
    not a tau of 0)."""
    flat = [a for seq in acceptance for a in seq]
    hist = np.bincount(flat).tolist() if flat else []
    return {
        "tau": eval_tau.tau_per_prompt(acceptance) if flat else None,
        "tau_steps": eval_tau.tau_all_steps(acceptance) if flat else None,
        "steps": len(flat),
        "longest_step": max(flat) if flat else 0,
        "acceptance_histogram": hist,  # index: tokens committed by a step
    }


def markdown(results, datasets) -> str:
    lines = [
        "| setting | " + " | ".join(f"{d} tau" for d in datasets) + " | identical to AR |",
        "|---|" + "---|" * len(datasets) + "---|",
    ]
    for name, per in results.items():
        ident = [per[d]["identical"] for d in datasets]
        shown = (
            "n/a (T=1)"
            if any(i is None for i in ident)
            else f"{sum(ident)}/{sum(per[d]['responses'] for d in datasets)}"
        )
        taus = " | ".join(fmt_tau(per[d]["tau"]) for d in datasets)
        lines.append(f"| {name} | {taus} | {shown} |")
    return "\n".join(lines) + "\n"


def plot(results, datasets, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = np.arange(len(names))
    w = 0.8 / len(datasets)
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.5))
    for i, d in enumerate(datasets):
        ax.bar(x + i * w, [results[n][d]["tau"] or 0.0 for n in names], w, label=d)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(x + w * (len(datasets) - 1) / 2, names, rotation=20)
    ax.set_ylabel("tau (tokens per target pass)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_drafters(dirs, looked_up, target):
    """The drafters of --drafter in order: prompt lookup where `looked_up` has one, else the
    directory loaded by its kind (`drafters.registry`: its config's architectures)."""
    from dflash_jax.drafters import registry

    return [
        pl if pl is not None else registry.for_spec(d).load(d, target)
        for d, pl in zip(dirs, looked_up)
    ]


def resolve_pair(target_flag, drafter_flag):
    """(target directory, drafter specs, their labels, their directories or prompt-lookup
    specs) of --target / --drafter, resolved before anything is loaded; one line for a bad
    one or two drafters of one name."""
    from dflash_jax.models import hub

    target_dir = hub.resolve_or_exit(target_flag, what="--target")
    specs = [d.strip() for d in drafter_flag]
    labels = [drafter_label(d) for d in specs]
    if not specs or len(set(labels)) != len(labels):
        raise ValueError(f"--drafter: give one or more drafters with distinct names, got {specs}")
    from dflash_jax.drafters import prompt_lookup

    dirs = [  # a directory or hub id: which drafter it holds, its config.json says
        d if prompt_lookup.from_spec(d) is not None else hub.resolve_or_exit(d, what="--drafter")
        for d in specs
    ]
    return target_dir, specs, labels, dirs


def load_pair(target_dir, labels, dirs):
    """(target, {label: drafter}, tokenizer, chat renderer, how prompts are rendered, stop
    ids): the target and the drafters of `resolve_pair`, loaded."""
    from dflash_jax.data import load_tokenizer
    from dflash_jax.data.chat import template_renderer
    from dflash_jax.drafters import prompt_lookup
    from dflash_jax.models.target import load_target
    from dflash_jax.support import console

    looked_up = [prompt_lookup.from_spec(d) for d in dirs]  # a bad n-gram range: one line
    console.cli_startup()
    target = load_target(target_dir)
    drafters = dict(zip(labels, load_drafters(dirs, looked_up, target)))
    tok = load_tokenizer(target_dir)
    render, how = template_renderer(target_dir, True)
    return target, drafters, tok, render, how, eval_tau._stop_ids(target_dir, tok)


def chat_prompts(tok, render, turns):
    """Token ids of each row's first user turn through the chat template."""
    return [list(tok.encode(render([{"role": "user", "content": t[0]}], True))) for t in turns]


def output_files(json_out, inputs=()) -> dict:
    """{path: what} of the files a run with --json_out writes (the JSON, the table `.md` and
    the plot `.png` beside it), checked before any model loads (`outputs.check_outputs`: no
    two the same, none an input); {} without --json_out. ValueError, one line."""
    from dflash_jax.support import outputs

    if not json_out:
        return {}
    base, ext = os.path.splitext(json_out)
    if ext.lower() in (".md", ".png"):
        raise ValueError(
            f"--json_out {json_out}: the table (.md) and the plot (.png) go beside it: give a "
            ".json name"
        )
    files = {
        "--json_out": json_out,
        "the table beside --json_out": base + ".md",
        "the plot beside --json_out": base + ".png",
    }
    outputs.check_outputs(files, inputs)
    return files


def nonempty(name: str, values) -> list:
    """The comma-separated flag `name`'s values, stripped; ValueError (one line) when there are
    none or one is empty."""
    got = [str(v).strip() for v in values or []]
    if not got or not all(got):
        raise ValueError(f"{name}: give one or more values, got {','.join(got)!r}")
    return got


def main(argv):
    del argv
    from dflash_jax.support import checks, outputs, provenance

    settings = {name: parse_setting(name) for name in nonempty("--settings", FLAGS.settings)}
    checks.int_param("--num_prompts", FLAGS.num_prompts, lo=1)
    checks.int_param("--max_new_tokens", FLAGS.max_new_tokens, lo=1)
    checks.int_param("--batch_size", FLAGS.batch_size, lo=1)
    checks.seed_param("--seed", FLAGS.seed)
    datasets = nonempty("--datasets", FLAGS.datasets)
    nonempty("--drafter", FLAGS.drafter)
    files = output_files(FLAGS.json_out)
    rows = {d: eval_tau.load_prompts(d, None, "auto", FLAGS.num_prompts) for d in datasets}
    for d, (turns, source) in rows.items():
        if not turns:
            raise ValueError(f"dataset {d} ({source}): no rows, no prompts to decode")
    target_dir, specs, labels, dirs = resolve_pair(FLAGS.target, FLAGS.drafter)
    target, drafters, tok, render, how, stop = load_pair(target_dir, labels, dirs)
    many = len(drafters) > 1
    row = lambda label, name: f"{label}:{name}" if many else name
    results = {row(label, name): {} for label in labels for name in settings}
    for d, (turns, source) in rows.items():
        prompts = chat_prompts(tok, render, turns)
        got = run_grid(
            target, drafters, prompts, settings, FLAGS.max_new_tokens, FLAGS.batch_size, stop,
            FLAGS.seed,
        )  # fmt: skip
        for label in labels:
            for name in settings:
                g = got[label][name]
                r = dict(summarize(g["acceptance"]), identical=g["identical"])
                results[row(label, name)][d] = dict(r, responses=len(prompts), source=source)
                print(
                    f"{d} {row(label, name)}: tau {fmt_tau(r['tau'])} "
                    f"(steps {fmt_tau(r['tau_steps'])})",
                    flush=True,
                )
    table = markdown(results, list(rows))
    if many:
        table += "\n" + ratios(results, labels, settings, list(rows))
    print("\n" + table)
    if FLAGS.json_out:
        rec = dict(
            provenance.record(),
            target=FLAGS.target,
            drafter=FLAGS.drafter if many else FLAGS.drafter[0],
            prompts=how,
            num_prompts=FLAGS.num_prompts,
            max_new_tokens=FLAGS.max_new_tokens,
            batch_size=FLAGS.batch_size,
            settings=settings,
            results=results,
        )
        png = io.BytesIO()
        plot(results, list(rows), png)
        j, md, pic = files.values()
        outputs.write_all({j: json.dumps(rec, indent=1), md: table, pic: png.getvalue()})
        print(f"wrote {j}, {md}, {pic}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
