"""Cost model on hand-computable cases: modeled time, gather-and-broadcast, lower bound (no processes)."""

import math

import numpy as np
import pytest
import torch

import reshard as rs
from reshard.modeling.baseline_time import (broadcast_chain, gather_broadcast_fair_time, gather_broadcast_time,
                                            gather_broadcast_time_of)
from reshard.modeling.bound import Demand, lower_bound
from reshard.modeling.reshard_time import model_time
from reshard.modeling.topology import Placement, Topology
from reshard.modeling.traffic import traffic_from_pairs, traffic_from_plan
from reshard.planning.baseline import Stage, gather_sends

GB = 1e9


def bare(name="dgx-h100", **kw) -> Topology:
    """A preset with no latencies and free copies: only link bandwidth counts."""
    fields = dict(net_latency_s=0.0, nvlink_latency_s=0.0, launch_latency_s=0.0, message_overhead_s=0.0,
                  copy_bytes_per_s=math.inf)
    return Topology.preset(name).with_(**(fields | kw))


def test_one_pair_across_domains_takes_bytes_over_nic():
    topo = bare()
    place = Placement.contiguous(topo, 8, 8)  # rank 0 on node 0, rank 8 on node 1
    est = model_time(traffic_from_pairs([{(0, 8): 50 * GB}], place), topo)
    assert est.seconds == pytest.approx(1.0)
    b = est.bottleneck
    assert b.kind in ("nic_out", "nic_in") and b.bytes == pytest.approx(50 * GB)


def test_pair_inside_a_domain_uses_nvlink():
    topo = bare()
    place = Placement.contiguous(topo, 4, 4)  # all 8 ranks on one DGX
    tr = traffic_from_pairs([{(0, 4): 450 * GB}], place)
    assert tr.network_bytes() == 0 and tr.nvlink_bytes() == 450 * GB
    assert model_time(tr, topo).seconds == pytest.approx(1.0)


def test_incast_bottleneck_is_the_receivers_nic():
    topo = bare()
    place = Placement.contiguous(topo, 8, 8)
    pairs = {(s, 8): 25 * GB for s in range(4)} | {(s, 9): 5 * GB for s in range(4, 8)}
    est = model_time(traffic_from_pairs([pairs], place), topo)
    assert est.seconds == pytest.approx(100 * GB / (50 * GB))
    b = est.bottleneck
    assert (b.kind, b.where, b.ranks) == ("nic_in", 8, (8,))


def test_pack_unpack_and_latency_add_per_round():
    # 1000 bytes, one pair, staging cap 544 B: rounds of 272 B (two in flight) -> 4 rounds (quota 256 =
    # the round's 272 B - 16 B of alignment room)
    topo = Topology.preset("dgx-h100").with_(nic_bytes_per_s=1000.0, net_latency_s=1.0, launch_latency_s=0.5,
                                             message_overhead_s=0.25, copy_bytes_per_s=4000.0)
    place = Placement.contiguous(topo, 8, 8)
    tr = traffic_from_pairs([{(0, 8): 1000}], place, max_bucket_bytes=544)
    assert tr.phases[0].rounds == 4
    assert tr.phases[0].bytes[:, 0, 0].tolist() == [256, 256, 256, 232]
    # sequential, per round: latency 1.5 + pack (b/4000 + 0.25) + b/1000 + unpack (b/4000 + 0.25)
    want = 4 * (1.5 + 0.5) + 1000 / 1000 + 2 * 1000 / 4000
    assert model_time(tr, topo, overlap=False).seconds == pytest.approx(want)
    # overlapped (the executor's default): while round j is on the wire, round j+1 is packed and
    # round j-1 unpacked; round 0's pack comes first and the last unpack last
    b = [256, 256, 256, 232]
    copy = [n / 4000 + 0.25 for n in b]  # pack = unpack of each round
    over = copy[0] + copy[-1] + sum(1.5 + max(n / 1000, (copy[j + 1] if j < 3 else 0) + (copy[j - 1] if j else 0))
                                    for j, n in enumerate(b))
    est = model_time(tr, topo)
    assert est.seconds == pytest.approx(over) and over < want
    assert est.phases[0].latency_s == pytest.approx(6.0)


