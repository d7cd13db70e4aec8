"""The flags of ``reshard demo``, ``reshard plan`` and ``reshard simulate``: their parsers, the argparse
types that read them, the checks run before a command starts (ranges, output paths), and the one
:class:`~reshard.options.RefitOptions` a command makes of its refit flags (:func:`refit_options`).

Each parser sets ``check`` (run by :func:`reshard.apps.cli.main` before the command) and ``parser``
(for its error line); :func:`reshard.apps.cli.build_parser` adds the command itself (``func``).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from ..errors import OptionsError
from ..models.arch import DEMO_MODEL, PRESETS, get_arch
from ..options import RefitOptions

DEFAULT_OUT = "reshard-out"
SIZES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")  # model size options

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MiB = 1 << 20


# ---------------------------------------------------------------------------------------- argparse types
def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1)


def _nonnegative(text: str) -> int:
    return _integer(text, 0)


def _number(text: str, *, zero: bool, what: str) -> float:
    """A finite float > 0 (>= 0 with ``zero``), for an argparse option."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>= 0' if zero else '> 0'}{what}, got {text!r}")
    return value


def _positive_number(text: str) -> float:
    return _number(text, zero=False, what="")


def _cap_mb(text: str) -> float:
    return _number(text, zero=True, what=" (0: no cap)")


# ---------------------------------------------------------------------------------------- values and checks
def cap_bytes(mb: float, option: str, *, none: bool = True) -> int | None:
    """``--max-bucket-mb``-style MiB as whole bytes (None for 0: no cap, where ``none``). A positive
    figure under one byte is a ``ValueError`` here (as 0 bytes it would read as no cap); whether the
    bytes make a staging cap is for :class:`~reshard.options.RefitOptions` to say (:func:`refit_options`).

    >>> cap_bytes(0, "--max-bucket-mb") is None, cap_bytes(1.5, "--max-bucket-mb") == 3 << 19
    (True, True)
    """
    from ..planning.schedule import ALIGN

    whole = int(mb * MiB)
    if mb and not whole:
        raise ValueError(f"{option} {mb:g} is 0 bytes; a staging cap needs at least {ALIGN} bytes "
                         f"({ALIGN / MiB:.2g} MiB)" + (", or 0 for none" if none else ""))
    return whole or None


def staging_cap(mb: float, option: str, *, none: bool = True) -> tuple[str, int | None]:
    """(the flag as written, its bytes) of a staging-cap flag in MiB, for :func:`refit_options`."""
    return f"{option} {mb:g}", cap_bytes(mb, option, none=none)


def refit_options(method: str, **given: tuple[str, object]) -> RefitOptions:
    """The one :class:`~reshard.options.RefitOptions` of ``method`` a command makes of its flags: ``given``
    maps each option to (the flag as the user wrote it, its value). RefitOptions checks every value;
    one it refuses is an :class:`~reshard.errors.OptionsError` that names the flag first.

    >>> refit_options("reshard", max_bucket_bytes=("--max-bucket-mb 1", MiB)).round_bytes == MiB // 2
    True
    >>> refit_options("reshard", max_bucket_bytes=("--max-bucket-mb 1e-05", 10))
    Traceback (most recent call last):
    ...
    reshard.errors.OptionsError: --max-bucket-mb 1e-05: max_bucket_bytes=10 is smaller than 16 bytes
    """
    options = RefitOptions(method=method)
    for name, (flag, value) in given.items():
        try:
            options = options.replace(**{name: value})
        except OptionsError as error:
            raise OptionsError(f"{flag}: {error}") from None
    return options


