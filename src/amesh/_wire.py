"""The wire schema: msgspec envelopes behind a three-byte preamble.

Every frame is ``MAGIC (2 bytes) | version (1 byte) | envelope length (u32 LE) |
msgpack envelope | out-of-band buffers``. Envelopes are tagged, array-like msgspec
Structs; those that carry a payload list the lengths of its buffers, which follow the
envelope back to back, so large buffers are never copied into the envelope. A small
pickle travels inside the envelope (``payload``); a large one (at least
:data:`INLINE_LIMIT` bytes) travels as the first buffer, and ``payload`` is then empty
(a pickle never is). The first fields of every request envelope are stable across
protocol versions (``[tag, sender, call_id, rank, ...]``) so that a runtime can answer a
frame of an unknown version with a clear error.

Casts and calls to many ranks may travel down a relay tree (:class:`Relay`), and the
replies come back up it in batches (:class:`Gathered`): see ``_runtime._tree``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from ._transport._frame import Frame, frame_size, join

__all__ = [
    "MAGIC",
    "VERSION",
    "Call",
    "Cancel",
    "Cast",
    "Credit",
    "Died",
    "Envelope",
    "Error",
    "FailureReport",
    "Gathered",
    "Heartbeat",
    "Prune",
    "Ready",
    "Relay",
    "Reply",
    "Frame",
    "addressed",
    "decode",
    "encode",
    "frame_size",
    "join",
    "pack",
    "payload_size",
    "unpack",
]

MAGIC = b"AM"
VERSION = 3
#: A pickle at least this long travels as a frame part of its own, not in the envelope.
INLINE_LIMIT = 16 * 1024
#: Frames up to this size are sent as one bytes object (one small copy beats parts).
_JOIN_LIMIT = 64 * 1024
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
    #: where the reply goes, when not to ``sender`` (a relay gathering replies)
    reply_to: str = ""
    #: the call id the reply carries there
    reply_id: int = 0


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
    """A result for ``call_id`` from ``rank``."""

    call_id: int
    rank: int
    payload: bytes
    buffers: list[int] = []


class Relay(msgspec.Struct, tag="relay", array_like=True):
    """A call or cast for a subtree of ranks, sent to the root of that subtree.

    The receiver runs it itself when ``rank >= 0`` and forwards it to each subtree in
    ``nodes``: the subtree below the receiver in preorder, each node as ``(address,
    rank or -1 for a node that only relays, number of nodes below it)``. For a call
    (``reply_to`` set) the receiver gathers the replies of its whole subtree and sends
    them to ``reply_to`` as :class:`Gathered` with ``reply_id``.
    """

    sender: str
    call_id: int
    rank: int
    actor: str
    method: str
    labels: list[str]
    sizes: list[int]
    payload: bytes
    chain: list[str]
    buffers: list[int]
    reply_to: str
    reply_id: int
    nodes: list[tuple[str, int, int]]


def addressed(req: Relay, rank: int, nodes: list[tuple[str, int, int]]) -> Call | Cast | Relay:
    """``req`` as sent to one receiver: ``rank`` there, and a :class:`Relay` only when
    the receiver has a subtree ``nodes`` to pass it to; else a plain :class:`Call` (a
    ``reply_to`` is set) or :class:`Cast`."""
    if nodes:
        return msgspec.structs.replace(req, rank=rank, nodes=nodes)
    if req.reply_to:
        return Call(
            req.sender, req.call_id, rank, req.actor, req.method, req.labels, req.sizes,
            req.payload, req.chain, req.buffers, req.reply_to, req.reply_id,
        )  # fmt: skip
    return Cast(
        req.sender, req.call_id, rank, req.actor, req.method, req.labels, req.sizes,
        req.payload, req.buffers,
    )  # fmt: skip


def payload_size(env: Call | Cast) -> int:
    """Bytes of a request's payload: its pickle and out-of-band buffers."""
    return len(env.payload) + sum(env.buffers)


class Error(msgspec.Struct, tag="error", array_like=True):
    """An exception for ``call_id`` from ``rank``, as data."""

    call_id: int
    rank: int
    type_name: str
    message: str
    traceback: str


class Gathered(msgspec.Struct, tag="gathered", array_like=True):
    """Replies of a subtree, for ``call_id`` of the receiver (a call or a relay's gather).

    ``buffers`` is the concatenation of the replies' buffers, in order.
    """

    call_id: int
    replies: list[Reply | Error]
    buffers: list[int] = []


class Prune(msgspec.Struct, tag="prune", array_like=True):
    """``sender``'s call ``call_id``: stop waiting for ``ranks`` (their relay died)."""

    sender: str
    call_id: int
    ranks: list[int]


class Credit(msgspec.Struct, tag="credit", array_like=True):
    """``actor`` at ``addr`` has taken ``count`` messages (``nbytes`` of payload) of
    the receiver's casts from its mailbox so far (flow control). The counts are totals,
    not deltas: a lost or repeated credit cannot shrink or widen a window for good.
    A sender held back for a while sends a probe (``count`` -1, ``addr`` its own) to
    ask for the totals again."""

    addr: str
    actor: str
    count: int
    nbytes: int


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


class Died(msgspec.Struct, tag="died", array_like=True):
    """The process at ``addr`` is gone: sent by its supervisor to the processes that
    may be calling it, so that their calls fail at once (see :class:`~amesh.Failure`
    for the fields)."""

    addr: str
    mesh: str
    rank: int
    pid: int | None
    host: str
    cause: str
    exit_code: int | None = None
    signal: int | None = None


Envelope = (
    Call
    | Cast
    | Reply
    | Error
    | Cancel
    | Ready
    | FailureReport
    | Heartbeat
    | Relay
    | Gathered
    | Prune
    | Credit
    | Died
)

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


def encode(env: Envelope, buffers: list[Any] | None = None) -> Frame:
    """Encode ``env`` (and the out-of-band ``buffers`` its ``buffers`` field lists).

    A small frame comes back as one bytes object, a large one as a list of parts
    (the buffers are not copied).
    """
    buf = bytearray(_HEADER)
    _encoder.encode_into(env, buf, _HEADER_LEN)
    _LEN.pack_into(buf, 3, len(buf) - _HEADER_LEN)
    if not buffers:
        return bytes(buf)
    if sum(memoryview(b).nbytes for b in buffers) <= _JOIN_LIMIT:
        for b in buffers:
            buf += b
        return bytes(buf)
    return [bytes(buf), *buffers]


def pack(data: bytes, buffers: list[Any]) -> tuple[bytes, list[int], list[Any]]:
    """``(envelope payload, buffer lengths, parts)`` for a pickle and its buffers."""
    if len(data) < INLINE_LIMIT:
        return data, [memoryview(b).nbytes for b in buffers], buffers
    parts = [data, *buffers]
    return b"", [memoryview(b).nbytes for b in parts], parts


def unpack(payload: bytes, buffers: list[Any]) -> tuple[Any, list[Any]]:
    """``(pickle, out-of-band buffers)`` of a received payload (see :func:`pack`)."""
    if payload or not buffers:
        return payload, buffers
    return buffers[0], buffers[1:]


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
    if not lengths:
        if end != len(view):
            raise BadFrame(f"{len(view) - end} stray bytes after the envelope")
        return env, []
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
