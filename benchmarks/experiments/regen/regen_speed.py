"""Where the time of regenerating training answers goes: the autoregressive batched decode that
`python -m dflash_jax.training.regenerate` runs (`regenerate_chat` -> `dflash_jax.generate(target,
None, prompts, ...)` in fixed-size batches, prompts sorted by length), timed as prefill and
decode apart, per decode step, against the analytic floor of a step.

  nice -n 19 python benchmarks/experiments/regen/regen_speed.py --target=smollm2-135m-instruct \
      --prompts_from=runs/smollm2/responses6.jsonl --num_prompts=64 --max_prompt_len=64 \
      --batch_sizes=16,64 --new_tokens=32 --capacities=384,1024 \
      --json_out=benchmarks/results/smollm2/regen_speed.json

- Prompts: the `prompt_ids` of the first --num_prompts records of --prompts_from (regenerated
  records, or any JSONL with `prompt_ids`) of at most --max_prompt_len tokens (64: the prompt
  bucket of 25 of the 40 batches of 64 of responses6.jsonl), sorted by length as `regenerate_chat` sorts them,
  cut into batches of each --batch_sizes (the last padded with repeats, as regenerate does),
  greedy, stopped at the tokenizer's EOS (--stop) and at each --new_tokens.
- Per case: answer tokens/s (answer tokens over prefill + decode seconds, compile apart),
  prefill s, decode s, ms per decode step (`res.stats`: one step = one token for every row
  still running; the loop runs until the whole batch is done), the row utilization (answer
  tokens / rows x steps: what rows that already stopped, and padded rows, cost), the padded
  prompt length and the cache capacity (`decoding.programs.buffer_sizes`).
- Capacity sweep (--capacities): the first batch of the largest batch size at the smallest
  new_tokens again, its programs built with a larger KV cache (the same tokens): the same steps
  over more cache slots, so the growth of ms/step is what attention over every slot costs
  (the decode attention reads all `capacity` slots every step, masked, whatever the lengths).
- Analytic floor of one decode step at batch B and S cache slots: FLOPs 2 B (linear params +
  V H) + 4 B L Nq D S (attention), bytes = the parameters + 2 L B S K D x dtype size (the K/V
  read); the floor is max(FLOPs / matmul rate, bytes / memory bandwidth), both rates measured
  here (a [B, H] x [H, 8 I] matmul, a 256 MB sum). Given at S = capacity, at S = the live
  slots (the longest prompt + half the steps: what attention over the filled slots would read)
  and without attention.
- Projection (when --prompts_from has response lengths): the whole file regenerated at the
  largest batch size and --project_new_tokens (batches sorted by prompt length, each running
  until its longest recorded answer), timed by the sweep's ms/step and prefill seconds per
  prompt slot as functions of the capacity (`StepModel`), as now and under each proposed
  change (`VARIANTS`: 128-slot capacity rounding, attention over the filled slots only,
  refilling finished rows, both).

Bad flags or input are one `error: ...` line and exit status 2, before any compute.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import List, Optional, Sequence

import numpy as np
from absl import flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS


def define_flags():
    """The flags (defined when run as a script, so tests can import this module)."""
    flags.DEFINE_string("target", "smollm2-135m-instruct", "Target directory, GGUF or name.")
    flags.DEFINE_string("prompts_from", None, "JSONL records with prompt_ids (regenerated).")
    flags.DEFINE_integer("num_prompts", 64, "Prompts: the first records of --prompts_from.")
    flags.DEFINE_integer(
        "max_prompt_len", 0, "Take only prompts of at most this many tokens (0: any length)."
    )
    flags.DEFINE_list("batch_sizes", ["16", "64"], "Prompts per generate call.")
    flags.DEFINE_list("new_tokens", ["32", "64"], "max_new_tokens of each case.")
    flags.DEFINE_list(
        "capacities", [], "Cache slots to rerun the first batch with (capacity sweep)."
    )
    flags.DEFINE_string("dtype", "float32", "The target's compute and parameter dtype.")
    flags.DEFINE_bool("stop", True, "Stop a row at the tokenizer's EOS (as regenerate does).")
    flags.DEFINE_integer("project_new_tokens", 256, "Projection: regenerate's max_new_tokens.")
    flags.DEFINE_string("json_out", None, "Write the results here (JSON).")


def int_list(name: str, values: Sequence[str], lo: int = 1) -> List[int]:
    """A comma-separated flag as distinct ints >= lo (one line for a bad one)."""
    from dflash_jax.support import checks

    out = []
    for v in values:
        try:
            n = int(str(v).strip())
        except ValueError:
            raise ValueError(f"{name}: {v!r} is not an integer") from None
        out.append(checks.int_param(name, n, lo=lo))
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: give distinct values, got {list(values)}")
    return out


def read_prompts(path: str):
    """(prompt ids per record, first-turn response length per record or None) of a JSONL file
    of regenerated records (`prompt_ids`; `turns[0].response_ids` or `response_ids`)."""
    prompts, lengths = [], []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{i}: not JSON") from None
            p = rec.get("prompt_ids") if isinstance(rec, dict) else None
            if not isinstance(p, list) or not p:
                raise ValueError(f"{path}:{i}: no prompt_ids")
            prompts.append([int(t) for t in p])
            turns = rec.get("turns")
            r = turns[0].get("response_ids") if turns else rec.get("response_ids")
            lengths.append(len(r) if isinstance(r, list) else None)
    if not prompts:
        raise ValueError(f"--prompts_from {path}: no records")
    return prompts, lengths


def step_cost(cfg, param_bytes: int, batch: int, slots: float) -> dict:
    """Analytic FLOPs and bytes of one autoregressive decode step of a dense target: every
    linear and the LM head once per row, attention over `slots` cache slots per row."""
    h, d, nq, k = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    per_layer = h * nq * d + 2 * h * k * d + nq * d * h + 3 * h * cfg.intermediate_size
    dense = 2 * batch * (cfg.num_layers * per_layer + cfg.vocab_size * h)
    attn = 4 * batch * cfg.num_layers * nq * d * slots
    itemsize = np.dtype(cfg.dtype).itemsize
    kv = 2 * cfg.num_layers * batch * slots * k * d * itemsize
    return dict(
        flops=float(dense + attn),
        flops_attention=float(attn),
        bytes=float(param_bytes + kv),
        bytes_kv=float(kv),
    )


def floor_ms(cost: dict, rates: dict) -> float:
    """The roofline floor of a step: max(FLOPs / matmul rate, bytes / bandwidth), in ms."""
    return 1e3 * max(cost["flops"] / rates["flops_per_s"], cost["bytes"] / rates["bytes_per_s"])


def machine_rates(cfg, batch: int) -> dict:
    """What this machine does now (under whatever else runs): a [B, H] x [H, 8 I] matmul in the
    target's dtype (FLOP/s) and a 256 MB float32 sum (bytes/s); the best of a few runs."""
    import jax
    import jax.numpy as jnp

    def best(f, *args, n=5):
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        return min(times)

    a = jnp.ones((batch, cfg.hidden_size), cfg.dtype)
    w = jnp.ones((cfg.hidden_size, 8 * cfg.intermediate_size), cfg.dtype)
    mm = best(jax.jit(lambda a, w: a @ w), a, w, n=20)
    x = jnp.ones((64 * 1024 * 1024,), jnp.float32)
    bw = best(jax.jit(jnp.sum), x)
    return dict(
        flops_per_s=2 * a.shape[0] * w.shape[0] * w.shape[1] / mm,
        bytes_per_s=4 * x.size / bw,
        matmul_shape=[int(a.shape[0]), int(w.shape[0]), int(w.shape[1])],
    )


