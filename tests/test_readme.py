"""The README's and docs/'s Python examples run as written, and their links lead somewhere (docs that
cannot drift)."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
BLOCKS = PYTHON_BLOCK.findall(README.read_text())
DOC_BLOCKS = {page.name: PYTHON_BLOCK.findall(page.read_text()) for page in DOCS}
DOC_EXAMPLES = [(name, i, block) for name, blocks in DOC_BLOCKS.items() for i, block in enumerate(blocks)]


def test_readme_has_the_examples_this_test_runs():
    assert len(BLOCKS) == 4, "update tests/test_readme.py when the README's examples change"
    assert "rs.run_local(plan" in BLOCKS[0] and "rs.spawn(refit, 5)" in BLOCKS[1]
    assert "WeightTransferTrainerFactory.trainer_init(" in BLOCKS[2]
    assert "ReshardGRPOTrainer(" in BLOCKS[3]


def test_docs_have_the_examples_this_test_runs():
    found = {name: len(blocks) for name, blocks in DOC_BLOCKS.items() if blocks}
    assert found == {"topology.md": 1}, "update tests/test_readme.py when the examples in docs/ change"
    assert "rs.hierarchical_plan(src, dst" in DOC_BLOCKS["topology.md"][0]


def _tour_scope() -> dict:
    """The names the README's library tour leaves behind; examples in docs/ may continue it."""
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(BLOCKS[0], "README tour", "exec"), scope)
    return scope


def test_library_tour_and_hierarchical_example():
    """The tour, then the hierarchical example of docs/topology.md that continues it; its output is what
    the page says."""
    scope = _tour_scope()
    hierarchical = DOC_BLOCKS["topology.md"][0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(hierarchical, "docs/topology.md hierarchical", "exec"), scope)
    promised = re.search(r"^# (\[.*?\] \{.*?\} \d+)", hierarchical, re.M).group(1)
    assert out.getvalue().strip() == promised


def _needs_processes(block: str) -> bool:
    return "rs.spawn(" in block or "__main__" in block


@pytest.mark.parametrize("name, index, block", DOC_EXAMPLES, ids=[f"{n}[{i}]" for n, i, _ in DOC_EXAMPLES])
def test_every_docs_example_runs(name, index, block):
    """Every ```python block of docs/*.md runs: in this process after the README's tour (which a page's
    example may continue), or, when it spawns processes, as a script of its own. An example that needs
    vLLM gets a check of its own here, as the README's does."""
    assert "vllm" not in block.lower(), f"docs/{name} example {index} needs vLLM: check it as the README's is"
    if _needs_processes(block):
        pytest.skip("spawns processes: see test_docs_examples_that_spawn_processes")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block, f"docs/{name} example {index}", "exec"), _tour_scope())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_docs_examples_that_spawn_processes(tmp_path):
    for name, index, block in DOC_EXAMPLES:
        if not _needs_processes(block):
            continue
        script = tmp_path / f"{pathlib.Path(name).stem}_{index}.py"
        script.write_text(block)
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=140)
        assert res.returncode == 0, f"docs/{name} example {index}:\n{res.stderr[-3000:]}"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _without_fences(page.read_text()), re.M):
        slug, n = _slug(heading), 1
        while slug in out:
            slug, n = f"{_slug(heading)}-{n}", n + 1
        out.add(slug)
    return out


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """Markdown with fenced blocks and inline code taken out: what links are read from."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


PAGES = [README, *DOCS]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    """Every relative link and image of the README and docs/ names a file that exists and, for a page, a
    heading it has."""
    bad = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", _prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            bad.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for t in re.findall(r"\]\(([^)\s#]+)[^)\s]*\)", _prose(README.read_text()))}
    assert [p.name for p in DOCS if p.resolve() not in linked] == []


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


def test_trl_snippet_is_the_example_that_runs():
    """The README's "Use with TRL" code is, line for line, code of ``examples/trl_grpo.py``, which
    tests/test_trl.py runs (GRPO steps refitted through reshard)."""
    example = README.parent / "examples" / "trl_grpo.py"
    compile(BLOCKS[3], "README TRL", "exec")
    source = set(_code_lines(example.read_text()))
    assert [ln for ln in _code_lines(BLOCKS[3]) if ln not in source] == []
