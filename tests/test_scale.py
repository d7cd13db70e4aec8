"""Issue 22 point 5's pieces: several vLLM deployments side by side, and a rank's part built from
only the groups that name it."""

from __future__ import annotations

import pytest

from reshard.frameworks.parallel import InferParallel, model_layouts
from reshard.frameworks.vllm import vllm_layout
from reshard.models.arch import get_arch
from reshard.planning.plan import plan


def test_two_deployments_are_one_deployment_on_each_half_of_the_ranks():
    two = InferParallel.parse("tp2,dp2,ep,deployments2")
    assert two.world == 8 and str(two) == "tp2,dp2,ep,deployments2"
    lay = two.layout("qwen3-30b-a3b", range(10, 18))
    for first in (10, 14):
        alone = vllm_layout(get_arch("qwen3-30b-a3b"), range(first, first + 4), 2, 2, expert_parallel=True)
        for r in range(first, first + 4):
            assert lay.pieces(r) == alone.pieces(r)
            assert lay.buffers(r) == alone.buffers(r)


def test_a_rank_part_from_its_groups_equals_one_from_every_group():
    refit = model_layouts("qwen3-30b-a3b", "ep4", "tp2,dp2,ep,deployments2")
    p = plan(refit.source, refit.destination, max_bucket_bytes=64 << 20)
    ranks = sorted(set(refit.source.ranks) | set(refit.destination.ranks))
    indexed = [p.for_rank(r) for r in ranks]
    builder = p._rank_plans
    builder._groups_by_rank = {r: list(range(len(builder.groups))) for r in ranks}
    for r, part in zip(ranks, indexed):
        assert part == p.for_rank(r)


@pytest.mark.parametrize("model, infer", [("qwen3-30b-a3b", "tp2,dp2,ep,deployments2"),
                                          ("qwen3-30b-a3b", "tp2,dp2,deployments3"),
                                          ("qwen3-30b-a3b", "tp2,dp2,ep,independent,deployments2"),
                                          ("deepseek-v3", "tp2,dp2,ep,deployments2")])
def test_side_by_side_deployments_equal_their_merge(model, infer):
    """Deployments built in one pass hold what each deployment's own layout holds, merged."""
    from reshard.layout import Layout
    sides = InferParallel.parse(infer)
    each = sides.tp * sides.dp
    parts = [vllm_layout(get_arch(model), range(first, first + each), sides.tp, sides.dp, expert_parallel=sides.ep,
                         independent_engines=sides.independent) for first in range(0, sides.world, each)]
    merged, fast = Layout.merge(parts), sides.layout(model)
    fast.validate()
    assert fast.ranks == merged.ranks and list(fast.tables) == list(merged.tables)
    assert all(fast.pieces(r) == merged.pieces(r) and fast.buffers(r) == merged.buffers(r) for r in fast.ranks)