def output_problem(path: str, option: str, *, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written (None: it can): a folder where a file is wanted or the other way
    round, a file on the way to it, or no write permission. Missing folders are fine: they are created."""
    if not path:
        return f"{option}: empty path"
    target = Path(path)
    if not folder and path.endswith(("/", os.sep)):
        return f"{option} {path!r} names a folder; give a file path"
    if target.exists():
        if folder and not target.is_dir():
            return f"{option} {path!r} is a file, not a folder"
        if not folder and target.is_dir():
            return f"{option} {path!r} is a folder; give a file path"
        if not os.access(target, os.W_OK):
            return f"{option} {path!r} is not writable"
        return None
    above = target.absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return f"{option} {path!r}: {str(above)!r} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"{option} {path!r}: cannot create anything in {str(above)!r} (not writable)"
    return None


def check_outputs(*outputs: tuple[str | None, str, bool]) -> None:
    """``ValueError`` for the first (path, option, folder) that cannot be written (None paths: not asked for)."""
    for path, option, folder in outputs:
        problem = None if path is None else output_problem(path, option, folder=folder)
        if problem:
            raise ValueError(problem)


def check_demo(args) -> None:
    """Option checks before anything is planned or spawned (``ValueError``: a usage error)."""
    cap_bytes(args.max_bucket_mb, "--max-bucket-mb")
    check_outputs((args.json, "--json", False))


def check_plan(args) -> None:
    cap_bytes(args.max_bucket_mb, "--max-bucket-mb")
    check_outputs((args.plot, "--plot", True))


def check_simulate(args) -> None:
    cap_bytes(args.bucket_mb, "--bucket-mb", none=False)
    check_outputs((args.out if args.png is None else None, "--out", True), (args.png or None, "--png", False),
                  (args.json, "--json", False))


# ---------------------------------------------------------------------------------------- parsers
def demo_parser(sub) -> argparse.ArgumentParser:
    demo_model = get_arch(DEMO_MODEL)
    parser = sub.add_parser(
        "demo",
        help="refit a transformer from M training ranks to N inference ranks with both executors, verify, compare",
        description=(
            "Spawn M source (training) and N = tp x dp destination (inference) processes on this machine "
            "(CPU, gloo), and move the weights of a Qwen3-0.6B-like transformer (untied LM head, "
            f"{demo_model.num_params / 1e9:.2f} B parameters, {demo_model.nbytes / 1e9:.2f} GB in bf16 by default) "
            "from an FSDP-style "
            "Shard(0) layout over the M sources to a tensor-parallel layout (column-parallel q/k/v/gate/up, "
            "row-parallel o/down, vocab-parallel embedding and LM head, replicated norms) over dp replicas of "
            "tp ranks. It runs the reshard executor and then the gather-and-broadcast baseline, verifies every "
            "destination byte after each, and prints wall time, wire bytes, bytes received per destination, "
            "peak staging memory and the speedup. Exits with status 1 if any byte is wrong. "
            "The defaults (the full 0.75 B-parameter model, 4 -> 4 ranks) take 30-60 s on a 2-core machine "
            "and about 8 GB of memory in all (8 processes); use --layers, --vocab or "
            "--scale to shrink the model."),
    )
    ranks = parser.add_argument_group("ranks")
    ranks.add_argument("--sources", "-M", type=_positive, default=None, metavar="M",
                   help="number of source (training) ranks, 0..M-1; every tensor is Shard(0) over them with "
                        "the torch.chunk split rule, as FSDP2 shards (default 4; not with --model)")
    ranks.add_argument("--tp", type=_positive, default=None,
                   help="tensor-parallel size of each inference replica; must divide the heads, kv heads, "
                        "intermediate size and vocab (1, 2, 4 or 8 for the default model) (default 2; not with "
                        "--model)")
    ranks.add_argument("--dp", type=_positive, default=None,
                   help="number of inference replicas (data parallel); destination ranks N = tp x dp, each "
                        "replica a group of tp consecutive ranks (default 2; not with --model)")
    ranks.add_argument("--colocate", action="store_true",
                   help="put destination ranks on ranks 0..N-1 (shared with the sources) instead of M..M+N-1; "
                        "bytes a rank already holds are then copied locally, not sent (default: separate ranks)")

    named = parser.add_argument_group(
        "named model with real framework layouts (instead of the Qwen3-style model and ranks)",
        "With --model, the training side is laid out as Megatron-Core (or FSDP2) lays it out and the inference "
        "side as vLLM does, with the same rules as `reshard plan`; training ranks are 0..M-1 and inference ranks "
        "M..M+N-1, M and N following from --train and --infer. Example: reshard demo --model qwen3-30b-a3b "
        "--train tp1,ep2 --infer tp2")
    named.add_argument("--model", default=None, choices=sorted(PRESETS), metavar="NAME",
                   help=f"model preset, one of: {', '.join(sorted(PRESETS))}")
    named.add_argument("--train", default=None, metavar="SPEC",
                   help="training parallelism as in `reshard plan`: Megatron sizes like tp1,ep2 or tp2,pp2, or "
                        "fsdp:dp2[,tp2] (default: tp1,ep2 for MoE models, else tp2)")
    named.add_argument("--infer", default=None, metavar="SPEC",
                   help="inference parallelism (vLLM): tp2,dp2 = 2 engines of 2 ranks; add ep for expert "
                        "parallel (default tp2)")
    named.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True,
                   help="shrink the preset to a small random model of the same family that runs in seconds: "
                        "64 hidden, 2 layers (3 for DeepSeek: 1 dense + 2 MoE), 8 heads, 4 KV heads, 8 experts, "
                        "vocab 1000, MLA and shared experts kept; --layers, --hidden, ... override single sizes. "
                        "--no-tiny runs the full preset (needs its full size in memory, several times over) "
                        "(default: on)")
    model = parser.add_argument_group(f"model (defaults: {DEMO_MODEL}, Qwen3-0.6B with an untied LM head)")
    model.add_argument("--layers", type=_positive, default=None, help=f"decoder layers (default {demo_model.layers})")
    model.add_argument("--hidden", type=_positive, default=None, help=f"hidden size (default {demo_model.hidden})")
    model.add_argument("--intermediate", type=_positive, default=None,
                   help=f"MLP intermediate size (default {demo_model.intermediate})")
    model.add_argument("--heads", type=_positive, default=None, help=f"attention heads (default {demo_model.heads})")
    model.add_argument("--kv-heads", type=_positive, default=None,
                       help=f"key/value heads (default {demo_model.kv_heads})")
    model.add_argument("--head-dim", type=_positive, default=None,
                       help=f"size of one head (default {demo_model.head_dim})")
    model.add_argument("--vocab", type=_positive, default=None, help=f"vocabulary size (default {demo_model.vocab})")
    model.add_argument("--scale", type=_positive_number, default=None,
                   help="shrink (or grow) the model: multiplies the number of layers and the vocabulary by this "
                        "factor (vocab rounded to a multiple of 64 x tp); explicit --layers/--vocab win")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the weights, and of the inference-side buffers (default %(default)s)")
    model.add_argument("--source-dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the training-side buffers if different (e.g. fp32 master weights); the "
                        "executors cast to --dtype on the sender (default: same as --dtype)")
    run = parser.add_argument_group("run")
    run.add_argument("--max-bucket-mb", type=_cap_mb, default=64.0,
                   help="staging cap per rank in MiB (max_bucket_bytes): the most a rank stages at once; the "
                        "transfer runs in rounds, two in flight, each under half of it; 0 means no cap "
                        "(default %(default)s)")
    run.add_argument("--repeat", type=_positive, default=1,
                   help="runs per method; the table reports the best (each run's time is its slowest rank's); "
                        "destination buffers are zeroed before, and verified after, every run (default %(default)s)")
    run.add_argument("--seed", type=int, default=0,
                   help="seed of the test values written into the source buffers (default %(default)s)")
    run.add_argument("--methods", default="reshard,gather-broadcast",
                   help="comma-separated methods to run, in order, of: reshard, gather-broadcast, hierarchical "
                        "(reshard in phases over pretend NVLink domains, see --domain-size), hybrid (the tensors "
                        "--hybrid-patterns picks by reshard, the others by gather-broadcast) (default %(default)s)")
    run.add_argument("--hybrid-patterns", default=None, metavar="REGEX,...",
                   help="for the hybrid method: comma-separated regular expressions; a tensor whose name matches "
                        "one (re.search) goes by reshard, the others by gather-broadcast; an empty string sends "
                        "everything by gather-broadcast (default: FFN and expert weights, "
                        "reshard.planning.hybrid.FFN_PATTERNS)")
    run.add_argument("--domain-size", type=_nonnegative, default=0, metavar="K",
                   help="for the hierarchical method: pretend NVLink domains of K consecutive ranks, inference "
                        "ranks starting a fresh domain; 0 puts all inference ranks in one (default %(default)s)")
    run.add_argument("--json", metavar="PATH", default=None,
                   help="also write the collected figures (per-run times, bytes, plan facts) to PATH as JSON")
    run.add_argument("--quiet", action="store_true",
                   help="no progress display while running; print only the header and the final table")
    parser.set_defaults(check=check_demo, parser=parser)
    return parser


def plan_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "plan", help="plan a whole model's refit between two parallel configurations and summarize it",
        description=(
            "Build the training-side layout (Megatron-Core or FSDP2) and the inference-side layout (vLLM) of a "
            "named model, plan the refit, and print what moves: tensors, pieces, bytes by category, per-rank "
            "maximum send and receive with the balance, and the bytes gather-and-broadcast would move. "
            "Nothing is run and no process group is formed. Example: reshard plan --model deepseek-v3 "
            "--train tp1,ep16,pp4,dp2 --infer tp8,dp16"),
    )
    parser.add_argument("--model", required=True, choices=sorted(PRESETS), metavar="MODEL",
                   help=f"model preset, one of: {', '.join(sorted(PRESETS))}")
    parser.add_argument("--train", required=True, metavar="SPEC",
                   help="training parallelism: Megatron sizes like tp1,ep16,pp4,dp2 (with ep > 1, dp counts "
                        "replicas of the expert grid: world = etp x ep x pp x dp; else world = tp x cp x pp x dp), "
                        "or fsdp:dp64[,tp8][,hsdp2] for FSDP2; training ranks are 0..M-1")
    parser.add_argument("--infer", required=True, metavar="SPEC",
                   help="inference parallelism (vLLM): tp8,dp16 = ONE vLLM deployment of 16 x 8 ranks with "
                        "data_parallel_size=16 (its MoE layers split over all 128 ranks); with "
                        "--independent-engines (or ',independent' in SPEC) 16 separate TP8 engines, each "
                        "holding the whole model; add ep for expert parallel; dtensor:tp2,dp2 for torch tensor "
                        "parallel replicas; inference ranks are M..M+N-1")
    parser.add_argument("--independent-engines", action="store_true",
                   help="read the vLLM spec's dp as that many independent engines (as most RL stacks run "
                        "them), not one deployment with data_parallel_size=dp")
    parser.add_argument("--max-bucket-mb", type=_cap_mb, default=0,
                   help="staging cap per rank in MiB: the most a rank stages at once; the plan's rounds get half "
                        "of it each (two are in flight), so the plan stages what a refit session given the same "
                        "cap stages (default: none)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the gather-and-broadcast byte count")
    parser.add_argument("--precision", choices=("bf16", "fp8", "mxfp8"), default="bf16",
                   help="destination precision: bf16 (default: the inference layout's dtype, as vLLM loads it), "
                        "fp8 (e4m3 with one float32 scale per 128x128 block for the linear weights; routers, norms, "
                        "embeddings and the head kept) or mxfp8 (OCP MX: e4m3 with one E8M0 scale per 32 elements "
                        "along the input dim, vLLM's weight_scale): plans the refit straight into FP8 engines, each block "
                        "quantized where it is whole (a source rank; else, where the training ranks of one NVLink domain "
                        "of --topology (8 GPUs without it) hold it together, one of them after the others hand it "
                        "their rows; else the destination); the tables and --json "
                        "report its wire bytes, by precision (fp8, scales, raw, other), and where blocks are "
                        "quantized; a destination split through a block is an error naming the tensor")
    parser.add_argument("--plot", metavar="DIR", nargs="?", const=DEFAULT_OUT, default=None,
                   help="also write two PNGs to DIR (default when DIR is left out: ./" + DEFAULT_OUT + "): bytes "
                        "per (source, destination) rank pair as a heat map, and each GPU's load on NIC out/in and "
                        "NVLink out/in (seconds at link bandwidth) with the bottleneck marked, for the refit "
                        "reshard runs on --topology (over NVLink domains: network once per domain, then NVLink); "
                        "prints their paths and the modeled time")
    parser.add_argument("--topology", metavar="NAME_OR_FILE", default=None,
                   help="model the refit on this machine: a preset (dgx-h100, gb200-nvl72, cpu) or a .json/.yaml "
                        "file of Topology fields (see docs/cost_model.md); training ranks on GPUs 0..M-1, "
                        "inference ranks from the next NVLink domain; prints the modeled times (reshard "
                        "hierarchical and direct, the hybrid, gather-and-broadcast fair and naive), the lower "
                        "bound and its binding term (default for --plot: dgx-h100)")
    parser.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout instead of tables: model, train, infer, engines, "
                        "tensors, wire_bytes (reshard's direct plan), max_send_bytes / max_recv_bytes (per "
                        "rank), gather_broadcast_bytes ({gather, broadcast}), fingerprint; with --topology also "
                        "topology, fits, does_not_fit, modeled_s ({hierarchical, direct, hybrid, "
                        "gather_broadcast (best implementation), gather_broadcast_naive}, seconds, null where "
                        "not modeled), lower_bound_s (domain ingress over all of a domain's NICs), "
                        "lower_bound_term, lower_bound_job_s (over the job's NICs only), ours_over_bound, "
                        "speedup (ours vs "
                        "hybrid, gather_broadcast, gather_broadcast_naive), bottleneck, cross_domain_bytes; "
                        "rounds use a 2 GiB staging cap (1 GiB rounds) unless --max-bucket-mb is set, "
                        "broadcasts 1 GiB buckets; "
                        "always precision, wire_bytes_by_precision ({fp8, scales, raw, other}), wire_bytes_by_dtype, "
                        "blocks ({at_source, assembled, at_destination}), assembly_bytes (handed over inside training "
                        "domains first) and bf16_wire_bytes (the BF16 plan's, to compare)")
    parser.set_defaults(check=check_plan, parser=parser)
    return parser


def simulate_parser(sub) -> argparse.ArgumentParser:
    from .simulate import CASES

    parser = sub.add_parser(
        "simulate", help="model refit times at cluster scale beside the published figures (table + PNG)",
        description=(
            "For each case, build the real training (Megatron-Core or FSDP2) and inference (vLLM) layouts of "
            "the model, "
            "plan the refit directly and in phases over NVLink domains, and model the time of both on the "
            "case's machine, beside the hybrid NeMo RL ships (FFN and experts by reshard, the rest broadcast), "
            "gather-and-broadcast as its best implementations run it and its naive single-root form, the "
            "physical lower bound, and the published figure. Rows follow the published engine arrangement "
            "where the source states it (independent engines: each holds the whole model) and say where our "
            "model differs from the published setup; a layout whose weights exceed a GPU's memory is reported "
            "as not fitting. The Kimi-K2 rows refit FSDP2 BF16 training into FP8 engines, as published "
            "(--precision sets every row's destination precision). Pure computation: no process group, no GPU. "
            "Every case takes one to two and a half minutes on a 2-core machine with the default --jobs "
            "(54-147 s measured on one host, depending on its load; about twice that one row after another), "
            "the 2.4 T-parameter MoE's three rows and kimi-h100 most of it; each row prints a line as soon as "
            "it is done (the small ones within seconds), the table follows; --cases picks rows."),
    )
    parser.add_argument("--cases", default=",".join(c.key for c in CASES),
                   help="comma-separated, from: " + ", ".join(c.key for c in CASES) + " (default: all)")
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help="folder for the chart (default ./%(default)s)")
    parser.add_argument("--png", metavar="PATH", default=None,
                   help="chart path (default: OUT/simulate.png; '' for no chart)")
    parser.add_argument("--bucket-mb", type=_positive_number, default=2048,
                   help="staging cap per GPU in MiB: the most a GPU stages at once, two rounds in flight sharing it, "
                        "as a refit session given the same cap (default %(default)s: rounds of 1 GiB)")
    parser.add_argument("--json", default=None,
                   help="also write the results as JSON here: per case the fields of `reshard plan --json`")
    parser.add_argument("--jobs", type=_positive, default=None,
                   help="rows simulated at once, each in its own process (default: one per core, as many as "
                        "memory holds at about 6 GiB a row); the figures do not depend on it")
    parser.add_argument("--precision", choices=("bf16", "fp8"), default=None,
                   help="destination precision of every row: bf16 or fp8 (e4m3, 128x128 block scales, as "
                        "`reshard plan --precision`); default: each case's own (the Kimi-K2 rows fp8, as "
                        "published; the others bf16). A layout FP8 cannot take is reported "
                        "in its row")
    parser.set_defaults(check=check_simulate, parser=parser)
    return parser


__all__ = ["DEFAULT_OUT", "DTYPES", "MiB", "SIZES", "cap_bytes", "check_demo", "check_outputs", "check_plan",
           "check_simulate", "demo_parser", "output_problem", "plan_parser", "refit_options", "simulate_parser",
           "staging_cap"]
