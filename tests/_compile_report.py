"""A pytest plugin: per test file, jax's own compile-time events (trace, lowering to MLIR,
XLA backend compile: seconds and counts) beside the file's wall seconds, as JSON; the same per
test under "tests" (which tests run longer than they compile: the `full_optimization` marker).

    PYTHONPATH=tests python -m pytest -p _compile_report tests/test_tree.py     # -> compile_report.<worker>.json

The output prefix is $COMPILE_REPORT (default ./compile_report); each xdist worker writes its
own file. How tests/README.md's compile shares were measured.
"""

import collections
import json
import os
import time

import pytest

_seconds = collections.defaultdict(collections.Counter)
_per_test = collections.defaultdict(collections.Counter)
_current = ["?", "?"]


def _on_event(event, secs, **_):
    name = event.rsplit("/", 1)[-1]
    for table, key in ((_seconds, _current[0]), (_per_test, _current[1])):
        table[key][name] += secs
        table[key][name + "_count"] += 1


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[:] = os.path.basename(str(item.path)), item.nodeid
    start = time.time()
    yield
    _seconds[_current[0]]["wall"] += time.time() - start
    _per_test[_current[1]]["wall"] += time.time() - start


def pytest_sessionfinish(session):
    prefix = os.environ.get("COMPILE_REPORT", "compile_report")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{prefix}.{worker}.json", "w") as f:
        report = {k: dict(v) for k, v in _seconds.items()}
        report["tests"] = {k: dict(v) for k, v in _per_test.items()}
        json.dump(report, f, indent=1, sort_keys=True)
