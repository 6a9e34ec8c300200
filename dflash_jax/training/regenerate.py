"""Target-generated training responses (DFlash regenerates its responses with the target).

`regenerate(target, prompts, out_path, ...)` runs `dflash_jax.generate` over prompts in fixed-size
batches (greedy or sampled) and writes JSONL records that `dflash_jax.data.build_user_files`
reads: {"prompt": text, "response": text, "prompt_ids": [...], "response_ids": [...]}
(texts only when a tokenizer is given; the ids are the exact tokens the target produced).

CLI: python -m dflash_jax.training.regenerate --target=DIR --prompts=FILE.jsonl --out=OUT.jsonl
     (prompts: JSONL with "prompt" text per line; --max_new_tokens, --temperature, --batch_size)
"""

from __future__ import annotations

import json
import os
import time
from typing import List, Optional, Sequence

from dflash_jax import console, distributed
from dflash_jax.decoding import generate


def regenerate(target, prompts: Sequence[Sequence[int]], out_path: str, *,
               max_new_tokens: int = 256, batch_size: int = 32, temperature: float = 0.0,
               top_p: Optional[float] = None, seed: int = 0, stop_token_ids: Sequence[int] = (),
               tokenizer=None, drafter=None, log_every: int = 10, mesh=None) -> List[dict]:
    """Generates a response for each prompt (token-id lists) and writes `out_path` (JSONL).

    Batches have a fixed size (the last one is padded with repeats) so one compiled program
    serves them all. Written atomically (tmp file, then rename). Returns the records.
    `mesh`: generate on it; when it spans several processes, all of them call this with the
    same prompts, process 0 writes the file and all return once it is there.
    """
    records = []
    prompts = [list(map(int, p)) for p in prompts]
    t0 = time.time()
    n_batches = (len(prompts) + batch_size - 1) // batch_size
    bar = console.progress(total=len(prompts), desc="regenerate", unit="prompt")
    for bi in range(n_batches):
        chunk = prompts[bi * batch_size:(bi + 1) * batch_size]
        padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
        res = generate(target, drafter, padded, max_new_tokens, temperature=temperature,
                       top_p=top_p, seed=seed + bi, stop_token_ids=stop_token_ids, mesh=mesh)
        for p, r in zip(chunk, res.tokens[:len(chunk)]):
            rec = {"prompt_ids": p, "response_ids": list(map(int, r))}
            if tokenizer is not None:
                rec = {"prompt": tokenizer.decode(p), "response": tokenizer.decode(r), **rec}
            records.append(rec)
        bar.update(len(chunk))
        if log_every and (bi + 1) % log_every == 0 and bar.disable and distributed.is_primary():
            # No bar (not a terminal, e.g. a log file): a line every `log_every` batches.
            console.say(f"regenerate: {len(records)}/{len(prompts)} responses, "
                        f"{time.time() - t0:.0f}s")
    bar.close()
    if distributed.is_primary():
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, out_path)
    distributed.sync("regenerate: " + os.path.basename(out_path))  # the file is complete
    return records


def read_records(path: str, required=("prompt_ids", "response_ids"),
                 vocab_size: Optional[int] = None) -> List[dict]:
    """The JSON objects of a JSONL file, each checked to hold the `required` keys (id-list
    keys, ending in "_ids", as integer lists within `vocab_size`). Every error is a ValueError
    naming the file and line."""
    from dflash_jax.validation import token_id_list

    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(f"{path}:{n}: not a valid JSON line ({e})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got "
                                 f"{type(rec).__name__}")
            for key in required:
                if key not in rec:
                    raise ValueError(f"{path}:{n}: missing key {key!r} (expected "
                                     f"{', '.join(map(repr, required))})")
                if key.endswith("_ids"):
                    try:
                        rec[key] = token_id_list(key, rec[key], vocab_size,
                                                 allow_empty=key != "prompt_ids")
                    except ValueError as e:
                        raise ValueError(f"{path}:{n}: {e}") from None
            out.append(rec)
    return out


def main(argv):
    del argv
    from absl import flags

    from dflash_jax.data import load_tokenizer
    from dflash_jax.target import load_target

    from dflash_jax import hub

    F = flags.FLAGS
    target_dir = hub.resolve_or_exit(F.target, what="--target")
    console.cli_startup()
    target = load_target(target_dir)
    tok = load_tokenizer(target_dir)
    prompts = [tok.encode(r["prompt"]) for r in read_records(F.prompts, required=("prompt",))]
    regenerate(target, prompts, F.out, max_new_tokens=F.max_new_tokens,
               batch_size=F.batch_size, temperature=F.temperature, seed=F.seed,
               stop_token_ids=(tok.eos_id,), tokenizer=tok)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("target", None, "target model directory (HF format) or hub id",
                        required=True)
    flags.DEFINE_string("prompts", None, "JSONL with a 'prompt' field per line", required=True)
    flags.DEFINE_string("out", None, "output JSONL", required=True)
    flags.DEFINE_integer("max_new_tokens", 256, "response length cap")
    flags.DEFINE_integer("batch_size", 32, "prompts per generate call")
    flags.DEFINE_float("temperature", 0.0, "0 = greedy")
    flags.DEFINE_integer("seed", 0, "sampling seed")
    app.run(main)
