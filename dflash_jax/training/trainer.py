"""One trainer for DFlash drafters (`mode="drafter"`) and small targets (`mode="target"`).

    train_and_evaluate(config, workdir) -> summary dict

builds the experiment (tokenizer, data, models), restores the newest readable checkpoint,
trains with AdamW + warmup-cosine + global-norm clipping on a device mesh (`config.mesh`:
empty for data parallelism over all local devices, or a `sharding` spec such as "fsdp=8" or
"data=2,fsdp=4": the trained parameters, their AdamW moments and the frozen target are then
sharded by the partition rules of `dflash_jax.sharding`; with several processes, e.g. a pod or
`dflash_jax.launch`, the mesh spans all of them and each reads only its data streams, see
`dflash_jax.distributed`), logs progress / TensorBoard / JSONL,
evaluates (per-position draft accuracy, tau with the real `generate`), saves Orbax checkpoints
(periodic, async, keep-N, on SIGTERM/SIGINT), stops cleanly on a NaN loss, and exports the
result (drafter: z-lab format; target: Hugging Face format with its tokenizer).

In target mode, `unlikelihood.weight > 0` adds sequence-level unlikelihood on the model's own
greedy continuations, decoded each step (`dflash_jax.training.unlikelihood`): a fine-tune
against greedy loops.

Config keys: see `default_config()`; experiment files in `configs/` override them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from typing import Any, Callable, List, Optional

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax import console, distributed, hub
from dflash_jax.config import ModelConfig, as_dtype
from dflash_jax.drafter import DFlashDrafter, Drafter, init_drafter_params, make_drafter_config
from dflash_jax.model import Transformer, init_params
from dflash_jax.target import Target, load_target, save_target
from dflash_jax.training import losses, unlikelihood
from dflash_jax.training.checkpointing import Checkpointer
from dflash_jax.training.metrics import MetricsLogger, format_eta


def default_config() -> ml_collections.ConfigDict:
    """Every key the trainer reads, with the paper's drafter recipe as defaults."""
    c = ml_collections.ConfigDict()
    c.mode = "drafter"  # "drafter" | "target"
    c.seed = 0
    # Device mesh: "" = data parallel over all local devices (parameters replicated), or a
    # dflash_jax.sharding spec ("fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2"; -1 = the rest).
    c.mesh = ""
    c.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)
    # Target: a HF directory, or (empty path) a random/fresh model described by target_model.
    c.target_path = ""
    c.target_model = ml_collections.ConfigDict(dict(
        vocab_size=0,  # 0: the tokenizer's vocabulary size
        hidden_size=256, intermediate_size=768, num_layers=6, num_heads=4, num_kv_heads=2,
        head_dim=64, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True,
        init_std=0.0,  # > 0: redraw every weight matrix ~ N(0, init_std) (peaky random targets)
        attn_out_scale=1.0,  # < 1 scales o_proj: a random target close to a bigram model, whose
        # greedy outputs a small drafter learns in seconds (tests)
        init_seed=0))
    c.tokenizer_dir = ""  # default: target_path; in target mode a BPE is trained if empty
    c.tokenizer_vocab_size = 4096
    # Drafter architecture and the DFlash recipe.
    c.drafter = ml_collections.ConfigDict(dict(
        num_layers=5, num_taps=5, block_size=16, mask_token_id=-1,  # -1: tokenizer's / V-1
        intermediate_size=0,  # 0: the target's
        target_layer_ids=(),  # empty: the default spread of num_taps layers
        # Storage dtype of the trained drafter weights, hence of their AdamW moments (float32
        # masters, as SpecForge keeps); compute stays in `dtype`. "": the same as `dtype`.
        param_dtype="float32",
        init_path=""))  # a z-lab drafter directory to continue from
    c.num_anchors = 512  # per sequence (per document of a packed row), as SpecForge
    c.anchors_per_row = 0  # static blocks per packed row, shared by its documents; 0: num_anchors
    c.gamma = 7.0
    c.loss = "ce"  # "ce" | "kl"
    c.mask_schedule = "all"  # "all" | "random"
    c.loss_chunk_anchors = 0  # > 0: drafter logits for this many anchors at a time (memory)
    c.attention_impl = "xla"  # "xla" | "pallas" | "pallas_interpret"
    c.use_segments = True
    # Data.
    c.data = ml_collections.ConfigDict(dict(
        kind="stdlib",  # "stdlib" | "files" | "regenerated" | "synthetic"
        paths=(), data_dir="", max_files=0, validation_percent=3.0,
        include_tests=False,  # stdlib: add its test suites (held-out library files stay out)
        seq_len=3072, batch_size=8, num_epochs=6, shuffle=True, allow_split=True,
        num_shards=0,  # data streams the global batch is made of (0: one per JAX process)
        num_docs=256, doc_len=64))  # synthetic: random-token documents
    c.regen = ml_collections.ConfigDict(dict(
        # "stdlib": random windows of prompt_len tokens of the training files; "functions":
        # code-completion prompts cut from them (context lines, a def header and its first
        # function_body_lines lines, at most prompt_len tokens); "mixed": half of each;
        # "random": random token ids.
        prompt_source="stdlib",
        num_prompts=512, prompt_len=64, max_new_tokens=256, temperature=0.0, batch_size=32,
        function_body_lines=2, functions_per_file=50,
        holdout_fraction=0.05, output="",  # output default: workdir/regenerated.jsonl
        only=False))  # True: write the responses (regen.output) and stop before training
    # Target mode: sequence-level unlikelihood on the model's own greedy continuations
    # (dflash_jax.training.unlikelihood): weight 0 = off. Prompts: `num_prompts` from the
    # training documents ("docs": random windows; "functions": code-completion prompts;
    # "mixed": half each), cut to their last prompt_len tokens; a continuation token inside an
    # n-gram (n = ngram) already generated earlier in it is pushed down by -log(1 - p).
    c.unlikelihood = ml_collections.ConfigDict(dict(
        weight=0.0, batch_size=8, prompt_len=128, max_new_tokens=64, ngram=4,
        prompt_source="mixed", num_prompts=4096))
    # Optimization.
    c.learning_rate = 6e-4
    c.warmup_ratio = 0.04
    c.end_lr_ratio = 0.0
    c.grad_clip = 1.0
    c.weight_decay = 0.0
    c.b1 = 0.9
    c.b2 = 0.999
    c.num_train_steps = -1  # -1: num_epochs over the training tokens
    c.stop_at_step = -1  # stop early (time-sliced jobs); the schedule is unchanged
    # Loop.
    c.log_every = 10
    c.eval_every = 200
    c.eval_batches = 2
    c.eval_num_prompts = 8
    c.eval_prompt_len = 64
    c.eval_max_new_tokens = 64
    c.checkpoint_every = 200
    c.keep_checkpoints = 3
    c.async_checkpoint = True
    c.profile_dir = ""
    c.profile_start_step = 5
    c.profile_num_steps = 3
    c.export = True
    return c