def _run_batch(target, prompts, new_tokens, stop, capacity: Optional[int] = None):
    """One batch through the library's own programs: `dflash_jax.generate`, or (capacity
    given) the same request with its programs built for `capacity` cache slots. Returns
    (GenerationResult, (p_pad, capacity))."""
    from dflash_jax.decoding import generation as gen
    from dflash_jax.decoding.request import Request, collect
    from dflash_jax.models import attention as attn_lib

    request = Request.build(target.config, None, prompts, new_tokens, stop_token_ids=stop)
    args, (b, p_pad, n_buf, cap) = gen._inputs(request)
    if capacity is None:
        res = gen.generate(target, None, prompts, new_tokens, stop_token_ids=stop)
        return res, (p_pad, cap)
    if capacity < p_pad + n_buf + 1:
        raise ValueError(
            f"--capacities: {capacity} slots cannot hold a {p_pad}-token prompt bucket and "
            f"{n_buf} new tokens (at least {p_pad + n_buf + 1})"
        )
    plan = request.plan(attn_lib.for_devices(target.attention_impl, None))
    (prefill_x, decode_x, _), compile_s = gen._programs(
        target, None, plan, args, (b, p_pad, n_buf, capacity), None
    )
    state, times = gen._run(prefill_x, decode_x, target.params, None, args, None)
    res = collect(state, plan, b, prefill_s=times[0], decode_s=times[1], compile_s=compile_s)
    return res, (p_pad, capacity)


