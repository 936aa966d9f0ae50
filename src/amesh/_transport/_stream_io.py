"""The stream transport's connections: asyncio protocols, and anyio-driven sockets.

:class:`~amesh._transport._stream.StreamTransport` owns them; see its module for the
design.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio

from ._stream_wire import NOSIGNAL, BadStream, Buf, Reader, SockAddr, nbytes, owned, tail

if TYPE_CHECKING:
    from ._stream import StreamTransport

__all__ = [
    "HIGH_WATER",
    "AioInbound",
    "AioLink",
    "AnyioInbound",
    "AnyioLink",
    "notify_closing_quietly",
    "spawn_system_task",
]

log = logging.getLogger("amesh._transport._stream")

#: A link takes frames while fewer bytes than this wait in user space for its peer.
HIGH_WATER = 2 * 1024 * 1024
#: asyncio resumes a paused link once its write buffer is below this.
LOW_WATER = HIGH_WATER // 4
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_RETRY_MIN = 0.01
_RETRY_MAX = 0.2
_CONNECT_TIMEOUT = 5.0


# -- asyncio: the loop's protocols do the I/O --------------------------------------------


class AioInbound(asyncio.BufferedProtocol):
    """One accepted connection, read by the event loop straight into a :class:`Reader`."""

    def __init__(self, owner: StreamTransport) -> None:
        self._owner = owner
        self._reader = Reader(owner.max_frame, self._emit)
        self._transport: asyncio.Transport | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's
        self._transport = transport = cast(asyncio.Transport, transport)
        if self._owner._closed:
            transport.abort()
            return
        self._owner._inbound.add(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self._reader.buffer_updated(nbytes)
        except BadStream as exc:
            log.warning("dropping an inbound connection: %s", exc)
            self.abort()

    def _emit(self, frame: Buf) -> None:
        self._owner._inbound_frame(frame, self)

    def eof_received(self) -> bool | None:
        return None  # close our end too

    def connection_lost(self, exc: BaseException | None) -> None:
        self._reader.stopped = True
        self._owner._inbound.discard(self)

    def pause(self) -> None:
        if not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def abort(self) -> None:
        self._reader.stopped = True
        if self._transport is not None:
            self._transport.abort()


class AioConn(asyncio.Protocol):
    """The current connection of an :class:`AioLink`."""

    def __init__(self, link: AioLink) -> None:
        self._link = link
        self.transport: asyncio.Transport | None = None
        self._fd = -1
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        link = self._link
        if link.closed:
            transport.abort()
            return
        self._fd = transport.get_extra_info("socket").fileno()
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        # Frames queued while connecting go first, before anyone can write more.
        pending, link.pending, link.pending_bytes = link.pending, deque(), 0
        link.conn = self
        if pending:
            transport.writelines([b for bufs in pending for b in bufs])
        link.wake()

    def connection_lost(self, exc: BaseException | None) -> None:
        link = self._link
        if link.conn is self:
            link.conn = None
        if link.pending and not link.closed:
            link.connect_soon()
        link.wake()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._link.wake()

    def data_received(self, data: bytes) -> None:
        pass  # peers never write back on a link

    def eof_received(self) -> bool | None:
        return None  # the peer closed: close our end, and dial again when needed

    def write(self, bufs: list[Buf], total: int) -> bool:
        """Write one frame; False (nothing of it written) if the connection broke."""
        tr = self.transport
        assert tr is not None
        if tr.get_write_buffer_size():
            tr.writelines(owned(bufs, total))
            return True
        # Nothing is buffered: hand the frame to the kernel now, in one system call.
        try:
            n = os.writev(self._fd, bufs if len(bufs) <= IOV_MAX else bufs[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            tr.abort()
            return False
        if n < total:
            tr.writelines(owned(tail(bufs, n), total - n))
        return True


class Waiters:
    """What both kinds of link share: senders waiting for room, and their turn."""

    __slots__ = ("_space", "closed", "lock", "waiters")

    def __init__(self) -> None:
        self.closed = False
        self.waiters = 0
        self.lock: anyio.Lock | None = None
        self._space: anyio.Event | None = None

    async def wait_space(self) -> None:
        if self._space is None:
            self._space = anyio.Event()
        await self._space.wait()

    def wake(self) -> None:
        space, self._space = self._space, None
        if space is not None:
            space.set()


class AioLink(Waiters):
    """The outbound link to one peer, on asyncio."""

    __slots__ = ("_connector", "_family", "_loop", "_sockaddr", "conn", "pending", "pending_bytes")

    def __init__(self, loop: asyncio.AbstractEventLoop, family: int, sockaddr: SockAddr) -> None:
        super().__init__()
        self._loop = loop
        self._family = family
        self._sockaddr = sockaddr
        self._connector: asyncio.Task[None] | None = None
        self.conn: AioConn | None = None
        #: Whole frames waiting for a connection, and their size.
        self.pending: deque[list[Buf]] = deque()
        self.pending_bytes = 0

    def _live(self) -> AioConn | None:
        conn = self.conn
        if conn is not None and conn.transport is not None and conn.transport.is_closing():
            conn = self.conn = None
        return conn

    def writable(self) -> bool:
        conn = self._live()
        if conn is not None:
            return not conn.paused
        return self.pending_bytes < HIGH_WATER

    def write(self, bufs: list[Buf], total: int) -> None:
        conn = self._live()
        if conn is not None:
            if conn.write(bufs, total):
                return
            self.conn = None
        self.pending.append(owned(bufs, total))
        self.pending_bytes += total
        self.connect_soon()

    def connect_soon(self) -> None:
        if self._connector is None and not self.closed:
            self._connector = self._loop.create_task(self._connect())

    async def _connect(self) -> None:
        loop, delay = self._loop, _RETRY_MIN
        try:
            while True:
                sock = socket.socket(self._family, socket.SOCK_STREAM)
                try:
                    sock.setblocking(False)
                    async with asyncio.timeout(_CONNECT_TIMEOUT):
                        await loop.sock_connect(sock, self._sockaddr)
                    if self._family == socket.AF_UNIX:
                        await loop.create_unix_connection(partial(AioConn, self), sock=sock)
                    else:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        await loop.create_connection(partial(AioConn, self), sock=sock)
                    return  # connection_made has taken over the pending frames
                except OSError:  # refused, no such socket yet, timed out
                    sock.close()
                except BaseException:
                    sock.close()
                    raise
                await asyncio.sleep(delay)
                delay = min(2 * delay, _RETRY_MAX)
        finally:
            self._connector = None

    def close(self, drop: bool) -> None:
        """Stop; ``drop`` discards what the connection still buffers."""
        self.closed = True
        self.pending.clear()
        self.pending_bytes = 0
        if not self._loop.is_closed():  # else the loop closed everything already
            if self._connector is not None:
                self._connector.cancel()
            conn, self.conn = self.conn, None
            if conn is not None and conn.transport is not None:
                if drop:
                    conn.transport.abort()
                else:
                    conn.transport.close()
            self.wake()


# -- anyio: non-blocking sockets and wait_readable/wait_writable -------------------------


def notify_closing_quietly(sock: socket.socket) -> None:
    try:
        anyio.notify_closing(sock)
    except RuntimeError:  # no event loop in this thread: nobody waits on it here
        pass


async def _connect(family: int, sockaddr: SockAddr) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        err = sock.connect_ex(sockaddr)
        if err == errno.EINPROGRESS:
            with anyio.fail_after(_CONNECT_TIMEOUT):
                await anyio.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


class AnyioLink(Waiters):
    """The outbound link to one peer, driven by a background task (see :meth:`run`)."""

    __slots__ = (
        "_family",
        "_scope",
        "_sockaddr",
        "_started",
        "_wakeup",
        "frames",
        "queued",
        "sock",
    )

    def __init__(self, family: int, sockaddr: SockAddr) -> None:
        super().__init__()
        self._family = family
        self._sockaddr = sockaddr
        self.sock: socket.socket | None = None
        #: Frames not yet written, the first maybe in part (``_started``), and their size.
        self.frames: deque[list[Buf]] = deque()
        self.queued = 0
        self._started = False
        self._wakeup: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None

    def writable(self) -> bool:
        return self.queued < HIGH_WATER

    def write(self, bufs: list[Buf], total: int) -> None:
        if self.sock is not None and not self.frames:
            try:
                n = self.sock.sendmsg(bufs[:IOV_MAX], (), NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._disconnect()
                n = 0
            if n == total:
                return
            if n:
                self.frames.append(owned(tail(bufs, n), total - n))
                self._started = True
                self.queued += total - n
                self._kick()
                return
        self.frames.append(owned(bufs, total))
        self.queued += total
        self._kick()

    def _kick(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()

    def _disconnect(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            notify_closing_quietly(sock)
            sock.close()
        if self._started:  # its beginning went into the broken connection
            self.queued -= nbytes(self.frames.popleft())
            self._started = False

    def _flush(self) -> None:
        assert self.sock is not None
        while self.frames:
            bufs = self.frames[0]
            try:
                n = self.sock.sendmsg(bufs[:IOV_MAX], (), NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            self.queued -= n
            rest = tail(bufs, n)
            if rest:
                self.frames[0] = rest
                self._started = True
            else:
                self.frames.popleft()
                self._started = False

    async def run(self) -> None:
        """Connect while there is something to send, and write it when the socket
        takes it; retry after failures until closed."""
        delay = _RETRY_MIN
        try:
            with anyio.CancelScope() as self._scope:
                while not self.closed:
                    if not self.frames:
                        self._wakeup = anyio.Event()
                        await self._wakeup.wait()
                        continue
                    if self.sock is None:
                        try:
                            self.sock = await _connect(self._family, self._sockaddr)
                        except OSError:
                            await anyio.sleep(delay)
                            delay = min(2 * delay, _RETRY_MAX)
                            continue
                        delay = _RETRY_MIN
                    try:
                        await anyio.wait_writable(self.sock)
                        self._flush()
                    except OSError:
                        self._disconnect()
                    if self.writable():
                        self.wake()
        except anyio.ClosedResourceError:
            pass
        finally:
            sock, self.sock = self.sock, None
            if sock is not None:
                sock.close()

    def close(self, drop: bool) -> None:
        self.closed = True
        self.frames.clear()
        self.queued = 0
        if self._scope is not None:
            self._scope.cancel()
        else:
            self._kick()
        self.wake()


class AnyioInbound:
    """One accepted connection, read by a task inside :meth:`StreamTransport.serve`."""

    __slots__ = ("_owner", "reader", "sock")

    def __init__(self, owner: StreamTransport, sock: socket.socket) -> None:
        self._owner = owner
        self.sock = sock
        self.reader = Reader(owner.max_frame, self._emit)

    def _emit(self, frame: Buf) -> None:
        self._owner._inbound_frame(frame, self)

    def pause(self) -> None:
        pass  # only read while serving

    def resume(self) -> None:
        pass

    def abort(self) -> None:
        self.reader.stopped = True
        notify_closing_quietly(self.sock)
        self.sock.close()


def spawn_system_task(backend: str, fn: Callable[[], Any], tasks: set[Any]) -> None:
    """Run ``fn()`` in the background, outside any task group of the caller."""
    if backend == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn)
    else:
        task = asyncio.get_running_loop().create_task(fn())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
