"""The message object: a pickled payload as its sender makes it and its receiver reads it.

:func:`amesh._wire.dumps` makes a :class:`Payload`: the pickle (``data``), its
out-of-band buffers, and the fields it takes in an envelope (``inline``: the envelope's
``payload``; ``lengths``: its ``buffers``) with the ``parts`` that follow the envelope
in the frame. A small pickle travels inside the envelope; one of :data:`INLINE_LIMIT`
bytes or more travels as the first part, and ``inline`` is then empty (a pickle never
is). The receiver gives :func:`loads` the envelope's ``payload`` and the frame's
buffers, which are the sender's ``inline`` and ``parts``: one path, whoever receives
(a worker its call's arguments, a caller its replies, a process its actor's class).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

from ._envelopes import INLINE_LIMIT

__all__ = ["Payload", "loads", "plain_payload"]


class Payload:
    """A pickled object: the pickle bytes and its out-of-band buffers, and how they
    travel in a frame.

    Attributes:
        data: the pickle.
        buffers: its out-of-band buffers.
        segments: the shared-memory segments that :func:`amesh._wire.dumps` made for
            it (see :func:`amesh._wire.release_payload`); they stay with the sender and
            are never pickled.
        inline: what the envelope's ``payload`` field carries: ``data``, or nothing
            when ``data`` is :data:`INLINE_LIMIT` bytes or more.
        lengths: what the envelope's ``buffers`` field carries: the lengths of ``parts``.
        parts: what follows the envelope in the frame: ``buffers``, after ``data``
            when that does not travel inline.
    """

    __slots__ = ("buffers", "data", "inline", "lengths", "parts", "segments")

    def __init__(
        self, data: bytes, buffers: Sequence[Any] = (), segments: Sequence[str] = ()
    ) -> None:
        self.data = data
        self.buffers: list[Any] = [memoryview(b) for b in buffers]
        self.segments: tuple[str, ...] = tuple(segments)
        if len(data) < INLINE_LIMIT:
            self.inline = data
            self.parts = self.buffers
        else:
            self.inline = b""
            self.parts = [data, *self.buffers]
        self.lengths: list[int] = [memoryview(b).nbytes for b in self.parts]

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(memoryview(b).nbytes for b in self.buffers)

    def load(self) -> Any:
        """The object this payload carries, as its receiver gets it (:func:`loads`)."""
        return loads(self.inline, self.parts)

    def __reduce__(self) -> tuple[Any, ...]:
        # Nested in another pickle (spawn arguments), the buffers stay out of band.
        return (Payload, (self.data, [pickle.PickleBuffer(b) for b in self.buffers]))


class _Plain(Payload):
    """A small pickle without buffers or segments (most calls' arguments and
    results): what every payload of its kind has in common are class attributes, so
    making one sets two slots. Nothing changes a payload once made; these lists are
    never appended to."""

    __slots__ = ()
    buffers = parts = lengths = []  # noqa: RUF012
    segments = ()


def plain_payload(data: bytes) -> Payload:
    """``Payload(data)``: a pickle without buffers or segments, made at less cost."""
    if len(data) < INLINE_LIMIT:  # the common case
        payload = _Plain.__new__(_Plain)
        payload.data = payload.inline = data
        return payload
    return Payload(data)


def loads(payload: bytes | memoryview, buffers: Sequence[Any] = ()) -> Any:
    """The object that a message carries: its envelope's ``payload`` and the buffers
    after the envelope (a :class:`Payload`'s ``inline`` and ``parts``); or a pickle
    and its out-of-band buffers (a :class:`Payload`'s ``data`` and ``buffers``).
    Objects may be views of the buffers.

    Raises:
        RuntimeError: a shared-memory segment of the payload is gone.
    """
    if payload or not buffers:
        return pickle.loads(payload, buffers=buffers)
    return pickle.loads(buffers[0], buffers=buffers[1:])
