"""Bad input, everywhere (issue 11 §5): every entry point refuses a user's mistake with one line that
names the culprit, before any byte moves or any process is spawned, and never with a traceback.

Layouts and plans raise ``LayoutError`` / ``ValueError``; lossy casts are found by
``tensors.narrowing`` and ``tensors.cast_problem``; the command line exits with status 2 and one
error line. No test here spawns a process: ``spawn`` is replaced by a trap in the CLI tests.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

import reshard as rs
from reshard import Piece
from reshard.apps import demo
from reshard.apps.cli import cap_bytes, main, output_problem
from reshard.layout import PieceTable, Repeated
from reshard.planning.hierarchy import hierarchical_plan
from reshard.planning.schedule import check_max_bucket_bytes
from reshard.tensors import cast_problem, checked_int, narrowing

F32 = torch.float32
W = rs.TensorSpec("w", (10, 6), F32)


def raises(*parts: str, error=rs.LayoutError):
    """pytest.raises(error) whose message contains every part, in order, on one line."""
    return pytest.raises(error, match="^[^\n]*" + ".*".join(re.escape(p) for p in parts) + "[^\n]*$")


def replicated(spec=W, ranks=(0,)) -> rs.Layout:
    return rs.Layout.from_placements(spec, list(ranks), (len(ranks),), [rs.Replicate()])


# ---------------------------------------------------------------------------- tensor specs
@pytest.mark.parametrize("shape, culprit", [
    ((2.5, 3), "2.5"), ((2.0, 3), "2.0"), ((True, 3), "True"), ((np.float32(2), 3), "np.float32(2.0)"),
    ((np.float64(4), 3), "np.float64(4.0)"), (("3", 2), "'3'"), ((None, 2), "None"),
])
def test_shape_with_a_size_that_is_not_an_integer(shape, culprit):
    with raises("tensor 'w'", "not an integer", culprit):
        rs.TensorSpec("w", shape, F32)


@pytest.mark.parametrize("shape", [4, "ab", None])
def test_shape_that_is_not_a_sequence(shape):
    with raises("tensor 'w'", "shape must be a sequence of sizes", repr(shape)):
        rs.TensorSpec("w", shape, F32)


def test_integer_sizes_of_any_kind_are_fine_and_zero_is_a_size():
    assert rs.TensorSpec("w", (np.int64(3), torch.Size([2])[0]), F32).shape == (3, 2)
    assert rs.TensorSpec("w", torch.Size([4, 0]), F32).nbytes == 0
    empty = rs.TensorSpec("e", (0, 6), F32)  # a zero-size dim is supported: nothing to move
    assert rs.plan(replicated(empty), replicated(empty, ranks=(1,))).wire_bytes == 0


def test_negative_size():
    with raises("tensor 'w'", "negative size", "(3, -2)"):
        rs.TensorSpec("w", (3, -2), F32)


def test_dtype_that_is_not_a_torch_dtype():
    with raises("tensor 'w'", "torch.dtype", "'float32'"):
        rs.TensorSpec("w", (2,), "float32")


@pytest.mark.parametrize("shape, dtype, culprit", [
    ((1 << 32, 1 << 32), F32, "holds 7.38e+19 bytes of float32, more than a 64-bit byte count can hold"),
    ((1 << 62, 2), torch.int8, "more than a 64-bit byte count can hold"),  # 2**63 bytes: one past int64
    ((0, 1 << 70), F32, f"size {1 << 70} in shape"),  # no bytes, but a size no int64 holds
])
def test_shape_whose_byte_count_overflows_64_bits(shape, dtype, culprit):
    with raises("tensor 'huge'", culprit):
        rs.TensorSpec("huge", shape, dtype)
    assert rs.TensorSpec("big", ((1 << 63) - 1,), torch.int8).nbytes == (1 << 63) - 1  # the largest is fine


# ---------------------------------------------------------------------------- 0-d tensors
def test_scalar_tensors_lay_out_but_are_refused_by_the_planner_with_a_way_out():
    s = rs.TensorSpec("scale", (), F32)
    src = rs.Layout.from_placements(s, [0, 1], (2,), [rs.Replicate()])  # a layout of a scalar is fine
    dst = rs.Layout.from_pieces([s], [Piece("scale", (), (), "scale", (), 2)])
    assert dst.buffers(2) == {"scale": ((), F32)}
    with raises("tensor 'scale'", "0-d", "t.view(1)", "(1,)"):
        rs.plan(src, dst)
    with raises("tensor 'scale'", "0-d"):
        hierarchical_plan(src, dst, {0: 0, 1: 0, 2: 1})
    one = rs.TensorSpec("scale", (1,), F32)  # the way out: a 1-element view on both sides
    assert rs.plan(replicated(one, (0, 1)), replicated(one, (2,))).wire_bytes == 4


# ---------------------------------------------------------------------------- ranks and pieces
@pytest.mark.parametrize("ranks, culprit", [
    ([-1, 0], "have -1, which is negative"), ([0.0, 1], "have 0.0, which is not an integer"),
    ([True, 0], "have True, which is not an integer"), ([0, np.float32(1)], "not an integer"),
])
def test_bad_ranks_of_a_placement_layout(ranks, culprit):
    with raises("tensor 'w'", "ranks", culprit):
        rs.Layout.from_placements(W, ranks, (2,), [rs.Shard(0)])


def test_piece_on_a_negative_rank():
    with raises("tensor 'w'", "piece rank", "got -1"):
        rs.Layout.from_pieces([W], [Piece("w", (0, 0), (4, 6), "b", (0, 0), -1)])


def test_buffers_declared_on_a_negative_rank():
    with raises("buffers: rank", "got -2"):
        rs.Layout.from_pieces([W], [], {-2: {"b": ((4, 6), F32)}})


def test_layout_built_from_tables_with_a_negative_rank():
    z = np.zeros((1, 2), np.int64)
    table = PieceTable(np.array([-3]), z, np.array([[4, 6]]), Repeated("w", 1), z)
    with raises("tensor 'w' rank -3", "box [0:4, 0:6]", "negative rank"):
        rs.Layout({"w": W}, {"w": table}, {0: {"w": ((10, 6), F32)}})
    with raises("rank -1", "ranks must be >= 0"):
        rs.Layout({"w": W}, {"w": PieceTable(np.array([0]), z, np.array([[4, 6]]), Repeated("w", 1), z)},
                  {0: {"w": ((10, 6), F32)}, -1: {"x": ((1,), F32)}})


@pytest.mark.parametrize("piece, culprit", [
    (Piece("w", (0, 0.5), (4, 6), "b", (0, 0), 1), "box offsets (0, 0.5) have 0.5"),
    (Piece("w", (0, 0), (4, True), "b", (0, 0), 1), "box sizes (4, True) have True"),
    (Piece("w", (0, 0), (4, 6), "b", (1.0, 0), 1), "buffer offsets (1.0, 0) have 1.0"),
    (Piece("w", (0, 0), (4, 6), "b", (0, 0), 1.0), "piece rank must be an integer >= 0, got 1.0"),
])
def test_piece_fields_that_are_not_integers(piece, culprit):
    with raises("tensor 'w'", culprit):
        rs.Layout.from_pieces([W], [piece])


def test_numpy_integers_in_pieces_are_fine():
    p = Piece("w", (np.int64(0), 0), (np.int32(4), 6), "b", (0, np.int64(0)), np.int64(1))
    assert rs.Layout.from_pieces([W], [p]).pieces(1)[0] == Piece("w", (0, 0), (4, 6), "b", (0, 0), 1)


@pytest.mark.parametrize("desc, culprit", [
    (((2.0, 6), F32), "shape (2.0, 6) have 2.0"), (((-2, 6), F32), "shape (-2, 6) have -2, which is negative"),
    (((2, 6), "fp32"), "dtype must be a torch.dtype, got 'fp32'"),
])
def test_declared_buffer_that_is_not_a_shape_and_dtype(desc, culprit):
    with raises("rank 0 buffer 'b'", culprit):
        rs.Layout.from_pieces([W], [], {0: {"b": desc}})


@pytest.mark.parametrize("placement, culprit", [
    (rs.Shard(0.0), "needs an integer dim"), (rs.Shard(True), "needs an integer dim"),
    (rs.StridedShard(0, 1.5), "needs an integer split_factor >= 1"),
])
def test_placement_fields_that_are_not_integers(placement, culprit):
    with raises("tensor 'w'", repr(placement), culprit):
        rs.Layout.from_placements(W, [0, 1], (2,), [placement])


@pytest.mark.parametrize("mesh", [(2.0,), (0,), (True, 2)])
def test_mesh_sizes_that_are_not_positive_integers(mesh):
    with raises("tensor 'w'", "mesh dim", "positive integer"):
        rs.Layout.from_placements(W, [0, 1], mesh, [rs.Replicate()] * len(mesh))


def test_buffer_dtype_that_is_not_a_torch_dtype():
    with raises("tensor 'w'", "buffer dtype", "'bf16'"):
        rs.Layout.from_placements(W, [0], (1,), [rs.Replicate()], dtype="bf16")


@pytest.mark.parametrize("domains, culprit", [
    ({0: 0, 1: 0.5}, "rank 1 -> domain 0.5"), ({0: 0, 1: -1}, "rank 1 -> domain -1"),
    ({0: 0, -1: 0, 1: 1}, "rank -1 -> domain 0"), ([0, 1], "domains must be a mapping"),
])
def test_bad_nvlink_domains(domains, culprit):
    with raises(culprit, error=ValueError):
        rs.plan(replicated(), replicated(ranks=(1,)), domains=domains)


def test_plan_of_something_that_is_not_a_layout():
    with raises("plan", "the source must be a Layout, got dict"):
        rs.plan({}, replicated())


# ---------------------------------------------------------------------------- staging cap
@pytest.mark.parametrize("cap", [math.nan, math.inf, -math.inf, 1.5, 100.25, 0, -16, True, False, "64",
                                 np.float64("nan")])
def test_max_bucket_bytes_that_is_not_a_positive_whole_number(cap):
    with raises("max_bucket_bytes must be a positive whole number of bytes", repr(cap), error=ValueError):
        rs.plan(replicated(), replicated(ranks=(1,)), max_bucket_bytes=cap)


def test_max_bucket_bytes_of_a_whole_float_or_numpy_integer_is_its_int():
    src, dst = replicated(), replicated(ranks=(1,))
    want = rs.plan(src, dst, max_bucket_bytes=64)
    for cap in (64.0, np.int64(64), np.float32(64)):
        p = rs.plan(src, dst, max_bucket_bytes=cap)
        assert type(p.max_bucket_bytes) is int and p.fingerprint() == want.fingerprint()
    assert check_max_bucket_bytes(None) is None
    with raises("max_bucket_bytes=8 is smaller than 16 bytes", error=ValueError):
        check_max_bucket_bytes(8.0)


# ---------------------------------------------------------------------------- lossy casts
@pytest.mark.parametrize("src, dst", [
    (torch.int64, torch.int32), (torch.int64, torch.int16), (torch.int64, torch.int8), (torch.int64, torch.uint8),
    (torch.int32, torch.int16), (torch.int16, torch.int8), (torch.int8, torch.uint8), (torch.uint8, torch.int8),
    (torch.float32, torch.float16), (torch.float64, torch.float32), (torch.float64, torch.float16),
    (torch.float64, torch.bfloat16), (torch.bfloat16, torch.float16), (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2), (torch.float16, torch.float8_e4m3fn), (torch.complex128, torch.complex64),
])
def test_narrowing_casts(src, dst):
    assert narrowing(src, dst)
    assert not narrowing(dst, src) or (src, dst) in {(torch.int8, torch.uint8), (torch.uint8, torch.int8)}


@pytest.mark.parametrize("src, dst", [
    (torch.float32, torch.bfloat16), (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16), (torch.int32, torch.int64), (torch.uint8, torch.int16),
    (torch.float32, torch.float32), (torch.bool, torch.bool),
    (torch.float32, torch.int8), (torch.int64, torch.float16),  # across classes: not a cast (plans refuse them)
])
def test_casts_that_do_not_narrow(src, dst):
    assert not narrowing(src, dst)


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
def test_float_values_outside_the_destination_range(device):
    t = torch.tensor([1.0, -1.2e5, 7e4, 3.0], device=device)
    msg = cast_problem("w", t, torch.float16)
    assert msg == ("tensor 'w': 2 values outside float16's range (largest |x| 1.2e+05 > 65504); "
                   "allow lossy casts to send them anyway")
    assert cast_problem("w", t / 100, torch.float16) is None


@pytest.mark.parametrize("device", devices())
def test_float_values_that_round_to_the_largest_number_are_fine(device):
    # fp16's largest is 65504 and its step there 32: below 65520 rounds down, 65520 and up overflow
    assert cast_problem("w", torch.tensor([65519.0, -65519.0], device=device), torch.float16) is None
    assert "1 value outside float16's range" in cast_problem("w", torch.tensor([65520.0], device=device),
                                                               torch.float16)
    # bf16 -> fp16: 65536 is a bf16 number that fp16 cannot hold; 65280 is one it can
    bf = torch.tensor([65280.0, 65536.0], dtype=torch.bfloat16, device=device)
    assert "1 value outside float16's range (largest |x| 6.554e+04" in cast_problem("b", bf, torch.float16)
    assert cast_problem("w", torch.tensor([440.0], device=device), torch.float8_e4m3fn) is None
    assert "1 value outside float8_e4m3fn's range" in cast_problem(
        "w", torch.tensor([470.0], device=device), torch.float8_e4m3fn)  # torch saturates to 448: lossy


@pytest.mark.parametrize("device", devices())
def test_values_that_were_not_finite_stay_as_they_are(device):
    t = torch.tensor([math.inf, -math.inf, math.nan, 1.0], device=device)
    assert cast_problem("w", t, torch.float16) is None
    assert "1 value outside" in cast_problem("w", torch.cat([t, torch.tensor([1e6], device=device)]), torch.float16)


@pytest.mark.parametrize("device", devices())
def test_integer_values_outside_the_destination_range(device):
    t = torch.tensor([3, 300, -200, 5], device=device)
    assert cast_problem("ids", t, torch.int8) == ("tensor 'ids': 2 values outside int8's range [-128, 127] "
                                                  "(smallest -200, largest 300); allow lossy casts to send them anyway")
    assert cast_problem("ids", t, torch.int16) is None
    assert "1 value outside uint8's range [0, 255] (smallest -1" in cast_problem(
        "u", torch.tensor([-1, 5], dtype=torch.int8, device=device), torch.uint8)


def test_unsigned_sources_torch_has_few_ops_for():
    assert "1 value outside int32's range" in cast_problem("u", torch.tensor([0, 1 << 40]).to(torch.uint64),
                                                           torch.int32)
    assert "1 value outside int64's range" in cast_problem("u", torch.tensor([-1]).view(torch.uint64), torch.int64)
    assert "largest 70000" in cast_problem("u", torch.tensor([0, 70000]).to(torch.uint32), torch.uint16)
    assert cast_problem("u", torch.tensor([0, 60000]).to(torch.uint32), torch.uint16) is None


def test_fp8_sources():
    t = torch.tensor([1.0, 480.0, -30000.0]).to(torch.float8_e5m2)  # e5m2 reaches 57344, e4m3fn 448
    assert "2 values outside float8_e4m3fn's range (largest |x| 2.867e+04" in cast_problem("f", t, torch.float8_e4m3fn)
    assert cast_problem("f", t[:1], torch.float8_e4m3fn) is None


def test_complex_values_outside_the_destination_range():
    t = torch.tensor([1 + 1e5j, 2 + 0j], dtype=torch.complex64)
    assert "1 value outside float16's range" in cast_problem("c", t, torch.complex32)


def test_cast_problem_corner_cases():
    assert cast_problem("w", torch.zeros(0), torch.float16) is None
    assert cast_problem("w", torch.tensor([1e30]), torch.float32) is None  # no cast at all
    assert cast_problem("w", torch.tensor([1e30]), torch.bfloat16) is None  # bf16 has fp32's range
    assert cast_problem("m", torch.tensor([True]), torch.bool) is None
    assert cast_problem("w", torch.tensor([1.5]), torch.int8) == (
        "tensor 'w': cannot cast float32 to int8, a dtype of another class (float -> int)")


@pytest.mark.parametrize("src, dst", [(torch.float32, torch.int8), (torch.int64, torch.float16),
                                      (torch.bool, torch.uint8), (torch.complex64, torch.float32)])
def test_casts_across_classes_are_refused_by_layouts_and_plans(src, dst):
    with raises("tensor 'w'", "rank 0", "buffer 'w'", "another class"):  # a buffer of another class
        rs.Layout.from_placements(rs.TensorSpec("w", (10, 6), src), [0], (1,), [rs.Replicate()], dtype=dst)
    with raises("tensor 'w'", str(src), str(dst), "different classes"):  # two sides of different classes
        rs.plan(replicated(rs.TensorSpec("w", (10, 6), src)), replicated(rs.TensorSpec("w", (10, 6), dst), (1,)))


# ---------------------------------------------------------------------------- command line
@pytest.fixture
def no_spawn(monkeypatch):
    """The CLI tests must fail before anything is spawned: spawning raises."""
    def trap(*a, **k):
        raise AssertionError("a process was spawned")

    monkeypatch.setattr(demo, "spawn", trap)


def usage_error(capsys, argv: list[str]) -> str:
    """The one error line of an argparse-style refusal (status 2, on stderr, no traceback)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = [line for line in captured.err.splitlines() if ": error: " in line]
    assert len(lines) == 1, captured.err
    return lines[0]


