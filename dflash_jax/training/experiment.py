"""Building a training run from its config: `build_experiment(config, workdir) -> Experiment`.

(Over ~450 lines on purpose: one job, every data source and both modes of the run.)

The tokenizer (loaded, or a BPE trained on the corpus in target mode), the documents (the
Python stdlib or user files as TFDS sources, synthetic random ones, or responses the target
regenerated to prompts from the training files), packed batch iterators, held-out batches and
prompts, the target (a Hugging Face directory or a fresh random model), the drafter, the loss
function of the mode, and in target mode with `unlikelihood.weight > 0` the sampler of the
model's own greedy continuations. The trainer (`trainer.train_and_evaluate`) places these on
its mesh and runs the loop; notebooks and tests use the Experiment directly.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.data.prompts import prompt_pool, window_prompts
from dflash_jax.drafters import registry
from dflash_jax.models import checkpoint, hub, layer_stack
from dflash_jax.models.config import ModelConfig, as_dtype
from dflash_jax.models.target import Target, load_target
from dflash_jax.models.verifier import target_module
from dflash_jax.models.transformer import Transformer
from dflash_jax.models.verifier import init_params
from dflash_jax.parallel import distributed
from dflash_jax.support import console
from dflash_jax.training import losses, unlikelihood


def log(msg: str):
    """One line on stdout (and the CLI's log file), from process 0 only."""
    if distributed.is_primary():  # every process sees the same values: print them once
        console.say(msg)  # stdout, and the CLI's log file (never twice on the console)


@dataclasses.dataclass
class Experiment:
    """Everything a run needs, built from a config (usable from notebooks and tests)."""

    config: Any
    mode: str
    target_cfg: ModelConfig
    tmod: Transformer
    target_params: Any  # frozen in drafter mode; the init in target mode
    drafter_cfg: Any
    dmod: Any  # the drafter's module (`registry.of(dmod)`: its kind)
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
    d2t: Any = None  # an EAGLE-3 drafter's draft-to-target offsets (drafter.kind "eagle3")
    draft_vocab: Any = None  # a DFlash drafter's draft vocabulary (drafter.draft_vocab_size)
    tap_layers: tuple = ()  # drafter mode: the target layers the loss taps (`tap_cache`)

    @property
    def frozen(self):
        return self.target_params if self.mode == "drafter" else None

    def target_for(self, params) -> Target:
        tp = params if self.mode == "target" else self.target_params
        return Target(self.target_cfg, tp, path=self.tokenizer_dir)

    def drafter_for(self, params):
        """The user object of the trained drafter: a `Drafter`, or an `Eagle3` (sharing the
        target's embedding)."""
        kind = registry.of(self.drafter_cfg)
        vocab = self.d2t if self.d2t is not None else self.draft_vocab
        return kind.from_trained(self.drafter_cfg, params, vocab)


def model_config_from(config, vocab_size: int) -> ModelConfig:
    """The fresh target of `config.target_model` (vocab_size 0: `vocab_size`, the
    tokenizer's), computing in config.dtype with float32 parameters."""
    m = config.target_model
    return ModelConfig(
        vocab_size=int(m.vocab_size or vocab_size),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rope_theta=float(m.rope_theta),
        tie_word_embeddings=bool(m.tie_word_embeddings),
        max_position_embeddings=m.max_position_embeddings,
        dtype=as_dtype(config.dtype),
        param_dtype=jnp.float32,
    )


def fresh_target_params(cfg: ModelConfig, m) -> Any:
    """Random parameters of a fresh target; `m` (config.target_model) may redraw every
    matrix ~ N(0, init_std) and scale o_proj by attn_out_scale (see configs/default.py). Drawn
    per layer, then in `cfg`'s layout (`layer_stack`): a stacked target has the same numbers."""
    params = init_params(cfg.replace(scan_layers=False), seed=m.init_seed)
    if m.init_std > 0:
        leaves, tree = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(jax.random.PRNGKey(m.init_seed + 1), len(leaves))
        leaves = [
            m.init_std * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 2 else x
            for k, x in zip(keys, leaves)
        ]
        params = jax.tree_util.tree_unflatten(tree, leaves)
    if m.attn_out_scale != 1.0:
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: (
                x * m.attn_out_scale
                if any(getattr(k, "key", None) == "o_proj" for k in path)
                else x
            ),
            params,
        )
    return layer_stack.to_layout(params, cfg)


