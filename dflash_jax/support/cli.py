"""How the command-line tools (`infer.py`, `train.py`) end on an error.

    from dflash_jax.support import cli
    if __name__ == "__main__":
        cli.run(main)          # instead of absl's app.run(main)

Expected errors (bad user input: `ValueError` and its subclasses `ConfigError` and
`CheckpointError`, file errors (`OSError`), flag errors, and JAX unable to start the platform
that JAX_PLATFORMS names) print ONE line, `error: <message>`, to
stderr and exit with `EXIT_USAGE` (2). Anything else is a bug and keeps its traceback; with
`--verbose` every error does.

Exit codes of the tools: 0 success; 1 a real bug (traceback) or, for `train.py`, a non-finite
loss; 2 bad input (`EXIT_USAGE`); 3 `train.py` stopped by SIGTERM/SIGINT after saving a
checkpoint (`EXIT_PREEMPTED`: rerun the same command to resume); 130 / 143 stopped by Ctrl-C /
SIGTERM (one line on stderr).

Once main has ended (returned, failed, or was interrupted), the output locks it took are released
(`locks`) and the interrupt guard is armed again (`interrupts.guard`): Ctrl-C or SIGTERM during
the interpreter's shutdown is one line and an immediate exit, not a KeyboardInterrupt traceback
from an atexit handler. A KeyboardInterrupt that reaches `run` (a signal after the tool released
the guard, outside its own handling) is one line as well.
"""

from __future__ import annotations

import difflib
import sys
from typing import Callable, Optional, Sequence

from absl import app, flags

EXIT_USAGE = 2
EXIT_PREEMPTED = 3
# What Ctrl-C / SIGTERM prints once a tool's main has ended (its files are closed by then).
SHUTDOWN_LINE = "interrupted while exiting: the run had already ended"


def expected_errors() -> tuple:
    # ConfigError and CheckpointError are ValueErrors.
    return (ValueError, OSError, flags.Error, app.UsageError)


def one_line(e: BaseException) -> str:
    """The message of `e` on one line (newlines folded), without a traceback."""
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in msg:
        msg = f"{e.filename}: {msg}"
    if isinstance(e, KeyError):
        msg = f"missing key {msg}"
    return msg


def backend_error(e: BaseException) -> Optional[str]:
    """The one line for JAX failing to start the platform the environment asks for (e.g.
    JAX_PLATFORMS=tpu on a machine without a TPU); None for any other error."""
    import os

    text = str(e)
    if not isinstance(e, RuntimeError) or "Unable to initialize backend" not in text:
        return None
    msg = " ".join(text.split("(set JAX_PLATFORMS=")[0].split())
    env = os.environ.get("JAX_PLATFORMS")
    where = f"JAX_PLATFORMS={env!r}: " if env else ""
    return (
        f"{where}{msg} (this machine lacks that platform: unset JAX_PLATFORMS, or set it to "
        "one it has, e.g. cpu)"
    )


def fail(message: str, code: int = EXIT_USAGE):
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(code)


def _suggest_flag(argv: Sequence[str]) -> Optional[str]:
    """'did you mean --config.x?' for an unknown --config.KEY override (ml_collections'
    message names neither the key nor a near one)."""
    try:
        from configs.default import get_config as default_config
        from dflash_jax.support.checks import _flatten
    except Exception:  # noqa: BLE001 - a hint only
        return None
    known = list(_flatten(default_config()))
    for arg in argv[1:]:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config.") :].split("=", 1)[0]
        if key in known:
            continue
        groups = {k.rsplit(".", 1)[0] for k in known if "." in k}
        if key in groups:
            continue
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        return f"unknown config key {key!r}" + (
            f" (did you mean '--config.{near[0]}'?)" if near else ""
        )
    return None


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        hint = _suggest_flag(argv) if any(a.startswith("--config.") for a in argv) else None
        fail(hint or one_line(e))
    except Exception as e:  # noqa: BLE001 - ml_collections raises plain errors for overrides
        hint = _suggest_flag(argv)
        if hint is None and "--verbose" in argv:
            raise
        fail(hint or f"bad flag value: {one_line(e)}")


def run(main: Callable, argv=None) -> None:
    """absl's `app.run(main)` with the error policy of this module (adds `--verbose` unless
    the tool defines it)."""
    if "verbose" not in flags.FLAGS:
        flags.DEFINE_bool("verbose", False, "Print a traceback for every error.")

    def wrapped(args):
        import signal

        from dflash_jax.support import interrupts, locks

        # SIGTERM (a scheduler's stop) ends the run as Ctrl-C does: one line, exit 143, what
        # the tool keeps on interruption kept. A tool with its own SIGTERM handling (the
        # trainer's checkpoint on signal) installs it later, over this one.
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            interrupts.raise_on_sigterm()
        try:
            return main(args)
        except KeyboardInterrupt:
            if flags.FLAGS["verbose"].value:
                raise
            sys.stdout.flush()
            sys.stderr.write("interrupted\n")
            sys.exit(interrupts.exit_status())
        except expected_errors() as e:
            if flags.FLAGS["verbose"].value:
                raise
            fail(one_line(e))
        except RuntimeError as e:  # JAX_PLATFORMS naming a platform this machine lacks
            line = backend_error(e)
            if line is None or flags.FLAGS["verbose"].value:
                raise
            fail(line)
        finally:
            locks.release_all()
            interrupts.guard(SHUTDOWN_LINE)

    app.run(wrapped, argv=argv, flags_parser=_parse_flags)
