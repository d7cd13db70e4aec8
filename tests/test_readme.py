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
    assert len(BLOCKS) == 4, "update tests/test_readme.py when the README's examples change"
    assert "rs.run_local(plan" in BLOCKS[0] and "rs.spawn(refit, 5)" in BLOCKS[1]
    assert "WeightTransferTrainerFactory.trainer_init(" in BLOCKS[2]
    assert "rs.hierarchical_plan(src, dst" in BLOCKS[3]


def test_library_tour_and_hierarchical_example():
    """The tour, then the hierarchical example that continues it; its output is what the README says."""
    scope: dict = {}
    exec(compile(BLOCKS[0], "README tour", "exec"), scope)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[3], "README hierarchical", "exec"), scope)
    promised = re.search(r"^# (\[.*?\] \{.*?\} \d+)", BLOCKS[3], re.M).group(1)
    assert out.getvalue().strip() == promised


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torch_distributed_example(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[1])
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(ln for ln in res.stdout.split("\n") if ln.strip())
    assert [ln.split()[0] for ln in lines] == ["0", "1", "2", "3", "4"], res.stdout


def _code_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_snippet_is_the_example_that_runs():
    """The README's "Use with vLLM" code is, line for line, code of ``examples/vllm_refit.py``; that
    example runs: the engine reports every pushed version and its completion changes as the
    trainer learns."""
    pytest.importorskip("vllm")
    example = README.parent / "examples" / "vllm_refit.py"
    compile(BLOCKS[2], "README vLLM", "exec")
    source = set(_code_lines(example.read_text()))
    assert [ln for ln in _code_lines(BLOCKS[2]) if ln not in source] == []
    res = subprocess.run([sys.executable, str(example), "--steps", "3"], capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    before = re.search(r"^engine before training: (.*)$", res.stdout, re.M).group(1)
    steps = re.findall(r"^step (\d): loss [\d.]+, refit \d+ ms, ([\d.]+) MiB sent, engine at (\S+): (.*)$",
                       res.stdout, re.M)
    assert [(s, v) for s, _, v, _ in steps] == [("0", "step-0"), ("1", "step-1"), ("2", "step-2")], res.stdout
    assert all(float(mib) > 0 for _, mib, _, _ in steps)
    assert steps[-1][3] != before  # the engine generates with the trainer's new weights
