"""benchmarks/compare_dry_runs.py: a changed figure is found, provenance and scope names are not
counted as figures."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "compare_dry_runs.py")


def _run(tmp_path, before, after):
    for name, d in (("a.json", before), ("b.json", after)):
        (tmp_path / name).write_text(json.dumps(d))
    return subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path / "a.json"), str(tmp_path / "b.json")],
        capture_output=True,
        text=True,
    )


def test_figures_compared_names_and_provenance_apart(tmp_path):
    base = {
        "commit": "abc",
        "programs": {"dflash_decode": {"hbm_bytes": 100, "collectives": [{"bytes": 8}]}},
        "roofline": {"steps": {"ar": {"top_ops": [{"scope": "jit(_verify)/x", "bytes": 4}]}}},
    }
    renamed = json.loads(json.dumps(base))
    renamed["commit"] = "def"
    renamed["roofline"]["steps"]["ar"]["top_ops"][0]["scope"] = "jit(_attend)/x"
    same = _run(tmp_path, base, renamed)
    assert same.returncode == 0, same.stdout
    assert "0 figure(s) differ; 1 op scope name(s) differ" in same.stdout
    changed = json.loads(json.dumps(renamed))
    changed["programs"]["dflash_decode"]["collectives"][0]["bytes"] = 16
    out = _run(tmp_path, base, changed)
    assert out.returncode == 1
    assert "DIFFERS /programs/dflash_decode/collectives[0]/bytes: 8 -> 16" in out.stdout
