"""Transports move opaque frames between processes; they know nothing of actors.

Every connection proves that its dialer holds the job key (:mod:`amesh._identity`)
before anything it sends is decoded (:mod:`._auth`; its names that other packages speak
the handshake with are exported here), and a link that breaks is reported to the owner
(``set_lost_handler``).

``tcp`` means encrypted between hosts: a :class:`HybridTransport` (:mod:`._hybrid`)
speaks NNG over ``tls+tcp`` to other hosts and event-loop streams within its host, under
one ``tls+tcp://`` address. ``stream+tcp`` is the plain opt-out (still authenticated by
the job key).

The NNG transport (:mod:`._ext`) and the NNG heartbeat sender (:mod:`._nng`) are
imported only when NNG is chosen or an NNG address is dialled: with the default stream
transport, pynng is never imported.

This is the package's front door: other packages import only what is exported here.
The main entry points are :func:`open_transport` (a process's :class:`Transport`),
:func:`heartbeat_sender`, the handshake's names, the stream transport's addresses and
frames (:func:`is_stream_address`, :data:`STREAM_HEADER`), and, loaded on first use
because they import pynng and ``cryptography`` (a module ``__getattr__``),
:class:`NngBeat` and the TLS material of the job (:func:`prepare_tls`,
:func:`tls_material`); :func:`load_nng` loads the NNG transport ahead of use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .._config import settings
from ._auth import (
    CHALLENGE_LEN,
    HANDSHAKE_TIMEOUT,
    Gate,
    Refusals,
    Refused,
    check_peer,
    mac,
)
from ._base import Deliver, Transport, TransportClosed, TransportStats
from ._frame import Frame, frame_size, join
from ._guard import Limits
from ._hybrid import TLS_PREFIX, HostStreams, HybridTransport, local_route, open_tls
from ._memory import MemoryTransport
from ._paths import ipc_dir
from ._stream import StreamBeat, StreamTransport, is_stream_address
from ._stream_framing import HEADER as STREAM_HEADER
from ._stream_framing import fresh_address as fresh_stream_address
from ._stream_framing import parse_address as parse_stream_address
from ._tags import TAG_PATTERN, dial_part

if TYPE_CHECKING:
    from ._nng import NngBeat
    from ._tls import Material
    from ._tls import material as tls_material
    from ._tls import prepare as prepare_tls

__all__ = [
    "CHALLENGE_LEN",
    "HANDSHAKE_TIMEOUT",
    "STREAM_HEADER",
    "TAG_PATTERN",
    "TLS_PREFIX",
    "Deliver",
    "Frame",
    "Gate",
    "HeartbeatSender",
    "HostStreams",
    "HybridTransport",
    "Limits",
    "Material",
    "MemoryTransport",
    "NngBeat",
    "Refusals",
    "Refused",
    "StreamBeat",
    "StreamTransport",
    "Transport",
    "TransportClosed",
    "TransportStats",
    "check_peer",
    "default_impl",
    "dial_part",
    "frame_size",
    "fresh_stream_address",
    "heartbeat_sender",
    "ipc_dir",
    "is_stream_address",
    "join",
    "load_nng",
    "local_route",
    "mac",
    "open_tls",
    "open_transport",
    "parse_stream_address",
    "prepare_tls",
    "tls_material",
]


def default_impl() -> str:
    """``AMESH_TRANSPORT_IMPL``: ``stream`` (the default: length-prefixed frames over
    sockets driven by the event loop) or ``ext`` (NNG through the C extension; ``nng``,
    once pure pynng, is now the same transport).

    Measured on a 2-CPU box, a round trip costs ~45-85 µs over ``stream`` and
    ~190-300 µs over ``ext``: NNG does its socket I/O on its own threads, and the hops
    and wake-ups between those threads and the event loop are most of that gap.

    With ``ext`` (or ``nng``) every link is NNG's: ``tcp`` then is NNG over ``tls+tcp``
    alone, within a host too.
    """
    return settings().transport_impl


def open_transport(
    scheme: str = "auto", host: str = "127.0.0.1", *, reach: str | None = None
) -> Transport:
    """Open the default transport, listening on a fresh address.

    Args:
        scheme: ``"abstract"`` (Linux abstract sockets, no files), ``"ipc"`` (socket
            files), ``"tcp"`` or ``"tls+tcp"`` (the same: TLS between hosts, both ends
            showing a certificate of the job, and event-loop streams within a host; a
            :class:`HybridTransport`, or an NNG transport alone over ``tls+tcp`` when
            :func:`default_impl` names one), ``"stream+tcp"`` (plain event-loop streams
            over tcp, authenticated by the job key but not encrypted) or ``"auto"``
            (abstract on Linux, else ipc). A ``stream+`` prefix asks for a
            :class:`StreamTransport` unless ``reach`` says otherwise (a
            :class:`HostStreams`: it reaches this host's ``tls+tcp`` processes too).
        host: the interface for the tcp schemes; loopback unless you mean otherwise.
        reach: an address the transport must be able to send to (a worker's parent):
            its kind decides between :class:`StreamTransport`, TLS (as for ``tcp``)
            and the NNG transport, whatever ``scheme`` and :func:`default_impl` say;
            ``None`` leaves it to them.
    """
    impl = default_impl()
    if reach is not None:
        if is_stream_address(reach):
            return HostStreams(scheme.removeprefix("stream+"), host=host)
        if reach.startswith(TLS_PREFIX):
            return _open_tls(impl, host)
        if impl == "stream":
            impl = "ext"
    elif is_stream_address(scheme):
        return HostStreams(scheme.removeprefix("stream+"), host=host)
    elif scheme in ("tcp", "tls+tcp"):
        return _open_tls(impl, host)
    scheme = scheme.removeprefix("stream+")
    if impl == "stream":
        return HostStreams(scheme, host=host)
    return _open_nng(scheme, host)


def _open_tls(impl: str, host: str) -> Transport:
    """TLS between hosts: a :class:`HybridTransport`, or the NNG transport alone."""
    if impl == "stream":
        return HybridTransport(host)
    return _open_nng("tls+tcp", host)


def _open_nng(scheme: str, host: str) -> Transport:
    from ._ext import ExtTransport

    return ExtTransport(scheme, host=host)


def load_nng() -> None:
    """Import the NNG transports now: pynng, and the C extension with NNG's functions
    bound (what the extension's own senders, such as a worker's heartbeat, need).

    Raises:
        ImportError: pynng or the C extension is not there.
    """
    from . import _ext  # noqa: F401  (importing it binds the extension to NNG)


def __getattr__(name: str) -> object:
    # These modules import pynng and cryptography, which a process on the default
    # stream transport never needs: they are loaded when a name of theirs is first used.
    if name == "NngBeat":
        from ._nng import NngBeat

        return NngBeat
    if name in ("Material", "prepare_tls", "tls_material"):
        from . import _tls

        tls = {
            "Material": _tls.Material,
            "prepare_tls": _tls.prepare,
            "tls_material": _tls.material,
        }
        return tls[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
