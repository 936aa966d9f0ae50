"""Encrypted links between hosts, event-loop streams within one host.

A :class:`HybridTransport` is two transports under one address:

- an NNG transport over ``tls+tcp`` (:mod:`._tls`: both ends show a certificate of the
  job). Its address, ``tls+tcp://HOST:PORT/TAG`` (the tag only on a port the kernel
  picked: see :mod:`._tags`), is the process's identity everywhere;
- a :class:`~._stream.StreamTransport` on a Linux abstract socket named after that
  address (:func:`alias_of`). Abstract sockets belong to a network namespace, which is
  what "the same host" means here (the namespace hosts of the SLURM tests included):
  any process that can reach the alias runs on this host.

Sending to a ``tls+tcp`` address decides its route once (:func:`local_alias`): when a
process of this uid listens on the address's alias here, its frames go over streams to
the alias, else over TLS. The decision holds until the link breaks (reported, with the
``tls+tcp`` address, to the lost handler) or is forgotten; the next send decides again.
Other addresses go to the transport that speaks them (streams for ``stream+``, else
NNG).

Both routes prove the same address: the streams' handshake (:mod:`._auth`) claims the
``tls+tcp`` address as the dialer's (``identity``), so a receiver's ``peer`` is that
address whichever route a frame took, and a stream listener admits only holders of the
job key, as every amesh listener does.

Why the uid: an abstract name can be taken by any user of the namespace. A process of
another user that took the alias of an address (of a process on another host, say)
would otherwise get our frames in the clear. :func:`local_alias` reads who listens
(``SO_PEERCRED``) on a connection that it closes before sending a byte; the listener
does not count such a probe as a refused peer.

Without abstract sockets (not Linux), or when the alias is taken, every link goes over
TLS.

The TLS side's certificates come from the job key (:mod:`._tls`). A process that holds
no key yet when it opens the transport (a controller that will adopt the key of its
host agents, as :func:`amesh.attach` with ``key_file`` does) reserves its port and
opens the TLS listener there at its first send to a ``tls+tcp`` (or NNG) address: its
address is known to nobody before it has sent something, and its key is final then.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from .._identity import has_key, same_process
from ._base import Deliver, Transport, TransportClosed, TransportStats
from ._frame import DEFAULT_MAX_FRAME, Frame
from ._guard import Limits
from ._stream import StreamTransport, is_stream_address
from ._stream_io import spawn_system_task
from ._tags import listening_address, tag_of

__all__ = [
    "TLS_PREFIX",
    "HostStreams",
    "HybridTransport",
    "alias_of",
    "local_alias",
    "local_route",
    "open_tls",
]

log = logging.getLogger(__name__)

TLS_PREFIX = "tls+tcp://"
_ALIAS = "amesh-via-"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ABSTRACT = sys.platform == "linux"


def alias_of(addr: str) -> str:
    """The name of the abstract socket where the process at ``addr`` (a ``tls+tcp``
    address) listens for processes of its host."""
    return _ALIAS + hashlib.sha256(addr.encode()).hexdigest()[:20]


def local_alias(addr: str) -> str | None:
    """The stream address of ``addr``'s alias when a process of this uid listens there
    in this network namespace, else None (``addr`` is not ``tls+tcp``, nobody listens,
    or a process of another uid does: then it is logged).

    The probe connects without blocking (a unix connect to an abstract name succeeds or
    fails at once), reads the listener's uid and closes before sending a byte.
    """
    if not _ABSTRACT or not addr.startswith(TLS_PREFIX):
        return None
    name = alias_of(addr)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            sock.connect("\0" + name)
            pid, uid, _ = _CRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
            )
        except OSError:  # nobody listens (or its backlog is full): over TLS
            return None
    if uid != os.getuid():
        log.warning(
            "the local alias of %s is held by pid %d of uid %d, not of ours: sending to it "
            "over TLS",
            addr,
            pid,
            uid,
        )
        return None
    return f"stream+abstract://{name}"


def local_route(addr: str) -> str:
    """Where to send to ``addr`` from this host: its alias when :func:`local_alias`
    finds one, else ``addr`` itself (heartbeat senders use this)."""
    return local_alias(addr) or addr


def open_tls(
    host: str,
    port: int = 0,
    max_frame: int = DEFAULT_MAX_FRAME,
    tag: str = "",
    guard: Limits | None = None,
) -> Transport:
    """The NNG transport on ``tls+tcp://HOST:PORT``, tagged when the kernel picks the
    port or ``tag`` is given (see :mod:`._tags`); its listener guarded by ``guard``
    (see :mod:`._guard`) when given.

    Raises:
        ImportError: pynng is not installed.
    """
    from ._ext import ExtTransport

    return ExtTransport("tls+tcp", host=host, port=port, max_frame=max_frame, tag=tag, guard=guard)


def _reserve(host: str, port: int) -> tuple[socket.socket, str]:
    """A tcp socket bound to ``host`` and ``port`` (0: one the kernel picks), not
    listening: it keeps the port ours until the TLS listener takes it over. And the
    ``tls+tcp`` address that listener will have (tagged if the kernel picked the port)."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((bare, port))
        bound = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    shown = f"[{bare}]" if ":" in bare else bare
    return sock, listening_address(f"{TLS_PREFIX}{shown}:{bound}", port)


