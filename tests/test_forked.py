"""``reshard.forked``: a function run in a forked child gives its value or its error back, a dead child is
an error naming how it died, a stuck child is killed, and a child whose result is not taken is stopped.

The checks that fork run in a fresh interpreter (:mod:`fresh_interpreter`): this test process may hold
threads other tests left, and with other threads running nothing is forked. The functions that end a
process act only in a child, so none can end the process running them."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from reshard.forked import can_fork, forked, in_this_process

from fresh_interpreter import in_a_fresh_interpreter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked children run on Linux only")
HERE = os.path.abspath(__file__)


def _in_a_child(parent: int) -> bool:
    if os.getpid() == parent:
        raise AssertionError("ran in the parent: nothing was forked")
    return True


def _pid_and_sum(values):
    return os.getpid(), int(np.sum(values))


def _check_value_comes_back():
    assert can_fork()
    big = np.arange(3_000_000)  # the child reads it without any pickling of inputs
    with forked(_pid_and_sum, big) as job:
        pid, total = job.result()
    assert pid == job.pid != os.getpid() and total == int(big.sum())
    with pytest.raises(ChildProcessError):  # reaped: no such child any more
        os.waitpid(job.pid, os.WNOHANG)


def _fails():
    raise ValueError("tensor 'w' at fault")


def _check_error_comes_back():
    with forked(_fails) as job:
        with pytest.raises(ValueError, match="tensor 'w' at fault") as caught:
            job.result()
    notes = "".join(caught.value.__notes__)
    assert job.pid is not None and f"raised in forked child {job.pid}" in notes and "_fails" in notes


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle this error")


def _fails_unpicklably():
    raise _Unpicklable("odd error")


def _check_unpicklable_error_comes_back_by_name():
    with forked(_fails_unpicklably) as job:
        with pytest.raises(RuntimeError, match="_Unpicklable: odd error"):
            job.result()
    assert job.pid is not None


def _dies(parent: int):
    if _in_a_child(parent):
        os.kill(os.getpid(), signal.SIGKILL)


def _check_dead_child_named():
    with forked(_dies, os.getpid()) as job:
        with pytest.raises(ChildProcessError, match=f"forked child {job.pid} ended without a result.*SIGKILL"):
            job.result()


def _dies_in_a_child(parent: int) -> int:
    if os.getpid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return 7


def _check_dead_childs_function_runs_here():
    with forked(_dies_in_a_child, os.getpid()) as job:
        with pytest.warns(RuntimeWarning, match=r"killed by SIGKILL\); running it in this process instead"):
            assert job.result(here_if_dead=True) == 7
    assert job.pid is not None


def _exits(parent: int):
    if _in_a_child(parent):
        os._exit(3)


def _check_exit_status_named():
    with forked(_exits, os.getpid()) as job:
        with pytest.raises(ChildProcessError, match="exit status 3"):
            job.result()


def _check_result_not_taken_stops_the_child():
    started = time.monotonic()
    with forked(time.sleep, 600) as job:
        pid = job.pid
    assert pid is not None
    assert time.monotonic() - started < 60  # killed and reaped, not waited for (the margin is for a busy host)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    with pytest.raises(RuntimeError, match="no result left"):
        job.result()


def _sleeps_in_a_child(parent: int, seconds: float) -> str:
    if os.getpid() != parent:  # stuck: uses no CPU time, sends nothing
        time.sleep(seconds)
    return "here"


def _check_stuck_child_is_killed_and_named():
    started = time.monotonic()
    with forked(_sleeps_in_a_child, os.getpid(), 600) as job:
        with pytest.raises(ChildProcessError, match=rf"forked child {job.pid} ended without a result \(stuck: no CPU "
                                                    rf"time used and nothing sent for 2 s, killed\)"):
            job.result(stuck_after_s=2)
    assert time.monotonic() - started < 60  # the bound, not the child's 600 s (the margin is for a busy host)
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(job.pid, os.WNOHANG)
    with forked(_sleeps_in_a_child, os.getpid(), 600) as job:
        with pytest.warns(RuntimeWarning, match=r"stuck.*killed\); running it in this process instead"):
            assert job.result(stuck_after_s=2, here_if_dead=True) == "here"


def _computes_for(seconds: float) -> int:
    end, n = time.process_time() + seconds, 0
    while time.process_time() < end:  # CPU time, not wall time: as long on a busy host
        n += 1
    return n


def _check_computing_child_is_waited_for():
    with forked(_computes_for, 6.0) as job:  # three times the bound below
        assert job.result(stuck_after_s=2) > 0


def _check_torch_after_the_parents_parallel_torch():
    """A forked child's parallel torch operation must not wait for the parent's OpenMP threads (which
    are not in the child)."""
    import torch

    x = torch.randn(1500, 1500)
    (x @ x).sum()  # the parent's OpenMP pool is started
    with forked(lambda: float((x @ x).sum() - (x @ x).sum()) + float(torch.ones(10**6).sum())) as job:
        assert job.result() == 1_000_000.0
    assert job.pid is not None


@linux_only
@pytest.mark.parametrize("check", ["_check_value_comes_back", "_check_error_comes_back",
                                   "_check_unpicklable_error_comes_back_by_name", "_check_dead_child_named",
                                   "_check_dead_childs_function_runs_here", "_check_exit_status_named",
                                   "_check_result_not_taken_stops_the_child",
                                   "_check_stuck_child_is_killed_and_named", "_check_computing_child_is_waited_for",
                                   "_check_torch_after_the_parents_parallel_torch"])
def test_in_a_fresh_interpreter(check):
    in_a_fresh_interpreter(HERE, check, timeout=180)


def test_with_another_thread_running_the_function_runs_here():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, args=(60,))
    other.start()
    try:
        assert not can_fork()
        with forked(_pid_and_sum, [1, 2]) as job:
            assert job.pid is None  # nothing forked
            assert job.result() == (os.getpid(), 3)
    finally:
        stop.set()
        other.join(60)


def test_in_this_process_runs_at_result_and_raises_there():
    calls = []
    job = in_this_process(calls.append, 1)
    assert calls == []
    job.result()
    assert calls == [1]
    with in_this_process(_fails) as job, pytest.raises(ValueError, match="at fault"):
        job.result()
