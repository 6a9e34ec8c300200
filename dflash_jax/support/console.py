"""What the command-line tools show: a quiet start-up, log levels and log files, progress bars,
bold text.

    console.quiet_startup()                  # before the first JAX computation of a CLI
    console.configure_logging(verbose, log_file=os.path.join(workdir, "train.log"))
    console.say("step 10/150 loss 2.31")     # stdout, and the log file
    for x in console.progress(items, desc="regenerate", unit="prompt"): ...
    sys.stdout.write(console.style(completion, sys.stdout))   # bold on a terminal only

Defaults: stdout carries what the user asked for; library log lines (Orbax, JAX) appear on
stderr only with `--verbose` or absl's `--verbosity=0/1`; a log file, when given, gets
everything at INFO. Progress bars (tqdm) go to stderr and are on only when stderr is a
terminal; `DFLASH_PROGRESS=0/1` or `set_progress(False/True)` overrides that. Escape codes
(`style`) are written only to a terminal and never when `NO_COLOR` is set (no-color.org), so
`python infer.py > out.txt` gets plain text.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Iterable, Optional

# Lines a CLI prints for the user and also wants in the log file: logged under this name, which
# the console handler skips (they are already on stdout), so nothing is shown twice.
SAY_LOGGER = "dflash_jax.say"

_progress_override: Optional[bool] = None

BOLD = "1"  # SGR parameters for `style`


def quiet_startup() -> None:
    """Keeps JAX from probing a TPU runtime that cannot be there.

    With libtpu installed (or merely with jaxlib's built-in TPU plugin), JAX's first backend
    initialization tries the TPU on every machine, and on one without TPU chips libtpu writes
    several lines of hostname / topology warnings to stderr and JAX logs "Unable to initialize
    backend 'tpu'". When the user has not chosen platforms (`JAX_PLATFORMS`) and the machine has
    neither TPU chips nor a visible GPU, JAX is pinned to the CPU, which is what it would end up
    using anyway. Must run before the first JAX computation; a no-op after it.
    """
    if os.environ.get("JAX_PLATFORMS"):
        return
    try:
        import jax
        from jax._src import hardware_utils, xla_bridge

        if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
            return
        n_tpu, _ = hardware_utils.num_available_tpu_chips_and_device_id()
        gpu = hardware_utils.has_visible_nvidia_gpu() or os.path.exists("/dev/kfd")
    except Exception:  # noqa: BLE001 - private JAX helpers moved: keep JAX's own behaviour
        return
    if n_tpu == 0 and not gpu:
        jax.config.update("jax_platforms", "cpu")


def cli_startup(verbose: bool = False, log_file: Optional[str] = None) -> None:
    """`configure_logging` + `quiet_startup`: the first call in a CLI's main."""
    configure_logging(verbose, log_file)
    quiet_startup()


_verbose = False


def verbose() -> bool:
    """Whether the CLI asked for library details on the console (--verbose / --verbosity)."""
    return _verbose


def configure_logging(verbose: bool = False, log_file: Optional[str] = None) -> None:
    """Console: warnings and errors only, unless `verbose` or absl's `--verbosity` was given
    (then INFO, or DEBUG at `--verbosity=1`). `log_file`: every INFO line, appended."""
    from absl import flags
    from absl import logging as absl_logging

    global _verbose
    explicit = flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].present
    if explicit:
        console_level = logging.root.level
    else:
        console_level = logging.INFO if verbose else logging.WARNING
    _verbose = console_level <= logging.INFO
    handler = absl_logging.get_absl_handler()
    handler.setLevel(console_level)
    if not any(isinstance(f, _SkipSay) for f in handler.filters):
        handler.addFilter(_SkipSay())
    # The root level gates every handler: low enough for the console and for the file.
    logging.root.setLevel(min(console_level, logging.INFO if log_file else console_level))
    if log_file:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh.setLevel(logging.INFO)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s"))
        logging.root.addHandler(fh)
        _log_files.append(fh)
    logging.getLogger(SAY_LOGGER).setLevel(logging.INFO)


_log_files: list = []  # the FileHandlers configure_logging added


def close_log_file() -> None:
    """Detaches and closes the log files `configure_logging` opened (before removing one)."""
    while _log_files:
        fh = _log_files.pop()
        logging.root.removeHandler(fh)
        fh.close()


class _SkipSay(logging.Filter):
    def filter(self, record):
        return record.name != SAY_LOGGER


def say(msg: str) -> None:
    """One line for the user: stdout, and the log file (not the console log: no duplicates)."""
    print(msg, flush=True)
    logging.getLogger(SAY_LOGGER).info(msg)


def set_progress(enabled: Optional[bool]) -> None:
    """True / False forces progress bars on / off; None: on when stderr is a terminal."""
    global _progress_override
    _progress_override = enabled


def progress_enabled() -> bool:
    if _progress_override is not None:
        return _progress_override
    env = os.environ.get("DFLASH_PROGRESS", "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    return sys.stderr.isatty()


def progress(
    iterable: Optional[Iterable] = None,
    *,
    total: Optional[float] = None,
    desc: Optional[str] = None,
    unit: str = "it",
    **kw,
):
    """A tqdm bar on stderr (rate and ETA), disabled unless `progress_enabled()`.

    Use as an iterator wrapper or with `update(n)` / `set_postfix_str(...)`; it is a tqdm
    object either way (a disabled one costs nothing)."""
    from tqdm import tqdm

    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not progress_enabled(),
        dynamic_ncols=True,
        leave=False,
        **kw,
    )


def color_enabled(stream=None) -> bool:
    """Whether escape codes may go to `stream` (default sys.stdout): it is a terminal and the
    environment variable NO_COLOR is unset or empty (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def style(text: str, stream=None, sgr: str = BOLD) -> str:
    """`text` wrapped in the escape codes `ESC[<sgr>m ... ESC[0m` (default bold) when
    `color_enabled(stream)`, else `text` unchanged. The one place this project writes escape
    codes: pass the stream the text is written to (default sys.stdout)."""
    if not text or not color_enabled(stream):
        return text
    return f"\033[{sgr}m{text}\033[0m"
