"""The value checks every entry point shares, run before any compute or file write (stdlib and
NumPy only; infer.py's own flags: `dflash_jax.frontend.infer_flags`).

`generate` (the API), `infer.py` and the trainer (`train.py` configs) call these functions
first, so bad input gets one clear line (a `ValueError`, or its subclass `ConfigError` for
training configs) instead of a traceback from deep inside tracing, a silently truncated value,
or results lost at the end of a run.

    int_param("block_size", 8.0)             -> ValueError: block_size must be an integer ...
    prompt_ids([1, 2, 3], vocab_size=100)    -> ValueError: ... a flat list ...; wrap it
    sampling_params(1.0, None, 0.0)          -> ValueError: top_p must be in (0, 1] ...
    check_train_config(config)               -> ConfigError: unknown config key 'drafter.num_layer'
                                                (did you mean 'drafter.num_layers'?)
    writable_file("out/results.json")        -> ValueError: ... directory out does not exist
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import math
import numbers
import os
import tempfile
import warnings
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np


class ConfigError(ValueError):
    """A training config value that is out of range, of the wrong type, or an unknown key."""


def _is_int(value) -> bool:
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def _describe(value) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def int_param(
    name: str, value, lo: Optional[int] = None, hi: Optional[int] = None, error=ValueError
) -> int:
    """`value` as an int: integers only (a float, even 8.0, a bool or a string is an error, so
    nothing is silently truncated), within [lo, hi] when given."""
    if not _is_int(value):
        raise error(f"{name} must be an integer, got {_describe(value)}")
    value = int(value)
    if lo is not None and value < lo or hi is not None and value > hi:
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise error(f"{name} must be {bounds}, got {value}")
    return value


def float_param(
    name: str,
    value,
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    lo_open: bool = False,
    error=ValueError,
) -> float:
    """`value` as a finite float (ints accepted), within [lo, hi] ((lo, hi] with lo_open)."""
    if not (
        isinstance(value, (numbers.Real, np.floating, np.integer))
        and not isinstance(value, (bool, np.bool_))
    ):
        raise error(f"{name} must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise error(f"{name} must be a finite number, got {value}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    if below or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        bounds = (
            f"in {left}{lo}, {hi}]"
            if lo is not None and hi is not None
            else f"> {lo}"
            if lo_open
            else f">= {lo}"
            if lo is not None
            else f"<= {hi}"
        )
        raise error(f"{name} must be {bounds}, got {value}")
    return value


def token_id_list(
    name: str, value, vocab_size: Optional[int] = None, allow_empty: bool = False
) -> List[int]:
    """A list of integer token ids in [0, vocab_size). A string, a float id (1.5, even 2.0)
    or a nested list is an error naming the first bad entry."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, np.ndarray)):
        raise ValueError(f"{name} must be a list of integer token ids, got {_describe(value)}")
    out = []
    for j, t in enumerate(value):
        if not _is_int(t):
            raise ValueError(f"{name}[{j}] must be an integer token id, got {_describe(t)}")
        out.append(int(t))
    if not out and not allow_empty:
        raise ValueError(f"{name} is empty")
    if vocab_size is not None and out and (min(out) < 0 or max(out) >= vocab_size):
        bad = next(t for t in out if t < 0 or t >= vocab_size)
        raise ValueError(
            f"{name} has token ids outside [0, {vocab_size}): {bad} (range "
            f"[{min(out)}, {max(out)}])"
        )
    return out


