"""What the stream transport's two connection cores share: one per event-loop family.

- asyncio (:mod:`._stream_aio`): the loop's own protocols do the I/O, with the C
  extension's reader and writer under them where it is built;
- anyio (:mod:`._stream_anyio`): non-blocking sockets driven with anyio's
  ``wait_readable``/``wait_writable``, for trio (and for asyncio where
  :attr:`~._stream.StreamTransport.fast_asyncio` is off).

:class:`~amesh._transport._stream.StreamTransport` owns their connections; see its
module for the design, and :mod:`._auth` for the handshake that opens every connection:
an inbound connection's bytes go to a :class:`~._auth.Gate` until the peer has proven
itself, and only then to the reader that cuts frames. Here: the water marks and batch
sizes, the senders waiting for room (:class:`Waiters`), why a dial failed, and starting
a background task on either loop.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from typing import Any

import anyio

from ._auth import HANDSHAKE_TIMEOUT

__all__ = [
    "BATCH_BYTES",
    "BATCH_FRAME",
    "HIGH_WATER",
    "IOV_MAX",
    "LOW_WATER",
    "RETRY_MAX",
    "RETRY_MIN",
    "LostCallback",
    "Waiters",
    "cannot_connect",
    "notify_closing_quietly",
    "spawn_system_task",
]

#: A link takes frames while fewer bytes than this wait in user space for its peer.
HIGH_WATER = 2 * 1024 * 1024
#: asyncio resumes a paused link once its write buffer is below this.
LOW_WATER = HIGH_WATER // 4
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
#: A link's frame goes to the kernel at once when something was read since its last
#: frame written at once (the peer can start on it); after that one, frames of up to
#: this many bytes wait for the end of the loop's turn and go in one system call, up to
#: :data:`BATCH_BYTES` at a time.
BATCH_FRAME = 16 * 1024
BATCH_BYTES = 256 * 1024
#: A first connect that fails is tried again after this, doubling up to the maximum,
#: for :data:`~._base.FIRST_CONNECT_WINDOW` seconds.
RETRY_MIN = 0.01
RETRY_MAX = 0.2

#: Called with a link and why it broke; the transport drops it and reports it.
LostCallback = Callable[[Any, str], None]


class Waiters:
    """What both kinds of link share: senders waiting for room, and their turn."""

    __slots__ = ("_space", "closed", "fast", "lock", "waiters")

    def __init__(self) -> None:
        self.closed = False
        #: the live connection's C writer, where there is one (see _fast_conn)
        self.fast: Any = None
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


def cannot_connect(exc: OSError) -> str:
    """Why dialling failed, never empty (a timeout's own text is)."""
    if isinstance(exc, TimeoutError):
        return (
            f"cannot connect: no answer within {HANDSHAKE_TIMEOUT:g} s (the listener "
            "is stopped, or overloaded)"
        )
    return f"cannot connect: {exc.strerror or exc}"


def notify_closing_quietly(sock: socket.socket) -> None:
    try:
        anyio.notify_closing(sock)
    except RuntimeError:  # no event loop in this thread: nobody waits on it here
        pass


def spawn_system_task(backend: str, fn: Callable[[], Any], tasks: set[Any]) -> None:
    """Run ``fn()`` in the background, outside any task group of the caller."""
    if backend == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn)
    else:
        task = asyncio.get_running_loop().create_task(fn())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
