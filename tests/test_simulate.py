"""``reshard simulate`` and ``reshard plan --topology``: the modeled figures are consistent with each other,
engines are read as stated, and setups that cannot fit say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import math
from dataclasses import replace

import pytest

from reshard.apps.cli import main
from reshard.apps.simulate import (CASES, METHODS, default_jobs, plot, rank_weight_bytes, simulate_case,
                                   simulate_cases, to_json)
from reshard.frameworks.parallel import model_layouts

from fresh_interpreter import in_a_fresh_interpreter

KNOWN = {c.key: c for c in CASES}


@pytest.fixture(scope="module")
def qwen30():
    return simulate_case(KNOWN["qwen30-h100"]), simulate_case(KNOWN["qwen30-h100-1dep"])


def test_modeled_times_respect_the_lower_bound_and_order_the_baselines(qwen30):
    for r in qwen30:
        f = r.figures
        s = f["modeled_s"]
        assert 0 < r.lower_bound_s <= s["hierarchical"] <= 1.25 * r.lower_bound_s  # near the bound (issue 10)
        # no method beats the bound; the best implementation of gather-and-broadcast beats its naive
        # single-root form by far
        assert min(s.values()) >= r.lower_bound_s
        assert s["gather_broadcast"] * 5 < s["gather_broadcast_naive"]
        assert r.speedup() == pytest.approx(s["gather_broadcast"] / min(s["hierarchical"], s["pipelined"]))
        assert r.ours_s == min(s["hierarchical"], s["pipelined"])  # the order that models faster
    engines, one = qwen30
    # one deployment: its inference ranks hold different expert slices, so reshard sends each its own
    # bytes and beats broadcasting the whole model to every node
    assert one.seconds("hierarchical") * 1.5 < one.seconds("gather_broadcast")
    # two independent engines: each node needs the whole model, which the fair broadcast already brings
    # at nearly the NICs' rate; both are near the bound
    assert engines.seconds("gather_broadcast") < 1.1 * engines.lower_bound_s


def test_independent_engines_need_the_model_once_per_engine(qwen30):
    engines, one = qwen30
    # Qwen3-30B-A3B in bf16 is 61 GB. Two independent TP8 engines on two nodes each need all of it;
    # vLLM's one data-parallel deployment splits the experts over all 16 inference ranks, so the two
    # nodes together need the model once plus the dense part twice
    assert 120 < engines.figures["cross_domain_bytes"] / 1e9 < 125
    assert 60 < one.figures["cross_domain_bytes"] / 1e9 < 70
    assert "independent" in engines.case.infer and not engines.case.differs
    assert "not the published arrangement" in one.case.differs


@pytest.mark.timeout(300)  # two spawned workers import torch (seconds each on a busy machine)
def test_rows_in_parallel_give_the_figures_of_one_process(qwen30):
    cases = [KNOWN["qwen30-h100-1dep"], KNOWN["qwen30-h100"]]
    shown = []  # each row handed over as it is done, before the call returns
    parallel = simulate_cases(cases, jobs=2, on_result=shown.append)
    assert [r.case.key for r in parallel] == [c.key for c in cases]  # the order asked for, not the order run
    assert [to_json(r) for r in parallel] == [to_json(r) for r in reversed(qwen30)]
    assert sorted(r.case.key for r in shown) == sorted(c.key for c in cases)
    assert {r.case.key: to_json(r) for r in shown} == {r.case.key: to_json(r) for r in parallel}
    assert default_jobs(1) == 1 and default_jobs(100) >= 1


def test_the_command_shows_each_row_as_it_is_done(capsys):
    assert main(["simulate", "--cases", "qwen30-h100,qwen30-h100-1dep", "--jobs", "1", "--png", ""]) == 0
    out = capsys.readouterr().out
    first, second = out.index("qwen30-h100 done (1/2, "), out.index("qwen30-h100-1dep done (2/2, ")
    table = out.index("modeled refit time")
    assert first < second < table  # one line per row in the order they finish, then the table
    assert "x the job's bound; gather-and-broadcast" in out[first:table]


def test_a_setup_whose_weights_exceed_a_gpu_is_not_timed(capsys):
    # the row's inference side in BF16 (the row itself is FP8, tests/test_fp8_figures.py), from Megatron
    # training: FSDP over 256 ranks takes a while to build and does not change the inference side
    case = replace(KNOWN["kimi-h100-engines"], train="tp1,ep32,pp4,dp2", precision="bf16")
    r = simulate_case(case)
    assert r.figures is None and r.does_not_fit.startswith("does not fit: inference rank")
    assert "259 GB of weights, a dgx-h100 GPU has 80 GB" in r.does_not_fit
    assert to_json(r)["modeled_s"] == dict.fromkeys(METHODS) and to_json(r)["fits"] is False


def test_rank_weight_bytes_count_every_piece_a_rank_holds():
    lay = model_layouts("qwen3-30b-a3b", "ep8,pp2", "tp8,dp2,independent")
    for layout in (lay.source, lay.destination):
        held = rank_weight_bytes(layout)
        for r in (layout.ranks[0], layout.ranks[-1]):
            pieces = layout.pieces(r)
            assert held[r] == sum(math.prod(p.sizes) * layout.specs[p.tensor].dtype.itemsize for p in pieces)
    # two engines, each the whole model, and more: vLLM replicates KV heads (4 of them over TP 8), norms
    # and routers on every rank of an engine
    assert sum(rank_weight_bytes(lay.destination).values()) > 2 * lay.arch.nbytes


def test_chart_is_written(qwen30, tmp_path):
    path = plot(list(qwen30), str(tmp_path / "sim.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_unknown_case_is_a_one_line_error(capsys):
    assert main(["simulate", "--cases", "nope", "--png", ""]) == 2
    assert "unknown case 'nope'" in capsys.readouterr().out


def test_a_staging_cap_refit_options_refuse_names_the_flag(capsys):
    assert main(["simulate", "--cases", "qwen30-h100", "--bucket-mb", "1e-5", "--png", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "reshard simulate: error: --bucket-mb 1e-05: max_bucket_bytes=10 is smaller than 16 bytes"


def test_chart_goes_to_the_output_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--cases", "qwen30-h100", "--out", "figs", "--json", "figs/r.json"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs"]
    assert (tmp_path / "figs" / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "figs/simulate.png" in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "figs" / "r.json").read_text())
    assert row["case"] == "qwen30-h100" and set(row["modeled_s"]) == set(METHODS) | {"pipelined"}


def test_plan_json_with_a_topology(capsys):
    args = ["plan", "--model", "qwen3-30b-a3b", "--train", "ep8,pp2", "--infer", "tp8,dp2", "--topology",
            "dgx-h100", "--json"]
    assert main(args + ["--independent-engines"]) == 0
    out = json.loads(capsys.readouterr().out)  # stdout holds the JSON object and nothing else
    assert out["engines"] == "independent" and out["infer"] == "vllm tp8,dp2,independent (2 independent engines)"
    assert set(out["modeled_s"]) == set(METHODS) and all(v > 0 for v in out["modeled_s"].values())
    assert out["lower_bound_s"] <= out["modeled_s"]["hierarchical"] and out["lower_bound_term"]
    assert out["wire_bytes"] > 0 and out["fits"] is True
    # the same row as `reshard simulate` models it
    row = to_json(simulate_case(KNOWN["qwen30-h100"]))
    assert out["modeled_s"] == pytest.approx({k: v for k, v in row["modeled_s"].items() if k != "pipelined"}) and out["lower_bound_s"] == row["lower_bound_s"]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["engines"] == "one deployment" and "data_parallel_size=2" in one["infer"]
    assert one["cross_domain_bytes"] < out["cross_domain_bytes"]


@pytest.mark.parametrize("model, train, infer, precision", [("qwen3-30b-a3b", "ep8,pp2", "tp8,dp2", "bf16"),
                                                            ("qwen3-8b", "tp2,pp2", "tp4,dp2", "fp8")])
def test_the_plan_command_on_two_cores_gives_the_same_record(model, train, infer, precision):
    """``reshard plan --topology`` summarizes, and models two baselines, in forked children: its record is
    the one computed in one process, to the byte (the FP8 case: the baselines' staging cap comes from the
    precision plan's wire), and the parent uses the child's hybrid instead of modeling it again. Run in a
    fresh interpreter: with the threads other tests leave here, nothing would be forked."""
    in_a_fresh_interpreter(os.path.abspath(__file__), "_check_plan_command_on_two_cores", model, train, infer,
                           precision)


def _check_plan_command_on_two_cores(model, train, infer, precision):
    from reshard.apps.plan_report import build_model_report, build_plan_report, plan_record
    from reshard.forked import can_fork
    from reshard.modeling import pipeline
    from reshard.modeling.topology import Topology
    from reshard.options import RefitOptions

    assert can_fork()  # else both runs would be in one process and this would compare nothing
    hybrid_split_in = []  # processes that split the layouts for the hybrid (a forked child's calls stay there)
    split_layout = pipeline.split_layout
    pipeline.split_layout = lambda *a: hybrid_split_in.append(os.getpid()) or split_layout(*a)
    options = RefitOptions(precision=None if precision == "bf16" else precision)
    records, split_here = [], []
    for second_core in (False, True):
        hybrid_split_in.clear()
        report = build_plan_report(model, train, infer, options=options, second_core=second_core)
        modeled = build_model_report(report, Topology.preset("dgx-h100"), figures=True, plots=False,
                                     second_core=second_core)
        records.append(json.dumps(plan_record(report, modeled), sort_keys=True))
        split_here.append(len(hybrid_split_in))
    one, two = records
    assert one == two and '"hybrid"' in one and '"gather_broadcast_naive"' in one
    assert split_here == [2, 0]  # source and destination, once, in one process; none here on two cores


def test_one_row_on_two_cores_gives_the_same_figures():
    """A row simulated alone (``reshard simulate --cases KEY``) models two baselines in a forked child: the
    figures are those of one process (in a fresh interpreter, as above)."""
    in_a_fresh_interpreter(os.path.abspath(__file__), "_check_one_row_on_two_cores")


def _check_one_row_on_two_cores():
    from reshard.forked import can_fork

    assert can_fork()
    one, two = (simulate_case(KNOWN["qwen30-h100"], second_core=second_core) for second_core in (False, True))
    assert json.dumps(two.figures, sort_keys=True) == json.dumps(one.figures, sort_keys=True)


SMALL_PAGES_PROBE = """
import os
from numpy._core.multiarray import _get_madvise_hugepage
import reshard.apps.simulate as simulate
from reshard.apps.cli import main

def seen(cases, **options):  # what the rows would be planned under, then the refusal's path
    print("inside", _get_madvise_hugepage(), os.environ.get("NUMPY_MADVISE_HUGEPAGE"))
    raise ValueError("stop here")

simulate.simulate_cases = seen
assert main(["simulate", "--cases", "qwen30-h100"]) == 2
print("after", _get_madvise_hugepage(), os.environ.get("NUMPY_MADVISE_HUGEPAGE"))
"""


@pytest.mark.parametrize("preset, expect", [(None, "inside False 0 after True None"),
                                            ("1", "inside True 1 after True 1"),
                                            ("0", "inside False 0 after False 0")])
def test_planning_commands_turn_numpys_huge_pages_off_unless_told(preset, expect):
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if preset is not None:
        env["NUMPY_MADVISE_HUGEPAGE"] = preset
    out = subprocess.run([sys.executable, "-c", SMALL_PAGES_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    probed = [line for line in out.splitlines() if line.startswith(("inside ", "after "))]  # not the progress lines
    assert " ".join(probed).split() == expect.split()
