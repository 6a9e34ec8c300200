"""The drafter that losslessness tests use, and the check that it was accepted.

The bundled trained pair (assets/tiny-code) on code prompts: 40 new tokens give tau ~1.8-2.0 at
blocks 8 and 16 with steps committing 4-6 tokens, so "DFlash == autoregressive" exercises the
multi-token commits, their cache writes and roll-backs. A never-accepted drafter commits only
the target's own token per step and passes any such test. The prompts are ragged on purpose (9,
26, 25 and 7 tokens). The fixture is `bundled_pair` in conftest.py.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(ROOT, "assets", "tiny-code")
CODE = (
    "def add(a, b):\n    return",
    'import os\n\n\ndef read_lines(path):\n    """Return the list of lines in the file at *path*."""',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):",
)


def assert_accepted(result, block_size, min_tau=1.5):
    """The drafter of a losslessness check really was accepted: mean acceptance above `min_tau`
    and some step committing at least min(3, block_size) tokens (several drafts accepted)."""
    assert result.tau > min_tau, result.tau
    longest = max(max(a) for a in result.acceptance_lengths if a)
    assert longest >= min(3, block_size), result.acceptance_lengths
