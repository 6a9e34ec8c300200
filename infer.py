"""DFlash speculative decoding from the command line.

  python infer.py                                  # the bundled tiny-code pair, default prompt
  python infer.py --target=DIR --drafter=DIR --prompt="def fib(n):" --compare_ar
  python infer.py --target=DIR --prompt_file=prompts.jsonl --json_out=out.json
  python infer.py --target=DIR --drafter=DIR --profile_dir=/tmp/trace   # XProf / Perfetto trace
"""

import json
import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.abspath(__file__))
# Ends without a newline on purpose: byte-level BPE merges "\n" with the next line's
# indentation, so a prompt cut after "\n" ends on a token the model rarely saw there.
DEFAULT_PROMPT = ('import os\n\n\ndef read_lines(path):\n'
                  '    """Return the list of lines in the file at *path*."""')

FLAGS = flags.FLAGS
flags.DEFINE_string("target", os.path.join(ROOT, "assets/tiny-code/target"),
                    "Hugging Face target directory (Qwen3ForCausalLM / LlamaForCausalLM).")
flags.DEFINE_string("drafter", None, "z-lab DFlash drafter directory; default: the bundled "
                    "drafter when the target is the bundled one, else none (autoregressive).")
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
flags.DEFINE_bool("compare_ar", None, "Also decode autoregressively and report the speedup "
                  "(default: on when a drafter is used).")
flags.DEFINE_string("json_out", None, "Write tokens, texts and stats as JSON here.")
flags.DEFINE_string("profile_dir", None, "Write a jax.profiler trace of the generation here.")
flags.DEFINE_string("dtype", "float32", "Compute dtype (bfloat16 on accelerators).")
flags.DEFINE_string("attention_impl", "xla", "xla | pallas | pallas_interpret | auto.")
flags.DEFINE_bool("stream", None, "Print the completion of a single prompt as tokens are "
                  "committed (an extra, untimed run; default: when stdout is a terminal).")
flags.DEFINE_bool("chat_template", True, "Apply the tokenizer's chat template when present.")
flags.DEFINE_bool("dry_run", False, "Compile the generate programs for a TPU topology from "
                  "abstract params (libtpu, no TPU needed) and print per-device HBM, FLOPs, "
                  "collectives and a roofline projection (dflash_jax/dry_run.py).")
flags.DEFINE_string("topology", "v5e:2x4", "Dry run: v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x4, "
                    "... or cpu:8 (fake CPU devices).")
flags.DEFINE_string("dry_run_model", "qwen3_8b", "Dry run: qwen3_8b, qwen3_4b, llama31_8b, small "
                    "(comma-separated), or a Hugging Face model directory.")
flags.DEFINE_string("mesh", None, "Dry run: ';'-separated meshes, e.g. 'tensor=8;data=2,tensor=4'.")
flags.DEFINE_integer("batch_size", 1, "Dry run: sequences per batch.")
flags.DEFINE_integer("context", 4096, "Dry run: prompt tokens.")
flags.DEFINE_string("tau", "6.5,5.4", "Dry run: acceptance lengths for the projected speedup.")