def _ids_doc(eos_id: Optional[int]):
    def tokenize(rec):
        p, r = list(rec["prompt_ids"]), list(rec["response_ids"])
        tail = [eos_id] if eos_id is not None and (not r or r[-1] != eos_id) else []
        ids = np.asarray(p + r + tail, np.int32)
        mask = np.ones(len(ids), np.int32)
        mask[: len(p)] = 0
        return ids, mask

    return tokenize


def _tfds_sources(config, workdir):
    from dflash_jax.data import build_python_stdlib, build_user_files, load_split

    d = config.data
    data_dir = d.data_dir or os.path.join(workdir, "tfds")
    if d.kind in ("stdlib", "regenerated"):
        build = lambda: build_python_stdlib(
            data_dir,
            max_files=d.max_files or None,
            validation_percent=d.validation_percent,
            include_tests=d.include_tests,
        )
    else:
        build = lambda: build_user_files(
            list(d.paths), data_dir, validation_percent=d.validation_percent
        )
    builder = distributed.primary_first(build, "tfds: " + data_dir)  # one writer
    val = load_split(builder, "validation") if "validation" in builder.info.splits else []
    return load_split(builder, "train"), val


def drafter_loss_fn(config, tmod: Transformer, dmod, draft_vocab=None) -> Callable:
    """The drafter objective of `config` (the DFlash recipe) as loss_fn(params, frozen, batch,
    key) -> (loss, metrics) for `make_train_step` (also what `dflash_jax.dry_run` compiles);
    `draft_vocab` (int32 [K]): the head restricted to those rows (`drafters.draft_vocab`)."""
    dcfg = dmod.cfg
    recipe = losses.DrafterRecipe(
        block_size=dcfg.block_size,
        mask_token_id=dcfg.mask_token_id,
        tap_layers=tuple(dcfg.target_layer_ids),
        num_anchors=config.num_anchors,
        gamma=config.gamma,
        loss=config.loss,
        mask_schedule=config.mask_schedule,
        mask_full_fraction=float(config.get("mask_full_fraction", 0.5)),
        attention_impl=config.attention_impl,
        use_segments=config.use_segments,
        loss_chunk_anchors=config.loss_chunk_anchors,
        anchors_per_row=config.get("anchors_per_row", 0),
        selector_weight=float(config.drafter.get("dflash2", {}).get("selector_weight", 1.0)),
        position_weights=config.get("position_weights", "decay"),
        loss_positions=int(config.get("loss_positions", 0)),
    )

    def loss_fn(params, frozen, batch, key):
        return losses.drafter_loss(tmod, dmod, recipe, params, frozen, batch, key, draft_vocab)

    return loss_fn


def _refuse_hybrid(tcfg: ModelConfig, target_path: str) -> None:
    if tcfg.is_hybrid:
        raise ValueError(
            f"target {target_path or '(random)'}: training against a hybrid (Gated DeltaNet) "
            "target is not supported yet: the trainer packs several documents per row and the "
            "recurrent state would run across them"
        )


