"""infer.py's flags checked before anything loads (`check_infer_flags`), and the rule that no
output file is one of the run's inputs (`output_not_input`): one line naming the flag."""

from __future__ import annotations

import difflib
from typing import Iterable, Mapping, Optional

from dflash_jax.support import checks
from dflash_jax.support.checks import (
    ATTENTION_IMPLS,
    BLOCK_SIZE_MAX,
    BLOCK_SIZE_MIN,
    MAX_TREE_BUDGET,
    check_denoise,
    confidence_threshold,
    int_param,
    profile_dir,
    sampling_params,
    seed_param,
    writable_file,
)


def output_not_input(
    path: Optional[str], name: str, files: Optional[Mapping] = None, dirs: Optional[Mapping] = None
) -> None:
    """`checks.output_not_input` with the model files the loaders read (`hub.ALLOW_PATTERNS`)."""
    from dflash_jax.models.hub import ALLOW_PATTERNS

    checks.output_not_input(path, name, files, dirs, model_files=ALLOW_PATTERNS)


# infer.py's flags that only the dry run reads, and every flag `infer.py --dry_run` passes on to
# it (`dflash_jax.dry_run.infer_main`) or uses itself; any other flag given with --dry_run, or
# one of the first without it, would be ignored: `check_flags_used` refuses it.
DRY_RUN_ONLY = ("topology", "dry_run_model", "context", "tau")
DRY_RUN_USES = DRY_RUN_ONLY + (
    "dry_run",
    "mesh",
    "batch_size",
    "max_new_tokens",
    "attention_impl",
    "json_out",
    "block_size",
    "tree_budget",
    "scan_layers",
    "verbose",
)


def check_flags_used(given: Iterable[str], dry_run: bool) -> None:
    """Raises ValueError (one line) for the first flag in `given` (the names of the infer.py
    flags on the command line) that the run would ignore: one of `DRY_RUN_ONLY` without
    --dry_run, or with --dry_run one it does not use (`DRY_RUN_USES`)."""
    for name in given:
        if not dry_run and name in DRY_RUN_ONLY:
            raise ValueError(f"--{name} is for --dry_run (a compile for a TPU topology)")
        if dry_run and name not in DRY_RUN_USES:
            raise ValueError(
                f"--{name} is not used by --dry_run (it compiles --dry_run_model's programs "
                "from abstract params); drop it (python -m dflash_jax.dry_run --help lists the "
                "dry run's own flags)"
            )


def check_infer_flags(f: Mapping) -> None:
    """Raises ValueError (one line, naming the flag) for the first bad value among infer.py's
    flags (`f`: `FLAGS.flag_values_dict()`): --resume without --json_out, --prompt with
    --prompt_file, batch, token and step counts, the seed, sampling, the attention
    implementation, an output file or directory that cannot be written or that is the prompt
    file, dtypes, --quantize. Prompts and models are checked when they are read (`prompting`, `hub`);
    what depends on the models' config files (context length, block size, stop ids) by
    `infer_run.check_before_loading`."""
    from dflash_jax.models.config import as_dtype

    if f["resume"] and not f["json_out"]:
        raise ValueError("--resume needs --json_out (the file of the interrupted run)")
    if f.get("prompt") is not None and f.get("prompt_file"):
        raise ValueError(
            "--prompt and --prompt_file were both given; pass one (a prompt file can hold "
            'the prompt as a line {"prompt": ...})'
        )
    if f.get("prompt") is not None:  # bytes that were not UTF-8, lone surrogates, its length
        from dflash_jax.data.prompting import check_text

        check_text("--prompt", f["prompt"], from_bytes=True)  # argv: surrogateescape'd
    if f["batch_size"] is not None:
        int_param("--batch_size", f["batch_size"], lo=1)
    if f["json_out"]:
        writable_file(f["json_out"], "--json_out")
        output_not_input(f["json_out"], "--json_out", {"--prompt_file": f.get("prompt_file")})
    if f["profile_dir"]:
        profile_dir(f["profile_dir"], "--profile_dir")
    sampling_params(f["temperature"], f["top_k"], f["top_p"])
    confidence_threshold(f["confidence_threshold"])
    int_param("--max_new_tokens", f["max_new_tokens"], lo=1)
    int_param("--denoise_steps", f["denoise_steps"], lo=1)
    if f.get("remask") or f.get("denoise_schedule", "confidence") != "confidence":
        try:
            check_denoise(
                f.get("denoise_schedule", "confidence"), f.get("remask"), f["denoise_steps"]
            )
        except ValueError as e:
            raise ValueError("--" + str(e)) from None
    if seed_param("--seed", f.get("seed", 0)) != 0 and f["temperature"] == 0:
        raise ValueError(
            "--seed needs --temperature > 0 (greedy decoding takes the most probable token: "
            "nothing is drawn)"
        )
    if f["block_size"] is not None:
        int_param("--block_size", f["block_size"], lo=BLOCK_SIZE_MIN, hi=BLOCK_SIZE_MAX)
    if f.get("tree_budget") is not None:
        int_param("--tree_budget", f["tree_budget"], lo=1, hi=MAX_TREE_BUDGET)
    impl = f.get("attention_impl", "xla")
    if impl not in ATTENTION_IMPLS:
        near = difflib.get_close_matches(str(impl), ATTENTION_IMPLS, n=1)
        raise ValueError(
            f"--attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, got {impl!r}"
            + (f" (did you mean {near[0]!r}?)" if near else "")
        )
    as_dtype(f["dtype"])
    if f["param_dtype"]:
        as_dtype(f["param_dtype"])
    from dflash_jax.models.quantization import check_quantize

    try:
        quantize = check_quantize(f.get("quantize"))
    except ValueError:
        raise ValueError(
            f"--quantize must be int8 (weight-only, per output channel), got {f.get('quantize')!r}"
        ) from None
    if f.get("quantize_lm_head") and quantize is None:
        raise ValueError("--quantize_lm_head needs --quantize=int8")
