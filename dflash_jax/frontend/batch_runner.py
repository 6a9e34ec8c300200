"""Generation over many prompts: fixed-size batches grouped by length, JSON Lines written as
batches finish, resume, progress, per-prompt and total tau / throughput; `run_and_report`:
what infer.py runs, from model directories and prompt items to the printed report (`report`).

    report = run_prompts(target, drafter, prompts, batch_size=8, out_path="out.jsonl",
                         resume=True, max_new_tokens=128, stop_token_ids=[0])
    report.records   # per prompt, in prompt order: tokens, tau, tokens/s, ... (see `run_prompts`)
    report.totals    # prompts, new_tokens, tau, decode_tokens_per_s, ...

Prompts are sorted by length and cut into batches of `batch_size`, so a batch's padding is
small and every batch has the same shape class (one compiled program per prompt-length
bucket, not per batch). A short last batch is filled with copies of its last prompt, whose
outputs are dropped. Greedy outputs do not depend on the batching (tested against one prompt
at a time); sampled ones use seed + batch number, so they depend on `batch_size`.

Each record is one JSON line: {"index", "prompt_sha", "settings", "prompt_ids", "tokens",
"text" (with a tokenizer), "acceptance_lengths", "tau", "new_tokens", "batch",
"batch_decode_s", "tokens_per_s", "identical_to_ar" (with compare_ar)}; "tau" is null for a
prompt whose every token came from the prefill (max_new_tokens=1: no decode step ran).

The output file is not touched until the first batch is done: its lines (after the lines an
earlier run left, with --resume) go to a temporary file in the same directory that then
replaces the file in one rename; later batches are appended, each batch's lines in one write,
flushed. So a failed check or a crash before the first result leaves an existing file as it
was, and an interrupted run leaves complete records (a torn last line at most, which resume
drops). Resuming reads the file without changing it: every complete line must be a record of
this tool written for the same prompts (`prompt_sha`) and settings (`settings`), and a last line
without a newline must be the start of one (a torn write); anything else is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dflash_jax.decoding.generation import generate
from dflash_jax.drafters import registry
from dflash_jax.frontend import infer_flags, textgen
from dflash_jax.support import checks, console, interrupts


@dataclasses.dataclass
class BatchReport:
    """records: per prompt (prompt order), done in this run or resumed; totals: see
    `summarize`; resumed: how many prompts were taken from an earlier run's file."""

    records: List[dict]
    totals: dict
    resumed: int = 0


def length_batches(lengths: Sequence[int], batch_size: int) -> List[List[int]]:
    """Prompt indices cut into batches of `batch_size` after sorting by length (stable)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def prompt_sha(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def settings_key(settings: dict) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _is_primary() -> bool:
    import jax

    return jax.process_index() == 0


def run_settings(
    gen_kw: dict, batch_size: int, with_drafter: bool, extra: Optional[dict] = None
) -> str:
    """The `settings` key of `run_prompts`' records: what must match for --resume."""
    gen = dict(gen_kw)
    seed = int(gen.pop("seed", 0))
    if gen.get("mesh") is not None:  # the layout, not device objects
        gen["mesh"] = dict(gen["mesh"].shape)
    return settings_key(
        {
            "gen": gen,
            "seed": seed,
            "batch_size": batch_size,
            "drafter": with_drafter,
            **(extra or {}),
        }
    )


# How every record line starts (json.dumps keeps the key order of `run_prompts`' dicts): the
# one thing a torn last line (a write cut short) must show to be taken for this tool's.
RECORD_START = b'{"index": '