def build_experiment(config, workdir: str) -> Experiment:
    """Tokenizer, data, target, drafter and loss for `config`."""
    mode = config.mode
    if mode not in ("drafter", "target"):
        raise ValueError(f"mode must be 'drafter' or 'target', got {mode!r}")
    rng = np.random.RandomState(config.seed)
    # Model locations may be hub ids (resolved to their cached snapshots).
    target_path = hub.local_path(config.target_path, what="target") if config.target_path else ""
    if target_path and os.path.isfile(os.path.join(target_path, "config.json")):
        _refuse_hybrid(checkpoint.read_target_config(target_path), target_path)
    train_src = val_src = None
    d = config.data
    if d.kind in ("stdlib", "files") or (
        d.kind == "regenerated" and config.regen.prompt_source not in ("random", "file")
    ):
        train_src, val_src = _tfds_sources(config, workdir)
    tokenizer, tok_dir = _tokenizer(config, workdir, target_path, train_src)
    eos_id = tokenizer.eos_id if tokenizer is not None else None
    pad_id = tokenizer.pad_id if tokenizer is not None else 0
    tcfg, tparams, tpath = _target(config, target_path, tokenizer)
    _refuse_hybrid(tcfg, target_path)
    tmod = target_module(tcfg, config.attention_impl)  # the target pass: causal_attention
    train_docs, eval_docs, tokenize_fn, eval_prompts = _documents(
        config, workdir, tcfg, tparams, tokenizer, tok_dir, train_src, val_src, rng, tpath
    )
    train_iter, steps_per_epoch, eval_batches = _batches(
        config, train_docs, eval_docs, tokenize_fn, pad_id
    )
    d2t = draft_vocab = None
    if mode == "drafter" and config.drafter.get("kind", "dflash") == "eagle3":
        dcfg, dmod, init, loss_fn, d2t = _eagle3_model(config, tcfg, tmod, train_docs, tokenize_fn)
    else:
        dcfg, dmod, init, loss_fn = _trained_model(
            config, tcfg, tparams, tmod, tokenizer, eval_batches
        )
        k = int(config.drafter.get("draft_vocab_size", 0)) if mode == "drafter" else 0
        if k:
            draft_vocab = _draft_vocab(config, tcfg, train_docs, tokenize_fn, k)
            loss_fn = drafter_loss_fn(config, tmod, dmod, draft_vocab)
    tap_layers = ()
    if mode == "drafter":
        tap_layers = tuple(registry.of(dcfg).tap_layers(dcfg, tcfg.num_layers))
    stop_ids = (eos_id,) if eos_id is not None else ()
    sampler = None
    if mode == "target" and config.unlikelihood.weight > 0:
        sampler = _repetition_sampler(
            config, tcfg, tokenizer, train_docs, tokenize_fn, stop_ids, pad_id, rng
        )
    return Experiment(
        config=config,
        mode=mode,
        target_cfg=tcfg,
        tmod=tmod,
        target_params=tparams,
        drafter_cfg=dcfg,
        dmod=dmod,
        init_params=init,
        loss_fn=loss_fn,
        train_iter=train_iter,
        steps_per_epoch=steps_per_epoch,
        eval_batches=eval_batches,
        eval_prompts=eval_prompts,
        tokenizer=tokenizer,
        tokenizer_dir=tok_dir,
        stop_ids=stop_ids,
        repetition_sampler=sampler,
        d2t=d2t,
        draft_vocab=draft_vocab,
        tap_layers=tap_layers,
    )


def _draft_vocab(config, tcfg, train_docs, tokenize_fn, k: int) -> np.ndarray:
    """The draft vocabulary of a DFlash drafter: the init drafter's own when it has one of
    size k (a continued run keeps its head), else the k most frequent answer (loss-masked)
    tokens of the training documents (`drafters.draft_vocab`)."""
    from dflash_jax.drafters import draft_vocab as dv

    path = config.drafter.init_path
    if path:
        path = hub.local_path(path, what="drafter")
        have = registry.named("dflash").read_draft_vocab(path, tcfg)
        if have is not None and len(have) == k:
            log(f"draft vocabulary: the {k} tokens of {path}")
            return have
    counts = dv.token_counts(
        (train_docs[i] for i in range(len(train_docs))), tokenize_fn, tcfg.vocab_size
    )
    vocab = dv.top_tokens(counts, k)
    log(
        f"draft vocabulary: the {k} most frequent answer tokens, "
        f"{100 * dv.coverage(counts, vocab):.2f}% of the training answers' tokens"
    )
    return vocab


