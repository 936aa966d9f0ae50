"""Payload codec: pickle protocol 5 with out-of-band buffers and shared memory.

Classes and functions from ``__main__`` (scripts, notebooks) travel by value
(cloudpickle), their code with its real file name and the source lines it spans, which
the receiver puts in ``linecache``: its tracebacks show them.

Buffers of at least :data:`OOB_THRESHOLD` bytes (numpy arrays, torch tensors, large
``bytes``...) are not copied into the pickle: they travel as separate parts of the
frame, and the receiver's objects are views of the received frame (``bytes`` are
copied once, since a ``bytes`` object cannot be a view).

With ``dumps(obj, shm=True)`` (one receiver, on this host) buffers of at least
:func:`shm_threshold` bytes are written once into shared-memory segments, files in
:func:`shm_dir` (``AMESH_SHM_DIR``, else ``/dev/shm``); the pickle holds their paths.
The receiver maps each segment and unlinks it at once, so its objects are views of
memory that the kernel frees when the last of them goes.

A segment's name says whose it is: ``amesh-<job>-<pid>.<start>.<pidns>-<n>-<random>``.
``<job>`` (:func:`job_id`) is derived from the job key, so the controller and all its
workers share it (:func:`segment_prefix`); ``<pid>``, ``<start>`` (the process's start
time, from /proc) and ``<pidns>`` (its pid namespace) tell whether the process that
made it still runs, even once its pid is reused. A segment lives at most as long as
the process that made it, and goes earlier when its message is abandoned:

- loaded: the receiver unlinks it.
- its message is dropped unread (a reply to a call that timed out or was cancelled):
  the runtime that drops it calls :func:`discard_segments`, which unlinks only this
  user's files named like a segment of this job, directly in :func:`shm_dir`.
- its sender abandons the message (the call timed out, was cancelled or failed
  before the receiver loaded it): :func:`release_payload`.
- its maker exits: :func:`release_segments` (at runtime close and atexit).
- its maker is killed: whoever saw it die calls :func:`remove_segments_of`. A killed
  controller's workers die with it; its zygote (which outlives it to reap them) and
  its host agents (once its lease has run out) call :func:`sweep_segments`, which
  removes the segments of every process that has ended (the old
  ``amesh-<pid>-<n>-<random>`` ones too, where that pid is free). Every ProcMesh
  start (of any job) calls it too, for what nobody was left to remove.

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
import hashlib
import linecache
import logging
import marshal
import mmap
import os
import pickle
import re
import stat
import struct
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

import cloudpickle

from ._codec_tensor import reduce_tensor
from ._config import settings
from ._identity import job_key

__all__ = [
    "OOB_THRESHOLD",
    "SHM_THRESHOLD",
    "Payload",
    "discard_segments",
    "dumps",
    "dumps_plain",
    "for_receivers",
    "job_id",
    "loads",
    "plain_payload",
    "release_payload",
    "release_segments",
    "remove_segments_of",
    "segment_prefix",
    "shm_dir",
    "shm_threshold",
    "sweep_segments",
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
# A flag on that kind: the segment's bytes are shared by several receivers, each
# through a name of its own (see :func:`for_receivers`), and mapped copy-on-write.
_SHARED = 4
# A flag on a kind that is copied out (bytes, bytearray): the receiver hands the
# segment back to its sender for the next message, renaming it ``<path>.free``, rather
# than unlinking it (see :func:`_reuse_segment`).
_POOLED = 8
_FREE = ".free"
#: Segments of these sizes are kept for reuse, up to POOL_SEGMENTS of them and
#: POOL_BYTES in all per process: writing into pages a file already has costs a
#: copy, while fresh pages are allocated and zeroed first (8.5 against 3.3 ms for
#: 16 MiB on the 2-CPU VM of bench/README.md).
POOL_MIN = 1 << 20
POOL_MAX = 128 << 20
POOL_SEGMENTS = 4
POOL_BYTES = 256 << 20
#: Of the pooled segments of other processes, a receiver keeps this many mapped
#: (least recently used let go first), MAPS_BYTES at most: a copy between mappings
#: that stay is a memcpy, 3 times as fast as a read or write of a tmpfs file (16 MiB:
#: 0.9-1.0 against 2.8-3.4 ms on the VM of bench/README.md).
MAPS_KEPT = 4
MAPS_BYTES = 256 << 20
#: A ``bytes`` of these sizes read out of a segment is kept (up to SPARE_OBJECTS of
#: them, SPARE_BYTES in all per process, the oldest let go first) and filled again for
#: a later one of the same size once nothing else references it: a new object's
#: pages are fresh, and faulting them in cost 3 times the copy itself (47 against 14
#: ms for 64 MiB on the VM of bench/README.md). See :func:`amesh._native._ext.pread_bytes`.
SPARE_MIN = 1 << 20
SPARE_MAX = 128 << 20
SPARE_OBJECTS = 4
SPARE_BYTES = 256 << 20


class Payload:
    """A pickled object: the pickle bytes and its out-of-band buffers.

    ``segments`` lists the shared-memory segments that :func:`dumps` made for it (see
    :func:`release_payload`); it stays with the sender and is never pickled.
    """

    __slots__ = ("buffers", "data", "segments")

    def __init__(
        self, data: bytes, buffers: Sequence[Any] = (), segments: Sequence[str] = ()
    ) -> None:
        self.data = data
        self.buffers: list[Any] = [memoryview(b) for b in buffers]
        self.segments: tuple[str, ...] = tuple(segments)

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(memoryview(b).nbytes for b in self.buffers)

    def __reduce__(self) -> tuple[Any, ...]:
        # Nested in another pickle (spawn arguments), the buffers stay out of band.
        return (Payload, (self.data, [pickle.PickleBuffer(b) for b in self.buffers]))


# -- encoding ---------------------------------------------------------------------------


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    def reducer_override(self, obj: Any) -> Any:
        tp = type(obj)
        if tp is types.CodeType:
            return _reduce_code(obj)
        # Never imports torch: a tensor exists only where torch was imported already.
        torch = sys.modules.get("torch")
        if torch is not None and tp is torch.Tensor:
            return reduce_tensor(obj)
        return super().reducer_override(obj)


def _reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    """Code shipped by value (``__main__``, a notebook cell), with its source lines.

    cloudpickle's own reduction renames the file ``<dynamic-code>``; marshal keeps the
    real name. The lines the code spans (nested functions included) go along, so that
    a traceback through it in another process shows them (:func:`_load_code`): the
    receiver may not have the file (another host, a notebook cell).
    """
    first = code.co_firstlineno
    lines = linecache.getlines(code.co_filename)[first - 1 : _last_line(code)]
    return _load_code, (marshal.dumps(code), code.co_filename, first, lines)


def _last_line(code: types.CodeType) -> int:
    """The last source line of ``code`` and of the code nested in it."""
    last = max((line for _, _, line in code.co_lines() if line is not None), default=0)
    for const in code.co_consts:
        if type(const) is types.CodeType:
            last = max(last, _last_line(const))
    return last


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
        made: list[str] = []
        done = 0
        for chunk in self.chunks:
            if type(chunk) is not _Segment:
                data.append(chunk)
                continue
            buffers += self.buffers[done : chunk.index]
            done = chunk.index
            copied = chunk.kind == _BYTES or chunk.kind == _BYTEARRAY
            path, pooled = _create_segment(chunk.view, copied)
            if path is None:
                data.append(_IN_FRAME[chunk.kind])
                buffers.append(chunk.view)
            else:
                data.append(_segment_ref(path, chunk.kind | (_POOLED if pooled else 0)))
                made.append(path)
        buffers += self.buffers[done:]
        return Payload(b"".join(data), buffers, made)


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


def plain_payload(data: bytes) -> Payload:
    """``Payload(data)``: a pickle without buffers or segments, made at less cost."""
    payload = Payload.__new__(Payload)
    payload.data = data
    payload.buffers = []
    payload.segments = ()
    return payload


def dumps_plain(obj: Any) -> Payload | None:
    """:func:`dumps` of ``obj`` if it is plain (see :func:`_plain`), else None."""
    t = type(obj)
    if t is bytes or t is str:  # (the commonest results first, without _plain)
        if len(obj) > _PLAIN_BYTES:
            return None
    elif t not in _PLAIN_SCALARS and not _plain(obj):
        return None
    payload = Payload.__new__(Payload)
    payload.data = pickle.dumps(obj, 5)
    payload.buffers = []
    payload.segments = ()
    return payload


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


def loads(data: bytes | memoryview, buffers: Sequence[memoryview] = ()) -> Any:
    """Unpickle what :func:`dumps` made; objects may be views of ``buffers``.

    Raises:
        RuntimeError: a shared-memory segment of the payload is gone.
    """
    return pickle.loads(data, buffers=buffers)


# -- shared-memory segments -------------------------------------------------------------


def shm_dir() -> str:
    """Where segments go: ``AMESH_SHM_DIR``, else ``/dev/shm``."""
    return settings().shm_dir or "/dev/shm"


def shm_threshold() -> int:
    """Buffers of this many bytes or more go through shared memory with ``shm=True``.

    ``AMESH_SHM_THRESHOLD`` if set, else :data:`SHM_THRESHOLD`; at least 64 KiB.

    Raises:
        ConfigError: ``AMESH_SHM_THRESHOLD`` is not an integer >= 0.
    """
    return max(settings().shm_threshold, _DIRECT)


_counter = count()
_lock = threading.Lock()
_made: set[str] = set()  # segments this process made, maybe consumed since
_pool: dict[str, _Kept] = {}  # segments that come back for reuse (see _POOLED)
#: the mappings of other processes' pooled segments, by (st_dev, st_ino): each is read
#: out of one mapping message after message (see _read_kept). A mapping holds its file,
#: so no other live file has its inode number (tmpfs numbers them from a counter).
_maps: OrderedDict[tuple[int, int], mmap.mmap] = OrderedDict()
_spare: list[bytes] = []  # bytes read out of segments, to fill again (see SPARE_MIN)
#: held while the mappings kept of pooled segments are looked up, made and read
_maps_lock = threading.Lock()
#: the pages of a segment mapped at once, rather than a fault each on first touch
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_prune_at = 1024

# A segment's name says whose it is: ``amesh-<job>-<pid>.<start>.<pidns>-<n>-<random>``.
# <job> is :func:`job_id`; <pid>, <start> (in clock ticks since boot, field 22 of
# /proc/<pid>/stat) and <pidns> (the inode of its pid namespace) name the process that
# made it, for good: a pid reused by a later process has another start time.
_NAME = re.compile(
    rb"amesh-(\d{10})-(\d{1,10})\.(\d{1,20})\.(\d{1,20})-\d{1,20}-[0-9a-f]{8}(?:\.free)?"
)
# What amesh named its segments before: ``amesh-<pid>-<n>-<random>``.
_OLD_NAME = re.compile(rb"amesh-(\d{1,10})-\d{1,20}-[0-9a-f]{8}")
_JOB_TAG = b"amesh shm job v1\0"

_job: tuple[bytes, str] | None = None  # (job key, its job id)
_self: tuple[int, str] | None = None  # (pid, "<pid>.<start>.<pidns>") of this process


def job_id() -> str:
    """This job's id in segment names: 10 digits from a hash of the job key, the same in
    the controller and every process it started (workers adopt its key)."""
    global _job
    key = job_key()
    cached = _job
    if cached is None or cached[0] is not key:
        digest = hashlib.sha256(_JOB_TAG + key).digest()
        cached = _job = (key, f"{int.from_bytes(digest[:4], 'big'):010d}")
    return cached[1]


def segment_prefix() -> str:
    """The start of the name of every segment of this job: ``amesh-<job id>-``."""
    return f"amesh-{job_id()}-"


def _owner() -> str:
    """``<pid>.<start>.<pidns>`` of this process (0 for what /proc does not tell)."""
    global _self
    pid = os.getpid()
    cached = _self
    if cached is None or cached[0] != pid:
        ps = _stat_of(pid) if _have_proc() else None
        cached = _self = (pid, f"{pid}.{ps[1] if ps else 0}.{_pid_namespace()}")
    return cached[1]


def _have_proc() -> bool:
    return os.path.exists("/proc/self/stat")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _stat_of(pid: int) -> tuple[bytes, int] | None:
    """(state, start time) of process ``pid``; None if there is no such process.

    Raises:
        OSError, ValueError, IndexError: /proc could not tell.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its end.
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0], int(fields[19])


