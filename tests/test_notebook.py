"""Executes notebooks/dflash_colab.ipynb top to bottom on CPU with small parameters."""

import os

import nbformat
import pytest

# Minutes of subprocess launches: left out of `make test-fast` (the edit loop), run by `make test`.
# The notebook's cells call the public API that the other files test on both jax versions:
# once, in the oldest jax's suite.
pytestmark = [pytest.mark.slow, pytest.mark.once]
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "dflash_colab.ipynb")


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None


def test_notebook_runs_top_to_bottom(tmp_path):
    if not os.path.isdir(os.path.join(ROOT, "assets", "tiny-code", "drafter")):
        pytest.fail("the bundled pair assets/tiny-code is missing")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(
        idx + 1,
        nbformat.v4.new_code_cell(
            # 3 training steps (an evaluation each) on 8 regenerated prompts: every cell runs;
            # what training does is test_training.py's (12 steps on 16 took 9 s more).
            f"INSTALL = False\nRUN_ONLINE = False\nMAX_NEW_TOKENS = 32\nTRAIN_STEPS = 3\n"
            f"TRAIN_REGEN_PROMPTS = 8\nWORKDIR = {str(tmp_path)!r}"
        ),
    )
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "identical to autoregressive: True" in text
    assert "skipped the online section: RUN_ONLINE is False" in text
    assert "trace files:" in text and (".xplane.pb" in text or ".trace.json.gz" in text)