def run_case(target, prompts, batch, new_tokens, stop, capacity=None, max_batches=None) -> dict:
    """The prompts (sorted) in batches of `batch`, timed: one case's figures."""
    tot = dict(prefill_s=0.0, decode_s=0.0, compile_s=0.0, steps=0, answer_tokens=0, rows=0)
    row_steps, live, p_pads, caps = 0, [], set(), set()
    starts = list(range(0, len(prompts), batch))[:max_batches]
    tokens = []
    for b0 in starts:
        chunk = prompts[b0 : b0 + batch]
        padded = chunk + [chunk[-1]] * (batch - len(chunk))
        res, (p_pad, cap) = _run_batch(target, padded, new_tokens, stop, capacity)
        s = res.stats
        for k in ("prefill_s", "decode_s", "compile_s"):
            tot[k] += s[k]
        tot["steps"] += s["steps"]
        tot["answer_tokens"] += sum(len(r) for r in res.tokens[: len(chunk)])
        tot["rows"] += len(chunk)
        row_steps += batch * (s["steps"] + 1)  # the prefill gives every row its first token
        live.append(max(len(p) for p in padded) + (s["steps"] + 1) / 2)
        p_pads.add(p_pad)
        caps.add(cap)
        tokens += res.tokens[: len(chunk)]
    run_s = tot["prefill_s"] + tot["decode_s"]
    return dict(
        batch=batch,
        new_tokens=new_tokens,
        batches=len(starts),
        **tot,
        p_pad=sorted(p_pads),
        capacity=sorted(caps),
        answer_tokens_per_s=tot["answer_tokens"] / max(run_s, 1e-9),
        decode_ms_per_step=1e3 * tot["decode_s"] / max(tot["steps"], 1),
        prefill_share=tot["prefill_s"] / max(run_s, 1e-9),
        row_utilization=tot["answer_tokens"] / max(row_steps, 1),
        live_slots=float(np.mean(live)),
        tokens=tokens,
    )


def with_floor(case: dict, cfg, param_bytes: int, rates: dict) -> dict:
    """The case with the analytic step cost and floors at its capacity and its live slots."""
    cap = max(case["capacity"])
    at_cap = step_cost(cfg, param_bytes, case["batch"], cap)
    at_live = step_cost(cfg, param_bytes, case["batch"], case["live_slots"])
    return dict(
        case,
        step_cost=at_cap,
        floor_ms=floor_ms(at_cap, rates),
        floor_live_ms=floor_ms(at_live, rates),
        floor_no_attention_ms=floor_ms(
            dict(
                flops=at_cap["flops"] - at_cap["flops_attention"],
                bytes=at_cap["bytes"] - at_cap["bytes_kv"],
            ),
            rates,
        ),
    )


