"""Pickling a payload: protocol 5 with out-of-band buffers and shared memory.

Buffers of at least :data:`OOB_THRESHOLD` bytes (numpy arrays, torch tensors, large
``bytes``...) are not copied into the pickle: they travel as separate parts of the
frame, and the receiver's objects are views of the received frame (``bytes`` are
copied once, since a ``bytes`` object cannot be a view). With ``dumps(obj, shm=True)``
they go through shared-memory segments instead (:mod:`._segments`). Code from
``__main__`` travels by value (:mod:`._code`), tensors as their raw bytes
(:mod:`._tensor`). Small payloads of builtin values are pickled by the C pickler alone
(:func:`dumps_plain`, :func:`dumps_args`).

How large ``bytes`` and shared-memory buffers get out of the stream: the pickler writes
any buffer of 64 KiB or more (``bytes``, or a ``PickleBuffer`` that the buffer callback
keeps in band) straight to its file, as the very object, right after its opcode
header. The file here (:class:`_Encoder`) knows those objects by identity, drops the
header and writes a few opcodes in their place: ``bytes(<next out-of-band buffer>)`` or
``_load_segment(path, kind)``. The stream stays plain pickle, read by
:func:`amesh._wire.loads`.
"""

from __future__ import annotations

import pickle
import struct
import sys
import types
from collections.abc import Callable
from typing import Any

import cloudpickle

from ._code import reduce_code
from ._payload import Payload, plain_payload
from ._segments import (
    BYTEARRAY,
    BYTES,
    DIRECT,
    POOLED,
    READONLY,
    WRITABLE,
    create_segment,
    global_op,
    segment_ref,
    shm_threshold,
)
from ._tensor import reduce_tensor

__all__ = ["OOB_THRESHOLD", "dumps", "dumps_args", "dumps_plain", "small_tree"]

#: Buffers smaller than this stay inside the pickle (a part costs more than a copy).
OOB_THRESHOLD = 64 * 1024


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    def reducer_override(self, obj: Any) -> Any:
        tp = type(obj)
        if tp is types.CodeType:
            return reduce_code(obj)
        # Never imports torch: a tensor exists only where torch was imported already.
        torch = sys.modules.get("torch")
        if torch is not None and tp is torch.Tensor:
            return reduce_tensor(obj)
        return super().reducer_override(obj)


class _BytesPickler(_Pickler):
    """The second pass, for a payload with large ``bytes``/``bytearray``: notes them.

    ``persistent_id`` is called for every object, which makes pickling a big structure
    about three times slower; the first pass (:class:`_Pickler`) goes without it.
    """

    def __init__(self, enc: _Encoder, big: dict[int, bytes | bytearray]) -> None:
        super().__init__(enc, protocol=5, buffer_callback=enc.take)
        self._big = big

    def persistent_id(self, obj: Any) -> None:
        tp = type(obj)
        if (tp is bytes or tp is bytearray) and len(obj) >= DIRECT:
            self._big[id(obj)] = obj  # kept alive, so the id stays its own
        return None


class _Retry(Exception):
    """The first pass met what looks like a large ``bytes``: run the second."""


class _Segment:
    """A buffer to write into a segment once pickling succeeded (or send in the frame)."""

    __slots__ = ("index", "kind", "view")

    def __init__(self, view: memoryview, kind: int, index: int) -> None:
        self.view = view
        self.kind = kind
        self.index = index  # how many out-of-band buffers precede it in the stream


