"""The Transport protocol that the runtime is written against."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

if TYPE_CHECKING:
    from ._frame import Frame

__all__ = ["FIRST_CONNECT_WINDOW", "Deliver", "Transport", "TransportClosed", "TransportStats"]

#: What a transport hands each inbound frame to: ``deliver(frame, peer)``, where
#: ``peer`` is the listening address the sending process proved it speaks for (see
#: :mod:`._auth`), so a receiver can tell who sent what.
Deliver = Callable[[Any, str], None]

#: How long a link keeps dialling a listener it never reached before it reports the
#: loss. The listener may not accept yet; but a worker's address is published once it
#: listens, so this is a margin, not a wait.
FIRST_CONNECT_WINDOW = 2.5


class TransportClosed(Exception):
    """The transport was closed by its owner."""


class TransportStats(msgspec.Struct, frozen=True):
    """Counters of one transport (immutable snapshot)."""

    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    peers: int
    #: connections (or NNG pipes) closed because the peer did not prove it holds the
    #: job key: wrong uid, wrong proof, garbage, or too slow
    auth_refused: int


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
        waiting; False when the link is full. Once it returns, the caller may change
        its buffers: what the transport holds back, it holds a copy of."""
        ...

    async def send(self, addr: str, frame: Frame) -> None:
        """Hand ``frame`` to the link towards ``addr``, waiting while it is full.

        Raises:
            ValueError: the frame is larger than :attr:`max_frame`.
            TransportClosed: the transport was closed.
        """
        ...

    async def serve(self, deliver: Deliver) -> None:
        """Receive forever, calling ``deliver(frame, peer)`` with every inbound frame.

        ``frame`` is bytes-like (bytes, or a buffer the receiver may keep views of);
        ``peer`` is the address its sender proved it speaks for when its connection
        was authenticated. ``deliver`` must not block; it runs on the event loop.
        """
        ...

    def forget(self, addr: str) -> None:
        """Close the link towards ``addr`` (the peer is gone); it reports nothing."""
        ...

    def set_lost_handler(self, handler: Callable[[str, str], None] | None) -> None:
        """Call ``handler(addr, why)`` on the event loop when the link towards ``addr``
        broke: its established connection ended (EOF, reset), the listener is gone
        (refused, no such socket) or refused our handshake, or a first connect did not
        succeed within :data:`FIRST_CONNECT_WINDOW`. The link is then dropped: frames queued or
        written into it are gone, and a later send dials afresh.

        Inbound connections that close are not reported (peers close their links on
        purpose), nor is a link closed by :meth:`forget` or :meth:`close`.
        """
        ...

    def statistics(self) -> TransportStats:
        """A snapshot of the counters."""
        ...

    def close(self) -> None:
        """Close every socket; idempotent."""
        ...