def _is_dead(pid: int, start: int, procfs: bool) -> bool:
    """True if process ``pid`` that started at ``start`` (0: unknown) surely ended."""
    if pid <= 0:
        return False
    if start and procfs:
        try:
            ps = _stat_of(pid)
        except (OSError, ValueError, IndexError):
            return False
        # another start time: the pid was reused; Z/X: it exited, only not reaped yet
        return ps is None or ps[1] != start or ps[0] in (b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists
        return False
    return False


def _segment_name() -> str:
    return os.path.join(
        shm_dir(), f"{segment_prefix()}{_owner()}-{next(_counter)}-{os.urandom(4).hex()}"
    )


class _Kept:
    """A pooled segment of this process, kept open and mapped: a message goes into
    it by a memcpy into pages the file already has (see :func:`_fill`)."""

    __slots__ = ("fd", "mem", "size")

    def __init__(self, fd: int, mem: mmap.mmap, size: int) -> None:
        self.fd = fd
        self.mem = mem
        #: the file's size, which is what its last message held
        self.size = size

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # (a view of it lives: it goes with that)
            self.mem.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _map_rw(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _fill(kept: _Kept, view: memoryview) -> None:
    """Put ``view`` into pooled segment ``kept``, as its whole content.

    Through the mapping where the file's pages exist already: a full /dev/shm could
    not make a page for a store through a mapping (SIGBUS), so what needs new pages
    is written (ENOSPC is an OSError), and the mapping made again to cover it."""
    n = view.nbytes
    if n <= kept.size:
        if n < kept.size:
            os.ftruncate(kept.fd, n)
        kept.mem[:n] = view
    else:
        _write_all(kept.fd, view)
        if n > len(kept.mem):
            with contextlib.suppress(BufferError):
                kept.mem.close()
            kept.mem = _map_rw(kept.fd, n)
    kept.size = n


def _create_segment(view: memoryview, poolable: bool = False) -> tuple[str | None, bool]:
    """Copy ``view`` into a segment, one handed back by a receiver if ``poolable`` and
    one fits, else a new one; its path (None where that fails), and whether its
    receiver is to hand it back (it joined the pool)."""
    n = view.nbytes
    poolable = poolable and POOL_MIN <= n <= POOL_MAX
    if poolable:
        path = _reuse_segment(n, view)
        if path is not None:
            return path, True
    path = _segment_name()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.debug("no shared-memory segment (%s); the buffer goes in the frame", exc)
        return None, False
    _remember(path)
    kept: _Kept | None = None
    try:
        # write() rather than a mapping: faster on fresh tmpfs pages, and a full
        # /dev/shm is ENOSPC here instead of SIGBUS.
        _write_all(fd, view)
        if poolable:
            with _lock:  # (its pages exist now: it may be stored into through a mapping)
                if len(_pool) < POOL_SEGMENTS and _pooled_bytes() + n <= POOL_BYTES:
                    kept = _pool[path] = _Kept(fd, _map_rw(fd, n), n)
    except OSError as exc:
        log.debug("cannot fill shared-memory segment %s (%s); sending in the frame", path, exc)
        _forget(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        return None, False
    if kept is None:
        os.close(fd)
        return path, False
    return path, True


def _pooled_bytes() -> int:
    return sum(kept.size for kept in _pool.values())


def _write_all(fd: int, view: memoryview) -> None:
    done, n = 0, view.nbytes
    while done < n:
        done += os.pwrite(fd, view[done : done + (1 << 30)], done)


def _reuse_segment(n: int, view: memoryview) -> str | None:
    """Copy ``view`` into a pooled segment that its last receiver handed back, under a
    new name; None if none is back (or it cannot be had)."""
    with _lock:
        candidates = sorted(_pool.items(), key=lambda item: abs(item[1].size - n))
    for old, kept in candidates:
        path = _segment_name()
        try:
            os.rename(old + _FREE, path)  # claimed: nobody else renames it now
        except OSError:
            # With a receiver still (``old``), or gone. Looked at in that order, since a
            # receiver may hand it back (``old`` to ``old.free``) right after the rename
            # failed: then it is kept for the next message.
            if not os.path.exists(old) and not os.path.exists(old + _FREE):
                _forget(old)
            continue
        with _lock:
            _pool.pop(old, None)
            _pool[path] = kept
            _made.add(path)
        try:
            _fill(kept, view)
        except OSError as exc:
            log.debug("cannot reuse shared-memory segment %s (%s)", path, exc)
            _forget(path)
            _unlink(path)
            return None
        return path
    return None


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
        kept = _pool.pop(path, None)
    if kept is not None:
        kept.close()


def _unlink(path: str) -> bool:
    """Unlink segment ``path``; True if it was there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot remove shared-memory segment %s: %s", path, exc)
        return False
    return True


def _unlink_ours(where: str, name: str) -> bool:
    """Unlink ``where/name`` if it is a plain file of this user; True if it was."""
    path = os.path.join(where, name)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return False
    return _unlink(path)


def release_segments() -> int:
    """Unlink the segments this process made that no receiver has loaded.

    Their receivers, if any are still to come, fail with a clear error.

    Returns:
        How many segments were removed.
    """
    with _lock:
        paths = [*_made, *(path + _FREE for path in _pool)]
        kept = list(_pool.values())
        _made.clear()
        _pool.clear()
        _spare.clear()  # (memory, not segments: let it go with them)
    with _maps_lock:
        maps = list(_maps.values())
        _maps.clear()
    for k in kept:
        k.close()
    for mem in maps:
        with contextlib.suppress(BufferError):
            mem.close()
    return sum(_unlink(path) for path in paths)


def release_payload(payload: Payload) -> int:
    """Unlink the segments that :func:`dumps` made for ``payload`` and that no receiver
    loaded: for a sender that abandons the message (its call timed out, was cancelled,
    or failed), whose receiver will then never load it, or fail to with a clear error.

    Returns:
        How many segments were removed (0 when the receiver had loaded them all).
    """
    removed = 0
    for path in payload.segments:
        if _unlink(path):
            _forget(path)
            removed += 1
        else:  # loaded; one handed back for reuse stays in the pool
            with _lock:
                _made.discard(path)
    return removed


def for_receivers(payload: Payload, ranks: Sequence[int]) -> Payload | dict[int, Payload]:
    """``payload`` (from ``dumps(..., shm=True)``) for several receivers on this host:
    one payload per rank of ``ranks``, each naming the same segments by names of its
    own (hard links), so the bytes are written once however many processes load
    them. Each receiver unlinks its names as it loads them, as for one receiver, and
    maps the bytes copy-on-write: what it writes stays its own. ``payload`` itself
    when it has no segments.

    Raises:
        OSError: a segment cannot be linked (nothing is left behind; send the bytes
            some other way).
    """
    if not payload.segments:
        return payload
    out: dict[int, Payload] = {}
    try:
        for rank in ranks:
            data, names = payload.data, []
            for path in payload.segments:
                name = _link_segment(path)
                names.append(name)
                data = _rename_ref(data, path, name)
            out[rank] = Payload(data, payload.buffers, names)
    except OSError:
        for each in out.values():
            release_payload(each)
        raise
    finally:
        release_payload(payload)  # the receivers' names are all that is left
    return out


def _link_segment(path: str) -> str:
    """Another name for segment ``path``, of the same form (see :func:`_create_segment`)."""
    name = f"{segment_prefix()}{_owner()}-{next(_counter)}-{os.urandom(4).hex()}"
    link = os.path.join(os.path.dirname(path), name)
    os.link(path, link)
    _remember(link)
    return link


def _rename_ref(data: bytes, path: str, name: str) -> bytes:
    """Pickle ``data`` with its reference to segment ``path`` naming ``name`` instead,
    as a segment that other receivers share."""
    ref = re.compile(re.escape(_LOAD_SEGMENT + _str_op(path) + pickle.BININT1) + b"(.)", re.S)

    def shared(m: re.Match[bytes]) -> bytes:
        return _LOAD_SEGMENT + _str_op(name) + pickle.BININT1 + bytes((m[1][0] | _SHARED,))

    return ref.sub(shared, data, count=1)


def _segment_refs(data: bytes | memoryview) -> list[str]:
    """The segment paths that pickle ``data`` (from :func:`dumps`) loads."""
    view = memoryview(data).cast("B")
    refs: list[str] = []
    for m in _REF.finditer(view):
        at = m.end()
        if view[at - 1] == pickle.SHORT_BINUNICODE[0]:
            if at >= len(view):
                continue
            n, at = view[at], at + 1
        else:
            if at + 4 > len(view):
                continue
            (n,) = struct.unpack_from("<I", view, at)
            at += 4
        end = at + n
        # what _segment_ref writes after the path: BININT1 <kind> TUPLE2 REDUCE
        if (
            n > 4096
            or bytes(view[end : end + 1]) != pickle.BININT1
            or bytes(view[end + 2 : end + 4]) != pickle.TUPLE2 + pickle.REDUCE
            or view[end + 1] > (_READONLY | _SHARED | _POOLED)
        ):
            continue
        try:
            refs.append(bytes(view[at:end]).decode())
        except UnicodeDecodeError:
            continue
    return refs


def discard_segments(data: bytes | memoryview) -> int:
    """Unlink the segments that pickle ``data`` refers to, which will never be loaded.

    For a received payload that is dropped unread (a reply to a call that timed out or
    was cancelled): its sender made the segments for this one receiver, so nobody else
    would unlink them before the sender exits. Only files of this user named like a
    segment of this job (:func:`segment_prefix`) directly in :func:`shm_dir` are
    touched, whatever ``data`` says.

    Returns:
        How many segments were removed.
    """
    refs = _segment_refs(data)
    if not refs:
        return 0
    where = shm_dir()
    job = job_id().encode()
    removed = 0
    for path in refs:
        name = os.path.basename(path)
        m = _NAME.fullmatch(name.encode())
        if m is None or m[1] != job or os.path.join(where, name) != path:
            log.debug("not discarding %r: not a segment of this job in %s", path, where)
            continue
        _forget(path)
        removed += _unlink_ours(where, name)
    return removed


def _owner_of(name: str, procfs: bool, namespace: int) -> tuple[int, int] | None:
    """(pid, start time or 0) of the process that made segment ``name``; None when it
    is not a segment, or its maker cannot be told (another pid namespace)."""
    if not name.startswith("amesh-"):
        return None
    raw = name.encode()
    m = _NAME.fullmatch(raw)
    if m is not None:
        if int(m[4]) != namespace:
            return None
        return int(m[2]), (int(m[3]) if procfs else 0)
    m = _OLD_NAME.fullmatch(raw)
    if m is not None:
        return int(m[1]), 0
    return None


def _remove_dead(only_pid: int | None) -> int:
    where = shm_dir()
    try:
        names = os.listdir(where)
    except OSError:
        return 0
    procfs = _have_proc()
    namespace = _pid_namespace()
    dead: dict[tuple[int, int], bool] = {}
    removed = 0
    for name in names:
        owner = _owner_of(name, procfs, namespace)
        if owner is None or (only_pid is not None and owner[0] != only_pid):
            continue
        verdict = dead.get(owner)
        if verdict is None:
            verdict = dead[owner] = _is_dead(*owner, procfs)
        if not verdict:
            continue
        if _unlink_ours(where, name):
            removed += 1
        elif not name.endswith(_FREE) and _unlink_ours(where, name + _FREE):
            # A receiver loaded it after the listing and handed it back to its (dead)
            # sender: the one rename it can have had since (once unlinked here, a
            # receiver's rename fails and it unlinks the name itself).
            removed += 1
    return removed


def remove_segments_of(pid: int) -> int:
    """Unlink the segments left by process ``pid``, which must have ended.

    A killed process cannot run :func:`release_segments`; whoever saw it die can. A
    segment whose name says that a live process made it (the pid was reused since) is
    kept.

    Returns:
        How many segments were removed.
    """
    return _remove_dead(pid)


def sweep_segments() -> int:
    """Unlink the segments in :func:`shm_dir` of every process that has ended.

    For what killed jobs leave (a controller killed takes its workers along, and nobody
    is left to clean up): each ProcMesh start calls it. One listing of the directory
    and a look at /proc per owner. A segment is removed only when its maker surely
    ended: its pid is gone, or belongs to a process started at another time. Segments
    of another pid namespace (a container sharing /dev/shm) are left alone; so are
    those of the old naming (``amesh-<pid>-<n>-<random>``) whose pid is in use.

    Returns:
        How many segments were removed.
    """
    return _remove_dead(None)


def _after_fork_in_child() -> None:
    # The parent's segments are the parent's to release; a lock may be held by a
    # thread that does not exist here. What is empty or free already is left as it is:
    # every child of a zygote runs this, and each write copies a page it shares with
    # the zygote (15 fewer page faults in a bare fork; within noise in a worker's start).
    global _lock, _maps_lock
    if _lock.locked():
        _lock = threading.Lock()
    if _maps_lock.locked():
        _maps_lock = threading.Lock()
    if _made:
        _made.clear()
    if _pool:
        for kept in _pool.values():  # the child writes into no segment of its parent's
            kept.close()
        _pool.clear()
    if _spare:
        _spare.clear()
    if _maps:
        _maps.clear()


atexit.register(release_segments)
os.register_at_fork(after_in_child=_after_fork_in_child)


# -- decoding ---------------------------------------------------------------------------


def _load_code(data: bytes, filename: str, first: int, lines: list[str]) -> types.CodeType:
    """Rebuild code from :func:`_reduce_code`, and give ``linecache`` its source lines.

    The lines go under the code's own file name (``mtime`` None: ``linecache`` never
    checks them against a file), over what is known of that file already; lines of
    the file that no shipped code spans stay blank.
    """
    if lines:
        _remember_lines(filename, first, lines)
    code: types.CodeType = marshal.loads(data)
    return code


def _remember_lines(filename: str, first: int, lines: list[str]) -> None:
    """Put ``lines`` at line ``first`` of ``filename`` in ``linecache``."""
    entry = linecache.cache.get(filename)
    known: list[str] = []
    unchecked = False  # lines no file is checked against (mtime None), ours to change
    if entry is not None and len(entry) == 4:
        known, unchecked = entry[2], entry[1] is None
    start, end = first - 1, first - 1 + len(lines)
    if unchecked and known[start:end] == lines:
        return  # already there (the same code shipped again)
    if not unchecked:
        known = list(known)
    if len(known) < start:
        known.extend("\n" for _ in range(start - len(known)))
    known[start:end] = lines
    linecache.cache[filename] = (0, None, known, filename)  # the size counts with an mtime


def _load_segment(path: str, kind: int) -> bytes | bytearray | memoryview:
    """Open segment ``path`` and unlink it (or hand it back to its sender, see
    :data:`_POOLED`): a copy of its bytes, or a view of its mapping."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RuntimeError(
            f"shared-memory segment {path} is gone: its sender released it (it exited or"
            " closed its runtime), or this payload was already loaded once"
        ) from None
    shared, pooled, kind = kind & _SHARED, kind & _POOLED, kind & ~(_SHARED | _POOLED)
    copied = kind == _BYTES or kind == _BYTEARRAY
    back = pooled and copied and not shared
    try:
        if not back:
            with contextlib.suppress(FileNotFoundError):  # its sender releasing it now
                os.unlink(path)
        st = os.fstat(fd)
        size = st.st_size
        if copied:
            try:
                if back:
                    data = _read_kept(fd, (st.st_dev, st.st_ino), size, kind)
                else:
                    data = _read_all(fd, size, kind)
            except BaseException:
                if back:
                    _unlink(path)
                raise
            if back:
                try:  # (its sender may have released it meanwhile)
                    os.rename(path, path + _FREE)
                except OSError:
                    _unlink(path)
            return data
        # bytes that other receivers map too: what this one writes stays its own
        mem = mmap.mmap(fd, size, access=mmap.ACCESS_COPY if shared else mmap.ACCESS_WRITE)
    finally:
        os.close(fd)
    # The mapping lives as long as a view of it does (numpy's .base, torch's storage).
    view = memoryview(mem)
    return view.toreadonly() if kind == _READONLY else view


def _read_all(fd: int, size: int, kind: int) -> bytes | bytearray:
    """The ``size`` bytes of ``fd``, in one copy (up to 2 GiB for ``bytes``)."""
    if kind == _BYTES and SPARE_MIN <= size <= SPARE_MAX and _ext is not None:
        return _refilled(_ext.pread_bytes, fd, size)
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


def _read_kept(fd: int, key: tuple[int, int], size: int, kind: int) -> bytes | bytearray:
    """The ``size`` bytes of pooled segment ``fd`` (file ``key``), copied out of the
    mapping of it that this process keeps for the messages that come in it."""
    with _maps_lock:
        mem = _maps.get(key)
        if mem is not None and len(mem) >= size:
            _maps.move_to_end(key)
        else:
            mem = _map_kept(fd, key, size)
        if kind == _BYTES and SPARE_MIN <= size <= SPARE_MAX and _ext is not None:
            return _refilled(_ext.copy_bytes, mem, size)
        with memoryview(mem) as whole, whole[:size] as part:
            return bytes(part) if kind == _BYTES else bytearray(part)


def _map_kept(fd: int, key: tuple[int, int], size: int) -> mmap.mmap:
    """Map pooled segment ``fd`` for this and its next messages, letting the least
    recently used mappings go beyond :data:`MAPS_KEPT` or :data:`MAPS_BYTES`."""
    mem = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ)
    gone = [m for m in (_maps.pop(key, None),) if m is not None]
    _maps[key] = mem
    total = sum(map(len, _maps.values()))
    while len(_maps) > 1 and (len(_maps) > MAPS_KEPT or total > MAPS_BYTES):
        old = _maps.popitem(last=False)[1]
        total -= len(old)
        gone.append(old)
    for old in gone:
        with contextlib.suppress(BufferError):  # (a view of it lives: it goes with that)
            old.close()
    return mem


