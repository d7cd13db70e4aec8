"""`reshard plan`: a whole model's refit summary by name, and one-line errors for impossible configs."""

import json
import os
import subprocess
import sys

import pytest

import reshard as rs
from reshard.apps.cli import main
from reshard.apps.report import summarize
from reshard.frameworks.parallel import model_layouts


def test_plan_summary_qwen3_moe(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b", "--train", "tp2,ep8,pp2", "--infer", "tp8,dp2,ep"]) == 0
    out = capsys.readouterr().out
    for word in ("attention", "experts", "embeddings", "norms", "router", "gather-and-broadcast",
                 "balance max/mean", "16 training -> 16 inference ranks"):
        assert word in out


def test_summary_bytes_add_up():
    refit = model_layouts("qwen3-8b", "tp2,pp2,dp2", "tp4,dp2")
    plan = rs.plan(refit.source, refit.destination)
    s = summarize(refit, plan)
    assert sum(s["by_category"].values()) == plan.wire_bytes
    assert s["by_category"]["experts"] == 0 and s["by_category"]["attention"] > 0
    # every inference rank holds a quarter of the model (TP 4) and nothing is colocated
    model = sum(spec.nbytes for spec in refit.destination.specs.values())
    assert s["max_recv"] >= model // 4
    assert s["gather_broadcast"]["broadcast"] == model * 8


@pytest.mark.parametrize("args, message", [
    (["--train", "tp1,ep6,pp2", "--infer", "tp8,dp2"], "ep=6 does not divide the 128 experts"),
    (["--train", "tp1,ep8,pp2", "--infer", "tp7,dp2"], "attention heads (32) is not divisible by 7"),
    (["--train", "tp1,ep8,pq2", "--infer", "tp8"], "megatron takes cp, dp, ep, etp, pp, tp, not pq"),
    (["--train", "tp1,ep8,pp-2", "--infer", "tp8"], "cannot read 'pp-2'"),
    (["--train", "fsdp:dp8,pp2", "--infer", "tp8"], "fsdp takes dp, hsdp, tp, not pp"),
    (["--train", "tp1,ep8,pp2", "--infer", "sglang:tp8"], "unknown framework 'sglang'"),
])
def test_impossible_configs_get_one_line(capsys, args, message):
    assert main(["plan", "--model", "qwen3-30b-a3b", *args]) == 2
    out = capsys.readouterr().out.strip()
    assert message in out and "Traceback" not in out and len(out.splitlines()) <= 2


def test_a_staging_cap_refit_options_refuse_names_the_flag(capsys):
    assert main(["plan", "--model", "qwen3-8b", "--train", "tp2", "--infer", "tp2", "--max-bucket-mb", "1e-5"]) == 2
    out = capsys.readouterr().out.strip()
    assert out == "reshard plan: --max-bucket-mb 1e-05: max_bucket_bytes=10 is smaller than 16 bytes"


def _command(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m reshard ...`` as a user runs it, its output block-buffered into pipes (the timeout is a
    margin for a busy host)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-m", "reshard", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_planning_commands_exit_with_their_output_whole(tmp_path):
    """``reshard plan`` and ``simulate`` leave without tearing down their objects (``cli.run``): what they print
    and write is whole, and their exit status is the command's."""
    done = _command("plan", "--model", "qwen3-8b", "--train", "tp2,pp2", "--infer", "tp4", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tensors"] == 399
    bad = _command("plan", "--model", "qwen3-30b-a3b", "--train", "tp1,ep6,pp2", "--infer", "tp8,dp2")
    assert bad.returncode == 2 and "ep=6 does not divide the 128 experts" in bad.stdout
    rows = tmp_path / "rows.json"
    one = _command("simulate", "--cases", "qwen30-h100", "--png", "", "--json", str(rows))
    assert one.returncode == 0, one.stderr
    assert "qwen30-h100 done (1/1" in one.stdout and "modeled refit time" in one.stdout
    assert [row["case"] for row in json.loads(rows.read_text())] == ["qwen30-h100"]
