"""``reshard simulate`` on its smallest case: the modeled figures are consistent with each other."""

from __future__ import annotations

import pytest

from reshard.apps.cli import main
from reshard.apps.simulate import CASES, plot, simulate_case


@pytest.fixture(scope="module")
def qwen30():
    return simulate_case(next(c for c in CASES if c.key == "qwen30-h100"))


def test_modeled_times_respect_the_lower_bound_and_beat_gather_broadcast(qwen30):
    r = qwen30
    assert 0 < r.lower_bound_s <= r.hierarchical_s <= r.direct_s * 1.0001
    assert r.gather_broadcast_s > 2.7 * r.hierarchical_s  # the published claim's low end, modeled
    # Qwen3-30B-A3B in bf16 is 61 GB; vLLM's one data-parallel deployment splits the experts over all
    # 16 inference ranks, so the two inference nodes together need the model once plus the dense part twice
    assert 60 < r.network_gb < 70


def test_chart_is_written(qwen30, tmp_path):
    path = plot([qwen30], str(tmp_path / "sim.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_unknown_case_is_a_one_line_error(capsys):
    assert main(["simulate", "--cases", "nope", "--png", ""]) == 2
    assert "unknown case 'nope'" in capsys.readouterr().out


def test_chart_goes_to_the_output_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--cases", "qwen30-h100", "--out", "figs"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs"]
    assert (tmp_path / "figs" / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "figs/simulate.png" in capsys.readouterr().out
