"""Topology presets, topology files and rank placement (pure: no processes)."""

import json

import numpy as np
import pytest

from reshard.modeling.topology import Placement, Topology, parse_bandwidth, parse_duration


def test_presets_match_the_spec_sheets():
    h = Topology.preset("dgx-h100")
    assert (h.gpus_per_domain, h.gpus_per_node) == (8, 8)
    assert h.nic_bytes_per_s == 50e9 and h.nvlink_bytes_per_s == 450e9  # 400 Gb/s; 900 GB/s both ways
    g = Topology.preset("gb200-nvl72")
    assert (g.gpus_per_domain, g.gpus_per_node) == (72, 4)
    assert g.nic_bytes_per_s == 50e9 and g.nvlink_bytes_per_s == 900e9
    c = Topology.preset("cpu")
    assert c.gpus_per_domain == 1 and c.host_cores >= 1 and c.host_bytes_per_s > 0
    assert set(Topology.preset_names()) >= {"dgx-h100", "gb200-nvl72", "cpu"}


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown topology preset 'h200'.*dgx-h100"):
        Topology.preset("h200")


@pytest.mark.parametrize("text, want", [
    ("400 Gb/s", 50e9), ("450 GB/s", 450e9), ("1 GiB/s", 2 ** 30), ("12.5GB/s", 12.5e9), ("800 Gbps", 100e9),
])
def test_parse_bandwidth(text, want):
    assert parse_bandwidth(text) == pytest.approx(want)


def test_parse_duration():
    assert parse_duration("5 us") == pytest.approx(5e-6)
    assert parse_duration("0.2ms") == pytest.approx(2e-4)
    with pytest.raises(ValueError, match="cannot read duration"):
        parse_duration("5 sec")


def test_yaml_file_with_base_and_units(tmp_path):
    f = tmp_path / "two-rail.yaml"
    f.write_text("base: dgx-h100\nnic_bytes_per_s: 200 Gb/s\nnet_latency_s: 3 us\ngpus_per_node: 4\n")
    t = Topology.from_file(f)
    assert t.name == "two-rail"  # from the file name
    assert t.nic_bytes_per_s == 25e9 and t.net_latency_s == pytest.approx(3e-6)
    assert t.gpus_per_node == 4 and t.nvlink_bytes_per_s == 450e9  # the rest from the base


def test_json_file_without_base(tmp_path):
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps({"name": "tiny", "gpus_per_domain": 2, "gpus_per_node": 2,
                             "nic_bytes_per_s": 1e9, "nvlink_bytes_per_s": "10 GB/s"}))
    t = Topology.resolve(str(f))
    assert (t.name, t.gpus_per_domain, t.nvlink_bytes_per_s) == ("tiny", 2, 10e9)


@pytest.mark.parametrize("body, message", [
    ({"base": "dgx-h100", "nic_bw": 1}, "unknown key 'nic_bw'"),
    ({"base": "dgx-h100", "nic_bytes_per_s": "fast"}, "key 'nic_bytes_per_s': cannot read bandwidth 'fast'"),
    ({"base": "dgx-h100", "gpus_per_domain": 2.5}, "key 'gpus_per_domain': expected an integer"),
    ({"base": "dgx-h100", "gpus_per_domain": 0}, "gpus_per_domain must be an integer >= 1"),
    ({"base": "dgx-h100", "nvlink_bytes_per_s": -1}, "nvlink_bytes_per_s must be a number > 0"),
    ({"base": "h100", "name": "x"}, "key 'base': unknown topology preset 'h100'"),
    ({"name": "x", "gpus_per_domain": 8, "gpus_per_node": 8, "nvlink_bytes_per_s": 1e9}, "missing key 'nic_bytes_per_s'"),
])
def test_bad_files_name_the_key(tmp_path, body, message):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        Topology.from_file(f)
    assert str(f) in str(e.value)


def test_resolve_rejects_missing_file_and_unknown_name():
    with pytest.raises(ValueError, match="does not exist"):
        Topology.resolve("/nonexistent/topo.yaml")
    with pytest.raises(ValueError, match="unknown topology 'nope'"):
        Topology.resolve("nope")


def test_contiguous_placement_on_gb200():
    t = Topology.preset("gb200-nvl72")
    p = Placement.contiguous(t, 128, 128)
    assert p.num_ranks == 256 and p.gpu_of.tolist() == list(range(256))
    # rank 75: GPU 75, tray 18, second NVL72 domain; training and inference share domain 1
    assert (p.node_of[75], p.domain_of[75]) == (18, 1)
    assert set(p.domain_of[list(p.train_ranks)]) == {0, 1} and set(p.domain_of[list(p.infer_ranks)]) == {1, 2, 3}


def test_inference_on_a_fresh_domain_or_node():
    t = Topology.preset("gb200-nvl72")
    p = Placement.contiguous(t, 128, 128, infer_start="domain")
    assert p.gpu_of[128] == 144 and p.domain_of[128] == 2
    assert not set(p.domain_of[:128]) & set(p.domain_of[128:])
    q = Placement.contiguous(t, 6, 4, infer_start="node")
    assert q.gpu_of.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="infer_start"):
        Placement.contiguous(t, 6, 4, infer_start="rack")


def test_colocated_and_explicit_placements():
    t = Topology.preset("dgx-h100")
    c = Placement.contiguous(t, 8, 4, colocated=True)
    assert c.num_ranks == 8 and c.infer_ranks == (0, 1, 2, 3) and c.train_ranks == tuple(range(8))
    e = Placement.explicit(t, [0, 8, 16, 24, 1, 9], num_train=4)
    assert e.domain_of.tolist() == [0, 1, 2, 3, 0, 1] and e.infer_ranks == (4, 5)
    assert e.num_gpus == 25 and np.array_equal(e.used_gpus(), [0, 1, 8, 9, 16, 24])
    with pytest.raises(ValueError, match="rank 7 has no GPU"):
        Placement.explicit(t, [0, 1], num_train=1, infer_ranks=[7])
