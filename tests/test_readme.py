"""The README's Python examples run as written (docs that cannot drift)."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_the_examples_this_test_runs():
    assert len(BLOCKS) == 3, "update tests/test_readme.py when the README's examples change"
    assert "rs.run_local(plan" in BLOCKS[0] and "rs.spawn(refit, 5)" in BLOCKS[1]
    assert "rs.hierarchical_plan(src, dst" in BLOCKS[2]


def test_library_tour_and_hierarchical_example():
    """The tour, then the hierarchical example that continues it; its output is what the README says."""
    scope: dict = {}
    exec(compile(BLOCKS[0], "README tour", "exec"), scope)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[2], "README hierarchical", "exec"), scope)
    promised = re.search(r"^# (\[.*?\] \{.*?\} \d+)", BLOCKS[2], re.M).group(1)
    assert out.getvalue().strip() == promised


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torch_distributed_example(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[1])
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(res.stdout.split("\n")[:-1])
    assert [ln.split()[0] for ln in lines] == ["0", "1", "2", "3", "4"]
