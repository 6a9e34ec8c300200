"""DFlash speculative decoding from the command line.

python infer.py                                  # the bundled tiny-code pair, default prompt
python infer.py --target=DIR --drafter=DIR --prompt="def fib(n):" --compare_ar
python infer.py --target=Qwen/Qwen3-8B --drafter=z-lab/Qwen3-8B-DFlash-b16   # hub ids
python infer.py --target=DIR --prompt_file=prompts.jsonl --json_out=out.jsonl --resume
python infer.py --target=DIR --drafter=DIR --profile_dir=/tmp/trace   # XProf / Perfetto trace
"""

import os
import sys

from absl import flags

ROOT = os.path.dirname(os.path.abspath(__file__))
# Ends without a newline on purpose: byte-level BPE merges "\n" with the next line's
# indentation, so a prompt cut after "\n" ends on a token the model rarely saw there.
DEFAULT_PROMPT = (
    "import os\n\n\ndef read_lines(path):\n"
    '    """Return the list of lines in the file at *path*."""'
)

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "target",
    os.path.join(ROOT, "assets/tiny-code/target"),
    "Hugging Face target directory or hub id (Qwen3ForCausalLM / "
    "LlamaForCausalLM), e.g. Qwen/Qwen3-8B.",
)
flags.DEFINE_string(
    "drafter",
    None,
    "z-lab DFlash drafter directory or hub id; default: the "
    "bundled drafter when the target is the bundled one, else none "
    "(autoregressive).",
)
flags.DEFINE_string("prompt", None, "Text prompt (default: a code prompt).")
flags.DEFINE_string("prompt_file", None, "JSONL prompts: {'prompt'|'messages'|'ids': ...} lines.")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate per prompt.")
flags.DEFINE_integer("block_size", None, "Draft block size (default: the drafter's).")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_integer("top_k", None, "Top-k filter of the target distribution when sampling.")
flags.DEFINE_float("top_p", None, "Nucleus filter of the target distribution when sampling.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("denoise_steps", 1, "Drafter denoising passes per block.")
flags.DEFINE_float("confidence_threshold", None, "Trim drafts after the first one below this.")
flags.DEFINE_bool(
    "compare_ar",
    None,
    "Also decode autoregressively and report the speedup "
    "(default: on when a drafter is used and there is no --prompt_file).",
)
flags.DEFINE_string(
    "json_out",
    None,
    "Write one JSON line per prompt here (tokens, text, tau, tokens/s), each batch as it finishes.",
)
flags.DEFINE_bool(
    "resume",
    False,
    "Keep the prompts already in --json_out (an interrupted run) and generate only the rest.",
)
flags.DEFINE_bool("progress", None, "Progress bar on stderr (default: when it is a terminal).")
flags.DEFINE_bool("verbose", False, "Show library log lines (JAX, checkpoint loading).")
flags.DEFINE_string("profile_dir", None, "Write a jax.profiler trace of the generation here.")
flags.DEFINE_string("dtype", "float32", "Compute dtype (bfloat16 on accelerators).")
flags.DEFINE_string(
    "param_dtype",
    None,
    "Weight storage dtype (default: --dtype). bfloat16 "
    "weights with --dtype=float32 give outputs identical to autoregressive "
    "decoding where bfloat16 compute can flip near-ties (README).",
)
flags.DEFINE_string("attention_impl", "xla", "xla | pallas | pallas_interpret | auto.")
flags.DEFINE_bool(
    "stream",
    None,
    "Print the completion of a single prompt as tokens are "
    "committed (an extra, untimed run; default: when stdout is a terminal).",
)
flags.DEFINE_bool("chat_template", True, "Apply the tokenizer's chat template when present.")
flags.DEFINE_bool(
    "dry_run",
    False,
    "Compile the generate programs for a TPU topology from "
    "abstract params (libtpu, no TPU needed) and print per-device HBM, FLOPs, "
    "collectives and a roofline projection (dflash_jax/dry_run/).",
)
flags.DEFINE_string(
    "topology",
    "v5e:2x4",
    "Dry run: v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x4, ... or cpu:8 (fake CPU devices).",
)
flags.DEFINE_string(
    "dry_run_model",
    "qwen3_8b",
    "Dry run: qwen3_8b, qwen3_4b, llama31_8b, small "
    "(comma-separated), or a Hugging Face model directory.",
)
flags.DEFINE_string(
    "mesh",
    None,
    "Device mesh for generate, e.g. 'data=2,tensor=4' (default: "
    "one device; all devices, tensor-parallel, with several processes). Dry run: "
    "';'-separated meshes, e.g. 'tensor=8;data=2,tensor=4'.",
)
flags.DEFINE_bool(
    "distributed",
    False,
    "Call jax.distributed.initialize() (TPU pod / SLURM / "
    "multi-node); automatic under `python -m dflash_jax.launch`.",
)
flags.DEFINE_integer(
    "batch_size",
    None,
    "Prompts per generate call, grouped by length "
    "(default 8); dry run: sequences per batch (default 1).",
)
flags.DEFINE_integer("context", 4096, "Dry run: prompt tokens.")
flags.DEFINE_string("tau", "6.5,5.4", "Dry run: acceptance lengths for the projected speedup.")


def main(argv):
    del argv
    if FLAGS.dry_run:
        from dflash_jax import dry_run

        # The TPU kernels unless --attention_impl is given ("auto" is "pallas" on a TPU).
        attention = FLAGS.attention_impl if FLAGS["attention_impl"].present else "pallas"
        attention = "pallas" if attention == "auto" else attention
        argv = [
            f"--topology={FLAGS.topology}",
            f"--model={FLAGS.dry_run_model}",
            "--mode=infer",
            f"--mesh={FLAGS.mesh or ''}",
            f"--batch={FLAGS.batch_size or 1}",
            f"--context={FLAGS.context}",
            f"--max_new_tokens={FLAGS.max_new_tokens}",
            f"--attention={attention}",
            f"--tau={FLAGS.tau}",
            f"--json_out={FLAGS.json_out or ''}",
        ]
        if FLAGS.block_size:
            argv.append(f"--block_size={FLAGS.block_size}")
        dry_run.main(argv)  # exits 2 with one line on bad input
        return
    # Every flag checked before any model is loaded or anything is computed or written.
    from dflash_jax import console, hub, prompting, serving, validation

    if FLAGS.resume and not FLAGS.json_out:
        raise ValueError("--resume needs --json_out (the file of the interrupted run)")
    if FLAGS.batch_size is not None:
        validation.int_param("--batch_size", FLAGS.batch_size, lo=1)
    if FLAGS.json_out:
        validation.writable_file(FLAGS.json_out, "--json_out")
    if FLAGS.profile_dir:
        validation.writable_dir(FLAGS.profile_dir, "--profile_dir")
    validation.sampling_params(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    validation.confidence_threshold(FLAGS.confidence_threshold)
    validation.int_param("--max_new_tokens", FLAGS.max_new_tokens, lo=1)
    validation.int_param("--denoise_steps", FLAGS.denoise_steps, lo=1)
    if FLAGS.block_size is not None:
        validation.int_param("--block_size", FLAGS.block_size, lo=2, hi=64)
    from dflash_jax.config import as_dtype

    as_dtype(FLAGS.dtype)
    if FLAGS.param_dtype:
        as_dtype(FLAGS.param_dtype)
    labels = None
    if FLAGS.prompt_file:
        items, labels = prompting.read_prompt_file(FLAGS.prompt_file, with_labels=True)
    else:
        items = [{"prompt": FLAGS.prompt if FLAGS.prompt is not None else DEFAULT_PROMPT}]
    # Model locations next (a bad path or an offline hub id is one line, exit 2).
    target_dir = hub.resolve_or_exit(FLAGS.target, what="target")
    drafter_dir = FLAGS.drafter
    bundled = os.path.join(ROOT, "assets/tiny-code")
    if drafter_dir is None and os.path.abspath(target_dir).startswith(bundled):
        drafter_dir = os.path.join(bundled, "drafter")
    if drafter_dir:
        drafter_dir = hub.resolve_or_exit(drafter_dir, what="drafter")
    console.configure_logging(FLAGS.verbose)
    console.set_progress(FLAGS.progress)
    console.quiet_startup()
    import jax

    import dflash_jax as dj
    from dflash_jax import batch_infer, distributed, sharding

    distributed.initialize(FLAGS.distributed)  # before any other JAX call
    if not distributed.is_primary():  # every process computes; the first one reports
        sys.stdout = open(os.devnull, "w")
    mesh = None
    if FLAGS.mesh or distributed.is_multiprocess():
        mesh = sharding.make_mesh(**sharding.parse_mesh(FLAGS.mesh or ""))
    text = serving.load_text(target_dir)  # tokenizer, stop ids, vocabulary size
    tok = text.tokenizer
    prompts = text.encode(items, FLAGS.chat_template, labels=labels)
    batch_size = FLAGS.batch_size or (8 if len(prompts) > 1 else 1)

    kw = dict(
        max_new_tokens=FLAGS.max_new_tokens,
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
        top_p=FLAGS.top_p,
        seed=FLAGS.seed,
        stop_token_ids=text.stop_token_ids,
        mesh=mesh,
    )
    spec_kw = dict(
        kw,
        block_size=FLAGS.block_size,
        denoise_steps=FLAGS.denoise_steps,
        confidence_threshold=FLAGS.confidence_threshold,
    )
    run_kw = dict(
        batch_size=batch_size,
        extra_settings={
            "target": FLAGS.target,
            "drafter": FLAGS.drafter or drafter_dir,
            "dtype": FLAGS.dtype,
            "param_dtype": FLAGS.param_dtype,
            "chat_template": FLAGS.chat_template,
        },
    )
    if FLAGS.resume:  # a file of other prompts or settings is refused before any compute
        batch_infer.read_done(
            FLAGS.json_out,
            prompts,
            batch_infer.run_settings(
                spec_kw, batch_size, drafter_dir is not None, run_kw["extra_settings"]
            ),
        )

    target = dj.load_target(
        target_dir,
        dtype=FLAGS.dtype,
        param_dtype=FLAGS.param_dtype,
        attention_impl=FLAGS.attention_impl,
    )
    drafter = dj.load_drafter(drafter_dir, target=target) if drafter_dir else None
    compare = (
        FLAGS.compare_ar
        if FLAGS.compare_ar is not None
        else (drafter is not None and not FLAGS.prompt_file)
    )
    drafter_name = FLAGS.drafter or drafter_dir or "none (autoregressive)"
    print(
        f"target {FLAGS.target}: {target.config.num_layers} layers, hidden "
        f"{target.config.hidden_size}; drafter: {drafter_name}; "
        f"backend {jax.default_backend()}",
        flush=True,
    )

    stream_on = FLAGS.stream if FLAGS.stream is not None else sys.stdout.isatty()
    stream_on = stream_on and mesh is None  # the stream callback runs on one device
    stream = None
    if stream_on and tok is not None and len(prompts) == 1:
        # An extra untimed run that prints blocks as they are committed (a host callback per
        # step), before the timed ones.
        sys.stdout.write("\n" + tok.decode(prompts[0]))
        committed = []

        def stream(chunks):
            before = tok.decode(committed)
            committed.extend(chunks[0])
            sys.stdout.write(console.style(tok.decode(committed)[len(before) :], sys.stdout))
            sys.stdout.flush()

    # Batches grouped by length; the first is run once untimed (compiles both programs).
    try:
        report = batch_infer.run_prompts(
            target,
            drafter,
            prompts,
            out_path=FLAGS.json_out,
            resume=FLAGS.resume,
            tokenizer=tok,
            compare_ar=compare,
            profile_dir=FLAGS.profile_dir,
            stream_callback=stream,
            **run_kw,
            **spec_kw,
        )
        if stream is not None:
            print("\n")
    except KeyboardInterrupt:
        if FLAGS.json_out:
            print(
                f"\ninterrupted: finished batches are in {FLAGS.json_out}; rerun with "
                "--resume to continue",
                file=sys.stderr,
            )
        sys.exit(130)
    if FLAGS.profile_dir:
        print(
            f"profile written to {FLAGS.profile_dir} (open with TensorBoard's profile plugin, "
            "XProf, or ui.perfetto.dev)"
        )
    if report.resumed:
        print(
            f"resumed: {report.resumed} of {len(prompts)} prompts were already in {FLAGS.json_out}"
        )

    show = not FLAGS.json_out or len(prompts) <= 20
    for i, rec in enumerate(report.records if show else []):
        print(
            f"\n=== prompt {i}: {rec['new_tokens']} tokens, tau {rec['tau']:.2f}, "
            f"{rec['tokens_per_s']:.1f} tok/s (batch of {batch_size}) ==="
        )
        if not FLAGS.json_out:  # else the completion is in the file
            if tok is not None:
                print(tok.decode(prompts[i]) + console.style(rec["text"], sys.stdout))
            else:
                print(prompts[i], "->", rec["tokens"])
        if rec.get("identical_to_ar") is False:
            print("!!! speculative output differs from autoregressive output")

    s = report.totals
    many = f"{s['prompts']} prompts in batches of {batch_size}, " if len(prompts) > 1 else ""
    spread = (
        f" (per prompt {s['tau_per_prompt']['min']:.2f}..{s['tau_per_prompt']['max']:.2f})"
        if len(prompts) > 1
        else ""
    )
    print(
        f"\n{'DFlash' if drafter else 'autoregressive'}: {many}{s['new_tokens']} tokens, "
        f"tau {s['tau']:.2f}{spread}, {s['decode_tokens_per_s']:.1f} tok/s decode, "
        f"prefill {s['prefill_s'] * 1e3:.1f} ms"
    )
    if "speedup" in s:
        print(
            f"autoregressive: {s['ar_decode_tokens_per_s']:.1f} tok/s decode; "
            f"speedup {s['speedup']:.2f}x; outputs identical: {s['identical_to_ar']}"
        )
    if FLAGS.json_out:
        print(f"wrote {FLAGS.json_out} ({len(prompts)} JSON lines)")


if __name__ == "__main__":
    from dflash_jax import cli

    cli.run(main)  # user errors: one line on stderr, exit 2
