"""The value checks every entry point shares, run before any compute or file write (stdlib and
NumPy only; infer.py's own flags: `dflash_jax.frontend.infer_flags`).

`generate` (the API), `infer.py` and the trainer (`train.py` configs:
`dflash_jax.training.config_checks`) call these functions first, so bad input gets one clear line (a `ValueError`, or its subclass `ConfigError` for
training configs) instead of a traceback from deep inside tracing, a silently truncated value,
or results lost at the end of a run.

    int_param("block_size", 8.0)             -> ValueError: block_size must be an integer ...
    prompt_ids([1, 2, 3], vocab_size=100)    -> ValueError: ... a flat list ...; wrap it
    sampling_params(1.0, None, 0.0)          -> ValueError: top_p must be in (0, 1] ...
    unknown_keys(config, get_config())       -> ["unknown config key 'drafter.num_layer'
                                                (did you mean 'drafter.num_layers'?)"]
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


def describe_value(value) -> str:
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
        raise error(f"{name} must be an integer, got {describe_value(value)}")
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
        raise error(f"{name} must be a number, got {describe_value(value)}")
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
        raise ValueError(f"{name} must be a list of integer token ids, got {describe_value(value)}")
    out = []
    for j, t in enumerate(value):
        if not _is_int(t):
            raise ValueError(f"{name}[{j}] must be an integer token id, got {describe_value(t)}")
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
            f"prompts must be a list of token-id lists (one per prompt), got {describe_value(prompts)}"
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
        raise ValueError(f"stop_token_ids must be a list of token ids, got {describe_value(ids)}")
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
        raise ValueError(f"{name} must be a path, got {describe_value(path)}")
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
        raise ValueError(f"{name} must be a path, got {describe_value(path)}")
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
