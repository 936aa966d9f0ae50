"""The stream transport's connections on asyncio: the loop's own protocols do the I/O.

An inbound connection is an :class:`AioInbound` (a :class:`asyncio.BufferedProtocol`)
until its peer has proven itself, then the C extension's reader where it is built; an
outbound link (:class:`AioLink`) dials (:meth:`~._stream_io.LinkCore.dial`, which
both cores share), hands the socket to the loop and writes through an :class:`AioConn`, whose
small frames the C extension's writer takes where it is built. What both cores share
is in :mod:`._stream_io`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from ._auth import Gate, Refused, check_peer
from ._stream_framing import AnyReader, BadStream, Buf, SockAddr, _frame_memory, owned, tail
from ._stream_io import (
    BATCH_BYTES,
    BATCH_FRAME,
    HIGH_WATER,
    IOV_MAX,
    LOW_WATER,
    CannotConnect,
    LinkCore,
    LostCallback,
)

if TYPE_CHECKING:
    from ._stream import StreamTransport

__all__ = ["AioConn", "AioInbound", "AioLink"]

log = logging.getLogger("amesh._transport._stream")


def _frames_protocol() -> type[Any] | None:
    """The C extension's reader as the protocol of a proven inbound connection (None
    where it is not built): the loop's read callbacks are its C methods, so no Python
    code of ours runs until a frame is whole; the connection's loss goes to the
    :class:`AioInbound` it took over from."""
    try:
        from .._native._ext import FrameReader
    except ImportError:
        return None

    class InboundFrames(FrameReader, asyncio.BufferedProtocol):
        conn: AioInbound | None = None

        def connection_lost(self, exc: BaseException | None) -> None:
            if self.conn is not None:  # (which lets go of this object)
                self.conn.connection_lost(exc)

    return InboundFrames


_InboundFrames = _frames_protocol()

#: How many reads the Python reader took in this process (the C reader counts its own
#: for :class:`~amesh._native._ext.FrameWriter`): see :meth:`AioConn.write`.
_reads = 0


class AioInbound(asyncio.BufferedProtocol):
    """One accepted connection, read by the event loop: into a :class:`~._auth.Gate`
    until the peer has proven itself, then straight into a reader. The C extension's
    reader then becomes the connection's protocol (see :func:`_frames_protocol`);
    without it, this protocol feeds a :class:`Reader`."""

    def __init__(self, owner: StreamTransport) -> None:
        self._owner = owner
        # (frames go straight to the transport: no method of ours in between)
        emit = partial(owner._inbound_frame, conn=self)
        self._frames: Any = None
        self._reader: AnyReader
        if owner.accelerated and _InboundFrames is not None:
            self._frames = self._reader = _InboundFrames(
                owner.max_frame, emit, _frame_memory, BadStream, self._bad
            )
            self._frames.conn = self
        else:
            self._reader = owner.reader(emit)
        self._gate: Gate | None = Gate(owner.address)
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._paused = False
        self._who = "a peer"
        #: whether the dialer sent anything (one that leaves without a word probed)
        self._heard = False
        #: the dialer's address, once it has proven itself
        self.peer = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's
        self._transport = transport = cast(asyncio.Transport, transport)
        owner = self._owner
        if owner._closed:
            self._gate = None
            transport.abort()
            return
        owner._inbound.add(self)
        self._who, why = check_peer(transport.get_extra_info("socket"))
        if why:
            self._refuse(why)
            return
        admission = owner._admission
        if admission is not None:  # (a listener open to other hosts: see ._guard)
            source = str(transport.get_extra_info("peername", ("?",))[0])
            for old, why in admission.admit(self, source):
                cast(AioInbound, old)._refuse(why)
        assert self._gate is not None
        transport.write(self._gate.challenge)
        self._timer = asyncio.get_running_loop().call_later(owner.deadline, self._too_slow)

    def get_buffer(self, sizehint: int) -> memoryview:
        gate = self._gate
        if gate is not None:
            return gate.get_buffer()
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        global _reads
        if self._gate is not None:
            self._open(nbytes)
            return
        _reads += 1
        try:
            self._reader.buffer_updated(nbytes)
        except BadStream as exc:
            self._bad(str(exc))

    def _bad(self, why: str) -> None:
        log.warning("dropping an inbound connection from %s: %s", self.peer or self._who, why)
        self.abort()

    def _open(self, nbytes: int) -> None:
        """Bytes of the handshake: pass on what follows a good answer, refuse a bad one."""
        gate = self._gate
        assert gate is not None
        self._heard = True
        try:
            rest = gate.buffer_updated(nbytes)
        except Refused as exc:
            self._refuse(str(exc))
            return
        if rest is None:
            return
        self._gate = None
        self.peer = gate.peer
        if self._owner._admission is not None:
            self._owner._admission.done(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._frames is not None and self._transport is not None:
            self._transport.set_protocol(self._frames)  # the next read goes to C
        if rest:  # frames pipelined behind the answer
            self._reader.get_buffer()[: len(rest)] = rest
            self.buffer_updated(len(rest))

    def _too_slow(self) -> None:
        self._timer = None
        if self._gate is not None:
            self._refuse(f"no handshake within {self._owner.deadline:g} s")

    def _refuse(self, why: str) -> None:
        self._gate = None
        if self._owner._admission is not None:
            self._owner._admission.done(self)
        self._owner._refusals.refuse(self._who, why)
        self.abort()

    def eof_received(self) -> bool | None:
        return None  # close our end too

    def connection_lost(self, exc: BaseException | None) -> None:
        # A large frame's memory goes with the connection, and no cycle is left: the
        # connection goes with its last reference, not with the collector.
        self._reader.stop()
        if self._frames is not None:
            self._frames.conn = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._gate is not None and not self._owner._closed:
            self._gate = None
            if self._owner._admission is not None:
                self._owner._admission.done(self)
            if self._heard:
                why = "closed the connection before the handshake"
                self._owner._refusals.refuse(self._who, why)
            else:  # a probe (see _hybrid.local_alias): it tried nothing
                log.debug("%s connected and left without a word", self._who)
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
        self._reader.stop()
        if self._transport is not None:
            self._transport.abort()


class AioConn(asyncio.Protocol):
    """The connection of an :class:`AioLink`, once its handshake answer is known.

    Writes are batched per turn of the event loop. A frame goes to the kernel at once
    when something was read since this connection's last frame written at once: a
    reply to what came in, the next call after a reply. A frame after that one in the
    same turn starts a batch: small frames (every part ``bytes``, so nobody can change
    them meanwhile) wait in :attr:`_batch` and go together at the end of the turn, in
    one ``writev``. A larger frame first sends what waits, keeping the order. (With the
    C extension, :class:`FastConn` writes the small frames.)
    """

    def __init__(self, link: AioLink, hello: bytes) -> None:
        self._link = link
        self._loop = link._loop
        self._hello = hello
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.paused = False
        #: frames waiting for the end of this turn (None: no batch this turn)
        self._batch: list[Buf] | None = None
        self._batch_bytes = 0
        #: :data:`_reads` at this connection's last frame written at once
        self._turn = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        link = self._link
        if link.closed:
            transport.abort()
            return
        self.fd = transport.get_extra_info("socket").fileno()
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        # The answer goes first, then the frames queued while connecting, before
        # anyone can write more.
        pending, link.pending, link.pending_bytes = link.pending, deque(), 0
        link.conn = self
        transport.writelines([self._hello, *(b for bufs in pending for b in bufs)])
        link.wake()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._batch = None
        link = self._link
        if link.conn is self:
            link.conn = link.fast = None
        link.fail(f"the connection broke ({exc})" if exc else "the peer closed the connection")

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._link.wake()

    def data_received(self, data: bytes) -> None:
        pass  # peers never write on a link after their challenge

    def eof_received(self) -> bool | None:
        return None  # the peer closed: close our end (connection_lost reports it)

    def write(self, bufs: list[Buf], total: int) -> bool:
        """Write one frame; False (nothing of it written) if the connection broke."""
        batch = self._batch
        if batch is None and self._link.batching:
            if self._turn != _reads:  # something was read since: this one goes now
                self._turn = _reads
                return self._writev(bufs, total)
            batch = self._batch = []
            self._batch_bytes = 0
            self._loop.call_soon(self._end_turn)  # once the loop ran what is ready now
        if batch is not None:
            if total <= BATCH_FRAME:
                for b in bufs:
                    if type(b) is not bytes:  # a view: it may change after we return
                        break
                else:
                    batch += bufs
                    self._batch_bytes += total
                    return self._batch_bytes < BATCH_BYTES or self.flush()
            if batch and not self.flush():  # what waits goes first
                return False
        return self._writev(bufs, total)

    def _end_turn(self) -> None:
        if self._batch and not self.flush():  # (most turns write one frame: none waits)
            self._link.fail("the connection broke")
        self._batch = None

    def flush(self) -> bool:
        """Send the frames waiting for the end of the turn now; False if the
        connection broke (then, or before: what waited is lost with it)."""
        batch = self._batch
        if not batch:
            return True
        total = self._batch_bytes
        self._batch = []
        self._batch_bytes = 0
        tr = self.transport
        if tr is None or tr.is_closing():  # aborted meanwhile: its fd may be reused
            return False
        return self._writev(batch, total)

    def _writev(self, bufs: list[Buf], total: int) -> bool:
        tr = self.transport
        assert tr is not None
        if tr.get_write_buffer_size():
            tr.writelines(owned(bufs, total))
            return True
        # Nothing is buffered: hand the frames to the kernel now, in one system call.
        try:
            n = os.writev(self.fd, bufs if len(bufs) <= IOV_MAX else bufs[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            tr.abort()
            return False
        if n < total:
            tr.writelines(owned(tail(bufs, n), total - n))
        return True


def _fast_conn() -> type[AioConn] | None:
    """:class:`AioConn` whose small frames the C extension writes (None where it is
    not built): :meth:`StreamTransport.try_send` hands a frame straight to its
    :meth:`~amesh._native._ext.FrameWriter.send`, which writes it or batches it as
    :meth:`AioConn.write` would, with no Python code of ours in between. A frame it
    does not take (a large one, one in parts) goes by :meth:`write`."""
    try:
        from .._native._ext import FrameWriter
    except ImportError:
        return None

    class FastConn(FrameWriter, AioConn):
        def __init__(self, link: AioLink, hello: bytes) -> None:
            assert link.small is not None  # (made only where it is set)
            FrameWriter.__init__(self, link.small, BATCH_BYTES)
            AioConn.__init__(self, link, hello)
            self.batching = link.batching
            self.call_soon = self._loop.call_soon
            self.end_turn = self._end_turn

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            link = self._link
            if link.conn is self:
                link.fast = self

        def connection_lost(self, exc: BaseException | None) -> None:
            self.drop()
            super().connection_lost(exc)

        def write(self, bufs: list[Buf], total: int) -> bool:
            if self.batched and not self.flush():  # what waits goes first
                return False
            return self._writev(bufs, total)

        def _end_turn(self) -> None:
            if not self.finish_turn():
                self._link.fail("the connection broke")

    return FastConn


_FastConn = _fast_conn()


class AioLink(LinkCore):
    """The outbound link to one peer, on asyncio.

    It dials on its first frame, keeps dialling for a short window while the listener
    is not there yet, and answers the listener's challenge; when that fails, or its
    connection breaks later, it closes and ``on_lost`` reports it (once).
    """

    __slots__ = (
        "_connector",
        "_loop",
        "batching",
        "conn",
        "pending",
        "pending_bytes",
        "small",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        addr: str,
        family: int,
        sockaddr: SockAddr,
        own: str,
        on_lost: LostCallback,
        batching: bool = True,
        small: int | None = None,
    ) -> None:
        super().__init__(addr, family, sockaddr, own, on_lost)
        self._loop = loop
        #: whether its connection batches writes per turn of the loop (see AioConn)
        self.batching = batching
        #: frames up to this size go by the C extension's writer (None: none do)
        self.small = small
        self._connector: asyncio.Task[None] | None = None
        self.conn: AioConn | None = None
        #: Whole frames waiting for a connection, and their size.
        self.pending: deque[list[Buf]] = deque()
        self.pending_bytes = 0

    def _live(self) -> AioConn | None:
        conn = self.conn
        if conn is not None and conn.transport is not None and conn.transport.is_closing():
            self.fail("the connection broke")
            return None
        return conn

    def writable(self) -> bool:
        conn = self._live()
        if conn is not None:
            return not conn.paused
        return self.pending_bytes < HIGH_WATER

    def try_write(self, bufs: list[Buf], total: int) -> bool:
        """:meth:`write` if :meth:`writable`, in one step; False: full, nothing done."""
        conn = self._live()
        if conn is None:
            if self.pending_bytes >= HIGH_WATER:
                return False
            self.write(bufs, total)
        elif conn.paused:
            return False
        elif not conn.write(bufs, total):
            self.fail("the connection broke")
        return True

    def write(self, bufs: list[Buf], total: int) -> None:
        """Write or queue one frame; a broken link drops it (its loss is reported)."""
        conn = self._live()
        if conn is not None:
            if not conn.write(bufs, total):
                self.fail("the connection broke")
            return
        if self.closed:
            return
        self.pending.append(owned(bufs, total))
        self.pending_bytes += total
        if self._connector is None:
            self._connector = self._loop.create_task(self._connect())

    async def _connect(self) -> None:
        """Dial (see :meth:`~._stream_io.LinkCore.dial`), then hand the socket to the loop: its
        connection writes the answer first, then the frames queued meanwhile."""
        try:
            try:
                sock, hello = await self.dial()
            except CannotConnect as exc:
                self.fail(str(exc))
                return
            kind = AioConn if self.small is None or _FastConn is None else _FastConn
            factory = partial(kind, self, hello)
            try:
                if self._family == socket.AF_UNIX:
                    await self._loop.create_unix_connection(factory, sock=sock)
                else:
                    await self._loop.create_connection(factory, sock=sock)
            except Exception as exc:  # fails the link, never hangs it
                sock.close()
                self.fail(f"cannot connect: {exc!r}")
            except BaseException:
                sock.close()
                raise
        finally:
            self._connector = None

    def fail(self, why: str) -> None:
        """The link broke: close it, and have it reported (unless it was closed)."""
        if self.closed:
            return
        self._stop(drop=True)
        if not self._loop.is_closed():
            self._loop.call_soon(self._on_lost, self, why)

    def close(self, drop: bool) -> None:
        """Stop; ``drop`` discards what the connection still buffers. Nothing is reported."""
        if not self.closed:
            self._stop(drop)

    def _stop(self, drop: bool) -> None:
        self.closed = True
        self.pending.clear()
        self.pending_bytes = 0
        if not self._loop.is_closed():  # else the loop closed everything already
            connector = self._connector
            if connector is not None and connector is not asyncio.current_task(self._loop):
                connector.cancel()
            conn, self.conn, self.fast = self.conn, None, None
            if conn is not None and conn.transport is not None:
                if drop:
                    conn.transport.abort()
                else:
                    conn.flush()  # what waited for the end of the turn goes too
                    conn.transport.close()
            self.wake()
