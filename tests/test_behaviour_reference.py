"""Plans, hierarchy phases, cost figures and CLI output of the quick cases of ``tools/dump_behaviour.py``
equal the committed reference: a refactor that changes none of them passes; a change that means to
alter plans regenerates ``tools/behaviour-reference.json`` and says so."""

from __future__ import annotations

import pathlib
import sys

import pytest

TOOLS = pathlib.Path(__file__).parents[1] / "tools"


@pytest.mark.timeout(300)
def test_quick_cases_match_the_reference(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # the dump fixes the CLI's width; put it back afterwards
    sys.path.insert(0, str(TOOLS))
    try:
        import dump_behaviour
    finally:
        sys.path.remove(str(TOOLS))
    code = dump_behaviour.main(["--quick", "--out", str(tmp_path / "now.json"),
                                "--compare", str(TOOLS / "behaviour-reference.json")])
    assert code == 0, capsys.readouterr().out[-4000:]