@flax.struct.dataclass
class TrainState:
    step: jnp.ndarray
    params: Any
    opt_state: Any
    rng: jnp.ndarray


def make_optimizer(config, total_steps: int):
    """AdamW (weight decay from config, 0 in the recipe), warmup-cosine, global-norm clip."""
    warmup = max(1, int(round(config.warmup_ratio * total_steps)))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.learning_rate * config.end_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(config.grad_clip),
                     optax.adamw(schedule, b1=config.b1, b2=config.b2,
                                 weight_decay=config.weight_decay))
    return tx, schedule


def make_mesh(devices=None) -> Mesh:
    devices = jax.local_devices() if devices is None else devices
    return Mesh(np.asarray(devices), ("data",))


def make_train_step(loss_fn: Callable, optimizer, mesh: Optional[Mesh] = None,
                    shardings=None):
    """jit(step)(state, frozen, batch) -> (state, metrics); loss_fn(params, frozen, batch, key).

    With a mesh and no `shardings`: batch sharded over `data`, everything else replicated; XLA
    inserts the gradient all-reduce. `shardings` = (state, frozen, batch) shardings (see
    `train_shardings`) lay the step out on the mesh that way instead. The step's random key is
    fold_in(state.rng, state.step), so a resumed run draws the same anchors as the uninterrupted
    one.
    """

    def step(state: TrainState, frozen, batch):
        key = jax.random.fold_in(state.rng, state.step)
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, frozen, batch, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if mesh is None:
        return jax.jit(step)
    if shardings is None:
        rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        return jax.jit(step, in_shardings=(rep, rep, data), out_shardings=(rep, rep))
    state_sh, frozen_sh, batch_sh = shardings
    return jax.jit(step, in_shardings=(state_sh, frozen_sh, batch_sh),
                   out_shardings=(state_sh, NamedSharding(mesh, P())))


def train_shardings(mesh: Mesh, mode: str, state, frozen, target_head_dim: int,
                    drafter_head_dim: Optional[int] = None):
    """(state, frozen, batch) shardings for `make_train_step` on a ("data", "fsdp", "tensor")
    mesh: the trained parameters and their optimizer moments by the drafter's (or, training a
    target, the target's) FSDP + tensor rules, the frozen target by the target's, step and rng
    replicated, the batch over ("data", "fsdp")."""
    from dflash_jax import sharding

    if mode == "drafter":
        rules, head_dim = sharding.drafter_rules(True), drafter_head_dim
    else:
        rules, head_dim = sharding.target_rules(True), target_head_dim
    rep = NamedSharding(mesh, P())
    state_sh = TrainState(
        step=rep, rng=rep, params=sharding.param_shardings(state.params, mesh, rules, head_dim),
        opt_state=sharding.param_shardings(state.opt_state, mesh, rules, head_dim))
    frozen_sh = None if frozen is None else sharding.param_shardings(
        frozen, mesh, sharding.target_rules(True), target_head_dim)
    return state_sh, frozen_sh, sharding.batch_sharding(mesh)


