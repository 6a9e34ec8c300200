"""The drafter side of a training run (`experiment.build_experiment`): how each drafter kind
that can be trained is trained (`TRAINED_KINDS`: its config section's checks, its model,
initialization, draft vocabulary and loss function). The trainer, the config checks and the
tap cache ask a drafter's training kind (`training_kind`); they never test for a kind.

Training a new drafter kind: a `DrafterTraining` here, named as its kind in the registry
(`dflash_jax.drafters.registry`), and one entry in `TRAINED_KINDS`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from dflash_jax.parallel import distributed
from dflash_jax.data.prompts import prompt_pool
from dflash_jax.drafters import registry
from dflash_jax.models import hub
from dflash_jax.models.config import as_dtype
from dflash_jax.models.target import Target
from dflash_jax.models.transformer import Transformer
from dflash_jax.support.checks import float_param, int_param
from dflash_jax.training import losses, unlikelihood


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
            distributed.say(f"draft vocabulary: the {k} tokens of {path}")
            return have
    counts = dv.token_counts(
        (train_docs[i] for i in range(len(train_docs))), tokenize_fn, tcfg.vocab_size
    )
    vocab = dv.top_tokens(counts, k)
    distributed.say(
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


def target_loss_fn(config, tmod) -> Callable:
    """The loss of target mode (the target trained itself, with unlikelihood when weighted)."""
    ul_weight = float(config.unlikelihood.weight)

    def loss_fn(params, frozen, batch, key):
        del frozen, key
        return unlikelihood.combined_loss(tmod, params, batch, ul_weight, losses.target_loss)

    return loss_fn


def _dflash_model(config, tcfg, tparams, tmod, tokenizer, eval_batches):
    """(drafter config, drafter module, initial parameters, loss function) of a DFlash or
    DFlash 2 drafter: its config from config.drafter and the target; initialized fresh, fc rows
    scaled by the tap RMS, or from drafter.init_path."""
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


@dataclasses.dataclass(frozen=True)
class TrainingInputs:
    """What a training kind builds its drafter from (`experiment.build_experiment`)."""

    config: Any  # the trainer config (configs/default.py)
    target_cfg: Any
    target_params: Any
    tmod: Any  # the target's module (its pass is frozen in drafter mode)
    tokenizer: Any
    eval_batches: Any
    train_docs: Any
    tokenize_fn: Callable


@dataclasses.dataclass(frozen=True)
class TrainedDrafter:
    """A drafter as training starts it: config, module, initial parameters, loss function, and
    the vocabulary its kind's `from_trained` takes (DFlash: its draft vocabulary or None;
    EAGLE-3: d2t)."""

    config: Any
    module: Any
    init_params: Any
    loss_fn: Callable
    vocab: Any = None


class DrafterTraining:
    """How drafters of one registered kind (`name`) are trained: the checks of its settings
    in the trainer config and the drafter training starts from."""

    name = ""
    takes_draft_vocab_size = False  # drafter.draft_vocab_size (a DFlash head's rows)
    reads_tap_store = False  # data.tap_store (the target's taps and top-k from disk)

    def check_config(self, c, error) -> None:
        """Raises `error` (one line) for a setting this kind cannot train with."""

    def build(self, inputs: TrainingInputs) -> TrainedDrafter:
        raise NotImplementedError


class DFlashTraining(DrafterTraining):
    """DFlash and DFlash 2 (drafter.dflash2.enabled): the paper's recipe (`losses`)."""

    name = "dflash"
    reads_tap_store = True
    takes_draft_vocab_size = True  # not with DFlash 2: its selector scores the full vocabulary

    def check_config(self, c, error) -> None:
        if c.drafter.get("draft_vocab_size", 0) and c.drafter.get("dflash2", {}).get(
            "enabled", False
        ):
            raise error(DRAFT_VOCAB_SIZE_IS_DFLASH)

    def build(self, inputs: TrainingInputs) -> TrainedDrafter:
        x, config = inputs, inputs.config
        dcfg, dmod, init, loss_fn = _dflash_model(
            config, x.target_cfg, x.target_params, x.tmod, x.tokenizer, x.eval_batches
        )
        vocab = None
        k = int(config.drafter.get("draft_vocab_size", 0))
        if k:
            vocab = _draft_vocab(config, x.target_cfg, x.train_docs, x.tokenize_fn, k)
            loss_fn = drafter_loss_fn(config, x.tmod, dmod, vocab)
        return TrainedDrafter(dcfg, dmod, init, loss_fn, vocab)


class Eagle3Training(DrafterTraining):
    """EAGLE-3: training-time test over its own draft vocabulary (`eagle3_ttt`)."""

    name = "eagle3"

    def check_config(self, c, error) -> None:
        e3 = c.drafter.eagle3
        int_param("drafter.eagle3.ttt_steps", e3.ttt_steps, lo=1, hi=32, error=error)
        int_param("drafter.eagle3.draft_vocab_size", e3.draft_vocab_size, lo=0, error=error)
        float_param(
            "drafter.eagle3.ttt_decay", e3.ttt_decay, lo=0.0, lo_open=True, hi=1.0, error=error
        )
        if len(c.drafter.target_layer_ids) not in (0, 3):
            raise error(
                "an eagle3 drafter reads 3 target layers: drafter.target_layer_ids must name 3 "
                f"(or none: EAGLE-3's default), got {tuple(c.drafter.target_layer_ids)}"
            )
        v2 = c.drafter.get("dflash2", None)
        if c.mode != "drafter" or c.loss != "ce" or (v2 is not None and v2.get("enabled")):
            raise error(
                "drafter.kind='eagle3' trains in mode 'drafter' with loss 'ce' and without "
                "drafter.dflash2"
            )

    def build(self, inputs: TrainingInputs) -> TrainedDrafter:
        x = inputs
        dcfg, dmod, init, loss_fn, d2t = _eagle3_model(
            x.config, x.target_cfg, x.tmod, x.train_docs, x.tokenize_fn
        )
        return TrainedDrafter(dcfg, dmod, init, loss_fn, d2t)


# The drafter kinds the trainer trains (config.drafter.kind), by their registry names.
TRAINED_KINDS: Tuple[DrafterTraining, ...] = (DFlashTraining(), Eagle3Training())

DRAFT_VOCAB_SIZE_IS_DFLASH = (
    "drafter.draft_vocab_size is for DFlash drafters (EAGLE-3: "
    "drafter.eagle3.draft_vocab_size; DFlash 2's selector scores the full vocabulary)"
)


def trained_kind_names() -> Tuple[str, ...]:
    return tuple(k.name for k in TRAINED_KINDS)


def training_kind(config) -> Optional[DrafterTraining]:
    """The training kind of config.drafter.kind (None in target mode: no drafter is trained)."""
    if config.mode != "drafter":
        return None
    return training_kind_named(config.drafter.get("kind", "dflash"))


def training_kind_named(name: str) -> DrafterTraining:
    """The training kind `name`: a ValueError naming those there are for another
    (`check_train_config` refuses it first, with the nearest name)."""
    for kind in TRAINED_KINDS:
        if kind.name == name:
            registry.named(name)  # a training kind trains a registered drafter kind
            return kind
    raise ValueError(
        f"drafter.kind must be one of {', '.join(map(repr, trained_kind_names()))}, got {name!r}"
    )


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