def _eagle3_model(config, tcfg, tmod, train_docs, tokenize_fn):
    """(config, module, initial parameters, TTT loss function, d2t) of an EAGLE-3 drafter
    (drafter.kind "eagle3"): continued from drafter.init_path (an EAGLE-3 directory, its own
    draft vocabulary kept) or new, its draft vocabulary the drafter.eagle3.draft_vocab_size
    most frequent label tokens of the training docs (0: the whole vocabulary)."""
    from dflash_jax.training import eagle3_ttt

    kind = registry.named("eagle3")
    dc, ec = config.drafter, config.drafter.eagle3
    if dc.init_path:
        loaded = kind.load(
            dc.init_path, Target(tcfg, None), param_dtype=dc.get("param_dtype") or None
        )
        if loaded.embedding is not None:
            raise ValueError(
                f"drafter.init_path {dc.init_path} has its own embedding; training keeps the "
                "target's shared one (remove embed_tokens from the file to continue it)"
            )
        cfg, init, d2t = loaded.config, loaded.params, np.asarray(loaded.d2t, np.int64)
    else:
        vd = int(ec.draft_vocab_size) or tcfg.vocab_size
        if vd > tcfg.vocab_size:
            raise ValueError(
                f"drafter.eagle3.draft_vocab_size {vd} exceeds the target's vocabulary "
                f"{tcfg.vocab_size}"
            )
        overrides = {"intermediate_size": dc.intermediate_size} if dc.intermediate_size else {}
        if dc.get("param_dtype"):
            overrides["param_dtype"] = as_dtype(dc.param_dtype)
        cfg = kind.new_config(
            tcfg,
            draft_vocab_size=vd,
            target_layer_ids=tuple(dc.target_layer_ids) or None,
            **overrides,
        )
        counts = eagle3_ttt.label_counts(train_docs, tokenize_fn, tcfg.vocab_size)
        d2t = eagle3_ttt.draft_vocabulary(counts, vd)
        init = kind.init_params(cfg, seed=config.seed)
    dmod = kind.module(cfg)
    t2d = eagle3_ttt.target_to_draft(d2t, tcfg.vocab_size)
    loss_fn = eagle3_ttt.loss_fn_for(tmod, dmod, t2d, int(ec.ttt_steps), float(ec.ttt_decay))
    return cfg, dmod, init, loss_fn, d2t


def _tokenizer(config, workdir, target_path, train_src):
    """(tokenizer or None, its directory): config.tokenizer_dir's or the target's; a small
    target trained from scratch on text data gets one trained on the training split (once, by
    the primary process, in workdir/tokenizer)."""
    from dflash_jax.data import load_tokenizer, train_bpe_tokenizer
    from dflash_jax.data.builders import iter_texts

    tok_dir = (
        hub.local_path(config.tokenizer_dir, what="tokenizer")
        if config.tokenizer_dir
        else target_path
    ) or None
    if tok_dir and os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        return load_tokenizer(tok_dir), tok_dir
    if config.mode == "target" and config.data.kind != "synthetic":
        tok_dir = os.path.join(workdir, "tokenizer")

        def load_or_train():
            if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
                return load_tokenizer(tok_dir)
            return train_bpe_tokenizer(
                iter_texts(train_src),
                tok_dir,
                vocab_size=config.tokenizer_vocab_size,
                total=len(train_src),
            )

        return distributed.primary_first(load_or_train, "tokenizer"), tok_dir  # one writer
    return None, tok_dir


def _target(config, target_path, tokenizer):
    """(config, parameters, its directory or None) of the target: loaded from target_path,
    else fresh ones of config.target_model's shape over the tokenizer's vocabulary. The
    directory identifies it to a regeneration journal (`regenerate.target_identity`)."""
    scan = bool(config.get("scan_layers", False))
    if target_path:
        target = load_target(target_path, dtype=config.dtype, scan_layers=scan)
        return target.config, target.params, target.path
    vocab = tokenizer.vocab_size if tokenizer is not None else 0
    tcfg = model_config_from(config, vocab).replace(scan_layers=scan)
    if tcfg.vocab_size <= 0:
        raise ValueError("target_model.vocab_size is needed without a tokenizer")
    return tcfg, fresh_target_params(tcfg, config.target_model), None


