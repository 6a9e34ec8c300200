"""The trainer's log window (the loss and rates over the last steps, the JSONL and
TensorBoard lines), its JSON values, the schedule's host-side value, and the profiler."""

from __future__ import annotations

import math
import time

import jax
import numpy as np

from dflash_jax.parallel import distributed
from dflash_jax.training.evaluation import selector_figures
from dflash_jax.training.metrics import format_eta


# The data item of a checkpoint holds the log window's sums under this key, beside the data
# iterator's position.
LOG_WINDOW_KEY = "log_window"


class _LogWindow:
    """The host's part of each step once its metrics are read (`finish`): the non-finite loss
    check, the loss history, and the metrics summed since the last log line, written (metrics
    file, console) every `log_every` steps and at the last step.

    The sums of a window that a checkpoint cuts (a preemption, a stage's stop_at_step) are
    saved with it (`data_state`) and restored (`run.log_window`), so a resumed run logs at the
    next multiple of `log_every` what the uninterrupted run logs there: the mean over the whole
    window. (A stage's last line, at its stop_at_step, reports the part it ran and keeps the
    sums.) Throughput counts only the steps this process timed."""

    def __init__(self, config, run, logger, bar):  # run: the trainer's `_Run`
        self.config, self.run, self.logger, self.bar = config, run, logger, bar
        self.history = []  # (step, loss) of this process
        self.bad_step = self.bad_loss = None  # the first step with a non-finite loss
        self.tokens_per_step = config.data.batch_size * config.data.seq_len
        self.t_start = self.t_window = time.time()
        self.step_start = int(run.state.step)
        self.steps, self.acc = 0, None  # the window's steps and summed metrics
        self.timed = 0  # the window's steps run by this process (the rate's)
        saved = getattr(run, "log_window", None)
        if saved:
            self.steps = int(saved["steps"])
            self.acc = {k: _from_json(v) for k, v in saved["sums"].items()}

    def saved(self):
        """The window's sums as JSON (None when empty): what a checkpoint keeps."""
        if not self.steps:
            return None
        return {"steps": self.steps, "sums": {k: _to_json(v) for k, v in self.acc.items()}}

    def data_state(self, train_iter):
        """A checkpoint's data item: the iterator's position and the window's sums (computed
        only when a checkpoint is saved: with several processes the position is a collective)."""

        def get():
            state = dict(train_iter.get_state())
            window = self.saved()
            if window is not None:
                state[LOG_WINDOW_KEY] = window
            return state

        return get

    def finish(self, k, metrics, rep_frac) -> bool:
        """Step k's metrics read; False when its loss is not finite (step k is dropped: the
        loop stops at step k - 1, the last good one)."""
        metrics = jax.device_get(metrics)
        if rep_frac is not None:
            metrics = dict(metrics, rep_frac=np.float32(rep_frac))
        loss = float(metrics["loss"]) + float(metrics.get("ul_loss", 0.0))
        if not math.isfinite(loss):
            self.bad_step, self.bad_loss = k, loss
            return False
        self.history.append((k, loss))
        self.bar.update(1)
        self.steps += 1
        self.timed += 1
        self.acc = (
            metrics if self.acc is None else jax.tree_util.tree_map(np.add, self.acc, metrics)
        )
        if k % self.config.log_every == 0 or k == self.run.total:
            self._write(k)
        elif k == self.run.stop_at:  # a stage's end: its line; the sums go on (checkpoint)
            self._write(k, reset=False)
        return True

    def _write(self, k, reset: bool = True) -> None:
        acc, n, run = self.acc, self.steps, self.run
        # The window is wall time from this write's start to the last one's: anything below
        # that waits is the next window's (reset at the end, a window of 5 steps read as 4
        # steps' time: rates 25% too high, as logged before 2026-12-04).
        now = time.time()
        dt = now - self.t_window
        rate = self.timed * self.tokens_per_step / max(dt, 1e-9)
        eta = (time.time() - self.t_start) / max(k - self.step_start, 1) * (run.total - k)
        rec = {
            "loss": acc["loss"] / n,
            "grad_norm": acc["grad_norm"] / n,
            "learning_rate": _host_value(run.schedule, k - 1),
            "tokens_per_s": rate,
        }
        if run.exp.mode == "drafter":
            per_k = acc["correct_k"] / np.maximum(acc["count_k"], 1)
            rec["acc_k01"] = float(per_k[1])
            rec["block_accept_len"] = float(acc["accept_sum"] / max(acc["num_blocks"], 1))
            rec.update(selector_figures(acc))
        ul_msg = ""
        if "rep_frac" in acc:
            rec.update({key: float(acc[key]) / n for key in ("ul_loss", "ul_p", "rep_frac")})
            ul_msg = (
                f"ul {rec['ul_loss']:.3f} p_rep {rec['ul_p']:.2f} "
                f"repeated {100 * rec['rep_frac']:.1f}% "
            )
        self.logger.write("train", k, rec)
        self.bar.set_postfix_str(f"loss {rec['loss']:.4f}", refresh=False)
        distributed.say(
            f"step {k}/{run.total} loss {rec['loss']:.4f} {ul_msg}"
            f"lr {rec['learning_rate']:.2e} gnorm {rec['grad_norm']:.2f} "
            f"{rate:,.0f} tok/s ETA {format_eta(eta)}"
        )
        self.t_window, self.timed = now, 0
        if reset:
            self.steps, self.acc = 0, None


def _to_json(value):
    """A summed metric (a NumPy scalar or array) as JSON that `_from_json` gives back exactly."""
    a = np.asarray(value)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "values": a.ravel().tolist()}


def _from_json(obj):
    a = np.asarray(obj["values"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
    return a[()] if a.ndim == 0 else a


def _host_value(schedule, step: int) -> float:
    """An optax schedule (jnp arithmetic) at `step`, computed on the host's CPU device: on the
    default device it would queue behind the train step just dispatched and wait for it."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return float(schedule(step))
    with jax.default_device(cpu):
        return float(schedule(step))


class _Profiler:
    """config.profile_dir: a trace of steps [profile_start_step, + profile_num_steps)."""

    def __init__(self, config):
        self.config, self.active = config, False

    def maybe_start(self, step) -> None:
        c = self.config
        if c.profile_dir and step == c.profile_start_step:
            jax.profiler.start_trace(c.profile_dir)
            self.active = True

    def maybe_stop(self, step, metrics) -> None:
        c = self.config
        if self.active and step + 1 >= c.profile_start_step + c.profile_num_steps:
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
            self.active = False
            distributed.say(
                f"profile of steps {c.profile_start_step}..{step} written to {c.profile_dir}"
            )

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
