"""Transport over NNG through pynng: one Pull0 listener, one Push0 per peer.

Receiving waits on NNG's receive pollable fd in the event loop and then drains the
socket without blocking, which avoids pynng's per-message thread hop (``arecv``)
and its cancellation bug under anyio's asyncio backend. Sending tries a non-blocking
send first and only waits on the send pollable when the link is full.

Push/Pull never resends (unlike Req/Rep, which resends after 60 s) and keeps the
frames of one link in order. Every pipe proves itself with a hello before anything it
sends is delivered, and a link that breaks is reported: see :mod:`._nng_pipes`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import pynng

from ._auth import HANDSHAKE_TIMEOUT, hello
from ._base import Deliver, TransportClosed, TransportStats
from ._frame import DEFAULT_MAX_FRAME, Frame, join
from ._guard import Limits
from ._nng_pipes import Inbox, NngLink, fresh_address, notify_closing, tls_dialer_config
from ._tags import dial_part

__all__ = ["Inbox", "NngBeat", "NngLinks", "NngTransport", "notify_closing", "serve_with_sweeps"]

_RECV_BUFFER = 1024
#: How often unproven pipes and links that never connected are looked at.
SWEEP_PERIOD = HANDSHAKE_TIMEOUT / 10

#: the name tests and benchmarks know it by
_fresh_address = fresh_address


class NngLinks:
    """The links of an NNG transport, and their losses (shared by both transports)."""

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


async def serve_with_sweeps(
    receive: Callable[[], Any], inbox: Inbox, links: NngLinks, closed: Callable[[], bool]
) -> None:
    """Run ``receive()`` while sweeping ``inbox`` and ``links`` every
    :data:`SWEEP_PERIOD`; exceptions of ``receive`` propagate as they are."""
    error: BaseException | None = None
    async with anyio.create_task_group() as tg:

        async def sweep() -> None:
            while not closed():
                await anyio.sleep(SWEEP_PERIOD)
                inbox.sweep()
                links.sweep()

        tg.start_soon(sweep)
        try:
            await receive()
        except Exception as exc:  # raised below, not wrapped in a group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    raise TransportClosed("transport is closed")


class NngTransport:
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

    @property
    def address(self) -> str:
        return self._address

    @property
    def max_frame(self) -> int:
        return self._max_frame

    def _check(self, frame: Frame) -> bytes:
        data = join(frame)
        if len(data) > self._max_frame:
            raise ValueError(
                f"message of {len(data)} bytes exceeds the transport limit of "
                f"{self._max_frame} bytes"
            )
        return data

    def try_send(self, addr: str, frame: Frame) -> bool:
        frame = self._check(frame)
        link = self._links.links.get(addr) or self._links.get(addr)
        try:
            link.sock.send(frame, block=False)
        except pynng.TryAgain:
            return False
        except pynng.Closed:
            raise TransportClosed(f"link to {addr} is closed") from None
        self._sent += 1
        self._bytes_sent += len(frame)
        return True

    async def send(self, addr: str, frame: Frame) -> None:
        frame = self._check(frame)  # join once, not at every retry
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

    async def serve(self, deliver: Deliver) -> None:
        await serve_with_sweeps(
            lambda: self._receive(deliver), self._box, self._links, lambda: self._closed
        )

    async def _receive(self, deliver: Deliver) -> None:
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
        notify_closing(self._box.sock.recv_fd)
        self._box.close()


class NngBeat:
    """A Push0 socket that drops a frame rather than wait. It says hello first (see
    :mod:`._nng_pipes`); when its pipe goes, the next send starts a new socket, as a
    pipe that NNG redials on its own would be refused for want of a hello.

    Args:
        addr: the NNG address to send to.
        own: the sender's own listening address, which it proves it speaks for.
    """

    def __init__(self, addr: str, own: str = "") -> None:
        self._addr = addr
        self._own = own
        self._broken = False
        self._sock: pynng.Push0 | None = None
        self._sock = self._open()

    def _open(self) -> pynng.Push0:
        sock = pynng.Push0(
            send_buffer_size=4, send_timeout=1000, tls_config=tls_dialer_config(self._addr)
        )
        try:
            sock.add_post_pipe_remove_cb(partial(self._on_pipe_gone, sock))
            sock.send(hello(self._addr, self._own), block=False)
            sock.dial(dial_part(self._addr), block=False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _on_pipe_gone(self, sock: pynng.Push0, pipe: pynng.Pipe) -> None:
        if sock is self._sock:  # on an NNG thread: the sending thread acts on it
            self._broken = True

    @property
    def stale(self) -> bool:
        """Whether the next frame needs a new socket: there is none, or its pipe went."""
        return self._broken or self._sock is None

    def _current(self) -> pynng.Push0:
        if self._broken or self._sock is None:
            self._broken = False
            if self._sock is not None:
                self._sock.close()
            self._sock = None
            self._sock = self._open()
        return self._sock

    def socket_id(self) -> int:
        """The NNG id of the socket to send on, a new one if :attr:`stale` (for a
        sender outside Python, such as :class:`amesh._ext.Beat`: close that sender
        before calling this again, since it closes the socket it replaces)."""
        return int(self._current().socket.id)

    def send(self, frame: bytes) -> bool:
        try:
            self._current().send(frame, block=False)
        except pynng.TryAgain:
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