class _Encoder:
    """The pickler's file for one :func:`dumps`: chunks of the stream, parts, segments."""

    __slots__ = ("big", "buffers", "chunks", "inband", "segments", "shm_min")

    def __init__(self, shm_min: int, big: dict[int, bytes | bytearray] | None = None) -> None:
        self.shm_min = shm_min  # 0: no shared memory
        self.big = big  # None in the first pass
        self.chunks: list[Any] = []
        self.buffers: list[memoryview] = []
        self.inband: dict[int, pickle.PickleBuffer] = {}
        self.segments = 0

    def take(self, pb: pickle.PickleBuffer) -> bool:
        """The buffer callback: True keeps ``pb`` in band."""
        view = pb.raw()
        if view.nbytes < OOB_THRESHOLD:
            return True
        if self.shm_min and view.nbytes >= self.shm_min:
            # "In band", the pickler hands this very object to write(), which puts a
            # segment reference in its place.
            self.inband[id(pb)] = pb
            return True
        self.buffers.append(view)
        return False

    def write(self, chunk: Any) -> None:
        tp = type(chunk)
        if tp is bytes or tp is bytearray:
            if len(chunk) >= DIRECT and self._large_bytes(chunk):
                return
        elif tp is pickle.PickleBuffer:
            pb = self.inband.get(id(chunk))
            if pb is not None and pb is chunk and self._shm_buffer(pb):
                return
        self.chunks.append(chunk)

    def _shm_buffer(self, pb: pickle.PickleBuffer) -> bool:
        """Put a segment reference in place of ``pb``, which :meth:`take` kept in band."""
        view = pb.raw()
        if view.readonly:
            kind, header = READONLY, _bytes_header(view.nbytes)
        else:
            kind, header = WRITABLE, pickle.BYTEARRAY8 + struct.pack("<Q", view.nbytes)
        if not self._strip(header):
            return False
        self.chunks.append(_Segment(view, kind, len(self.buffers)))
        self.segments += 1
        return True

    def _large_bytes(self, chunk: bytes | bytearray) -> bool:
        """Take ``chunk`` out of the stream if it is a bytes(-array) of the payload."""
        if type(chunk) is bytes:
            kind, header = BYTES, _bytes_header(len(chunk))
        else:
            kind, header = BYTEARRAY, pickle.BYTEARRAY8 + struct.pack("<Q", len(chunk))
        if self.big is None:
            # Most likely a bytes object (else a chunk of pickle that happens to follow
            # a matching header, and the second pass costs time, nothing more).
            last = self.chunks[-1] if self.chunks else None
            if type(last) is bytes and last.endswith(header):
                raise _Retry
            return False
        if self.big.get(id(chunk)) is not chunk or not self._strip(header):
            return False
        view = memoryview(chunk)
        if self.shm_min and view.nbytes >= self.shm_min:
            self.chunks.append(_Segment(view, kind, len(self.buffers)))
            self.segments += 1
        else:
            self.chunks.append(_IN_FRAME[kind])
            self.buffers.append(view)
        return True

    def _strip(self, header: bytes) -> bool:
        """Drop ``header`` from the end of the stream so far; False if it is not there."""
        last = self.chunks[-1] if self.chunks else None
        if type(last) is not bytes or not last.endswith(header):
            return False
        self.chunks[-1] = memoryview(last)[: len(last) - len(header)]
        return True

    def payload(self) -> Payload:
        if not self.segments:
            return Payload(b"".join(self.chunks), self.buffers)
        data: list[Any] = []
        buffers: list[memoryview] = []
        made: list[str] = []
        done = 0
        for chunk in self.chunks:
            if type(chunk) is not _Segment:
                data.append(chunk)
                continue
            buffers += self.buffers[done : chunk.index]
            done = chunk.index
            copied = chunk.kind == BYTES or chunk.kind == BYTEARRAY
            path, pooled = create_segment(chunk.view, copied)
            if path is None:
                data.append(_IN_FRAME[chunk.kind])
                buffers.append(chunk.view)
            else:
                data.append(segment_ref(path, chunk.kind | (POOLED if pooled else 0)))
                made.append(path)
        buffers += self.buffers[done:]
        return Payload(b"".join(data), buffers, made)


def _bytes_header(n: int) -> bytes:
    """The opcode and length the pickler writes before ``n`` bytes (n >= 256)."""
    if n <= 0xFFFFFFFF:
        return pickle.BINBYTES + struct.pack("<I", n)
    return pickle.BINBYTES8 + struct.pack("<Q", n)


