"""The NNG transport: one Pull0 inbox, one Push0 per peer, pynng's sockets, and the
``amesh._native._ext`` C extension on the hot path.

The extension drives the same NNG that pynng loaded:

- Receiving: a receive stays posted on the inbox. Its completion runs on an NNG thread
  without the GIL, appends the message to a bounded queue in C and, when the queue
  turns non-empty, writes to an eventfd. The event loop waits on that fd and drains the
  queue in batches, so there is no thread hop into Python per message.
- Sending: the frame is copied into an NNG message and handed over with a non-blocking
  ``nng_sendmsg`` (accepted into the link's buffer, or "full"). Only a full link waits,
  on the socket's send fd. A frame may also be a list of parts (an envelope and its
  out-of-band buffers): they are copied back to back into the one message.

Where the extension is not built (setup.py builds none on Windows; a source tree run
unbuilt), pynng does both itself: receiving waits on NNG's receive pollable fd in the
event loop and then drains the socket without blocking (not pynng's ``arecv``, a
thread hop per message), and sending tries a non-blocking send first. That path is
kept for those installs alone: on this 2-CPU VM, 64-byte frames between two processes
on one CPU, it received 32k frames/s at 24 µs of CPU each against the extension's
162k at 2.5 µs, and a round trip took 137 against 57 µs (``bench_transport.py``).

Push/Pull never resends (unlike Req/Rep, which resends after 60 s) and keeps the
frames of one link in order. Every pipe proves itself with a hello before anything it
sends is delivered (the extension tells the pipe of each message), and a link that
breaks is reported: see :mod:`._nng_pipes`. Over ``tls+tcp`` NNG's TLS (Mbed TLS, on
NNG's threads) sits below all of this; the extension sees the same messages.

With the extension, frames are delivered as memoryviews of NNG messages (no copy;
writable, since each message belongs to its frame alone); a view keeps its message
alive, so a frame that the receiver keeps stays valid. Without it, as bytes.
"""

from __future__ import annotations

import asyncio
import atexit
import time
from collections.abc import Callable
from typing import ClassVar

import anyio
import anyio.lowlevel
import pynng
import sniffio
from pynng import _nng as _pynng_cffi

from ._auth import HANDSHAKE_TIMEOUT
from ._base import Deliver, TransportClosed, TransportStats
from ._frame import DEFAULT_MAX_FRAME, Frame, frame_size, join
from ._guard import Limits
from ._nng_pipes import Inbox, NngLink, notify_closing

try:
    from .._native import _ext
except ImportError:  # not built: pynng's own I/O (see above)
    _ext = None  # type: ignore[assignment]

__all__ = ["ExtTransport"]

#: NNG's own receive buffer, and then the extension's queue: both bound memory.
_RECV_BUFFER = 1024
_QUEUE = 1024
#: Frames at least this large are copied into NNG in a worker thread by ``send``.
THREAD_SEND = 16 << 20
#: Frames delivered per wake-up before yielding to other tasks.
_BATCH = 256
#: How often unproven pipes and links that never connected are looked at.
SWEEP_PERIOD = HANDSHAKE_TIMEOUT / 10


def _bind() -> None:
    """Give the extension the addresses of the functions of pynng's NNG."""
    ffi, lib = _pynng_cffi.ffi, _pynng_cffi.lib
    _ext.bind(
        {name: int(ffi.cast("uintptr_t", ffi.addressof(lib, name))) for name in _ext.NNG_FUNCTIONS}
    )


if _ext is not None:
    _bind()
    # At exit the sockets are closed (see _nng_pipes._close_at_exit, which replaces
    # pynng's nng_fini()); atexit runs handlers last-in first-out, so this one
    # (registered after that one) stops the extension's receives first, while their
    # sockets are open.
    atexit.register(_ext.finalize)