# ------------------------------------------------------------------------------ experiment


@dataclasses.dataclass
class Experiment:
    """Everything a run needs, built from a config (usable from notebooks and tests)."""

    config: Any
    mode: str
    target_cfg: ModelConfig
    tmod: Transformer
    target_params: Any  # frozen in drafter mode; the init in target mode
    drafter_cfg: Any
    dmod: Optional[DFlashDrafter]
    init_params: Any  # params the optimizer trains, at step 0
    loss_fn: Callable  # (params, frozen, batch, key) -> (loss, metrics)
    train_iter: Any  # PackedBatchIterator
    steps_per_epoch: int
    eval_batches: List[dict]
    eval_prompts: List[List[int]]
    tokenizer: Any
    tokenizer_dir: Optional[str]
    stop_ids: tuple
    repetition_sampler: Any = None  # unlikelihood.RepetitionSampler (target mode, weight > 0)

    @property
    def frozen(self):
        return self.target_params if self.mode == "drafter" else None

    def target_for(self, params) -> Target:
        tp = params if self.mode == "target" else self.target_params
        return Target(self.target_cfg, tp, path=self.tokenizer_dir)

    def drafter_for(self, params) -> Drafter:
        return Drafter(self.drafter_cfg, params)


def _model_config_from(config, vocab_size: int) -> ModelConfig:
    m = config.target_model
    return ModelConfig(
        vocab_size=int(m.vocab_size or vocab_size), hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rope_theta=float(m.rope_theta),
        tie_word_embeddings=bool(m.tie_word_embeddings),
        max_position_embeddings=m.max_position_embeddings, dtype=as_dtype(config.dtype),
        param_dtype=jnp.float32)


def _fresh_target_params(cfg: ModelConfig, m) -> Any:
    params = init_params(cfg, seed=m.init_seed)
    if m.init_std > 0:
        leaves, tree = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(jax.random.PRNGKey(m.init_seed + 1), len(leaves))
        leaves = [m.init_std * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 2 else x
                  for k, x in zip(keys, leaves)]
        params = jax.tree_util.tree_unflatten(tree, leaves)
    if m.attn_out_scale != 1.0:
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x * m.attn_out_scale if any(
                getattr(k, "key", None) == "o_proj" for k in path) else x, params)
    return params


def _ids_doc(eos_id: Optional[int]):
    def tokenize(rec):
        p, r = list(rec["prompt_ids"]), list(rec["response_ids"])
        tail = [eos_id] if eos_id is not None and (not r or r[-1] != eos_id) else []
        ids = np.asarray(p + r + tail, np.int32)
        mask = np.ones(len(ids), np.int32)
        mask[:len(p)] = 0
        return ids, mask
    return tokenize


def _tfds_sources(config, workdir):
    from dflash_jax.data import build_python_stdlib, build_user_files, load_split

    d = config.data
    data_dir = d.data_dir or os.path.join(workdir, "tfds")
    if d.kind in ("stdlib", "regenerated"):
        build = lambda: build_python_stdlib(data_dir, max_files=d.max_files or None,
                                            validation_percent=d.validation_percent,
                                            include_tests=d.include_tests)
    else:
        build = lambda: build_user_files(list(d.paths), data_dir,
                                         validation_percent=d.validation_percent)
    builder = distributed.primary_first(build, "tfds: " + data_dir)  # one writer
    val = load_split(builder, "validation") if "validation" in builder.info.splits else []
    return load_split(builder, "train"), val


def _doc_prompts(source, tokenize_fn, n, length, rng) -> List[List[int]]:
    """Up to n prompts of `length` tokens from random windows of the documents: one window per
    document per pass, in a fresh random order each pass, until n prompts or no usable doc."""
    out = []
    while len(out) < n:
        before = len(out)
        for i in rng.permutation(len(source)):
            ids, _ = tokenize_fn(source[int(i)])
            if len(ids) < length + 8:
                continue
            start = int(rng.randint(0, len(ids) - length - 8 + 1))
            out.append(ids[start:start + length].tolist())
            if len(out) >= n:
                return out
        if len(out) == before:
            break
    return out


def _function_prompts(source, tokenizer, n, max_len, body_lines, per_file, rng):
    """Up to n code-completion prompts (the benchmark's kind, see `data.code_prompts`) from the
    documents, each encoded by `prompting.encode_code_prompt` to its last max_len tokens, in
    random order."""
    from dflash_jax.data.builders import code_prompts
    from dflash_jax.prompting import encode_code_prompt

    if n <= 0:
        return []
    items = code_prompts((source[i] for i in range(len(source))), prompt_body_lines=body_lines,
                         reference_lines=1, context_lines=40, max_per_file=per_file)
    out = []
    for i in rng.permutation(len(items))[:n]:
        ids = encode_code_prompt(tokenizer, items[int(i)]["prompt"], max_len)
        if ids:
            out.append(ids)
    return out