#: A route: the transport that carries frames to an address, and where it sends them.
_Route = tuple[Transport, str]
_NOTHING = TransportStats(0, 0, 0, 0, 0, 0)


class HybridTransport:
    """See :class:`amesh._transport.Transport`, and this module's docstring (which says
    when the TLS side opens).

    Args:
        host: the address to listen on for tls+tcp.
        port: the tls+tcp port to listen on (0: one the kernel picks).
        max_frame: the largest frame accepted, in bytes, by either route.
        guard: the limits of the TLS listener's connections not proven yet (see
            :mod:`._guard`); None: no guard.

    Raises:
        OSError: the port is taken.
        ValueError: bad ``AMESH_TLS_*`` settings (see :mod:`._tls`), when the TLS side
            opens at once.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        port: int = 0,
        max_frame: int = DEFAULT_MAX_FRAME,
        guard: Limits | None = None,
    ) -> None:
        self._host = host
        self._max_frame = max_frame
        self._guard = guard
        self._closed = False
        self._tls: Transport | None = None
        self._streams: StreamTransport | None = None
        self._reserved: socket.socket | None = None
        #: why the TLS side failed to open ("": it did not)
        self._tls_failed = ""
        #: set when the TLS side opens, for a serve() that started before
        self._tls_opened: anyio.Event | None = None
        #: address -> its route, for the ``tls+tcp`` addresses sent to
        self._routes: dict[str, _Route] = {}
        #: alias in use -> the ``tls+tcp`` address it stands for
        self._canonical: dict[str, str] = {}
        self._lost_handler: Callable[[str, str], None] | None = None
        if has_key():
            self._tls = open_tls(host, port, max_frame, guard=guard)
            self._address = self._tls.address
        else:
            self._reserved, self._address = _reserve(host, port)
        if _ABSTRACT:
            try:
                self._streams = StreamTransport(
                    "abstract",
                    name=alias_of(self._address),
                    identity=self._address,
                    max_frame=max_frame,
                )
            except OSError as exc:  # taken: by a process of another user, say
                log.warning(
                    "cannot listen on the local alias of %s (%s): every link goes over TLS",
                    self._address,
                    exc,
                )
            except BaseException:
                self.close()
                raise

    @property
    def address(self) -> str:
        return self._address

    @property
    def max_frame(self) -> int:
        return self._max_frame

    @property
    def alias(self) -> str | None:
        """The stream address processes of this host reach us at (None: none)."""
        return None if self._streams is None else self._streams.address

    def _open_tls(self) -> Transport:
        """The TLS side, opened on the reserved port if it is not yet.

        Raises:
            TransportClosed: the transport is closed.
            RuntimeError: the TLS side failed to open (now or before).
        """
        tls = self._tls
        if tls is not None:
            return tls
        if self._closed:
            raise TransportClosed("transport is closed")
        reserved, self._reserved = self._reserved, None
        if reserved is None:
            raise RuntimeError(f"the TLS listener of {self._address} failed: {self._tls_failed}")
        port = reserved.getsockname()[1]
        reserved.close()
        try:
            tls = open_tls(self._host, port, self._max_frame, tag_of(self._address), self._guard)
            if tls.address != self._address:  # peers prove themselves to this address
                tls.close()
                raise RuntimeError(f"the TLS listener came up at {tls.address}")
        except Exception as exc:
            self._tls_failed = str(exc) or type(exc).__name__
            raise
        self._tls = tls
        if self._lost_handler is not None:
            tls.set_lost_handler(self._lost)
        if self._tls_opened is not None:
            self._tls_opened.set()
        return tls

    # -- routes ----------------------------------------------------------------------

    def _route(self, addr: str) -> _Route:
        """The route to ``addr``: decided (and kept) on the first send to a ``tls+tcp``
        address, fixed for the others."""
        route = self._routes.get(addr)
        if route is not None:
            return route
        streams = self._streams
        if streams is not None and is_stream_address(addr):
            return streams, addr
        tls = self._open_tls()  # the job key is final by now
        if streams is None or not addr.startswith(TLS_PREFIX):
            return tls, addr
        alias = local_alias(addr)
        if alias is None:
            route = tls, addr
        else:
            route = streams, alias
            self._canonical[alias] = addr
            same_process(alias, addr)
        self._routes[addr] = route
        return route

    def routes(self) -> dict[str, TransportStats]:
        """The counters of each route: ``"stream"`` (within this host) and ``"tls"``."""
        return {
            "stream": _NOTHING if self._streams is None else self._streams.statistics(),
            "tls": _NOTHING if self._tls is None else self._tls.statistics(),
        }

    # -- the Transport protocol ------------------------------------------------------

    def try_send(self, addr: str, frame: Frame) -> bool:
        transport, target = self._route(addr)
        return transport.try_send(target, frame)

    async def send(self, addr: str, frame: Frame) -> None:
        transport, target = self._route(addr)
        await transport.send(target, frame)

    def forget(self, addr: str) -> None:
        route = self._routes.pop(addr, None)
        if route is not None:
            transport, target = route
            self._canonical.pop(target, None)
            transport.forget(target)
        elif self._streams is not None and is_stream_address(addr):
            self._streams.forget(addr)
        elif self._tls is not None:
            self._tls.forget(addr)

    def _lost(self, addr: str, why: str) -> None:
        """A link of either route broke: report it under the address it stands for."""
        canonical = self._canonical.pop(addr, addr)
        self._routes.pop(canonical, None)
        handler = self._lost_handler
        if handler is not None:
            handler(canonical, why)

    def set_lost_handler(self, handler: Callable[[str, str], None] | None) -> None:
        self._lost_handler = handler
        for t in self._opened():
            t.set_lost_handler(None if handler is None else self._lost)

    async def serve(self, deliver: Deliver) -> None:
        if self._closed:
            raise TransportClosed("transport is closed")
        error: Exception | None = None

        async def run(transport: Transport | None) -> None:
            nonlocal error
            try:
                if transport is None:  # the TLS side, once it opens
                    opened = self._tls_opened = anyio.Event()
                    if self._tls is None and not self._closed:
                        await opened.wait()
                    transport = self._open_tls()
                await transport.serve(deliver)
            except Exception as exc:  # raised below, not wrapped in a group
                error = error or exc
            tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, self._tls)
                if self._streams is not None:
                    tg.start_soon(run, self._streams)
        finally:
            self._tls_opened = None
        raise error or TransportClosed("transport is closed")

    def statistics(self) -> TransportStats:
        stats = [t.statistics() for t in self._opened()]
        return TransportStats(
            frames_sent=sum(s.frames_sent for s in stats),
            frames_received=sum(s.frames_received for s in stats),
            bytes_sent=sum(s.bytes_sent for s in stats),
            bytes_received=sum(s.bytes_received for s in stats),
            peers=sum(s.peers for s in stats),
            auth_refused=sum(s.auth_refused for s in stats),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._opened():
            t.close()
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        if self._tls_opened is not None:  # a serve() waiting for the TLS side ends
            self._tls_opened.set()
        self._routes.clear()
        self._canonical.clear()

    def _opened(self) -> list[Transport]:
        return [t for t in (self._tls, self._streams) if t is not None]


class _Dropped:
    """The link to a ``tls+tcp`` address with no local alias (another host's, or
    gone): it takes every frame and drops it; its loss is reported."""

    __slots__ = ()
    waiters = 0
    fast = None
    closed = True
    lock = None

    def try_write(self, bufs: Any, total: int) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def write(self, bufs: Any, total: int) -> None:
        pass


_DROPPED: Any = _Dropped()


class HostStreams(StreamTransport):
    """A :class:`~._stream.StreamTransport` that also reaches the ``tls+tcp`` processes
    of this host, at their alias (see :func:`local_alias`).

    Plain streams cannot dial ``tls+tcp``: without this, a process on streams (the
    default transport, this machine's own agent) could not answer a controller of the
    same host started with ``AMESH_TRANSPORT=tcp``, nor call the workers of one: its
    frames were dropped (a persistent mesh's ``hosts.info`` timed out). The link to
    such an address is its alias's, found once, when the first frame to it makes the
    link: the transport's table holds it under both addresses, so that a frame goes
    as any other (no step of its own per frame), and its loss is reported under the
    ``tls+tcp`` address. One with no alias here is another host's: its frames are
    dropped, and the link reported lost.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: alias -> the ``tls+tcp`` address whose link it is
        self._canonical: dict[str, str] = {}

    def _link(self, addr: str) -> Any:
        if not addr.startswith(TLS_PREFIX):
            return super()._link(addr)
        alias = local_alias(addr)
        if alias is None:
            self._unreachable(addr)
            return _DROPPED
        link = super()._link(alias)
        self._links[addr] = link
        self._canonical[alias] = addr
        same_process(alias, addr)
        return link

    def _unreachable(self, addr: str) -> None:
        """Report the link to ``addr`` lost, from the event loop, as a refused dial is
        (its frames are dropped): its calls fail now, not when they time out."""
        handler = self._lost_handler
        if handler is None:
            return
        why = (
            "no process of this host listens at its local alias: it is gone, or on "
            "another host, which plain streams do not reach"
        )

        async def report() -> None:
            handler(addr, why)

        self._fast()  # (finds which event loop runs this)
        spawn_system_task(self._backend, report, self._tasks)

    def _unalias(self, link: Any) -> str | None:
        """If ``link`` is the link of a ``tls+tcp`` address (see :meth:`_link`), take
        it out of the table under both its addresses and return that one; else None."""
        alias: str = link.addr
        canonical = self._canonical.pop(alias, None)
        if canonical is not None:
            for key in (alias, canonical):
                if self._links.get(key) is link:
                    del self._links[key]
        return canonical

    def _link_lost(self, link: Any, why: str) -> None:
        canonical = self._unalias(link)
        if canonical is None:
            super()._link_lost(link, why)
            return
        handler = self._lost_handler
        if handler is not None and not self._closed:
            handler(canonical, why)

    def statistics(self) -> TransportStats:
        stats = super().statistics()  # (an alias's link counts once)
        return msgspec.structs.replace(stats, peers=stats.peers - len(self._canonical))

    def forget(self, addr: str) -> None:
        # (by either of its addresses: the link of a tls+tcp address goes under both)
        link = self._links.get(addr)
        if link is not None and self._unalias(link) is not None:
            link.close(drop=True)
            return
        super().forget(addr)
