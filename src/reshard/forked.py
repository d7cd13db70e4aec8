"""Run one function on the second core: in a forked child, while this process goes on.

A planning command whose stages do not depend on each other can finish sooner on two cores. The
child is a copy of this process (``os.fork``), so its inputs are not pickled; only its result comes
back, through a pipe.

>>> with forked(sum, [1, 2, 3]) as job:   # the child adds while this process could do other work
...     job.result()
6

* An error raised in the child is raised again by :meth:`Forked.result`, with the child's
  traceback added as a note.
* A child that dies without a result (killed, out of memory) makes :meth:`Forked.result` raise
  ``ChildProcessError`` naming how it ended, or run the function here instead (``here_if_dead``).
  The wait ends when the child exits or closes its pipe, so a dead child is seen at once.
* The wait is bounded: a child that neither uses CPU time nor sends a byte for ``stuck_after_s``
  (:data:`STUCK_AFTER_S`) is stuck (a deadlock, a wait for something that is not in the copy): it is
  killed, and treated as a dead child. A child that computes is waited for however long it takes.
* Leaving the ``with`` block without the result kills the child and reaps it.
* Where forking is not safe, the function runs in this process at :meth:`Forked.result`: not on
  Linux, or with other threads running (a fork copies only the calling thread).
* The child runs torch on one thread: a parent's OpenMP pool does not survive the fork, and the
  child's first parallel torch operation would wait for it forever.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable

STUCK_AFTER_S = 60.0  # a child that uses no CPU time and sends nothing for this long is stuck


def can_fork() -> bool:
    """Whether :func:`forked` runs its function in a child: on Linux, with no other thread running."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1


def forked(fn: Callable, *args, **kwargs) -> "Forked":
    """Start ``fn(*args, **kwargs)`` in a forked child (in this process at :meth:`Forked.result` where
    :func:`can_fork` is false); use the returned job as a context manager."""
    if not can_fork():
        return in_this_process(fn, *args, **kwargs)
    call = functools.partial(fn, *args, **kwargs)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send, and leave without running this process's exit handlers
        status = 1
        try:
            os.close(read)
            _one_torch_thread()
            try:
                payload = pickle.dumps((True, call()), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as error:  # noqa: BLE001 - every error goes back to the caller
                payload = _error_payload(error)
            with os.fdopen(write, "wb") as pipe:
                pipe.write(payload)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    return Forked(pid, read, call)


def in_this_process(fn: Callable, *args, **kwargs) -> "Forked":
    """The same job as :func:`forked` gives, run in this process when its result is asked for.

    >>> with in_this_process(max, 2, 5) as job:
    ...     job.result()
    5
    """
    return Forked(None, None, functools.partial(fn, *args, **kwargs))


class Forked:
    """A function running in a forked child (see module doc)."""

    def __init__(self, pid: int | None, read_fd: int | None, call: Callable[[], Any]) -> None:
        self.pid = pid  # None: nothing forked, the function runs here at result()
        self._read_fd = read_fd
        self._call: Callable[[], Any] | None = call  # the function (run here without a child, or if it died)

    def result(self, *, here_if_dead: bool = False, stuck_after_s: float = STUCK_AFTER_S) -> Any:
        """The function's value; raises its error, or ``ChildProcessError`` if the child died first (or was
        stuck: no CPU time used and nothing sent for ``stuck_after_s`` seconds, then killed);
        ``here_if_dead``: then run the function in this process instead, with a ``RuntimeWarning`` naming
        how the child ended (a child killed for memory, say, costs time, not the answer)."""
        if self.pid is None and self._call is not None:  # nothing forked: run it here, once
            call, self._call = self._call, None
            return call()
        if self._read_fd is None:
            raise RuntimeError(f"forked child {self.pid}: no result left (taken already, or the job was closed)")
        payload, stuck = self._read_until_closed(stuck_after_s)
        _, status = os.waitpid(self.pid, 0)
        if not payload:  # dead, or killed as stuck
            how = (f"stuck: no CPU time used and nothing sent for {stuck_after_s:g} s, killed" if stuck
                   else _how_it_ended(status))
            problem = f"forked child {self.pid} ended without a result ({how})"
            if not here_if_dead:
                raise ChildProcessError(problem)
            warnings.warn(f"{problem}; running it in this process instead", RuntimeWarning, stacklevel=2)
            return self._call()
        ok, value = pickle.loads(payload)
        if ok:
            return value
        error, child_traceback = value
        error.add_note(f"raised in forked child {self.pid}:\n{child_traceback}")
        raise error

    def _read_until_closed(self, stuck_after_s: float) -> tuple[bytes, bool]:
        """(what the child sent until it closed its pipe, whether it was killed as stuck instead: then nothing)."""
        fd, self._read_fd = self._read_fd, None
        chunks: list[bytes] = []
        cpu = _cpu_ticks(self.pid)
        last_progress = time.monotonic()
        try:
            while True:
                ready, _, _ = select.select([fd], [], [], min(1.0, stuck_after_s / 4))
                if ready:
                    data = os.read(fd, 1 << 20)
                    if not data:  # the child closed its end: done, or dead
                        return b"".join(chunks), False
                    chunks.append(data)
                    last_progress = time.monotonic()
                    continue
                now_cpu = _cpu_ticks(self.pid)
                if now_cpu is None or now_cpu != cpu:  # computing (or unknown: no /proc to read)
                    cpu, last_progress = now_cpu, time.monotonic()
                elif time.monotonic() - last_progress > stuck_after_s:
                    _kill(self.pid)
                    return b"", True
        finally:
            os.close(fd)

    def __enter__(self) -> "Forked":
        return self

    def __exit__(self, *exc) -> None:
        if self._read_fd is not None:  # the result was not taken: stop the child and reap it
            os.close(self._read_fd)
            self._read_fd = None
            _kill(self.pid)
            os.waitpid(self.pid, 0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cpu_ticks(pid: int) -> int | None:
    """CPU time (user + system, in clock ticks) process ``pid`` has used, from ``/proc``; None where
    it cannot be read (then every look counts as progress)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of the line
    except (OSError, IndexError, ValueError):
        return None


def _one_torch_thread() -> None:
    """In a forked child: torch's intra-op work on this thread alone. An OpenMP thread pool the parent
    started is not in the child (a fork copies one thread), and the child's next parallel region would
    wait for it forever; with one thread torch never enters one."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _error_payload(error: BaseException) -> bytes:
    """``(False, (error, traceback text))`` pickled; an error that does not survive pickling goes back
    as a ``RuntimeError`` carrying its type and message."""
    text = "".join(traceback.format_exception(error))
    try:
        payload = pickle.dumps((False, (error, text)), protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(payload)
        return payload
    except Exception:  # noqa: BLE001 - any failure to round-trip: send the plain form
        plain = RuntimeError(f"{type(error).__name__}: {error}")
        return pickle.dumps((False, (plain, text)), protocol=pickle.HIGHEST_PROTOCOL)


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


__all__ = ["Forked", "can_fork", "forked", "in_this_process"]