def prompt_ids(
    prompts, vocab_size: Optional[int] = None, labels: Optional[Sequence[str]] = None
) -> List[List[int]]:
    """`prompts` as a list of token-id lists (one per prompt). A flat list of ints, a string,
    or a list of strings is an error that says what was expected; a bad prompt is named by
    `labels[i]` (e.g. "file.jsonl:3"), default "prompt i"."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist() if prompts.ndim == 2 else prompts
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts must be a list of token-id lists (one per prompt), got {_describe(prompts)}"
        )
    if not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(_is_int(p) for p in prompts):
        raise ValueError(
            "prompts must be a list of token-id lists (one per prompt), got a flat "
            f"list of {len(prompts)} ints; for one prompt pass [[...]]"
        )
    out = []
    for i, p in enumerate(prompts):
        where = labels[i] if labels is not None and i < len(labels) else f"prompt {i}"
        if isinstance(p, (str, bytes)):
            raise ValueError(
                f"{where} is a string ({p[:30]!r}); prompts are token ids: "
                "encode text with the target's tokenizer first"
            )
        if isinstance(p, (list, tuple, np.ndarray)) and len(p) == 0:
            raise ValueError(f"{where} is empty")
        out.append(token_id_list(where, p, vocab_size))
    return out


def sampling_params(temperature, top_k, top_p) -> Tuple[float, Optional[int], Optional[float]]:
    """(temperature, top_k, top_p) checked: temperature finite and >= 0; top_k an integer
    >= 1 (or None); top_p in (0, 1] (or None). A NaN or an empty nucleus would otherwise turn
    every weight to -inf and the sampler would emit token 0 at every position. Greedy
    (temperature 0) samples nothing, so a top_k or top_p there is refused, never ignored."""
    temperature = float_param("temperature", temperature, lo=0.0)
    if top_k is not None:
        top_k = int_param("top_k", top_k, lo=1)
    if top_p is not None:
        top_p = float_param("top_p", top_p, lo=0.0, hi=1.0, lo_open=True)
    if temperature == 0:
        for name, given in (("top_k", top_k is not None), ("top_p", top_p is not None)):
            if given:
                raise ValueError(
                    f"{name} needs temperature > 0 (greedy decoding takes the most probable "
                    "token: nothing is sampled)"
                )
    return temperature, top_k, top_p


def stop_id_tuple(ids: Iterable, vocab_size: int) -> Tuple[int, ...]:
    """Sorted distinct stop ids, each an integer in [0, vocab_size)."""
    if isinstance(ids, (str, bytes)) or (ids is not None and _is_int(ids)):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {_describe(ids)}")
    ids = token_id_list("stop_token_ids", list(ids or ()), vocab_size, allow_empty=True)
    return tuple(sorted(set(ids)))


# The ranges every entry point checks against, stated once: the verify block (a drafter's block
# size, generate's and infer.py's --block_size, the dry run's, the trainer's) and the draft tree
# (above MAX_TREE_BUDGET the builder's O(budget^2) per row and step dominates; the published
# speed peaks at 256-512 nodes on an H200, DDTree).
BLOCK_SIZE_MIN, BLOCK_SIZE_MAX = 2, 64
MAX_TREE_BUDGET = 1024


def block_size_for(block_size, drafter_block_size: int) -> int:
    """A verify block size in [BLOCK_SIZE_MIN, BLOCK_SIZE_MAX]; larger than the drafter's
    trained block size is allowed (the drafter was never trained to fill those positions) with
    an explicit warning."""
    block_size = int_param("block_size", block_size, lo=BLOCK_SIZE_MIN, hi=BLOCK_SIZE_MAX)
    if block_size > drafter_block_size:
        warnings.warn(
            f"block_size {block_size} is larger than the drafter's trained block size "
            f"{drafter_block_size}: positions past {drafter_block_size} were never "
            "trained and are rarely accepted",
            UserWarning,
            stacklevel=3,
        )
    return block_size


def confidence_threshold(value) -> Optional[float]:
    return None if value is None else float_param("confidence_threshold", value, 0.0, 1.0)


# ----------------------------------------------------------------------------- output paths


# Inside `reading_once`: the JSON objects read so far, by real path, with the file's identity.
_READ_ONCE: Optional[dict] = None


@contextlib.contextmanager
def reading_once():
    """Within the block, `json_object_file` reads and checks each file once: a later read of
    the same file, unchanged (same inode, size and modification time), gets a copy of the
    first read's object. What one command reads many times (a model's config.json: the
    pre-load checks, then the loaders) comes off the disk once."""
    global _READ_ONCE
    outer = _READ_ONCE
    _READ_ONCE = {} if outer is None else outer
    try:
        yield
    finally:
        _READ_ONCE = outer


def json_object_file(path: str, error=ValueError) -> dict:
    """The JSON object in the file at `path`; a file that is not JSON or holds another JSON
    value is an `error` naming the file, and so is a number that is not finite (NaN, Infinity
    or 1e999, which Python's reader accepts and JSON does not), named by its field: a model's
    config.json with a NaN scale would otherwise give NaN logits. Inside `reading_once`, an
    unchanged file is read once."""
    key = ident = None
    if _READ_ONCE is not None:
        try:
            st = os.stat(path)
            key, ident = os.path.realpath(path), (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            pass  # open() below says what is wrong with it
        if key in _READ_ONCE and _READ_ONCE[key][0] == ident:
            return copy.deepcopy(_READ_ONCE[key][1])
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object, got {type(obj).__name__}")
    field = _non_finite(obj)
    if field is not None:
        raise error(f"{path}: {field[0]} must be a finite number, got {field[1]}")
    if key is not None:
        _READ_ONCE[key] = (ident, copy.deepcopy(obj))
    return obj


def _non_finite(value, where: str = ""):
    """(the field path, e.g. "dflash_config.output_multiplier" or "layer_types[2]", the value)
    of the first float in a parsed JSON value that is not finite, else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (where, value)
    if isinstance(value, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for name, v in items:
        found = _non_finite(v, name)
        if found is not None:
            return found
    return None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _short(name: str) -> str:
    return name if len(name) <= 40 else name[:20] + "..." + name[-12:]


def _fits_limits(path: str, name: str, shown: str) -> None:
    """Every name in `path` within the file system's NAME_MAX, the whole within PATH_MAX (an
    open or a mkdir fails with 'File name too long' otherwise, after the work)."""
    full = os.path.abspath(path)
    base = _nearest_existing(full)
    if not os.path.isdir(base):
        base = os.path.dirname(base)
    try:
        name_max = os.pathconf(base, "PC_NAME_MAX")
        path_max = os.pathconf(base, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    size = len(os.fsencode(full))
    if size >= path_max:
        raise ValueError(
            f"{name} {_short(shown)}: the path is {size} bytes long, over the system's limit of "
            f"{path_max - 1}"
        )
    for part in full.split(os.sep):
        n = len(os.fsencode(part))
        if n > name_max:
            raise ValueError(
                f"{name} {_short(shown)}: the name {_short(part)!r} is {n} bytes long, over the "
                f"file system's limit of {name_max}"
            )


def _can_create_in(folder: str, name: str, shown: str) -> None:
    """A file can really be created in `folder` (created and removed at once): os.access reads
    permission bits, which root passes even where nothing can be created (/proc, /sys)."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".dflash-write-check-")
    except OSError as e:
        raise ValueError(
            f"{name} {shown}: nothing can be created in {folder} ({e.strerror or e})"
        ) from None
    os.close(fd)
    os.unlink(probe)


def writable_file(path: str, name: str = "output file") -> str:
    """Checks that `path` can be written (without creating it): an existing writable file, or
    a new name (within the file system's name and path length limits) in an existing directory
    where a file can be created. Call before any compute."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{name} must be a path, got {_describe(path)}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{name} {path} is a directory")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{name} {path} is not writable")
        return path
    _fits_limits(path, name, path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{name} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path}: directory {parent} is not writable")
    _can_create_in(parent, name, path)
    return path


def writable_dir(path: str, name: str = "output directory", below=(), files=()) -> str:
    """Checks that directory `path` exists and is writable, or can be created (its nearest
    existing ancestor is a directory where something can be created), within the file system's
    name and path length limits. `below`: relative paths the tool will create inside `path`
    (e.g. the profiler's plugins/profile/RUN): none of their existing parts may be a file, and
    they must fit the limits too. `files`: names the tool writes as files in `path`: none may
    be a directory."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{name} must be a path, got {_describe(path)}")
    path = os.fspath(path)
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        raise ValueError(f"{name} {path}: {base} exists and is not a directory")
    for rel in ("", *below):
        inner = os.path.join(os.path.abspath(path), rel) if rel else os.path.abspath(path)
        _fits_limits(inner, name, path)
        blocked = _nearest_existing(inner)
        if not os.path.isdir(blocked):
            raise ValueError(f"{name} {path}: {blocked} is a file, where a directory goes")
    for f in files:
        target = os.path.join(path, f)
        _fits_limits(target, name, path)
        if os.path.isdir(target):
            raise ValueError(f"{name} {path}: {target} is a directory, where a file goes")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path}: {base} is not writable")
    _can_create_in(base, name, path)
    return path


def profile_dir(path: str, name: str = "--profile_dir") -> str:
    """`writable_dir` for a jax.profiler trace: it goes to PATH/plugins/profile/<date_time>/
    <host>.xplane.pb when the trace stops, after the work it traced."""
    import socket

    run = os.path.join("plugins", "profile", "2000_01_01_00_00_00")
    return writable_dir(path, name, below=(os.path.join(run, socket.gethostname() + ".xplane.pb"),))


def output_not_input(
    path: Optional[str],
    name: str,
    files: Optional[Mapping] = None,
    dirs: Optional[Mapping] = None,
    model_files: Sequence[str] = ("*",),
) -> None:
    """Raises ValueError when output `path` resolves (symbolic links, "..", relative paths) to
    one of the inputs: `files` ({flag: path}) or a file the loaders read in one of `dirs`
    ({flag: model directory}: the names matching the glob patterns `model_files`, e.g.
    `hub.ALLOW_PATTERNS`, also through a link such as a hub snapshot's), e.g. an output
    naming the prompt file or a config.json. Other files in a model directory may be written."""
    import fnmatch

    if not path:
        return
    real = os.path.realpath(path)
    for flag, other in (files or {}).items():
        if other and os.path.realpath(other) == real:
            raise ValueError(f"{name} {path} is the {flag} (an input); choose another file")

    def model_file(p):
        return any(fnmatch.fnmatch(os.path.basename(p), pat) for pat in model_files)

    for flag, d in (dirs or {}).items():
        if not d or not os.path.isdir(d):
            continue
        base = os.path.realpath(d)
        inside = os.path.commonpath([base, real]) == base and model_file(real)
        linked = any(
            os.path.realpath(os.path.join(d, n)) == real for n in os.listdir(d) if model_file(n)
        )
        if inside or linked:
            raise ValueError(
                f"{name} {path} is a file of the {flag} model directory {d} (an input); "
                "choose another file"
            )


# ------------------------------------------------------------------------- training configs


def _flatten(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = prefix + str(k)
        if hasattr(v, "items") and not isinstance(v, (str, bytes)):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def unknown_keys(config: Mapping, reference: Mapping) -> List[str]:
    """'unknown config key X (did you mean Y?)' for every key of `config` that `reference`
    (configs/default.py's get_config()) does not have."""
    known = _flatten(reference)
    groups = {k.rsplit(".", 1)[0] for k in known if "." in k}
    out = []
    for key in _flatten(config):
        if key in known:
            continue
        near = difflib.get_close_matches(key, list(known) + sorted(groups), n=1, cutoff=0.6)
        out.append(
            f"unknown config key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
        )
    return out


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
            f"regen.chat_template must be True or False, got {_describe(c.regen.chat_template)}"
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
    """`check_train_config`: the seed and the drafter's sizes, kind, tap store, DFlash 2 and
    EAGLE-3 settings."""
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
    dvs = c.drafter.get("draft_vocab_size", 0)
    int_param("drafter.draft_vocab_size", dvs, lo=0, error=E)
    store = c.data.get("tap_store", "")
    if dvs and (
        c.drafter.get("kind", "dflash") != "dflash"
        or c.drafter.get("dflash2", {}).get("enabled", False)
    ):
        raise E(
            "drafter.draft_vocab_size is for DFlash drafters (EAGLE-3: "
            "drafter.eagle3.draft_vocab_size; DFlash 2's selector scores the full vocabulary)"
        )
    if c.loss.startswith("topk_") and not store:
        raise E(f"loss={c.loss!r} reads the target's top-k from data.tap_store: set it")
    if store:
        if c.mode != "drafter" or c.drafter.get("kind", "dflash") != "dflash":
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
    _choice("drafter.kind", c.drafter.get("kind", "dflash"), ("dflash", "eagle3"))
    if c.drafter.get("kind", "dflash") == "eagle3":
        e3 = c.drafter.eagle3
        int_param("drafter.eagle3.ttt_steps", e3.ttt_steps, lo=1, hi=32, error=E)
        int_param("drafter.eagle3.draft_vocab_size", e3.draft_vocab_size, lo=0, error=E)
        float_param("drafter.eagle3.ttt_decay", e3.ttt_decay, lo=0.0, lo_open=True, hi=1.0, error=E)
        if len(c.drafter.target_layer_ids) not in (0, 3):
            raise E(
                "an eagle3 drafter reads 3 target layers: drafter.target_layer_ids must name 3 "
                f"(or none: EAGLE-3's default), got {tuple(c.drafter.target_layer_ids)}"
            )
        if c.mode != "drafter" or c.loss != "ce" or (v2 is not None and v2.get("enabled")):
            raise E(
                "drafter.kind='eagle3' trains in mode 'drafter' with loss 'ce' and without "
                "drafter.dflash2"
            )


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


# The seeds `generate` accepts: what a 64-bit integer holds (jax.random.PRNGKey's range).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# The attention implementations a user may choose (`attention.IMPLS` has three internal ones).
ATTENTION_IMPLS = ("xla", "pallas", "pallas_interpret", "auto")


def seed_param(name: str, value) -> int:
    return int_param(name, value, lo=SEED_MIN, hi=SEED_MAX)


DENOISE_SCHEDULES = ("confidence", "fixed")


def check_denoise(denoise_schedule, remask, denoise_steps, has_drafter: bool = True):
    """`generate`'s denoise_schedule and remask checked (one ValueError): (schedule, remask);
    without a drafter only their defaults are accepted."""
    if denoise_schedule not in DENOISE_SCHEDULES:
        raise ValueError(
            f"denoise_schedule must be one of {', '.join(map(repr, DENOISE_SCHEDULES))}, "
            f"got {denoise_schedule!r}"
        )
    if not isinstance(remask, (bool, np.bool_)):
        raise ValueError(f"remask must be a bool, got {remask!r}")
    if not has_drafter and (remask or denoise_schedule != "confidence"):
        name = "remask" if remask else "denoise_schedule"
        raise ValueError(f"{name} needs a drafter (autoregressive decoding drafts nothing)")
    if remask and denoise_schedule != "confidence":
        raise ValueError("remask needs denoise_schedule='confidence' (it re-ranks by confidence)")
    if remask and denoise_steps < 3:
        raise ValueError(
            f"remask needs denoise_steps >= 3 (a remasked token is predicted again by a later "
            f"pass before the last), got {denoise_steps}"
        )
    return denoise_schedule, bool(remask)
