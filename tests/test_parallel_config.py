"""One parallel-configuration type per side: parsed once from strings, validated once, laid out on request."""

import pytest

import reshard as rs
from reshard.frameworks.fsdp import fsdp_layout
from reshard.frameworks.megatron import megatron_layout
from reshard.frameworks.parallel import InferParallel, TrainParallel, model_layouts
from reshard.frameworks.vllm import vllm_layout
from reshard.models import get_arch, tiny_arch


@pytest.mark.parametrize("text, framework, world, shown", [
    ("tp1,ep16,pp4,dp2", "megatron", 128, "tp1,ep16,pp4,dp2"),
    ("tp1,cp1,ep16,dp2,pp4", "megatron", 128, "tp1,ep16,pp4,dp2"),  # any order, sizes of 1 left out
    ("megatron:tp2,pp2,dp2", "megatron", 8, "tp2,pp2,dp2"),
    ("tp2,etp1,ep4", "megatron", 4, "tp2,ep4,etp1"),
    ("fsdp:dp64,tp8,hsdp2", "fsdp", 1024, "fsdp:dp64,tp8,hsdp2"),
    ("FSDP:DP4", "fsdp", 4, "fsdp:dp4"),
])
def test_train_parse_and_format(text, framework, world, shown):
    t = TrainParallel.parse(text)
    assert (t.framework, t.world, str(t)) == (framework, world, shown)
    assert TrainParallel.parse(str(t)) == t


def test_megatron_sizes_follow_its_rank_rules():
    t = TrainParallel.parse("tp1,ep16,pp4,dp2")  # with ep > 1, dp counts replicas of the expert grid
    assert (t.expert_tp, t.dense_dp) == (1, 32)
    t = TrainParallel.parse("tp2,pp2,dp2")  # without EP, etp follows tp
    assert (t.expert_tp, t.dense_dp, t.world) == (2, 2, 8)


@pytest.mark.parametrize("text, framework, world, ep, shown", [
    ("tp8,dp16", "vllm", 128, False, "tp8,dp16"),
    ("tp8,dp16,ep", "vllm", 128, True, "tp8,dp16,ep"),
    ("dtensor:tp2,dp2", "dtensor", 4, False, "dtensor:tp2,dp2"),
    ("tp2", "vllm", 2, False, "tp2"),
])
def test_infer_parse_and_format(text, framework, world, ep, shown):
    i = InferParallel.parse(text)
    assert (i.framework, i.world, i.ep, str(i)) == (framework, world, ep, shown)
    assert InferParallel.parse(str(i)) == i


@pytest.mark.parametrize("cls, text, message", [
    (TrainParallel, "tp0", "tp must be a positive integer, got 0"),
    (TrainParallel, "tp2,tp4", "tp is given twice"),
    (TrainParallel, "tp", "tp needs a size"),
    (TrainParallel, "tp2,ep3", "3 ranks do not split into tp2 x cp1 x pp1 groups"),
    (TrainParallel, "fsdp:dp4,ep2", "fsdp takes dp, hsdp, tp, not ep"),
    (TrainParallel, "deepspeed:dp4", "unknown framework 'deepspeed'"),
    (TrainParallel, "tp2;dp2", "cannot read 'tp2;dp2'"),
    (InferParallel, "tp8,ep2", "ep takes no size"),
    (InferParallel, "dtensor:tp2,ep", "dtensor takes dp, tp, not ep"),
    (InferParallel, "tp2,dp0", "dp must be a positive integer, got 0"),
])
def test_bad_specs_name_the_part_at_fault(cls, text, message):
    with pytest.raises(rs.LayoutError, match=message) as e:
        cls.parse(text)
    assert str(e.value).startswith(text)


def test_constructor_validates_like_parse():
    with pytest.raises(rs.LayoutError, match="pp must be a positive integer"):
        TrainParallel(pp=0)
    with pytest.raises(rs.LayoutError, match="hsdp=2 is not a megatron size"):
        TrainParallel(hsdp=2)
    with pytest.raises(rs.LayoutError, match="inference framework 'sglang' unknown"):
        InferParallel("sglang")


def test_layouts_are_the_framework_constructors():
    arch = tiny_arch("qwen3-30b-a3b")
    lay = model_layouts(arch, "tp2,ep2", "tp2,dp2,ep")
    assert lay.source_ranks == [0, 1] and lay.destination_ranks == [2, 3, 4, 5] and lay.world_size == 6
    want_src = megatron_layout(arch, range(2), tp=2, ep=2, etp=1, dp=1)
    want_dst = vllm_layout(arch, range(2, 6), 2, 2, expert_parallel=True)
    for got, want in ((lay.source, want_src), (lay.destination, want_dst)):
        assert rs.plan(want, got).fingerprint() == rs.plan(want, want).fingerprint()
    colocated = model_layouts(get_arch("qwen3-8b"), "fsdp:dp2", "tp2", colocate=True)
    assert colocated.destination_ranks == [0, 1] and colocated.world_size == 2
    fsdp = fsdp_layout(get_arch("qwen3-8b"), range(2), dp_shard=2)
    assert all(colocated.source.pieces(r) == fsdp.pieces(r) for r in range(2))
