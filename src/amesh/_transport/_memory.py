"""An in-memory transport: runtimes in one process (one event loop) talk directly.

The in-process host (:mod:`amesh._hosts._inprocess`) gives its workers one when the
controller runs on one; :mod:`amesh.testing` exports it."""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable

import anyio

from ._base import Deliver, TransportClosed, TransportStats
from ._frame import Frame, join

__all__ = ["MemoryTransport"]

_registry: dict[str, MemoryTransport] = {}


class MemoryTransport:
    """A :class:`~amesh._transport.Transport` whose peers live in this process.

    Frames are handed over by reference into the receiver's queue, in order. A frame
    to an address that is gone is dropped (as a dead process would drop it).
    ``pause()`` and ``resume()`` stand in for SIGSTOP and SIGCONT: a paused transport
    neither delivers nor sends.

    Links break as connections do: when a transport closes, every transport that sent
    to it (and did not :meth:`forget` it) hears of it through its lost handler, and a
    send to an address where nobody is reports that once. Handlers run in
    :meth:`serve`. Peers share the process's job key: there is nothing to refuse.

    Args:
        max_queue: frames a receiver holds before senders wait (back-pressure).
    """

    def __init__(self, max_queue: int = 10_000) -> None:
        self._address = f"memory://{uuid.uuid4().hex}"
        #: frames and the address of their sender
        self._queue: deque[tuple[bytes, str]] = deque()
        self._max_queue = max_queue
        self._arrived: anyio.Event | None = None
        self._room: anyio.Event | None = None
        self._resumed: anyio.Event | None = None
        self._closed = False
        self._sent = self._received = self._bytes_sent = self._bytes_received = 0
        #: peers sent to since the last forget(), and addresses found unreachable
        self._links: set[str] = set()
        self._unreachable: set[str] = set()
        self._lost_handler: Callable[[str, str], None] | None = None
        self._lost: deque[tuple[str, str]] = deque()
        _registry[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    @property
    def max_frame(self) -> int:
        return 2**31 - 1

    @property
    def paused(self) -> bool:
        return self._resumed is not None

    def pause(self) -> None:
        """Stop delivering and sending until :meth:`resume`."""
        if self._resumed is None:
            self._resumed = anyio.Event()

    def resume(self) -> None:
        """Deliver and send again."""
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    def _push(self, frame: bytes, sender: str) -> bool:
        if len(self._queue) >= self._max_queue:
            return False
        self._queue.append((frame, sender))
        self._received += 1
        self._bytes_received += len(frame)
        if self._arrived is not None:
            self._arrived.set()
        return True

    def try_send(self, addr: str, frame: Frame) -> bool:
        frame = join(frame)
        if self._closed:
            raise TransportClosed("transport is closed")
        if len(frame) > self.max_frame:
            raise ValueError(f"message of {len(frame)} bytes exceeds the transport limit")
        if self.paused:
            return False
        peer = _registry.get(addr)
        if peer is None:
            if addr not in self._unreachable:
                self._unreachable.add(addr)
                self._report(addr, "cannot connect (nobody listens there)")
        elif not peer._push(frame, self._address):
            return False
        else:
            self._links.add(addr)
        self._sent += 1
        self._bytes_sent += len(frame)
        return True

    async def send(self, addr: str, frame: Frame) -> None:
        frame = join(frame)
        while not self.try_send(addr, frame):
            if self._resumed is not None:
                await self._resumed.wait()
                continue
            peer = _registry.get(addr)
            if peer is None:
                continue
            if peer._room is None:
                peer._room = anyio.Event()
            await peer._room.wait()

    def _report(self, addr: str, why: str) -> None:
        """Have serve() tell the lost handler that the link to ``addr`` broke."""
        self._lost.append((addr, why))
        if self._arrived is not None:
            self._arrived.set()

    async def serve(self, deliver: Deliver) -> None:
        while True:
            if self._closed:
                raise TransportClosed("transport is closed")
            if self._resumed is not None:
                await self._resumed.wait()
                continue
            while self._lost:
                addr, why = self._lost.popleft()
                if self._lost_handler is not None:
                    self._lost_handler(addr, why)
            if not self._queue:
                self._arrived = anyio.Event()
                await self._arrived.wait()
                self._arrived = None
                continue
            # Deliver a batch, then let other tasks run.
            for _ in range(min(len(self._queue), 256)):
                if self._resumed is not None:
                    break
                deliver(*self._queue.popleft())
            if self._room is not None:
                self._room.set()
                self._room = None
            await anyio.lowlevel.checkpoint()

    def forget(self, addr: str) -> None:
        """Forget the link to ``addr``: its end is not reported."""
        self._links.discard(addr)

    def set_lost_handler(self, handler: Callable[[str, str], None] | None) -> None:
        self._lost_handler = handler

    def statistics(self) -> TransportStats:
        return TransportStats(
            frames_sent=self._sent,
            frames_received=self._received,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            peers=len(self._links),
            auth_refused=0,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _registry.pop(self._address, None)
        self._queue.clear()
        self._lost.clear()
        for peer in _registry.values():
            if self._address in peer._links:
                peer._links.discard(self._address)
                peer._report(self._address, "the peer closed the connection")
        for ev in (self._arrived, self._room, self._resumed):
            if ev is not None:
                ev.set()
