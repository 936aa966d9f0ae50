"""Shared-memory segments and their life.

With ``dumps(obj, shm=True)`` (one receiver, on this host) buffers of at least
:func:`shm_threshold` bytes are written once into shared-memory segments, files in
:func:`shm_dir` (``AMESH_SHM_DIR``, else ``/dev/shm``); the pickle holds their paths
(:func:`segment_ref`). The receiver maps each segment and unlinks it at once
(:func:`_load_segment`, which unpickling calls), so its objects are views of memory
that the kernel frees when the last of them goes.

A segment's name says whose it is: ``amesh-<job>-<pid>.<start>.<pidns>-<n>-<random>``.
``<job>`` (:func:`amesh._identity.job_id`) is derived from the job key, so the
controller and all its workers share it (:func:`segment_prefix`); ``<pid>``,
``<start>`` and ``<pidns>`` (:func:`._processes.this_process`) tell whether the process
that made it still runs, even once its pid is reused. A segment lives at most as long
as the process that made it, and goes earlier when its message is abandoned:

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
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import pickle
import re
import stat
import struct
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

from .._config import settings
from .._identity import job_id
from ._payload import Payload
from ._processes import has_procfs, is_dead, pid_namespace, this_process

__all__ = [
    "BYTEARRAY",
    "BYTES",
    "DIRECT",
    "POOLED",
    "READONLY",
    "SHM_THRESHOLD",
    "WRITABLE",
    "create_segment",
    "discard_segments",
    "for_receivers",
    "global_op",
    "release_payload",
    "release_segments",
    "remove_segments_of",
    "segment_prefix",
    "segment_ref",
    "shm_dir",
    "shm_threshold",
    "sweep_segments",
]

log = logging.getLogger("amesh.codec")

#: With ``shm=True``, buffers of at least this many bytes go through shared memory
#: (``AMESH_SHM_THRESHOLD`` overrides it; below 64 KiB counts as 64 KiB).
SHM_THRESHOLD = 1 << 20

#: The pickler writes buffers of this size or more straight to its file (C _pickle's
#: FRAME_SIZE_TARGET); only those can be taken out of the stream after the fact.
DIRECT = 64 * 1024

#: What a buffer taken out of the stream was, so what to rebuild.
BYTES, BYTEARRAY, WRITABLE, READONLY = 0, 1, 2, 3
# A flag on that kind: the segment's bytes are shared by several receivers, each
# through a name of its own (see :func:`for_receivers`), and mapped copy-on-write.
_SHARED = 4
#: A flag on a kind that is copied out (bytes, bytearray): the receiver hands the
#: segment back to its sender for the next message, renaming it ``<path>.free``, rather
#: than unlinking it (see :func:`_reuse_segment`).
POOLED = 8
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


def shm_dir() -> str:
    """Where segments go: ``AMESH_SHM_DIR``, else ``/dev/shm``."""
    return settings().shm_dir or "/dev/shm"


def shm_threshold() -> int:
    """Buffers of this many bytes or more go through shared memory with ``shm=True``.

    ``AMESH_SHM_THRESHOLD`` if set, else :data:`SHM_THRESHOLD`; at least 64 KiB.

    Raises:
        ConfigError: ``AMESH_SHM_THRESHOLD`` is not an integer >= 0.
    """
    return max(settings().shm_threshold, DIRECT)


_counter = count()
_lock = threading.Lock()
_made: set[str] = set()  # segments this process made, maybe consumed since
_pool: dict[str, _Kept] = {}  # segments that come back for reuse (see POOLED)
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
# <job> is :func:`amesh._identity.job_id`; <pid>.<start>.<pidns> is its maker's
# :func:`._processes.this_process`, which names it for good: a pid reused by a later
# process has another start time.
_NAME = re.compile(
    rb"amesh-(\d{10})-(\d{1,10})\.(\d{1,20})\.(\d{1,20})-\d{1,20}-[0-9a-f]{8}(?:\.free)?"
)
# What amesh named its segments before: ``amesh-<pid>-<n>-<random>``.
_OLD_NAME = re.compile(rb"amesh-(\d{1,10})-\d{1,20}-[0-9a-f]{8}")


def segment_prefix() -> str:
    """The start of the name of every segment of this job: ``amesh-<job id>-``."""
    return f"amesh-{job_id()}-"


def _segment_name() -> str:
    return os.path.join(
        shm_dir(), f"{segment_prefix()}{this_process()}-{next(_counter)}-{os.urandom(4).hex()}"
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


def create_segment(view: memoryview, poolable: bool = False) -> tuple[str | None, bool]:
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
    """Another name for segment ``path``, of the same form (see :func:`create_segment`)."""
    name = f"{segment_prefix()}{this_process()}-{next(_counter)}-{os.urandom(4).hex()}"
    link = os.path.join(os.path.dirname(path), name)
    os.link(path, link)
    _remember(link)
    return link


def _rename_ref(data: bytes, path: str, name: str) -> bytes:
    """Pickle ``data`` with its reference to segment ``path`` naming ``name`` instead,
    as a segment that other receivers share."""
    ref = re.compile(re.escape(_LOAD_SEGMENT + str_op(path) + pickle.BININT1) + b"(.)", re.S)

    def shared(m: re.Match[bytes]) -> bytes:
        return _LOAD_SEGMENT + str_op(name) + pickle.BININT1 + bytes((m[1][0] | _SHARED,))

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
            or view[end + 1] > (READONLY | _SHARED | POOLED)
        ):
            continue
        try:
            refs.append(bytes(view[at:end]).decode())
        except UnicodeDecodeError:
            continue
    return refs


def discard_segments(payload: bytes | memoryview, buffers: Sequence[Any] = ()) -> int:
    """Unlink the segments that a received message refers to, which will never be
    loaded: ``payload`` and ``buffers`` as :func:`amesh._wire.loads` takes them.

    For a received payload that is dropped unread (a reply to a call that timed out or
    was cancelled): its sender made the segments for this one receiver, so nobody else
    would unlink them before the sender exits. Only files of this user named like a
    segment of this job (:func:`segment_prefix`) directly in :func:`shm_dir` are
    touched, whatever the pickle says.

    Returns:
        How many segments were removed.
    """
    refs = _segment_refs(payload if payload or not buffers else buffers[0])
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
    procfs = has_procfs()
    namespace = pid_namespace()
    dead: dict[tuple[int, int], bool] = {}
    removed = 0
    for name in names:
        owner = _owner_of(name, procfs, namespace)
        if owner is None or (only_pid is not None and owner[0] != only_pid):
            continue
        verdict = dead.get(owner)
        if verdict is None:
            verdict = dead[owner] = is_dead(*owner, procfs)
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


def str_op(s: str) -> bytes:
    b = s.encode()
    if len(b) < 256:
        return pickle.SHORT_BINUNICODE + bytes((len(b),)) + b
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def global_op(module: str, name: str) -> bytes:
    return str_op(module) + str_op(name) + pickle.STACK_GLOBAL


def segment_ref(path: str, kind: int) -> bytes:
    """Opcodes that push ``_load_segment(path, kind)``."""
    return (
        _LOAD_SEGMENT
        + str_op(path)
        + pickle.BININT1
        + bytes((kind,))
        + pickle.TUPLE2
        + pickle.REDUCE
    )


# Opcodes for a buffer that travels as a part of the frame instead, as pickle writes it.


def _load_segment(path: str, kind: int) -> bytes | bytearray | memoryview:
    """Open segment ``path`` and unlink it (or hand it back to its sender, see
    :data:`POOLED`): a copy of its bytes, or a view of its mapping."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RuntimeError(
            f"shared-memory segment {path} is gone: its sender released it (it exited or"
            " closed its runtime), or this payload was already loaded once"
        ) from None
    shared, pooled, kind = kind & _SHARED, kind & POOLED, kind & ~(_SHARED | POOLED)
    copied = kind == BYTES or kind == BYTEARRAY
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
    return view.toreadonly() if kind == READONLY else view


