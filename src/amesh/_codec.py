"""Payload codec: pickle protocol 5 with out-of-band buffers and shared memory.

Classes and functions from ``__main__`` (scripts, notebooks) travel by value
(cloudpickle). Buffers of at least :data:`OOB_THRESHOLD` bytes (numpy arrays, torch
tensors, large ``bytes``...) are not copied into the pickle: they travel as separate
parts of the frame, and the receiver's objects are views of the received frame
(``bytes`` are copied once, since a ``bytes`` object cannot be a view).

With ``dumps(obj, shm=True)`` (one receiver, on this host) buffers of at least
:func:`shm_threshold` bytes are written once into shared-memory segments, files in
:func:`shm_dir` named ``amesh-<pid>-<n>-<random>``; the pickle holds their paths. The
receiver maps each segment and unlinks it at once, so its objects are views of memory
that the kernel frees when the last of them goes. Segments nobody loaded are unlinked
by :func:`release_segments` (the runtime calls it at close; atexit does too).

How large ``bytes`` and shared-memory buffers get out of the stream: the pickler writes
any buffer of 64 KiB or more (``bytes``, or a ``PickleBuffer`` that the buffer callback
keeps in band) straight to its file, as the very object, right after its opcode
header. The file here (:class:`_Encoder`) knows those objects by identity, drops the
header and writes a few opcodes in their place: ``bytes(<next out-of-band buffer>)`` or
``_load_segment(path, kind)``. The stream stays plain pickle, read by ``pickle.loads``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import pickle
import struct
import sys
import threading
from collections.abc import Sequence
from itertools import count
from typing import Any

import cloudpickle

from ._codec_tensor import reduce_tensor

__all__ = [
    "OOB_THRESHOLD",
    "SHM_THRESHOLD",
    "Payload",
    "dumps",
    "loads",
    "release_segments",
    "remove_segments_of",
    "shm_dir",
    "shm_threshold",
]

log = logging.getLogger("amesh.codec")

#: Buffers smaller than this stay inside the pickle (a part costs more than a copy).
OOB_THRESHOLD = 64 * 1024
#: With ``shm=True``, buffers of at least this many bytes go through shared memory
#: (``AMESH_SHM_THRESHOLD`` overrides it; below 64 KiB counts as 64 KiB).
SHM_THRESHOLD = 1 << 20

# The pickler writes buffers of this size or more straight to its file (C _pickle's
# FRAME_SIZE_TARGET); only those can be taken out of the stream after the fact.
_DIRECT = 64 * 1024

# What a buffer taken out of the stream was, so what to rebuild.
_BYTES, _BYTEARRAY, _WRITABLE, _READONLY = 0, 1, 2, 3


class Payload:
    """A pickled object: the pickle bytes and its out-of-band buffers."""

    __slots__ = ("buffers", "data")

    def __init__(self, data: bytes, buffers: Sequence[Any] = ()) -> None:
        self.data = data
        self.buffers: list[Any] = [memoryview(b) for b in buffers]

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(memoryview(b).nbytes for b in self.buffers)

    def __reduce__(self) -> tuple[Any, ...]:
        # Nested in another pickle (spawn arguments), the buffers stay out of band.
        return (Payload, (self.data, [pickle.PickleBuffer(b) for b in self.buffers]))


# -- encoding ---------------------------------------------------------------------------


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    def reducer_override(self, obj: Any) -> Any:
        # Never imports torch: a tensor exists only where torch was imported already.
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
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
        if (tp is bytes or tp is bytearray) and len(obj) >= _DIRECT:
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
            if len(chunk) >= _DIRECT and self._large_bytes(chunk):
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
            kind, header = _READONLY, _bytes_header(view.nbytes)
        else:
            kind, header = _WRITABLE, pickle.BYTEARRAY8 + struct.pack("<Q", view.nbytes)
        if not self._strip(header):
            return False
        self.chunks.append(_Segment(view, kind, len(self.buffers)))
        self.segments += 1
        return True

    def _large_bytes(self, chunk: bytes | bytearray) -> bool:
        """Take ``chunk`` out of the stream if it is a bytes(-array) of the payload."""
        if type(chunk) is bytes:
            kind, header = _BYTES, _bytes_header(len(chunk))
        else:
            kind, header = _BYTEARRAY, pickle.BYTEARRAY8 + struct.pack("<Q", len(chunk))
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
        done = 0
        for chunk in self.chunks:
            if type(chunk) is not _Segment:
                data.append(chunk)
                continue
            buffers += self.buffers[done : chunk.index]
            done = chunk.index
            path = _create_segment(chunk.view)
            if path is None:
                data.append(_IN_FRAME[chunk.kind])
                buffers.append(chunk.view)
            else:
                data.append(_segment_ref(path, chunk.kind))
        buffers += self.buffers[done:]
        return Payload(b"".join(data), buffers)


def _bytes_header(n: int) -> bytes:
    """The opcode and length the pickler writes before ``n`` bytes (n >= 256)."""
    if n <= 0xFFFFFFFF:
        return pickle.BINBYTES + struct.pack("<I", n)
    return pickle.BINBYTES8 + struct.pack("<Q", n)


def _str_op(s: str) -> bytes:
    b = s.encode()
    if len(b) < 256:
        return pickle.SHORT_BINUNICODE + bytes((len(b),)) + b
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def _global_op(module: str, name: str) -> bytes:
    return _str_op(module) + _str_op(name) + pickle.STACK_GLOBAL


def _segment_ref(path: str, kind: int) -> bytes:
    """Opcodes that push ``_load_segment(path, kind)``."""
    return (
        _LOAD_SEGMENT
        + _str_op(path)
        + pickle.BININT1
        + bytes((kind,))
        + pickle.TUPLE2
        + pickle.REDUCE
    )


# Opcodes for a buffer that travels as a part of the frame instead, as pickle writes it.
_IN_FRAME = {
    _BYTES: _global_op("builtins", "bytes") + pickle.NEXT_BUFFER + pickle.TUPLE1 + pickle.REDUCE,
    _BYTEARRAY: (
        _global_op("builtins", "bytearray") + pickle.NEXT_BUFFER + pickle.TUPLE1 + pickle.REDUCE
    ),
    _WRITABLE: pickle.NEXT_BUFFER,
    _READONLY: pickle.NEXT_BUFFER + pickle.READONLY_BUFFER,
}


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


def loads(data: bytes | memoryview, buffers: Sequence[memoryview] = ()) -> Any:
    """Unpickle what :func:`dumps` made; objects may be views of ``buffers``.

    Raises:
        RuntimeError: a shared-memory segment of the payload is gone.
    """
    return pickle.loads(data, buffers=buffers)


# -- shared-memory segments -------------------------------------------------------------


def shm_dir() -> str:
    """Where segments go: ``AMESH_SHM_DIR``, else ``/dev/shm``."""
    return os.environ.get("AMESH_SHM_DIR") or "/dev/shm"


def shm_threshold() -> int:
    """Buffers of this many bytes or more go through shared memory with ``shm=True``.

    ``AMESH_SHM_THRESHOLD`` if set, else :data:`SHM_THRESHOLD`; at least 64 KiB.

    Raises:
        ValueError: ``AMESH_SHM_THRESHOLD`` is not an integer.
    """
    value = os.environ.get("AMESH_SHM_THRESHOLD")
    return max(int(value) if value else SHM_THRESHOLD, _DIRECT)


_counter = count()
_lock = threading.Lock()
_made: set[str] = set()  # segments this process made, maybe consumed since
_prune_at = 1024


def _create_segment(view: memoryview) -> str | None:
    """Copy ``view`` into a new segment; its path, or None where that fails."""
    path = os.path.join(shm_dir(), f"amesh-{os.getpid()}-{next(_counter)}-{os.urandom(4).hex()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.debug("no shared-memory segment (%s); the buffer goes in the frame", exc)
        return None
    _remember(path)
    try:
        # write() rather than a mapping: faster on tmpfs, and a full /dev/shm is ENOSPC
        # here instead of SIGBUS.
        done, n = 0, view.nbytes
        while done < n:
            done += os.write(fd, view[done : done + (1 << 30)])
    except OSError as exc:
        log.debug("cannot fill shared-memory segment %s (%s); sending in the frame", path, exc)
        _forget(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


def _remember(path: str) -> None:
    global _prune_at
    with _lock:
        _made.add(path)
        if len(_made) >= _prune_at:
            # Receivers unlink what they load: forget those, keep the rest.
            _made.difference_update([p for p in _made if not os.path.exists(p)])
            _prune_at = max(1024, 2 * len(_made))


def _forget(path: str) -> None:
    with _lock:
        _made.discard(path)


def release_segments() -> int:
    """Unlink the segments this process made that no receiver has loaded.

    Their receivers, if any are still to come, fail with a clear error.

    Returns:
        How many segments were removed.
    """
    with _lock:
        paths = list(_made)
        _made.clear()
    removed = 0
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove shared-memory segment %s: %s", path, exc)
            continue
        removed += 1
    return removed


def remove_segments_of(pid: int) -> int:
    """Unlink the segments left by process ``pid``, which must be known to be dead.

    A killed process cannot run :func:`release_segments`; whoever saw it die can.

    Returns:
        How many segments were removed.
    """
    prefix = f"amesh-{pid}-"
    where = shm_dir()
    removed = 0
    try:
        names = os.listdir(where)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(where, name))
                removed += 1
    return removed


def _after_fork_in_child() -> None:
    # The parent's segments are the parent's to release; the lock may be held by a
    # thread that does not exist here.
    global _lock
    _lock = threading.Lock()
    _made.clear()


atexit.register(release_segments)
os.register_at_fork(after_in_child=_after_fork_in_child)


# -- decoding ---------------------------------------------------------------------------


def _load_segment(path: str, kind: int) -> bytes | bytearray | memoryview:
    """Open segment ``path`` and unlink it: a copy of its bytes, or a view of its mapping."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RuntimeError(
            f"shared-memory segment {path} is gone: its sender released it (it exited or"
            " closed its runtime), or this payload was already loaded once"
        ) from None
    try:
        with contextlib.suppress(FileNotFoundError):  # its sender releasing it now
            os.unlink(path)
        size = os.fstat(fd).st_size
        if kind == _BYTES or kind == _BYTEARRAY:
            return _read_all(fd, size, kind)
        mem = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    # The mapping lives as long as a view of it does (numpy's .base, torch's storage).
    view = memoryview(mem)
    return view.toreadonly() if kind == _READONLY else view


def _read_all(fd: int, size: int, kind: int) -> bytes | bytearray:
    """The ``size`` bytes of ``fd``, in one copy (up to 2 GiB for ``bytes``)."""
    if kind == _BYTES:
        data = os.read(fd, size)
        if len(data) < size:  # Linux reads at most 2 GiB at a time
            data += _read_all(fd, size - len(data), _BYTEARRAY)
        return data
    buf = bytearray(size)
    view = memoryview(buf)
    done = 0
    while done < size:
        n = os.readv(fd, [view[done:]])
        if not n:
            raise RuntimeError("shared-memory segment is shorter than it was written")
        done += n
    return buf


_LOAD_SEGMENT = _global_op(_load_segment.__module__, _load_segment.__name__)
