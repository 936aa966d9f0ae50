"""Transport over plain stream sockets, with its I/O on the event loop.

Every frame travels as a 4-byte little-endian length followed by the frame's bytes.
A transport listens on one socket and accepts any number of connections; towards each
peer it keeps one outbound connection, dialled on the first send. Frames on one
connection arrive in the order they were written, which gives the ordering of one
sender to one receiver that :class:`~amesh._transport.Transport` promises.

Addresses say what they are, so that neither NNG nor this transport dials the other's
protocol:

- ``stream+abstract://NAME``: a Linux abstract unix socket (no file);
- ``stream+ipc:///PATH.sock``: a unix socket file under
  :func:`~amesh._transport._paths.ipc_dir`, removed at :meth:`StreamTransport.close`;
- ``stream+tcp://HOST:PORT`` (``[HOST]`` for IPv6): always a numeric host, the one the
  listener is bound to, and the real port when it was asked for port 0, followed then
  by a tag (``stream+tcp://HOST:PORT/TAG``: see :mod:`._tags`).

On asyncio (uvloop in amesh's processes) the loop's own protocols do the I/O: inbound
connections are read by a :class:`asyncio.BufferedProtocol` that splits frames straight
out of its buffer, and a frame is written with one ``writev`` of the length and its
parts when the connection has nothing buffered. On trio, and on asyncio when
:attr:`StreamTransport.fast_asyncio` is off, non-blocking sockets are driven with
anyio's ``wait_readable``/``wait_writable``: a reader task per inbound connection inside
:meth:`~StreamTransport.serve` and a background task per outbound link.

Back-pressure: a link accepts frames while less than :data:`HIGH_WATER` bytes wait in
user space (frames queued until the connection is up, and whatever the kernel did not
take yet). Above that ``try_send`` says False and ``send`` waits for the link to drain;
waiting senders keep their turn, so a ``try_send`` never overtakes them.

Authentication: every connection opens with the handshake of :mod:`._auth`. The
listener checks a unix socket peer's uid, sends a fresh challenge and reads the
dialer's answer into a :class:`~._auth.Gate`; not one byte reaches the frame reader
before the answer is proven right. A peer that fails (wrong uid, wrong proof, garbage,
nothing within :data:`~._auth.HANDSHAKE_TIMEOUT`) is closed at once, counted
(``auth_refused``) and logged, rate-limited. The dialer waits for the challenge once
per connection and pipelines its frames behind its answer.

Peers going away: a link dials on its first frame and, while the listener is not
there yet (refused, no such socket), dials again (10 ms, doubling to 200 ms) for
:data:`~._base.FIRST_CONNECT_WINDOW` seconds. When that fails, the listener refuses
the handshake, or an established connection ends (EOF, reset), the link is dropped
with whatever it held, and the handler of :meth:`~StreamTransport.set_lost_handler`
hears of it on the event loop; senders waiting on it get :class:`TransportClosed`,
and a later send dials afresh. Frames written into a connection that breaks are lost.
The owner calls :meth:`~StreamTransport.forget` when it learns the peer is gone, which
drops the link (reporting nothing) and wakes its waiting senders with
:class:`TransportClosed`.

Frames are the sender's again when ``try_send``/``send`` return: what the kernel did not
take at once is kept by reference when it is immutable ``bytes``, and copied otherwise.
Frames are delivered as ``bytes`` when small and as a writable memoryview of a
``bytearray`` of their own when large; in both cases the receiver may keep them.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import sys
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

import anyio
import sniffio

from .._ratelog import RateLimitedLog
from ._auth import HANDSHAKE_TIMEOUT, LOG_INTERVAL, Refusals
from ._base import Deliver, TransportClosed, TransportStats
from ._frame import DEFAULT_MAX_FRAME, Frame
from ._guard import Admission, Limits
from ._paths import ensure_ipc_dir
from ._stream_aio import AioInbound, AioLink
from ._stream_anyio import AnyioInbound, AnyioLink
from ._stream_framing import (
    HEADER,
    HLEN,
    MAX_SIZE,
    PREFIX,
    AnyReader,
    BadStream,
    Buf,
    Reader,
    StreamBeat,
    byte_view,
    c_reader,
    cut_frames_py,
    fresh_address,
    is_stream_address,
    nbytes,
    parse_address,
)
from ._stream_io import BATCH_FRAME, HIGH_WATER, notify_closing_quietly, spawn_system_task
from ._tags import listening_address

__all__ = ["HIGH_WATER", "StreamBeat", "StreamTransport", "is_stream_address", "parse_address"]

log = logging.getLogger(__name__)

#: Seconds the anyio accept loop rests after running out of descriptors (or memory).
_ACCEPT_REST = 0.1
#: Connections accepted per wake-up of the listener, at most (then other work runs).
_ACCEPT_BATCH = 64
#: accept()'s errors that say this process (or the system) is out of something: rest.
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_accept_errors = RateLimitedLog(log, LOG_INTERVAL)


def _listen(
    scheme: str, host: str, port: int = 0, name: str = ""
) -> tuple[socket.socket, str, str | None]:
    """A non-blocking listening socket on a fresh address (for tcp: on ``port``, 0 for
    one the kernel picks; for abstract: on ``name`` when given): (socket, address, ipc
    path)."""
    scheme = scheme.removeprefix(PREFIX)
    if scheme == "auto":
        scheme = "abstract" if sys.platform == "linux" else "ipc"
    if name and scheme != "abstract":
        raise ValueError(f"only an abstract socket listens on a given name, not {scheme!r}")
    addr = f"{PREFIX}abstract://{name}" if name else fresh_address(scheme, host.strip("[]"), port)
    family, sockaddr = parse_address(addr)
    if scheme == "ipc":
        ensure_ipc_dir()
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        if port:  # a well-known port (an agent's): take it again at once after a restart
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        if scheme == "tcp":  # report the port the kernel picked, under a tag
            bound_host, bound = sock.getsockname()[:2]
            shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
            addr = listening_address(f"{PREFIX}tcp://{shown}:{bound}", port)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock, addr, sockaddr if isinstance(sockaddr, str) and scheme == "ipc" else None


# -- the transport -----------------------------------------------------------------------

_Link = AioLink | AnyioLink
_Inbound = AioInbound | AnyioInbound


class StreamTransport:
    """See :class:`amesh._transport.Transport`, and this module's docstring.

    Args:
        scheme: ``abstract``, ``ipc``, ``tcp`` or ``auto`` (abstract on Linux, else
            ipc); a ``stream+`` prefix is allowed.
        host: the address to listen on for tcp.
        port: the tcp port to listen on (0: one the kernel picks).
        max_frame: the largest frame accepted, in bytes (sent and received; at most
            2**32 - 1).
        name: for ``abstract``, the name to listen on (else a fresh one).
        identity: the address this transport's links prove they speak for (see
            :mod:`._auth`), and so the ``peer`` their frames arrive from; its own
            address unless given (a :class:`~._hybrid.HybridTransport` gives its
            ``tls+tcp`` address).
        guard: for a listener open to other hosts, the deadline and caps of the
            connections that have not proven themselves (see :mod:`._guard`); None:
            :data:`~._auth.HANDSHAKE_TIMEOUT`, and no caps.

    Raises:
        ValueError: an unknown scheme, ``max_frame`` out of range, or a ``name`` for
            another scheme than ``abstract``.
        OSError: the address is taken (``name``, or a tcp ``port``).
    """

    #: On asyncio, do the I/O with the loop's protocols (else as on trio).
    fast_asyncio: ClassVar[bool] = True
    #: Cut inbound frames with the C extension (``amesh._native._ext.cut_frames``) where it
    #: is built; False: always the pure-Python fallback (both pass the same tests).
    accelerated: ClassVar[bool] = True
    #: On asyncio, batch a link's small frames per turn of the event loop (the turn's
    #: first goes at once, the rest in one ``writev`` at its end).
    batch_writes: ClassVar[bool] = True

    def __init__(
        self,
        scheme: str = "auto",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame: int = DEFAULT_MAX_FRAME,
        name: str = "",
        identity: str = "",
        guard: Limits | None = None,
    ) -> None:
        if not 0 <= max_frame <= MAX_SIZE:
            raise ValueError(f"max_frame must be between 0 and {MAX_SIZE}, not {max_frame}")
        self._max_frame = max_frame
        self._closed = False
        self._links: dict[str, _Link] = {}
        self._inbound: set[_Inbound] = set()
        #: Frames received while nobody served (or after ``deliver`` failed).
        self._backlog: deque[tuple[Buf, str]] = deque()
        self._deliver: Deliver | None = None
        self._serving = False
        self._serve_error: BaseException | None = None
        self._wake_serve: Callable[[], None] | None = None
        self._backend = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        #: the rest of the accepts on a selector loop, out of descriptors
        self._accept_rest: asyncio.TimerHandle | None = None
        self._tasks: set[Any] = set()
        self._sent = self._received = self._bytes_sent = self._bytes_received = 0
        self._lost_handler: Callable[[str, str], None] | None = None
        self._lsock, self._address, self._ipc_path = _listen(scheme, host, port, name)
        self._identity = identity or self._address
        self._refusals = Refusals(self._address)
        #: the caps on connections not proven yet, for a listener open to other hosts
        #: (on asyncio, where the agents run: see :class:`~._guard.Admission`)
        self._admission = None if guard is None else Admission(guard)
        #: seconds an inbound connection has from its accept to prove itself
        self.deadline = HANDSHAKE_TIMEOUT if guard is None else guard.deadline

    @property
    def address(self) -> str:
        return self._address

    @property
    def max_frame(self) -> int:
        return self._max_frame

    def reader(self, emit: Callable[[Buf], None]) -> AnyReader:
        """A reader for one inbound connection that hands each frame to ``emit``: the
        C extension's where it is built, else :class:`Reader`. The pure-Python fallback
        uses :class:`Reader` with :func:`cut_frames_py`."""
        if self.accelerated:
            reader = c_reader(self._max_frame, emit)
            if reader is not None:
                return reader
        return Reader(self._max_frame, emit, None if self.accelerated else cut_frames_py)

    def _fast(self) -> bool:
        """Pick the backend on first use: asyncio protocols, or anyio."""
        if not self._backend:
            try:
                self._backend = sniffio.current_async_library()
            except sniffio.AsyncLibraryNotFoundError:
                # A loop callback (a deliver, say) runs outside any task.
                asyncio.get_running_loop()
                self._backend = "asyncio"
            if self._backend == "asyncio":
                self._loop = asyncio.get_running_loop()
        return self._backend == "asyncio" and self.fast_asyncio

    # -- sending ---------------------------------------------------------------------

    def _frame(self, frame: Frame) -> tuple[list[Buf], int, int]:
        """The buffers to write for ``frame`` (length first), their total, its size."""
        if self._closed:
            raise TransportClosed("transport is closed")
        if isinstance(frame, bytes):  # the common case: no list to walk
            size = len(frame)
            if size <= self._max_frame:
                return [HEADER.pack(size), frame], size + HLEN, size
            parts: list[Buf] = [frame]
        else:
            if isinstance(frame, list):
                parts = [p if isinstance(p, bytes) else byte_view(p) for p in frame]
            else:
                parts = [byte_view(frame)]
            size = nbytes(parts)
        if size > self._max_frame:
            raise ValueError(
                f"message of {size} bytes exceeds the transport limit of {self._max_frame} bytes"
            )
        return [HEADER.pack(size), *parts], size + HLEN, size

    def _link(self, addr: str) -> _Link:
        link = self._links.get(addr)
        if link is None:
            if self._closed:
                raise TransportClosed("transport is closed")
            family, sockaddr = parse_address(addr)
            if self._fast():
                assert self._loop is not None
                link = AioLink(
                    self._loop,
                    addr,
                    family,
                    sockaddr,
                    self._identity,
                    self._link_lost,
                    self.batch_writes,
                    min(BATCH_FRAME, self._max_frame) if self.accelerated else None,
                )
            else:
                link = AnyioLink(addr, family, sockaddr, self._identity, self._link_lost)
                spawn_system_task(self._backend, link.run, self._tasks)
            self._links[addr] = link
        return link

    def _link_lost(self, link: _Link, why: str) -> None:
        """A link broke (on the event loop): drop it and report it, unless it was
        forgotten or the transport closed meanwhile."""
        if self._links.get(link.addr) is not link:
            return
        del self._links[link.addr]
        handler = self._lost_handler
        if handler is not None and not self._closed:
            handler(link.addr, why)
        else:
            log.debug("lost the link to %s: %s", link.addr, why)

    def set_lost_handler(self, handler: Callable[[str, str], None] | None) -> None:
        self._lost_handler = handler

    def try_send(self, addr: str, frame: Frame) -> bool:
        link = self._links.get(addr)
        if link is not None and link.fast is not None and not link.waiters:
            # the common case: a small frame, written (or batched) by the C extension
            taken = link.fast.send(frame)
            if taken:
                if taken < 0:
                    link.fail("the connection broke")
                self._sent += 1
                self._bytes_sent += len(frame)
                return True
        bufs, total, size = self._frame(frame)
        link = link or self._link(addr)
        if link.waiters or not link.try_write(bufs, total):
            return False
        self._sent += 1
        self._bytes_sent += size
        return True

    async def send(self, addr: str, frame: Frame) -> None:
        bufs, total, size = self._frame(frame)
        link = self._links.get(addr) or self._link(addr)
        if not link.waiters and link.writable():
            link.write(bufs, total)
        else:
            # Wait for room, in turn with other waiting senders.
            if link.lock is None:
                link.lock = anyio.Lock()
            link.waiters += 1
            try:
                async with link.lock:
                    while True:
                        if self._closed:
                            raise TransportClosed("transport is closed")
                        if link.closed:
                            raise TransportClosed(f"link to {addr} was closed")
                        if link.writable():
                            break
                        await link.wait_space()
                    link.write(bufs, total)
            finally:
                link.waiters -= 1
        self._sent += 1
        self._bytes_sent += size

    def forget(self, addr: str) -> None:
        link = self._links.pop(addr, None)
        if link is not None:
            link.close(drop=True)

    # -- receiving -------------------------------------------------------------------

    async def serve(self, deliver: Deliver) -> None:
        if self._closed:
            raise TransportClosed("transport is closed")
        if self._serving:
            raise RuntimeError("serve() is already running")
        self._serving = True
        try:
            if self._fast():
                await self._serve_asyncio(deliver)
            else:
                await self._serve_anyio(deliver)
        finally:
            self._serving = False
            self._deliver = self._wake_serve = None
        error, self._serve_error = self._serve_error, None
        if error is not None:
            raise error
        raise TransportClosed("transport is closed")

    def _start_serving(self, deliver: Deliver) -> None:
        """Deliver the backlog, then deliver as frames come."""
        while self._backlog and not self._closed:
            frame, peer = self._backlog.popleft()
            self._received += 1
            self._bytes_received += len(frame)
            deliver(frame, peer)
        if self._closed:
            raise TransportClosed("transport is closed")
        self._deliver = deliver
        for conn in list(self._inbound):
            conn.resume()

    def _inbound_frame(self, frame: Buf, conn: _Inbound) -> None:
        deliver = self._deliver
        if deliver is None:
            self._backlog.append((frame, conn.peer))
            conn.pause()
            return
        self._received += 1
        self._bytes_received += len(frame)
        try:
            deliver(frame, conn.peer)
        except BaseException as exc:  # serve() raises it; later frames wait in the backlog
            self._serve_error = exc
            self._deliver = None
            if self._wake_serve is not None:
                self._wake_serve()

    async def _serve_asyncio(self, deliver: Deliver) -> None:
        loop = self._loop
        assert loop is not None
        if isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop):
            # asyncio's own server, out of descriptors, logs a traceback and schedules
            # a retry for each of up to `backlog` (4,096) accepts it tries in a row,
            # and each retry does the same: ~360,000 lines in 3 s, a core busy (3.11 to
            # 3.13). Accept here instead (uvloop's server rests quietly). The reader is
            # added with no await before it, so that close() removes it whenever it
            # comes: asyncio's server adds it, then yields once, and a transport closed
            # in that turn left it behind; the next listener, given the same descriptor
            # number, was then never watched (test_one_transport_after_another_...).
            if self._accept_rest is None:
                loop.add_reader(self._lsock.fileno(), self._accept_ready)
        elif self._server is None:
            if self._lsock.family == socket.AF_UNIX:
                self._server = await loop.create_unix_server(
                    lambda: AioInbound(self), sock=self._lsock, backlog=socket.SOMAXCONN
                )
            else:
                self._server = await loop.create_server(
                    lambda: AioInbound(self), sock=self._lsock, backlog=socket.SOMAXCONN
                )
        ended: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ended.done():
                ended.set_result(None)

        self._wake_serve = wake
        self._start_serving(deliver)
        await ended

    def _accept_ready(self) -> None:
        """The listener is readable (on a selector loop): accept what waits, up to
        :data:`_ACCEPT_BATCH`; out of descriptors, rest :data:`_ACCEPT_REST` seconds
        (the listener stays readable: at once would spin), saying so once per
        :data:`~._auth.LOG_INTERVAL`."""
        loop = self._loop
        assert loop is not None
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _ = self._lsock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF:
                    raise  # the loop logs it (the listener broke: not a flood)
                _accept_errors.warning("cannot accept a connection on %s: %s", self._address, exc)
                loop.remove_reader(self._lsock.fileno())
                self._accept_rest = loop.call_later(_ACCEPT_REST, self._accept_again)
                return
            sock.setblocking(False)
            task = loop.create_task(loop.connect_accepted_socket(lambda: AioInbound(self), sock))
            self._tasks.add(task)
            task.add_done_callback(self._accepted)

    def _accept_again(self) -> None:
        self._accept_rest = None
        if not self._closed and self._loop is not None:
            self._loop.add_reader(self._lsock.fileno(), self._accept_ready)

    def _accepted(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # gone meanwhile
            log.debug("an accepted connection failed: %s", task.exception())

    async def _serve_anyio(self, deliver: Deliver) -> None:
        self._start_serving(deliver)
        async with anyio.create_task_group() as tg:
            self._wake_serve = tg.cancel_scope.cancel
            tg.start_soon(self._accept, tg)
            for conn in list(self._inbound):
                assert isinstance(conn, AnyioInbound)
                tg.start_soon(self._read, conn)

    async def _accept(self, tg: anyio.abc.TaskGroup) -> None:
        lsock = self._lsock
        try:
            while True:
                await anyio.wait_readable(lsock)
                try:
                    sock, _ = lsock.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        raise
                    # one line per LOG_INTERVAL, and a rest before the next try: the
                    # listener stays readable, so an immediate retry would spin
                    _accept_errors.warning(
                        "cannot accept a connection on %s: %s", self._address, exc
                    )
                    await anyio.sleep(_ACCEPT_REST)
                    continue
                sock.setblocking(False)
                conn = AnyioInbound(self, sock)
                self._inbound.add(conn)
                tg.start_soon(self._read, conn)
        except anyio.ClosedResourceError:
            pass
        tg.cancel_scope.cancel()

    async def _read(self, conn: AnyioInbound) -> None:
        reader, sock = conn.reader, conn.sock
        try:
            try:
                opened = await conn.handshake()
            except BadStream as exc:  # in the frames behind the answer
                log.warning("dropping an inbound connection from %s: %s", conn.peer, exc)
                opened = False
            if not opened:
                self._inbound.discard(conn)
                conn.abort()
                return
            while not reader.stopped:
                await anyio.wait_readable(sock)
                try:
                    n = sock.recv_into(reader.get_buffer())
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    n = 0
                if n == 0:  # the peer closed its end
                    self._inbound.discard(conn)
                    conn.abort()
                    return
                try:
                    reader.buffer_updated(n)
                except BadStream as exc:
                    log.warning("dropping an inbound connection from %s: %s", conn.peer, exc)
                    self._inbound.discard(conn)
                    conn.abort()
                    return
        except anyio.ClosedResourceError:
            pass

    # -- the rest --------------------------------------------------------------------

    def statistics(self) -> TransportStats:
        return TransportStats(
            frames_sent=self._sent,
            frames_received=self._received,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            peers=len(self._links),
            auth_refused=self._refusals.count,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A closed asyncio loop has closed its transports and ended its tasks already.
        loop_alive = self._loop is None or not self._loop.is_closed()
        links, self._links = list(self._links.values()), {}
        for link in links:
            if loop_alive:
                link.close(drop=False)
            else:
                link.closed = True
        inbound, self._inbound = list(self._inbound), set()
        self._backlog.clear()
        if loop_alive:
            for conn in inbound:
                conn.abort()
            if self._server is not None:
                self._server.close()
            elif self._loop is not None:  # (our own accepts: see _serve_asyncio)
                self._loop.remove_reader(self._lsock.fileno())
                if self._accept_rest is not None:
                    self._accept_rest.cancel()
        if self._server is None:
            notify_closing_quietly(self._lsock)
        self._lsock.close()
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
        if self._wake_serve is not None and loop_alive:
            self._wake_serve()
