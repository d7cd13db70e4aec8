"""``reshard.forked``: a function run in a forked child gives its value or its error back, a dead child is
an error naming how it died, and a child whose result is not taken is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from reshard.forked import can_fork, forked, in_this_process

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked children run on Linux only")


def _pid_and_sum(values):
    return os.getpid(), int(np.sum(values))


@linux_only
def test_the_function_runs_in_a_child_and_its_value_comes_back():
    assert can_fork()
    big = np.arange(3_000_000)  # the child reads it without any pickling of inputs
    with forked(_pid_and_sum, big) as job:
        pid, total = job.result()
    assert pid == job.pid != os.getpid() and total == int(big.sum())
    with pytest.raises(ChildProcessError):  # reaped: no such child any more
        os.waitpid(job.pid, os.WNOHANG)


def _fails():
    raise ValueError("tensor 'w' at fault")


@linux_only
def test_an_error_in_the_child_is_raised_here_with_the_childs_traceback():
    with forked(_fails) as job:
        with pytest.raises(ValueError, match="tensor 'w' at fault") as caught:
            job.result()
    notes = "".join(caught.value.__notes__)
    assert f"raised in forked child {job.pid}" in notes and "_fails" in notes


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle this error")


def _fails_unpicklably():
    raise _Unpicklable("odd error")


@linux_only
def test_an_error_that_cannot_be_pickled_comes_back_by_name():
    with forked(_fails_unpicklably) as job:
        with pytest.raises(RuntimeError, match="_Unpicklable: odd error"):
            job.result()


def _dies():
    os.kill(os.getpid(), signal.SIGKILL)


@linux_only
def test_a_child_that_dies_is_an_error_naming_the_signal():
    with forked(_dies) as job:
        with pytest.raises(ChildProcessError, match=f"forked child {job.pid} ended without a result.*SIGKILL"):
            job.result()


def _dies_in_a_child(parent: int) -> int:
    if os.getpid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return 7


@linux_only
def test_a_dead_childs_function_can_run_here_instead():
    with forked(_dies_in_a_child, os.getpid()) as job:
        with pytest.warns(RuntimeWarning, match=r"killed by SIGKILL\); running it in this process instead"):
            assert job.result(here_if_dead=True) == 7


def _exits():
    os._exit(3)


@linux_only
def test_a_child_that_exits_without_a_result_names_its_status():
    with forked(_exits) as job:
        with pytest.raises(ChildProcessError, match="exit status 3"):
            job.result()


@linux_only
def test_a_result_not_taken_stops_the_child():
    started = time.monotonic()
    with forked(time.sleep, 600) as job:
        pid = job.pid
    assert time.monotonic() - started < 60  # killed and reaped, not waited for (the margin is for a busy host)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    with pytest.raises(RuntimeError, match="no result left"):
        job.result()


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


TORCH_AFTER_FORK = """
import torch
from reshard.forked import forked

x = torch.randn(1500, 1500)
(x @ x).sum()  # the parent's OpenMP pool is started
with forked(lambda: float((x @ x).sum() - (x @ x).sum()) + float(torch.ones(10**6).sum())) as job:
    print(job.result())
"""


@linux_only
def test_torch_in_the_child_after_the_parent_ran_parallel_torch():
    """A forked child's parallel torch operation must not wait for the parent's OpenMP threads (which
    are not in the child): run apart, so a hang fails here instead of stopping the suite."""
    script = subprocess.Popen([sys.executable, "-c", TORCH_AFTER_FORK], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = script.communicate(timeout=180)  # seconds of work: the margin is for a busy host
    except subprocess.TimeoutExpired:
        os.killpg(script.pid, signal.SIGKILL)  # the script and its forked child
        script.communicate()
        pytest.fail("a forked child's parallel torch operation hung")
    assert script.returncode == 0, err
    assert out.split() == ["1000000.0"]
