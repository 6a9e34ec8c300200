"""The checks of a trainer config (configs/default.py), each bad value one ConfigError line
before anything runs: `check_train_config`. A drafter kind's own settings are checked by its
training kind (`drafter_setup.DrafterTraining.check_config`)."""

from __future__ import annotations

import difflib
import os
from typing import Mapping, Optional

from dflash_jax.support.checks import (
    BLOCK_SIZE_MAX,
    BLOCK_SIZE_MIN,
    ConfigError,
    describe_value,
    float_param,
    int_param,
    unknown_keys,
)
from dflash_jax.training import drafter_setup


def check_train_config(config, reference: Optional[Mapping] = None) -> None:
    """Raises ConfigError (one line) for the first bad value of a trainer config: unknown keys
    (with the nearest valid key), wrong types, out-of-range sizes and rates, unknown choices.
    `reference`: the known keys (default: configs/default.py's `get_config()`)."""
    if reference is None:
        from configs.default import get_config

        reference = get_config()
    bad = unknown_keys(config, reference)
    if bad:
        raise ConfigError(bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    _check_choices(config)
    _check_drafter(config)
    _check_run(config)


def _choice(name, value, options):
    """ConfigError (one line, with the nearest option) unless `value` is one of `options`."""
    if value not in options:
        near = difflib.get_close_matches(str(value), options, n=1)
        raise ConfigError(
            f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}"
            + (f" (did you mean {near[0]!r}?)" if near else "")
        )


def _check_choices(c) -> None:
    """`check_train_config`: the choices (mode, loss, masks, attention, dtype, data and prompt
    sources) and the regeneration prompt file."""
    E, choice = ConfigError, _choice
    choice("mode", c.mode, ("drafter", "target"))
    choice("loss", c.loss, ("ce", "kl", "topk_kl", "topk_lk"))
    choice("position_weights", c.get("position_weights", "decay"), ("decay", "dpace"))
    int_param("loss_positions", c.get("loss_positions", 0), lo=0, error=E)
    choice("mask_schedule", c.mask_schedule, ("all", "random", "mdlm"))
    choice("drafter.fc_init", c.drafter.get("fc_init", "normal"), ("normal", "tap_rms"))
    mff = c.get("mask_full_fraction", 0.5)
    if isinstance(mff, bool) or not isinstance(mff, (int, float)) or not 0.0 <= mff <= 1.0:
        raise E(f"mask_full_fraction must be a number in [0, 1], got {mff!r}")
    choice("attention_impl", c.attention_impl, ("xla", "pallas", "pallas_interpret", "auto"))
    if not isinstance(c.get("scan_layers", False), bool):
        raise E(f"scan_layers must be true or false, got {c.get('scan_layers')!r}")
    choice("dtype", c.dtype, ("float32", "bfloat16", "float16"))
    choice("data.kind", c.data.kind, ("stdlib", "files", "regenerated", "synthetic"))
    choice(
        "regen.prompt_source",
        c.regen.prompt_source,
        ("stdlib", "functions", "mixed", "random", "file"),
    )
    if not isinstance(c.regen.get("chat_template", True), bool):
        raise E(
            f"regen.chat_template must be True or False, got {describe_value(c.regen.chat_template)}"
        )
    prompt_file = c.regen.get("prompt_file", "")
    if c.regen.prompt_source == "file":
        # The file is read when regeneration runs; an existing regen.output is reused as is.
        out = c.regen.output
        if not (out and os.path.exists(out)):
            if not isinstance(prompt_file, str) or not prompt_file:
                raise E(
                    "regen.prompt_source='file' needs regen.prompt_file (JSONL "
                    "conversations or prompts)"
                )
            if not os.path.isfile(prompt_file):
                raise E(f"regen.prompt_file {prompt_file}: no such file")
    elif prompt_file:
        raise E(
            f"regen.prompt_file is set but regen.prompt_source is "
            f"{c.regen.prompt_source!r}; set regen.prompt_source='file'"
        )
    choice(
        "unlikelihood.prompt_source", c.unlikelihood.prompt_source, ("docs", "functions", "mixed")
    )