def _prompt_pool(source, tokenizer, tokenize_fn, n, n_functions, length, body_lines, per_file,
                 rng) -> List[List[int]]:
    """n prompts of at most `length` tokens: n_functions code-completion prompts, random
    document windows for the rest, shuffled."""
    prompts = _function_prompts(source, tokenizer, n_functions, length, body_lines, per_file, rng)
    prompts += _doc_prompts(source, tokenize_fn, n - len(prompts), length, rng)
    return [prompts[i] for i in rng.permutation(len(prompts))]


def drafter_loss_fn(config, tmod: Transformer, dmod: DFlashDrafter) -> Callable:
    """The drafter objective of `config` (the DFlash recipe) as loss_fn(params, frozen, batch,
    key) -> (loss, metrics) for `make_train_step` (also what `dflash_jax.dry_run` compiles)."""
    dcfg = dmod.cfg
    recipe = losses.DrafterRecipe(
        block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
        tap_layers=tuple(dcfg.target_layer_ids), num_anchors=config.num_anchors,
        gamma=config.gamma, loss=config.loss, mask_schedule=config.mask_schedule,
        attention_impl=config.attention_impl, use_segments=config.use_segments,
        loss_chunk_anchors=config.loss_chunk_anchors,
        anchors_per_row=config.get("anchors_per_row", 0))

    def loss_fn(params, frozen, batch, key):
        return losses.drafter_loss(tmod, dmod, recipe, params, frozen, batch, key)

    return loss_fn


