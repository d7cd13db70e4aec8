"""Framework rules as layout constructors: each module turns one framework's parallel
configuration into a :class:`reshard.Layout` of a model's logical (Hugging Face-named) tensors."""

import numpy as np

from ..tensors import LayoutError


def engine_ranks(ranks, tp: int, dp: int, framework: str) -> np.ndarray:
    """``ranks`` as an array, checked to be ``dp`` engines of ``tp`` distinct ranks each."""
    out = np.array([int(r) for r in ranks], np.int64)
    if tp < 1 or dp < 1:
        raise LayoutError(f"{framework} layout: tp and dp must be >= 1, got tp={tp}, dp={dp}")
    if len(out) != tp * dp:
        raise LayoutError(f"{framework} layout: {len(out)} ranks given for tp={tp} x dp={dp} = {tp * dp} ranks")
    if len(np.unique(out)) != len(out):
        raise LayoutError(f"{framework} layout: ranks {out.tolist()} repeat a rank")
    return out


VALIDATE_MAX_PIECES = 100_000
"""``validate=None`` in the framework constructors checks layouts up to this many pieces; bigger
ones are correct by construction (the tests validate every constructor on small configurations)
and ``Layout.validate()`` can still be called on them (seconds per million pieces)."""


def framework_layout(specs, tables, buffers, validate: bool | None):
    """A :class:`Layout` from a framework constructor's tables, validated per :data:`VALIDATE_MAX_PIECES`."""
    from ..layout import Layout

    if validate is None:
        validate = sum(len(t) for t in tables.values()) <= VALIDATE_MAX_PIECES
    return Layout(specs, tables, buffers, validate=validate)