def test_rounds_match_the_planners_schedule():
    spec = rs.TensorSpec("w", (64, 64), torch.float32)
    src = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(0)])
    dst = rs.Layout.from_placements(spec, [2, 3], (2,), [rs.Shard(1)])
    plan = rs.plan(src, dst, max_bucket_bytes=4096)  # rounds of 2 KiB: two in flight
    place = Placement.contiguous(bare(), 2, 2)
    approx = traffic_from_pairs([plan.pair_bytes], place, max_bucket_bytes=4096)
    exact = traffic_from_plan(plan, place)
    assert exact.phases[0].rounds == plan.num_rounds > 1
    # from payload bytes alone (no alignment padding) the rounds can come out one short
    assert plan.num_rounds - 1 <= approx.phases[0].rounds <= plan.num_rounds
    for kind in ("nvlink_out", "nvlink_in", "pack", "unpack"):
        assert np.allclose(approx.total(kind), exact.total(kind))
    assert exact.phases[0].pack_copies.sum() > 0 and approx.phases[0].pack_copies.sum() == 0


def test_given_quotas_set_the_rounds():
    place = Placement.contiguous(bare(), 2, 2)
    tr = traffic_from_pairs([{(0, 2): 1000, (1, 3): 100}], place, quotas=[{(0, 2): 300, (1, 3): None}])
    assert tr.phases[0].rounds == 4  # ceil(1000 / 300); the unbounded pair goes in one message
    assert tr.phases[0].messages[:, 2, 1].tolist() == [1, 0, 0, 0]  # NVLink out of GPU 1 (one DGX)


def test_two_phases_pipeline_by_round():
    topo = bare()
    place = Placement.contiguous(topo, 8, 8)
    network = {(0, 8): 200 * GB}  # 4 s over one NIC, 1 s per round
    fanout = {(8, 9): 900 * GB}  # 2 s over NVLink, 0.5 s per round
    tr = traffic_from_pairs([network, fanout], place, names=["network", "nvlink"], rounds=4)
    assert model_time(tr, topo).seconds == pytest.approx(6.0)  # phases in turn, as the executor runs them
    # pipelined: round j of the fan-out runs while round j+1 crosses the network: 4 x 1 + 0.5
    est = model_time(tr, topo, pipeline=True)
    assert est.seconds == pytest.approx(4.5) and est.pipelined
    assert [p.seconds for p in est.phases] == pytest.approx([4.0, 2.0])
    assert est.phases[1].bottleneck.kind in ("nvlink_out", "nvlink_in")
    assert "pipelined" in est.format() and "network" in est.format()


def test_shared_host_cores_bound_the_cpu_preset():
    # 4 processes on one host: each pair alone 1 s at 1 GB/s, but the host moves 1 GB/s in all
    topo = Topology.preset("cpu").with_(nic_bytes_per_s=1 * GB, host_bytes_per_s=1 * GB, copy_bytes_per_s=math.inf,
                                        message_overhead_s=0.0, net_latency_s=0.0, copy_overhead_s=0.0)
    place = Placement.contiguous(topo, 2, 2)
    est = model_time(traffic_from_pairs([{(0, 2): 1 * GB, (1, 3): 1 * GB}], place), topo)
    assert est.seconds == pytest.approx(2.0)
    assert est.bottleneck.kind == "host"
    # CPU work adds up over the shared cores: 4 x 1 GB of packing/unpacking at 1 GB/s on 2 cores
    topo2 = topo.with_(copy_bytes_per_s=1 * GB, host_bytes_per_s=100 * GB, nic_bytes_per_s=100 * GB)
    est2 = model_time(traffic_from_pairs([{(0, 2): 1 * GB, (1, 3): 1 * GB}], place), topo2)
    assert est2.seconds == pytest.approx(max(4 / 2 + 0.02, 1 + 0.01 + 1)) and est2.bottleneck.kind == "host"


def test_message_costs_add_up_on_a_shared_host():
    # 3 rounds of 2 messages; each message costs 0.5 s of CPU at each end, on 2 shared cores
    topo = Topology.preset("cpu").with_(nic_bytes_per_s=1e30, host_bytes_per_s=1e30, copy_bytes_per_s=math.inf,
                                        message_overhead_s=0.5, net_latency_s=0.0, copy_overhead_s=0.0)
    place = Placement.contiguous(topo, 2, 2)
    est = model_time(traffic_from_pairs([{(0, 2): 30, (1, 3): 30}], place, rounds=3), topo)
    assert est.seconds == pytest.approx(3 * max(0.5 + 0.5, 4 * 0.5 / 2))
    # one sender to two receivers: its 2 posts run one after another on its own
    est1 = model_time(traffic_from_pairs([{(0, 2): 30, (0, 3): 30}], place, rounds=3), topo)
    assert est1.seconds == pytest.approx(3 * (2 * 0.5 + 0.5))


