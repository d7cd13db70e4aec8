"""The engine's rule for the asynchronous loop: a generation batch never straddles a weight change.

The rollout engine generates a batch while the trainers train and the next refit arrives; vLLM
labels every token with the version the engine served when it was sampled, so a batch of one
version needs the weights to stay put from its first token to its last. :class:`BatchGate` is
that rule, on the engine, in plain threading (no vLLM: tests drive it directly)::

    call on the engine                      waits for
    a batch that asks for version v         the engine to serve v (resumed after its refit)
    a weight change (pause, an update that  the batch in flight to end, and a batch that asked
    writes live weights, a reload)          for the version served now to run first
    a staged receive (bytes into staging)   nothing: it runs while the batch generates

so for refit k of the loop (see :mod:`.async_loop`)::

    batch k   (asked for version k-1)  ----------------|                       generates
    refit k   receive (staging)          ======        |  apply k  | resume k
    batch k+1 (asked for version k)                                            |--------...

The apply step of refit ``k`` comes after batch ``k`` returned and before batch ``k + 1``
started; batch ``k + 1`` starts once the engine serves ``k``. Every wait is bounded by
``timeout_s`` (``TimeoutError``).
"""

from __future__ import annotations

import threading
import time


class BatchGate:
    """Generation batches and weight changes, one at a time (see module doc). ``version``: the version
    the engine serves at start."""

    def __init__(self, version: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.serving: str | None = version  # None between a weight change's start and its resume
        self.running: str | None = None  # the version of the batch generating now
        self.asked: list[str] = []  # versions of the batches waiting for their version
        self.last_end: float | None = None  # when the last batch ended (time.monotonic())
        self._cond = threading.Condition()

    def _wait(self, ready, what: str) -> None:
        if not self._cond.wait_for(ready, self.timeout_s):
            raise TimeoutError(f"{what}: not within {self.timeout_s:g} s (serving {self.serving!r}, batch "
                               f"running {self.running!r}, batches waiting for {self.asked})")

    def begin_batch(self, version: str) -> float:
        """Block until the engine serves ``version`` and no other batch runs, then mark this one running;
        the ``time.monotonic()`` it started."""
        with self._cond:
            self.asked.append(version)
            try:
                self._wait(lambda: self.serving == version and self.running is None,
                           f"a batch for version {version!r}")
            finally:
                self.asked.remove(version)
            self.running = version
            return time.monotonic()

    def end_batch(self) -> float:
        """The running batch ended (its last token, or its failure); the ``time.monotonic()`` it ended."""
        with self._cond:
            self.running = None
            self.last_end = time.monotonic()
            self._cond.notify_all()
            return self.last_end

    def stop_serving(self) -> float | None:
        """Before the weights change: wait for the batch in flight, and for a batch that asked for the
        version served now to run first; then serve nothing until :meth:`serve`. Returns when the last
        batch ended (``time.monotonic()``; None if none ran yet): the weights change after it."""
        with self._cond:
            self._wait(lambda: self.running is None and not (self.serving is not None and self.serving in self.asked),
                       "a weight change")
            self.serving = None
            return self.last_end

    def serve(self, version: str) -> None:
        """The engine serves ``version`` now (resumed after a refit, or never stopped)."""
        with self._cond:
            self.serving = version
            self._cond.notify_all()


__all__ = ["BatchGate"]