def _check_drafter(c) -> None:
    """`check_train_config`: the seed and the drafter's sizes, kind, tap store and DFlash 2
    settings, then its training kind's own (`DrafterTraining.check_config`)."""
    E = ConfigError
    int_param("seed", c.seed, error=E)
    int_param(
        "drafter.block_size", c.drafter.block_size, lo=BLOCK_SIZE_MIN, hi=BLOCK_SIZE_MAX, error=E
    )
    int_param("drafter.num_layers", c.drafter.num_layers, lo=1, error=E)
    int_param("drafter.num_taps", c.drafter.num_taps, lo=1, error=E)
    int_param("drafter.mask_token_id", c.drafter.mask_token_id, lo=-1, error=E)
    int_param("drafter.intermediate_size", c.drafter.intermediate_size, lo=0, error=E)
    int_param("drafter.sliding_window", c.drafter.get("sliding_window", 0), lo=0, error=E)
    name = c.drafter.get("kind", "dflash")
    _choice("drafter.kind", name, drafter_setup.trained_kind_names())
    kind = drafter_setup.training_kind_named(name)
    dvs = c.drafter.get("draft_vocab_size", 0)
    int_param("drafter.draft_vocab_size", dvs, lo=0, error=E)
    store = c.data.get("tap_store", "")
    if dvs and not kind.takes_draft_vocab_size:
        raise E(drafter_setup.DRAFT_VOCAB_SIZE_IS_DFLASH)
    if c.loss.startswith("topk_") and not store:
        raise E(f"loss={c.loss!r} reads the target's top-k from data.tap_store: set it")
    if store:
        if c.mode != "drafter" or not kind.reads_tap_store:
            raise E("data.tap_store is for training DFlash drafters (mode='drafter')")
        if c.data.allow_split:
            raise E(
                "data.tap_store: data.allow_split=True packs other pieces of a document than "
                "the store holds; set --config.data.allow_split=False"
            )
        if c.loss == "kl":
            raise E("data.tap_store keeps the target's top-k, not its logits: use loss='topk_kl'")
        if c.data.get("cache_taps", False):
            raise E("data.tap_store and data.cache_taps: choose one")
        if not os.path.isfile(os.path.join(store, "manifest.json")):
            raise E(f"data.tap_store {store}: not a tap store (no manifest.json)")
    v2 = c.drafter.get("dflash2", None)
    if v2 is not None and v2.get("enabled", False):
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            int_param(f"drafter.dflash2.{name}", v2.get(name), lo=1, error=E)
        float_param(
            "drafter.dflash2.output_multiplier",
            v2.output_multiplier,
            lo=0.0,
            lo_open=True,
            error=E,
        )
        float_param(
            "drafter.dflash2.final_logit_softcapping", v2.final_logit_softcapping, lo=0.0, error=E
        )
        float_param("drafter.dflash2.selector_weight", v2.selector_weight, lo=0.0, error=E)
    for i, t in enumerate(c.drafter.target_layer_ids):
        int_param(f"drafter.target_layer_ids[{i}]", t, lo=0, error=E)
    kind.check_config(c, E)


def _check_run(c) -> None:
    """`check_train_config`: the loss's anchors, the data, regeneration and unlikelihood sizes,
    the synthetic target, the optimizer and the schedule."""
    E = ConfigError
    int_param("num_anchors", c.num_anchors, lo=1, error=E)
    float_param("gamma", c.gamma, lo=0.0, lo_open=True, error=E)
    int_param("loss_chunk_anchors", c.loss_chunk_anchors, lo=0, error=E)
    int_param("data.seq_len", c.data.seq_len, lo=2, error=E)
    int_param("data.batch_size", c.data.batch_size, lo=1, error=E)
    int_param("data.num_epochs", c.data.num_epochs, lo=1, error=E)
    float_param("data.validation_percent", c.data.validation_percent, 0.0, 100.0, error=E)
    if c.data.kind == "files" and not len(c.data.paths):
        raise E("data.kind='files' needs data.paths (text or JSONL files)")
    for key in ("num_prompts", "prompt_len", "max_new_tokens", "batch_size"):
        int_param(f"regen.{key}", c.regen[key], lo=1, error=E)
    float_param("regen.temperature", c.regen.temperature, lo=0.0, error=E)
    float_param("regen.holdout_fraction", c.regen.holdout_fraction, 0.0, 1.0, error=E)
    float_param("unlikelihood.weight", c.unlikelihood.weight, lo=0.0, error=E)
    for key in ("batch_size", "prompt_len", "max_new_tokens", "num_prompts"):
        int_param(f"unlikelihood.{key}", c.unlikelihood[key], lo=1, error=E)
    int_param("unlikelihood.ngram", c.unlikelihood.ngram, lo=1, error=E)
    m = c.target_model
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        int_param(f"target_model.{key}", m[key], lo=1, error=E)
    int_param("target_model.vocab_size", m.vocab_size, lo=0, error=E)
    if m.num_heads % m.num_kv_heads:
        raise E(
            f"target_model.num_heads {m.num_heads} is not a multiple of num_kv_heads "
            f"{m.num_kv_heads}"
        )
    float_param("learning_rate", c.learning_rate, lo=0.0, lo_open=True, error=E)
    float_param("warmup_ratio", c.warmup_ratio, 0.0, 1.0, error=E)
    float_param("end_lr_ratio", c.end_lr_ratio, lo=0.0, error=E)
    float_param("grad_clip", c.grad_clip, lo=0.0, lo_open=True, error=E)
    float_param("weight_decay", c.weight_decay, lo=0.0, error=E)
    float_param("b1", c.b1, 0.0, 1.0, error=E)
    float_param("b2", c.b2, 0.0, 1.0, error=E)
    steps = int_param("num_train_steps", c.num_train_steps, lo=-1, error=E)
    if steps == 0:
        raise E("num_train_steps must be >= 1 (or -1: num_epochs over the data), got 0")
    if int_param("stop_at_step", c.stop_at_step, lo=-1, error=E) == 0:  # never "no limit"
        raise E("stop_at_step must be >= 1 (or -1: run the whole schedule), got 0")
    int_param("log_every", c.log_every, lo=1, error=E)
    int_param("eval_every", c.eval_every, lo=0, error=E)
    int_param("eval_batches", c.eval_batches, lo=0, error=E)
    int_param("eval_num_prompts", c.eval_num_prompts, lo=0, error=E)
    int_param("eval_prompt_len", c.eval_prompt_len, lo=1, error=E)
    int_param("eval_max_new_tokens", c.eval_max_new_tokens, lo=1, error=E)
    int_param("checkpoint_every", c.checkpoint_every, lo=1, error=E)
    int_param("keep_checkpoints", c.keep_checkpoints, lo=1, error=E)