PLAN = ["plan", "--model", "qwen3-8b", "--train", "tp2", "--infer", "tp2"]


@pytest.mark.parametrize("argv, culprit", [
    (["demo", "--scale", "inf"], "argument --scale: must be a finite number > 0, got 'inf'"),
    (["demo", "--scale", "nan"], "argument --scale: must be a finite number > 0, got 'nan'"),
    (["demo", "--scale", "0"], "argument --scale: must be a finite number > 0, got '0'"),
    (["demo", "--scale", "-2"], "argument --scale: must be a finite number > 0, got '-2'"),
    (["demo", "--max-bucket-mb", "nan"], ("argument --max-bucket-mb: must be a finite number >= 0 (0: no cap), "
                                          "got 'nan'")),
    (["demo", "--max-bucket-mb", "-1"], "argument --max-bucket-mb: must be a finite number >= 0"),
    (["demo", "--max-bucket-mb", "inf"], "argument --max-bucket-mb: must be a finite number >= 0"),
    (["demo", "--max-bucket-mb", "1e-9"], "--max-bucket-mb 1e-09 is 0 bytes; a staging cap needs at least 16 bytes"),
    (["demo", "--dp", "0"], "argument --dp: must be >= 1, got 0"),
    (["demo", "--dp", "2.5"], "argument --dp: must be an integer >= 1, got '2.5'"),
    (["demo", "--tp", "-1"], "argument --tp: must be >= 1, got -1"),
    (["demo", "--sources", "x"], "argument --sources/-M: must be an integer >= 1, got 'x'"),
    (["demo", "--repeat", "0"], "argument --repeat: must be >= 1, got 0"),
    (["demo", "--domain-size", "-1"], "argument --domain-size: must be >= 0, got -1"),
    (["demo", "--domain-size", "1.5"], "argument --domain-size: must be an integer >= 0, got '1.5'"),
    (PLAN + ["--max-bucket-mb", "-1"], "argument --max-bucket-mb: must be a finite number >= 0"),
    (PLAN + ["--max-bucket-mb", "nan"], "argument --max-bucket-mb: must be a finite number >= 0"),
    (PLAN + ["--max-bucket-mb", "1e-7"], "--max-bucket-mb 1e-07 is 0 bytes"),
    (["simulate", "--bucket-mb", "0"], "argument --bucket-mb: must be a finite number > 0, got '0'"),
    (["simulate", "--bucket-mb=-inf"], "argument --bucket-mb: must be a finite number > 0, got '-inf'"),
])
def test_option_out_of_range(capsys, no_spawn, argv, culprit):
    line = usage_error(capsys, argv)
    assert line.startswith(f"reshard {argv[0]}: error: ") and culprit in line


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    return f