class NngLinks:
    """The transport's links, and their losses."""

    def __init__(self, own: str) -> None:
        self._own = own
        self.links: dict[str, NngLink] = {}
        self.handler: Callable[[str, str], None] | None = None
        self.closed = False

    def get(self, addr: str) -> NngLink:
        link = self.links.get(addr)
        if link is None:
            if self.closed:
                raise TransportClosed("transport is closed")
            link = self.links[addr] = NngLink(addr, self._own, self.lost)
        return link

    def lost(self, link: NngLink, why: str) -> None:
        """``link`` broke (on the event loop): drop and report it, unless it was
        forgotten or the transport closed meanwhile."""
        if self.links.get(link.addr) is not link:
            return
        del self.links[link.addr]
        link.close()
        if self.handler is not None and not self.closed:
            self.handler(link.addr, why)

    async def room(self, link: NngLink) -> None:
        """Wait until ``link`` may take a frame again.

        Raises:
            TransportClosed: it was closed or given up meanwhile.
        """
        if self.links.get(link.addr) is not link:
            raise TransportClosed(f"link to {link.addr} was closed")
        try:
            await anyio.wait_readable(link.send_fd())
        except anyio.ClosedResourceError:
            raise TransportClosed(f"link to {link.addr} was closed") from None

    def sweep(self) -> None:
        """Give up the links that never connected."""
        now = time.monotonic()
        for link in [link for link in self.links.values() if link.overdue(now)]:
            self.lost(link, link.never_connected())

    def forget(self, addr: str) -> None:
        link = self.links.pop(addr, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        self.closed = True
        links, self.links = list(self.links.values()), {}
        for link in links:
            link.close()


class ExtTransport:
    """See :class:`amesh._transport.Transport`.

    Args:
        scheme: ``abstract``, ``ipc``, ``tcp``, ``tls+tcp`` (encrypted, and both ends
            show a certificate of the job: see :mod:`._tls`) or ``auto``.
        host: the address to listen on for tcp and tls+tcp.
        port: the port for tcp and tls+tcp (0: one the kernel picks, and the address
            gets a tag: see :mod:`._tags`).
        max_frame: the largest frame accepted, in bytes.
        tag: the address's tag (for a port reserved under that tag).
        guard: the limits of connections not proven yet, for a listener open to
            other hosts (see :mod:`._guard`); None: no guard.
    """

    #: whether the extension does the I/O (wherever it is built); else pynng does
    accelerated: ClassVar[bool] = _ext is not None

    def __init__(
        self,
        scheme: str = "auto",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame: int = DEFAULT_MAX_FRAME,
        tag: str = "",
        guard: Limits | None = None,
    ) -> None:
        self._max_frame = max_frame
        self._closed = False
        self._sent = self._received = self._bytes_sent = self._bytes_received = 0
        self._box = Inbox(scheme, host, max_frame, _RECV_BUFFER, port, tag, guard)
        self._address = self._box.address
        self._links = NngLinks(self._address)
        self._rx: _ext.Receiver | None = None
        if self.accelerated:
            try:
                self._rx = _ext.Receiver(self._box.sock.socket.id, _QUEUE)
                self._rx.start()
            except BaseException:
                self._box.close()
                raise

    @property
    def address(self) -> str:
        return self._address

    @property
    def max_frame(self) -> int:
        return self._max_frame

    def try_send(self, addr: str, frame: Frame) -> bool:
        size = frame_size(frame)
        if size > self._max_frame:
            raise ValueError(
                f"message of {size} bytes exceeds the transport limit of {self._max_frame} bytes"
            )
        link = self._links.links.get(addr) or self._links.get(addr)
        if link.busy:
            return False  # behind a large frame being copied: keep the order
        return self._send_now(link, frame, size)

    def _send_now(self, link: NngLink, frame: Frame, size: int) -> bool:
        if self._rx is None:
            sent = self._send_pynng(link, frame)
        else:
            try:
                sent = _ext.send(link.id, frame)
            except _ext.NngError as exc:
                if exc.errno == _ext.NNG_ECLOSED:
                    raise TransportClosed(f"link to {link.addr} is closed") from None
                raise
        if sent:
            self._sent += 1
            self._bytes_sent += size
        return sent

    @staticmethod
    def _send_pynng(link: NngLink, frame: Frame) -> bool:
        try:
            link.sock.send(join(frame), block=False)
        except pynng.TryAgain:
            return False
        except pynng.Closed:
            raise TransportClosed(f"link to {link.addr} is closed") from None
        return True

    async def send(self, addr: str, frame: Frame) -> None:
        size = frame_size(frame)
        if size >= THREAD_SEND and size <= self._max_frame:
            await self._send_large(addr, frame, size)
            return
        if self.try_send(addr, frame):
            return
        # The link is full. Only one task may wait on a given fd (trio insists), so
        # waiters for the same peer queue on a lock.
        link = self._links.links[addr]
        if link.lock is None:
            link.lock = anyio.Lock()
        async with link.lock:
            while not self.try_send(addr, frame):
                await self._links.room(link)

    async def _send_large(self, addr: str, frame: Frame, size: int) -> None:
        """Copy a large frame into NNG in a worker thread (the copy runs without the
        GIL, ~0.8 s per GiB here), so the event loop goes on meanwhile; frames sent to
        the same peer after it wait their turn."""
        link = self._links.links.get(addr) or self._links.get(addr)
        if link.lock is None:
            link.lock = anyio.Lock()
        async with link.lock:
            link.busy = True
            try:
                while not await anyio.to_thread.run_sync(self._send_now, link, frame, size):
                    await self._links.room(link)
            finally:
                link.busy = False

    async def serve(self, deliver: Deliver) -> None:
        # Receives while the unproven pipes and the links that never connected are
        # swept every SWEEP_PERIOD; the receiver's exceptions propagate as they are.
        error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._sweep)
            try:
                await self._receive(deliver)
            except Exception as exc:  # raised below, not wrapped in a group
                error = exc
            tg.cancel_scope.cancel()
        if error is not None:
            raise error
        raise TransportClosed("transport is closed")

    async def _sweep(self) -> None:
        while not self._closed:
            await anyio.sleep(SWEEP_PERIOD)
            self._box.sweep()
            self._links.sweep()

    async def _receive(self, deliver: Deliver) -> None:
        rx = self._rx
        if rx is None:
            await self._receive_pynng(deliver)
            return
        if sniffio.current_async_library() == "asyncio":
            await self._receive_asyncio(rx, deliver)
            return
        fd = rx.fileno()
        while True:
            # A view keeps its NNG message alive as long as anyone holds it (or a view
            # of it): the receiver may keep the frame or parts of it.
            if self._drain_into(rx, deliver) < _BATCH:
                await anyio.wait_readable(fd)
            else:
                await anyio.lowlevel.checkpoint()

    def _drain_into(self, rx: _ext.Receiver, deliver: Deliver) -> int:
        try:
            batch = rx.drain(_BATCH)
        except _ext.NngError as exc:
            if self._closed or exc.errno == _ext.NNG_ECLOSED:
                raise TransportClosed("transport is closed") from None
            raise
        box = self._box
        proven = box.proven
        for msg in batch:
            if self._closed:
                raise TransportClosed("transport is closed")
            view = memoryview(msg)
            peer = proven.get(msg.pipe)
            if peer is None:
                box.admit(msg.pipe, view)  # a hello, or refused: never delivered
                continue
            self._received += 1
            self._bytes_received += len(view)
            deliver(view, peer)
        return len(batch)

    async def _receive_asyncio(self, rx: _ext.Receiver, deliver: Deliver) -> None:
        """On asyncio, a reader callback delivers straight from the loop's poll: no task
        wakes per batch, and no reader is added and removed per wait."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        fd = rx.fileno()

        def readable() -> None:
            try:
                for _ in range(8):  # then let other callbacks run; the fd stays readable
                    if self._drain_into(rx, deliver) < _BATCH:
                        break
            except BaseException as exc:
                loop.remove_reader(fd)
                if not ended.done():
                    ended.set_exception(exc)

        loop.add_reader(fd, readable)
        try:
            readable()
            await ended
        finally:
            try:
                loop.remove_reader(fd)
            except (OSError, ValueError):  # the receiver's fd is already gone
                pass

    async def _receive_pynng(self, deliver: Deliver) -> None:
        """Without the extension: wait until the inbox is readable, then take what it
        holds without blocking."""
        box = self._box
        sock, proven = box.sock, box.proven
        fd = sock.recv_fd
        while True:
            try:
                await anyio.wait_readable(fd)
            except anyio.ClosedResourceError:
                raise TransportClosed("transport is closed") from None
            while True:
                try:
                    msg = sock.recv_msg(block=False)
                except pynng.TryAgain:
                    break
                except pynng.Closed:
                    raise TransportClosed("transport is closed") from None
                pipe = msg.pipe.id if msg.pipe is not None else -1
                peer = proven.get(pipe)
                if peer is None:
                    box.admit(pipe, msg.bytes)  # a hello, or refused: never delivered
                    continue
                frame = msg.bytes
                self._received += 1
                self._bytes_received += len(frame)
                deliver(frame, peer)

    def forget(self, addr: str) -> None:
        self._links.forget(addr)

    def set_lost_handler(self, handler: Callable[[str, str], None] | None) -> None:
        self._links.handler = handler

    def statistics(self) -> TransportStats:
        return TransportStats(
            frames_sent=self._sent,
            frames_received=self._received,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            peers=len(self._links.links),
            auth_refused=self._box.refused(),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._links.close()
        if self._rx is None:
            notify_closing(self._box.sock.recv_fd)
        else:
            # Stopping the receiver leaves its fd readable, so a serve() wakes up and
            # ends; the fd itself is closed when the last reference to it goes.
            self._rx.close()
        self._box.close()
