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
import os
from typing import Any, Callable, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters import registry
from dflash_jax.models import checkpoint, hub, layer_stack
from dflash_jax.models.config import ModelConfig, as_dtype
from dflash_jax.models.target import Target, init_params, load_target, target_module
from dflash_jax.models.transformer import Transformer
from dflash_jax.training import drafter_setup
from dflash_jax.training.corpus import _batches, _documents, _tfds_sources, _tokenizer
from dflash_jax.training.drafter_setup import _repetition_sampler


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
    drafter_vocab: Any = None  # its kind's `from_trained` vocab (DFlash: draft vocabulary)
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
        return kind.from_trained(self.drafter_cfg, params, self.drafter_vocab)


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
    kind = drafter_setup.training_kind(config)  # None: the target trains itself
    if kind is None:
        trained = drafter_setup.TrainedDrafter(
            None, None, tparams, drafter_setup.target_loss_fn(config, tmod)
        )
    else:
        trained = kind.build(
            drafter_setup.TrainingInputs(
                config, tcfg, tparams, tmod, tokenizer, eval_batches, train_docs, tokenize_fn
            )
        )
    dcfg = trained.config
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
        dmod=trained.module,
        init_params=trained.init_params,
        loss_fn=trained.loss_fn,
        train_iter=train_iter,
        steps_per_epoch=steps_per_epoch,
        eval_batches=eval_batches,
        eval_prompts=eval_prompts,
        tokenizer=tokenizer,
        tokenizer_dir=tok_dir,
        stop_ids=stop_ids,
        repetition_sampler=sampler,
        drafter_vocab=trained.vocab,
        tap_layers=tap_layers,
    )


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
