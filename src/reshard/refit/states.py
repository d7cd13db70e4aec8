"""The states of a refit's destination side (an inference rank), shared by the session and the engines.

    state      meaning                                        after
    ready      holds every byte of ``version``                connect (version None), a commit
    updating   a refit is writing in place: must not serve    refit() started (in-place receive)
    staged     serves ``version``; a committed next version   receive() committed (staged receive),
               waits in staging to be put in place           until apply()
    poisoned   may hold a mix of versions: must not serve     a refit failed after bytes moved
    empty      never received a version                       join() (a new member)

A state is a ``str`` enum: it compares equal to its plain name (``DestinationState.READY ==
"ready"``) and prints as it (``str()``, f-strings, ``%s``), so logs read the same as with bare
strings; JSON and other plain data take ``.value``.
"""

from __future__ import annotations

import enum


class DestinationState(str, enum.Enum):
    """Where a destination rank stands (see module doc)."""

    READY = "ready"
    UPDATING = "updating"
    POISONED = "poisoned"
    EMPTY = "empty"
    STAGED = "staged"

    @property
    def servable(self) -> bool:
        """Whether the rank's live weights are one whole version (ready or staged)."""
        return self in (DestinationState.READY, DestinationState.STAGED)

    def __str__(self) -> str:
        return self.value


__all__ = ["DestinationState"]