def build_experiment(config, workdir: str) -> Experiment:
    """Tokenizer, data, target, drafter and loss for `config`."""
    from dflash_jax.data import (PackedBatchIterator, load_tokenizer, tokenize_example,
                                 train_bpe_tokenizer)
    from dflash_jax.data.builders import iter_texts

    mode = config.mode
    if mode not in ("drafter", "target"):
        raise ValueError(f"mode must be 'drafter' or 'target', got {mode!r}")
    d = config.data
    rng = np.random.RandomState(config.seed)

    # Tokenizer. Model locations may be hub ids (resolved to their cached snapshots).
    target_path = hub.local_path(config.target_path, what="target") if config.target_path else ""
    tok_dir = (hub.local_path(config.tokenizer_dir, what="tokenizer") if config.tokenizer_dir
               else target_path) or None
    tokenizer = None
    if tok_dir and os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        tokenizer = load_tokenizer(tok_dir)
    train_src = val_src = None
    if d.kind in ("stdlib", "files") or (d.kind == "regenerated" and
                                         config.regen.prompt_source != "random"):
        train_src, val_src = _tfds_sources(config, workdir)
    if tokenizer is None and mode == "target" and d.kind != "synthetic":
        tok_dir = os.path.join(workdir, "tokenizer")

        def load_or_train():
            if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
                return load_tokenizer(tok_dir)
            return train_bpe_tokenizer(iter_texts(train_src), tok_dir,
                                       vocab_size=config.tokenizer_vocab_size,
                                       total=len(train_src))

        tokenizer = distributed.primary_first(load_or_train, "tokenizer")  # one writer
    eos_id = tokenizer.eos_id if tokenizer is not None else None
    pad_id = tokenizer.pad_id if tokenizer is not None else 0

    # Target.
    if target_path:
        target = load_target(target_path, dtype=config.dtype)
        tcfg, tparams = target.config, target.params
    else:
        vocab = tokenizer.vocab_size if tokenizer is not None else 0
        tcfg = _model_config_from(config, vocab)
        if tcfg.vocab_size <= 0:
            raise ValueError("target_model.vocab_size is needed without a tokenizer")
        tparams = _fresh_target_params(tcfg, config.target_model)
    tmod = Transformer(tcfg, "xla")

    # Documents.
    text_tokenize = (lambda ex: tokenize_example(ex, tokenizer)) if tokenizer else None
    eval_prompts: List[List[int]] = []
    if d.kind == "synthetic":
        drng = np.random.RandomState(config.seed + 17)
        docs = [{"prompt_ids": drng.randint(2, tcfg.vocab_size, 4).tolist(),
                 "response_ids": drng.randint(2, tcfg.vocab_size, d.doc_len).tolist()}
                for _ in range(d.num_docs)]
        train_docs, eval_docs = docs[: int(0.9 * len(docs))], docs[int(0.9 * len(docs)):]
        tokenize_fn = _ids_doc(eos_id)
        eval_prompts = [list(rec["prompt_ids"]) + list(rec["response_ids"][:8])
                        for rec in eval_docs[: config.eval_num_prompts]]
    elif d.kind == "regenerated":
        if mode != "drafter":
            raise ValueError("data.kind='regenerated' is for drafter training")
        train_docs, eval_docs = _regenerated_docs(config, workdir, tcfg, tparams, tokenizer,
                                                  train_src, text_tokenize, rng)
        tokenize_fn = _ids_doc(None)  # responses end with the eos the target produced
        eval_prompts = [list(rec["prompt_ids"]) for rec in eval_docs[: config.eval_num_prompts]]
    else:
        if tokenizer is None:
            raise ValueError(f"data.kind={d.kind!r} needs a tokenizer (tokenizer_dir or a "
                             "target_path with tokenizer.json)")
        train_docs, eval_docs, tokenize_fn = train_src, val_src, text_tokenize
        eval_prompts = _doc_prompts(eval_docs, tokenize_fn, config.eval_num_prompts,
                                    config.eval_prompt_len, rng) if len(eval_docs) else []

    epoch_tokens = sum(len(tokenize_fn(train_docs[i])[0]) for i in range(len(train_docs)))
    steps_per_epoch = max(1, math.ceil(epoch_tokens / (d.seq_len * d.batch_size)))
    train_iter = PackedBatchIterator(train_docs, tokenize_fn, seq_len=d.seq_len,
                                     batch_size=d.batch_size, seed=config.seed,
                                     shuffle=d.shuffle, pad_id=pad_id, allow_split=d.allow_split)
    eval_batches = []
    if len(eval_docs) and config.eval_batches > 0:
        it = PackedBatchIterator(eval_docs, tokenize_fn, seq_len=d.seq_len,
                                 batch_size=d.batch_size, shuffle=False, num_epochs=1,
                                 pad_id=pad_id, allow_split=d.allow_split, drop_remainder=False)
        for batch in it:
            eval_batches.append(batch)
            if len(eval_batches) >= config.eval_batches:
                break

    # Trained model and loss.
    dcfg = dmod = None
    if mode == "drafter":
        dc = config.drafter
        mask_id = dc.mask_token_id
        if mask_id < 0:
            mask_id = (tokenizer.mask_id if tokenizer is not None and
                       tokenizer.mask_id is not None else tcfg.vocab_size - 1)
        overrides = {"intermediate_size": dc.intermediate_size} if dc.intermediate_size else {}
        if dc.get("param_dtype"):  # float32 masters; the frozen target keeps its dtype
            overrides["param_dtype"] = as_dtype(dc.param_dtype)
        dcfg = make_drafter_config(tcfg, num_layers=dc.num_layers, num_taps=dc.num_taps,
                                   block_size=dc.block_size, mask_token_id=mask_id,
                                   target_layer_ids=tuple(dc.target_layer_ids) or None,
                                   **overrides)
        if dc.init_path:
            from dflash_jax.drafter import load_drafter

            dcfg_params = load_drafter(dc.init_path, target=Target(tcfg, tparams),
                                       param_dtype=dc.get("param_dtype") or None)
            dcfg, init = dcfg_params.config, dcfg_params.params
        else:
            init = init_drafter_params(dcfg, seed=config.seed)
        dmod = DFlashDrafter(dcfg)
        loss_fn = drafter_loss_fn(config, tmod, dmod)
    else:
        init = tparams
        ul_weight = float(config.unlikelihood.weight)

        def loss_fn(params, frozen, batch, key):
            del frozen, key
            return unlikelihood.combined_loss(tmod, params, batch, ul_weight,
                                              losses.target_loss)

    stop_ids = (eos_id,) if eos_id is not None else ()
    sampler = None
    if mode == "target" and config.unlikelihood.weight > 0:
        sampler = _repetition_sampler(config, tcfg, tokenizer, train_docs, tokenize_fn,
                                      stop_ids, pad_id, rng)
    return Experiment(config=config, mode=mode, target_cfg=tcfg, tmod=tmod,
                      target_params=tparams, drafter_cfg=dcfg, dmod=dmod, init_params=init,
                      loss_fn=loss_fn, train_iter=train_iter, steps_per_epoch=steps_per_epoch,
                      eval_batches=eval_batches, eval_prompts=eval_prompts, tokenizer=tokenizer,
                      tokenizer_dir=tok_dir, stop_ids=stop_ids, repetition_sampler=sampler)


