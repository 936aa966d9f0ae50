"""The envelopes: msgspec structs behind a three-byte preamble, and the frames they make.

Every frame is ``MAGIC (2 bytes) | version (1 byte) | envelope length (u32 LE) |
msgpack envelope | out-of-band buffers``. Envelopes are tagged, array-like msgspec
Structs; those that carry a payload list the lengths of its buffers, which follow the
envelope back to back, so large buffers are never copied into the envelope. A small
pickle travels inside the envelope (``payload``); a large one (at least
:data:`INLINE_LIMIT` bytes) travels as the first buffer, and ``payload`` is then empty
(a pickle never is; see :class:`amesh._wire.Payload`). The first fields of every
request envelope are stable across protocol versions (``[tag, sender, call_id, rank,
...]``) so that a runtime can answer a frame of an unknown version with a clear error.

Casts and calls to many ranks may travel down a relay tree (:class:`Relay`), and the
replies come back up it in batches (:class:`Gathered`): see ``_runtime._tree``.

:func:`decode` checks every field of every envelope (addresses have the form of one,
ranks, ids and sizes are in range, strings and lists are bounded, the buffers of a
:class:`Gathered` add up): a frame that fails is :class:`BadFrame`, which the runtime
drops and counts, so nothing behind decode meets such a value. The checks do not
change the encoding.

The hot path is in C where the extension is built: :func:`try_decode` (a frame's
preamble, envelope, checks and buffers in one call; None for a frame it does not take,
which :func:`decode` then explains) and :func:`encode_envelope` (a frame with no
buffers). The Python versions do the same where it is not built.
"""

from __future__ import annotations

import operator
import re
import struct
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .._transport import TAG_PATTERN, Frame, frame_size, join

__all__ = [
    "ADDRESS_PATTERN",
    "LOG",
    "MAGIC",
    "MAX_LINE",
    "MAX_NAME",
    "MAX_OUTPUT_LINES",
    "MAX_TEXT",
    "STDERR",
    "STDOUT",
    "VERSION",
    "Address",
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
    "Output",
    "OutputLine",
    "Prune",
    "Ready",
    "Relay",
    "Reply",
    "Frame",
    "addressed",
    "clip",
    "decode",
    "encode",
    "encode_envelope",
    "frame_size",
    "is_address",
    "join",
    "payload_size",
    "try_decode",
]

MAGIC = b"AM"
#: 4 since tcp addresses may end in a tag (``_transport._tags``): a peer of version 3
#: would drop the frames of such a sender as malformed, and now answers with a clear
#: error instead.
VERSION = 4
#: A pickle at least this long travels as a frame part of its own, not in the envelope.
INLINE_LIMIT = 16 * 1024
#: Frames up to this size are sent as one bytes object (one small copy beats parts).
_JOIN_LIMIT = 64 * 1024
_LEN = struct.Struct("<I")
_HEADER = MAGIC + bytes([VERSION]) + bytes(4)
_HEADER_LEN = len(_HEADER)

# -- what every field may hold --------------------------------------------------------
#
# Each field is checked where the frame is decoded: a value out of its range is a
# malformed frame (BadFrame, a counted drop), so nothing behind decode meets it. The
# bounds are generous for what amesh sends, and none changes the encoding.

