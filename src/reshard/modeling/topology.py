"""Where ranks run and how fast the links between them are: :class:`Topology` and :class:`Placement`.

A *topology* describes one kind of machine: GPUs grouped into nodes (what a tray or
a server holds) and NVLink domains (GPUs that reach each other over NVLink), one
NIC per GPU, and the speed of every link kind. A *placement* says which GPU each
refit rank runs on. Both are plain data: the cost model (:mod:`reshard.modeling.traffic`,
:mod:`~reshard.modeling.reshard_time`, :mod:`~reshard.modeling.baseline_time`, :mod:`~reshard.modeling.bound`)
and the plots read them; nothing here touches a process group.

Presets (bandwidths per GPU, per direction; sources in ``docs/cost_model.md``)::

    name          GPUs/domain  GPUs/node  NIC          NVLink
    dgx-h100      8            8          400 Gb/s     450 GB/s
    gb200-nvl72   72           4          400 Gb/s     900 GB/s
    cpu           1            (one host) measured     -          (this machine, gloo over loopback)

Placement, 6 training ranks -> 4 inference ranks on ``dgx-h100`` (default: contiguous)::

    rank      0 1 2 3 4 5 | 6 7 8 9
    gpu       0 1 2 3 4 5 | 6 7 8 9
    domain    0 0 0 0 0 0 | 0 0 1 1

and with ``infer_start="domain"`` the inference ranks begin on a fresh domain: GPUs 8..11.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Sequence

import numpy as np

GB = 1e9  # decimal, as spec sheets write bandwidths
_GBIT = 1e9 / 8

#: one host holds every rank (the CPU preset): larger than any rank count we place
ONE_HOST = 1 << 20


@dataclass(frozen=True)
class Topology:
    """Link speeds of one kind of machine; all bandwidths are bytes/s per GPU per direction.

    >>> t = Topology.preset("dgx-h100")
    >>> t.gpus_per_domain, t.nic_bytes_per_s / 1e9, t.nvlink_bytes_per_s / 1e9
    (8, 50.0, 450.0)

    Fields:
      gpus_per_domain     GPUs that reach each other over NVLink (GPU g is in domain g // this)
      gpus_per_node       GPUs per node / tray / host (node g // this); a node holds its GPUs' NICs
      nic_bytes_per_s     one GPU's NIC (scale-out network), each direction
      nvlink_bytes_per_s  one GPU's NVLink bandwidth, each direction
      net_latency_s       one network message: time from posting it to its first byte arriving
      nvlink_latency_s    the same for a message inside an NVLink domain
      launch_latency_s    fixed cost of one round of messages or one collective call (kernel launch, sync)
      copy_bytes_per_s    local pack / unpack / local-copy bandwidth of one GPU (or CPU process)
      message_overhead_s  serial CPU time to post one message (each end pays it)
      copy_overhead_s     serial CPU time per copy (one box packed or unpacked); 0 on GPUs, where
                          the cost model does not count copies
      host_cores          if set, all GPUs (processes) of a node share this many CPU cores, so their
                          copy and message work adds up per node (the CPU preset); None on GPUs
      host_bytes_per_s    if set, total network bytes a node can move per second in each direction,
                          all its ranks together (a host's loopback); None: the sum of its NICs
      gpu_memory_bytes    one GPU's memory, to tell whether a layout's weights fit at all; None: unknown
    """

    name: str
    gpus_per_domain: int
    gpus_per_node: int
    nic_bytes_per_s: float
    nvlink_bytes_per_s: float
    net_latency_s: float = 0.0
    nvlink_latency_s: float = 0.0
    launch_latency_s: float = 0.0
    copy_bytes_per_s: float = math.inf
    message_overhead_s: float = 0.0
    copy_overhead_s: float = 0.0
    host_cores: int | None = None
    host_bytes_per_s: float | None = None
    gpu_memory_bytes: float | None = None

    def __post_init__(self) -> None:
        for f in ("gpus_per_domain", "gpus_per_node"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"topology {self.name!r}: {f} must be an integer >= 1, got {v!r}")
        for f in ("nic_bytes_per_s", "nvlink_bytes_per_s", "copy_bytes_per_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"topology {self.name!r}: {f} must be a number > 0, got {v!r}")
        for f in ("net_latency_s", "nvlink_latency_s", "launch_latency_s", "message_overhead_s",
                  "copy_overhead_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
                raise ValueError(f"topology {self.name!r}: {f} must be a finite number >= 0, got {v!r}")
        if self.host_cores is not None and (not isinstance(self.host_cores, int) or self.host_cores < 1):
            raise ValueError(f"topology {self.name!r}: host_cores must be an integer >= 1 or null, "
                             f"got {self.host_cores!r}")
        if self.host_bytes_per_s is not None and not self.host_bytes_per_s > 0:
            raise ValueError(f"topology {self.name!r}: host_bytes_per_s must be > 0 or null, "
                             f"got {self.host_bytes_per_s!r}")
        if self.gpu_memory_bytes is not None and not self.gpu_memory_bytes > 0:
            raise ValueError(f"topology {self.name!r}: gpu_memory_bytes must be > 0 or null, "
                             f"got {self.gpu_memory_bytes!r}")

    # ------------------------------------------------------------------ presets and files
    @staticmethod
    def preset_names() -> list[str]:
        return sorted(_PRESETS)

    @classmethod
    def preset(cls, name: str) -> "Topology":
        """A named topology: ``"dgx-h100"``, ``"gb200-nvl72"`` or ``"cpu"``."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown topology preset {name!r}; known: {', '.join(sorted(_PRESETS))}") from None

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "topology") -> "Topology":
        """Build from a mapping of field names; ``base: PRESET`` starts from a preset.

        Bandwidths may be numbers (bytes/s) or strings with a unit (``"400 Gb/s"``,
        ``"450 GB/s"``, ``"12 GiB/s"``); latencies numbers (s) or strings (``"5 us"``).

        >>> Topology.from_dict({"base": "dgx-h100", "name": "h100-200g", "nic_bytes_per_s": "200 Gb/s"}
        ...                    ).nic_bytes_per_s
        25000000000.0
        """
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping of topology fields, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known) - {"base"})
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: base, {', '.join(known)})")
        values: dict = {}
        if "base" in data:
            try:
                values = asdict(cls.preset(str(data["base"])))
            except ValueError as e:
                raise ValueError(f"{where}: key 'base': {e}") from None
        for key, raw in data.items():
            if key == "base":
                continue
            try:
                values[key] = _read_value(key, raw)
            except ValueError as e:
                raise ValueError(f"{where}: key {key!r}: {e}") from None
        missing = [f for f in ("name", "gpus_per_domain", "gpus_per_node", "nic_bytes_per_s", "nvlink_bytes_per_s")
                   if f not in values]
        if missing:
            raise ValueError(f"{where}: missing key {missing[0]!r} (or give base: PRESET to start from one of "
                             f"{', '.join(sorted(_PRESETS))})")
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "Topology":
        """Read a JSON (``.json``) or YAML (``.yaml``/``.yml``) file of fields (see :meth:`from_dict`).

        Example ``my-cluster.yaml``::

            base: dgx-h100
            name: h100-2x200g
            nic_bytes_per_s: 200 Gb/s
        """
        path = Path(path)
        text = path.read_text()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {e}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from None
        data = dict(data) if isinstance(data, dict) else data
        if isinstance(data, dict) and "name" not in data:
            data["name"] = path.stem
        return cls.from_dict(data, where=str(path))

    @classmethod
    def resolve(cls, name_or_path: str | Path) -> "Topology":
        """A preset name, or the path of a topology file."""
        if str(name_or_path) in _PRESETS:
            return _PRESETS[str(name_or_path)]
        p = Path(name_or_path)
        if p.suffix.lower() in (".json", ".yaml", ".yml") or p.exists():
            if not p.exists():
                raise ValueError(f"topology file {str(p)!r} does not exist")
            return cls.from_file(p)
        raise ValueError(f"unknown topology {str(name_or_path)!r}: give a preset "
                         f"({', '.join(sorted(_PRESETS))}) or a .json/.yaml file")

    def with_(self, **changes) -> "Topology":
        """A copy with some fields changed."""
        return replace(self, **changes)

    def describe(self) -> str:
        """One line: ``dgx-h100: 8 GPUs/NVLink domain, 8/node, NIC 50 GB/s, NVLink 450 GB/s``."""
        node = "one host" if self.gpus_per_node >= ONE_HOST else f"{self.gpus_per_node}/node"
        out = (f"{self.name}: {self.gpus_per_domain} GPUs/NVLink domain, {node}, NIC {self.nic_bytes_per_s / GB:.3g} "
               f"GB/s, NVLink {self.nvlink_bytes_per_s / GB:.3g} GB/s per direction per GPU")
        if self.host_cores:
            out += f", {self.host_cores} shared cores"
            if self.host_bytes_per_s:
                out += f", host network {self.host_bytes_per_s / GB:.3g} GB/s"
        return out


