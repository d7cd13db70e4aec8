"""A refit's options: one frozen, validated value that every entry point takes.

The session, the vLLM init infos (as JSON: :meth:`RefitOptions.to_json`), the demo, the CLI and
the cost model all take a :class:`RefitOptions`; it is checked once, here, when it is made.

    option            default   meaning
    method            "auto"    a name of :data:`~reshard.planning.methods.METHODS`, or "auto"
                                (hierarchical where there are NVLink domains, else reshard)
    max_bucket_bytes  256 MiB   the most staging bytes a rank holds at once (None: no cap); the
                                planner schedules rounds at half of it (two are in flight)
    timeout           5 min     bounds every wait of a refit (a datetime.timedelta)
    checksum          False     an xxh3-64 digest per message, checked on arrival
    allow_lossy       False     send values a narrowing cast loses instead of refusing them
    hybrid_rule       None      method "hybrid": which tensors go by reshard (a HybridRule, regular
                                expressions or a predicate; None: FFN and expert weights)
    precision         None      a dtype policy (a DtypePolicy or "fp8", "bf16", ...): each destination
                                tensor's precision
    domains           None      {rank: NVLink domain}; None: found by the session (GPU hosts)
    receive           "in-place" how destinations take a refit: "in-place" (written into the live
                                tensors) or "staged" (into staging, put in place after every rank
                                committed: a failed refit leaves them serving their version)
    max_receive_staging_bytes
                      None      the most staging a staged destination rank may hold (None: no bound)

An option the method does not take, or an unknown method, is one :class:`~reshard.errors.OptionsError`
naming both:

>>> RefitOptions(method="gather-broadcast", checksum=True)
Traceback (most recent call last):
...
reshard.errors.OptionsError: method 'gather-broadcast' does not take option 'checksum' (it takes allow_lossy, max_bucket_bytes, max_receive_staging_bytes, method, precision, receive, timeout)
>>> RefitOptions(max_bucket_bytes=64 << 20).round_bytes == 32 << 20
True
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

from .errors import OptionsError
from .planning.hybrid import HybridRule, as_rule
from .planning.methods import AUTO, AUTO_TAKES, COMMON_OPTIONS, METHOD_NAMES, METHODS, resolve
from .planning.precision import DtypePolicy, as_policy
from .planning.schedule import check_max_bucket_bytes, round_cap

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT = timedelta(minutes=5)
IN_PLACE, STAGED = "in-place", "staged"
RECEIVE_MODES = (IN_PLACE, STAGED)


@dataclass(frozen=True)
class RefitOptions:
    """Every option of a refit (see module doc); invalid values raise :class:`OptionsError` here."""

    method: str = AUTO
    max_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    timeout: timedelta = DEFAULT_TIMEOUT
    checksum: bool = False
    allow_lossy: bool = False
    hybrid_rule: HybridRule | None = None
    precision: DtypePolicy | str | None = None
    domains: Mapping[int, int] | None = field(default=None, hash=False)
    receive: str = IN_PLACE
    max_receive_staging_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.method != AUTO and self.method not in METHODS:
            raise OptionsError(f"unknown refit method {self.method!r}; choose from auto, {', '.join(METHOD_NAMES)}")
        self._set("max_bucket_bytes", _checked(check_max_bucket_bytes, self.max_bucket_bytes))
        given = self.timeout
        if isinstance(given, (int, float)) and not isinstance(given, bool) and math.isfinite(given):
            self._set("timeout", timedelta(seconds=given))
        if not isinstance(self.timeout, timedelta) or not self.timeout.total_seconds() > 0:
            raise OptionsError(f"timeout must be a positive datetime.timedelta (or seconds), got {given!r}")
        for flag in ("checksum", "allow_lossy"):
            if not isinstance(getattr(self, flag), bool):
                raise OptionsError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.hybrid_rule is not None:
            self._set("hybrid_rule", _checked(as_rule, self.hybrid_rule))
        if self.precision is not None:
            _checked(as_policy, self.precision)
        if self.domains is not None:
            self._set("domains", _domains(self.domains))
        if self.receive not in RECEIVE_MODES:
            raise OptionsError(f"receive {self.receive!r}: use one of {', '.join(map(repr, RECEIVE_MODES))}")
        limit = self.max_receive_staging_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise OptionsError(f"max_receive_staging_bytes must be a number of bytes >= 0 or None, got {limit!r}")
        self._check_method_takes()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_method_takes(self) -> None:
        takes = AUTO_TAKES if self.method == AUTO else METHODS[self.method].takes
        for name in self.given():
            if name not in COMMON_OPTIONS and name not in takes:
                accepted = ", ".join(sorted(COMMON_OPTIONS | takes))
                raise OptionsError(f"method {self.method!r} does not take option {name!r} (it takes {accepted})")

    def given(self) -> list[str]:
        """The options that differ from their defaults."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]

    @classmethod
    def of(cls, options: "RefitOptions | Mapping | None" = None, **changes) -> "RefitOptions":
        """``options`` (a RefitOptions, a mapping of its fields, or None: the defaults) with ``changes``.

        >>> RefitOptions.of(None, method="hybrid").method
        'hybrid'
        """
        if isinstance(options, RefitOptions):
            return options.replace(**changes) if changes else options
        fields = {**dict(options or {}), **changes}
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise OptionsError(f"unknown refit option {unknown[0]!r}; the options are "
                               f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        return cls(**fields)

    def replace(self, **changes) -> "RefitOptions":
        """A copy with ``changes`` (validated again)."""
        return RefitOptions.of(None, **{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **changes})

    # ------------------------------------------------------------------ derived
    @property
    def round_bytes(self) -> int | None:
        """The staging cap of one round, derived from :attr:`max_bucket_bytes` by the planner's rule."""
        return round_cap(self.max_bucket_bytes)

    @property
    def policy(self) -> DtypePolicy | None:
        """:attr:`precision` as a :class:`DtypePolicy` (None: every tensor at its destination dtype)."""
        return None if self.precision is None else as_policy(self.precision)

    def resolved(self, domains: Mapping[int, int] | None = None) -> "RefitOptions":
        """The options with ``"auto"`` resolved (:func:`~reshard.planning.methods.resolve`) and ``domains``
        (found by the session) filled in where none were given; domains a method does not take are
        dropped."""
        domains = self.domains if self.domains is not None else domains
        method = resolve(self.method, domains)
        if not METHODS[method].accepts("domains"):
            domains = None
        return self.replace(method=method, domains=domains)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        """Plain JSON (for vLLM's init infos, which cross processes and HTTP routes); options that hold
        code (a predicate rule or policy) cannot cross and raise :class:`OptionsError`.

        >>> RefitOptions(method="hybrid", hybrid_rule=["experts"], checksum=True).to_json()["hybrid_rule"]
        ['experts']
        """
        rule = self.hybrid_rule
        if rule is not None and rule.predicate is not None:
            raise OptionsError("hybrid_rule: a predicate rule cannot be sent as JSON; give regular expressions")
        if self.precision is not None and not isinstance(self.precision, str):
            raise OptionsError("precision: a DtypePolicy object cannot be sent as JSON; give its name ('fp8', ...)")
        return {"method": self.method, "max_bucket_bytes": self.max_bucket_bytes,
                "timeout_s": self.timeout.total_seconds(), "checksum": self.checksum, "allow_lossy": self.allow_lossy,
                "hybrid_rule": None if rule is None else list(rule.patterns), "precision": self.precision,
                "domains": None if self.domains is None else {str(r): d for r, d in self.domains.items()},
                "receive": self.receive, "max_receive_staging_bytes": self.max_receive_staging_bytes}

    @classmethod
    def from_json(cls, data: Mapping) -> "RefitOptions":
        """The options :meth:`to_json` wrote.

        >>> o = RefitOptions(method="hybrid", hybrid_rule=["mlp"], timeout=timedelta(seconds=9))
        >>> RefitOptions.from_json(o.to_json()) == o
        True
        """
        fields = dict(data)
        if "timeout_s" in fields:
            fields["timeout"] = timedelta(seconds=fields.pop("timeout_s"))
        if fields.get("domains") is not None:
            fields["domains"] = {int(r): d for r, d in fields["domains"].items()}
        return cls.of(None, **fields)


def _checked(check, value):
    """``check(value)``, its ValueError as an OptionsError."""
    try:
        return check(value)
    except OptionsError:
        raise
    except ValueError as e:
        raise OptionsError(str(e)) from None


def _domains(domains: Mapping[int, int]) -> dict[int, int]:
    try:
        out = {int(r): int(d) for r, d in dict(domains).items()}
    except (TypeError, ValueError):
        raise OptionsError(f"domains must map each rank to its NVLink domain ({{rank: domain}}), got {domains!r}") from None
    if any(r < 0 for r in out):
        raise OptionsError(f"domains: rank {min(out)} is negative")
    return out


__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_TIMEOUT", "IN_PLACE", "RECEIVE_MODES", "RefitOptions", "STAGED"]
