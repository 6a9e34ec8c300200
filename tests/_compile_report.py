"""A pytest plugin: per test file, jax's own compile-time events (trace, lowering to MLIR,
XLA backend compile: seconds and counts) beside the file's wall seconds, as JSON; the same per
test under "tests" (`python tests/_compile_report.py PREFIX`: the tests that spend the most
outside compiling).

    PYTHONPATH=tests python -m pytest -p _compile_report tests/test_tree.py     # -> compile_report.<worker>.json

The output prefix is $COMPILE_REPORT (default ./compile_report); each xdist worker writes its
own file. How tests/README.md's compile shares were measured.
"""

import collections
import json
import os
import time

import pytest

_per_test = collections.defaultdict(collections.Counter)  # node id -> seconds and counts
_current = ["?"]


def _on_event(event, secs, **_):
    name = event.rsplit("/", 1)[-1]
    _per_test[_current[0]][name] += secs
    _per_test[_current[0]][name + "_count"] += 1


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    start = time.time()
    yield
    _per_test[_current[0]]["wall"] += time.time() - start


def pytest_sessionfinish(session):
    prefix = os.environ.get("COMPILE_REPORT", "compile_report")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{prefix}.{worker}.json", "w") as f:
        files = collections.defaultdict(collections.Counter)
        for node, seconds in _per_test.items():
            files[os.path.basename(node.split("::")[0])].update(seconds)
        report = {k: dict(v) for k, v in files.items()}
        report["tests"] = {k: dict(v) for k, v in _per_test.items()}
        json.dump(report, f, indent=1, sort_keys=True)


def main(argv):
    """`python tests/_compile_report.py PREFIX [N]`: the N (default 20) tests that spent the
    most seconds outside jax's compile events (running programs, Python, subprocesses), from
    the workers' PREFIX.<worker>.json (a test that launches subprocesses counts their compiles
    as outside)."""
    import glob

    prefix, n = argv[1], int(argv[2]) if len(argv) > 2 else 20
    tests = {}
    for path in sorted(glob.glob(f"{prefix}.*.json")):
        with open(path) as f:
            tests.update(json.load(f).get("tests", {}))
    compile_keys = (
        "backend_compile_duration",
        "jaxpr_trace_duration",
        "jaxpr_to_mlir_module_duration",
    )
    rows = []
    for name, t in tests.items():
        compiling = sum(t.get(k, 0.0) for k in compile_keys)
        rows.append((t["wall"] - compiling, t["wall"], compiling, name))
    print(f"{'outside':>8} {'wall':>8} {'compile':>8}  test")
    for outside, wall, compiling, name in sorted(rows, reverse=True)[:n]:
        print(f"{outside:8.1f} {wall:8.1f} {compiling:8.1f}  {name}")


if __name__ == "__main__":
    import sys

    main(sys.argv)