def test_same_gpu_pair_is_a_local_copy():
    topo = bare(copy_bytes_per_s=10 * GB)
    place = Placement.explicit(topo, [0, 0], num_train=1)  # colocated with distinct rank numbers
    tr = traffic_from_pairs([{(0, 1): 5 * GB}], place)
    assert tr.network_bytes() == 0 and tr.nvlink_bytes() == 0
    assert model_time(tr, topo).seconds == pytest.approx(0.5)


def test_errors_name_the_problem():
    topo = bare()
    place = Placement.contiguous(topo, 2, 2)
    with pytest.raises(ValueError, match="rank 9 is not placed"):
        traffic_from_pairs([{(0, 9): 1}], place)
    with pytest.raises(ValueError, match="groups GPUs differently"):
        traffic_from_pairs([{(0, 2): 1}], place, Topology.preset("gb200-nvl72"))


# ---------------------------------------------------------------------------------- gather-and-broadcast
def test_gather_broadcast_by_hand():
    topo = bare()
    place = Placement.contiguous(topo, 8, 8)
    est = gather_broadcast_time([100 * GB], [{1: 50 * GB}], 0, range(8, 16), place, topo)
    gather, bcast = est.phases
    assert gather.seconds == pytest.approx(50 / 450)  # into root over NVLink
    assert bcast.seconds == pytest.approx(2.0)  # 100 GB out of root's one NIC
    assert (bcast.bottleneck.kind, bcast.bottleneck.where) == ("nic_out", 0)
    assert est.seconds == pytest.approx(2.0 + 50 / 450)


def test_gather_from_other_nodes_uses_roots_nic():
    topo = bare()
    place = Placement.explicit(topo, [0, 8, 16, 24], num_train=4, infer_ranks=[])
    est = gather_broadcast_time([30 * GB], [{1: 10 * GB, 2: 10 * GB, 3: 10 * GB}], 0, [], place, topo)
    assert est.phases[0].seconds == pytest.approx(30 / 50)
    assert est.phases[0].bottleneck.kind == "nic_in" and est.phases[1].seconds == 0


def test_broadcast_chain_spreads_domain_exits_over_channels():
    topo = Topology.preset("dgx-h100").with_(gpus_per_domain=4, gpus_per_node=4, nvlink_latency_s=1.0,
                                             net_latency_s=10.0)
    place = Placement.explicit(topo, list(range(8)), num_train=1)  # root 0; 1-3 share its domain; 4-7 the next
    hops, lat = broadcast_chain(0, range(1, 8), place, channels=4)
    assert lat == pytest.approx(6 * 1.0 + 10.0)  # 0-1-2-3 | 4-5-6-7: one network hop
    tr = traffic_from_pairs([hops], place)
    nic_out, nic_in, nvl_in = tr.total("nic_out"), tr.total("nic_in"), tr.total("nvlink_in")
    # the 4 rings leave root's domain through each of its 4 GPUs (root too) and enter the next through each
    assert nic_out[:4] == pytest.approx([0.25] * 4) and nic_in[4:8] == pytest.approx([0.25] * 4)
    # a ring that starts mid-domain comes back for root's domain peers before root (3 of the 4 rings)
    assert nic_out[4:8] == pytest.approx([0.25, 0.25, 0.25, 0]) and nic_out.sum() == pytest.approx(1.75)
    assert (nic_in + nvl_in)[1:8] == pytest.approx(np.ones(7))  # every receiver gets every byte
    assert (nic_in + nvl_in)[0] == 0  # the ring stops before it comes back to root
    hops1, _ = broadcast_chain(0, range(1, 8), place, channels=1)
    assert traffic_from_pairs([hops1], place).total("nic_out").max() == pytest.approx(1.0)
    # root alone in its domain (the naive baseline): everything leaves through root's one NIC
    hops2, _ = broadcast_chain(0, range(4, 8), place, channels=4)
    assert traffic_from_pairs([hops2], place).total("nic_out")[0] == pytest.approx(1.0)