#: A port, 0..65535.
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
#: The addresses transports listen on: the stream transport's (``stream+abstract://NAME``,
#: ``stream+ipc://PATH``, ``stream+tcp://HOST:PORT``), NNG's (the same without
#: ``stream+``), and the in-memory test transport's (``memory://HEX``). A unix name or
#: path has no control character and at most 240 characters, a tcp host is a name or
#: a (bracketed) IPv6 literal, and a tcp address on a port the kernel picked ends in
#: its tag (``/`` and 12 hex digits: see ``_transport._tags``): so an address is at
#: most 978 bytes of UTF-8, within what a handshake can carry
#: (``_transport._auth.MAX_ADDRESS``).
_ADDRESS = (
    r"(?:(?:stream\+)?(?:abstract|ipc)://[^\x00-\x1f\x7f]{1,240}"
    rf"|(?:stream\+|tls\+)?tcp://(?:[A-Za-z0-9._-]{{1,253}}|\[[0-9A-Za-z:.%_-]{{1,64}}\]):{_PORT}"
    rf"(?:{TAG_PATTERN})?"
    r"|memory://[0-9a-f]{1,64})"
)
ADDRESS_PATTERN = rf"^{_ADDRESS}\Z"
_ADDRESS_RE = re.compile(ADDRESS_PATTERN)
#: Limits of the lists and strings of an envelope.
MAX_ADDRESS_CHARS = 300
MAX_NAME = 4096
MAX_TEXT = 1 << 20
MAX_DIMS = 256
MAX_CHAIN = 4096
MAX_RANKS = 1 << 20
#: (a Gathered lists the buffers of a whole subtree's replies)
MAX_BUFFERS = MAX_RANKS
#: The largest buffer a frame can hold (a stream frame's length is a u32).
MAX_BUFFER = 2**32 - 1
#: Limits of worker output (:class:`Output`): characters of one line (a log record's
#: whole text), and lines of one frame.
MAX_LINE = 64 * 1024
MAX_OUTPUT_LINES = 4096

