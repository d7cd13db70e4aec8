"""``Layout.from_placements`` against torch's own DTensor placement code, without a process group.

The expected local tensor of a rank is what ``distribute_tensor`` computes: each
mesh dim's placement, left to right, splits what the previous ones left on the rank
with torch's ``Shard._split_tensor`` / ``_StridedShard._split_tensor``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.placement_types import _StridedShard

import reshard as rs
from reshard.placements import from_torch_placement

try:
    import strategies as S
except ImportError:  # tests/ imported as a package
    from . import strategies as S

PROPS = settings(max_examples=150, deadline=None)


def torch_placement(p):
    if isinstance(p, rs.Shard):
        return TShard(p.dim)
    if isinstance(p, rs.StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    return TReplicate()


def torch_local(full: torch.Tensor, mesh_shape, placements, coord) -> torch.Tensor:
    """The local tensor at mesh coordinate ``coord``, as DTensor's ``distribute_tensor`` cuts it."""
    local = full
    for k, p, c in zip(mesh_shape, placements, coord):
        if isinstance(p, rs.Replicate):
            continue
        shards, _ = torch_placement(p)._split_tensor(local, k, with_padding=False, contiguous=True)
        assert len(shards) == k
        local = shards[c]
    return local


@st.composite
def placement_cases(draw, strided: bool, max_mesh_dims: int = 2):
    shape = draw(S.shapes(max_ndim=3, budget=400))
    mesh = draw(S.mesh_shapes(max_dims=max_mesh_dims))
    placements = draw(S.placements_for(len(shape), len(mesh), strided=strided))
    n = math.prod(mesh)
    ranks = draw(st.permutations(range(10, 10 + n)))  # ranks in any order; row-major over the mesh
    return shape, mesh, placements, list(ranks)


def check_against_torch(shape, mesh, placements, ranks, split="chunk"):
    spec = rs.TensorSpec("w", shape, torch.float32)
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    lay = rs.Layout.from_placements(spec, ranks, mesh, placements, split)
    for rank, coord in zip(ranks, itertools.product(*(range(m) for m in mesh))):
        want = torch_local(full, mesh, placements, coord)
        got = lay.materialize(rank, {"w": full})["w"]
        assert got.shape == want.shape, f"rank {rank} at {coord}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"rank {rank} at {coord}:\n got {got}\nwant {want}"


@PROPS
@given(placement_cases(strided=False, max_mesh_dims=3))
def test_shard_and_replicate_match_torch(case):
    check_against_torch(*case)


@st.composite
def divisible_cases(draw):
    """Shapes whose every split divides: each dim a multiple of the product of its mesh sizes and
    split factors."""
    mesh = draw(S.mesh_shapes(max_ranks=4, max_dims=2))
    ndim = draw(st.integers(1, 2))
    placements = draw(S.placements_for(ndim, len(mesh), strided=True))
    shape = []
    for d in range(ndim):
        div = math.prod(k * (p.split_factor if isinstance(p, rs.StridedShard) else 1)
                        for k, p in zip(mesh, placements) if not isinstance(p, rs.Replicate) and p.dim == d)
        shape.append(div * draw(st.integers(0, 2)))
    ranks = draw(st.permutations(range(math.prod(mesh))))
    return tuple(shape), mesh, placements, list(ranks)


@PROPS
@given(divisible_cases())
def test_all_split_rules_match_torch_when_sizes_divide(case):
    shape, mesh, placements, ranks = case
    assert S.even_divides(shape, mesh, placements)
    for split in S.SPLITS:
        check_against_torch(shape, mesh, placements, ranks, split)


@PROPS
@given(placement_cases(strided=True))
def test_strided_shard_matches_torch(case):
    """Uneven sizes included: torch 2.13's _StridedShard chunks into split_factor parts first,
    then each part into mesh-size parts (a nested rule, not one flat split)."""
    check_against_torch(*case)


