"""Refits in the background: the trainer goes on while its weights leave.

``session.refit(version, wait=False)`` starts the refit on a thread and returns a
:class:`RefitHandle` at once. The sources are read from the live parameter shards while the
trainer runs its next forward and backward, which read them but do not change them (FSDP2
unshards into buffers of its own). The first thing that does change them is an optimizer step,
so while a refit is in flight every optimizer step that would update one of its source tensors
first waits for it: a global step pre-hook (``torch.optim.Optimizer``), matched by storage, that
no user has to remember. It waits until this rank's sources were sent (the refit calls
:func:`sources_sent` once every byte left them), not for the destinations to receive, prepare
and commit: a refit that fails after that still raises on ``wait()``, and the step it let through
only changed weights that had already left. Other writes (``p.data.copy_``, a manual update) are not seen; call
:meth:`RefitHandle.wait` before them, or refit from a snapshot (``snapshot=True``: the shards are
copied first, :attr:`RefitHandle.snapshot_bytes` more memory, and nothing waits)::

    trainer thread                          refit thread
    h = session.refit(v, wait=False)        sends the shards (read in place)
    loss = model(batch); loss.backward()    ...
    optimizer.step()  -> waits until        ... every byte sent: sources_sent()
                         then updates       ... the destinations commit v
    h.wait()          -> the RefitStats, or the RefitError every rank raises

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2))
>>> opt = torch.optim.SGD([w], lr=1.0)
>>> h = RefitHandle(lambda: float(w.detach().sum()), sources=[w])   # a "refit" that reads w
>>> w.grad = torch.ones(2); opt.step()        # waits for h before changing w
>>> h.wait(), w.tolist()
(2.0, [0.0, 0.0])
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable, Generic, Iterable, TypeVar

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

Result = TypeVar("Result")

_lock = threading.Lock()
_in_flight: list["RefitHandle"] = []
_running = threading.local()  # .handle: the RefitHandle whose refit runs on this thread
_hook = None  # the global optimizer step pre-hook, while any refit with live sources is in flight


def _storage(tensor: torch.Tensor) -> int:
    to_local = getattr(tensor, "to_local", None)
    local = to_local() if callable(to_local) else tensor
    return local.untyped_storage().data_ptr()


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Wait for every in-flight refit that reads a parameter this step changes."""
    with _lock:
        handles = list(_in_flight)
    if not handles:
        return
    params = {_storage(p) for group in optimizer.param_groups for p in group["params"]}
    for handle in handles:
        if handle.storages & params:
            handle.guard_waits += 1
            start = time.perf_counter()
            handle._sent.wait()
            handle.guard_wait_s += time.perf_counter() - start


def copies_of(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Copies of ``tensors`` for a refit that must not read the live ones, and the bytes they hold."""
    copies = {name: tensor.detach().clone() for name, tensor in tensors.items()}
    return copies, sum(t.numel() * t.element_size() for t in copies.values())


def sources_sent() -> None:
    """Called by a refit once this rank's sources were read for the last time (every byte left): from
    then on the optimizer steps of the handle running on this thread, if any, need not wait."""
    handle = getattr(_running, "handle", None)
    if handle is not None:
        handle._release()


class RefitHandle(Generic[Result]):
    """``run()`` (a refit) on its own thread (see module doc); ``sources``: the live tensors it reads,
    which optimizer steps wait for it before changing (none: a snapshot, nothing waits);
    ``snapshot_bytes``: the extra memory its snapshot holds."""

    def __init__(self, run: Callable[[], Result], *, sources: Iterable[torch.Tensor] = (),
                 snapshot_bytes: int = 0, name: str = "reshard-refit") -> None:
        global _hook
        self.storages = {_storage(t) for t in sources}
        self.snapshot_bytes = snapshot_bytes
        self.guard_waits = 0  # how many optimizer steps waited for this refit
        self.guard_wait_s = 0.0  # how long they waited, in all
        self._sent = threading.Event()  # set once the sources are free (sent, or the refit ended)
        self.finished_at: float | None = None  # time.perf_counter() when the refit ended (None: running)
        self._future: Future = Future()
        if self.storages:
            with _lock:
                _in_flight.append(self)
                if _hook is None:
                    _hook = register_optimizer_step_pre_hook(_before_step)
        self._thread = threading.Thread(target=self._run, args=(run,), name=name, daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], Result]) -> None:
        _running.handle = self
        try:
            result = run()
        except BaseException as error:  # noqa: BLE001 - raised again by wait()
            self.finished_at = time.perf_counter()
            self._future.set_exception(error)
            self._release()  # after the outcome: a step the guard held sees the refit done
            return
        self.finished_at = time.perf_counter()
        self._future.set_result(result)
        self._release()

    def _release(self) -> None:
        global _hook
        self._sent.set()
        with _lock:
            if self in _in_flight:
                _in_flight.remove(self)
            if not _in_flight and _hook is not None:
                _hook.remove()
                _hook = None

    @property
    def sent(self) -> bool:
        """Whether this rank's sources were sent (or the refit ended): optimizer steps no longer wait."""
        return self._sent.is_set()

    def done(self) -> bool:
        """Whether the refit has ended (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: timedelta | float | None = None, *, raise_error: bool = True) -> Result | None:
        """The refit's result once it ended, or its error raised here (``raise_error``). The refit's own
        timeout bounds it; ``timeout`` bounds this wait too (a ``TimeoutError`` leaves it running)."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self._thread.join(seconds)
        if self._thread.is_alive():
            raise TimeoutError(f"the refit is still running after {seconds:g} s")
        if not raise_error:
            return None
        return self._future.result()

    def exception(self) -> BaseException | None:
        """The refit's error once it ended (None: it committed or still runs)."""
        return self._future.exception() if self.done() else None


__all__ = ["RefitHandle", "copies_of", "sources_sent"]
