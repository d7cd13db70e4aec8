"""Calls that may never return, made bounded: each runs on its own daemon thread, and whoever waits
for it waits at most a given time.

The trainer calls into engines that may be dead or stalled (a stalled worker keeps vLLM's RPC
busy); a call on a thread pool's worker would keep the process from exiting, a daemon thread does
not.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Callable, Iterator


def in_thread(fn: Callable, *args) -> Future:
    """``fn(*args)`` on a daemon thread (a call into a dead engine may never return: it must not
    keep the process from exiting, as a thread pool's worker would)."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="reshard-weight-sync").start()
    return future


def outcome(future: Future, seconds: float | None) -> BaseException | None:
    """Wait at most ``seconds`` for ``future``: its exception, a ``TimeoutError`` if it is still
    running, or None."""
    try:
        return future.exception(timeout=seconds)
    except FutureTimeout:
        return TimeoutError(f"no answer within {seconds:g} s")


@contextmanager
def with_pending_call(pending: Future | None, grace_s: float | None = None) -> Iterator[None]:
    """Run the body, then wait for the control-plane call ``pending`` (the workers' side of the same
    collective); raise the body's error if it failed (the session's, which names the rank and
    tensor), else the call's. ``grace_s`` bounds the wait for the call after the body."""
    try:
        yield
    except BaseException:
        if pending is not None:
            outcome(pending, grace_s)  # wait for it; the workers fail the same way
        raise
    if pending is not None:
        error = outcome(pending, grace_s)
        if error is not None:
            raise error


__all__ = ["in_thread", "outcome", "with_pending_call"]