def _repetition_sampler(config, tcfg, tokenizer, train_docs, tokenize_fn, stop_ids, pad_id,
                        rng) -> "unlikelihood.RepetitionSampler":
    u = config.unlikelihood
    if u.prompt_source not in ("docs", "functions", "mixed"):
        raise ValueError("unlikelihood.prompt_source must be 'docs', 'functions' or 'mixed', "
                         f"got {u.prompt_source!r}")
    if u.prompt_source != "docs" and tokenizer is None:
        raise ValueError(f"unlikelihood.prompt_source={u.prompt_source!r} needs text documents "
                         "and a tokenizer; use 'docs'")
    n_fn = {"docs": 0, "functions": u.num_prompts, "mixed": u.num_prompts // 2}[u.prompt_source]
    prompts = _prompt_pool(train_docs, tokenizer, tokenize_fn, u.num_prompts, n_fn, u.prompt_len,
                           2, 50, rng)
    return unlikelihood.RepetitionSampler(
        tcfg, prompts, batch_size=u.batch_size, prompt_len=u.prompt_len,
        max_new_tokens=u.max_new_tokens, ngram=u.ngram, stop_ids=stop_ids, pad_id=pad_id)


def _process_group_mesh():
    """Several processes: a data-parallel mesh over all their devices (generation that every
    process takes part in). One process: None (generation on the default device)."""
    if not distributed.is_multiprocess():
        return None
    from dflash_jax import sharding

    return sharding.make_mesh(data=-1, fsdp=1, tensor=1)


def _regenerated_docs(config, workdir, tcfg, tparams, tokenizer, train_src, text_tokenize, rng):
    from dflash_jax.training.regenerate import read_records, regenerate

    r = config.regen
    path = r.output or os.path.join(workdir, "regenerated.jsonl")
    # Decided once (process 0's view): a file one process is writing must not change it.
    if not distributed.broadcast(np.int32(os.path.exists(path))):
        if r.prompt_source == "random":
            prng = np.random.RandomState(config.seed + 29)
            prompts = [prng.randint(2, tcfg.vocab_size, r.prompt_len).tolist()
                       for _ in range(r.num_prompts)]
        elif r.prompt_source in ("stdlib", "functions", "mixed"):
            if text_tokenize is None:
                raise ValueError(f"regen.prompt_source={r.prompt_source!r} needs a tokenizer")
            n_fn = {"stdlib": 0, "functions": r.num_prompts,
                    "mixed": r.num_prompts // 2}[r.prompt_source]
            prompts = _prompt_pool(train_src, tokenizer, text_tokenize, r.num_prompts, n_fn,
                                   r.prompt_len, r.function_body_lines, r.functions_per_file, rng)
        else:
            raise ValueError("regen.prompt_source must be 'stdlib', 'functions', 'mixed' or "
                             f"'random', got {r.prompt_source!r}")
        _log(f"regenerating {len(prompts)} responses with the target -> {path}")
        regenerate(Target(tcfg, tparams), prompts, path, max_new_tokens=r.max_new_tokens,
                   batch_size=r.batch_size, temperature=r.temperature, seed=config.seed,
                   stop_token_ids=(tokenizer.eos_id,) if tokenizer is not None else (),
                   tokenizer=tokenizer, mesh=_process_group_mesh())
    records = read_records(path, vocab_size=tcfg.vocab_size)
    n_eval = max(1, int(round(r.holdout_fraction * len(records))))
    return records[:-n_eval], records[-n_eval:]


# ----------------------------------------------------------------------------- evaluation


def evaluate(exp: Experiment, params, eval_step, step: int, frozen=None, mesh=None) -> dict:
    """Held-out loss and per-position draft accuracy; tau with the real `generate` (on `mesh`
    when given). `frozen`: the target parameters as placed for training (default exp.frozen)."""
    frozen = exp.frozen if frozen is None else frozen
    out = {}
    if exp.eval_batches:
        acc = None
        for batch in exp.eval_batches:
            m = jax.device_get(eval_step(params, frozen, batch))
            acc = m if acc is None else jax.tree_util.tree_map(np.add, acc, m)
        n = len(exp.eval_batches)
        out["loss"] = float(acc["loss"]) / n
        if exp.mode == "drafter":
            per_k = acc["correct_k"] / np.maximum(acc["count_k"], 1)
            for k in range(1, len(per_k)):
                out[f"acc_k{k:02d}"] = float(per_k[k])
            out["block_accept_len"] = float(acc["accept_sum"] / max(acc["num_blocks"], 1))
        else:
            out["accuracy"] = float(acc["correct"] / max(acc["weight_sum"], 1))
            out["perplexity"] = float(np.exp(min(out["loss"], 50.0)))
    if exp.mode == "drafter" and exp.eval_prompts:
        from dflash_jax.decoding import generate

        res = generate(exp.target_for(params), exp.drafter_for(params), exp.eval_prompts,
                       exp.config.eval_max_new_tokens, stop_token_ids=exp.stop_ids, mesh=mesh)
        out["tau"] = float(res.stats["tau"])
    return out


# ------------------------------------------------------------------------------ main loop


class _StopFlag:
    def __init__(self):
        self.signum = None
        self._old = {}

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        del frame
        self.signum = signum

    def uninstall(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)


def _log(msg: str):
    if distributed.is_primary():  # every process sees the same values: print them once
        console.say(msg)  # stdout, and the CLI's log file (never twice on the console)


def train_and_evaluate(config, workdir: str) -> dict:
    """Runs (or resumes) training in `workdir`. Returns a summary:
    {"status": "done" | "stopped" | "preempted" | "nan" | "data_exhausted" | "regenerated"
     (regen.only), "step",
     "losses": [(step, loss), ...] of this process, "eval": last eval metrics,
     "export": path or None}."""
    from dflash_jax import validation

    validation.check_train_config(config)  # one-line ConfigError before anything runs
    validation.writable_dir(workdir, "workdir")
    if config.regen.output and not os.path.exists(config.regen.output):
        validation.writable_file(config.regen.output, "regen.output")
    workdir = os.path.abspath(workdir)
    regen_only = config.regen.get("only", False)
    if regen_only and (config.mode != "drafter" or config.data.kind != "regenerated"):
        raise ValueError("regen.only needs mode='drafter' and data.kind='regenerated', got "
                         f"mode={config.mode!r}, data.kind={config.data.kind!r}")
    os.makedirs(workdir, exist_ok=True)
    exp = build_experiment(config, workdir)
    if regen_only:  # the responses exist now (build_experiment wrote or found them)
        path = config.regen.output or os.path.join(workdir, "regenerated.jsonl")
        _log(f"regen.only: responses in {path}; no training")
        return {"status": "regenerated", "step": 0, "losses": [], "eval": {}, "export": None,
                "regenerated": path}
    total = (config.num_train_steps if config.num_train_steps > 0
             else exp.steps_per_epoch * config.data.num_epochs)
    stop_at = min(total, config.stop_at_step) if config.stop_at_step > 0 else total
    optimizer, schedule = make_optimizer(config, total)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=exp.init_params,
                       opt_state=optimizer.init(exp.init_params),
                       rng=jax.random.PRNGKey(config.seed))
    # "" is data parallelism over this host's devices: the same rules on a data-only mesh,
    # where every parameter is replicated.
    from dflash_jax import sharding

    mesh_spec = config.get("mesh", "")
    sizes = sharding.parse_mesh(mesh_spec or "data=-1")
    pool = jax.devices() if mesh_spec or distributed.is_multiprocess() else jax.local_devices()
    mesh = sharding.make_mesh(**sizes, devices=pool if -1 in sizes.values()
                              else pool[:math.prod(sizes.values())])
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    state_sh, frozen_sh, data_sh = train_shardings(
        mesh, exp.mode, state, exp.frozen, exp.target_cfg.head_dim,
        exp.drafter_cfg.body.head_dim if exp.drafter_cfg is not None else None)
    n_dev = mesh.devices.size
    if config.data.batch_size % n_batch:
        raise ValueError(f"batch_size {config.data.batch_size} is not divisible by the "
                         f"{n_batch} batch shards of the mesh ({n_dev} devices)")
    if exp.repetition_sampler is not None and config.unlikelihood.batch_size % n_batch:
        raise ValueError(f"unlikelihood.batch_size {config.unlikelihood.batch_size} is not "
                         f"divisible by the {n_batch} batch shards of the mesh")
    # Several processes: each reads only the data streams whose rows its devices hold.
    exp.train_iter = distributed.shard_batches(exp.train_iter, data_sh,
                                               config.data.get("num_shards", 0))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint_every,
                        config.keep_checkpoints, config.async_checkpoint)
    abstract = jax.tree_util.tree_map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        jax.eval_shape(lambda: state), state_sh)
    try:
        restored = ckpt.restore(abstract)
    except BaseException:  # incompatible: leave every checkpoint as it is
        ckpt.manager.close()
        raise
    if distributed.is_multiprocess():
        steps = distributed.allgather_json(-1 if restored is None else int(restored[2]))
        if len(set(steps)) > 1:
            raise RuntimeError(f"processes restored different checkpoint steps {steps} from "
                               f"{ckpt.directory}")
    if restored is not None:
        state, data_state, _ = restored
        exp.train_iter.set_state(data_state)
        _log(f"resumed from step {int(state.step)} ({ckpt.directory})")
    state = distributed.put(state, state_sh)
    frozen = distributed.put(exp.frozen, frozen_sh)
    train_step = make_train_step(exp.loss_fn, optimizer, mesh, (state_sh, frozen_sh, data_sh))
    eval_mesh = mesh if n_dev > 1 else None
    eval_jit = jax.jit(lambda p, f, b: exp.loss_fn(p, f, b, jax.random.PRNGKey(1234))[1],
                       out_shardings=NamedSharding(mesh, P()))
    eval_step = lambda p, f, b: eval_jit(p, f, distributed.put(b, data_sh))

    n_params = sum(x.size for x in jax.tree_util.tree_leaves(exp.init_params))
    _log(f"{config.mode} training: {n_params / 1e6:.2f}M trained params, {total} steps "
         f"({exp.steps_per_epoch}/epoch), batch {config.data.batch_size}x{config.data.seq_len} "
         f"over {n_dev} device(s) [{jax.devices()[0].platform}, mesh "
         f"{sharding.mesh_str(mesh)}], workdir {workdir}")
    logger = MetricsLogger(workdir, resume_step=int(state.step),  # no duplicate rows
                           enabled=distributed.is_primary())
    flag = _StopFlag().install()
    step = int(state.step)
    status, last_eval, history = "done", {}, []
    tokens_per_step = config.data.batch_size * config.data.seq_len
    t_window, steps_window, t_start, step_start = time.time(), 0, time.time(), step
    acc_window = None
    profiling = False
    try:
        while step < stop_at:
            try:
                batch = next(exp.train_iter)
            except StopIteration:
                status = "data_exhausted"
                break
            if config.profile_dir and step == config.profile_start_step:
                jax.profiler.start_trace(config.profile_dir)
                profiling = True
            batch = {k: batch[k] for k in ("input_ids", "loss_mask", "segment_ids")}
            rep_frac = None
            if exp.repetition_sampler is not None:
                ul_batch, rep_frac = exp.repetition_sampler(state.params, step, eval_mesh)
                batch.update(ul_batch)
            batch = distributed.put(batch, data_sh)
            new_state, metrics = train_step(state, frozen, batch)
            metrics = jax.device_get(metrics)
            if rep_frac is not None:
                metrics = dict(metrics, rep_frac=np.float32(rep_frac))
            loss = float(metrics["loss"]) + float(metrics.get("ul_loss", 0.0))
            if profiling and step + 1 >= config.profile_start_step + config.profile_num_steps:
                jax.profiler.stop_trace()
                profiling = False
                _log(f"profile of steps {config.profile_start_step}.."
                     f"{step} written to {config.profile_dir}")
            if not math.isfinite(loss):
                status = "nan"
                _log(f"ERROR: non-finite loss ({loss}) at step {step + 1}; stopping. The last "
                     f"good checkpoint (step {ckpt.manager.latest_step()}) is kept; this "
                     "state is not saved.")
                break
            state = new_state
            step += 1
            history.append((step, loss))
            steps_window += 1
            acc_window = metrics if acc_window is None else jax.tree_util.tree_map(
                np.add, acc_window, metrics)
            if step % config.log_every == 0 or step == stop_at:
                dt = time.time() - t_window
                rate = steps_window * tokens_per_step / max(dt, 1e-9)
                elapsed = time.time() - t_start
                eta = elapsed / max(step - step_start, 1) * (total - step)
                rec = {"loss": acc_window["loss"] / steps_window,
                       "grad_norm": acc_window["grad_norm"] / steps_window,
                       "learning_rate": float(schedule(step - 1)), "tokens_per_s": rate}
                if exp.mode == "drafter":
                    per_k = acc_window["correct_k"] / np.maximum(acc_window["count_k"], 1)
                    rec["acc_k01"] = float(per_k[1])
                    rec["block_accept_len"] = float(acc_window["accept_sum"] /
                                                    max(acc_window["num_blocks"], 1))
                ul_msg = ""
                if "rep_frac" in acc_window:
                    rec.update({k: float(acc_window[k]) / steps_window
                                for k in ("ul_loss", "ul_p", "rep_frac")})
                    ul_msg = (f"ul {rec['ul_loss']:.3f} p_rep {rec['ul_p']:.2f} "
                              f"repeated {100 * rec['rep_frac']:.1f}% ")
                logger.write("train", step, rec)
                _log(f"step {step}/{total} loss {rec['loss']:.4f} {ul_msg}"
                     f"lr {rec['learning_rate']:.2e} gnorm {rec['grad_norm']:.2f} "
                     f"{rate:,.0f} tok/s ETA {format_eta(eta)}")
                t_window, steps_window, acc_window = time.time(), 0, None
            if config.eval_every > 0 and (step % config.eval_every == 0 or step == total):
                last_eval = evaluate(exp, state.params, eval_step, step, frozen, eval_mesh)
                logger.write("eval", step, last_eval)
                _log(f"eval step {step}: " + " ".join(
                    f"{k} {v:.3f}" for k, v in last_eval.items() if not k.startswith("acc_k")
                    or k in ("acc_k01", "acc_k02", "acc_k04", "acc_k08")))
            if ckpt.maybe_save(step, state, exp.train_iter.get_state):
                _log(f"checkpoint step {step} -> {ckpt.directory}")
            # A signal to any one process stops all of them after the same step.
            if distributed.any_process(flag.signum is not None):
                status = "preempted"
                _log(f"signal {flag.signum or 'to another process'}: saving step {step} and "
                     "stopping")
                break
        if status != "nan" and ckpt.maybe_save(step, state, exp.train_iter.get_state,
                                                force=True):
            _log(f"checkpoint step {step} -> {ckpt.directory}")
        if status == "done" and step < total:
            status = "stopped"
    finally:
        if profiling:
            jax.profiler.stop_trace()
        ckpt.close()
        flag.uninstall()
        logger.close()

    export_path = None
    if config.export and status == "done":
        export_path = export(exp, state.params, os.path.join(workdir, "export"))
        _log(f"exported to {export_path}")
    return {"status": status, "step": step, "losses": history, "eval": last_eval,
            "export": export_path, "total_steps": total}


def export(exp: Experiment, params, directory: str) -> str:
    """Drafter: z-lab format (`save_drafter`). Target: HF format with the tokenizer beside it."""
    from dflash_jax.drafter import save_drafter

    params = distributed.gather(params)  # all processes take part; process 0 writes
    if exp.mode == "drafter":
        path = os.path.join(directory, "drafter")
        if not distributed.is_primary():
            return path
        save_drafter(exp.drafter_for(params), path)
    else:
        path = os.path.join(directory, "target")
        if not distributed.is_primary():
            return path
        save_target(exp.target_for(params), path)
        if exp.tokenizer is not None and not os.path.exists(
                os.path.join(path, "tokenizer.json")):
            exp.tokenizer.save(path)
    return path