class StepModel:
    """Decode ms/step and prefill seconds per prompt slot at the sweep's batch, as functions of
    the cache capacity S: piecewise linear through the measured capacities, extended by the
    line through the two nearest measured points beyond them (the measured growth is
    superlinear, so beyond the largest capacity this is a lower bound)."""

    def __init__(self, sweep: Sequence[dict], kv_bytes_per_slot: float, bytes_per_s: float):
        pts = sorted((max(c["capacity"]), c) for c in sweep)
        self.caps = [float(s) for s, _ in pts]
        self.ms = [c["decode_ms_per_step"] for _, c in pts]
        self.pre = [c["prefill_s"] / (c["batch"] * max(c["p_pad"]) * c["batches"]) for _, c in pts]
        (s0, m0), (s1, m1) = list(zip(self.caps, self.ms))[:2]
        # The step without attention: the line through the two smallest capacities at 0 slots.
        self.no_attention_ms = m0 - s0 * (m1 - m0) / (s1 - s0)
        self.kv_bytes_per_slot, self.bytes_per_s = kv_bytes_per_slot, bytes_per_s

    def _at(self, ys, s: float) -> float:
        xs = self.caps
        if s <= xs[0] or s >= xs[-1]:
            i = 0 if s <= xs[0] else len(xs) - 2
            return ys[i] + (ys[i + 1] - ys[i]) * (s - xs[i]) / (xs[i + 1] - xs[i])
        return float(np.interp(s, xs, ys))

    def step_ms(self, slots: float) -> float:
        return self._at(self.ms, slots)

    def prefill_per_slot(self, slots: float) -> float:
        return max(self._at(self.pre, slots), 0.0)

    def bandwidth_step_ms(self, slots: float) -> float:
        """The step with its attention reading K/V at the measured memory bandwidth."""
        return self.no_attention_ms + 1e3 * slots * self.kv_bytes_per_slot / self.bytes_per_s


