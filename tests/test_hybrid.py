"""The hybrid refit: the split rule, the split layouts, and its modeled time from its two parts."""

import math

import pytest

from reshard.frameworks.parallel import model_layouts
from reshard.modeling.pipeline import RefitModel
from reshard.modeling.topology import Placement, Topology
from reshard.models import tiny_arch
from reshard.planning.baseline import stage_groups
from reshard.planning.hybrid import HybridRule, split_layout


@pytest.fixture(scope="module")
def moe():
    lay = model_layouts(tiny_arch("deepseek-v3"), "pp2,ep2", "tp2,dp2,independent")
    topo = Topology.preset("dgx-h100").with_(gpus_per_domain=2, gpus_per_node=2)
    place = Placement.contiguous(topo, lay.train_world, lay.infer_world, infer_start="domain")
    return RefitModel.build(lay.source, lay.destination, topo, placement=place)


def test_default_rule_sends_ffn_and_experts_by_reshard(moe):
    rule = HybridRule()
    names = list(moe.destination.specs)
    by_reshard = [n for n in names if rule(n)]
    assert by_reshard and all(("experts" in n) or ("_proj." in n and ".mlp." in n) for n in by_reshard)
    assert not rule("model.embed_tokens.weight") and not rule("lm_head.weight")
    assert not any(rule(n) for n in names if ".mlp.gate." in n)  # the router stays with the broadcast
    assert not any(rule(n) for n in names if ".self_attn." in n)


def test_split_layout_partitions_tensors_and_keeps_buffers(moe):
    for lay in (moe.source, moe.destination):
        a, b = split_layout(lay)
        assert set(a.specs) | set(b.specs) == set(lay.specs) and not set(a.specs) & set(b.specs)
        for part in (a, b):
            for n, t in part.tables.items():
                assert t is lay.tables[n]
                for r in set(t.ranks.tolist()):
                    assert part.buffers(r).items() <= lay.buffers(r).items()
        a.validate()
        b.validate()


def test_hybrid_is_its_two_parts_in_turn(moe):
    est = moe.hybrid()
    names = [p.name for p in est.phases]
    assert names[0].startswith("reshard ") and names[-1] == "broadcast broadcast"
    assert est.seconds == pytest.approx(sum(p.seconds for p in est.phases if p.name.startswith("broadcast"))
                                        + float(est.notes[0].split(": ")[1].split(" s")[0]), rel=1e-3)
    # everything by reshard: the reshard estimate; nothing: the fair broadcast
    everything = moe.hybrid(rule=HybridRule(predicate=lambda n: True))
    assert everything.seconds == pytest.approx(moe.estimate(moe.reshard)[1].seconds)
    nothing = moe.hybrid(rule=HybridRule(predicate=lambda n: False))
    assert nothing.seconds == pytest.approx(moe.gather_broadcast().seconds)


def test_stage_groups_are_pipeline_stages(moe):
    groups = stage_groups(moe.source)
    assert groups == [(0, 1), (2, 3)]  # pp2 x ep2: two stages of two ranks


def test_gather_broadcast_variants(moe):
    fair, naive = moe.gather_broadcast(), moe.gather_broadcast(variant="naive")
    assert fair.method == "gather-broadcast (fair)" and naive.method == "gather-broadcast (naive)"
    assert fair.pipelined and fair.seconds < naive.seconds and math.isfinite(fair.seconds)
    with pytest.raises(ValueError, match="variant"):
        moe.gather_broadcast(variant="best")


def test_the_executor_method_and_the_cost_model_split_alike(moe):
    """The ``hybrid`` method's plan moves by reshard exactly the tensors the cost model's hybrid
    counts as reshard, for the default rule and a changed one."""
    from reshard.planning.hybrid import HybridPlan

    for rule in (None, HybridRule(patterns=(r"experts",))):
        plan = HybridPlan(moe.source, moe.destination, rule)
        note = moe.hybrid(rule=rule).notes[-1]
        assert note.startswith(f"{len(plan.reshard_tensors)} tensors by reshard, {len(plan.broadcast_tensors)} by "
                               f"packed broadcast"), note
        by_reshard, _ = split_layout(moe.destination, rule)
        assert set(plan.reshard_tensors) == {n for n, t in by_reshard.tables.items() if len(t)}
