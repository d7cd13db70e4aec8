"""Liveness probes (``reshard.execution.liveness``) and the control plane's use of them: a rank a wait
misses is named at once when its process is gone, and waited for (up to the timeout) while it lives.

The process tests use a real child process, killed with SIGKILL or stopped with SIGSTOP; the control
tests use a real TCP store and addresses that refuse (a closed port) or accept (this process's port)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from reshard.execution.control import Control, RefitError
from reshard.execution.liveness import listen_address, probe
from reshard.execution.process_group import free_port

pytestmark = pytest.mark.timeout(300)  # every wait below is bounded; this bounds the test if one is not

# a child process takes seconds to start on a busy 2-core machine; its death is seen by the kernel at once
START_S, DEATH_S = 120.0, 10.0


def _listen_then_sleep(queue) -> None:
    queue.put(listen_address("127.0.0.1"))
    time.sleep(600)


def _closed_port_address() -> str:
    """An address nothing listens on (a port just bound and released): connecting is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_live_process_answers_a_stopped_one_too_and_a_killed_one_refuses():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_listen_then_sleep, args=(queue,), daemon=True)
    child.start()
    try:
        address = queue.get(timeout=START_S)
        assert probe(address) is True
        os.kill(child.pid, signal.SIGSTOP)  # stalled, not dead: the kernel still accepts for it
        assert probe(address) is True
        os.kill(child.pid, signal.SIGKILL)
        child.join(DEATH_S)
        assert not child.is_alive()
        assert probe(address) is False
    finally:
        if child.is_alive():
            child.kill()


def test_this_process_listens_once_and_a_closed_port_refuses():
    a, b = listen_address("127.0.0.1"), listen_address("127.0.0.1")
    assert a == b and probe(a) is True
    assert probe(_closed_port_address()) is False


@pytest.fixture
def store():
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _control(store, prefix, rank, size, addresses, timeout_s):
    control = Control(dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout_s))
    control.addresses = addresses
    return control


def test_a_gather_names_a_dead_rank_at_once_and_waits_out_a_live_one(store):
    own = listen_address("127.0.0.1")
    dead = _control(store, "dead", 0, 2, {0: own, 1: _closed_port_address()}, 20.0)
    t = time.monotonic()
    with pytest.raises(RefitError, match=r"agreement: rank 1 did not arrive: gone \(its process refuses"):
        dead.gather("agreement")
    assert time.monotonic() - t < 5.0  # the timeout is 20 s: a probe, not the timeout, named it
    alive = _control(store, "alive", 0, 2, {0: own, 1: own}, 1.0)
    t = time.monotonic()
    with pytest.raises(RefitError, match=r"rank 1 did not arrive within 1 s"):
        alive.gather("agreement")
    assert time.monotonic() - t >= 1.0  # alive (or unknown): waited for until the timeout
    unknown = _control(store, "unknown", 0, 2, {}, 1.0)  # no addresses: no probes, the timeout decides
    with pytest.raises(RefitError, match=r"did not arrive within 1 s"):
        unknown.gather("agreement")


def test_a_decision_counts_a_dead_rank_that_never_reported_and_waits_for_a_live_one(store):
    own = listen_address("127.0.0.1")
    dead = _control(store, "dead", 0, 2, {0: own, 1: _closed_port_address()}, 20.0)
    t = time.monotonic()
    with pytest.raises(RefitError, match=r"commit: rank 1 did not report within .* \(rank 1 gone") as e:
        dead.decide(None)  # rank 0 succeeded; rank 1 died before reporting (no abort raised)
    assert e.value.ranks == (1,) and time.monotonic() - t < 5.0
    alive = _control(store, "alive", 0, 2, {0: own, 1: own}, 1.0)
    t = time.monotonic()
    with pytest.raises(RefitError, match=r"rank 1 did not report within") as e:
        alive.decide(None)
    assert "gone" not in str(e.value) and time.monotonic() - t >= 1.0


def test_a_group_probes_only_where_a_live_peer_answers():
    """At connect every rank has just checked in: if the next one's port does not answer (a firewall
    that resets or drops unlisted ports), the group's waits never probe and keep their timeouts."""
    from reshard.execution.group import _probed_addresses

    own, refused = listen_address("127.0.0.1"), _closed_port_address()
    assert _probed_addresses([own, own, refused], 0) == {0: own, 1: own, 2: refused}
    assert _probed_addresses([own, own, refused], 1) == {}  # its next rank, 2, refuses
    assert _probed_addresses([own, None], 0) == {}  # a peer without an address
    assert _probed_addresses([own], 0) == {0: own}  # alone: nothing to check


class _NeverDone:
    """A posted work that never completes (an NCCL transfer with a dead peer)."""

    def is_completed(self) -> bool:
        return False


def test_a_polled_transfer_with_a_dead_peer_fails_at_once(store):
    """The polling wait (NCCL's) names a peer whose process is gone instead of waiting out its deadline;
    a live peer's pending work is waited for until the deadline."""
    own = listen_address("127.0.0.1")
    dead = _control(store, "dead", 0, 3, {0: own, 1: own, 2: _closed_port_address()}, 20.0)
    t = time.monotonic()
    with pytest.raises(RefitError, match=r"transfer round 0: transfer with rank 2 gone") as e:
        dead.wait([(_NeverDone(), (1,)), (_NeverDone(), (2,))], "transfer round 0")
    assert e.value.ranks == (2,) and time.monotonic() - t < 5.0
    alive = _control(store, "alive", 0, 2, {0: own, 1: own}, 1.0)
    with pytest.raises(RefitError, match=r"no progress with rank 1 within 1 s"):
        alive.wait([(_NeverDone(), (1,))], "transfer round 0")


def test_gone_now_probes_at_once_and_remembers(store):
    """After a failed refit (the vLLM trainer, before calling an engine): every rank asked is probed now,
    not at the next throttled turn; a dead one stays gone."""
    own = listen_address("127.0.0.1")
    control = _control(store, "now", 0, 3, {0: own, 1: own, 2: _closed_port_address()}, 20.0)
    control.gone_among([1])  # a probe just ran: the throttle would skip the next 0.25 s
    assert control.gone_now([1, 2]) == [2] and control.gone == {2}
    assert control.gone_now([0, 2]) == [2]