#: A peer's listening address (or "" where a field says so). Its form is checked after
#: decoding (see :func:`is_address`): a regex in msgspec's ``Meta`` costs ~0.4 µs per
#: field, a look-up among the addresses seen before ~0.05 µs.
Address = Annotated[str, Meta(max_length=MAX_ADDRESS_CHARS)]
#: A call id (ids count up from 1; 0 is "none").
_Id = Annotated[int, Meta(ge=0, le=2**63 - 1)]
#: A rank in a mesh; ``_NodeRank`` may be -1 (a node that only relays, a death with
#: no known place).
_Rank = Annotated[int, Meta(ge=0, lt=2**31)]
_NodeRank = Annotated[int, Meta(ge=-1, lt=2**31)]
_Pid = Annotated[int, Meta(ge=0, lt=2**31)]
#: The size of one dimension of a mesh.
_Size = Annotated[int, Meta(ge=0, lt=2**31)]
#: The length of an out-of-band buffer.
_Length = Annotated[int, Meta(ge=0, le=MAX_BUFFER)]
#: A running total of messages or bytes; -1 in a credit probe.
_Total = Annotated[int, Meta(ge=-1, le=2**63 - 1)]
_Name = Annotated[str, Meta(max_length=MAX_NAME)]
_Text = Annotated[str, Meta(max_length=MAX_TEXT)]
_ChainEntry = Annotated[str, Meta(max_length=MAX_ADDRESS_CHARS + 2 * MAX_NAME + 2)]
_Labels = Annotated[list[_Name], Meta(max_length=MAX_DIMS)]
_Sizes = Annotated[list[_Size], Meta(max_length=MAX_DIMS)]
_Chain = Annotated[list[_ChainEntry], Meta(max_length=MAX_CHAIN)]
_Buffers = Annotated[list[_Length], Meta(max_length=MAX_BUFFERS)]
#: A pickle inside an envelope is shorter than INLINE_LIMIT (see ``Payload.inline``).
_Payload = Annotated[bytes, Meta(max_length=INLINE_LIMIT)]
#: ``(address, rank or -1, number of nodes below)`` (see :class:`Relay`)
_Node = tuple[Address, _NodeRank, Annotated[int, Meta(ge=0, lt=MAX_RANKS)]]


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text``, cut to at most ``limit`` characters (what a text field may carry)."""
    if len(text) <= limit:
        return text
    note = f"... [cut: {len(text)} characters in all]"
    return text[: max(limit - len(note), 0)] + note


#: Addresses that passed :func:`is_address` lately (peers are few: most frames hit).
_good: set[str] = set()
_GOOD_KEPT = 4096


def is_address(addr: str) -> bool:
    """Whether ``addr`` has the form of an address some amesh transport listens on."""
    if addr in _good:
        return True
    if len(addr) > MAX_ADDRESS_CHARS or _ADDRESS_RE.match(addr) is None:
        return False
    if len(_good) >= _GOOD_KEPT:
        _good.clear()
    _good.add(addr)
    return True


class Call(msgspec.Struct, tag="call", array_like=True):
    """Run ``method`` on ``actor`` and reply to ``sender`` with ``call_id``.

    ``chain`` lists the serial handlers waiting on this call, outermost first, as
    ``"address#actor key#label"``: the receiver refuses a call that would wait on
    itself.
    """

    sender: Address
    call_id: _Id
    rank: _Rank
    actor: _Name
    method: _Name
    labels: _Labels
    sizes: _Sizes
    payload: _Payload
    chain: _Chain = []
    buffers: _Buffers = []
    #: where the reply goes, when not to ``sender`` (a relay gathering replies)
    reply_to: Address = ""
    #: the call id the reply carries there
    reply_id: _Id = 0


class Cast(msgspec.Struct, tag="cast", array_like=True):
    """Like :class:`Call`, with no reply; a failure is reported to the owner."""

    sender: Address
    call_id: _Id
    rank: _Rank
    actor: _Name
    method: _Name
    labels: _Labels
    sizes: _Sizes
    payload: _Payload
    buffers: _Buffers = []


class Reply(msgspec.Struct, tag="reply", array_like=True):
    """A result for ``call_id`` from ``rank``."""

    call_id: _Id
    rank: _Rank
    payload: _Payload
    buffers: _Buffers = []


class Relay(msgspec.Struct, tag="relay", array_like=True):
    """A call or cast for a subtree of ranks, sent to the root of that subtree.

    The receiver runs it itself when ``rank >= 0`` and forwards it to each subtree in
    ``nodes``: the subtree below the receiver in preorder, each node as ``(address,
    rank or -1 for a node that only relays, number of nodes below it)``. For a call
    (``reply_to`` set) the receiver gathers the replies of its whole subtree and sends
    them to ``reply_to`` as :class:`Gathered` with ``reply_id``.
    """

    sender: Address
    call_id: _Id
    rank: _NodeRank
    actor: _Name
    method: _Name
    labels: _Labels
    sizes: _Sizes
    payload: _Payload
    chain: _Chain
    buffers: _Buffers
    reply_to: Address
    reply_id: _Id
    nodes: Annotated[list[_Node], Meta(max_length=MAX_RANKS)]


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


#: The ``type_name`` of the :class:`Error` a process answers a call with when it runs
#: no such actor (stopped, replaced, or not spawned there yet): no user code ran, so
#: the caller raises a LookupError that says so, not an ActorError.
NO_ACTOR = "amesh.NoActor"


class Error(msgspec.Struct, tag="error", array_like=True):
    """An exception for ``call_id`` from ``rank``, as data."""

    call_id: _Id
    rank: _Rank
    type_name: _Name
    message: _Text
    traceback: _Text


class Gathered(msgspec.Struct, tag="gathered", array_like=True):
    """Replies of a subtree, for ``call_id`` of the receiver (a call or a relay's gather).

    ``buffers`` is the concatenation of the replies' buffers, in order.
    """

    call_id: _Id
    replies: Annotated[list[Reply | Error], Meta(max_length=MAX_RANKS)]
    buffers: _Buffers = []


class Prune(msgspec.Struct, tag="prune", array_like=True):
    """``sender``'s call ``call_id``: stop waiting for ``ranks`` (their relay died)."""

    sender: Address
    call_id: _Id
    ranks: Annotated[list[_Rank], Meta(max_length=MAX_RANKS)]


class Credit(msgspec.Struct, tag="credit", array_like=True):
    """``actor`` at ``addr`` has taken ``count`` messages (``nbytes`` of payload) of
    the receiver's casts from its mailbox so far (flow control). The counts are totals,
    not deltas: a lost or repeated credit cannot shrink or widen a window for good.
    A sender held back for a while sends a probe (``count`` -1, ``addr`` its own) to
    ask for the totals again."""

    addr: Address
    actor: _Name
    count: _Total
    nbytes: _Total


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    """Cancel ``sender``'s call ``call_id`` if it is queued or running."""

    sender: Address
    call_id: _Id


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """A worker process is listening at ``addr``."""

    token: _Name
    addr: Address
    pid: _Pid


class FailureReport(msgspec.Struct, tag="failure", array_like=True):
    """A supervision event reported to the owner of actor mesh ``actor``."""

    actor: _Name
    rank: _Rank
    pid: _Pid
    cause: _Text


class Heartbeat(msgspec.Struct, tag="hb", array_like=True):
    """A worker at ``addr`` is alive (sent from a thread, whatever its loop does)."""

    addr: Address
    pid: _Pid


#: The streams of :class:`OutputLine`: a worker's stdout, its stderr, a logging record.
STDOUT, STDERR, LOG = 0, 1, 2


class OutputLine(msgspec.Struct, array_like=True):
    """One line a worker wrote, and whose it is: the actor mesh ``label`` and the
    actor's ``rank`` while an actor's handler wrote it, else the ProcMesh's name and
    the process's slot. A :data:`LOG` line is a whole logging record (its text may
    span lines: a traceback), with its ``level`` and ``logger`` name."""

    stream: Annotated[int, Meta(ge=STDOUT, le=LOG)]
    label: _Name
    rank: _Rank
    text: Annotated[str, Meta(max_length=MAX_LINE)]
    level: Annotated[int, Meta(ge=0, le=100)] = 0
    logger: _Name = ""


class Output(msgspec.Struct, tag="output", array_like=True):
    """Lines a worker wrote, in order, sent to its supervisor (see
    :mod:`amesh._runtime._capture`). ``dropped`` lines were lost before them (the
    worker's buffer was full); ``last``: the worker sends nothing more (it exits)."""

    lines: Annotated[list[OutputLine], Meta(max_length=MAX_OUTPUT_LINES)]
    dropped: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    last: bool = False


class Died(msgspec.Struct, tag="died", array_like=True):
    """The process at ``addr`` is gone: sent by its supervisor to the processes that
    may be calling it, so that their calls fail at once (see :class:`~amesh.Failure`
    for the fields)."""

    addr: Address
    mesh: _Name
    rank: _NodeRank
    pid: _Pid | None
    host: _Name
    cause: _Text
    exit_code: Annotated[int, Meta(ge=0, lt=2**31)] | None = None
    signal: Annotated[int, Meta(ge=1, lt=256)] | None = None


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
    | Output
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
_loose = msgspec.msgpack.Decoder()
#: what decoding a peer's envelope raises on bad bytes: RecursionError where it nests too
#: deep, and UnicodeDecodeError for a string that is not UTF-8 (msgspec before 0.23;
#: later ones raise DecodeError)
_UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


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
    head = encode_envelope(env)
    if not buffers:
        return head
    if sum(memoryview(b).nbytes for b in buffers) <= _JOIN_LIMIT:
        return b"".join([head, *buffers])
    return [head, *buffers]


_first = operator.itemgetter(0)


def _bad_address(addr: str) -> str:
    return f"not an address: {addr[:80]!r}"


def _check_call(env: Call | Relay) -> str:
    if env.sender not in _good and not is_address(env.sender):
        return _bad_address(env.sender)
    if env.reply_to and env.reply_to not in _good and not is_address(env.reply_to):
        return _bad_address(env.reply_to)
    if len(env.labels) != len(env.sizes):
        return f"{len(env.labels)} labels for {len(env.sizes)} sizes"
    return ""


def _check_cast(env: Cast) -> str:
    if env.sender not in _good and not is_address(env.sender):
        return _bad_address(env.sender)
    if len(env.labels) != len(env.sizes):
        return f"{len(env.labels)} labels for {len(env.sizes)} sizes"
    return ""


def _check_relay(env: Relay) -> str:
    # (a node's count of nodes below it may run past the end: see _tree.split)
    if not _good.issuperset(map(_first, env.nodes)):
        for addr, _, _ in env.nodes:
            if not is_address(addr):
                return _bad_address(addr)
    return _check_call(env)


def _check_sender(env: Prune | Cancel) -> str:
    return "" if env.sender in _good or is_address(env.sender) else _bad_address(env.sender)


def _check_addr(env: Credit | Ready | Heartbeat | Died) -> str:
    return "" if env.addr in _good or is_address(env.addr) else _bad_address(env.addr)


def _check_gathered(env: Gathered) -> str:
    lengths: list[int] = []
    for item in env.replies:
        if type(item) is Reply and item.buffers:
            lengths += item.buffers
    if lengths != env.buffers:
        return "the buffers of the gathered replies do not add up to the frame's"
    return ""


#: Checks across fields, where a field's own type cannot say it: "" or what is wrong.
_CHECKS: dict[type, Any] = {
    Call: _check_call,
    Cast: _check_cast,
    Relay: _check_relay,
    Gathered: _check_gathered,
    Prune: _check_sender,
    Cancel: _check_sender,
    Credit: _check_addr,
    Ready: _check_addr,
    Heartbeat: _check_addr,
    Died: _check_addr,
}


def decode(frame: bytes | memoryview) -> tuple[Envelope, list[memoryview]]:
    """Decode one frame into its envelope and views of its out-of-band buffers.

    Raises:
        BadFrame: not an amesh frame, or truncated/malformed.
        BadVersion: an amesh frame of another protocol version.
    """
    got = try_decode(frame)
    if got is not None:
        return got
    return _decode(frame)


def _decode(frame: bytes | memoryview) -> tuple[Envelope, list[memoryview]]:
    """:func:`decode` in Python: what is wrong with a frame that :func:`try_decode`
    did not take, or every frame where the C extension is not built."""
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
        except _UNDECODABLE:
            head = None
        if isinstance(head, list) and len(head) >= 4:
            s, c, r = head[1], head[2], head[3]
            # answered only where that is an address and the numbers fit (see Error)
            if (
                isinstance(s, str)
                and is_address(s)
                and isinstance(c, int)
                and 0 <= c < 2**63
                and isinstance(r, int)
                and 0 <= r < 2**31
            ):
                sender, call_id, rank = s, c, r
        raise BadVersion(version, sender, call_id, rank)
    if end > len(view):
        raise BadFrame("truncated envelope")
    try:
        env = _decoder.decode(view[_HEADER_LEN:end])
    except _UNDECODABLE as exc:
        raise BadFrame(str(exc)) from None
    check = _CHECKS.get(type(env))
    if check is not None:
        why = check(env)
        if why:
            raise BadFrame(why)
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


def _encode_envelope(env: Envelope) -> bytes:
    buf = bytearray(_HEADER)
    _encoder.encode_into(env, buf, _HEADER_LEN)
    _LEN.pack_into(buf, 3, len(buf) - _HEADER_LEN)
    return bytes(buf)


def _try_decode(frame: bytes | memoryview) -> tuple[Envelope, list[memoryview]] | None:
    try:
        return _decode(frame)
    except (BadFrame, BadVersion):
        return None


def _c_codec() -> tuple[
    Callable[[bytes | memoryview], tuple[Envelope, list[memoryview]] | None],
    Callable[[Envelope], bytes],
]:
    try:
        from .._native._ext import EnvelopeDecoder, EnvelopeEncoder
    except ImportError:  # the C extension is not built: the same in Python
        return _try_decode, _encode_envelope
    preamble = _HEADER[: len(MAGIC) + 1]
    return (
        EnvelopeDecoder(preamble, _decoder.decode, _CHECKS),
        EnvelopeEncoder(preamble, _encoder.encode),
    )


#: The hot path, in C where the extension is built (``amesh._native._ext.EnvelopeDecoder`` and
#: ``EnvelopeEncoder``: one call for the header, the envelope, its checks and its
#: buffers), else in Python. ``try_decode(frame)``: ``(envelope, buffers)`` of a
#: well-formed frame, or None (then :func:`decode` says what is wrong).
#: ``encode_envelope(env)``: :func:`encode` of an envelope with no buffers.
try_decode, encode_envelope = _c_codec()
