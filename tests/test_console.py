"""console.style: escape codes only for a terminal, never with NO_COLOR (no-color.org)."""

import io

import pytest

from dflash_jax.support import console


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def no_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)


def test_style_bolds_for_a_terminal_only():
    assert console.style("done", FakeTTY()) == "\x1b[1mdone\x1b[0m"
    assert console.style("done", FakeTTY(), sgr="2") == "\x1b[2mdone\x1b[0m"
    assert console.style("done", io.StringIO()) == "done"  # a file or a pipe
    assert console.style("", FakeTTY()) == ""
    closed = io.StringIO()
    closed.close()
    assert not console.color_enabled(closed)  # isatty raises ValueError
    assert not console.color_enabled(object())  # no isatty at all


@pytest.mark.parametrize("value, codes", [("1", False), ("0", False), ("", True)])
def test_no_color_set_to_anything_non_empty_turns_codes_off(monkeypatch, value, codes):
    monkeypatch.setenv("NO_COLOR", value)
    assert console.color_enabled(FakeTTY()) is codes
    assert ("\x1b" in console.style("done", FakeTTY())) is codes


def test_style_defaults_to_sys_stdout(monkeypatch):
    monkeypatch.setattr("sys.stdout", FakeTTY())
    assert console.style("x") == "\x1b[1mx\x1b[0m"
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert console.style("x") == "x"