@pytest.mark.parametrize("argv, culprit", [
    (["demo", "--json", "{dir}"], "--json '{dir}' is a folder; give a file path"),
    (["demo", "--json", "{file}/out.json"], "--json '{file}/out.json': '{file}' is a file, not a folder"),
    (["demo", "--json", "{dir}/new/"], "names a folder; give a file path"),
    (PLAN + ["--plot", "{file}"], "--plot '{file}' is a file, not a folder"),
    (PLAN + ["--plot", "{file}/sub"], "--plot '{file}/sub': '{file}' is a file, not a folder"),
    (["simulate", "--out", "{file}"], "--out '{file}' is a file, not a folder"),
    (["simulate", "--png", "{dir}"], "--png '{dir}' is a folder; give a file path"),
    (["simulate", "--json", "{file}/r.json"], "'{file}' is a file, not a folder"),
])
def test_output_path_that_cannot_be_written(capsys, no_spawn, tmp_path, a_file, argv, culprit):
    where = {"dir": str(tmp_path), "file": str(a_file)}
    line = usage_error(capsys, [a.format(**where) for a in argv])
    assert culprit.format(**where) in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_output_folder_without_write_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert "not writable" in output_problem(str(locked / "r.json"), "--json")
        assert "not writable" in output_problem(str(locked), "--out", folder=True)
    finally:
        locked.chmod(0o700)