def _check_record(path, n, line: bytes, prompts, settings) -> dict:
    try:
        rec = json.loads(line)
        i = int(rec["index"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"{path}:{n}: not a record of this tool; remove the file or choose another --json_out"
        ) from None
    if not 0 <= i < len(prompts) or rec.get("prompt_sha") != prompt_sha(prompts[i]):
        raise ValueError(
            f"{path}:{n}: written for a different prompt {i} (another prompt "
            "file?); remove it or choose another --json_out to start afresh"
        )
    if rec.get("settings") != settings:
        raise ValueError(
            f"{path}:{n}: written with other generation settings (model, "
            "max_new_tokens, temperature, seed, block size, batch size ...); "
            "rerun with the same flags or choose another --json_out"
        )
    return rec


def read_records(
    path: str, prompts: Sequence[Sequence[int]], settings: str
) -> Tuple[Dict[int, dict], int]:
    """(finished records of an earlier run in `path` by prompt index, the length in bytes of
    its complete lines). Reads only: a torn last line (the run was killed mid-write) is left
    where it is and replaced when the first new batch is written. Raises ValueError (one line)
    when a line is not a record of this tool, or was written for other prompts or settings."""
    done: Dict[int, dict] = {}
    if not os.path.exists(path):
        return done, 0
    with open(path, "rb") as f:
        data = f.read()
    keep = data.rfind(b"\n") + 1  # complete lines only
    lines = data[:keep].split(b"\n")[:-1]
    for n, line in enumerate(lines, 1):  # a blank line is not one of ours either
        rec = _check_record(path, n, line, prompts, settings)
        done[int(rec["index"])] = rec
    tail = data[keep:]
    if tail:
        try:
            json.loads(tail)
            whole = True
        except ValueError:
            whole = False
        if whole:  # a complete line that lost its newline: it must still be a record of ours
            _check_record(path, len(lines) + 1, tail, prompts, settings)
        elif not tail.startswith(RECORD_START):
            raise ValueError(
                f"{path}:{len(lines) + 1}: not a record of this tool; remove the file or "
                "choose another --json_out"
            )
    return done, keep


def read_done(path: str, prompts: Sequence[Sequence[int]], settings: str) -> Dict[int, dict]:
    """Finished records of an earlier run in `path` (JSONL), by prompt index (`read_records`;
    the file is not changed). Raises ValueError (one line) when the file is not this tool's
    or belongs to other prompts or settings."""
    return read_records(path, prompts, settings)[0]


class RecordWriter:
    """The output file of `run_prompts`. The first `write` puts the `keep` first bytes of the
    existing file (an earlier run's complete lines, on resume) and its lines into a temporary
    file in the same directory, which then replaces the file (through a symbolic link: the
    file it names) in one rename; later writes append, one write each, flushed. Nothing
    exists or changes on disk before the first write."""

    def __init__(self, path: str, keep: int = 0):
        self.path = os.path.realpath(path)
        self.keep = keep
        self._f = None

    def write(self, text: str) -> None:
        data = text.encode()
        if self._f is not None:
            self._f.write(data)
            self._f.flush()
            os.fsync(self._f.fileno())
            return
        folder, name = os.path.split(self.path)
        os.makedirs(folder, exist_ok=True)
        prefix = b""
        if self.keep:
            with open(self.path, "rb") as f:
                prefix = f.read(self.keep)
        if os.path.exists(self.path):
            mode = os.stat(self.path).st_mode & 0o7777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(prefix + data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self._f = open(self.path, "ab")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _batch_seed(seed: int, b: int) -> int:
    """seed + b, wrapped into the 64-bit range `generate` accepts."""
    return (seed + b + 2**63) % 2**64 - 2**63


def run_prompts(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    out_path: Optional[str] = None,
    resume: bool = False,
    tokenizer=None,
    compare_ar: bool = False,
    warmup: bool = True,
    profile_dir: Optional[str] = None,
    extra_settings: Optional[dict] = None,
    on_batch: Optional[Callable[[int, List[dict]], None]] = None,
    stream_callback: Optional[Callable[[List[List[int]]], None]] = None,
    **gen_kw,
) -> BatchReport:
    """Runs `generate` over `prompts` (token-id lists) in length-grouped batches.

    gen_kw: `generate` keyword arguments (max_new_tokens, temperature, top_k, top_p, seed,
    stop_token_ids, block_size, denoise_steps, confidence_threshold). The drafter-only ones are
    dropped for the autoregressive comparison (compare_ar), which decodes the same batches.
    warmup: run the first batch once untimed first (compiles, first-run allocations).
    stream_callback: an extra, untimed run over `prompts` before anything else that calls it
    with each step's commits (infer.py prints a single prompt's completion as it comes).
    extra_settings: more values that must match on resume (e.g. model paths).
    on_batch(batch_number, records): called after each batch's lines are written.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        raise ValueError("no prompts")
    settings = run_settings(gen_kw, batch_size, drafter is not None, extra_settings)
    seed = checks.seed_param("seed", gen_kw.pop("seed", 0))  # batch b: seed + b, wrapped
    gen_kw.setdefault("stop_token_ids", ())
    batches = length_batches([len(p) for p in prompts], batch_size)
    done: Dict[int, dict] = {}
    keep = 0
    if out_path and resume:  # read only; the file is replaced when the first batch is done
        done, keep = read_records(out_path, prompts, settings)
    resumed = len(done)
    todo = [(b, [i for i in idx if i not in done]) for b, idx in enumerate(batches)]
    todo = [(b, idx) for b, idx in todo if idx]

    def padded(idx):
        rows = [prompts[i] for i in idx]
        return rows + [rows[-1]] * (batch_size - len(rows))

    if stream_callback is not None:
        generate(target, drafter, prompts, stream_callback=stream_callback, seed=seed, **gen_kw)
    if warmup and todo:
        textgen.warm_up(
            target, drafter, padded(todo[0][1]), compare_ar=compare_ar, seed=seed, **gen_kw
        )
    if profile_dir:
        import jax

        jax.profiler.start_trace(profile_dir)
    # With several processes every one computes the same records; the first one writes them.
    out = RecordWriter(out_path, keep) if out_path and _is_primary() else None
    bar = console.progress(total=len(prompts) - resumed, desc="generate", unit="prompt")
    run_tokens, run_decode_s, run_acc = 0, 0.0, []
    try:
        for b, idx in todo:
            c = textgen.compare(
                target,
                drafter,
                padded(idx),
                compare_ar=compare_ar,
                warmup=False,
                seed=_batch_seed(seed, b),
                **gen_kw,
            )
            res, ar = c.spec, c.ar
            recs = []
            for row, i in enumerate(idx):
                acc = [int(a) for a in res.acceptance_lengths[row]]
                toks = [int(t) for t in res.tokens[row]]
                rec = {
                    "index": i,
                    "prompt_sha": prompt_sha(prompts[i]),
                    "settings": settings,
                    "prompt_ids": prompts[i],
                    "tokens": toks,
                    "acceptance_lengths": acc,
                    "tau": float(np.mean(acc)) if acc else None,  # no decode step ran
                    "new_tokens": len(toks),
                    "batch": b,
                    "batch_decode_s": res.stats["decode_s"],
                    "prefill_s": res.stats["prefill_s"],
                    "compile_s": res.stats["compile_s"],
                    "tokens_per_s": sum(acc) / max(res.stats["decode_s"], 1e-9),
                }
                if tokenizer is not None:
                    rec["text"] = tokenizer.decode(toks)
                if ar is not None:
                    rec["identical_to_ar"] = ar.tokens[row] == res.tokens[row]
                    rec["ar_batch_decode_s"] = ar.stats["decode_s"]
                    rec["ar_decode_tokens"] = int(sum(ar.acceptance_lengths[row]))
                    rec["ar_tokens_per_s"] = rec["ar_decode_tokens"] / max(
                        ar.stats["decode_s"], 1e-9
                    )
                recs.append(rec)
                done[i] = rec
            if out is not None:
                out.write("".join(json.dumps(r) + "\n" for r in recs))
            run_tokens += sum(sum(r["acceptance_lengths"]) for r in recs)
            run_decode_s += res.stats["decode_s"]
            run_acc += [a for r in recs for a in r["acceptance_lengths"]]
            bar.update(len(idx))
            bar.set_postfix_str(
                f"{run_tokens / max(run_decode_s, 1e-9):,.0f} tok/s, "
                f"tau {np.mean(run_acc) if run_acc else 0:.2f}"
            )
            if on_batch is not None:
                on_batch(b, recs)
    finally:
        bar.close()
        if out is not None:
            out.close()
        if profile_dir:
            import jax

            jax.profiler.stop_trace()
    records = [done[i] for i in range(len(prompts))]
    return BatchReport(records=records, totals=summarize(records), resumed=resumed)


def summarize(records: Sequence[dict]) -> dict:
    """Totals over records: tau over every committed block, throughput = committed decode
    tokens / decode time of the distinct batches, per-prompt tau quantiles. Without a decode
    step (max_new_tokens=1: every token came from the prefill) tau and its quantiles are None,
    and so is the speedup."""
    acc = [a for r in records for a in r["acceptance_lengths"]]
    batch_s = {r["batch"]: r["batch_decode_s"] for r in records}
    decode_tokens = sum(acc)
    taus = [r["tau"] for r in records if r["tau"] is not None]
    out = {
        "prompts": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "decode_tokens": decode_tokens,
        "tau": float(np.mean(acc)) if acc else None,
        "decode_s": float(sum(batch_s.values())),
        "decode_tokens_per_s": decode_tokens / max(sum(batch_s.values()), 1e-9),
        "prefill_s": float(sum({r["batch"]: r["prefill_s"] for r in records}.values())),
        "compile_s": float(sum({r["batch"]: r["compile_s"] for r in records}.values())),
        "tau_per_prompt": {
            q: float(np.quantile(taus, p)) if taus else None
            for q, p in (("min", 0), ("median", 0.5), ("max", 1))
        },
    }
    if records and all("identical_to_ar" in r for r in records):
        ar_s = {r["batch"]: r["ar_batch_decode_s"] for r in records}
        ar_tokens = sum(r["ar_decode_tokens"] for r in records)
        out["ar_decode_tokens_per_s"] = ar_tokens / max(sum(ar_s.values()), 1e-9)
        out["speedup"] = (
            out["decode_tokens_per_s"] / max(out["ar_decode_tokens_per_s"], 1e-9)
            if decode_tokens and ar_tokens
            else None  # nothing was decoded: no rate to compare
        )
        out["identical_to_ar"] = all(r["identical_to_ar"] for r in records)
    return out


def model_identity(name: Optional[str]) -> Optional[str]:
    """What a resumed file must match for a model: the real path of a directory (so the same
    model named by another relative path or a link matches, and another model at the same
    relative path elsewhere does not); a hub id as it is."""
    if name is None:
        return None
    return os.path.realpath(name) if os.path.isdir(name) else str(name)


def check_before_loading(
    target_dir: str,
    drafter_dir: Optional[str],
    prompts: Sequence[Sequence[int]],
    gen_kw: dict,
    *,
    dtype: str = "float32",
    param_dtype: Optional[str] = None,
    attention_impl: str = "xla",
    mesh=None,
    quantize: Optional[str] = None,
    quantize_lm_head: bool = False,
    labels: Optional[Sequence[str]] = None,
) -> None:
    """What `generate` would refuse, checked from the config.json files alone (no weights are
    read): the pair's fit, the context length (prompt + max_new_tokens against
    max_position_embeddings), block size and denoise steps against the drafter's, stop ids in
    the vocabulary, the seed and sampling, and the attention implementation on `mesh`'s
    devices (the default backend's without one), the target's quantization_config and the
    `quantize` request (an LM head that is tied cannot be int8). Raises ValueError (one line)."""
    from dflash_jax.decoding.request import Request
    from dflash_jax.models import attention, checkpoint
    from dflash_jax.models.config import ModelConfig
    from dflash_jax.models.safetensors_io import CheckpointError

    source = os.path.join(target_dir, "config.json")
    try:
        tcfg = ModelConfig.from_hf(
            checkpoint.read_config(target_dir),
            dtype=dtype,
            param_dtype=param_dtype,
            source=source,
        )
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    from dflash_jax.models.quantization import check_quantize

    if check_quantize(quantize) is not None or quantize_lm_head:
        if tcfg.quantization is None and quantize is None:
            raise ValueError("quantize_lm_head needs quantize='int8'")
        try:
            tcfg = tcfg.replace(
                quantization="int8", quantize_lm_head=quantize_lm_head or tcfg.quantize_lm_head
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    kind = registry.for_spec(drafter_dir)
    dcfg = kind.read_config(drafter_dir, tcfg, dtype=dtype) if drafter_dir else None
    try:
        attention.for_devices(attention_impl, mesh)
    except ValueError as e:
        raise ValueError(f"attention_impl {attention_impl!r}: {e}") from None
    settings = {k: v for k, v in gen_kw.items() if k in Request.SETTINGS}
    with warnings.catch_warnings():  # generate itself warns (block_size past the drafter's)
        warnings.simplefilter("ignore")
        Request.build(tcfg, dcfg, prompts, gen_kw.get("max_new_tokens"), labels=labels, **settings)
    if mesh is not None:
        from dflash_jax.parallel import sharding

        sharding.check_expert_axis(mesh.shape.get("expert", 1), tcfg.num_experts)


def run_and_report(
    target_dir: str,
    drafter_dir: Optional[str],
    items: Sequence[dict],
    *,
    labels: Optional[Sequence[str]] = None,
    chat_template: bool = True,
    dtype: str = "float32",
    param_dtype: Optional[str] = None,
    quantize: Optional[str] = None,
    quantize_lm_head: bool = False,
    scan_layers: bool = False,
    attention_impl: str = "xla",
    mesh: Optional[str] = None,
    batch_size: Optional[int] = None,
    out_path: Optional[str] = None,
    resume: bool = False,
    compare_ar: bool = False,
    profile_dir: Optional[str] = None,
    stream: Optional[bool] = None,
    target_name: Optional[str] = None,
    drafter_name: Optional[str] = None,
    **gen_kw,
) -> Optional[BatchReport]:
    """What infer.py runs once its flags are checked: prompt items (`prompting`) encoded with
    `target_dir`'s tokenizer, the models loaded, `run_prompts`, and `report.print_run` on stdout.

    mesh: a `sharding.parse_mesh` spec; "" / None: one device, or every device with several
    processes. quantize / quantize_lm_head / scan_layers: `load_target`'s (int8 weight-only;
    the layers as one scan). batch_size: default 8 for several prompts, else 1. stream: print a single
    prompt's completion as it is committed, an extra untimed run (None: when stdout is a
    terminal; never on a mesh). target_name / drafter_name: what the user called the models
    (hub ids), printed and part of the settings a resumed file must match. gen_kw: `generate`'s
    max_new_tokens, temperature, top_k, top_p, seed, block_size, denoise_steps,
    confidence_threshold (stop ids: the target directory's).

    Returns the report, or None when stopped by Ctrl-C during generation (finished batches are
    in `out_path`, as a line on stderr says). Before any model is loaded (ValueError, one line):
    an `out_path` that is a file of a model directory, what `generate` would refuse
    (`check_before_loading`), a `resume` file of other prompts or settings or not of this tool.
    Models are identified for resume by `model_identity`.
    """
    import jax

    from dflash_jax.models.target import load_target
    from dflash_jax.frontend import report
    from dflash_jax.parallel import distributed, sharding

    target_name = target_dir if target_name is None else target_name
    drafter_name = drafter_dir if drafter_name is None else drafter_name
    infer_flags.output_not_input(
        out_path, "--json_out", dirs={"--target": target_dir, "--drafter": drafter_dir}
    )
    if mesh or distributed.is_multiprocess():
        mesh = sharding.make_mesh(**sharding.parse_mesh(mesh or ""))
    else:
        mesh = None
    text = textgen.load_text(target_dir)  # config, tokenizer, stop ids, vocabulary size
    kind = registry.for_spec(drafter_dir)  # --drafter=prompt_lookup[:N-M], a directory
    if drafter_dir:  # its config.json checked against the target's, before the prompts
        kind.read_config(drafter_dir, text.config)
    tok = text.tokenizer
    prompts = text.encode(items, chat_template, labels=labels)
    batch_size = batch_size or (8 if len(prompts) > 1 else 1)
    gen_kw = dict(gen_kw, stop_token_ids=text.stop_token_ids, mesh=mesh)
    check_before_loading(
        target_dir,
        drafter_dir,
        prompts,
        gen_kw,
        dtype=dtype,
        param_dtype=param_dtype,
        attention_impl=attention_impl,
        mesh=mesh,
        quantize=quantize,
        quantize_lm_head=quantize_lm_head,
        labels=labels,
    )
    extra_settings = {
        "target": model_identity(target_name),
        "drafter": model_identity(drafter_name),
        "dtype": dtype,
        "param_dtype": param_dtype,
        "chat_template": chat_template,
    }
    if quantize or quantize_lm_head:  # absent otherwise: files of earlier runs still resume
        extra_settings.update(quantize=quantize, quantize_lm_head=quantize_lm_head)
    if scan_layers:  # the same model; float32 sums in another order, so resumed runs match it
        extra_settings.update(scan_layers=True)
    if resume:  # a file of other prompts or settings is refused before any compute
        read_done(
            out_path,
            prompts,
            run_settings(gen_kw, batch_size, drafter_dir is not None, extra_settings),
        )

    target = load_target(
        target_dir,
        dtype=dtype,
        param_dtype=param_dtype,
        attention_impl=attention_impl,
        quantize=quantize,
        quantize_lm_head=quantize_lm_head,
        scan_layers=scan_layers,
    )
    drafter = kind.load(drafter_dir, target) if drafter_dir else None
    print(
        report.model_line(target_name, target.config, drafter_name, jax.default_backend()),
        flush=True,
    )
    stream = sys.stdout.isatty() if stream is None else stream
    callback = None
    if stream and mesh is None and tok is not None and len(prompts) == 1:
        # The stream callback runs on one device, a host callback per step.
        callback = report.stream_printer(tok, prompts[0])
    # Batches grouped by length; the first is run once untimed (compiles both programs).
    finished: List[int] = []

    def on_batch(b, recs):
        finished.append(b)
        if out_path:  # a batch is in the file: Ctrl-C from now on keeps it (KeyboardInterrupt)
            interrupts.release()

    try:
        rep = run_prompts(
            target,
            drafter,
            prompts,
            batch_size=batch_size,
            out_path=out_path,
            resume=resume,
            tokenizer=tok,
            compare_ar=compare_ar,
            profile_dir=profile_dir,
            extra_settings=extra_settings,
            stream_callback=callback,
            on_batch=on_batch,
            **gen_kw,
        )
        if callback is not None:
            print("\n")
    except KeyboardInterrupt:
        note = report.interrupted_line(out_path, len(finished))
        if note:
            print(note, file=sys.stderr)
        return None
    report.print_run(
        rep,
        prompts,
        tokenizer=tok,
        batch_size=batch_size,
        with_drafter=drafter is not None,
        json_out=out_path,
        profile_dir=profile_dir,
        sampled=float(gen_kw.get("temperature") or 0.0) > 0,
    )
    return rep