def _documents(
    config, workdir, tcfg, tparams, tokenizer, tok_dir, train_src, val_src, rng, tpath=None
):
    """(train documents, eval documents, their tokenize function, eval prompts) of
    config.data.kind: synthetic ids, responses regenerated by the target, or text."""
    from dflash_jax.data import tokenize_example

    d = config.data
    eos_id = tokenizer.eos_id if tokenizer is not None else None
    text_tokenize = (lambda ex: tokenize_example(ex, tokenizer)) if tokenizer else None
    if d.kind == "synthetic":
        drng = np.random.RandomState(config.seed + 17)
        docs = [
            {
                "prompt_ids": drng.randint(2, tcfg.vocab_size, 4).tolist(),
                "response_ids": drng.randint(2, tcfg.vocab_size, d.doc_len).tolist(),
            }
            for _ in range(d.num_docs)
        ]
        train_docs, eval_docs = docs[: int(0.9 * len(docs))], docs[int(0.9 * len(docs)) :]
        eval_prompts = [
            list(rec["prompt_ids"]) + list(rec["response_ids"][:8])
            for rec in eval_docs[: config.eval_num_prompts]
        ]
        return train_docs, eval_docs, _ids_doc(eos_id), eval_prompts
    if d.kind == "regenerated":
        if config.mode != "drafter":
            raise ValueError("data.kind='regenerated' is for drafter training")
        train_docs, eval_docs = _regenerated_docs(
            config, workdir, tcfg, tparams, tokenizer, train_src, text_tokenize, rng, tok_dir, tpath
        )
        from dflash_jax.training.regenerate import record_tokens

        eval_prompts = [list(rec["prompt_ids"]) for rec in eval_docs[: config.eval_num_prompts]]
        # responses end with the eos the target produced
        return train_docs, eval_docs, record_tokens, eval_prompts
    if tokenizer is None:
        raise ValueError(
            f"data.kind={d.kind!r} needs a tokenizer (tokenizer_dir or a "
            "target_path with tokenizer.json)"
        )
    eval_prompts = (
        window_prompts(val_src, text_tokenize, config.eval_num_prompts, config.eval_prompt_len, rng)
        if len(val_src)
        else []
    )
    return train_src, val_src, text_tokenize, eval_prompts


def _batches(config, train_docs, eval_docs, tokenize_fn, pad_id):
    """(the packed training batch iterator, steps per epoch, the first config.eval_batches
    packed eval batches)."""
    from dflash_jax.data import PackedBatchIterator
    from dflash_jax.data.packing import rows_for

    d = config.data
    lengths = [len(tokenize_fn(train_docs[i])[0]) for i in range(len(train_docs))]
    if d.shuffle:  # the first epoch's order (padding without allow_split depends on it)
        lengths = [
            lengths[i] for i in np.random.default_rng([config.seed, 0]).permutation(len(lengths))
        ]
    rows = rows_for(lengths, d.seq_len, d.allow_split)
    steps_per_epoch = max(1, math.ceil(rows / d.batch_size))
    train_iter = PackedBatchIterator(
        train_docs,
        tokenize_fn,
        seq_len=d.seq_len,
        batch_size=d.batch_size,
        seed=config.seed,
        shuffle=d.shuffle,
        pad_id=pad_id,
        allow_split=d.allow_split,
        include_doc_keys=bool(d.get("cache_taps", False) or d.get("tap_store", "")),
    )
    eval_batches = []
    if len(eval_docs) and config.eval_batches > 0:
        it = PackedBatchIterator(
            eval_docs,
            tokenize_fn,
            seq_len=d.seq_len,
            batch_size=d.batch_size,
            shuffle=False,
            num_epochs=1,
            pad_id=pad_id,
            allow_split=d.allow_split,
            drop_remainder=False,
        )
        for batch in it:
            eval_batches.append(batch)
            if len(eval_batches) >= config.eval_batches:
                break
    return train_iter, steps_per_epoch, eval_batches