_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30,
           "Ti": 2 ** 40}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str) -> float:
    """``"400 Gb/s"`` -> 5e10 bytes/s; ``"450 GB/s"`` -> 4.5e11; ``"1 GiB/s"`` -> 2**30. Bits are lowercase b."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(k|K|M|G|T|Ki|Mi|Gi|Ti)?(b|B)(?:/s|ps)\s*", text)
    if not m:
        raise ValueError(f"cannot read bandwidth {text!r}; write e.g. '400 Gb/s', '50 GB/s' or a number of bytes/s")
    return float(m.group(1)) * _PREFIX[m.group(2) or ""] * (1 / 8 if m.group(3) == "b" else 1.0)


def parse_size(text: str) -> float:
    """``"80 GB"`` -> 8e10 bytes; ``"192 GiB"`` -> 192 * 2**30."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(k|K|M|G|T|Ki|Mi|Gi|Ti)?B\s*", text)
    if not m:
        raise ValueError(f"cannot read size {text!r}; write e.g. '80 GB', '192 GiB' or a number of bytes")
    return float(m.group(1)) * _PREFIX[m.group(2) or ""]


def parse_duration(text: str) -> float:
    """``"5 us"`` -> 5e-06 s."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)\s*", text)
    if not m:
        raise ValueError(f"cannot read duration {text!r}; write e.g. '5 us', '0.2 ms' or a number of seconds")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def _read_value(key: str, raw):
    if key == "name":
        return str(raw)
    if raw is None and key in ("host_cores", "host_bytes_per_s", "gpu_memory_bytes"):
        return None
    if key in ("gpus_per_domain", "gpus_per_node", "host_cores"):
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"expected an integer, got {raw!r}")
        return raw
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        if key.endswith("bytes_per_s"):
            return parse_bandwidth(raw)
        if key.endswith("_bytes"):
            return parse_size(raw)
        if key.endswith("_s"):
            return parse_duration(raw)
    raise ValueError(f"expected a number, got {raw!r}")


# The "cpu" preset: this machine (2 cores, shared with other jobs), every rank a process, gloo over TCP
# loopback. Each rank is its own "domain" (no NVLink); all ranks share one host, its cores and its loopback.
# Measured by `make bench-cost` (python benchmarks/bench_cost.py) on 2026-11-29 (its 4 -> 4 process group);
# it prints fresh values for the machine it runs on (they move by large factors when other jobs take the
# cores: rerun rather than trust these).
CPU_MEASURED = dict(
    nic_bytes_per_s=2.169e9,  # one pair, 16 x 2 MiB messages back to back into one reused receive buffer
    host_bytes_per_s=2.638e9,  # every process of the group in a pair, all at once, total
    net_latency_s=8.188e-5,  # median one-way time of a 1-byte ping-pong
    launch_latency_s=0.0,
    copy_bytes_per_s=7.854e9,  # reshard.execution.packing.pack + unpack, 2 MiB messages, one reused staging buffer, one thread
    message_overhead_s=1.773e-4,  # CPU per message end: 4 processes messaging each other, back to back
    copy_overhead_s=8.923e-6,  # per box packed or unpacked
    host_cores=2,
)


def cpu_topology(**measured) -> Topology:
    """The CPU preset with measured values (defaults: :data:`CPU_MEASURED`)."""
    vals = {**CPU_MEASURED, **measured}
    return Topology(name="cpu", gpus_per_domain=1, gpus_per_node=ONE_HOST,
                    nvlink_bytes_per_s=vals["nic_bytes_per_s"], nvlink_latency_s=vals["net_latency_s"], **vals)


_PRESETS: dict[str, Topology] = {
    # DGX H100: 8 H100 SXM per node on NVSwitch (NVLink 4: 900 GB/s total = 450 per direction per GPU);
    # 8 ConnectX-7 400 Gb/s ports for the compute fabric, one per GPU. HBM3 3.35 TB/s: a copy reads
    # and writes, so about half of it; 80 GB each. Latencies: NCCL's own tuning model (docs/cost_model.md).
    "dgx-h100": Topology(
        name="dgx-h100", gpus_per_domain=8, gpus_per_node=8, nic_bytes_per_s=400 * _GBIT,
        nvlink_bytes_per_s=450 * GB, net_latency_s=14e-6, nvlink_latency_s=3.4e-6, launch_latency_s=8.4e-6,
        copy_bytes_per_s=3.35e12 / 2, message_overhead_s=1e-6, gpu_memory_bytes=80 * GB),
    # GB200 NVL72: 72 Blackwell GPUs in one NVLink domain (NVLink 5: 1.8 TB/s total = 900 per direction),
    # 18 compute trays of 4 GPUs, one 400 Gb/s NIC per GPU; HBM3e 8 TB/s, 13.4 TB per rack = 186 GB per GPU.
    "gb200-nvl72": Topology(
        name="gb200-nvl72", gpus_per_domain=72, gpus_per_node=4, nic_bytes_per_s=400 * _GBIT,
        nvlink_bytes_per_s=900 * GB, net_latency_s=14e-6, nvlink_latency_s=3.4e-6, launch_latency_s=8.4e-6,
        copy_bytes_per_s=8e12 / 2, message_overhead_s=1e-6, gpu_memory_bytes=13.4e12 / 72),
    "cpu": cpu_topology(),
}


# ---------------------------------------------------------------------------------------------- placement
@dataclass(frozen=True, eq=False)
class Placement:
    """Which GPU each refit rank runs on, and so its node and NVLink domain.

    Ranks ``0..M-1`` train and ``M..M+N-1`` infer (reshard's convention); colocated
    setups reuse rank numbers, so rank ``r`` is both. ``gpu_of[r]`` is rank r's GPU.

    >>> p = Placement.contiguous(Topology.preset("dgx-h100"), 6, 4)
    >>> p.gpu_of.tolist(), p.domain_of.tolist()
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1])
    >>> Placement.contiguous(Topology.preset("dgx-h100"), 6, 4, infer_start="domain").gpu_of.tolist()
    [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    """

    topology: Topology
    gpu_of: np.ndarray  # int64 [ranks]
    train_ranks: tuple[int, ...]
    infer_ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        g = np.asarray(self.gpu_of, dtype=np.int64)
        if g.ndim != 1 or (len(g) and g.min() < 0):
            raise ValueError(f"placement: gpu_of must be a list of GPU indices >= 0, got {self.gpu_of!r}")
        g.setflags(write=False)
        object.__setattr__(self, "gpu_of", g)
        bad = [r for r in self.train_ranks + self.infer_ranks if not 0 <= r < len(g)]
        if bad:
            raise ValueError(f"placement: rank {bad[0]} has no GPU (ranks 0..{len(g) - 1} are placed)")

    @classmethod
    def contiguous(cls, topology: Topology, num_train: int, num_infer: int, *, infer_start: str = "next",
                   colocated: bool = False) -> "Placement":
        """Training ranks on GPUs ``0..M-1``; inference ranks right after (``infer_start="next"``),
        from the next node boundary (``"node"``) or the next NVLink-domain boundary (``"domain"``).
        ``colocated=True``: ranks ``0..max(M, N)-1`` on GPUs ``0..``, training ``0..M-1``, inference ``0..N-1``.
        """
        if num_train < 1 or num_infer < 1:
            raise ValueError(f"placement: need >= 1 training and inference rank, got {num_train} and {num_infer}")
        if colocated:
            n = max(num_train, num_infer)
            return cls(topology, np.arange(n), tuple(range(num_train)), tuple(range(num_infer)))
        if infer_start == "next":
            first = num_train
        elif infer_start in ("node", "domain"):
            q = topology.gpus_per_node if infer_start == "node" else topology.gpus_per_domain
            first = -(-num_train // q) * q
        else:
            raise ValueError(f"placement: infer_start must be 'next', 'node' or 'domain', got {infer_start!r}")
        gpus = np.concatenate([np.arange(num_train), first + np.arange(num_infer)])
        return cls(topology, gpus, tuple(range(num_train)), tuple(range(num_train, num_train + num_infer)))

    @classmethod
    def explicit(cls, topology: Topology, gpus: Sequence[int], num_train: int,
                 infer_ranks: Sequence[int] | None = None) -> "Placement":
        """Rank ``r`` on GPU ``gpus[r]``; ranks ``0..num_train-1`` train and, unless ``infer_ranks`` is
        given, the rest infer. Two ranks may share a GPU (colocated with distinct rank numbers)."""
        gpus = [int(g) for g in gpus]
        infer = tuple(range(num_train, len(gpus))) if infer_ranks is None else tuple(int(r) for r in infer_ranks)
        return cls(topology, np.array(gpus, np.int64), tuple(range(num_train)), infer)

    @property
    def num_ranks(self) -> int:
        return len(self.gpu_of)

    @property
    def num_gpus(self) -> int:
        """GPUs ``0..max(gpu_of)`` (idle ones included, so domains keep their numbering)."""
        return int(self.gpu_of.max()) + 1 if len(self.gpu_of) else 0

    @property
    def node_of(self) -> np.ndarray:
        return self.gpu_of // self.topology.gpus_per_node

    @property
    def domain_of(self) -> np.ndarray:
        return self.gpu_of // self.topology.gpus_per_domain

    def gpu_domain(self) -> np.ndarray:
        """Domain of every GPU ``0..num_gpus-1``."""
        return np.arange(self.num_gpus) // self.topology.gpus_per_domain

    def gpu_node(self) -> np.ndarray:
        """Node of every GPU ``0..num_gpus-1``."""
        return np.arange(self.num_gpus) // self.topology.gpus_per_node

    def used_gpus(self) -> np.ndarray:
        """Sorted GPUs that hold at least one rank."""
        return np.unique(self.gpu_of)

    def ranks_on(self, gpu: int) -> list[int]:
        return np.flatnonzero(self.gpu_of == gpu).tolist()

    def check_topology(self, topology: Topology | None = None) -> Topology:
        """The topology to model this placement on: ``topology`` when given (its links may differ from
        the placement's, its grouping of GPUs into domains and nodes may not), else the placement's own."""
        if topology is None:
            return self.topology
        own = self.topology
        if (topology.gpus_per_domain, topology.gpus_per_node) != (own.gpus_per_domain, own.gpus_per_node):
            raise ValueError(f"topology {topology.name!r} groups GPUs differently from the placement's "
                             f"{own.name!r}; build the placement with the same topology")
        return topology

    def describe(self) -> str:
        t, i = self.train_ranks, self.infer_ranks
        tg, ig = self.gpu_of[list(t)], self.gpu_of[list(i)]
        return (f"{len(t)} training ranks on GPUs {tg.min()}-{tg.max()}, {len(i)} inference ranks on GPUs "
                f"{ig.min()}-{ig.max()}; {len(np.unique(self.domain_of))} NVLink domain(s), "
                f"{len(np.unique(self.node_of))} node(s) of {self.topology.name}")
