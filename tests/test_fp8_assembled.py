"""Issue 23 §4: FSDP blocks assembled before they cross.

Where no source rank holds a whole block but the source ranks of one domain hold it together, they
hand its rows to one of them first (a local phase, inside the domain); that rank quantizes and sends
FP8 plus scales. The engine's bytes stay bit-equal to the reference quantizer on the full tensor,
whichever of the three paths (source, assembled, destination) each block took."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.execution.precision import PrecisionExecutor, run_local_precision
from reshard.execution.process_group import free_port
from reshard.planning.precision import (ASSEMBLED, DESTINATION, SOURCE, DtypePolicy, FP8Block, PrecisionPlan)
from reshard.quant import quantize_blocks, quantize_mx

BF16, F32 = torch.bfloat16, torch.float32


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def _reference(plan: PrecisionPlan, full: dict) -> dict[str, torch.Tensor]:
    ref = dict(full)
    for name, info in plan.fp8.items():
        if info.precision.mx:
            q, s = quantize_mx(full[name])
        else:
            q, s = quantize_blocks(full[name], info.block, info.precision.ue8m0)
        ref[name], ref[info.precision.scale_name(name)] = q, s
    return ref


def _check(plan: PrecisionPlan, out: dict, full: dict) -> None:
    ref = _reference(plan, full)
    for r in plan.destination.ranks:
        for p in plan.destination.pieces(r):
            got = rs.tensors.buffer_view(out[r][p.buffer], p.buffer_offsets, p.sizes)
            want = ref[p.tensor][rs.tensors.box_slices(p.offsets, p.sizes)]
            assert same_bits(got, want), (r, p)


def _expected_paths(src: rs.Layout, name: str, shape, block, domain_of) -> np.ndarray:
    """Each block's path from first principles: SOURCE if one piece holds it whole; else ASSEMBLED if the
    pieces of one domain cover every element of its block row (within the rows the block spans, over the
    columns of the uncovered run); else DESTINATION. Here every uncovered run spans all columns (the
    strategies keep source pieces at full width, as FSDP does), so a block row is the block's rows x all
    columns."""
    bn, bk = block
    rows, cols = shape
    gr, gc = -(-rows // bn), -(-cols // bk)
    out = np.full((gr, gc), DESTINATION, np.int8)
    pieces = [p for p in src.all_pieces() if p.tensor == name]
    for i in range(gr):
        r0, r1 = i * bn, min((i + 1) * bn, rows)
        for j in range(gc):
            c0, c1 = j * bk, min((j + 1) * bk, cols)
            if any(p.offsets[0] <= r0 and r1 <= p.offsets[0] + p.sizes[0] and p.offsets[1] <= c0
                   and c1 <= p.offsets[1] + p.sizes[1] for p in pieces):
                out[i, j] = SOURCE
        if (out[i] == SOURCE).all():
            continue
        for d in sorted(set(domain_of.values())):
            held = np.zeros(r1 - r0, bool)
            for p in pieces:
                if domain_of.get(p.rank) == d:
                    lo, hi = max(p.offsets[0], r0), min(p.offsets[0] + p.sizes[0], r1)
                    if hi > lo:
                        held[lo - r0:hi - r0] = True
            if held.all():
                out[i][out[i] != SOURCE] = ASSEMBLED
                break
    return out


@st.composite
def fsdp_cases(draw):
    bn, bk = draw(st.integers(2, 6)), draw(st.integers(1, 5))
    rows, cols = draw(st.integers(1, 6 * bn + 2)), draw(st.integers(1, 3 * bk + 2))
    w = rs.TensorSpec("mlp.up_proj.weight", (rows, cols), draw(st.sampled_from([BF16, F32])))
    keep = rs.TensorSpec("norm.weight", (3,), BF16)
    # FSDP-like: row pieces at any row on ranks 0..5, some replicated (HSDP) on a second rank
    cuts = sorted(draw(st.lists(st.integers(1, max(rows - 1, 1)), max_size=6, unique=True))) if rows > 1 else []
    bounds = [0] + [c for c in cuts if 0 < c < rows] + [rows]
    pieces = []
    for i in range(len(bounds) - 1):
        for r in draw(st.lists(st.integers(0, 5), min_size=1, max_size=2, unique=True)):
            pieces.append(rs.Piece(w.name, (bounds[i], 0), (bounds[i + 1] - bounds[i], cols), f"w{i}", (0, 0), r))
    src = rs.Layout.merge([rs.Layout.from_pieces([w], pieces),
                           rs.Layout.from_placements(keep, [0, 1], (2,), [rs.Shard(0)])])
    # destination: TP by rows or columns at block boundaries on ranks 6..8
    dim = draw(st.integers(0, 1))
    n, step = (rows, bn) if dim == 0 else (cols, bk)
    inner = list(range(step, n, step))
    dcuts = [0] + sorted(draw(st.lists(st.sampled_from(inner), max_size=2, unique=True)) if inner else []) + [n]
    dpieces = []
    for i in range(len(dcuts) - 1):
        off = (dcuts[i], 0) if dim == 0 else (0, dcuts[i])
        size = (dcuts[i + 1] - dcuts[i], cols) if dim == 0 else (rows, dcuts[i + 1] - dcuts[i])
        for r in draw(st.lists(st.integers(6, 8), min_size=1, max_size=2, unique=True)):
            dpieces.append(rs.Piece(w.name, off, size, f"d{i}", (0, 0), r))
    dst = rs.Layout.merge([rs.Layout.from_pieces([w], dpieces),
                           rs.Layout.from_placements(keep, [6, 7], (2,), [rs.Replicate()])])
    size = draw(st.sampled_from([2, 3, 6]))
    domain_of = {r: r // size for r in range(6)}
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    full = {s.name: (torch.randn(s.shape, generator=g) * 10 ** torch.randint(-3, 4, s.shape, generator=g)).to(s.dtype)
            for s in (w, keep)}
    policy = DtypePolicy(rules=(("up_proj", FP8Block((bn, bk), draw(st.booleans()))),))
    bucket = draw(st.sampled_from([None, 4096]))
    return src, dst, policy, domain_of, bucket, full


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fsdp_cases(), st.booleans())
def test_assembled_refit_equals_the_reference_bit_for_bit(case, hierarchical):
    src, dst, policy, domain_of, bucket, full = case
    domains = {**domain_of, 6: 10, 7: 10, 8: 11} if hierarchical else None
    plan = PrecisionPlan(src, dst, policy, max_bucket_bytes=bucket, domains=domains, assemble=domain_of)
    out = {r: {b: torch.full(shape, -3.0).to(dt) for b, (shape, dt) in plan.destination.buffers(r).items()}
           for r in plan.destination.ranks}
    run_local_precision(plan, {r: src.materialize(r, full) for r in src.ranks}, out)
    _check(plan, out, full)
    name = "mlp.up_proj.weight"
    info = plan.fp8[name]
    want = _expected_paths(src, name, full[name].shape, info.block, domain_of)
    assert (plan.block_paths(name) == want).all(), (plan.block_paths(name), want)
    counts = plan.tensor_paths()[name]
    assert counts["source"] + counts["assembled"] + counts["destination"] == counts["blocks"]
    # the local phase stays inside domains, and assembled blocks cross as FP8, never raw
    assert plan.assembly_cross_domain_bytes() == 0
    assert sum(plan.wire_bytes_by_path().values()) == plan.wire_bytes
    if counts["assembled"]:
        assert plan.assembly is not None and plan.staging_bytes()["assembly"]
    # without assembly, the same blocks cross raw: never fewer bytes on the wire with it
    plain = PrecisionPlan(src, dst, policy, max_bucket_bytes=bucket, domains=domains)
    assert plan.wire_bytes_by_path()["raw"] <= plain.wire_bytes_by_path()["raw"]
    assert (plan.block_paths(name) == SOURCE).sum() == (plain.block_paths(name) == SOURCE).sum()


def test_fsdp_over_one_domain_sends_fp8_only():
    """FSDP over 8 ranks of one domain, 1000 rows (125 a rank: only rank 7 holds a whole block row, the short
    last one [896:1000)), into a TP 2 engine by columns: every other block is assembled, the network carries
    FP8 and scales only, and each assembler's staging is a block row or two (about its own share)."""
    w = rs.TensorSpec("model.layers.0.mlp.down_proj.weight", (1000, 256), BF16)
    src = rs.Layout.from_placements(w, list(range(8)), (8,), [rs.Shard(0)])
    dst = rs.Layout.from_placements(w, [8, 9], (2,), [rs.Shard(1)])
    domain_of = {r: 0 for r in range(8)}
    plain = PrecisionPlan(src, dst, "fp8")
    plan = PrecisionPlan(src, dst, "fp8", assemble=domain_of)
    assert plain.tensor_paths()[w.name]["destination"] == 14
    assert plan.tensor_paths()[w.name] == {"blocks": 16, "source": 2, "assembled": 14, "destination": 0,
                                           "raw_bytes": 0}
    assert plan.wire_bytes_by_path() == {"fp8": 1000 * 256, "scales": 16 * 4, "raw": 0, "other": 0}
    assert plain.wire_bytes_by_path()["raw"] == 896 * 256 * 2
    staged = plan.staging_bytes()["assembly"]
    own = 125 * 256 * 2
    assert max(staged.values()) <= 2 * 128 * 256 * 2 and sum(staged.values()) == 896 * 256 * 2, staged
    assert max(staged.values()) <= 2.1 * own
    assert plan.assembly_bytes < 1000 * 256 * 2 and plan.assembly_cross_domain_bytes() == 0
    assert plan.summary()["blocks_assembled"] == 14
    # two domains of 4 (rows 0:500 | 500:1000): block row 3 [384:512) spans both and is not assembled
    plan2 = PrecisionPlan(src, dst, "fp8", assemble={r: r // 4 for r in range(8)})
    assert plan2.block_paths(w.name)[:, 0].tolist() == [ASSEMBLED] * 3 + [DESTINATION] + [ASSEMBLED] * 3 + [SOURCE]
    assert plan2.fingerprint() != plan.fingerprint() != plain.fingerprint()


def test_mxfp8_row_cuts_need_no_assembly_but_column_cuts_do():
    """MX blocks are one row: FSDP's row cuts never cut them. Column cuts do; a domain assembles those."""
    w = rs.TensorSpec("model.layers.0.mlp.down_proj.weight", (4, 96), BF16)
    src = rs.Layout.from_placements(w, [0, 1, 2, 3], (4,), [rs.Shard(1)])  # 24 columns each
    dst = rs.Layout.from_placements(w, [4], (1,), [rs.Replicate()])
    plan = PrecisionPlan(src, dst, "mxfp8", assemble={r: 0 for r in range(4)})
    assert (plan.block_paths(w.name) == ASSEMBLED).all()
    g = torch.Generator().manual_seed(1)
    full = {w.name: torch.randn(w.shape, generator=g).to(BF16)}
    out = {4: plan.destination.empty_buffers(4)}
    run_local_precision(plan, {r: src.materialize(r, full) for r in src.ranks}, out)
    _check(plan, out, full)


def test_plan_cli_reports_the_assembled_path(capsys):
    import json

    from reshard.apps.cli import main

    args = ["plan", "--model", "qwen3-8b", "--train", "fsdp:dp16", "--infer", "tp8,dp2", "--precision", "fp8",
            "--json", "--topology", "dgx-h100"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    b = out["blocks"]
    assert b["assembled"] > 0 and b["at_source"] > 0
    assert out["wire_bytes_by_precision"]["raw"] < out["bf16_wire_bytes"] / 10


# ---------------------------------------------------------------------------- multi-process (gloo)
def _gloo_assembled(rank, world, store_addr):
    """Ranks 0-3: FSDP over two domains of 2 ranks (96 rows each of 384: no rank holds a 128-row block;
    block rows 0 and 2 lie in one domain, block row 1 spans both); ranks 4-5: TP 2 by columns."""
    from datetime import timedelta

    w = rs.TensorSpec("model.layers.0.mlp.gate_proj.weight", (384, 256), BF16)
    n = rs.TensorSpec("model.layers.0.input_layernorm.weight", (256,), BF16)
    src = rs.Layout.merge(rs.Layout.from_placements(s, [0, 1, 2, 3], (4,), [rs.Shard(0)]) for s in (w, n))
    dst = rs.Layout.merge([rs.Layout.from_placements(w, [4, 5], (2,), [rs.Shard(1)]),
                           rs.Layout.from_placements(n, [4, 5], (2,), [rs.Replicate()])])
    plan = PrecisionPlan(src, dst, max_bucket_bytes=16384, assemble={0: 0, 1: 0, 2: 1, 3: 1})
    assert plan.tensor_paths()[w.name] == {"blocks": 6, "source": 0, "assembled": 4, "destination": 2,
                                           "raw_bytes": 128 * 256 * 2}
    g = torch.Generator().manual_seed(7)
    full = {s.name: torch.randn(s.shape, generator=g).to(BF16) for s in (w, n)}
    sb = src.materialize(rank, full) if rank in src.ranks else {}
    db = {k: torch.full(v[0], -1.0).to(v[1]) for k, v in plan.destination.buffers(rank).items()}
    ex = PrecisionExecutor(plan, timeout=timedelta(seconds=60))
    stats = ex.run(sb, db)
    assert [p.name for p in stats.phases] == ["assemble blocks", "quantize at source", "transfer",
                                              "quantize at destination"]
    if rank in dst.ranks:
        ref = _reference(plan, full)
        for p in plan.destination.pieces(rank):
            got = rs.tensors.buffer_view(db[p.buffer], p.buffer_offsets, p.sizes)
            assert same_bits(got, ref[p.tensor][rs.tensors.box_slices(p.offsets, p.sizes)]), (rank, p)
    ex.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_assembled_fp8_refit_over_gloo():
    rs.spawn(_gloo_assembled, 6, f"127.0.0.1:{free_port()}")


# ---------------------------------------------------------------------------- rounds under the staging cap
def _layers(n: int, ranks, shape=(384, 256)):
    """``n`` FSDP'd gate_proj weights (row pieces over ``ranks``) and a norm, into a TP 2 engine on ranks 4-5."""
    ws = [rs.TensorSpec(f"model.layers.{i}.mlp.gate_proj.weight", shape, BF16) for i in range(n)]
    norm = rs.TensorSpec("model.norm.weight", (shape[1],), BF16)
    src = rs.Layout.merge(rs.Layout.from_placements(s, list(ranks), (len(ranks),), [rs.Shard(0)]) for s in ws + [norm])
    dst = rs.Layout.merge([rs.Layout.from_placements(w, [4, 5], (2,), [rs.Shard(1)]) for w in ws]
                          + [rs.Layout.from_placements(norm, [4, 5], (2,), [rs.Replicate()])])
    g = torch.Generator().manual_seed(n)
    full = {s.name: torch.randn(s.shape, generator=g).to(BF16) for s in ws + [norm]}
    return src, dst, full


@pytest.mark.parametrize("cap", [64 << 10, 256 << 10, 1 << 20, None])
def test_assembly_rounds_keep_each_ranks_boxes_under_half_the_cap(cap):
    """The assembly runs in rounds: every round's boxes on a rank stay under half ``max_bucket_bytes`` (a box over
    it alone in its round), the rounds hold every box once, and the run stays bit-exact."""
    from reshard.planning.assembly_rounds import AssemblyRounds

    src, dst, full = _layers(6, range(4))
    plan = PrecisionPlan(src, dst, max_bucket_bytes=cap, assemble={0: 0, 1: 0, 2: 1, 3: 1})
    rounds = AssemblyRounds(plan)
    box = 128 * 256 * 2
    seen: dict[int, dict] = {}
    for i in range(len(rounds)):
        for rank, nbytes in rounds.staging_bytes(i).items():
            assert cap is None or nbytes <= max(cap // 2, box), (i, rank, nbytes)
            seen.setdefault(rank, {}).update(rounds.buffers(i, rank))
    assert seen == {r: dict(named) for r, named in plan.assembly_staging.items()}
    busiest = max(sum(int(np.prod(s)) * d.itemsize for s, d in named.values()) for named in seen.values())
    assert len(rounds) == (1 if cap is None else -(-busiest // max(cap // 2 // box * box, box)))
    assert sum(p.wire_bytes for p in rounds.plans) == plan.assembly_bytes
    out = {r: plan.destination.empty_buffers(r) for r in plan.destination.ranks}
    run_local_precision(plan, {r: src.materialize(r, full) for r in src.ranks}, out)
    _check(plan, out, full)


def _session_assembled(rank, world, store_addr):
    """Ranks 0-3: FSDP over two NVLink domains (0-1, 2-3; 96 rows a rank of 384: block rows 0 and 2 lie in one
    domain, block row 1 spans both); ranks 4-5: a TP 2 FP8 engine (domain 2). Through RefitSession: with the
    domains in the options the blocks are assembled (in rounds under max_bucket_bytes), without them they cross
    raw (unchanged); a fault while assembling fails the refit on every rank, and the next refit heals."""
    from datetime import timedelta

    import torch.distributed as dist

    from reshard.execution import faults
    from reshard.planning.precision import precision_layout
    from reshard.refit import RefitError, RefitSession, Side

    cap = 256 << 10
    src, dst, full = _layers(4, range(4))
    domains = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    engine = precision_layout(dst, "fp8").empty_buffers(rank) if rank in dst.ranks else None
    source = Side.from_layout(src, rank, src.materialize(rank, full)) if rank in src.ranks else None
    destination = Side.from_layout(dst, rank, engine) if engine is not None else None

    def check(plan, values):
        if engine is not None:
            ref = _reference(plan, values)
            for p in plan.destination.pieces(rank):
                got = rs.tensors.buffer_view(engine[p.buffer], p.buffer_offsets, p.sizes)
                assert same_bits(got, ref[p.tensor][rs.tensors.box_slices(p.offsets, p.sizes)]), (rank, p)

    def connect(**options):
        where = dict(store_addr=store_addr, rank=rank, world_size=world) if options else dict(group=dist.group.WORLD)
        return RefitSession.connect(source=source, destination=destination, timeout=timedelta(seconds=60),
                                    precision="fp8", max_bucket_bytes=cap, **where, **options)

    plain = connect()  # no domains (gloo finds none): as before, the uncovered blocks cross raw
    assert plain.method == "reshard" and plain.plan.assembly is None
    plain.refit(1)
    check(plain.plan, full)
    raw = plain.plan.wire_bytes_by_path()["raw"]
    plain.close()

    s = connect(domains=domains)  # "auto" with domains: hierarchical, and the source's domains assemble
    assert s.method == "hierarchical" and s.plan.assembly is not None
    paths = s.plan.tensor_paths()
    assert {p["assembled"] for p in paths.values()} == {4} and {p["destination"] for p in paths.values()} == {2}
    assert s.plan.wire_bytes_by_path()["raw"] == raw // 3  # block row 1 of each tensor only
    stats = s.refit(2)
    check(s.plan, full)
    names = [p.name for p in stats.run.phases]
    assert names[:2] == ["assemble blocks", "quantize at source"], names
    ex = s.executor
    assembly = stats.run.phases[0]
    # the phase's peak: a round's boxes and transfer staging, plus its tensor group's FP8 and raw staging
    assert ex.assembly_staging_bytes() <= assembly.peak_staging_bytes <= ex.staging_bytes() <= cap, (rank, assembly)
    boxes = s.plan.staging_bytes()["assembly"].get(rank, 0)
    if boxes:  # an assembler: its boxes all at once would be over half the cap; groups and rounds keep each under it
        runs = [run for run in (ex.children or [ex]) if run.rounds is not None]
        assert boxes > cap // 2 and sum(len(run.rounds) for run in runs) > 1
        assert max(run.rounds.staging_bytes(i).get(rank, 0) for run in runs for i in range(len(run.rounds))) <= cap // 2
    assert stats.run.peak_staging_bytes <= ex.staging_bytes() <= cap  # the busiest group's, all steps counted

    # a fault on an assembler while assembling: every rank raises; the engines keep version 2 or are poisoned
    twice = {n: (v * 2).to(v.dtype) for n, v in full.items()}
    if source is not None:
        for name, t in source.tensors.items():
            t.mul_(2)
    if boxes and rank == min(s.plan.assembly_staging):
        faults.arm("raise@assemble blocks")
    with pytest.raises(RefitError, match="assemble blocks"):
        s.refit(3)
    faults.arm(None)
    if engine is not None:
        assert s.version == 2 and s.state in ("poisoned", "ready"), s.state
        if s.state == "ready":
            check(s.plan, full)
    s = s.recover()
    s.refit(4)
    assert s.plan.assembly is not None and (engine is None or (s.state == "ready" and s.version == 4))
    check(s.plan, twice)
    s.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_session_assembles_fp8_blocks_in_the_domains_it_is_given():
    rs.spawn(_session_assembled, 6, f"127.0.0.1:{free_port()}")
