"""Transports move opaque frames between processes; they know nothing of actors."""

from __future__ import annotations

import os

from ._base import Transport, TransportClosed, TransportStats
from ._nng import NngTransport

__all__ = [
    "NngTransport",
    "Transport",
    "TransportClosed",
    "TransportStats",
    "default_impl",
    "open_transport",
]


def default_impl() -> str:
    """``AMESH_TRANSPORT_IMPL``: ``ext`` (the C extension; the default when it is
    built) or ``nng`` (pure pynng)."""
    impl = os.environ.get("AMESH_TRANSPORT_IMPL", "")
    if impl not in ("", "ext", "nng"):
        raise ValueError(f"AMESH_TRANSPORT_IMPL must be 'ext' or 'nng', not {impl!r}")
    if impl == "":
        try:
            from . import _ext  # noqa: F401
        except ImportError:
            return "nng"
        return "ext"
    return impl


def open_transport(scheme: str = "auto", host: str = "127.0.0.1") -> Transport:
    """Open the default transport, listening on a fresh address.

    Args:
        scheme: ``"abstract"`` (Linux abstract sockets, no files), ``"ipc"``
            (socket files), ``"tcp"`` or ``"auto"`` (abstract on Linux, else ipc).
        host: the interface for ``tcp``; loopback unless you mean otherwise.
    """
    if default_impl() == "ext":
        from ._ext import ExtTransport

        return ExtTransport(scheme, host=host)
    return NngTransport(scheme, host=host)