def _trained_model(config, tcfg, tparams, tmod, tokenizer, eval_batches):
    """(drafter config, drafter module, initial parameters, loss function): the drafter (its
    config from config.drafter and the target; initialized fresh, fc rows scaled by the tap
    RMS, or from drafter.init_path) in drafter mode; the target itself in target mode."""
    if config.mode != "drafter":
        ul_weight = float(config.unlikelihood.weight)

        def loss_fn(params, frozen, batch, key):
            del frozen, key
            return unlikelihood.combined_loss(tmod, params, batch, ul_weight, losses.target_loss)

        return None, None, tparams, loss_fn
    dc = config.drafter
    mask_id = dc.mask_token_id
    if mask_id < 0:
        mask_id = (
            tokenizer.mask_id
            if tokenizer is not None and tokenizer.mask_id is not None
            else tcfg.vocab_size - 1
        )
    overrides = {"intermediate_size": dc.intermediate_size} if dc.intermediate_size else {}
    if dc.get("param_dtype"):  # float32 masters; the frozen target keeps its dtype
        overrides["param_dtype"] = as_dtype(dc.param_dtype)
    kind = registry.named("dflash")
    dcfg = kind.new_config(
        tcfg,
        num_layers=dc.num_layers,
        num_taps=dc.num_taps,
        block_size=dc.block_size,
        mask_token_id=mask_id,
        target_layer_ids=tuple(dc.target_layer_ids) or None,
        sliding_window=dc.get("sliding_window", 0) or None,
        **overrides,
    )
    v2 = dc.get("dflash2", {})
    v2_fields = {}
    if v2.get("enabled", False):  # DFlash 2: convolutions, logit rule, candidate selector
        cap = v2.get("final_logit_softcapping", 0.0)
        v2_fields = dict(
            conv_kernel_size=v2.conv_kernel_size,
            conv_group_size=v2.conv_group_size,
            selector_rank=v2.selector_rank,
            selector_top_k=v2.selector_top_k,
            output_multiplier=v2.output_multiplier,
            final_logit_softcapping=cap if cap > 0 else None,
            is_causal=None,  # the reference's default for DFlash 2: its sliding layers causal
        )
        dcfg = dcfg.replace(**v2_fields)
    if dc.init_path:
        loaded = kind.load(
            dc.init_path, Target(tcfg, tparams), param_dtype=dc.get("param_dtype") or None
        )
        dcfg, init = loaded.config, loaded.params
        want = tuple(dc.target_layer_ids)
        if want and want != tuple(dcfg.target_layer_ids):  # more taps: new fc rows at zero
            dcfg, init = kind.widen_taps(dcfg, init, want, tcfg)
        if v2_fields and not dcfg.dflash2:  # a DFlash drafter continued as DFlash 2
            dcfg, init = kind.upgrade(dcfg, init, seed=config.seed, **v2_fields)
        if dc.get("sliding_window", 0):  # continue a drafter with (another) window
            causal = dcfg.is_causal if dcfg.dflash2 else False  # DFlash: bidirectional
            dcfg = kind.variant(dcfg, window=dc.sliding_window, causal=causal)
    else:
        init = kind.init_params(dcfg, seed=config.seed)
        if dc.get("fc_init", "normal") == "tap_rms":
            init = scale_fc_by_tap_rms(init, tmod, tparams, dcfg, eval_batches)
    dmod = kind.module(dcfg)
    return dcfg, dmod, init, drafter_loss_fn(config, tmod, dmod)


def tap_rms(tmod, tparams, dcfg, batches) -> np.ndarray:
    """Per input feature of the drafter's `fc` (the concatenated taps), the root mean square of
    the target's tapped hidden states over the scored tokens of `batches` (the first position
    of each row left out: attention-sink tokens carry activations 100x the rest)."""
    sq, n = 0.0, 0
    for batch in batches:
        ids = jnp.asarray(batch["input_ids"])
        taps = tmod.apply(
            {"params": tparams},
            ids,
            tuple(dcfg.target_layer_ids),
            segment_ids_BT=jnp.asarray(batch["segment_ids"]),
            method="taps",
        )
        x = np.asarray(taps, np.float64)[:, 1:]
        mask = np.asarray(batch["segment_ids"])[:, 1:] > 0
        sq = sq + (x[mask] ** 2).sum(0)
        n += int(mask.sum())
    return np.sqrt(sq / max(n, 1)).astype(np.float32)


def scale_fc_by_tap_rms(params, tmod, tparams, dcfg, batches):
    """`fc`'s rows scaled by median(rms) / rms of their input feature (`tap_rms`): every tapped
    feature then enters the context features at the same scale at step 0. LLM hidden states
    carry a few massive dimensions (SmolLM2-135M: 5 of 576 hold over half the energy at layers 1,
    14 and 27, and layer 27's RMS is ~10x layer 1's), which otherwise dominate `fc`'s output,
    so that after `hidden_norm` the context features start nearly alike for every token. An
    initialization only: the architecture and the checkpoint format are unchanged."""
    if not batches:
        raise ValueError(
            "drafter.fc_init='tap_rms' needs held-out batches to measure the taps "
            "(eval_batches >= 1 and held-out data)"
        )
    rms = np.maximum(tap_rms(tmod, tparams, dcfg, batches[:1]), 1e-6)
    scale = (np.median(rms) / rms)[:, None]
    kernel = params["fc"]["kernel"]
    new = (np.asarray(kernel, np.float32) * scale).astype(kernel.dtype)
    return {**params, "fc": {**params["fc"], "kernel": jnp.asarray(new)}}


