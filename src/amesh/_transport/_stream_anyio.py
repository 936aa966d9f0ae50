"""The stream transport's connections on trio (and on asyncio where
:attr:`~._stream.StreamTransport.fast_asyncio` is off): non-blocking sockets driven
with anyio's ``wait_readable``/``wait_writable``, a reader task per inbound connection
(:class:`AnyioInbound`) inside :meth:`~._stream.StreamTransport.serve` and a background
task per outbound link (:class:`AnyioLink`). What both cores share is in
:mod:`._stream_io`.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from typing import TYPE_CHECKING

import anyio

from ._auth import Gate, Refused, check_peer
from ._stream_framing import NOSIGNAL, Buf, SockAddr, owned, tail
from ._stream_io import (
    HIGH_WATER,
    IOV_MAX,
    CannotConnect,
    LinkCore,
    LostCallback,
    notify_closing_quietly,
)

if TYPE_CHECKING:
    from ._stream import StreamTransport

__all__ = ["AnyioInbound", "AnyioLink"]

log = logging.getLogger("amesh._transport._stream")


class AnyioLink(LinkCore):
    """The outbound link to one peer, driven by a background task (see :meth:`run`).

    Like :class:`AioLink`, it dials on its first frame (:meth:`~._stream_io.LinkCore.dial`:
    a short window at most), and closes and reports (``on_lost``) when that fails or its
    connection breaks.
    """

    __slots__ = (
        "_closing",
        "_lost",
        "_scope",
        "_started",
        "_wakeup",
        "frames",
        "queued",
        "sock",
    )

    def __init__(
        self, addr: str, family: int, sockaddr: SockAddr, own: str, on_lost: LostCallback
    ) -> None:
        super().__init__(addr, family, sockaddr, own, on_lost)
        self.sock: socket.socket | None = None
        #: Frames not yet written, the first maybe in part (``_started``), and their size.
        self.frames: deque[list[Buf]] = deque()
        self.queued = 0
        self._started = False
        self._wakeup: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        #: why the link broke, once it did
        self._lost: str | None = None
        #: closed, but :meth:`run` still writes what was queued before
        self._closing = False

    def writable(self) -> bool:
        return self.queued < HIGH_WATER

    def try_write(self, bufs: list[Buf], total: int) -> bool:
        """:meth:`write` if :meth:`writable`, in one step; False: full, nothing done."""
        if self.queued >= HIGH_WATER:
            return False
        self.write(bufs, total)
        return True

    def write(self, bufs: list[Buf], total: int) -> None:
        """Write or queue one frame; a broken link drops it (its loss is reported)."""
        if self.closed:
            return
        if self.sock is not None and not self.frames:
            try:
                n = self.sock.sendmsg(bufs[:IOV_MAX], (), NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self.fail(f"the connection broke ({exc})")
                return
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

    async def _wait(self) -> None:
        self._wakeup = anyio.Event()
        await self._wakeup.wait()

    async def run(self) -> None:
        """Connect once there is something to send, then write what the socket takes,
        until closed or broken (then report it)."""
        try:
            with anyio.CancelScope() as self._scope:
                while not self.frames and not self.closed:
                    await self._wait()
                if not self.closed and await self._connect():
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._watch)
                        await self._pump()
                        tg.cancel_scope.cancel()
        finally:
            sock, self.sock = self.sock, None
            if sock is not None:
                notify_closing_quietly(sock)
                sock.close()
            if self._lost is not None:
                try:
                    self._on_lost(self, self._lost)
                except Exception:  # a system task must not raise
                    log.exception("reporting the loss of the link to %s", self.addr)

    async def _connect(self) -> bool:
        """Dial (see :meth:`~._stream_io.LinkCore.dial`) and queue the answer to the challenge
        first; False if it failed."""
        try:
            self.sock, hello = await self.dial()
        except CannotConnect as exc:
            self.fail(str(exc))
            return False
        self.frames.appendleft([hello])
        self.queued += len(hello)
        return True

    async def _pump(self) -> None:
        sock = self.sock
        assert sock is not None
        while not self.closed or (self._closing and self.frames):
            if not self.frames:
                await self._wait()
                continue
            try:
                await anyio.wait_writable(sock)
                self._flush()
            except OSError as exc:
                self.fail(f"the connection broke ({exc})")
                return
            if self.writable():
                self.wake()

    async def _watch(self) -> None:
        """Notice at once when the peer closes (it never writes on a link)."""
        sock = self.sock
        assert sock is not None
        while True:
            await anyio.wait_readable(sock)
            try:
                data = sock.recv(1)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                self.fail(f"the connection broke ({exc})")
                return
            if not data:
                self.fail("the peer closed the connection")
                return

    def fail(self, why: str) -> None:
        """The link broke: close it, and have :meth:`run` report it (unless it was
        closed: then it only stops writing what was queued)."""
        if not self.closed:
            self._lost = why
            self.close(drop=True)
        elif self._closing:
            self.close(drop=True)

    def close(self, drop: bool) -> None:
        """Stop taking frames; nothing is reported. Unless ``drop``, a connected link
        still writes what it queued before, in :meth:`run`, as an asyncio transport
        does once closed; else, or when not connected, the socket closes now."""
        self.closed = True
        if not drop and self.frames and self.sock is not None and self._lost is None:
            self._closing = True
            self._kick()
            self.wake()
            return
        self._closing = False
        self.frames.clear()
        self.queued = 0
        if self._scope is not None:
            self._scope.cancel()
        else:
            self._kick()
        self.wake()


class AnyioInbound:
    """One accepted connection, read by a task inside :meth:`StreamTransport.serve`."""

    __slots__ = ("_owner", "gate", "peer", "reader", "sock", "who")

    def __init__(self, owner: StreamTransport, sock: socket.socket) -> None:
        self._owner = owner
        self.sock = sock
        self.reader = owner.reader(self._emit)
        #: the handshake, until the peer has proven itself
        self.gate: Gate | None = Gate(owner.address)
        self.who = "a peer"
        #: the dialer's address, once it has proven itself
        self.peer = ""

    async def handshake(self) -> bool:
        """Challenge the peer and check its answer; False (refused, counted) if it
        fails. Frames sent behind the answer go to the reader."""
        gate, sock = self.gate, self.sock
        if gate is None:
            return True
        why: str | None
        self.who, why = check_peer(sock)
        if not why:
            why = f"no handshake within {self._owner.deadline:g} s"
            with anyio.move_on_after(self._owner.deadline):
                why = await self._check(gate, sock)
        if why is None:  # a probe (see _hybrid.local_alias): it tried nothing
            log.debug("%s connected and left without a word", self.who)
            self.gate = None
            return False
        if why:
            self.gate = None
            self._owner._refusals.refuse(self.who, why)
            return False
        self.gate = None
        self.peer = gate.peer
        return True

    async def _check(self, gate: Gate, sock: socket.socket) -> str | None:
        """Why the peer is refused, "" once its answer is good, or None when it closed
        the connection without sending a byte."""
        heard = False
        try:
            sock.send(gate.challenge, NOSIGNAL)  # a fresh socket takes 36 bytes at once
        except OSError:  # the peer is gone already
            return None
        while True:
            await anyio.wait_readable(sock)
            try:
                n = sock.recv_into(gate.get_buffer())
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                return f"the connection broke ({exc})" if heard else None
            if n == 0:
                return "closed the connection before the handshake" if heard else None
            heard = True
            try:
                rest = gate.buffer_updated(n)
            except Refused as exc:
                return str(exc)
            if rest is not None:
                self.peer = gate.peer
                if rest:  # frames pipelined behind the answer
                    self.reader.get_buffer()[: len(rest)] = rest
                    self.reader.buffer_updated(len(rest))
                return ""

    def _emit(self, frame: Buf) -> None:
        self._owner._inbound_frame(frame, self)

    def pause(self) -> None:
        pass  # only read while serving

    def resume(self) -> None:
        pass

    def abort(self) -> None:
        self.reader.stop()
        notify_closing_quietly(self.sock)
        self.sock.close()