def test_buckets_pay_latency_once_each():
    topo = Topology.preset("dgx-h100").with_(nic_bytes_per_s=1e30, nvlink_bytes_per_s=1e30, copy_bytes_per_s=1e30,
                                             launch_latency_s=1.0, net_latency_s=10.0, nvlink_latency_s=0.0,
                                             message_overhead_s=0.0)
    place = Placement.contiguous(topo, 8, 8)
    sizes, sends = [10, 10, 10], [{1: 5}, {1: 5}, {1: 5}]
    per_tensor = gather_broadcast_time(sizes, sends, 0, range(8, 16), place, topo)
    bucketed = gather_broadcast_time(sizes, sends, 0, range(8, 16), place, topo, bucket_bytes=25)
    # gather inside the node: launch 1 + NVLink 0; broadcast: launch 1 + one network hop 10
    assert per_tensor.seconds == pytest.approx(3 * (1 + 11))
    assert bucketed.seconds == pytest.approx(2 * (1 + 11)) and bucketed.phases[0].rounds == 2


def test_fair_gather_broadcast_by_hand():
    # domains of 2 GPUs: training ranks 0-3 on domains 0 and 1, inference ranks 4, 5 on domain 2
    topo = bare().with_(gpus_per_domain=2, gpus_per_node=2)
    place = Placement.contiguous(topo, 4, 2)
    stage = Stage(0, (0, 1, 2, 3), ["w"], [40 * GB], [{2: 20 * GB}])
    est = gather_broadcast_fair_time([stage], [4, 5], place, topo)
    gather, bcast = est.phases
    # rank 2's 20 GB leave domain 1 over both its NICs and enter domain 0 over both: 10 GB / 50 GB/s
    assert gather.seconds == pytest.approx(0.2)
    # the rings leave domain 0 through GPU 0 or 1 and enter domain 2 through GPU 4 or 5: 20 GB per NIC
    assert bcast.seconds == pytest.approx(0.4) and bcast.bottleneck.kind.startswith("nic")
    assert est.seconds == pytest.approx(0.6) and est.method == "gather-broadcast (fair)"
    naive = gather_broadcast_time([40 * GB], [{2: 20 * GB}], 0, [4, 5], place, topo)
    assert naive.seconds == pytest.approx(20 / 50 + 40 / 50)  # all through root's one NIC, in then out
    # a second stage (root 2, holding its 40 GB) broadcasts at the same time over the same inference NICs
    both = gather_broadcast_fair_time([stage, Stage(2, (2, 3), ["v"], [40 * GB], [{}])], [4, 5], place, topo)
    assert both.phases[1].seconds == pytest.approx(0.8) and both.seconds == pytest.approx(1.0)


def test_fair_buckets_overlap_gather_and_broadcast():
    topo = bare()
    place = Placement.contiguous(topo, 8, 8)
    n = 10
    stage = Stage(0, tuple(range(8)), ["w"] * n, [10 * GB] * n, [{r: 1.25 * GB for r in range(1, 8)}] * n)
    est = gather_broadcast_fair_time([stage], range(8, 16), place, topo)
    g, b = 8.75 / 450, 10 / 400  # per bucket: into root over NVLink; out of node 0 over its 8 NICs
    assert [p.seconds for p in est.phases] == pytest.approx([n * g, n * b])
    assert est.seconds == pytest.approx(g + n * b) and est.pipelined


