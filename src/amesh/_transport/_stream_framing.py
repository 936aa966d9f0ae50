"""The stream transport's framing: its addresses, its frames on the socket, and a
blocking sender (named apart from :mod:`amesh._wire`, the envelopes inside frames).

A frame travels as a 4-byte little-endian length followed by the frame's bytes, once
the connection's handshake (:mod:`._auth`) is done.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from ._auth import CHALLENGE_LEN, Refused, answer
from ._paths import ipc_dir
from ._tags import dial_part

if TYPE_CHECKING:
    from .._native._ext import FrameReader

__all__ = [
    "AnyReader",
    "HEADER",
    "HLEN",
    "MAX_SIZE",
    "NOSIGNAL",
    "PREFIX",
    "CUT_FRAMES",
    "BadStream",
    "Buf",
    "Reader",
    "SockAddr",
    "StreamBeat",
    "byte_view",
    "c_reader",
    "cut_frames_py",
    "fresh_address",
    "is_stream_address",
    "nbytes",
    "owned",
    "parse_address",
    "tail",
]

PREFIX = "stream+"
HEADER = struct.Struct("<I")
HLEN = HEADER.size
#: The largest frame the length can describe.
MAX_SIZE = 2**32 - 1
#: Inbound: frames up to this size are cut out of a per-connection buffer of
#: ``CHUNK`` bytes (one copy, into ``bytes``); larger ones are read straight into a
#: ``bytearray`` of their own, and from ``MAPPED`` bytes on into an anonymous
#: ``mmap``: a bytearray is zero-filled at once, under the GIL (a second or more for
#: a gigabyte, and a 4-byte header may ask for 2 GiB), while a mapping is filled in
#: by the kernel, page by page, as the socket is read into it without the GIL.
CHUNK = 64 * 1024
SMALL = 16 * 1024
MAPPED = 1024 * 1024
#: Outbound: buffered frames up to this size are joined into one ``bytes``.
JOIN_MAX = 64 * 1024
NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)

Buf = bytes | memoryview
SockAddr = str | tuple[Any, ...]


# -- addresses ---------------------------------------------------------------------------


def is_stream_address(addr: str) -> bool:
    """Whether ``addr`` is one of this transport's addresses."""
    return addr.startswith(PREFIX)


def parse_address(addr: str) -> tuple[int, SockAddr]:
    """The socket family and socket address that ``addr`` names.

    Raises:
        ValueError: ``addr`` is not a stream transport address.
    """
    scheme, sep, rest = dial_part(addr).partition("://")
    if sep and scheme == PREFIX + "abstract" and rest:
        return socket.AF_UNIX, "\0" + rest
    if sep and scheme == PREFIX + "ipc" and rest:
        return socket.AF_UNIX, rest
    if sep and scheme == PREFIX + "tcp":
        host, _, port = rest.rpartition(":")
        # a port the socket calls take (a larger one raises OverflowError there)
        if port.isascii() and port.isdigit() and len(port) <= 5 and int(port) <= 65535:
            if host.startswith("[") and host.endswith("]") and len(host) > 2:
                return socket.AF_INET6, (host[1:-1], int(port))
            if host and "[" not in host and "]" not in host:
                return socket.AF_INET, (host, int(port))
    raise ValueError(
        f"{addr!r} is not a stream transport address "
        "(stream+abstract://NAME, stream+ipc:///PATH, stream+tcp://HOST:PORT)"
    )


def fresh_address(scheme: str, host: str = "127.0.0.1", port: int = 0) -> str:
    """A new address of ``scheme`` that nobody listens on (tcp: ``port``, 0 for any)."""
    name = f"amesh-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if scheme == "abstract":
        return f"{PREFIX}abstract://{name}"
    if scheme == "ipc":
        return f"{PREFIX}ipc://{os.path.join(ipc_dir(), name)}.sock"
    if scheme == "tcp":
        return f"{PREFIX}tcp://[{host}]:{port}" if ":" in host else f"{PREFIX}tcp://{host}:{port}"
    raise ValueError(f"unknown transport scheme {scheme!r} (abstract, ipc, tcp, auto)")


# -- frames as buffers ---------------------------------------------------------------------