def test_strided_shard_uneven_follows_the_nested_rule():
    spec = rs.TensorSpec("w", (10,), torch.float32)
    lay = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.StridedShard(0, 2)])
    assert rows(lay, 0) == ["0:3", "5:8"]  # 10 -> parts 0:5, 5:10 -> each cut 3 + 2
    assert rows(lay, 1) == ["3:5", "8:10"]
    check_against_torch((10,), (2,), [rs.StridedShard(0, 2)], [0, 1])
    # FSDP2 over TP, uneven: TP shards 0:5 / 5:10, FSDP cuts each 3 + 2
    lay = rs.Layout.from_placements(spec, [0, 1, 2, 3], (2, 2), [rs.StridedShard(0, 2), rs.Shard(0)])
    assert [rows(lay, r) for r in range(4)] == [["0:3"], ["5:8"], ["3:5"], ["8:10"]]
    check_against_torch((10,), (2, 2), [rs.StridedShard(0, 2), rs.Shard(0)], [0, 1, 2, 3])


# ---------------------------------------------------------------------------- layouts from placements
@PROPS
@given(placement_cases(strided=True, max_mesh_dims=3), st.sampled_from(S.SPLITS))
def test_every_element_held_once_per_replica_and_buffers_filled(case, split):
    shape, mesh, placements, ranks = case
    if split == "even" and not S.even_divides(shape, mesh, placements):
        with pytest.raises(rs.LayoutError, match="even"):
            rs.Layout.from_placements(rs.TensorSpec("w", shape, torch.float32), ranks, mesh, placements, split)
        return
    spec = rs.TensorSpec("w", shape, torch.float32)
    lay = rs.Layout.from_placements(spec, ranks, mesh, placements, split)
    replicas = math.prod(m for m, p in zip(mesh, placements) if isinstance(p, rs.Replicate))
    held = np.zeros(shape, np.int64)
    for r in ranks:
        assert set(lay.buffers(r)) == {"w"}
        assert lay.buffers(r)["w"][1] == torch.float32
        cover = S.coverage(lay, r)["w"]
        assert bool((cover == 1).all()), f"rank {r}: buffer not exactly tiled by its pieces"
        for p in lay.pieces(r):
            held[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))] += 1
    assert (held == replicas).all()
    assert lay.ranks == sorted(r for r in ranks if lay.buffers(r)) or lay.ranks == sorted(ranks)


@PROPS
@given(placement_cases(strided=True, max_mesh_dims=3))
def test_even_raises_exactly_when_a_split_does_not_divide(case):
    shape, mesh, placements, ranks = case
    spec = rs.TensorSpec("w", shape, torch.float32)
    if S.even_divides(shape, mesh, placements):
        even = rs.Layout.from_placements(spec, ranks, mesh, placements, "even")
        for split in ("chunk", "balanced"):  # every rule agrees when sizes divide
            other = rs.Layout.from_placements(spec, ranks, mesh, placements, split)
            assert all(even.pieces(r) == other.pieces(r) for r in ranks)
    else:
        with pytest.raises(rs.LayoutError, match="does not divide evenly"):
            rs.Layout.from_placements(spec, ranks, mesh, placements, "even")


def test_materialize_matches_the_independent_fill():
    spec = rs.TensorSpec("w", (7, 5), torch.float32)
    lay = rs.Layout.from_placements(spec, [3, 1, 2, 0], (2, 2), [rs.StridedShard(0, 2), rs.Shard(1)],
                                    dtype=torch.bfloat16)
    full = S.full_tensors([spec])
    for r in lay.ranks:
        got = lay.materialize(r, full)
        want = S.fill(lay, r, full)
        assert got.keys() == want.keys() and all(S.bitwise_equal(got[b], want[b]) for b in got)


def test_buffer_name_and_dtype_options():
    spec = rs.TensorSpec("model.w", (4, 6), torch.float32)
    lay = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.Shard(1)])
    assert lay.buffers(1) == {"model.w": ((4, 3), torch.float32)}
    lay = rs.Layout.from_placements(spec, [5, 2], (2,), [rs.Shard(1)], buffer="p", dtype=torch.bfloat16)
    assert lay.ranks == [2, 5]
    assert lay.buffers(5) == {"p": ((4, 3), torch.bfloat16)}
    assert lay.pieces(2) == [rs.Piece("model.w", (0, 3), (4, 3), "p", (0, 0), 2)]


