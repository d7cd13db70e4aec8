"""Refit sessions: a trainer connected to its inference engines once, refitted every step.

    sides.py     Side: one rank's part of one side of a refit (its pieces and live tensors)
    session.py   RefitSession: rendezvous, layout exchange, one plan, replayed refits, RefitError
"""

from .session import RefitError, RefitSession, RefitStats
from .sides import Side, WriteReport

__all__ = ["RefitError", "RefitSession", "RefitStats", "Side", "WriteReport"]
