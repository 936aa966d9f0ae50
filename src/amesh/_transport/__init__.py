"""Transports move opaque frames between processes; they know nothing of actors."""

from __future__ import annotations

from ._base import Transport, TransportClosed, TransportStats
from ._nng import NngTransport

__all__ = ["NngTransport", "Transport", "TransportClosed", "TransportStats", "open_transport"]


def open_transport(scheme: str = "auto", host: str = "127.0.0.1") -> Transport:
    """Open the default transport, listening on a fresh address.

    Args:
        scheme: ``"abstract"`` (Linux abstract sockets, no files), ``"ipc"``
            (socket files), ``"tcp"`` or ``"auto"`` (abstract on Linux, else ipc).
        host: the interface for ``tcp``; loopback unless you mean otherwise.
    """
    return NngTransport(scheme, host=host)
