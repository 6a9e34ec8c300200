"""Two dry-run JSONs (`python -m dflash_jax.dry_run ... --json_out=FILE`) compared field by field:
what a refactor must leave unchanged (memory per device, FLOPs, bytes, collectives, the roofline
step figures).

Provenance (command, commit, date, machine, environment) and compile times are
skipped; op scope names (which carry Python function names) are listed apart.

    python benchmarks/compare_dry_runs.py BEFORE.json AFTER.json

Exit status 0 when every figure agrees (names may differ), 1 otherwise.

Committed results: none (it compares two dry runs' JSONs and prints what differs).
"""

import json
import sys

SKIP = {"command", "commit", "dirty", "date", "machine", "env", "compile_s", "seconds"}


def differences(a, b, path=""):
    """[(path, before, after)] for every leaf that differs (a missing key: None)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k in SKIP:
                continue
            out += differences(a.get(k), b.get(k), f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [(path, a, b)]


def main(argv):
    if len(argv) != 3:
        sys.exit(__doc__)
    before, after = (json.load(open(p)) for p in argv[1:])
    diffs = differences(before, after)
    names = [d for d in diffs if d[0].endswith("/scope")]
    figures = [d for d in diffs if not d[0].endswith("/scope")]
    for path, x, y in figures:
        print(f"DIFFERS {path}: {x!r} -> {y!r}")
    print(
        f"{len(figures)} figure(s) differ; {len(names)} op scope name(s) differ"
        + (f" (e.g. {names[0][1]!r} -> {names[0][2]!r})" if names else "")
    )
    return 1 if figures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