# ---------------------------------------------------------------------------- split rules
@pytest.mark.parametrize("n, parts, split, sizes", [
    (10, 4, "chunk", [3, 3, 3, 1]),
    (10, 4, "balanced", [3, 3, 2, 2]),
    (12, 4, "even", [3, 3, 3, 3]),
    (5, 4, "chunk", [2, 2, 1, 0]),
    (6, 4, "chunk", [2, 2, 2, 0]),  # torch.chunk gives 3 chunks; DTensor pads with an empty one
    (5, 4, "balanced", [2, 1, 1, 1]),
    (1, 3, "chunk", [1, 0, 0]),
    (1, 3, "balanced", [1, 0, 0]),
    (0, 3, "chunk", [0, 0, 0]),
    (0, 3, "balanced", [0, 0, 0]),
    (0, 3, "even", [0, 0, 0]),
    (7, 1, "even", [7]),
])
def test_split_sizes_examples(n, parts, split, sizes):
    assert rs.split_sizes(n, parts, split) == sizes


@given(st.integers(0, 60), st.integers(1, 12))
def test_split_sizes_rules(n, parts):
    chunk = rs.split_sizes(n, parts, "chunk")
    torch_sizes = [t.shape[0] for t in torch.chunk(torch.empty(n), parts)] if n else []
    assert chunk == torch_sizes + [0] * (parts - len(torch_sizes))
    balanced = rs.split_sizes(n, parts, "balanced")
    assert sum(balanced) == n and len(balanced) == parts
    assert max(balanced) - min(balanced) <= 1 and balanced == sorted(balanced, reverse=True)
    if n % parts:
        with pytest.raises(rs.LayoutError, match="does not divide evenly"):
            rs.split_sizes(n, parts, "even")
    else:
        assert rs.split_sizes(n, parts, "even") == [n // parts] * parts == chunk == balanced


def rows(lay: rs.Layout, rank: int) -> list[str]:
    return [f"{p.offsets[0]}:{p.offsets[0] + p.sizes[0]}" for p in lay.pieces(rank)]


def test_placements_docstring_table():
    """The table in reshard/placements.py: 10 rows over 4 ranks, Shard(0)."""
    spec = rs.TensorSpec("w", (10,), torch.float32)
    table = {"chunk": ["0:3", "3:6", "6:9", "9:10"], "balanced": ["0:3", "3:6", "6:8", "8:10"]}
    for split, want in table.items():
        lay = rs.Layout.from_placements(spec, [0, 1, 2, 3], (4,), [rs.Shard(0)], split)
        assert [rows(lay, r) for r in range(4)] == [[w] for w in want]
    with pytest.raises(rs.LayoutError, match="10 does not divide evenly into 4"):
        rs.Layout.from_placements(spec, [0, 1, 2, 3], (4,), [rs.Shard(0)], "even")


def test_placements_docstring_strided_example():
    """StridedShard(0, split_factor=2) over 2 ranks, 8 rows: rank 0 holds 0:2 and 4:6 (two pieces)."""
    spec = rs.TensorSpec("w", (8,), torch.float32)
    lay = rs.Layout.from_placements(spec, [0, 1], (2,), [rs.StridedShard(0, 2)])
    assert rows(lay, 0) == ["0:2", "4:6"]
    assert rows(lay, 1) == ["2:4", "6:8"]
    assert [p.buffer_offsets for p in lay.pieces(0)] == [(0,), (2,)]
    check_against_torch((8,), (2,), [rs.StridedShard(0, 2)], [0, 1])


def test_fsdp_over_tp_example():
    """FSDP2 over TP: mesh (dp=2, tp=2), [StridedShard(0, 2), Shard(0)], 8 rows: TP splits first."""
    spec = rs.TensorSpec("w", (8, 3), torch.float32)
    lay = rs.Layout.from_placements(spec, [0, 1, 2, 3], (2, 2), [rs.StridedShard(0, 2), rs.Shard(0)])
    assert [rows(lay, r) for r in range(4)] == [["0:2"], ["4:6"], ["2:4"], ["6:8"]]
    check_against_torch((8, 3), (2, 2), [rs.StridedShard(0, 2), rs.Shard(0)], [0, 1, 2, 3])


def test_placement_reprs():
    assert repr(rs.Shard(0)) == "Shard(dim=0)"
    assert repr(rs.Replicate()) == "Replicate()"
    assert repr(rs.StridedShard(1, 3)) == "StridedShard(dim=1, split_factor=3)"


def test_from_torch_placement():
    assert from_torch_placement(TShard(1)) == rs.Shard(1)
    assert from_torch_placement(TReplicate()) == rs.Replicate()
    assert from_torch_placement(_StridedShard(0, split_factor=3)) == rs.StridedShard(0, 3)


NAMES, DTYPES = ["a", "a@raw/0", "b", "b@raw/1", "c", "d"], [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
buffer_maps = st.dictionaries(st.sampled_from(NAMES), st.sampled_from(DTYPES), max_size=6)


@settings(max_examples=200, deadline=None)
@given(base=st.lists(buffer_maps, min_size=1, max_size=2), extras=st.lists(buffer_maps, min_size=1, max_size=4))
def test_overlaid_rank_buffers_give_the_dtypes_of_plain_copies(base, extras):
    """Ranks whose buffers are a shared base plus their own staging (:meth:`RankBuffers.overlay`, which keeps
    the parts where no name is in both) agree on each name's dtype exactly where plain copies do, and give a
    plan's fingerprint the digest of plain copies (in any order); a changed buffer changes it."""
    from reshard.layout import RankBuffers

    def descs(named):
        return {name: ((len(name),), dtype) for name, dtype in named.items()}

    shared = [RankBuffers(descs(b)) for b in base]
    overlaid = {r: RankBuffers.overlay(shared[r % len(shared)], descs(e)) for r, e in enumerate(extras)}
    plain = {r: {**descs(base[r % len(base)]), **descs(e)} for r, e in enumerate(extras)}
    assert {r: dict(b) for r, b in overlaid.items()} == plain
    got, want = rs.Layout({}, {}, overlaid)._dtype_by_name(), rs.Layout({}, {}, plain)._dtype_by_name()
    assert got == want
    for r, held in overlaid.items():
        digest = held.digest()
        assert digest == RankBuffers(dict(reversed(plain[r].items()))).digest()
        if plain[r]:
            name = next(iter(plain[r]))
            changed = {**plain[r], name: ((len(name) + 1,), plain[r][name][1])}
            assert RankBuffers(changed).digest() != digest


def test_common_itemsize_of_pieces_in_buffers_of_several_names():
    """A tensor whose pieces live in staging numbered per rank (``w@raw/0``, ``w@raw/1``) has one element
    size and dtype where those buffers agree on a dtype, and none where they do not; the dtypes found from
    the names are those of each piece's buffer."""
    spec = rs.TensorSpec("w", (4, 2), torch.float32)
    pieces = [rs.Piece("w", (0, 0), (2, 2), "w@raw/0", (0, 0), 0), rs.Piece("w", (2, 0), (2, 2), "w@raw/1", (0, 0), 0)]
    for second, size in ((torch.bfloat16, 2), (torch.float32, None)):
        buffers = {0: {"w@raw/0": ((2, 2), torch.bfloat16), "w@raw/1": ((2, 2), second)}}
        lay = rs.Layout.from_pieces([spec], pieces, buffers)
        assert lay.common_itemsize(["w"]) == lay.buffer_itemsize("w") == size
        found, per_piece = lay.buffer_dtypes("w"), [torch.bfloat16, second]
        assert list(found.per_piece) == per_piece and found.itemsizes.tolist() == [d.itemsize for d in per_piece]
        assert found.uniform == lay.uniform_dtype("w") == (torch.bfloat16 if size else None)