_IN_FRAME = {
    BYTES: global_op("builtins", "bytes") + pickle.NEXT_BUFFER + pickle.TUPLE1 + pickle.REDUCE,
    BYTEARRAY: (
        global_op("builtins", "bytearray") + pickle.NEXT_BUFFER + pickle.TUPLE1 + pickle.REDUCE
    ),
    WRITABLE: pickle.NEXT_BUFFER,
    READONLY: pickle.NEXT_BUFFER + pickle.READONLY_BUFFER,
}


def small_tree(obj: Any, nodes: int, leaf: Callable[[Any], bool]) -> bool:
    """True if ``obj`` is at most ``nodes`` objects: lists, tuples, sets and dicts
    whose leaves (the objects in them that are none of those) all pass ``leaf``."""
    budget = nodes
    todo = [obj]
    while todo:
        x = todo.pop()
        budget -= 1
        if budget < 0:
            return False
        t = type(x)
        if t is list or t is tuple or t is set or t is frozenset:
            if len(x) > budget:
                return False
            todo.extend(x)
        elif t is dict:
            if 2 * len(x) > budget:
                return False
            todo.extend(x.keys())
            todo.extend(x.values())
        elif not leaf(x):
            return False
    return True


#: Types that the C pickler writes exactly as cloudpickle would (no reducer of ours, no
#: buffer out of band while small): see :func:`_plain`.
_PLAIN_SCALARS = frozenset({type(None), bool, int, float, complex})
_PLAIN_NODES = 64
_PLAIN_BYTES = 4096


def _plain_leaf(x: Any) -> bool:
    t = type(x)
    return t in _PLAIN_SCALARS or ((t is str or t is bytes) and len(x) <= _PLAIN_BYTES)


def _plain(obj: Any) -> bool:
    """True if ``obj`` is a few builtin scalars, short strings and bytes, in tuples,
    lists, sets and dicts: then the C pickler alone makes the payload, microseconds
    sooner than cloudpickle's Python-level pickler (a 64-byte echo's arguments and
    result)."""
    return small_tree(obj, _PLAIN_NODES, _plain_leaf)


def dumps_plain(obj: Any) -> Payload | None:
    """:func:`dumps` of ``obj`` if it is plain (see :func:`_plain`), else None."""
    t = type(obj)
    if t is bytes or t is str:  # (the commonest results first, without _plain)
        if len(obj) > _PLAIN_BYTES:
            return None
    elif t not in _PLAIN_SCALARS and not _plain(obj):
        return None
    return plain_payload(pickle.dumps(obj, 5))


def dumps_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Payload | None:
    """:func:`dumps_plain` of a call's ``(args, kwargs)``: the commonest case, a few
    builtin scalars and short strings and bytes, checked without the walk."""
    if len(args) <= 8 and len(kwargs) <= 8:
        for x in (*args, *kwargs.values()):
            t = type(x)
            if t not in _PLAIN_SCALARS and not (
                (t is str or t is bytes) and len(x) <= _PLAIN_BYTES
            ):
                break
        else:
            return plain_payload(pickle.dumps((args, kwargs), 5))
    return dumps_plain((args, kwargs))


def dumps(obj: Any, *, shm: bool = False) -> Payload:
    """Pickle ``obj``; large buffers are kept out of band.

    Args:
        obj: what to pickle.
        shm: put buffers of :func:`shm_threshold` bytes or more in shared-memory
            segments. Only for a payload that exactly one process on this host loads,
            once: loading a segment removes it.

    Raises:
        TypeError: ``obj`` cannot be pickled, with the reason.
    """
    if _plain(obj):
        return plain_payload(pickle.dumps(obj, 5))
    enc = _Encoder(shm_threshold() if shm else 0)
    try:
        try:
            _Pickler(enc, protocol=5, buffer_callback=enc.take).dump(obj)
        except _Retry:
            big: dict[int, bytes | bytearray] = {}
            enc = _Encoder(enc.shm_min, big)
            _BytesPickler(enc, big).dump(obj)
    except Exception as exc:  # pickling raises anything from TypeError to PicklingError
        raise TypeError(f"cannot pickle {type(obj).__name__}: {exc}") from exc
    return enc.payload()
