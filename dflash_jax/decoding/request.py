"""Generation settings (`Settings`, their one list) and requests checked once from the models'
configs alone (`Request.build`: so the batch runner checks a request from the config.json
files before any weight is read), and the host side of a run: the decode state read back into
a `GenerationResult` (also across the processes of a pod)."""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import jax
import numpy as np

from dflash_jax.decoding.step import Plan
from dflash_jax.drafters import registry
from dflash_jax.drafters.base import DRAFT_SAMPLING
from dflash_jax.support import checks
from dflash_jax.support.checks import MAX_TREE_BUDGET, check_denoise


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings of generation: every keyword of `generate` besides the models, the
    prompts, max_new_tokens, the mesh and the callbacks. This class is their one list:
    `Request.build`'s keywords are its fields, a `Generator` holds one, and `Plan`'s fields of
    the same names are taken from it by name (`plan`).

    As given (`Settings(temperature=0.7)`), or checked against a pair of configs (`check`:
    every value checked and normalized, block_size resolved)."""

    block_size: Optional[int] = None  # the verify block; None: the drafter's; 1: no drafter
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    stop_token_ids: Tuple[int, ...] = ()
    denoise_steps: int = 1
    denoise_schedule: str = "confidence"
    remask: bool = False
    confidence_threshold: Optional[float] = None
    tree_budget: Optional[int] = None
    return_drafts: bool = False
    prefill_chunk: Optional[int] = None  # None: `Plan.prefill_chunk`
    draft_sampling: Optional[str] = None  # None: the drafter's default (`Plan.draft_sampling`)
    # The configs these settings were checked against (`check`); None: as given.
    checked_for: Optional[tuple] = dataclasses.field(
        default=None, compare=False, repr=False, kw_only=True
    )

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        """The settings' names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "checked_for")

    @classmethod
    def of(cls, given: dict) -> "Settings":
        """Settings from keywords (a TypeError names one that is not a setting)."""
        unknown = sorted(set(given) - set(cls.names()))
        if unknown:
            raise TypeError(f"{unknown[0]!r} is not a generation setting")
        return cls(**given)

    def is_checked_for(self, target_config, drafter_config) -> bool:
        """Whether these are settings checked against equal configs."""
        if self.checked_for is None:
            return False
        try:
            return bool(self.checked_for == (target_config, drafter_config))
        except Exception:  # configs that do not compare (arrays in a user's config)
            return False

    def check(self, target_config, drafter_config, *, pair_checked: bool = False) -> "Settings":
        """These settings checked (types, ranges, ids in the vocabulary, what needs a drafter,
        what combines) against the target's and the drafter's configs (`drafter_config`
        None: autoregressive), normalized. pair_checked: the caller has checked the pair
        (the loaded drafter's `check_loaded`). Raises ValueError (one line) naming the
        setting."""
        drafted = drafter_config is not None
        kind = registry.of(drafter_config)
        if not pair_checked:
            kind.check_pair(drafter_config, target_config)
        vocab = target_config.vocab_size
        seed = checks.seed_param("seed", self.seed)
        temperature, top_k, top_p = checks.sampling_params(self.temperature, self.top_k, self.top_p)
        stop = checks.stop_id_tuple(self.stop_token_ids, vocab)
        steps = checks.int_param("denoise_steps", self.denoise_steps, lo=1)
        threshold = checks.confidence_threshold(self.confidence_threshold)
        block_size, tree_budget, remask = self.block_size, self.tree_budget, self.remask
        if drafted:
            limits = kind.limits(drafter_config)
            bs = limits.default_block_size if block_size is None else block_size
            if limits.trained_block_size is None:  # no trained block: any block in range
                bs = checks.int_param(
                    "block_size", bs, lo=checks.BLOCK_SIZE_MIN, hi=checks.BLOCK_SIZE_MAX
                )
            else:
                bs = checks.block_size_for(bs, limits.trained_block_size)
            if steps > bs - 1:
                raise ValueError(
                    f"denoise_steps must be in [1, {bs - 1}] (block_size - 1), got {steps}"
                )
            why = limits.chain_only
            for name, given in (
                ("denoise_steps", steps != 1),
                ("tree_budget", tree_budget is not None),
                ("remask", bool(remask)),
            ):
                if why and given:
                    raise ValueError(f"{name} is not implemented for {why}")
        else:
            bs = 1
            for name, given in (
                ("block_size", block_size is not None),
                ("denoise_steps", steps != 1),
                ("confidence_threshold", threshold is not None),
            ):
                if given:  # refused like tree_budget: a setting that cannot apply is not ignored
                    raise ValueError(
                        f"{name} needs a drafter (autoregressive decoding drafts nothing)"
                    )
        tree_budget = check_tree(
            target_config, drafted, bs, tree_budget, threshold, self.return_drafts
        )
        denoise_schedule, remask = check_denoise(
            self.denoise_schedule, remask, steps, has_drafter=drafted
        )
        if denoise_schedule != "confidence" and steps == 1:  # refused, never ignored
            raise ValueError(
                "denoise_schedule needs denoise_steps >= 2 (one drafter pass fixes every "
                "position at once)"
            )
        prefill_chunk = self.prefill_chunk
        if prefill_chunk is not None:
            prefill_chunk = checks.int_param("prefill_chunk", prefill_chunk, lo=0)
        draft_sampling = _check_draft_sampling(
            self.draft_sampling, drafter_config, temperature, steps, tree_budget
        )
        return Settings(
            block_size=bs,
            temperature=float(temperature),
            top_k=top_k,  # None under greedy (`checks.sampling_params` refuses one there)
            top_p=top_p,
            seed=seed,
            stop_token_ids=stop,
            denoise_steps=steps,
            denoise_schedule=denoise_schedule,
            remask=remask,
            confidence_threshold=threshold,
            tree_budget=tree_budget,
            return_drafts=bool(self.return_drafts and drafted),
            prefill_chunk=prefill_chunk,
            draft_sampling=draft_sampling,
            checked_for=(target_config, drafter_config),
        )

    def plan(
        self, attention_impl: str, stream: Optional[Callable[[List[List[int]]], None]] = None
    ) -> Plan:
        """The static settings of the programs of these (checked) settings: `Plan`'s fields
        taken by name (`attention_impl` made concrete for the devices compiled for;
        `stream`: generate's stream_callback)."""
        if self.checked_for is None:
            raise ValueError("Settings.plan needs checked settings (Settings.check)")
        plan_fields = {f.name for f in dataclasses.fields(Plan)}
        same = {
            n: getattr(self, n)
            for n in self.names()
            if n in plan_fields and not (n == "prefill_chunk" and self.prefill_chunk is None)
        }
        return Plan(**same, stream=stream, attention_impl=attention_impl)


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request, checked and normalized: prompts, max_new_tokens and checked
    `Settings`. Build it with `Request.build` (from keywords) or `Request.of` (from
    settings already checked); `plan` gives the static settings of the compiled programs."""

    prompts: Tuple[Tuple[int, ...], ...]
    max_new_tokens: int
    settings: Settings  # checked (`Settings.check`)

    # Build's keywords besides labels: the settings' names.
    SETTINGS = Settings.names()

    @classmethod
    def build(
        cls,
        target_config,
        drafter_config,
        prompts,
        max_new_tokens,
        *,
        labels: Optional[Sequence[str]] = None,
        **settings,
    ) -> "Request":
        """Every setting (`Settings`' fields, by keyword) checked against the target's and the
        drafter's configs (`drafter_config` None: autoregressive), then the prompts, and
        each prompt plus max_new_tokens against the context length. Raises ValueError (one
        line) naming the setting, or a bad prompt by its label (`labels[i]`, e.g.
        "file.jsonl:3"; default "prompt i"); TypeError for a keyword that is not a setting."""
        checked = Settings.of(settings).check(target_config, drafter_config)
        return cls.of(checked, prompts, max_new_tokens, labels=labels)

    @classmethod
    def of(
        cls,
        settings: Settings,
        prompts,
        max_new_tokens,
        *,
        labels: Optional[Sequence[str]] = None,
    ) -> "Request":
        """A request of checked `settings` (`Settings.check`): the prompts (token ids in the
        target's vocabulary) and max_new_tokens checked against the configs they were checked
        for."""
        if settings.checked_for is None:
            raise ValueError("Request.of needs checked settings (Settings.check)")
        target_config = settings.checked_for[0]
        prompts = checks.prompt_ids(prompts, target_config.vocab_size, labels=labels)
        max_new_tokens = checks.int_param("max_new_tokens", max_new_tokens, lo=1)
        _check_context(target_config, prompts, max_new_tokens, labels)
        return cls(
            prompts=tuple(tuple(p) for p in prompts),
            max_new_tokens=max_new_tokens,
            settings=settings,
        )

    def plan(
        self, attention_impl: str, stream: Optional[Callable[[List[List[int]]], None]] = None
    ) -> Plan:
        """The static settings of this request's programs (`Settings.plan`)."""
        return self.settings.plan(attention_impl, stream)


def _check_draft_sampling(value, drafter_config, temperature, denoise_steps, tree_budget):
    """draft_sampling checked against the drafter and the rest of the request: None (the
    drafter's default), "argmax" or "sample" (`drafters.base.DRAFT_SAMPLING`) with a model drafter;
    "sample" on a DFlash chain of one pass; at temperature > 0 only (at 0 every drafter
    drafts its argmax: a setting that cannot apply is refused, like top_k there)."""
    if value is None:
        return None
    if value not in DRAFT_SAMPLING:
        raise ValueError(
            f"draft_sampling must be one of {', '.join(map(repr, DRAFT_SAMPLING))} or None, "
            f"got {value!r}"[:200]
        )
    if drafter_config is None:
        raise ValueError("draft_sampling needs a drafter (autoregressive decoding drafts nothing)")
    if temperature == 0:
        raise ValueError(
            "draft_sampling needs temperature > 0 (at temperature 0 every drafter drafts its "
            "argmax)"
        )
    refusal = registry.of(drafter_config).limits(drafter_config).sample_refusal
    if refusal is not None and value == "sample":
        raise ValueError(refusal)
    if value == "sample":
        for name, given in (
            ("tree_budget", tree_budget is not None),
            ("denoise_steps", denoise_steps != 1),
        ):
            if given:
                raise ValueError(
                    f"draft_sampling='sample' does not combine with {name}: sampled drafts "
                    "are one chain from one drafter pass"
                )
    return value


def _check_context(cfg, prompts, max_new_tokens, labels=None) -> None:
    """Each prompt plus max_new_tokens within the target's context length."""
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            where = labels[i] if labels is not None else f"prompt {i}"
            raise ValueError(
                f"{where}: {len(p)} prompt tokens + max_new_tokens {max_new_tokens} exceed "
                f"the model's context length max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )


def check_tree(
    target_config, drafted, block_size, tree_budget, threshold=None, return_drafts=False
):
    """tree_budget checked against the rest of the request: None (the chain) or an int in
    [1, MAX_TREE_BUDGET] that the block's depth can hold, over a target that is not hybrid,
    with a drafter, no confidence threshold and no draft recording (also the dry run's check
    of --tree_budget against a model, before any compile)."""
    if tree_budget is None:
        return None
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, (int, np.integer)):
        raise ValueError(f"tree_budget must be an int or None, got {tree_budget!r}")
    tree_budget = int(tree_budget)
    if not drafted:
        raise ValueError("tree_budget needs a drafter (autoregressive decoding drafts nothing)")
    if not 1 <= tree_budget <= MAX_TREE_BUDGET:
        raise ValueError(f"tree_budget must be in [1, {MAX_TREE_BUDGET}], got {tree_budget}")
    if getattr(target_config, "hybrid", None) is not None:
        raise ValueError(
            "tree_budget is not supported over a hybrid (Gated DeltaNet) target: a tree needs "
            "its recurrent state per path (one per node); decode a chain (no tree_budget)"
        )
    from dflash_jax.drafters.tree import max_nodes

    most = max_nodes(block_size - 1, min(tree_budget, target_config.vocab_size))
    if tree_budget > most:
        raise ValueError(
            f"tree_budget {tree_budget} exceeds the {most} draft prefixes a block of "
            f"{block_size} can hold"
        )
    for name, bad, why in (
        (
            "confidence_threshold",
            threshold is not None,
            "a tree spends its budget where the drafter is unsure by construction",
        ),
        ("return_drafts", bool(return_drafts), "drafts are recorded for chains only"),
    ):
        if bad:
            raise ValueError(f"tree_budget does not combine with {name}: {why}")
    return tree_budget


@dataclasses.dataclass
class GenerationResult:
    """tokens: per sequence, the new token ids (prompt excluded, truncated after a stop token).
    acceptance_lengths: per sequence, tokens committed at each decode step (target pass).
    drafts: per sequence, the drafted block (bs-1 ids) of each step, when requested.
    stats: prefill_s, decode_s, compile_s, decode_tokens_per_s, steps, tau, new_tokens; tau
    (tokens per target pass) is None where no decode step ran (every token from the prefill).
    """

    tokens: List[List[int]]
    acceptance_lengths: List[List[int]]
    drafts: Optional[List[List[List[int]]]]
    stats: dict

    @property
    def tau(self) -> Optional[float]:
        return self.stats["tau"]


def gather_multiprocess(state, plan, times):
    """A mesh over several processes: the outputs `collect` reads, gathered to numpy on every
    process (a collective), and process 0's timings, so every process returns the same
    result."""
    from dflash_jax.parallel import distributed

    out = dict(tokens=state.tokens, num_out=state.num_out, accepted=state.accepted, step=state.step)
    if plan.return_drafts:
        out["drafts"] = state.drafts
    out = distributed.gather(out)
    times = distributed.broadcast(np.asarray(times, np.float64))
    return state.replace(**out), tuple(float(t) for t in times)


def collect(
    state, plan, b: int, *, prefill_s: float, decode_s: float, compile_s: float
) -> GenerationResult:
    """Host-side result of a final `decoding.DecodeState`: per-sequence tokens, acceptance
    lengths, drafts, and stats."""
    tokens, num_out, accepted, steps = jax.device_get(
        (state.tokens, state.num_out, state.accepted, state.step)
    )
    drafts_np = np.asarray(state.drafts) if plan.return_drafts else None
    out_tokens, acc, drafts = [], [], [] if plan.return_drafts else None
    for i in range(b):
        out_tokens.append(tokens[i, : num_out[i]].tolist())
        active = accepted[i, :steps] > 0
        acc.append(accepted[i, :steps][active].tolist())
        if drafts is not None:
            drafts.append(drafts_np[:steps, i][active].tolist())
    all_acc = [a for seq in acc for a in seq]
    new_tokens = int(num_out.sum())
    decode_tokens = int(sum(sum(a) for a in acc))
    stats = {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "compile_s": compile_s,
        "steps": int(steps),
        "new_tokens": new_tokens,
        "decode_tokens_per_s": decode_tokens / max(decode_s, 1e-9),
        "tokens_per_s": new_tokens / max(prefill_s + decode_s, 1e-9),
        "tau": float(np.mean(all_acc)) if all_acc else None,  # None: no decode step ran
        "block_size": plan.block_size,
        "batch": b,
    }
    return GenerationResult(tokens=out_tokens, acceptance_lengths=acc, drafts=drafts, stats=stats)