def _stop_ids(tok, target_dir):
    ids = set()
    if tok is not None:
        ids.add(tok.eos_id)
    gen_cfg = os.path.join(target_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        eos = json.load(open(gen_cfg)).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(i for i in ids if i is not None)


def main(argv):
    del argv
    if FLAGS.dry_run:
        from dflash_jax import dry_run

        # The TPU kernels unless --attention_impl is given ("auto" is "pallas" on a TPU).
        attention = FLAGS.attention_impl if FLAGS["attention_impl"].present else "pallas"
        attention = "pallas" if attention == "auto" else attention
        argv = [f"--topology={FLAGS.topology}", f"--model={FLAGS.dry_run_model}",
                "--mode=infer", f"--mesh={FLAGS.mesh or ''}", f"--batch={FLAGS.batch_size}",
                f"--context={FLAGS.context}", f"--max_new_tokens={FLAGS.max_new_tokens}",
                f"--attention={attention}",
                f"--tau={FLAGS.tau}", f"--json_out={FLAGS.json_out or ''}"]
        if FLAGS.block_size:
            argv.append(f"--block_size={FLAGS.block_size}")
        dry_run.main(argv)  # exits 2 with one line on bad input
        return
    import jax

    import dflash_jax as dj
    from dflash_jax import prompting
    from dflash_jax.data.tokenizer import load_tokenizer

    if not os.path.isdir(FLAGS.target):
        sys.exit(f"target directory {FLAGS.target} not found. The bundled pair lives in "
                 "assets/tiny-code/ (see README: 'Training the bundled pair').")
    drafter_dir = FLAGS.drafter
    bundled = os.path.join(ROOT, "assets/tiny-code")
    if drafter_dir is None and os.path.abspath(FLAGS.target).startswith(bundled):
        drafter_dir = os.path.join(bundled, "drafter")

    target = dj.load_target(FLAGS.target, dtype=FLAGS.dtype, attention_impl=FLAGS.attention_impl)
    drafter = dj.load_drafter(drafter_dir, target=target) if drafter_dir else None
    tok = None
    if os.path.exists(os.path.join(FLAGS.target, "tokenizer.json")):
        tok = load_tokenizer(FLAGS.target)
    if FLAGS.prompt_file:
        items = prompting.read_prompt_file(FLAGS.prompt_file)
    else:
        items = [{"prompt": FLAGS.prompt if FLAGS.prompt is not None else DEFAULT_PROMPT}]
    prompts = prompting.encode_prompts(items, tok, FLAGS.target, FLAGS.chat_template)

    kw = dict(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
              top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed,
              stop_token_ids=_stop_ids(tok, FLAGS.target))
    spec_kw = dict(kw, block_size=FLAGS.block_size, denoise_steps=FLAGS.denoise_steps,
                   confidence_threshold=FLAGS.confidence_threshold)
    compare = FLAGS.compare_ar if FLAGS.compare_ar is not None else drafter is not None
    print(f"target {FLAGS.target}: {target.config.num_layers} layers, hidden "
          f"{target.config.hidden_size}; drafter: {drafter_dir or 'none (autoregressive)'}; "
          f"backend {jax.default_backend()}", flush=True)

    stream_on = FLAGS.stream if FLAGS.stream is not None else sys.stdout.isatty()
    if stream_on and tok is not None and len(prompts) == 1:
        # An untimed run that prints blocks as they are committed (one host callback per step).
        sys.stdout.write("\n" + tok.decode(prompts[0]))
        committed = []

        def stream(chunks):
            before = tok.decode(committed)
            committed.extend(chunks[0])
            sys.stdout.write("\033[1m" + tok.decode(committed)[len(before):] + "\033[0m")
            sys.stdout.flush()

        dj.generate(target, drafter, prompts, stream_callback=stream, **spec_kw)
        print("\n")
    # Warm-up: compiles both programs and runs them once; its timings are not reported.
    dj.generate(target, drafter, prompts, **spec_kw)
    if compare and drafter is not None:
        dj.generate(target, None, prompts, **kw)
    if FLAGS.profile_dir:
        jax.profiler.start_trace(FLAGS.profile_dir)
    res = dj.generate(target, drafter, prompts, **spec_kw)
    if FLAGS.profile_dir:
        jax.profiler.stop_trace()
        print(f"profile written to {FLAGS.profile_dir} (open with TensorBoard's profile plugin, "
              "XProf, or ui.perfetto.dev)")
    ar = dj.generate(target, None, prompts, **kw) if compare and drafter is not None else None

    texts = []
    for i, toks in enumerate(res.tokens):
        text = tok.decode(toks) if tok is not None else None
        texts.append(text)
        print(f"\n=== prompt {i} ===")
        if tok is not None:
            print(tok.decode(prompts[i]) + "\033[1m" + text + "\033[0m")
        else:
            print(prompts[i], "->", toks)
        if ar is not None and ar.tokens[i] != toks:
            print("!!! speculative output differs from autoregressive output")

    s = res.stats
    print(f"\n{'DFlash' if drafter else 'autoregressive'}: {s['new_tokens']} tokens, "
          f"tau {s['tau']:.2f}, {s['decode_tokens_per_s']:.1f} tok/s decode, "
          f"prefill {s['prefill_s'] * 1e3:.1f} ms")
    summary = {"dflash": s}
    if ar is not None:
        speedup = s["decode_tokens_per_s"] / ar.stats["decode_tokens_per_s"]
        print(f"autoregressive: {ar.stats['decode_tokens_per_s']:.1f} tok/s decode; "
              f"speedup {speedup:.2f}x; outputs identical: {ar.tokens == res.tokens}")
        summary.update(autoregressive=ar.stats, speedup=speedup,
                       identical_to_ar=ar.tokens == res.tokens)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"prompts": prompts, "tokens": res.tokens, "texts": texts,
                       "acceptance_lengths": res.acceptance_lengths, **summary}, f, indent=1)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
