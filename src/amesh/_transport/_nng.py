"""Transport over NNG through pynng: one Pull0 listener, one Push0 per peer.

Receiving waits on NNG's receive pollable fd in the event loop and then drains the
socket without blocking, which avoids pynng's per-message thread hop (``arecv``)
and its cancellation bug under anyio's asyncio backend. Sending tries a non-blocking
send first and only waits on the send pollable when the link is full.

Push/Pull never resends (unlike Req/Rep, which resends after 60 s) and keeps the
frames of one link in order.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import anyio
import pynng

from .._wire import Frame, join
from ._base import TransportClosed, TransportStats

__all__ = ["NngTransport"]

#: Frames above this size are refused at the sender with a clear error; NNG itself
#: would drop an oversize frame silently at the receiver.
DEFAULT_MAX_FRAME = 2**31 - 1
_SEND_BUFFER = 1024
_RECV_BUFFER = 1024


def ipc_dir() -> str:
    """Where ipc:// socket files go: ``AMESH_IPC_DIR``, else ``$TMPDIR/amesh-<uid>``."""
    return os.environ.get("AMESH_IPC_DIR") or os.path.join(
        tempfile.gettempdir(), f"amesh-{os.getuid()}"
    )


def notify_closing(fd: int) -> None:
    """Wake tasks waiting on ``fd`` (ClosedResourceError) before NNG closes it."""
    try:
        anyio.notify_closing(fd)
    except RuntimeError:  # no event loop in this thread: nobody here waits on it
        pass


class Inbox:
    """The Pull0 socket a transport receives on, listening on a fresh address.

    Shared by the pure-pynng and the extension transports.

    Args:
        scheme: ``abstract``, ``ipc``, ``tcp`` or ``auto`` (abstract on Linux, else ipc).
        host: the address to listen on for tcp.
        max_frame: the largest frame NNG accepts.
        recv_buffer: NNG's receive buffer, in messages.
    """

    def __init__(self, scheme: str, host: str, max_frame: int, recv_buffer: int) -> None:
        if scheme == "auto":
            scheme = "abstract" if sys.platform == "linux" else "ipc"
        self.sock = pynng.Pull0(recv_max_size=max_frame, recv_buffer_size=recv_buffer)
        try:
            listener = self.sock.listen(_fresh_address(scheme, host))
        except BaseException:
            self.sock.close()
            raise
        addr: str = listener.url
        if scheme == "tcp" and addr.endswith(":0"):
            # pynng's InAddr.port is in network byte order; its str() is right.
            port = str(listener.local_address).rsplit(":", 1)[1]
            addr = addr.rsplit(":", 1)[0] + f":{port}"
        self.address = addr
        self._ipc_path = addr[len("ipc://") :] if scheme == "ipc" else None

    def close(self) -> None:
        """Close the socket and remove its socket file (ipc)."""
        self.sock.close()
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass


def _fresh_address(scheme: str, host: str) -> str:
    name = f"amesh-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if scheme == "abstract":
        return f"abstract://{name}"
    if scheme == "ipc":
        base = ipc_dir()
        os.makedirs(base, mode=0o700, exist_ok=True)
        return f"ipc://{os.path.join(base, name)}.sock"
    if scheme == "tcp":
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:0"
    raise ValueError(f"unknown transport scheme {scheme!r} (abstract, ipc, tcp, auto)")


class NngTransport:
    """See :class:`amesh._transport.Transport`.

    Args:
        scheme: ``abstract``, ``ipc``, ``tcp`` or ``auto``.
        host: the address to listen on for tcp.
        max_frame: the largest frame accepted, in bytes.
    """

    def __init__(
        self, scheme: str = "auto", *, host: str = "127.0.0.1", max_frame: int = DEFAULT_MAX_FRAME
    ) -> None:
        self._max_frame = max_frame
        self._closed = False
        self._peers: dict[str, pynng.Push0] = {}
        self._send_locks: dict[str, anyio.Lock] = {}
        self._send_fds: dict[str, int] = {}
        self._sent = self._received = self._bytes_sent = self._bytes_received = 0
        self._box = Inbox(scheme, host, max_frame, _RECV_BUFFER)
        self._address = self._box.address

    @property
    def address(self) -> str:
        return self._address

    @property
    def max_frame(self) -> int:
        return self._max_frame

    def _peer(self, addr: str) -> pynng.Push0:
        sock = self._peers.get(addr)
        if sock is None:
            if self._closed:
                raise TransportClosed("transport is closed")
            sock = pynng.Push0(
                send_buffer_size=_SEND_BUFFER, reconnect_time_min=10, reconnect_time_max=200
            )
            try:
                sock.dial(addr, block=False)
            except BaseException:
                sock.close()
                raise
            self._peers[addr] = sock
        return sock

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
        sock = self._peer(addr)
        try:
            sock.send(frame, block=False)
        except pynng.TryAgain:
            return False
        except pynng.Closed:
            raise TransportClosed("transport is closed") from None
        self._sent += 1
        self._bytes_sent += len(frame)
        return True

    async def send(self, addr: str, frame: Frame) -> None:
        frame = self._check(frame)  # join once, not at every retry
        if self.try_send(addr, frame):
            return
        # The link is full. Only one task may wait on a given fd (trio insists), so
        # waiters for the same peer queue on a lock.
        lock = self._send_locks.setdefault(addr, anyio.Lock())
        async with lock:
            while not self.try_send(addr, frame):
                sock = self._peers.get(addr)
                if sock is None:
                    raise TransportClosed(f"link to {addr} was closed")
                fd = self._send_fds.get(addr)
                if fd is None:
                    fd = self._send_fds[addr] = sock.send_fd
                try:
                    await anyio.wait_readable(fd)
                except anyio.ClosedResourceError:
                    raise TransportClosed(f"link to {addr} was closed") from None

    async def serve(self, deliver: Callable[[Any], None]) -> None:
        sock = self._box.sock
        fd = sock.recv_fd
        while True:
            try:
                await anyio.wait_readable(fd)
            except anyio.ClosedResourceError:
                raise TransportClosed("transport is closed") from None
            while True:
                try:
                    frame = sock.recv(block=False)
                except pynng.TryAgain:
                    break
                except pynng.Closed:
                    raise TransportClosed("transport is closed") from None
                except RuntimeError:
                    # pynng 0.9 cannot unpack a zero-length message (NULL body); the
                    # message is consumed, so hand it on as the empty frame it was.
                    frame = b""
                self._received += 1
                self._bytes_received += len(frame)
                deliver(frame)

    def forget(self, addr: str) -> None:
        sock = self._peers.pop(addr, None)
        self._send_locks.pop(addr, None)
        fd = self._send_fds.pop(addr, None)
        if fd is not None:
            notify_closing(fd)
        if sock is not None:
            sock.close()

    def statistics(self) -> TransportStats:
        return TransportStats(
            frames_sent=self._sent,
            frames_received=self._received,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            peers=len(self._peers),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in self._send_fds.values():
            notify_closing(fd)
        self._send_fds.clear()
        for sock in self._peers.values():
            sock.close()
        self._peers.clear()
        notify_closing(self._box.sock.recv_fd)
        self._box.close()
