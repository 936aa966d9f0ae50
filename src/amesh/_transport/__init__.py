"""Transports move opaque frames between processes; they know nothing of actors.

Every connection proves that its dialer holds the job key before anything it sends is
decoded (:mod:`._auth`), and a link that breaks is reported to the owner
(``set_lost_handler``).

The NNG transports (:mod:`._nng`, :mod:`._ext`) are imported only when one is chosen
or an NNG address is dialled: with the default stream transport, pynng is never
imported.
"""

from __future__ import annotations

import os
from typing import Protocol

from ._base import Deliver, Transport, TransportClosed, TransportStats
from ._stream import StreamBeat, StreamTransport, is_stream_address

__all__ = [
    "Deliver",
    "HeartbeatSender",
    "StreamTransport",
    "Transport",
    "TransportClosed",
    "TransportStats",
    "default_impl",
    "heartbeat_sender",
    "open_transport",
]

_IMPLS = ("ext", "nng", "stream")


def default_impl() -> str:
    """``AMESH_TRANSPORT_IMPL``: ``stream`` (the default: length-prefixed frames over
    sockets driven by the event loop), ``ext`` (NNG through the C extension) or ``nng``
    (pure pynng).

    Measured on a 2-CPU box, a round trip costs ~45-85 µs over ``stream`` and
    ~190-300 µs over ``ext``: NNG does its socket I/O on its own threads, and the hops
    and wake-ups between those threads and the event loop are most of that gap.
    """
    impl = os.environ.get("AMESH_TRANSPORT_IMPL", "")
    if impl not in ("", *_IMPLS):
        raise ValueError(f"AMESH_TRANSPORT_IMPL must be 'ext', 'nng' or 'stream', not {impl!r}")
    return impl or "stream"


def open_transport(
    scheme: str = "auto", host: str = "127.0.0.1", *, reach: str | None = None
) -> Transport:
    """Open the default transport, listening on a fresh address.

    Args:
        scheme: ``"abstract"`` (Linux abstract sockets, no files), ``"ipc"``
            (socket files), ``"tcp"``, ``"tls+tcp"`` (tcp with TLS, both ends showing a
            certificate of the job: an NNG transport, whatever :func:`default_impl`
            says) or ``"auto"`` (abstract on Linux, else ipc). A ``stream+`` prefix
            (the scheme of a :class:`StreamTransport` address) asks for a
            :class:`StreamTransport` unless ``reach`` says otherwise.
        host: the interface for ``tcp`` and ``tls+tcp``; loopback unless you mean
            otherwise.
        reach: an address the transport must be able to send to (a worker's parent):
            its kind decides between :class:`StreamTransport` and the NNG transports,
            whatever :func:`default_impl` says; ``None`` leaves it to the scheme and
            :func:`default_impl`.
    """
    impl = default_impl()
    if reach is not None:
        if is_stream_address(reach):
            impl = "stream"
        elif impl == "stream":
            impl = _nng_impl()
    elif is_stream_address(scheme):
        impl = "stream"
    elif scheme == "tls+tcp" and impl == "stream":
        impl = _nng_impl()  # only NNG speaks TLS here
    scheme = scheme.removeprefix("stream+")
    if impl == "stream":
        return StreamTransport(scheme, host=host)
    if impl == "ext":
        from ._ext import ExtTransport

        return ExtTransport(scheme, host=host)
    from ._nng import NngTransport

    return NngTransport(scheme, host=host)


def _nng_impl() -> str:
    try:
        from . import _ext  # noqa: F401
    except ImportError:
        return "nng"
    return "ext"


class HeartbeatSender(Protocol):
    """Sends small frames to one address from a plain thread (see :func:`heartbeat_sender`)."""

    def send(self, frame: bytes) -> bool:
        """Send ``frame`` without blocking for long; False when it was dropped."""
        ...

    def close(self) -> None:
        """Release the connection; idempotent."""
        ...


def heartbeat_sender(addr: str, own: str = "") -> HeartbeatSender:
    """A blocking sender of small frames to ``addr`` (an NNG or a stream transport's
    address), for a plain thread: sends never block for long, and a lost connection is
    dialled again. It proves to the listener that it speaks for ``own`` (the sender's
    own address; "" for none) with the job key."""
    if is_stream_address(addr):
        return StreamBeat(addr, own)
    from ._nng import NngBeat

    return NngBeat(addr, own)
