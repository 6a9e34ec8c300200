"""What infer.py prints about a generation run, as functions the notebook and the benchmarks can
reuse: the model line, a completion streamed as it is committed, one section per prompt, the
totals with the DFlash-vs-autoregressive comparison.

    print(report.model_line("Qwen/Qwen3-8B", target.config, "z-lab/...", jax.default_backend()))
    rep = batch_runner.run_prompts(target, drafter, prompts, batch_size=8, compare_ar=True, ...)
    report.print_run(rep, prompts, tokenizer=tok, batch_size=8, with_drafter=True)
    report.totals_lines(rep.totals, batch_size=8, with_drafter=True)   # the last lines, as text

Completions are bold on a terminal only (`console.style`: not in a file or a pipe, nor with
NO_COLOR set). `out`: the stream written to, default sys.stdout at the time of the call.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional, Sequence

from dflash_jax.support import console

NO_DRAFTER = "none (autoregressive)"
# Printed for tau and the speedup when no decode step ran (max_new_tokens=1: the one token
# comes from the prefill), so there is nothing to average or compare.
NO_DECODE = "n/a (no decode step)"


def _tau(value) -> str:
    return NO_DECODE if value is None else f"{value:.2f}"


def model_line(target_name: str, config, drafter_name: Optional[str], backend: str) -> str:
    """'target NAME: L layers, hidden H[, int8 weights]; drafter: NAME; backend B' (`config`: a
    ModelConfig)."""
    quant = getattr(config, "quantization", None)
    quant = (
        f", {quant} weights" + (" (LM head too)" if config.quantize_lm_head else "")
        if quant
        else ""
    )
    return (
        f"target {target_name}: {config.num_layers} layers, hidden {config.hidden_size}{quant}; "
        f"drafter: {drafter_name or NO_DRAFTER}; backend {backend}"
    )


def stream_printer(tokenizer, prompt: Sequence[int], out=None) -> Callable:
    """Writes the prompt's text now and returns a `stream_callback` for `generate` /
    `run_prompts` (one prompt) that writes each step's newly committed text, in bold on a
    terminal. Text is decoded from all tokens so far, so multi-token characters come out
    whole once complete."""
    out = sys.stdout if out is None else out
    out.write("\n" + tokenizer.decode(prompt))
    committed: List[int] = []

    def callback(chunks):
        before = tokenizer.decode(committed)
        committed.extend(chunks[0])
        out.write(console.style(tokenizer.decode(committed)[len(before) :], out))
        out.flush()

    return callback


def prompt_header(index: int, record: dict, batch_size: int) -> str:
    """'=== prompt I: N tokens, tau T, R tok/s (batch of B) ===' for a `run_prompts` record
    (tau n/a and no rate without a decode step)."""
    rate = "" if record["tau"] is None else f", {record['tokens_per_s']:.1f} tok/s"
    return (
        f"=== prompt {index}: {record['new_tokens']} tokens, tau {_tau(record['tau'])}{rate} "
        f"(batch of {batch_size}) ==="
    )


def completion(tokenizer, prompt: Sequence[int], record: dict, out=None) -> str:
    """The prompt's text and the completion (bold on a terminal); without a tokenizer,
    'PROMPT_IDS -> TOKEN_IDS'."""
    if tokenizer is None:
        return f"{list(prompt)} -> {record['tokens']}"
    out = sys.stdout if out is None else out
    return tokenizer.decode(prompt) + console.style(record["text"], out)


def totals_lines(
    totals: dict, *, batch_size: int, with_drafter: bool, sampled: bool = False
) -> List[str]:
    """The summary of `run_prompts`' totals (`batch_runner.summarize`): tokens, tau (its spread
    over several prompts), decode tokens/s, prefill time; and, when the run was compared with
    autoregressive decoding, its tokens/s, the speedup and whether the outputs were identical.
    Without a decode step (totals["tau"] None) tau, tokens/s and the speedup read n/a.
    `sampled` (T > 0): equality with AR holds in distribution, not token for token; the line
    says what was compared rather than reporting a failure."""
    several = totals["prompts"] > 1
    many = f"{totals['prompts']} prompts in batches of {batch_size}, " if several else ""
    q = totals["tau_per_prompt"]
    decoded = totals["tau"] is not None
    spread = f" (per prompt {q['min']:.2f}..{q['max']:.2f})" if several and decoded else ""
    rate = f"{totals['decode_tokens_per_s']:.1f} tok/s decode, " if decoded else ""
    lines = [
        f"{'DFlash' if with_drafter else 'autoregressive'}: {many}{totals['new_tokens']} tokens, "
        f"tau {_tau(totals['tau'])}{spread}, {rate}"
        f"prefill {totals['prefill_s'] * 1e3:.1f} ms"
    ]
    if "speedup" in totals:
        if totals["speedup"] is None:
            compared = f"speedup {NO_DECODE}"
        else:
            compared = (
                f"{totals['ar_decode_tokens_per_s']:.1f} tok/s decode; "
                f"speedup {totals['speedup']:.2f}x"
            )
        if sampled:
            same = "the same tokens" if totals["identical_to_ar"] else "other tokens"
            lines.append(
                f"autoregressive: {compared}; sampled with the same seed: {same} (at T > 0 "
                "DFlash equals autoregressive sampling in distribution, not token for token)"
            )
        else:
            lines.append(
                f"autoregressive: {compared}; outputs identical: {totals['identical_to_ar']}"
            )
    return lines


def print_run(
    report,
    prompts: Sequence[Sequence[int]],
    *,
    tokenizer,
    batch_size: int,
    with_drafter: bool,
    json_out: Optional[str] = None,
    profile_dir: Optional[str] = None,
    out=None,
    sampled: bool = False,
) -> None:
    """Everything infer.py prints after a `run_prompts` `report`: where the profile went, how
    many prompts were resumed, a section per prompt (with the completion unless it went to
    `json_out`; none for more than 20 prompts written there), the totals, the file written."""
    out = sys.stdout if out is None else out

    def say(line=""):
        print(line, file=out)

    if profile_dir:
        say(
            f"profile written to {profile_dir} (open with TensorBoard's profile plugin, "
            "XProf, or ui.perfetto.dev)"
        )
    if report.resumed:
        say(f"resumed: {report.resumed} of {len(prompts)} prompts were already in {json_out}")
    show = not json_out or len(prompts) <= 20
    for i, rec in enumerate(report.records if show else []):
        say("\n" + prompt_header(i, rec, batch_size))
        if not json_out:  # else the completion is in the file
            say(completion(tokenizer, prompts[i], rec, out))
        if rec.get("identical_to_ar") is False and not sampled:  # greedy: a real difference
            say("!!! speculative output differs from autoregressive output")
    lines = totals_lines(
        report.totals, batch_size=batch_size, with_drafter=with_drafter, sampled=sampled
    )
    say("\n" + "\n".join(lines))
    if json_out:
        say(f"wrote {json_out} ({len(prompts)} JSON lines)")


def interrupted_line(json_out: Optional[str], batches_done: Optional[int] = None) -> Optional[str]:
    """What to tell a user who stopped a run with Ctrl-C (None without a `json_out`);
    batches_done=0: none had finished, so the file was not written."""
    if not json_out:
        return None
    if batches_done == 0:
        return (
            f"\ninterrupted before the first batch finished: {json_out} was not written "
            "(an earlier file is as it was)"
        )
    return f"\ninterrupted: finished batches are in {json_out}; rerun with --resume to continue"
