"""Every validation error: raised as ``rs.LayoutError`` (a ``ValueError``) before any byte moves,
with a message that names the tensor and, where there is one, the rank and the box."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard import Piece
from reshard.layout_checks import _passes_at_once, check_each, check_layout
from reshard.piece_table import PieceTable
from reshard.tensors import box_str
from strategies import layout_pairs

W = rs.TensorSpec("w", (10, 6), torch.float32)


def raises(*parts: str):
    """pytest.raises(LayoutError) whose message contains every part, in order."""
    return pytest.raises(rs.LayoutError, match=".*".join(re.escape(p) for p in parts))


def replicated(spec=W, ranks=(0,), **kw) -> rs.Layout:
    return rs.Layout.from_placements(spec, list(ranks), (len(ranks),), [rs.Replicate()], **kw)


def test_layout_error_is_a_value_error():
    assert issubclass(rs.LayoutError, ValueError)


def test_box_str_format():
    assert box_str((8, 0), (2, 6)) == "[8:10, 0:6]"
    assert box_str((3,), (0,)) == "[3:3]"
    assert box_str((), ()) == "[]"


# ---------------------------------------------------------------------------- one layout
@pytest.mark.parametrize("offsets, sizes, box", [
    ((8, 0), (4, 6), "[8:12, 0:6]"),  # past the end
    ((-1, 0), (4, 6), "[-1:3, 0:6]"),  # negative offset
    ((0, 5), (10, 2), "[0:10, 5:7]"),  # second dim
    ((0, 0), (-1, 6), "[0:-1, 0:6]"),  # negative size
])
def test_box_outside_its_tensor(offsets, sizes, box):
    with raises("tensor 'w'", "rank 3", f"box {box}", "outside", "(10, 6)"):
        rs.Layout.from_pieces([W], [Piece("w", offsets, sizes, "b", (0, 0), 3)])


def test_piece_does_not_fit_its_buffer():
    with raises("tensor 'w'", "rank 3", "box [0:4, 0:6]", "does not fit buffer 'b'", "(3, 6)"):
        rs.Layout.from_pieces([W], [Piece("w", (0, 0), (4, 6), "b", (0, 0), 3)], {3: {"b": ((3, 6), torch.float32)}})


def test_piece_at_an_offset_past_its_buffer():
    with raises("tensor 'w'", "rank 1", "box [0:2, 0:6]", "(3, 0)", "does not fit buffer 'b'", "(4, 6)"):
        rs.Layout.from_pieces([W], [Piece("w", (0, 0), (2, 6), "b", (3, 0), 1)], {1: {"b": ((4, 6), torch.float32)}})


def test_piece_at_a_negative_buffer_offset():
    with raises("tensor 'w'", "rank 1", "box [0:2, 0:6]", "(-1, 0)", "does not fit buffer 'b'"):
        rs.Layout.from_pieces([W], [Piece("w", (0, 0), (2, 6), "b", (-1, 0), 1)], {1: {"b": ((4, 6), torch.float32)}})


def test_expert_index_past_a_3d_buffer():
    e = rs.TensorSpec("e", (2, 3), torch.float32)
    with raises("tensor 'e'", "rank 0", "box [0:2, 0:3]", "(2, 0, 0)", "does not fit buffer 'experts'", "(2, 2, 3)"):
        rs.Layout.from_pieces([e], [Piece("e", (0, 0), (2, 3), "experts", (2, 0, 0), 0)],
                              {0: {"experts": ((2, 2, 3), torch.float32)}})


def test_buffer_with_fewer_dims_than_the_piece_offsets():
    with raises("tensor 'w'", "rank 3", "buffer 'b'", "1 dims"):
        rs.Layout.from_pieces([W], [Piece("w", (0, 0), (4, 6), "b", (0, 0), 3)], {3: {"b": ((24,), torch.float32)}})


def test_two_pieces_overlapping_in_one_buffer():
    pieces = [Piece("w", (0, 0), (4, 6), "b", (0, 0), 3), Piece("w", (4, 0), (4, 6), "b", (2, 0), 3)]
    with raises("rank 3", "buffer 'b'", "'w'", "box [0:4, 0:6]", "'w'", "box [4:8, 0:6]", "(2, 0)"):
        rs.Layout.from_pieces([W], pieces)


def test_pieces_of_two_tensors_overlapping_in_a_fused_buffer():
    q = rs.TensorSpec("q", (4, 6), torch.float32)
    k = rs.TensorSpec("k", (2, 6), torch.float32)
    pieces = [Piece("q", (0, 0), (4, 6), "qkv", (0, 0), 0), Piece("k", (0, 0), (2, 6), "qkv", (3, 0), 0)]
    with raises("rank 0", "buffer 'qkv'", "'q'", "box [0:4, 0:6]", "'k'", "box [0:2, 0:6]"):
        rs.Layout.from_pieces([q, k], pieces, {0: {"qkv": ((8, 6), torch.float32)}})


def test_pieces_side_by_side_in_a_fused_buffer_are_fine():
    q = rs.TensorSpec("q", (4, 6), torch.float32)
    k = rs.TensorSpec("k", (2, 6), torch.float32)
    pieces = [Piece("q", (0, 0), (4, 6), "qkv", (0, 0), 0), Piece("k", (0, 0), (2, 6), "qkv", (4, 0), 0)]
    lay = rs.Layout.from_pieces([q, k], pieces)
    assert lay.buffers(0) == {"qkv": ((6, 6), torch.float32)}


def test_overlap_found_by_merge():
    v = rs.TensorSpec("v", (10, 6), torch.float32)
    with raises("rank 0", "buffer 'w'", "'w'", "box [0:10, 0:6]", "'v'", "box [0:10, 0:6]"):
        rs.Layout.merge([replicated(W), replicated(v, buffer="w")])


def test_buffer_of_another_dtype_class():
    with raises("tensor 'w'", "rank 3", "buffer 'b'", "torch.int32", "torch.float32"):
        rs.Layout.from_pieces([W], [Piece("w", (0, 0), (4, 6), "b", (0, 0), 3)], {3: {"b": ((4, 6), torch.int32)}})
    with raises("tensor 'w'", "rank 0", "torch.int64"):
        replicated(W, dtype=torch.int64)


def test_box_with_the_wrong_number_of_dims():
    with raises("tensor 'w'", "rank 3", "box [0:4]", "1 dims", "2"):
        rs.Layout.from_pieces([W], [Piece("w", (0,), (4,), "b", (0,), 3)])


def test_buffer_offsets_with_fewer_dims_than_the_tensor():
    with raises("tensor 'w'", "rank 3", "buffer 'b'", "fewer dims"):
        rs.Layout.from_pieces([W], [Piece("w", (0, 0), (4, 6), "b", (0,), 3)])


def test_pieces_disagree_on_a_buffer_number_of_dims():
    pieces = [Piece("w", (0, 0), (4, 6), "b", (0, 0), 3), Piece("w", (4, 0), (4, 6), "b", (1, 0, 0), 3)]
    with raises("rank 3", "buffer 'b'", "dims"):
        rs.Layout.from_pieces([W], pieces)


def test_negative_shape():
    with raises("tensor 'w'", "(-1, 2)"):
        rs.TensorSpec("w", (-1, 2), torch.float32)


# ---------------------------------------------------------------------------- names and specs
def test_piece_naming_a_tensor_without_a_spec():
    with raises("unknown tensor 'x'", "rank 3", "box [0:4, 0:6]", "buffer 'b'"):
        rs.Layout.from_pieces([W], [Piece("x", (0, 0), (4, 6), "b", (0, 0), 3)])


def test_destination_tensor_absent_from_the_source():
    v = rs.TensorSpec("v", (10, 6), torch.float32)
    with raises("unknown tensor 'w'", "destination rank 4", "source"):
        rs.plan(replicated(v), replicated(W, ranks=(4,)))


def test_source_tensor_absent_from_the_destination_is_fine():
    v = rs.TensorSpec("v", (10, 6), torch.float32)
    src = rs.Layout.merge([replicated(v, buffer="v"), replicated(W)])
    assert rs.plan(src, replicated(W, ranks=(4,))).tensors == ["w"]


def test_tensor_declared_twice_with_different_specs():
    with raises("tensor 'w'", "declared twice"):
        rs.Layout.from_pieces([W, rs.TensorSpec("w", (10, 7), torch.float32)], [])


def test_merged_layouts_disagree_on_a_spec():
    with raises("tensor 'w'", "(10, 6)", "(10, 7)"):
        rs.Layout.merge([replicated(W), replicated(rs.TensorSpec("w", (10, 7), torch.float32), ranks=(1,))])


def test_merged_layouts_disagree_on_a_buffer():
    v = rs.TensorSpec("v", (3,), torch.float32)
    with raises("rank 0", "buffer 'w'"):
        rs.Layout.merge([replicated(W), replicated(v, buffer="w")])


# ---------------------------------------------------------------------------- source vs destination
def test_source_and_destination_disagree_on_shape():
    src = replicated(rs.TensorSpec("w", (10, 7), torch.float32))
    with raises("tensor 'w'", "(10, 7)", "(10, 6)"):
        rs.plan(src, replicated(W, ranks=(4,)))


@pytest.mark.parametrize("src_dtype, dst_dtype", [
    (torch.int32, torch.float32), (torch.float32, torch.int64), (torch.bool, torch.int8),
    (torch.complex64, torch.float32),
])
def test_source_and_destination_disagree_on_dtype_class(src_dtype, dst_dtype):
    src = replicated(rs.TensorSpec("w", (10, 6), src_dtype))
    dst = replicated(rs.TensorSpec("w", (10, 6), dst_dtype), ranks=(4,))
    with raises("tensor 'w'", str(src_dtype), str(dst_dtype), "class"):
        rs.plan(src, dst)


def test_same_dtype_class_is_a_cast_not_an_error():
    src = replicated(rs.TensorSpec("w", (10, 6), torch.float32))
    dst = replicated(rs.TensorSpec("w", (10, 6), torch.bfloat16), ranks=(4,))
    assert rs.plan(src, dst).wire_bytes == 60 * 2


def test_destination_element_no_source_holds():
    src = rs.Layout.from_pieces([W], [Piece("w", (0, 0), (8, 6), "w", (0, 0), 0)])
    dst = rs.Layout.from_placements(W, [4, 5], (2,), [rs.Shard(0)])
    msg = ("tensor 'w' rank 5: destination box [5:10, 0:6] is not fully held by any source; "
           "uncovered: [8:10, 0:6]")
    with pytest.raises(rs.LayoutError, match=re.escape(msg)):
        rs.plan(src, dst)


def test_uncovered_lists_the_first_boxes():
    src = rs.Layout.from_pieces([W], [Piece("w", (0, 0), (8, 3), "w", (0, 0), 0)])
    with raises("tensor 'w' rank 4", "destination box [0:10, 0:6]",
                "uncovered: [0:8, 3:6], [8:10, 0:3], [8:10, 3:6]"):
        rs.plan(src, replicated(W, ranks=(4,)))


def test_uncovered_with_no_source_piece_at_all():
    empty = rs.Layout.from_pieces([W], [])
    with raises("tensor 'w' rank 4", "destination box [0:10, 0:6]", "uncovered: [0:10, 0:6]"):
        rs.plan(empty, replicated(W, ranks=(4,)))


def test_uncovered_hole_between_overlapping_sources():
    src = rs.Layout.merge([
        rs.Layout.from_pieces([W], [Piece("w", (0, 0), (4, 6), "a", (0, 0), 0)]),
        rs.Layout.from_pieces([W], [Piece("w", (2, 0), (4, 6), "b", (0, 0), 1)]),  # overlaps rows 2:4
        rs.Layout.from_pieces([W], [Piece("w", (7, 0), (3, 6), "c", (0, 0), 2)]),
    ])
    with raises("tensor 'w' rank 4", "uncovered: [6:7, 0:6]"):
        rs.plan(src, replicated(W, ranks=(4,)))


# ---------------------------------------------------------------------------- placements
def test_even_split_that_does_not_divide():
    with raises("tensor 'w'", "dim 0", "mesh dim 0", "10", "4", "even"):
        rs.Layout.from_placements(W, [0, 1, 2, 3], (4,), [rs.Shard(0)], split="even")


def test_even_split_that_does_not_divide_on_a_later_mesh_dim():
    # 6 columns: 2 per rank after mesh dim 0, then 2 do not divide into 4 on mesh dim 1
    with raises("tensor 'w'", "dim 1", "mesh dim 1", "2", "4", "even"):
        rs.Layout.from_placements(W, list(range(12)), (3, 4), [rs.Shard(1), rs.Shard(1)], split="even")


def test_even_strided_split_that_does_not_divide():
    with raises("tensor 'w'", "dim 0", "even"):
        rs.Layout.from_placements(W, [0, 1], (2,), [rs.StridedShard(0, 3)], split="even")


def test_unknown_split_rule():
    with raises("'w'", "'foo'", "chunk"):
        rs.Layout.from_placements(W, [0, 1], (2,), [rs.Shard(0)], split="foo")


@pytest.mark.parametrize("ranks, mesh", [([0, 1, 2], (2, 2)), ([0, 1, 2, 3, 4], (4,)), ([], (1,))])
def test_wrong_number_of_ranks_for_the_mesh(ranks, mesh):
    with raises("tensor 'w'", f"{len(ranks)} ranks", str(mesh)):
        rs.Layout.from_placements(W, ranks, mesh, [rs.Replicate()] * len(mesh))


def test_repeated_rank():
    with raises("tensor 'w'", "[0, 0]"):
        rs.Layout.from_placements(W, [0, 0], (2,), [rs.Shard(0)])


def test_number_of_placements_differs_from_the_mesh():
    with raises("tensor 'w'", "2 placements", "1-dim mesh"):
        rs.Layout.from_placements(W, [0, 1], (2,), [rs.Shard(0), rs.Shard(1)])


@pytest.mark.parametrize("placement", [rs.Shard(2), rs.Shard(-1), rs.StridedShard(5, 2), rs.StridedShard(-1, 1)])
def test_placement_dim_out_of_range(placement):
    with raises("tensor 'w'", repr(placement), "2 dims"):
        rs.Layout.from_placements(W, [0, 1], (2,), [placement])


def test_strided_shard_split_factor_below_one():
    with raises("tensor 'w'", "split_factor=0", ">= 1"):
        rs.Layout.from_placements(W, [0, 1], (2,), [rs.StridedShard(0, 0)])


def test_unsupported_placement():
    with raises("tensor 'w'", "unsupported placement"):
        rs.Layout.from_placements(W, [0, 1], (2,), ["Shard(0)"])


def test_partial_dtensor_placement_is_rejected():
    from torch.distributed.tensor import Partial

    from reshard.placements import from_torch_placement

    with raises("Partial"):
        from_torch_placement(Partial())


def test_split_into_no_parts():
    with raises("cannot split into 0 parts"):
        rs.split_sizes(4, 0, "chunk")


# ---------------------------------------------------------------------------- plan options and execution
def test_max_bucket_bytes_too_small():
    with pytest.raises(ValueError, match="max_bucket_bytes=15 is smaller than 16 bytes"):
        rs.plan(replicated(W), replicated(W, ranks=(1,)), max_bucket_bytes=15)
    # two rounds are in flight: each gets half the cap, and needs one aligned element per message
    with pytest.raises(ValueError, match=r"max_bucket_bytes=63 is too small for this plan: rank 0 exchanges 2 "
                                         r"messages per round, which needs at least 64 bytes \(two rounds in flight\)"):
        rs.plan(replicated(W), replicated(W, ranks=(1, 2)), max_bucket_bytes=63)
    assert rs.plan(replicated(W), replicated(W, ranks=(1, 2)), max_bucket_bytes=64).num_rounds > 1


def test_run_local_with_a_missing_buffer():
    plan = rs.plan(replicated(W), replicated(W, ranks=(1,)))
    with raises("rank 0", "source buffer 'w'"):
        rs.run_local(plan, {0: {}}, {1: {"w": torch.zeros(10, 6)}})
    with raises("rank 1", "destination buffer 'w'"):
        rs.run_local(plan, {0: {"w": torch.zeros(10, 6)}}, {1: {}})


def test_materialize_without_the_full_tensor():
    with raises("'w'", "rank 0"):
        replicated(W).materialize(0, {})


def test_unknown_buffer():
    with raises("rank 0", "'nope'"):
        replicated(W).buffer_spec(0, "nope")


def test_overlap_found_between_pieces_that_are_not_neighbours_in_a_3d_buffer():
    """The vectorized check compares every pair whose first-dim ranges meet, not just sort neighbours."""
    specs = [rs.TensorSpec(f"e{i}", (2, 4), torch.float32) for i in range(3)]
    pieces = [
        rs.Piece("e0", (0, 0), (2, 4), "w13", (0, 0, 0), 0),
        rs.Piece("e1", (0, 0), (2, 4), "w13", (0, 4, 0), 0),
        rs.Piece("e2", (0, 0), (2, 4), "w13", (0, 1, 0), 0),  # rows 1:3 of slot 0 overlap e0
    ]
    with pytest.raises(rs.LayoutError, match=r"rank 0 buffer 'w13': piece of 'e\d' box \[0:2, 0:4\] at \(0, [01], 0\) "
                                             r"overlaps piece of 'e\d'"):
        rs.Layout.from_pieces(specs, pieces, {0: {"w13": ((1, 8, 4), torch.float32)}})
    later = pieces[:2] + [rs.Piece("e2", (0, 0), (2, 4), "w13", (0, 5, 0), 0)]  # rows 5:7 overlap e1's 4:6
    with pytest.raises(rs.LayoutError, match="overlaps"):
        rs.Layout.from_pieces(specs, later, {0: {"w13": ((1, 8, 4), torch.float32)}})
    disjoint = [rs.Piece(f"e{i}", (0, 0), (2, 4), "w13", (0, 2 * i + (2 if i == 2 else 0), 0), 0) for i in range(3)]
    rs.Layout.from_pieces(specs, disjoint, {0: {"w13": ((1, 8, 4), torch.float32)}})


FAULTS = ("none", "box offset", "buffer offset", "rank", "buffer shape", "buffer dropped", "buffer dtype", "buffer dims",
          "piece twice", "spec dropped")


def _with_row(table, row: int, **changes):
    """``table`` with piece ``row`` changed (rank, box or buffer offsets moved: (dim, delta)) or appended twice."""
    ranks, offsets, boffs = table.ranks.copy(), table.offsets.copy(), table.buffer_offsets.copy()
    if "rank" in changes:
        ranks[row] = changes["rank"]
    if "shift" in changes:
        dim, delta = changes["shift"]
        boffs[row, dim] += delta
    if "move" in changes:
        dim, delta = changes["move"]
        offsets[row, dim] += delta
    if changes.get("twice"):
        idx = np.concatenate([np.arange(len(table)), [row]])
        return PieceTable(table.ranks[idx], table.offsets[idx], table.sizes[idx],
                          tuple(table.buffers) + (table.buffers[row],), table.buffer_offsets[idx])
    return PieceTable(ranks, offsets, table.sizes, table.buffers, boffs)


@settings(max_examples=200, deadline=None)
@given(case=layout_pairs(), side=st.sampled_from(("source", "destination")), fault=st.sampled_from(FAULTS),
       data=st.data())
def test_validation_at_once_finds_every_fault_the_tensor_by_tensor_check_names(case, side, fault, data):
    """``check_layout`` looks at all pieces at once and, where anything may be wrong, tensor by tensor: on
    random layouts with one random fault each it raises what the tensor-by-tensor check raises (the
    same first fault, the same words), and a layout with no fault passes without the second look."""
    layout = case.source if side == "source" else case.destination
    specs, tables = dict(layout.specs), dict(layout.tables)
    buffers = {r: dict(layout.buffers(r)) for r in layout.ranks}
    held = [name for name, t in tables.items() if len(t)]
    assume(held)
    name = data.draw(st.sampled_from(held))
    table = tables[name]
    row = data.draw(st.integers(0, len(table) - 1))
    rank, buffer = int(table.ranks[row]), table.buffers[row]
    shape, dtype = buffers[rank][buffer]
    if fault == "buffer offset":
        tables[name] = _with_row(table, row, shift=(data.draw(st.integers(0, table.buffer_offsets.shape[1] - 1)),
                                                    data.draw(st.integers(-3, 3))))
    elif fault == "box offset" and table.offsets.shape[1]:
        tables[name] = _with_row(table, row, move=(data.draw(st.integers(0, table.offsets.shape[1] - 1)),
                                                   data.draw(st.integers(-3, 3))))
    elif fault == "rank":
        tables[name] = _with_row(table, row, rank=data.draw(st.integers(-1, max(buffers) + 1)))
    elif fault == "piece twice":
        tables[name] = _with_row(table, row, twice=True)
    elif fault == "buffer shape" and shape:
        dim = data.draw(st.integers(0, len(shape) - 1))
        bent = list(shape)
        bent[dim] = max(bent[dim] + data.draw(st.integers(-3, 3)), 0)
        buffers[rank][buffer] = (tuple(bent), dtype)
    elif fault == "buffer dropped":
        del buffers[rank][buffer]
    elif fault == "buffer dtype":
        buffers[rank][buffer] = (shape, data.draw(st.sampled_from((torch.int32, torch.bool, torch.bfloat16))))
    elif fault == "buffer dims":
        buffers[rank][buffer] = ((1,) + tuple(shape) if data.draw(st.booleans()) or not shape else shape[1:], dtype)
    elif fault == "spec dropped":
        del specs[name]

    def outcome(check) -> str | None:
        try:
            check(specs, tables, buffers)
        except rs.LayoutError as e:
            return str(e)
        return None

    expected = outcome(check_each)
    assert outcome(check_layout) == expected
    if fault == "none":
        assert expected is None and _passes_at_once(specs, tables, buffers)