def byte_view(part: Any) -> Buf:
    """``part`` as bytes or a flat memoryview of unsigned bytes."""
    view = memoryview(part)
    if not view.c_contiguous:
        return view.tobytes()
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def owned(bufs: list[Buf], size: int) -> list[Buf]:
    """Buffers with the content of ``bufs`` that nobody else can change: small frames
    joined into one bytes, else bytes (and views of bytes) kept and the rest copied."""
    if size <= JOIN_MAX:
        return [b"".join(bufs)]
    return [
        b if isinstance(b, bytes) or isinstance(b.obj, bytes) else b.tobytes()
        for b in bufs
        if len(b)
    ]


def tail(bufs: list[Buf], n: int) -> list[Buf]:
    """What is left of ``bufs`` once their first ``n`` bytes are written."""
    for i, b in enumerate(bufs):
        if n < len(b):
            first = memoryview(b)[n:] if n else b
            return [first, *bufs[i + 1 :]]
        n -= len(b)
    return []


def nbytes(bufs: list[Buf]) -> int:
    return sum(len(b) for b in bufs)


class BadStream(Exception):
    """A peer announced a frame larger than this transport accepts."""


def _frame_memory(size: int) -> memoryview:
    """Writable memory for one large inbound frame, not zero-filled under the GIL.

    Raises:
        BadStream: the memory cannot be had (the peer will not get it either).
    """
    if size < MAPPED:
        return memoryview(bytearray(size))
    try:
        # Private and anonymous: untouched pages cost nothing, and the mapping goes
        # when the last view of it does.
        return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE))
    except OSError as exc:
        raise BadStream(f"no memory for a frame of {size} bytes ({exc})") from None


class Reader:
    """Cuts one connection's byte stream into frames and hands each to ``emit``.

    Feed it like a :class:`asyncio.BufferedProtocol`: read into :meth:`get_buffer`,
    then report the count to :meth:`buffer_updated`. Small frames are copied out of a
    reusable buffer; a large one gets memory of its own (see :data:`MAPPED`) that the
    socket reads into directly, delivered as a writable memoryview that keeps it
    alive. No delivered frame's memory is ever reused.
    """

    __slots__ = (
        "_big",
        "_buf",
        "_cut",
        "_emit",
        "_end",
        "_filled",
        "_max",
        "_start",
        "_view",
        "stopped",
    )

    def __init__(
        self,
        max_frame: int,
        emit: Callable[[Buf], None],
        cut: Callable[[bytearray, int, int, int], tuple[list[bytes], int, int]] | None = None,
    ) -> None:
        #: cuts the whole frames out of the buffer: C, or Python (:data:`CUT_FRAMES`)
        self._cut = cut or CUT_FRAMES
        self._buf = bytearray(CHUNK)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._big: memoryview | None = None
        self._filled = 0
        self._max = max_frame
        self._emit = emit
        #: Set when the connection is gone: emit no more frames.
        self.stopped = False

    def stop(self) -> None:
        """The connection is gone: emit no more frames, and let go of the memory of a
        large frame being read and of ``emit`` (which leads back to the connection), now,
        not when this reader is collected."""
        self.stopped = True
        self._big = None
        self._filled = self._start = self._end = 0
        self._emit = _dropped

    def get_buffer(self) -> memoryview:
        if self._big is not None:
            return self._big[self._filled :]
        return self._view[self._end :]

    def buffer_updated(self, n: int) -> None:
        """Account ``n`` bytes read into the buffer; emit the frames they complete.

        Raises:
            BadStream: a frame's length is above ``max_frame``.
        """
        if self.stopped:
            return
        big = self._big
        if big is not None:
            self._filled += n
            if self._filled == len(big):
                self._big = None
                self._emit(big)
            return
        self._end += n
        # (what follows runs for every read: written out here, not in a method)
        view, end = self._view, self._end
        frames, pos, size = self._cut(self._buf, self._start, end, self._max)
        self._start = pos
        for frame in frames:
            self._emit(frame)
            if self.stopped:
                return
        if size > self._max:
            raise BadStream(f"peer sent a frame of {size} bytes (max_frame {self._max})")
        if size > SMALL:
            big = _frame_memory(size)
            have = end - pos - HLEN
            big[:have] = view[pos + HLEN : end]
            self._big, self._filled = big, have
            self._start = self._end = 0
        elif pos == end:
            self._start = self._end = 0
        elif len(view) - pos < SMALL + HLEN:
            # Make room for the rest of the incomplete (small) frame.
            rest = bytes(view[pos:end])
            view[: len(rest)] = rest
            self._start, self._end = 0, len(rest)