def _repetition_sampler(
    config, tcfg, tokenizer, train_docs, tokenize_fn, stop_ids, pad_id, rng
) -> "unlikelihood.RepetitionSampler":
    u = config.unlikelihood
    if u.prompt_source not in ("docs", "functions", "mixed"):
        raise ValueError(
            "unlikelihood.prompt_source must be 'docs', 'functions' or 'mixed', "
            f"got {u.prompt_source!r}"
        )
    if u.prompt_source != "docs" and tokenizer is None:
        raise ValueError(
            f"unlikelihood.prompt_source={u.prompt_source!r} needs text documents "
            "and a tokenizer; use 'docs'"
        )
    n_fn = {"docs": 0, "functions": u.num_prompts, "mixed": u.num_prompts // 2}[u.prompt_source]
    prompts = prompt_pool(
        train_docs, tokenizer, tokenize_fn, u.num_prompts, n_fn, u.prompt_len, 2, 50, rng
    )
    return unlikelihood.RepetitionSampler(
        tcfg,
        prompts,
        batch_size=u.batch_size,
        prompt_len=u.prompt_len,
        max_new_tokens=u.max_new_tokens,
        ngram=u.ngram,
        stop_ids=stop_ids,
        pad_id=pad_id,
    )


def _process_group_mesh():
    """Several processes: a data-parallel mesh over all their devices (generation that every
    process takes part in). One process: None (generation on the default device)."""
    if not distributed.is_multiprocess():
        return None
    from dflash_jax.parallel import sharding

    return sharding.make_mesh(data=-1, fsdp=1, tensor=1)


def _regenerated_docs(
    config,
    workdir,
    tcfg,
    tparams,
    tokenizer,
    train_src,
    text_tokenize,
    rng,
    tok_dir=None,
    tpath=None,
):
    from dflash_jax.training.regenerate import read_records, regenerate, regenerate_from_file

    r = config.regen
    path = r.output or os.path.join(workdir, "regenerated.jsonl")
    # Decided once (process 0's view): a file one process is writing must not change it.
    exists = bool(distributed.broadcast(np.int32(os.path.exists(path))))
    if not exists and r.prompt_source == "file":
        regenerate_from_file(
            Target(tcfg, tparams, tpath),
            tokenizer,
            tok_dir,
            r.prompt_file,
            path,
            use_chat_template=r.chat_template,
            log=log,
            max_new_tokens=r.max_new_tokens,
            batch_size=r.batch_size,
            temperature=r.temperature,
            seed=config.seed,
            stop_token_ids=(tokenizer.eos_id,) if tokenizer is not None else (),
            mesh=_process_group_mesh(),
        )
    elif not exists:
        if r.prompt_source == "random":
            prng = np.random.RandomState(config.seed + 29)
            prompts = [
                prng.randint(2, tcfg.vocab_size, r.prompt_len).tolist()
                for _ in range(r.num_prompts)
            ]
        elif r.prompt_source in ("stdlib", "functions", "mixed"):
            if text_tokenize is None:
                raise ValueError(f"regen.prompt_source={r.prompt_source!r} needs a tokenizer")
            n_fn = {"stdlib": 0, "functions": r.num_prompts, "mixed": r.num_prompts // 2}[
                r.prompt_source
            ]
            prompts = prompt_pool(
                train_src,
                tokenizer,
                text_tokenize,
                r.num_prompts,
                n_fn,
                r.prompt_len,
                r.function_body_lines,
                r.functions_per_file,
                rng,
            )
        else:
            raise ValueError(
                "regen.prompt_source must be 'stdlib', 'functions', 'mixed' or "
                f"'random', got {r.prompt_source!r}"
            )
        log(f"regenerating {len(prompts)} responses with the target -> {path}")
        regenerate(
            Target(tcfg, tparams, tpath),
            prompts,
            path,
            max_new_tokens=r.max_new_tokens,
            batch_size=r.batch_size,
            temperature=r.temperature,
            seed=config.seed,
            stop_token_ids=(tokenizer.eos_id,) if tokenizer is not None else (),
            tokenizer=tokenizer,
            mesh=_process_group_mesh(),
        )
    records = read_records(path, vocab_size=tcfg.vocab_size)
    n_eval = max(1, int(round(r.holdout_fraction * len(records))))
    return records[:-n_eval], records[-n_eval:]
