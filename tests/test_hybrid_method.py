"""The ``hybrid`` method: its plan (pure: the split, the fingerprint, the degenerate rules) and its
executor and refit sessions over real gloo processes (bytes, pre-flight checks, one decision for
both parts, a fault in the broadcast part poisoning every destination)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import reshard as rs
from reshard.errors import OptionsError
from reshard.execution.local import run_local
from reshard.execution.methods import HYBRID, METHODS, RESHARD, method_executor, method_plan
from reshard.execution.process_group import free_port
from reshard.planning.hybrid import BROADCAST_ONLY, HybridPlan, HybridRule
from reshard.refit import RefitError, RefitSession, Side
from reshard.tensors import LayoutError

NAMES = ("model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
         "model.layers.0.mlp.experts.1.down_proj.weight", "lm_head.weight")
PICKED = {NAMES[0], NAMES[3]}  # by the default rule: FFN and experts


def _full(specs):
    return {s.name: ((torch.arange(s.numel, dtype=torch.int64) * 7 + 1000 * i) % 4093 - 2046).reshape(s.shape).to(s.dtype)
            for i, s in enumerate(specs)}


def layouts():
    """Ranks 0-1 train, 1-3 infer (rank 1 colocated): shards, replicas, a cast to bf16, uneven splits."""
    up, q, norm, ex, head = (rs.TensorSpec(NAMES[0], (10, 6), torch.float32), rs.TensorSpec(NAMES[1], (8, 6), torch.float32),
                             rs.TensorSpec(NAMES[2], (6,), torch.float32), rs.TensorSpec(NAMES[3], (4, 5, 3), torch.float32),
                             rs.TensorSpec(NAMES[4], (7, 6), torch.float32))
    src = rs.Layout.merge([
        rs.Layout.from_placements(up, [0, 1], (2,), [rs.Shard(0)]),
        rs.Layout.from_placements(q, [0, 1], (2,), [rs.Shard(1)]),
        rs.Layout.from_placements(norm, [0, 1], (2,), [rs.Replicate()]),
        rs.Layout.from_placements(ex, [0, 1], (2,), [rs.Shard(2)]),
        rs.Layout.from_placements(head, [0, 1], (2,), [rs.Shard(0)]),
    ])
    dst = rs.Layout.merge([
        rs.Layout.from_placements(up, [1, 2, 3], (3,), [rs.Shard(1)], dtype=torch.bfloat16),
        rs.Layout.from_placements(q, [1, 2, 3], (3,), [rs.Shard(0)]),
        rs.Layout.from_placements(norm, [1, 2, 3], (3,), [rs.Replicate()]),
        rs.Layout.from_placements(ex, [2, 3], (2,), [rs.Shard(0)]),
        rs.Layout.from_placements(head, [1, 2, 3], (3,), [rs.Shard(0)], dtype=torch.bfloat16),
    ])
    return src, dst


# ---------------------------------------------------------------------------------------- pure
def test_the_rule_splits_the_plan_and_the_parts_cover_every_destination_byte():
    src, dst = layouts()
    h = method_plan(HYBRID, src, dst, max_bucket_bytes=256)
    assert isinstance(h, HybridPlan) and HYBRID in METHODS
    assert set(h.reshard_tensors) == PICKED and set(h.broadcast_tensors) == set(NAMES) - PICKED
    assert h.phase_names == ["transfer", "gather-broadcast"] and h.phases == [h.reshard, h.broadcast]
    assert h.reshard.max_bucket_bytes == 256 and h.reshard.round_bytes == 128  # two rounds in flight: half each
    assert h.root == 0 and h.wire_bytes == sum(h.part_bytes().values())
    gb = rs.gather_broadcast_bytes(h.broadcast)
    assert h.part_bytes() == {"reshard": h.reshard.wire_bytes, **gb}
    # the two parts, run one after the other into the same buffers, fill every destination byte
    full = _full(list(dst.specs.values()))
    out = {r: dst.empty_buffers(r) for r in dst.ranks}
    srcb = {r: src.materialize(r, full) for r in src.ranks}
    run_local(h.reshard, srcb, out)
    run_local(h.broadcast, srcb, out)
    for r in dst.ranks:
        for name, want in dst.materialize(r, full).items():
            assert torch.equal(out[r][name], want), (r, name)
    assert h.summary()["reshard_tensors"] == 2 and "HybridPlan(2 tensors by reshard" in repr(h)


def _is_head(name):
    return name.startswith("lm_head")


def test_fingerprint_follows_the_rule():
    src, dst = layouts()
    default = HybridPlan(src, dst)
    assert default.fingerprint() == HybridPlan(src, dst, HybridRule()).fingerprint()  # deterministic
    other_split = HybridPlan(src, dst, HybridRule(patterns=(r"self_attn",)))
    same_split = HybridPlan(src, dst, HybridRule(patterns=HybridRule().patterns + (r"nothing-matches",)))
    assert set(same_split.reshard_tensors) == set(default.reshard_tensors)
    prints = {p.fingerprint() for p in (default, other_split, same_split, HybridPlan(src, dst, BROADCAST_ONLY))}
    assert len(prints) == 4  # ranks with another rule disagree even when it happens to split alike
    assert HybridRule(predicate=_is_head).key == f"predicate:{__name__}._is_head"


def test_degenerate_rules_give_one_part():
    src, dst = layouts()
    nothing = HybridPlan(src, dst, BROADCAST_ONLY)
    assert nothing.reshard is None and nothing.phase_names == ["gather-broadcast"] and nothing.root == 0
    assert nothing.part_bytes() == {"reshard": 0, **rs.gather_broadcast_bytes(rs.plan(src, dst))}
    everything = HybridPlan(src, dst, lambda name: True)
    assert everything.broadcast is None and everything.root is None and everything.phase_names == ["transfer"]
    assert everything.wire_bytes == rs.plan(src, dst).wire_bytes
    # with NVLink domains the reshard part is hierarchical
    h = HybridPlan(src, dst, domains={0: 0, 1: 1, 2: 1, 3: 1})
    assert h.phase_names[-1] == "gather-broadcast" and h.phase_names[0] == "network"


def test_bad_rules_and_options_are_named():
    src, dst = layouts()
    with pytest.raises(ValueError, match=r"pattern '\(' is not a regular expression"):
        method_plan(HYBRID, src, dst, rule=["("])
    with pytest.raises(ValueError, match="a list of regular expressions"):
        method_plan(HYBRID, src, dst, rule="experts")
    with pytest.raises(OptionsError, match="method 'reshard' does not take option 'hybrid_rule'"):
        method_plan(RESHARD, src, dst, rule=HybridRule())
    with pytest.raises(TypeError, match="runs a HybridPlan"):
        method_executor(HYBRID, rs.plan(src, dst))
    other = rs.Layout.from_placements(rs.TensorSpec("x", (2,), torch.float32), [0], (1,), [rs.Replicate()])
    with pytest.raises(LayoutError, match="unknown tensor 'model.layers.0.mlp.up_proj.weight'"):
        HybridPlan(other, dst)  # named before the layouts are cut
    with pytest.raises(OptionsError, match="method 'reshard' does not take option 'hybrid_rule'"):
        RefitSession.connect(store_addr="127.0.0.1:1", rank=0, world_size=2, method="reshard",
                             hybrid_rule=HybridRule())
    with pytest.raises(OptionsError, match="not a regular expression"):
        RefitSession.connect(store_addr="127.0.0.1:1", rank=0, world_size=2, method="hybrid", hybrid_rule=["[a"])


# ---------------------------------------------------------------------------------------- processes
T = datetime.timedelta(seconds=20)


def _check(dst, rank, buffers, full, what):
    for name, want in (dst.materialize(rank, full) if rank in dst.ranks else {}).items():
        assert torch.equal(buffers[name].view(torch.uint8), want.view(torch.uint8)), (what, rank, name)


def _executors(rank, world, store_addr):
    from reshard.execution import faults

    src, dst = layouts()
    full = _full(list(dst.specs.values()))
    sb = src.materialize(rank, full) if rank in src.ranks else {}
    # 1. bytes for the default rule and both degenerate ones; sent bytes add up to the plan's
    for rule in (None, BROADCAST_ONLY, lambda n: True):
        h = method_plan(HYBRID, src, dst, max_bucket_bytes=256, rule=rule)
        db = dst.empty_buffers(rank)
        with method_executor(HYBRID, h, timeout=T) as ex:
            stats = ex.run(sb, db)
        _check(dst, rank, db, full, h)
        sent = [None] * world
        dist.all_gather_object(sent, stats.sent_bytes)
        assert sum(sent) == h.wire_bytes, (h, sent)
        names = [p.name for p in stats.phases]
        assert names == {None: ["transfer", "gather", "broadcast"], BROADCAST_ONLY: ["gather", "broadcast"]}.get(
            rule, ["transfer"]), names
    # 2. pre-flight, every rank, nothing written: buffers of the two parts sharing storage; another rule
    h = method_plan(HYBRID, src, dst, max_bucket_bytes=256)
    db = dst.empty_buffers(rank)
    if rank == 2:  # up_proj (by reshard) and q_proj (by broadcast) written into one storage
        up, q = db[NAMES[0]], db[NAMES[1]]
        base = torch.zeros(up.numel() + q.numel())
        db[NAMES[0]], db[NAMES[1]] = base.view(torch.bfloat16)[: up.numel()].view(up.shape), base[: q.numel()].view(q.shape)
    with method_executor(HYBRID, h, timeout=T) as ex, pytest.raises(LayoutError, match="rank 2: destination buffers"
                                                                                       ".* share memory"):
        ex.run(sb, db)
    assert all(not t.any() for t in db.values())
    with pytest.raises(LayoutError, match="disagree on the plan fingerprint"):
        method_executor(HYBRID, method_plan(HYBRID, src, dst, rule=[r"self_attn"] if rank == 3 else None), timeout=T)
    # 3. sessions over a standalone group: hybrid refits; gather-broadcast through the same path
    source = Side.from_layout(src, rank, src.materialize(rank, full)) if rank in src.ranks else None
    db = dst.empty_buffers(rank) if rank in dst.ranks else None
    destination = Side.from_layout(dst, rank, db) if db is not None else None
    s = RefitSession.connect(source=source, destination=destination, store_addr=store_addr, rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=3), method="hybrid",
                             max_bucket_bytes=256, hybrid_rule=[r"experts", r"up_proj"])
    assert s.method == HYBRID and set(s.plan.reshard_tensors) == PICKED
    for version in (1, 2):
        if source is not None:
            for t in source.tensors.values():
                t.add_(1)
        stats = s.refit(version)
        assert s.version == version and [p.name for p in stats.run.phases] == ["transfer", "gather", "broadcast"]
    _check(dst, rank, db or {}, {n: (v + 2).to(v.dtype) for n, v in full.items()}, "session")
    # 4. a fault in the broadcast part: every rank raises, every destination is poisoned, nothing commits
    if rank == 2:
        faults.arm("raise@gather-broadcast")
    start = time.monotonic()
    with pytest.raises(RefitError) as err:
        s.refit(3)
    assert time.monotonic() - start < 8, err.value  # the 3 s timeout bounds it, not a hang
    assert "gather-broadcast" in str(err.value) and 2 in err.value.ranks, err.value
    assert s.version == 2 and s.state == ("poisoned" if destination is not None else "ready")
    # the survivors recover (same rule) and refit again
    s = s.recover()
    assert s.method == HYBRID and s.plan.rule == HybridRule(patterns=(r"experts", r"up_proj"))
    s.refit(4)
    assert s.version == 4 and s.state == "ready"
    _check(dst, rank, db or {}, {n: (v + 2).to(v.dtype) for n, v in full.items()}, "after recovery")
    s.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hybrid_executor_and_session_over_gloo():
    rs.spawn(_executors, 4, f"127.0.0.1:{free_port()}", timeout=datetime.timedelta(seconds=60))


@pytest.mark.parametrize("patterns", [None, ("(ex)perts", r"(a)\1"), (r"^model\.embed", r"norm\.weight$"),
                                      ("(?i)EXPERTS",), (r"(?P<p>proj)\.(?P=p)", "lm_head"), ("",)])
def test_a_rule_picks_what_any_of_its_patterns_finds(patterns):
    """A rule searches its patterns as one alternation where that is the same (one search per name):
    it picks exactly the names any pattern alone finds, over every tensor of two real models and names
    made to hit the patterns that cannot be joined (back-references, a leading flag)."""
    import re

    from reshard.models.arch import get_arch, model_specs

    rule = HybridRule() if patterns is None else HybridRule(patterns=patterns)
    names = [s.name for a in ("deepseek-v3", "qwen3-30b-a3b") for s in model_specs(get_arch(a))]
    names += ["aa", "ab", "x.Experts.0", "proj.proj", "proj.projx", "model.norm.weight", "", "lm_head.weight"]
    found = [n for n in names if any(re.search(p, n) for p in rule.patterns)]
    assert [n for n in names if rule(n)] == found
    assert 0 < len(found) < len(names) or patterns == ("",)
