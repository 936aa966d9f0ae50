"""The wire schema: msgspec envelopes behind a three-byte preamble.

Every frame is ``MAGIC (2 bytes) | version (1 byte) | envelope length (u32 LE) |
msgpack envelope | out-of-band buffers``. Envelopes are tagged, array-like msgspec
Structs; those that carry a payload list the lengths of its buffers, which follow the
envelope back to back, so large buffers are never copied into the envelope. The
first fields of every request envelope are stable across protocol versions
(``[tag, sender, call_id, rank, ...]``) so that a runtime can answer a frame of an
unknown version with a clear error.
"""

from __future__ import annotations

import struct

import msgspec

__all__ = [
    "MAGIC",
    "VERSION",
    "Call",
    "Cancel",
    "Cast",
    "Envelope",
    "Error",
    "FailureReport",
    "Heartbeat",
    "Ready",
    "Reply",
    "Frame",
    "decode",
    "encode",
    "frame_size",
    "join",
]

MAGIC = b"AM"
VERSION = 1
_LEN = struct.Struct("<I")
_HEADER = MAGIC + bytes([VERSION]) + bytes(4)
_HEADER_LEN = len(_HEADER)


class Call(msgspec.Struct, tag="call", array_like=True):
    """Run ``method`` on ``actor`` and reply to ``sender`` with ``call_id``.

    ``chain`` lists the serial handlers waiting on this call, outermost first, as
    ``"address#actor key#label"``: the receiver refuses a call that would wait on
    itself.
    """

    sender: str
    call_id: int
    rank: int
    actor: str
    method: str
    labels: list[str]
    sizes: list[int]
    payload: bytes
    chain: list[str] = []
    buffers: list[int] = []


class Cast(msgspec.Struct, tag="cast", array_like=True):
    """Like :class:`Call`, with no reply; a failure is reported to the owner."""

    sender: str
    call_id: int
    rank: int
    actor: str
    method: str
    labels: list[str]
    sizes: list[int]
    payload: bytes
    buffers: list[int] = []


class Reply(msgspec.Struct, tag="reply", array_like=True):
    """A result for ``call_id`` from ``rank``; ``last`` is False for stream items."""

    call_id: int
    rank: int
    payload: bytes
    buffers: list[int] = []


class Error(msgspec.Struct, tag="error", array_like=True):
    """An exception for ``call_id`` from ``rank``, as data."""

    call_id: int
    rank: int
    type_name: str
    message: str
    traceback: str


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    """Cancel ``sender``'s call ``call_id`` if it is queued or running."""

    sender: str
    call_id: int


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """A worker process is listening at ``addr``."""

    token: str
    addr: str
    pid: int


class FailureReport(msgspec.Struct, tag="failure", array_like=True):
    """A supervision event reported to the owner of actor mesh ``actor``."""

    actor: str
    rank: int
    pid: int
    cause: str


class Heartbeat(msgspec.Struct, tag="hb", array_like=True):
    """A worker at ``addr`` is alive (sent from a thread, whatever its loop does)."""

    addr: str
    pid: int


Envelope = Call | Cast | Reply | Error | Cancel | Ready | FailureReport | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
_loose = msgspec.msgpack.Decoder()


class BadFrame(Exception):
    """A frame that is not an amesh frame at all, or is truncated."""


class BadVersion(Exception):
    """A well-formed frame of another protocol version.

    Attributes:
        version: the version the frame claims.
        sender, call_id, rank: taken from the stable preamble when present, so the
            runtime can answer.
    """

    def __init__(self, version: int, sender: str | None, call_id: int, rank: int) -> None:
        super().__init__(version)
        self.version = version
        self.sender = sender
        self.call_id = call_id
        self.rank = rank


#: A frame as handed to a transport: one buffer, or parts to be sent back to back.
Frame = bytes | list[bytes | memoryview]


def encode(env: Envelope, buffers: list[memoryview] | None = None) -> Frame:
    """Encode ``env`` (and the out-of-band ``buffers`` its ``buffers`` field lists)."""
    buf = bytearray(_HEADER)
    _encoder.encode_into(env, buf, _HEADER_LEN)
    _LEN.pack_into(buf, 3, len(buf) - _HEADER_LEN)
    if not buffers:
        return bytes(buf)
    return [bytes(buf), *buffers]


def join(frame: Frame | memoryview) -> bytes:
    """One bytes object for a frame (copies the parts of a multi-part frame)."""
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, list):
        return b"".join(frame)
    return bytes(frame)


def frame_size(frame: Frame) -> int:
    if isinstance(frame, list):
        return sum(memoryview(p).nbytes for p in frame)
    return len(frame)


def decode(frame: bytes | memoryview) -> tuple[Envelope, list[memoryview]]:
    """Decode one frame into its envelope and views of its out-of-band buffers.

    Raises:
        BadFrame: not an amesh frame, or truncated/malformed.
        BadVersion: an amesh frame of another protocol version.
    """
    view = memoryview(frame)
    if len(view) < _HEADER_LEN or view[:2] != MAGIC:
        raise BadFrame("no amesh preamble")
    version = view[2]
    (length,) = _LEN.unpack_from(view, 3)
    end = _HEADER_LEN + length
    if version != VERSION:
        sender: str | None = None
        call_id = rank = 0
        try:
            head = _loose.decode(view[_HEADER_LEN:end])
        except msgspec.DecodeError:
            head = None
        if isinstance(head, list) and len(head) >= 4:
            s, c, r = head[1], head[2], head[3]
            if isinstance(s, str) and isinstance(c, int) and isinstance(r, int):
                sender, call_id, rank = s, c, r
        raise BadVersion(version, sender, call_id, rank)
    if end > len(view):
        raise BadFrame("truncated envelope")
    try:
        env = _decoder.decode(view[_HEADER_LEN:end])
    except msgspec.DecodeError as exc:
        raise BadFrame(str(exc)) from None
    lengths: list[int] = getattr(env, "buffers", None) or []
    buffers = []
    pos = end
    for n in lengths:
        if n < 0 or pos + n > len(view):
            raise BadFrame("truncated buffers")
        buffers.append(view[pos : pos + n])
        pos += n
    if pos != len(view):
        raise BadFrame(f"{len(view) - pos} stray bytes after the envelope")
    return env, buffers
