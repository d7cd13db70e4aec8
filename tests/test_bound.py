"""The lower bound is a bound: on small hand-made topologies whose optimum is known it never exceeds
the optimum, and no modeled method beats it on real (tiny) model layouts."""

import math

import pytest

from reshard.frameworks.parallel import model_layouts
from reshard.modeling.bound import Demand, lower_bound
from reshard.modeling.pipeline import RefitModel
from reshard.modeling.reshard_time import model_time
from reshard.modeling.topology import Placement, Topology
from reshard.modeling.traffic import traffic_from_pairs
from reshard.models import tiny_arch

GB = 1e9
NIC, NVL = 50 * GB, 450 * GB


def bare(gpus_per_domain: int) -> Topology:
    """NIC 50 GB/s, NVLink 450 GB/s, nothing else costs anything."""
    return Topology("toy", gpus_per_domain, gpus_per_domain, NIC, NVL, copy_bytes_per_s=math.inf)


def test_source_only_bytes_may_take_an_nvlink_hop_first():
    # domain 0: GPU 0 holds X alone, GPU 1 holds nothing; domain 1: GPUs 2, 3 each need all of X.
    # Optimum: GPU 0 sends half of X out of its NIC and hands the other half to GPU 1 over NVLink,
    # which sends it out of its NIC; domain 1's GPUs swap halves over NVLink: X / (2 NICs).
    X = 100 * GB
    topo = bare(2)
    place = Placement.explicit(topo, [0, 1, 2, 3], num_train=2)
    optimum = X / (2 * NIC)
    # that schedule, pipelined over many rounds, approaches the optimum from above
    phases = [{(0, 1): X / 2}, {(0, 2): X / 2, (1, 3): X / 2}, {(2, 3): X / 2, (3, 2): X / 2}]
    est = model_time(traffic_from_pairs(phases, place, rounds=1000), topo, pipeline=True)
    assert optimum <= est.seconds <= optimum * 1.01
    demand = Demand(domain_ingress_bytes={1: X}, dest_need_bytes={2: X, 3: X}, source_egress_bytes=X,
                    source_exclusive_bytes={0: X})
    for ingress in ("domain", "job"):
        b = lower_bound(demand, place, ingress=ingress)
        assert b.seconds <= optimum * (1 + 1e-12)
        assert b.seconds == pytest.approx(optimum)  # tight here
    # the source-only term alone: one NIC plus one NVLink hop (it used to be X / one NIC = 2 x optimum)
    (term,) = [t for t in b.terms if t.name.startswith("source-only")]
    assert term.seconds == pytest.approx(X / (NIC + NVL))


def test_partly_used_domain_counts_every_nic_or_the_jobs():
    # one source domain of 4 GPUs, each with a replica of X; the one inference GPU (GPU 4) needs X and
    # shares its domain with 3 idle GPUs.
    X = 100 * GB
    topo = bare(4)
    place = Placement.explicit(topo, [0, 1, 2, 3, 4], num_train=4)
    demand = Demand(domain_ingress_bytes={1: X}, dest_need_bytes={4: X}, source_egress_bytes=X)
    # idle GPUs may relay: 4 NICs into domain 1, 3 of them forwarding over NVLink to GPU 4
    with_idle = X / (4 * NIC)
    b = lower_bound(demand, place)
    assert b.seconds <= with_idle * (1 + 1e-12) and b.seconds == pytest.approx(with_idle)
    assert b.binding.name == "domain NIC ingress" and "4 NICs" in b.binding.where
    # only the job's GPUs: GPU 4's one NIC, which a single point-to-point transfer reaches
    job_only = X / NIC
    bj = lower_bound(demand, place, ingress="job")
    assert bj.seconds == pytest.approx(job_only) and "the job's" in bj.binding.where
    est = model_time(traffic_from_pairs([{(s, 4): X / 4 for s in range(4)}], place), topo)
    assert est.seconds == pytest.approx(job_only)


def test_one_pair_is_tight():
    X = 10 * GB
    topo = bare(1)
    place = Placement.explicit(topo, [0, 1], num_train=1)
    demand = Demand(domain_ingress_bytes={1: X}, dest_need_bytes={1: X}, source_egress_bytes=X,
                    source_exclusive_bytes={0: X})
    for ingress in ("domain", "job"):
        assert lower_bound(demand, place, ingress=ingress).seconds == pytest.approx(X / NIC)


@pytest.mark.parametrize("model,train,infer", [
    ("qwen3-30b-a3b", "ep2,pp2", "tp2,dp2"),
    ("qwen3-30b-a3b", "ep4", "tp2,dp2,independent"),
    ("deepseek-v3", "pp2,ep2", "tp4"),
])
def test_no_method_beats_the_bound(model, train, infer):
    topo = bare(2)
    lay = model_layouts(tiny_arch(model), train, infer)
    place = Placement.contiguous(topo, lay.train_world, lay.infer_world, infer_start="domain")
    m = RefitModel.build(lay.source, lay.destination, topo, placement=place)
    bound_domain, bound_job = m.lower_bound().seconds, m.lower_bound(ingress="job").seconds
    assert 0 < bound_domain <= bound_job
    times = {"hierarchical": m.estimate(m.hierarchical)[1].seconds, "direct": m.estimate(m.direct)[1].seconds,
             "fair": m.gather_broadcast().seconds, "naive": m.gather_broadcast(variant="naive").seconds,
             "hybrid": m.hybrid().seconds}
    for name, t in times.items():  # every method here uses the job's GPUs only
        assert t >= bound_job * (1 - 1e-9), name
    assert times["naive"] >= times["fair"] * (1 - 1e-9)
