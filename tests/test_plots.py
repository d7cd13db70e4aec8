"""The refit pictures: valid PNGs of sensible size, readable at many ranks, and `reshard plan --plot`."""

import struct

import pytest

from reshard.apps.cli import main
from reshard.frameworks.parallel import model_layouts
from reshard.modeling.pipeline import RefitModel
from reshard.modeling.plots import plot_link_load, plot_pair_bytes
from reshard.modeling.reshard_time import model_time
from reshard.modeling.topology import Placement, Topology
from reshard.modeling.traffic import traffic_from_pairs
from reshard.models import DEMO_MODEL, get_arch

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; fails unless the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def check_png(path, min_bytes=5_000, max_bytes=3_000_000):
    assert path.exists(), path
    size = path.stat().st_size
    assert min_bytes < size < max_bytes, (path, size)
    w, h = png_size(path)
    assert 300 <= w <= 2500 and 250 <= h <= 2000, (w, h)


def test_plots_of_a_small_model(tmp_path):
    lay = model_layouts(get_arch(DEMO_MODEL).with_overrides(layers=2, vocab=4096), "fsdp:dp4", "dtensor:tp2,dp2")
    m = RefitModel.build(lay.source, lay.destination, Topology.preset("dgx-h100"), infer_start="domain",
                         max_bucket_bytes=8 << 20)
    assert m.reshard is m.hierarchical and m.placement.gpu_of.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    paths = m.write_plots(tmp_path / "out", "small", "small")
    assert [p.name for p in paths] == ["small-pairs.png", "small-links.png"]
    for p in paths:
        check_png(p)


def test_many_ranks_are_grouped_and_the_bottleneck_is_marked(tmp_path):
    topo = Topology.preset("gb200-nvl72")
    place = Placement.contiguous(topo, 128, 128)
    pairs = {(s, 128 + (s * 7 + k) % 128): 10 ** 8 * (1 + (s + k) % 5) for s in range(128) for k in range(8)}
    traffic = traffic_from_pairs([pairs], place, topo)
    est = model_time(traffic, topo)
    heat = plot_pair_bytes(pairs, tmp_path / "pairs.png", block=topo.gpus_per_node)
    bars = plot_link_load(traffic, tmp_path / "links.png", topo, estimate=est)
    check_png(heat)
    check_png(bars)
    # 256 GPUs do not make a 256 x 4-bar picture wider than the size cap
    assert png_size(bars)[0] <= 18 * 110


def test_empty_pairs_still_draw(tmp_path):
    check_png(plot_pair_bytes({}, tmp_path / "none.png", sources=[0, 1], destinations=[2, 3]), min_bytes=2_000)


def test_cli_plan_plot(tmp_path, capsys):
    out = tmp_path / "png"
    assert main(["plan", "--model", "qwen3-0.6b", "--train", "tp2", "--infer", "tp2,dp2", "--plot", str(out),
                 "--topology", "gb200-nvl72"]) == 0
    text = capsys.readouterr().out
    files = sorted(out.glob("*.png"))
    assert len(files) == 2 and all(str(f) in text.replace("\n", "") for f in files)
    assert "modeled on gb200-nvl72" in text and "bottleneck" in text
    for f in files:
        check_png(f)


@pytest.mark.parametrize("topology, message", [("h300", "unknown topology 'h300'"),
                                               ("/nonexistent.yaml", "does not exist")])
def test_cli_bad_topology(tmp_path, capsys, topology, message):
    assert main(["plan", "--model", "qwen3-0.6b", "--train", "tp2", "--infer", "tp2", "--plot", str(tmp_path),
                 "--topology", topology]) == 2
    assert message in capsys.readouterr().out


def test_cli_plan_plot_default_folder(tmp_path, monkeypatch, capsys):
    """``--plot`` without a folder writes to ./reshard-out, never loose into the current directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "qwen3-0.6b", "--train", "tp2", "--infer", "tp2", "--plot"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reshard-out"]
    files = sorted((tmp_path / "reshard-out").glob("*.png"))
    assert len(files) == 2 and "reshard-out" in capsys.readouterr().out
