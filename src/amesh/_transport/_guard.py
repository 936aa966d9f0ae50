"""A guard on an NNG ``tls+tcp`` listener open to other hosts (a host agent's) against
connections that never prove themselves.

NNG accepts every TCP connection on its own threads and keeps one that never finishes
its TLS handshake for as long as the peer keeps it open (300 idle connections to an
agent were all open 20 s later, measured; 2,000 for 200 s in the report of issue 36),
and a ClientHello sent a byte a second as long;
at the descriptor limit the agent's own work failed (``Too many open files``), and the
hello deadline of :mod:`._nng_pipes` starts only once TLS is done. NNG has no hook
before a connection is a pipe, so the guard watches from outside, at each sweep of
the listener's inbox (:data:`~._nng.SWEEP_PERIOD`):

- it lists this process's connections on the listener's port (the sockets among its
  descriptors), and notes when it first saw each: the accept, within a sweep;
- a connection is proven once its peer's address is that of a pipe whose hello was
  good (TLS done, and the job key proven); every other is unproven;
- an unproven connection older than :attr:`Limits.deadline` (from the accept: TLS and
  the proof together) is shut down; so are the oldest unproven ones beyond
  :attr:`Limits.per_source` from one address and :attr:`Limits.total` in all, and the
  oldest unproven ones while fewer than :attr:`Limits.reserve` descriptors are free
  (the agent's own work, a controller's attach or a worker's start, needs them).

Oldest first, for every limit: an honest handshake (TLS and the proof) takes
milliseconds, well within a sweep, so what is still unproven at a sweep and old is
the flood's, and what is young may be an honest controller that came during it. Shedding
the newest would shed exactly those (a flood would keep honest controllers out as long
as it lasts), while shedding the oldest costs a flood its own connections, each of
which it must make again.

Shut down, not closed: the descriptor is NNG's. The guard duplicates it, checks that
the duplicate is still the same socket (its inode: the number may have been reused
meanwhile), and shuts the socket down through it; the peer gets its end, and NNG's
thread sees the connection end and closes its descriptor itself.

Nothing is logged per connection: one line at most per :data:`~._auth.LOG_INTERVAL`
says how many were shut down and why.

A stream listener (an agent's ``stream+tcp://``) accepts its connections itself, so
it applies the same limits at each accept, exactly (:class:`Admission`), and the
deadline with each connection's own timer (see :mod:`._stream_aio` and :mod:`._stream_anyio`).
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import time
from collections import Counter
from dataclasses import dataclass

from .._ratelog import RateLimitedLog
from ._auth import HANDSHAKE_TIMEOUT, LOG_INTERVAL

__all__ = ["Admission", "Guard", "Limits"]

log = logging.getLogger("amesh.transport")


@dataclass(frozen=True)
class Limits:
    """What a guarded listener allows connections that have not proven themselves."""

    #: seconds from the accept to a proven connection (TLS and the job key's proof)
    deadline: float = HANDSHAKE_TIMEOUT
    #: unproven connections from one address
    per_source: int = 32
    #: unproven connections in all
    total: int = 512
    #: descriptors kept free for the process's own work (at most a quarter of its limit)
    reserve: int = 256


@dataclass
class _Conn:
    """A connection on the guarded port, as first seen."""

    inode: int
    peer: str
    source: str
    since: float
    proven: bool = False


class Guard:
    """Watches the connections on ``port`` (see the module's docstring).

    Args:
        port: the guarded listener's port.
        limits: what it allows.
    """

    def __init__(self, port: int, limits: Limits) -> None:
        self._port = port
        self.limits = limits
        #: descriptor -> the connection it held at the last sweep
        self._conns: dict[int, _Conn] = {}
        #: proven pipes: id -> the peer's address (``ip:port``)
        self._proven: dict[int, str] = {}
        #: sockets that are not connections on the port (inode kept)
        self._others: dict[int, int] = {}
        self.shut = Counter[str]()
        self._log = RateLimitedLog(log, LOG_INTERVAL)

    def proven(self, pipe: int, peer: str) -> None:
        """Pipe ``pipe``, from ``peer`` (``ip:port``), said a good hello."""
        self._proven[pipe] = peer

    def gone(self, pipe: int) -> None:
        self._proven.pop(pipe, None)

    def sweep(self) -> None:
        """Look at the connections, and shut down those past the limits."""
        now = time.monotonic()
        try:
            fds = [int(name) for name in os.listdir("/proc/self/fd")]
        except OSError:  # no /proc: nothing to watch
            return
        conns: dict[int, _Conn] = {}
        others: dict[int, int] = {}
        for fd in fds:
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if not link.startswith("socket:["):
                continue
            inode = int(link[8:-1])
            known = self._conns.get(fd)
            if known is not None and known.inode == inode:
                conns[fd] = known
            elif self._others.get(fd) == inode:
                others[fd] = inode
            else:
                conn = self._look(fd, inode, now)
                if conn is None:
                    others[fd] = inode
                else:
                    conns[fd] = conn
        self._conns, self._others = conns, others
        proven = set(self._proven.values())
        unproven: list[tuple[int, _Conn]] = []
        for fd, conn in conns.items():
            if not conn.proven and conn.peer in proven:
                conn.proven = True
            if not conn.proven:
                unproven.append((fd, conn))
        self._enforce(unproven, len(fds), now)

    def _look(self, fd: int, inode: int, now: float) -> _Conn | None:
        """The connection on the guarded port that ``fd`` holds, or None."""
        try:
            dup = os.dup(fd)
        except OSError:  # closed meanwhile
            return None
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # not a socket any more (the number was reused)
            os.close(dup)
            return None
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                return None
            if sock.getsockname()[1] != self._port:
                return None
            host, port = sock.getpeername()[:2]
        except OSError:  # a listening socket (no peer), or one that ended
            return None
        finally:
            sock.close()
        peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return _Conn(inode, peer, host, now)

    def _enforce(self, unproven: list[tuple[int, _Conn]], open_fds: int, now: float) -> None:
        limits = self.limits
        unproven.sort(key=lambda item: item[1].since, reverse=True)  # newest first
        shut: Counter[str] = Counter()
        kept: list[tuple[int, _Conn]] = []  # newest first
        per: Counter[str] = Counter()
        for fd, conn in unproven:
            if now - conn.since >= limits.deadline:
                why = "past the deadline"
            elif per[conn.source] >= limits.per_source:
                why = "over the cap per address"
            else:
                per[conn.source] += 1
                kept.append((fd, conn))
                continue
            shut[self._shut(fd, conn, why)] += 1
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit == resource.RLIM_INFINITY:
            limit = 1 << 20  # the kernel's own ceiling (fs.nr_open's default)
        free = limit - open_fds + sum(shut.values())
        reserve = min(limits.reserve, limit // 4)  # (a low limit: keep a quarter free)
        excess = min(max(len(kept) - limits.total, reserve - free, 0), len(kept))
        for fd, conn in kept[len(kept) - excess :]:  # the oldest of those left
            shut[self._shut(fd, conn, "over the cap in all, or short of descriptors")] += 1
        del shut[""]
        if shut:
            self.shut.update(shut)
            self._log.warning(
                "shut down %d connections to port %d that did not prove themselves (%s)",
                sum(shut.values()),
                self._port,
                ", ".join(f"{n} {why}" for why, n in shut.items()),
            )

    def _shut(self, fd: int, conn: _Conn, why: str) -> str:
        """Shut ``fd``'s connection down if ``fd`` still holds it (NNG closes it):
        ``why``, or "" when it did not."""
        del self._conns[fd]
        try:
            dup = os.dup(fd)
        except OSError:  # closed meanwhile
            return ""
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # reused for something else
            os.close(dup)
            return ""
        with sock:
            try:
                if os.fstat(sock.fileno()).st_ino != conn.inode:
                    return ""  # closed, and the number reused: not ours to touch
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                return ""
        return why


class Admission:
    """:class:`Limits` for a listener that accepts its connections itself (a stream
    listener on tcp, an agent's ``stream+tcp://``): applied at each accept, exactly,
    where the :class:`Guard` of an NNG listener looks twice a second. The deadline
    is the connection's own timer; this keeps the caps, oldest first (see the
    module's docstring). The descriptors of unproven connections are bounded by
    :attr:`Limits.total`.

    Args:
        limits: what the listener allows.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        #: unproven connections (any hashable object) -> their source, oldest first
        self._unproven: dict[object, str] = {}

    def admit(self, conn: object, source: str) -> list[tuple[object, str]]:
        """Count ``conn``, just accepted from ``source``, as unproven; the older
        unproven connections to shed to make room for it, each with why."""
        shed: list[tuple[object, str]] = []
        same = [c for c, s in self._unproven.items() if s == source]
        if len(same) >= self.limits.per_source:
            shed.append((same[0], "over the cap per address"))
            del self._unproven[same[0]]
        if len(self._unproven) >= self.limits.total:
            oldest = next(iter(self._unproven))
            shed.append((oldest, "over the cap in all"))
            del self._unproven[oldest]
        self._unproven[conn] = source
        return shed

    def done(self, conn: object) -> None:
        """``conn`` proved itself, or ended."""
        self._unproven.pop(conn, None)