def _read_all(fd: int, size: int, kind: int) -> bytes | bytearray:
    """The ``size`` bytes of ``fd``, in one copy (up to 2 GiB for ``bytes``)."""
    if kind == BYTES and SPARE_MIN <= size <= SPARE_MAX and _ext is not None:
        return _refilled(_ext.pread_bytes, fd, size)
    if kind == BYTES:
        data = os.read(fd, size)
        if len(data) < size:  # Linux reads at most 2 GiB at a time
            data += _read_all(fd, size - len(data), BYTEARRAY)
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
        if kind == BYTES and SPARE_MIN <= size <= SPARE_MAX and _ext is not None:
            return _refilled(_ext.copy_bytes, mem, size)
        with memoryview(mem) as whole, whole[:size] as part:
            return bytes(part) if kind == BYTES else bytearray(part)


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
        from .._native import _ext
    except ImportError:  # not built: a new bytes object for each, read from the file
        return None
    return _ext


#: the C extension, for refilling large received bytes (None where it is not built)
_ext = _c_ext()

_LOAD_SEGMENT = global_op(_load_segment.__module__, _load_segment.__name__)
# A segment reference as _segment_ref writes it, up to the path's length.
_REF = re.compile(
    re.escape(_LOAD_SEGMENT) + b"[" + re.escape(pickle.SHORT_BINUNICODE + pickle.BINUNICODE) + b"]"
)