def round_up(n: float, tile: int) -> int:
    return int(-(-int(np.ceil(n)) // tile) * tile)


# What the projection compares: the decode as it is, and each proposed change.
VARIANTS = (
    ("as_now", "as regenerate runs now"),
    ("tile_128", "capacity rounded to 128 slots, not 512 (programs.cache_capacity on CPU)"),
    ("live_window", "attention over the filled slots only (rounded up to 128) each step"),
    ("per_row_stop", "a finished row's slot refilled (continuous batching): no idle rows"),
    ("live_window_and_per_row_stop", "both"),
    ("prefill_own_slots", "the prefill attending to the prompt bucket's slots only"),
    ("attention_at_bandwidth", "decode attention reading K/V at the measured bandwidth"),
    ("all", "all four: live window, per-row stop, prefill own slots, attention at bandwidth"),
)


def projection(prompts, lengths, batch, new_tokens, model: StepModel) -> dict:
    """The whole file regenerated at `batch` (sorted by prompt length, as regenerate_chat
    does), each batch running until its longest recorded answer (capped at new_tokens), timed
    by `model`: seconds and answer tokens/s as now and under each of `VARIANTS`."""
    from dflash_jax.decoding.programs import buffer_sizes

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    sec = {name: 0.0 for name, _ in VARIANTS}
    pre_s, answers, hist = 0.0, 0, {}
    for b0 in range(0, len(order), batch):
        idx = order[b0 : b0 + batch]
        lens = [min(lengths[i], new_tokens) for i in idx]
        p_max = max(len(prompts[i]) for i in idx)
        p_pad, n_buf, cap = buffer_sizes(p_max, new_tokens, 1)
        cap128 = round_up(p_pad + n_buf + 1, 128)
        steps = max(lens) - 1  # the prefill gives the first token
        full = sum(lens) / batch - 1  # steps of a batch whose rows are refilled
        pre = batch * p_pad * model.prefill_per_slot(cap)
        pre_own = batch * p_pad * model.prefill_per_slot(model.caps[0])
        live = lambda n: sum(model.step_ms(round_up(p_max + t + 1, 128)) for t in range(n))
        # a refilled batch holds rows at every stage: its live window is about the mean's
        mean_live = round_up(p_max + float(np.mean(lens)) / 2 + 1, 128)
        dec = {
            "as_now": steps * model.step_ms(cap),
            "tile_128": steps * model.step_ms(cap128),
            "live_window": live(steps),
            "per_row_stop": full * model.step_ms(cap),
            "live_window_and_per_row_stop": full * model.step_ms(mean_live),
            "prefill_own_slots": steps * model.step_ms(cap),
            "attention_at_bandwidth": steps * model.bandwidth_step_ms(cap),
            "all": full * model.bandwidth_step_ms(mean_live),
        }
        for name in sec:
            p = pre_own if name in ("prefill_own_slots", "all") else pre
            if name == "tile_128":
                p = batch * p_pad * model.prefill_per_slot(cap128)
            sec[name] += p + dec[name] / 1e3
        pre_s += pre
        answers += sum(lens)
        hist[cap] = hist.get(cap, 0) + 1
    return dict(
        batch=batch,
        new_tokens=new_tokens,
        records=len(prompts),
        answer_tokens=answers,
        prefill_s=pre_s,
        capacity_batches={str(k): v for k, v in sorted(hist.items())},
        variants={
            name: dict(what=what, seconds=sec[name], answer_tokens_per_s=answers / sec[name])
            for name, what in VARIANTS
        },
    )


def main(argv):
    del argv
    from dflash_jax.models import hub
    from dflash_jax.support import checks, provenance

    if not FLAGS.prompts_from:
        raise ValueError("--prompts_from: give a JSONL file of records with prompt_ids")
    if not os.path.isfile(FLAGS.prompts_from):
        raise ValueError(f"--prompts_from: {FLAGS.prompts_from}: no such file")
    checks.int_param("--num_prompts", FLAGS.num_prompts, lo=1)
    checks.int_param("--max_prompt_len", FLAGS.max_prompt_len, lo=0)
    checks.int_param("--project_new_tokens", FLAGS.project_new_tokens, lo=1)
    batches = int_list("--batch_sizes", FLAGS.batch_sizes)
    news = int_list("--new_tokens", FLAGS.new_tokens)
    caps = int_list("--capacities", FLAGS.capacities)
    if not batches or not news:
        raise ValueError("--batch_sizes and --new_tokens: give one or more values")
    if FLAGS.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {FLAGS.dtype!r}")
    if FLAGS.json_out:
        checks.writable_file(FLAGS.json_out, "--json_out")
    target_dir = hub.resolve_or_exit(FLAGS.target, what="--target")
    all_prompts, lengths = read_prompts(FLAGS.prompts_from)
    cut = FLAGS.max_prompt_len
    prompts = [p for p in all_prompts if not cut or len(p) <= cut][: FLAGS.num_prompts]
    if not prompts:
        raise ValueError(f"--prompts_from: no prompt of at most {cut} tokens")
    prompts = sorted(prompts, key=len)  # regenerate_chat's order

    from dflash_jax.data import load_tokenizer
    from dflash_jax.models.target import load_target
    from dflash_jax.support import console

    console.cli_startup()
    import jax

    t0 = time.perf_counter()
    target = load_target(target_dir, dtype=FLAGS.dtype)
    load_s = time.perf_counter() - t0
    cfg = target.config
    stop = (int(load_tokenizer(target_dir).eos_id),) if FLAGS.stop else ()
    param_bytes = int(sum(x.nbytes for x in jax.tree_util.tree_leaves(target.params)))
    rates = machine_rates(cfg, max(batches))
    print(
        f"{target_dir}: {cfg.num_layers} layers, {param_bytes / 1e6:.0f} MB of {FLAGS.dtype} "
        f"parameters; {len(prompts)} prompts ({len(prompts[0])}..{len(prompts[-1])} tokens); "
        f"machine now: {rates['flops_per_s'] / 1e9:.0f} GFLOP/s matmul, "
        f"{rates['bytes_per_s'] / 1e9:.1f} GB/s",
        flush=True,
    )
    head = (
        f"{'batch':>5} {'new':>4} {'p_pad':>5} {'cap':>5} {'steps':>5} {'ans tok/s':>9} "
        f"{'prefill s':>9} {'decode s':>8} {'ms/step':>8} {'floor ms':>8} {'live ms':>8} "
        f"{'rows used':>9}"
    )
    print(head)

    def show(c):
        print(
            f"{c['batch']:>5} {c['new_tokens']:>4} {max(c['p_pad']):>5} {max(c['capacity']):>5} "
            f"{c['steps']:>5} {c['answer_tokens_per_s']:>9.1f} {c['prefill_s']:>9.2f} "
            f"{c['decode_s']:>8.2f} {c['decode_ms_per_step']:>8.1f} {c['floor_ms']:>8.1f} "
            f"{c['floor_live_ms']:>8.1f} {c['row_utilization']:>9.2f}",
            flush=True,
        )

    cases = []
    for b in batches:
        for n in news:
            c = with_floor(run_case(target, prompts, b, n, stop), cfg, param_bytes, rates)
            show(c)
            cases.append(c)
    sweep = []
    b_max, n_min = max(batches), min(news)
    base = next(c for c in cases if c["batch"] == b_max and c["new_tokens"] == n_min)
    if caps:
        print(f"capacity sweep: the first batch of {b_max} at {n_min} new tokens")
        first = base  # one batch: the case itself
        if base["batches"] > 1:
            first = run_case(target, prompts, b_max, n_min, stop, max_batches=1)
            first = with_floor(first, cfg, param_bytes, rates)
            show(first)
        sweep.append(first)
        for cap in caps:
            if cap in first["capacity"]:
                continue
            c = run_case(target, prompts, b_max, n_min, stop, capacity=cap, max_batches=1)
            c = with_floor(c, cfg, param_bytes, rates)
            c["same_tokens"] = c["tokens"] == first["tokens"]
            show(c)
            sweep.append(c)
    model = proj = None
    if len({max(c["capacity"]) for c in sweep}) >= 2:
        kv = step_cost(cfg, param_bytes, b_max, 1)["bytes_kv"]
        model = StepModel(sweep, kv, rates["bytes_per_s"])
        at0 = model.no_attention_ms
        print(
            f"decode step at batch {b_max}: ~{at0:.0f} ms without attention (extrapolated); "
            + ", ".join(
                f"{int(s)} slots {m:.0f} ms ({1 - at0 / m:.0%} attention)"
                for s, m in zip(model.caps, model.ms)
            )
        )
        model_rec = dict(batch=b_max, new_tokens=n_min, step_ms_without_attention=at0)
        model_rec.update(capacities=model.caps, step_ms=model.ms, prefill_s_per_slot=model.pre)
        if all(n is not None for n in lengths):
            proj = projection(all_prompts, lengths, b_max, FLAGS.project_new_tokens, model)
            print(
                f"projection, all {proj['records']} records of {FLAGS.prompts_from} at batch "
                f"{b_max}, {FLAGS.project_new_tokens} new tokens (batches by capacity "
                f"{proj['capacity_batches']}; prefill {proj['prefill_s']:.0f} s), answer tok/s:"
            )
            for name, v in proj["variants"].items():
                print(f"  {v['answer_tokens_per_s']:6.1f}  {name}: {v['what']}")
        model = model_rec
    for c in cases + sweep:
        c.pop("tokens", None)  # the sweep may hold a case itself
    rec = dict(
        provenance.record(),
        target=FLAGS.target,
        dtype=FLAGS.dtype,
        prompts_from=FLAGS.prompts_from,
        num_prompts=len(prompts),
        max_prompt_len=cut,
        load_average=list(os.getloadavg()),
        stop_ids=list(stop),
        load_s=load_s,
        param_bytes=param_bytes,
        machine_rates=rates,
        cases=cases,
        capacity_sweep=sweep,
        step_model=model,
        projection=proj,
    )
    if FLAGS.json_out:
        tmp = FLAGS.json_out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f, indent=1)
        os.replace(tmp, FLAGS.json_out)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
