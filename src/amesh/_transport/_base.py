"""The Transport protocol that the runtime is written against."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

if TYPE_CHECKING:
    from .._wire import Frame

__all__ = ["Transport", "TransportClosed", "TransportStats"]


class TransportClosed(Exception):
    """The transport was closed by its owner."""


class TransportStats(msgspec.Struct, frozen=True):
    """Counters of one transport (immutable snapshot)."""

    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    peers: int


class Transport(Protocol):
    """One inbound endpoint per process, and outbound links dialled on demand.

    Frames from one sender to one receiver arrive in the order they were sent.
    """

    @property
    def address(self) -> str:
        """Where peers reach this transport."""
        ...

    @property
    def max_frame(self) -> int:
        """The largest frame, in bytes, that a send accepts."""
        ...

    def try_send(self, addr: str, frame: Frame) -> bool:
        """Hand ``frame`` (bytes, or a list of parts sent back to back) over without
        waiting; False when the link is full."""
        ...

    async def send(self, addr: str, frame: Frame) -> None:
        """Hand ``frame`` to the link towards ``addr``, waiting while it is full.

        Raises:
            ValueError: the frame is larger than :attr:`max_frame`.
            TransportClosed: the transport was closed.
        """
        ...

    async def serve(self, deliver: Callable[[Any], None]) -> None:
        """Receive forever, calling ``deliver`` with every inbound frame.

        ``deliver`` gets a bytes-like frame (bytes, or a buffer it may keep views of)
        and must not block; it runs on the event loop.
        """
        ...

    def forget(self, addr: str) -> None:
        """Close the link towards ``addr`` (the peer is gone)."""
        ...

    def statistics(self) -> TransportStats:
        """A snapshot of the counters."""
        ...

    def close(self) -> None:
        """Close every socket; idempotent."""
        ...
