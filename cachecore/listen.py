"""Listening sockets made before a server starts (``kvgate serve``, ``kvgate replica``):
the port is held from the check to the serving, and a port in use is one clear error
instead of the server's logged one and exit."""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048
_FREE_PORT_TRIES = 8  # port 0: picks of a port free on the first address but not another


class ListenError(OSError):
    """A server cannot listen on its address; ``reason`` says why (e.g. "Address already
    in use")."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def listen_advice(exc: ListenError, *, port: str, host: str) -> str:
    """The advice that fits why a listen failed, for a command's one-line refusal: ``port``
    (e.g. "pick another --port") for a port in use, ``host`` for a name that does not
    resolve or an address this host does not have, nothing otherwise. The port's advice for
    a bad host sent the operator after the wrong flag."""
    cause = exc.__cause__
    if isinstance(cause, socket.gaierror):
        return host
    if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE:
        return port
    if isinstance(cause, OSError) and cause.errno == errno.EADDRNOTAVAIL:
        return host
    return ""


def bind_listeners(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> list[socket.socket]:
    """Listening sockets on each address a server on ``host:port`` would listen on, so the
    port is held from the check to the serving with no window for another process to take
    it (a socket only bound does not hold it against SO_REUSEADDR binders on Linux).
    Connections made before the server starts wait in the backlog. With SO_REUSEADDR, as
    asyncio's ``create_server`` sets, so a port in TIME_WAIT is not taken for busy. Port 0
    picks a free one, the same on every address (one port for clients of either family).
    An address this host does not have (EADDRNOTAVAIL) is skipped, logged, when another
    one is listened on: Docker's /etc/hosts names ``::1 localhost`` with IPv6 disabled.
    Raises :class:`ListenError` naming the first other failure (nothing stays open)."""
    try:
        # a name listed twice (two /etc/hosts lines) resolves twice: one socket per address,
        # as asyncio's create_server does, or the second bind fails against the first
        infos = list(
            dict.fromkeys(
                socket.getaddrinfo(
                    host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
                )
            )
        )
    except OSError as exc:  # socket.gaierror: a host name that does not resolve
        raise ListenError(exc.strerror or str(exc)) from exc
    for _ in range(_FREE_PORT_TRIES if port == 0 else 1):
        bound = _listen_on(infos, port, backlog)
        if bound is not None:
            return bound
    raise ListenError(f"no port free on every address of {host!r} in {_FREE_PORT_TRIES} picks")


def _listen_on(
    infos: Sequence[tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]],
    port: int,
    backlog: int,
) -> list[socket.socket] | None:
    """One listening socket per address; None when ``port`` is 0 and the port the first
    address picked is in use on another (pick again). Each address picking its own (asyncio's
    create_server with port 0) gave ``localhost`` or ``""`` one port per family, and a
    server that names one port reachable on one family only."""
    bound: list[socket.socket] = []
    missing: list[tuple[Any, OSError]] = []  # addresses this host lacks, skipped if another binds
    picked = port
    try:
        for family, kind, proto, _, addr in infos:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this host lacks (no IPv6): asyncio skips it too
                continue
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((addr[0], picked, *addr[2:]))
                sock.listen(backlog)
            except OSError as exc:
                if picked != port and exc.errno == errno.EADDRINUSE:
                    for s in bound:
                        s.close()
                    return None
                if exc.errno == errno.EADDRNOTAVAIL:
                    bound.pop().close()
                    missing.append((addr[0], exc))
                    continue
                raise ListenError(exc.strerror or str(exc)) from exc
            picked = sock.getsockname()[1]
        if not bound:
            if missing:
                first = missing[0][1]
                raise ListenError(first.strerror or str(first)) from first
            raise ListenError("no address to listen on")
        for address, error in missing:
            log.warning(
                "not listening on %s: %s (listening on the host's other addresses)",
                address,
                error.strerror or error,
            )
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound
