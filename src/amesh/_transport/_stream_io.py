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
sizes, what an outbound link is (:class:`LinkCore`: the listener it dials, the senders
waiting for room), dialling a listener and answering its challenge (:meth:`LinkCore.dial`,
with anyio's primitives, which drive either loop), and starting a background task on
either loop.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from collections.abc import Callable
from typing import Any

import anyio

from ._auth import CHALLENGE_LEN, HANDSHAKE_TIMEOUT, Refused, answer
from ._base import FIRST_CONNECT_WINDOW
from ._stream_framing import SockAddr

__all__ = [
    "BATCH_BYTES",
    "BATCH_FRAME",
    "HIGH_WATER",
    "IOV_MAX",
    "LOW_WATER",
    "RETRY_MAX",
    "RETRY_MIN",
    "CannotConnect",
    "LinkCore",
    "LostCallback",
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


class CannotConnect(Exception):
    """:meth:`LinkCore.dial` failed for good; its text says why (for the lost handler)."""


class LinkCore:
    """What both kinds of outbound link share: the listener they dial and whom they
    speak for (:meth:`dial`), the senders waiting for room and their turn, and the
    live connection's C writer.

    Args:
        addr: the listener's address.
        family: its socket family.
        sockaddr: its socket address.
        own: the address the link proves it speaks for.
        on_lost: told (once) when the link broke.
    """

    __slots__ = (
        "_family",
        "_on_lost",
        "_own",
        "_sockaddr",
        "_space",
        "addr",
        "closed",
        "fast",
        "lock",
        "waiters",
    )

    def __init__(
        self, addr: str, family: int, sockaddr: SockAddr, own: str, on_lost: LostCallback
    ) -> None:
        self.addr = addr
        self._family = family
        self._sockaddr = sockaddr
        self._own = own
        self._on_lost = on_lost
        self.closed = False
        #: the live connection's C writer, where there is one (see _fast_conn)
        self.fast: Any = None
        self.waiters = 0
        self.lock: anyio.Lock | None = None
        self._space: anyio.Event | None = None

    async def dial(self) -> tuple[socket.socket, bytes]:
        """A non-blocking socket connected to this link's listener, and the answer to
        its challenge (see :mod:`._auth`), to be written first.

        While the listener is not there yet (refused, no such socket, no challenge
        within :data:`~._auth.HANDSHAKE_TIMEOUT`: any :class:`OSError`), it dials
        again after :data:`RETRY_MIN` seconds, doubling up to :data:`RETRY_MAX`, for
        :data:`~._base.FIRST_CONNECT_WINDOW` seconds. Runs on asyncio and trio alike
        (cancelled: the link closed).

        Raises:
            CannotConnect: the window passed, the listener refused us (not an amesh
                challenge, or it closed first), no socket could be made (out of
                descriptors, say), or anything else went wrong: never hangs the link.
        """
        delay = RETRY_MIN
        give_up = anyio.current_time() + FIRST_CONNECT_WINDOW
        while True:
            try:
                sock = socket.socket(self._family, socket.SOCK_STREAM)
            except OSError as exc:
                raise CannotConnect(f"cannot make a socket: {exc}") from None
            try:
                try:
                    with anyio.fail_after(HANDSHAKE_TIMEOUT):
                        challenge = await _challenge(sock, self._sockaddr)
                        hello = answer(challenge, self.addr, self._own)
                    if self._family != socket.AF_UNIX:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return sock, hello
                except BaseException:
                    sock.close()
                    raise
            except Refused as exc:
                raise CannotConnect(str(exc)) from None
            except OSError as exc:  # refused, no such socket yet, timed out
                if anyio.current_time() >= give_up:
                    raise CannotConnect(_cannot_connect(exc)) from None
            except Exception as exc:
                raise CannotConnect(f"cannot connect: {exc!r}") from None
            await anyio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX)

    async def wait_space(self) -> None:
        if self._space is None:
            self._space = anyio.Event()
        await self._space.wait()

    def wake(self) -> None:
        space, self._space = self._space, None
        if space is not None:
            space.set()


async def _challenge(sock: socket.socket, sockaddr: SockAddr) -> bytes:
    """Connect ``sock`` to ``sockaddr`` and read the listener's challenge."""
    sock.setblocking(False)
    err = sock.connect_ex(sockaddr)
    if err in (errno.EINPROGRESS, errno.EAGAIN):
        await anyio.wait_writable(sock)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))
    challenge = b""
    while len(challenge) < CHALLENGE_LEN:
        await anyio.wait_readable(sock)
        try:
            got = sock.recv(CHALLENGE_LEN - len(challenge))
        except (BlockingIOError, InterruptedError):
            continue
        if not got:
            raise Refused("the listener closed the connection before its challenge")
        challenge += got
    return challenge


def _cannot_connect(exc: OSError) -> str:
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