def test_gather_sends_of_a_plan():
    spec = rs.TensorSpec("w", (8, 4), torch.bfloat16)
    norm = rs.TensorSpec("n", (4,), torch.bfloat16)
    src = rs.Layout.merge([
        rs.Layout.from_placements(spec, [0, 1, 2, 3], (2, 2), [rs.Replicate(), rs.Shard(0)]),  # HSDP 2 x 2
        rs.Layout.from_placements(norm, [0, 1, 2, 3], (4,), [rs.Replicate()]),
    ])
    dst = rs.Layout.merge([rs.Layout.from_placements(spec, [4, 5], (2,), [rs.Shard(1)]),
                           rs.Layout.from_placements(norm, [4, 5], (2,), [rs.Replicate()])])
    plan = rs.plan(src, dst)
    names, sizes, sends = gather_sends(plan)
    got = dict(zip(names, zip(sizes, sends)))
    # root 0 holds rows 0-3 (so does rank 2); rows 4-7 (32 B) are on ranks 1 and 3: half each
    assert got["w"] == (64, {1: 16, 3: 16})
    assert got["n"] == (8, {})  # root holds the whole norm
    place = Placement.contiguous(bare(), 4, 2)
    est = gather_broadcast_time_of(plan, place)
    assert est.method == "gather-broadcast (naive)" and est.seconds > 0
    fair = gather_broadcast_time_of(plan, place, variant="fair")
    assert fair.method == "gather-broadcast (fair)" and 0 < fair.seconds
    with pytest.raises(ValueError, match="variant"):
        gather_broadcast_time_of(plan, place, variant="best")


# ---------------------------------------------------------------------------------- lower bound
def test_lower_bound_terms_by_hand():
    topo = Topology.preset("dgx-h100")
    place = Placement.contiguous(topo, 8, 16)  # sources on domain 0, inference on domains 1 and 2
    d = Demand(domain_ingress_bytes={1: 400 * GB, 2: 100 * GB}, dest_need_bytes={8: 200 * GB},
               source_egress_bytes=500 * GB, source_exclusive_bytes={3: 60 * GB})
    b = lower_bound(d, place)
    by_name = {t.name: t.seconds for t in b.terms if t.where.startswith(("domain 1", "1 source", "rank 3", "GPU 8",
                                                                          "domain 0"))}
    assert by_name["domain NIC ingress"] == pytest.approx(400 / (8 * 50))  # 1.0
    assert by_name["source NIC egress"] == pytest.approx(500 / (8 * 50))  # 1.25
    assert by_name["source-only bytes (NIC + NVLink)"] == pytest.approx(60 / 500)  # one NVLink hop, then NICs
    assert by_name["source domain egress"] == pytest.approx(60 / 400)
    assert by_name["GPU ingress (NIC + NVLink)"] == pytest.approx(200 / 500)
    assert b.seconds == pytest.approx(1.25) and b.binding.name == "source NIC egress"
    assert "1.25 s" in b.format()


def test_lower_bound_without_nvlink_peers_uses_the_nic_only():
    topo = Topology.preset("dgx-h100")
    place = Placement.explicit(topo, [0, 8], num_train=1)  # the one inference GPU is alone in its domain
    # its 7 idle neighbours could relay over NVLink ("domain"); with the job's GPUs only, its NIC alone
    b = lower_bound(Demand(dest_need_bytes={1: 100 * GB}), place, ingress="job")
    assert b.seconds == pytest.approx(2.0) and b.binding.name == "GPU ingress (NIC)"
    b = lower_bound(Demand(dest_need_bytes={1: 100 * GB}), place)
    assert b.seconds == pytest.approx(100 / 500) and b.binding.name == "GPU ingress (NIC + NVLink)"
    with pytest.raises(ValueError, match="ingress must be"):
        lower_bound(Demand(), place, ingress="all")
    with pytest.raises(ValueError, match="domain 5 must receive"):
        lower_bound(Demand(domain_ingress_bytes={5: 1}), place)


def test_model_never_beats_the_bound_on_random_direct_plans():
    topo = bare("gb200-nvl72").with_(gpus_per_domain=8, gpus_per_node=4)
    rng = np.random.default_rng(0)
    for _ in range(20):
        m, n = rng.integers(1, 24, size=2)
        place = Placement.contiguous(topo, int(m), int(n))
        pairs = {(int(s), int(m + d)): float(rng.integers(1, 10 ** 9)) for s in range(m) for d in range(n)
                 if rng.random() < 0.5}
        if not pairs:
            continue
        dom = place.domain_of
        ingress, need, egress = {}, {}, 0.0
        for (s, d), b in pairs.items():
            need[d] = need.get(d, 0) + b
            if dom[s] != dom[d]:
                ingress[int(dom[d])] = ingress.get(int(dom[d]), 0) + b
                egress += b
        bound = lower_bound(Demand(ingress, need, egress), place).seconds
        est = model_time(traffic_from_pairs([pairs], place), topo).seconds
        assert est >= bound * (1 - 1e-9)