def _dropped(frame: Buf) -> None:
    """What a stopped :class:`Reader` emits to (nothing reaches it)."""


#: A reader of either kind: :class:`Reader`, or its C twin (see :func:`c_reader`).
AnyReader = Union[Reader, "FrameReader"]


def cut_frames_py(buf: bytearray, start: int, end: int, limit: int) -> tuple[list[bytes], int, int]:
    """:func:`amesh._native._ext.cut_frames` in Python: the whole frames of ``buf[start:end]``,
    where the rest starts, and the length the next frame announces (-1: fewer than
    :data:`HLEN` bytes left). Stops at a frame above ``limit`` bytes."""
    frames: list[bytes] = []
    pos, size = start, -1
    while end - pos >= HLEN:
        (size,) = HEADER.unpack_from(buf, pos)
        stop = pos + HLEN + size
        if size > limit or stop > end:
            break
        frames.append(bytes(buf[pos + HLEN : stop]))
        pos, size = stop, -1
    return frames, pos, size


def _c_cutter() -> Callable[[bytearray, int, int, int], tuple[list[bytes], int, int]] | None:
    try:
        from .._native import _ext
    except ImportError:  # not built (an sdist without a compiler): the Python path
        return None
    return _ext.cut_frames


#: What a :class:`Reader` cuts frames with unless told: the C extension's
#: ``cut_frames`` where it is built, else :func:`cut_frames_py`.
CUT_FRAMES = _c_cutter() or cut_frames_py


def c_reader(max_frame: int, emit: Callable[[Buf], None]) -> AnyReader | None:
    """:class:`Reader` in C (``amesh._native._ext.FrameReader``), None where it is not built."""
    try:
        from .._native._ext import FrameReader
    except ImportError:
        return None
    return FrameReader(max_frame, emit, _frame_memory, BadStream)


# -- heartbeats from a plain thread --------------------------------------------------------


class StreamBeat:
    """Sends small frames to a stream address from a plain thread, never blocking long.

    Connects (and answers the listener's challenge, see :mod:`._auth`) on the first
    send and after a failure, waiting at most ``timeout`` seconds; a frame the
    connection cannot take at once is dropped.

    Args:
        addr: a stream transport address.
        own: the sender's own listening address, which it proves it speaks for.
        timeout: the longest a connect and its handshake may take, in seconds.
    """

    def __init__(self, addr: str, own: str = "", timeout: float = 1.0) -> None:
        self._addr = addr
        self._own = own
        self._family, self._sockaddr = parse_address(addr)
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._rest = b""

    def send(self, frame: bytes) -> bool:
        """Send ``frame``; False when it was dropped (no connection, or a full one)."""
        try:
            sock = self._sock or self._connect()
            if self._rest:  # finish the last frame first, or the stream is garbage
                self._rest = self._rest[sock.send(self._rest, NOSIGNAL) :]
                if self._rest:
                    return False
            data = HEADER.pack(len(frame)) + frame
            self._rest = data[sock.send(data, NOSIGNAL) :]
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, Refused):
            self.close()
            return False

    def _connect(self) -> socket.socket:
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout)
            sock.connect(self._sockaddr)
            challenge = b""
            while len(challenge) < CHALLENGE_LEN:
                got = sock.recv(CHALLENGE_LEN - len(challenge))
                if not got:
                    raise Refused("the listener closed the connection")
                challenge += got
            sock.sendall(answer(challenge, self._addr, self._own))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock, self._rest = sock, b""
        return sock

    def connect_fd(self) -> int:
        """Connect and prove (as :meth:`send` would), then give the connection away:
        its file descriptor, which the caller now owns (for a sender outside Python,
        such as :class:`amesh._native._ext.Beat`).

        Raises:
            OSError: cannot connect.
            Refused: the listener did not send an amesh challenge.
        """
        self.close()
        sock = self._connect()
        self._sock = None
        return sock.detach()

    def close(self) -> None:
        """Close the connection (a later :meth:`send` connects again)."""
        sock, self._sock = self._sock, None
        self._rest = b""
        if sock is not None:
            sock.close()
