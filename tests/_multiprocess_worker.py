"""One process of a `dflash_jax.launch` group (tests/test_multiprocess.py).

    python -m dflash_jax.launch --num_processes=2 --devices_per_process=4 -- \
        tests/_multiprocess_worker.py generate OUT_DIR
Joins the group, decodes a batch of mixed-length code prompts with the bundled pair on a mesh
over every process's devices (DFlash, with drafts, and autoregressive; DFlash over the bundled
target turned Qwen3-MoE, expert parallel over both processes' devices), prints one
`RESULT {json}` line, then runs infer.py's `main` on the same prompts and mesh with
--json_out=OUT_DIR/infer.json. The single-process reference is computed outside the group, by
the test itself (`reference`, the same pair, prompts and settings).

    ... -- tests/_multiprocess_worker.py die
Process 1 raises after joining; process 0 waits for it in a barrier, deaf to SIGTERM (as a
trainer saving a checkpoint would be): the launcher has to kill it.
"""

import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from dflash_jax.parallel import distributed  # noqa: E402

ASSETS = os.path.join(ROOT, "assets", "tiny-code")
CODE = [
    "def add(a, b):\n    return",
    'import os\n\n\ndef read_lines(path):\n    """Return the list of lines in the file at *path*."""',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):",
]
MAX_NEW = 16
MESH = "data=2,tensor=4"
MOE_MESH = "expert=4,data=2"  # a Qwen3-MoE target, expert parallel across the processes


def moe_target(target):
    """The bundled target turned Qwen3-MoE (tests/_pair.py's `moe_from_dense`)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _pair import moe_from_dense

    return moe_from_dense(target)


def _load_script(name):
    """A script of the repository root (`infer.py`) as a module: scripts are not installed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup():
    """(target, drafter, prompts, generate keywords): the bundled pair in float32, the code
    prompts and infer.py's stop ids (so that its generate calls reuse the programs compiled
    here). Shared by the 2-process run and its single-process reference."""
    import dflash_jax as dj
    from dflash_jax.data.tokenizer import load_tokenizer
    from dflash_jax.frontend import textgen

    target = dj.load_target(os.path.join(ASSETS, "target"), dtype="float32")
    drafter = dj.load_drafter(os.path.join(ASSETS, "drafter"), target=target)
    tok = load_tokenizer(os.path.join(ASSETS, "target"))
    prompts = [tok.encode(c) for c in CODE]
    kw = dict(stop_token_ids=textgen.stop_token_ids(os.path.join(ASSETS, "target"), tok))
    return target, drafter, prompts, kw


def reference():
    """The single-process result, on this process's default device: [tokens, acceptance
    lengths, drafts] (JSON-like lists)."""
    import dflash_jax as dj

    target, drafter, prompts, kw = setup()
    ref = dj.generate(target, drafter, prompts, MAX_NEW, return_drafts=True, **kw)
    moe = dj.generate(moe_target(target), drafter, prompts, MAX_NEW, **kw)
    return [ref.tokens, ref.acceptance_lengths, ref.drafts, [moe.tokens, moe.acceptance_lengths]]


def generate(out_dir):
    import jax
    from absl import app

    import dflash_jax as dj
    from dflash_jax.parallel import sharding

    infer = _load_script("infer")

    assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
    target, drafter, prompts, kw = setup()
    mesh = sharding.make_mesh(**sharding.parse_mesh(MESH))
    got = dj.generate(target, drafter, prompts, MAX_NEW, return_drafts=True, mesh=mesh, **kw)
    got_ar = dj.generate(target, None, prompts, MAX_NEW, mesh=mesh, **kw)
    moe_mesh = sharding.make_mesh(**sharding.parse_mesh(MOE_MESH))
    moe = dj.generate(moe_target(target), drafter, prompts, MAX_NEW, mesh=moe_mesh, **kw)
    out = {
        "process": jax.process_index(),
        "prompt_lens": [len(p) for p in prompts],
        "got": [got.tokens, got.acceptance_lengths, got.drafts],
        "got_ar": got_ar.tokens,
        "moe": [moe.tokens, moe.acceptance_lengths, moe.stats["mesh"]],
        "stats": got.stats,
        "stats_ar": got_ar.stats,
        "ids_file": os.path.join(out_dir, "prompts.jsonl"),
    }
    print("RESULT " + json.dumps(out), flush=True)
    if jax.process_index() == 0:
        with open(out["ids_file"], "w") as f:
            for p in prompts:
                f.write(json.dumps({"ids": p}) + "\n")
    distributed.sync("prompt file written")
    try:  # infer.py as a user runs it, in this process group (already joined)
        app.run(
            infer.main,
            argv=[
                "infer.py",
                f"--prompt_file={out['ids_file']}",
                f"--max_new_tokens={MAX_NEW}",
                f"--mesh={MESH}",
                "--compare_ar=false",
                "--stream=false",
                f"--json_out={os.path.join(out_dir, 'infer.json')}",
            ],
        )
    except SystemExit as e:
        assert not e.code, e.code


def die():
    import jax

    if jax.process_index() == 1:
        # Uncaught: without distributed.initialize's exit hook this process would wait in
        # JAX's shutdown barrier for process 0, itself waiting for it in the barrier below.
        raise RuntimeError("process 1 fails")
    signal.signal(signal.SIGTERM, lambda *a: print("process 0: SIGTERM ignored", flush=True))
    print("process 0: waiting for process 1 in a barrier", flush=True)
    distributed.sync("never reached by process 1")
    print("process 0: barrier passed (unexpected)", flush=True)


if __name__ == "__main__":
    distributed.initialize()
    if sys.argv[1] == "generate":
        generate(sys.argv[2])
    else:
        die()
