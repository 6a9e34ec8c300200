"""Writes notebooks/dflash_colab.ipynb (outputs stripped) from the cells below.

    python notebooks/build_notebook.py

Keeping the cells here makes the notebook reviewable as code; tests/test_notebook.py executes
the written notebook with small parameters.
"""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

CELLS = [
    (
        "md",
        """# DFlash speculative decoding in JAX

[dflash-jax](../README.md) runs DFlash (block-diffusion drafts, verified losslessly by the
target) as one compiled JAX program. This notebook, top to bottom:

1. installs the package (keeping the runtime's own `jax[tpu]` / `jax[cuda]`),
2. runs DFlash on the bundled tiny code model and its drafter: a completion, tau, the speedup
   over autoregressive decoding, acceptance plots,
3. (online, big enough runtime) runs a real Qwen3 target with its published z-lab drafter,
   sharded over the available devices,
4. trains a drafter for a few hundred steps with the library's training entry point and plots
   the loss and tau,
5. profiles one generation with `jax.profiler`.

Runtime: Colab TPU (v2-8 / v5e) or GPU; everything also runs on CPU, slowly.""",
    ),
    (
        "code",
        """# Parameters (CI overrides these to keep the run under two minutes on CPU).
INSTALL = True                    # pip-install this repo's requirements (never JAX itself)
REPO_URL = ""                     # git URL of dflash-jax when the notebook runs outside a clone
MAX_NEW_TOKENS = 128
PROMPT = 'class Stack:\\n    def __init__(self):\\n        self._items = []\\n\\n    def push(self, item):'
RUN_ONLINE = True                 # download a real target + drafter when online
HF_TARGET = "Qwen/Qwen3-4B"
HF_DRAFTER = "z-lab/Qwen3-4B-DFlash-b16"
MIN_DEVICE_GB_FOR_ONLINE = 30     # skip the 4B model on smaller runtimes
TRAIN_STEPS = 300
TRAIN_REGEN_PROMPTS = 256
WORKDIR = "/tmp/dflash_notebook\"""",
    ),
    (
        "code",
        """import os, subprocess, sys

def find_repo():
    for d in (os.getcwd(), os.path.dirname(os.getcwd()), "/content/dflash-jax"):
        if os.path.exists(os.path.join(d, "dflash_jax", "__init__.py")):
            return d
    return None

REPO = find_repo()
if REPO is None and REPO_URL:
    subprocess.run(["git", "clone", "-q", REPO_URL, "/content/dflash-jax"], check=True)
    REPO = "/content/dflash-jax"
assert REPO is not None, "run inside a dflash-jax checkout or set REPO_URL"
if INSTALL:
    # Keep the runtime's accelerator build of JAX: install everything else.
    reqs = [l.strip() for l in open(os.path.join(REPO, "requirements.txt"))
            if l.strip() and not l.startswith("#") and not l.startswith(("jax", "jaxlib"))]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *reqs], check=True)
os.chdir(REPO)  # a notebook kernel imports from its working directory ('' on sys.path)
import jax
print("JAX", jax.__version__, "backend:", jax.default_backend(), "devices:", jax.devices())""",
    ),
    (
        "md",
        """## 1. DFlash on the bundled tiny code model

`assets/tiny-code/` holds a small Qwen3-architecture code model trained on the Python standard
library with this repo's `train.py`, and a block-16 DFlash drafter trained on its own outputs.
The speculative output is checked token for token against autoregressive decoding.""",
    ),
    (
        "code",
        """import numpy as np
import dflash_jax as dj
from dflash_jax.frontend import textgen

target = dj.load_target("assets/tiny-code/target")
drafter = dj.load_drafter("assets/tiny-code/drafter", target=target)
text = textgen.load_text("assets/tiny-code/target")  # tokenizer, stop ids
tok = text.tokenizer
prompt = tok.encode(PROMPT)
kw = dict(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=text.stop_token_ids)
# An untimed warm-up (compiles both programs), then DFlash and autoregressive, timed.
c = textgen.compare(target, drafter, [prompt], **kw)
spec, ar = c.spec, c.ar
print(PROMPT + tok.decode(spec.tokens[0]))
print(f"identical to autoregressive: {c.identical}")
print(f"tau {spec.tau:.2f} | DFlash {spec.stats['decode_tokens_per_s']:.0f} tok/s | "
      f"AR {ar.stats['decode_tokens_per_s']:.0f} tok/s | speedup {c.speedup:.2f}x")""",
    ),
    (
        "code",
        """import matplotlib.pyplot as plt
acc = np.asarray(spec.acceptance_lengths[0])
bs = drafter.config.block_size
fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
ax[0].bar(np.arange(1, bs + 1), np.bincount(acc, minlength=bs + 1)[1:] / len(acc))
ax[0].set(xlabel="tokens committed per target pass", ylabel="fraction of steps",
          title=f"Acceptance lengths (tau = {acc.mean():.2f})")
ax[1].plot(np.arange(1, bs), [np.mean(acc > k) for k in range(1, bs)], marker="o")
ax[1].set(xlabel="draft position k", ylabel="P(accepted)", ylim=(0, 1.02),
          title="Per-position acceptance")
plt.tight_layout(); plt.show()""",
    ),
    (
        "md",
        """## 2. A real target with its published drafter (online)

Fetches the target and the z-lab drafter by hub id (`dflash_jax.models.hub`: the Hugging Face cache,
only config, safetensors and tokenizer files; `HF_TOKEN` for gated models), shards the parameters over
the runtime's devices (tensor parallel on a `tensor` mesh axis) and runs the same comparison.
Skipped with a message when offline or when the runtime is too small.""",
    ),
    (
        "code",
        """def device_gb():
    try:
        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("bytes_limit", 0) * jax.device_count() / 2**30
    except Exception:
        return 0.0

def try_online():
    if not RUN_ONLINE:
        return "RUN_ONLINE is False"
    if device_gb() < MIN_DEVICE_GB_FOR_ONLINE:
        return f"runtime has {device_gb():.0f} GB of accelerator memory (< {MIN_DEVICE_GB_FOR_ONLINE})"
    from dflash_jax.models import hub
    try:  # hub id -> local snapshot (config, safetensors, tokenizer files only; HF cache)
        tdir = hub.resolve(HF_TARGET, what="target")
        ddir = hub.resolve(HF_DRAFTER, what="drafter")
    except hub.HubError as e:  # offline, gated, unknown id: one line saying why
        return str(e)
    from dflash_jax.parallel import sharding
    big = dj.load_target(tdir, dtype="bfloat16")
    big_drafter = dj.load_drafter(ddir, target=big)
    mesh = sharding.make_mesh(tensor=-1)
    btext = textgen.load_text(tdir)  # tokenizer (chat template), stop ids
    prompts = btext.encode(
        [{"prompt": "Write a Python function that checks whether a number is prime."},
         {"prompt": "Explain speculative decoding in two sentences."}])
    # Warm-up (compiles), then the sharded DFlash and autoregressive runs, timed.
    c = textgen.compare(big, big_drafter, prompts, max_new_tokens=256,
                        stop_token_ids=btext.stop_token_ids, mesh=mesh)
    print(btext.tokenizer.decode(c.spec.tokens[0])[:500])
    print(f"tau {c.spec.tau:.2f}, speedup {c.speedup:.2f}x, identical: {c.identical}")

why = try_online()
if why:
    print("skipped the online section:", why)""",
    ),
    (
        "md",
        """## 3. Train a drafter with the library entry point

`dflash_jax.training.train_and_evaluate(config, workdir)` is what `train.py` calls. Here it
trains a fresh block-16 drafter for the bundled target from `configs/tiny_code/drafter.py`
(responses regenerated by the target itself, random anchors, the DFlash training mask and
position-decayed loss), evaluating tau with the real `generate` along the way.""",
    ),
    (
        "code",
        """import json, importlib.util
from dflash_jax.training import train_and_evaluate

spec_ = importlib.util.spec_from_file_location("cfg", "configs/tiny_code/drafter.py")
cfg_mod = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(cfg_mod)
config = cfg_mod.get_config()
config.target_path = os.path.abspath("assets/tiny-code/target")
config.num_train_steps = TRAIN_STEPS
config.regen.num_prompts = TRAIN_REGEN_PROMPTS
config.eval_every = max(TRAIN_STEPS // 3, 1)
config.checkpoint_every = max(TRAIN_STEPS // 2, 1)
config.log_every = max(TRAIN_STEPS // 10, 1)
workdir = os.path.join(WORKDIR, "drafter")
summary = train_and_evaluate(config, workdir)
print(summary["status"], "at step", summary["step"], "| last eval:", summary["eval"])""",
    ),
    (
        "code",
        """records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
train = [(r["step"], r["loss"]) for r in records if r["split"] == "train" and "loss" in r]
taus = [(r["step"], r["tau"]) for r in records if "tau" in r]
fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
ax[0].plot(*zip(*train)); ax[0].set(xlabel="step", ylabel="loss", title="Drafter training loss")
if taus:
    ax[1].plot(*zip(*taus), marker="o")
ax[1].set(xlabel="step", ylabel="tau", title="tau with the real generate (held-out prompts)")
plt.tight_layout(); plt.show()""",
    ),
    (
        "md",
        """## 4. Profile one generation

The generation program has `jax.named_scope`s around `draft`, `verify` and `accept`. Open the
trace with TensorBoard's profile plugin (`%load_ext tensorboard`, `%tensorboard --logdir
TRACE_DIR`), XProf, or by loading the `.trace.json.gz` file in https://ui.perfetto.dev.""",
    ),
    (
        "code",
        """trace_dir = os.path.join(WORKDIR, "trace")
with jax.profiler.trace(trace_dir):
    dj.generate(target, drafter, [prompt], **kw)
files = [os.path.join(r, f) for r, _, fs in os.walk(trace_dir) for f in fs]
print("trace files:", *files, sep="\\n  ")""",
    ),
]


def build():
    nb = new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["accelerator"] = "TPU"
    for kind, src in CELLS:
        cell = new_markdown_cell(src) if kind == "md" else new_code_cell(src)
        if kind == "code" and src.startswith("# Parameters"):
            cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    path = os.path.join(HERE, "dflash_colab.ipynb")
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    print("wrote", build())
