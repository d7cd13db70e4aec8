"""Is a peer's process still alive? Each process listens on one TCP port; a peer probes it by connecting.

A killed process's port refuses connections at once (its host's kernel answers for it), while a live
one, even stopped or busy, is accepted by the kernel. So a rank waiting for another that never comes
can tell *dead* from *slow* within a probe, instead of waiting out the whole timeout:

    rank 0 waits for rank 2 at the commit     probe(rank 2's address)
    rank 2 killed (SIGKILL, OOM, segfault)    -> False: gone, name it now
    rank 2 stopped, or in a long step         -> True: alive, keep waiting
    rank 2's host unreachable                 -> None: unknown, keep waiting (the timeout decides)

Groups connected through a store (:meth:`reshard.execution.group.Group.connect`) swap their ranks'
addresses as they connect; :class:`~reshard.execution.control.Control` probes the ranks it waits for.

>>> a = listen_address("127.0.0.1")
>>> probe(a)
True
"""

from __future__ import annotations

import os
import socket
import threading

PROBE_TIMEOUT_S = 0.1  # per probe: a live peer on a reachable host answers in well under a millisecond

_listener: tuple[int, socket.socket, int] | None = None  # (pid, socket, port) of this process
_lock = threading.Lock()


def listen_address(peer_host: str) -> str:
    """``"ip:port"`` at which peers reach this process's liveness port (opened on first use, one per
    process); ``ip``: this host's address on the route to ``peer_host`` (e.g. the store's host)."""
    global _listener
    with _lock:
        if _listener is None or _listener[0] != os.getpid():  # a forked child listens on a port of its own
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", 0))
            sock.listen(128)
            threading.Thread(target=_drain, args=(sock,), name="reshard-liveness", daemon=True).start()
            _listener = (os.getpid(), sock, sock.getsockname()[1])
        port = _listener[2]
    return f"{_route_ip(peer_host)}:{port}"


def _drain(sock: socket.socket) -> None:
    """Accept and close probes, so that the kernel's queue of them never fills."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        conn.close()


def _route_ip(host: str) -> str:
    """This host's IPv4 address on the route to ``host`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> bool | None:
    """True: the process at ``address`` is alive; False: it is gone (connection refused); None:
    unknown (no answer within ``timeout``, host unreachable)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


__all__ = ["PROBE_TIMEOUT_S", "listen_address", "probe"]