def _refilled(
    fill: Callable[[Any, int, list[bytes]], tuple[bytes, bool]], source: Any, size: int
) -> bytes:
    """``fill(source, size, _spare)`` (:func:`amesh._native._ext.pread_bytes` or ``copy_bytes``):
    the bytes, in a spare object when one is free, else in a new one kept as a spare
    from now on (see :data:`SPARE_MIN`), the oldest spares let go."""
    data, reused = fill(source, size, _spare)
    if not reused:
        with _lock:
            _spare.append(data)
            total = sum(map(len, _spare))
            while len(_spare) > SPARE_OBJECTS or total > SPARE_BYTES:
                total -= len(_spare.pop(0))
    return data


def _c_ext() -> types.ModuleType | None:
    try:
        from ._native import _ext
    except ImportError:  # not built: a new bytes object for each, read from the file
        return None
    return _ext


#: the C extension, for refilling large received bytes (None where it is not built)
_ext = _c_ext()

_LOAD_SEGMENT = _global_op(_load_segment.__module__, _load_segment.__name__)
# A segment reference as _segment_ref writes it, up to the path's length.
_REF = re.compile(
    re.escape(_LOAD_SEGMENT) + b"[" + re.escape(pickle.SHORT_BINUNICODE + pickle.BINUNICODE) + b"]"
)