def test_missing_output_folders_are_created_not_refused(tmp_path, a_file):
    assert output_problem(str(tmp_path / "new" / "deeper" / "r.json"), "--json") is None
    assert output_problem(str(tmp_path / "new"), "--out", folder=True) is None
    assert output_problem(str(a_file), "--json") is None  # an existing file is overwritten
    assert output_problem("", "--png") == "--png: empty path"
    assert cap_bytes(0, "--max-bucket-mb") is None and cap_bytes(1.5, "--max-bucket-mb") == 3 << 19


def demo_error(capsys, argv: list[str]) -> str:
    """A refusal after the options were read (status 2, one line, nothing spawned)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    out = (captured.out + captured.err).strip()
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    return out


def test_more_processes_than_the_machine_runs(capsys, no_spawn, monkeypatch):
    monkeypatch.setattr(demo, "machine_cpus", lambda: 2)
    out = demo_error(capsys, ["demo", "--sources", "4", "--tp", "2", "--dp", "7"])
    assert out == "reshard demo: 18 processes on a machine with 2 CPUs: at most 16 (8 per CPU); use fewer ranks"


def test_a_model_bigger_than_the_memory(capsys, no_spawn, monkeypatch):
    monkeypatch.setattr(demo, "available_memory", lambda: 4 << 30)
    out = demo_error(capsys, ["demo", "--scale", "2"])
    assert out.startswith("reshard demo: 8 processes need at least") and "GB are available" in out
    assert "--scale" in out


def test_a_model_too_big_to_list_is_refused_at_once(capsys, no_spawn):
    out = demo_error(capsys, ["demo", "--layers", str(10 ** 12)])
    assert "processes need at least" in out and "GB of memory" in out
    out = demo_error(capsys, ["demo", "--vocab", str(10 ** 20)])
    assert "tensor 'model.embed_tokens.weight'" in out and "does not fit in 64 bits" in out


def test_a_staging_cap_too_small_for_the_plan(capsys, no_spawn):
    out = demo_error(capsys, ["demo", "--layers", "1", "--vocab", "512", "--max-bucket-mb", "0.00005",
                              "--methods", "reshard,hierarchical"])
    assert "the reshard plan: max_bucket_bytes=52 is too small for this plan" in out


@pytest.mark.parametrize("train, infer, culprit", [
    ("tp2,dp100000000", "tp2", "training megatron: 200000000 ranks; at most 65536 ranks per side"),
    ("tp2", "tp2,dp100000000", "inference vllm: 200000000 ranks; at most 65536 ranks per side"),
    ("tp0", "tp2", "tp must be a positive integer, got 0"),
])
def test_parallel_sizes_out_of_range(capsys, train, infer, culprit):
    out = demo_error(capsys, ["plan", "--model", "qwen3-8b", "--train", train, "--infer", infer])
    assert out.startswith("reshard plan: ") and culprit in out


def test_a_value_error_that_reaches_main_is_one_line(capsys, monkeypatch):
    from reshard.apps import simulate

    def bad_case(case, **kw):
        raise rs.LayoutError(f"tensor 'x': something about {case.key}\nthat spans two lines")

    monkeypatch.setattr(simulate, "simulate_case", bad_case)
    assert main(["simulate", "--cases", "qwen30-h100", "--png", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "reshard simulate: error: tensor 'x': something about qwen30-h100 that spans two lines"


def test_preflight_accepts_a_good_config_and_checks_a_bad_one():
    cfg = demo.DemoConfig(model="qwen3-30b-a3b", tiny=True, train="tp1,ep2", infer="tp2", progress=False)
    lay = demo.preflight(cfg)
    assert lay.world_size == 4
    for bad, culprit in [({"max_bucket_bytes": math.nan}, "max_bucket_bytes"), ({"repeat": 0}, "repeat"),
                         ({"domain_size": -1}, "domain_size"), ({"methods": ("teleport",)}, "'teleport'"),
                         ({"seed": 1.5}, "seed"), ({"infer": "tp2,dp0"}, "dp must be a positive integer")]:
        with pytest.raises(ValueError, match=re.escape(culprit)):
            demo.preflight(replace(cfg, **bad))


def test_machine_limits():
    assert demo.machine_problem(16, 0, cpus=2, available=None) is None
    assert "17 processes on a machine with 2 CPUs" in demo.machine_problem(17, 0, cpus=2, available=None)
    assert "1 CPU:" in demo.machine_problem(9, 0, cpus=1, available=None)
    assert demo.machine_problem(4, 1 << 30, cpus=8, available=2 << 30) is None
    assert "GB are available" in demo.machine_problem(4, 2 << 30, cpus=8, available=2 << 30)


def test_checked_int():
    assert checked_int(np.int16(4), "x", minimum=1) == 4
    with raises("x must be an integer >= 1, got 4.0"):
        checked_int(4.0, "x", minimum=1)
