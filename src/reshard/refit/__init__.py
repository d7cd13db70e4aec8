"""Refit sessions: a trainer connected to its inference engines once, refitted every step.

    sides.py       Side: one rank's part of one side of a refit (its pieces and live tensors)
    session.py     RefitSession: rendezvous, layout exchange, one plan, replayed refits, RefitError
    membership.py  who is in a session: the membership protocol over the session's TCP store
    states.py      DestinationState: ready, updating, poisoned, empty
"""

from .session import RefitError, RefitSession, RefitStats
from .sides import Side, WriteReport
from .states import DestinationState

__all__ = ["DestinationState", "RefitError", "RefitSession", "RefitStats", "Side", "WriteReport"]
