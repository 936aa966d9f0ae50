"""The payload codec: out-of-band buffers, large bytes, shared-memory segments."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from amesh import _wire
from amesh._wire import _segments
from amesh.testing import LeakError, no_leaks
from amesh.testing._leaks import shm_files

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _release() -> Iterator[None]:
    """A failing test must not fail the next ones by leaving segments behind."""
    yield
    _wire.release_segments()


def round_trip(obj: object, *, shm: bool = False) -> object:
    p = _wire.dumps(obj, shm=shm)
    return _wire.loads(p.data, p.buffers)


def mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"nothing mapped at {address:#x}")


def test_small_objects_round_trip() -> None:
    for obj in [((b"x" * 64,), {}), ((1, "a", None), {"k": [1.5, b"", bytearray(b"ab")]})]:
        p = _wire.dumps(obj)
        assert p.buffers == []
        assert p.nbytes == len(p.data) < 200
        assert _wire.loads(p.data, p.buffers) == obj
        q = _wire.dumps(obj, shm=True)
        assert (q.data, q.buffers) == (p.data, [])
    assert shm_files() == set()


def test_large_bytes_travel_out_of_band() -> None:
    blob = os.urandom(MIB)
    names = [f"name{i}" for i in range(20_000)]  # the pickle spans several frames
    obj = (names, blob, blob, {"ba": bytearray(blob[:100_000]), "small": b"y" * 1000})
    p = _wire.dumps(obj)
    assert len(p.data) < 300_000  # the names; not the blob, nor the bytearray
    assert [b.nbytes for b in p.buffers] == [MIB, 100_000]
    got = _wire.loads(p.data, p.buffers)
    assert got == obj
    assert type(got[1]) is bytes and got[1] is got[2]  # one object, sent once
    assert type(got[3]["ba"]) is bytearray


def test_non_contiguous_numpy_bytes_go_out_of_band_too() -> None:
    # numpy pickles a non-contiguous array through ``tobytes()``: a large bytes object.
    a = np.arange(400_000, dtype=np.float64).reshape(800, 500)[:, ::2]
    p = _wire.dumps(a)
    assert len(p.data) < 1000 and [b.nbytes for b in p.buffers] == [a.nbytes]
    assert np.array_equal(_wire.loads(p.data, p.buffers), a)


def test_large_bytes_through_shared_memory() -> None:
    blob = os.urandom(2 * MIB)
    p = _wire.dumps({"blob": blob, "mid": b"m" * 100_000}, shm=True)
    assert len(p.data) < 1000
    assert [b.nbytes for b in p.buffers] == [100_000]  # under the threshold: in the frame
    (segment,) = shm_files()
    assert os.stat(os.path.join(_wire.shm_dir(), segment)).st_mode & 0o777 == 0o600
    got = _wire.loads(p.data, p.buffers)
    # copied out, and handed back to its sender for the next message (see the pool)
    assert shm_files() == {segment + ".free"}
    assert type(got["blob"]) is bytes and got["blob"] == blob
    assert _wire.release_segments() == 1
    assert shm_files() == set()


def test_a_segment_handed_back_carries_the_next_message() -> None:
    first, second = os.urandom(4 * MIB), os.urandom(4 * MIB)
    p = _wire.dumps(first, shm=True)
    (name,) = shm_files()
    inode = os.stat(os.path.join(_wire.shm_dir(), name)).st_ino
    q = _wire.dumps(second, shm=True)  # the first is still with its receiver: a new one
    assert len(shm_files()) == 2
    assert _wire.loads(p.data, p.buffers) == first
    r = _wire.dumps(os.urandom(3 * MIB), shm=True)  # reuses the first's file, resized
    names = shm_files()
    assert len(names) == 2 and name + ".free" not in names
    (again,) = [n for n in names if os.stat(os.path.join(_wire.shm_dir(), n)).st_ino == inode]
    assert again != name  # a new name for every message
    assert _wire.loads(q.data, q.buffers) == second
    got = _wire.loads(r.data, r.buffers)
    assert len(got) == 3 * MIB
    with pytest.raises(RuntimeError, match="already loaded once"):
        _wire.loads(p.data, p.buffers)
    # a sender that abandons a message takes its segment (a reused one) out of the pool
    assert len(_segments._pool) == 2 and len(shm_files()) == 2
    s = _wire.dumps(os.urandom(2 * MIB), shm=True)
    assert len(shm_files()) == 2  # one of the two handed back
    assert _wire.release_payload(s) == 1
    assert len(_segments._pool) == 1
    assert _wire.release_segments() == 1  # the other one
    assert shm_files() == set() and _segments._pool == {}


def test_a_segment_handed_back_while_its_sender_looks_stays_in_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The receiver hands a segment back right after its sender failed to claim it
    (it was not back yet): the sender keeps it in its pool, and so removes it when its
    runtime closes, rather than losing track of it."""
    p = _wire.dumps(os.urandom(2 * MIB), shm=True)
    (name,) = shm_files()
    rename = os.rename

    def back_just_too_late(src: str, dst: str) -> None:
        if src.endswith(".free"):  # the sender's claim fails: still with the receiver
            monkeypatch.setattr(_segments.os, "rename", rename)
            assert len(_wire.loads(p.data, p.buffers)) == 2 * MIB  # and back it comes
            raise FileNotFoundError(src)
        rename(src, dst)

    monkeypatch.setattr(_segments.os, "rename", back_just_too_late)
    q = _wire.dumps(os.urandom(MIB), shm=True)  # made a new segment meanwhile
    assert shm_files() == {name + ".free", *(os.path.basename(s) for s in q.segments)}
    assert len(_segments._pool) == 2
    r = _wire.dumps(os.urandom(MIB), shm=True)  # the one handed back serves this one
    assert len(shm_files()) == 2 and name + ".free" not in shm_files()
    assert _wire.release_payload(r) == 1 and _wire.release_payload(q) == 1
    assert shm_files() == set()


def test_large_bytes_received_fill_an_object_nobody_holds_any_more() -> None:
    """A bytes read out of a segment goes into one received before, once nothing
    else references it; never into one that somebody still holds."""
    _segments._spare.clear()
    first, second, third = (os.urandom(2 * MIB) for _ in range(3))
    got = _wire.loads(*_dumped(first))
    assert got == first and _segments._spare == [got]
    kept = got  # still held: a new object for the next one, and `kept` stays as it was
    hash(kept)  # (its hash is cached: a refilled object must not keep it)
    got = _wire.loads(*_dumped(second))
    assert got == second and got is not kept and kept == first
    assert [id(b) for b in _segments._spare] == [id(kept), id(got)]
    reused = id(kept)
    del kept, got  # nobody holds them now: the oldest of the right size is filled again
    got = _wire.loads(*_dumped(third))
    assert id(got) == reused and got == third
    assert hash(got) == hash(bytes(bytearray(third)))  # not the hash `first` had
    other = _wire.loads(*_dumped(os.urandom(3 * MIB)))  # another size: a new object
    assert id(other) != reused and len(_segments._spare) == 3
    _wire.release_segments()
    assert _segments._spare == []


def test_spare_bytes_are_bounded_and_let_go_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    _segments._spare.clear()
    monkeypatch.setattr(_segments, "SPARE_OBJECTS", 2)
    monkeypatch.setattr(_segments, "SPARE_BYTES", 5 * MIB)
    loaded = [_wire.loads(*_dumped(os.urandom(n * MIB))) for n in (1, 2, 3)]
    assert [len(b) for b in _segments._spare] == [2 * MIB, 3 * MIB]  # at most 2 objects
    _wire.loads(*_dumped(os.urandom(4 * MIB)))
    assert [len(b) for b in _segments._spare] == [4 * MIB]  # at most 5 MiB in all
    assert [len(b) for b in loaded] == [MIB, 2 * MIB, 3 * MIB]  # what was let go lives on
    monkeypatch.setattr(_segments, "SPARE_MIN", 2 * MIB)
    small = _wire.loads(*_dumped(os.urandom(MIB)))  # under SPARE_MIN: not kept
    assert len(small) == MIB and [len(b) for b in _segments._spare] == [4 * MIB]
    _segments._spare.clear()


def test_pread_and_copy_bytes_refill_only_an_unshared_object_of_its_size(tmp_path: Path) -> None:
    from amesh._native import _ext

    path = tmp_path / "data"
    path.write_bytes(b"abcdefgh")
    fd = os.open(path, os.O_RDONLY)
    try:
        spare: list[bytes] = []
        data, reused = _ext.pread_bytes(fd, 8, spare)
        assert (data, reused) == (b"abcdefgh", False)
        spare.append(b"x" * 7)  # another size
        spare.append(bytes(bytearray(b"y" * 8)))
        held = spare[-1]
        data, reused = _ext.pread_bytes(fd, 8, spare)
        assert not reused and held == b"y" * 8  # referenced here: left alone
        del held
        data, reused = _ext.pread_bytes(fd, 8, spare)
        assert reused and data is spare[-1] and data == b"abcdefgh"
        assert spare[0] == b"x" * 7
        with pytest.raises(RuntimeError, match="holds 8 bytes, not 9"):
            _ext.pread_bytes(fd, 9, spare)
        with pytest.raises(ValueError):
            _ext.pread_bytes(fd, -1, spare)
        with pytest.raises(TypeError):
            _ext.pread_bytes(fd, 8, tuple(spare))  # type: ignore[arg-type]
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        _ext.pread_bytes(fd, 8, [])  # closed
    assert err.value.errno == errno.EBADF
    # the same out of a buffer (a mapping)
    spare = [bytes(bytearray(b"z" * 4))]
    data, reused = _ext.copy_bytes(memoryview(b"abcdef"), 4, spare)
    assert reused and data is spare[0] and data == b"abcd"
    data, reused = _ext.copy_bytes(b"abcdef", 4, spare)  # `data` holds the other one
    assert not reused and data == b"abcd" and spare[0] == b"abcd"
    with pytest.raises(ValueError, match="cannot copy 7 bytes out of a buffer of 6"):
        _ext.copy_bytes(b"abcdef", 7, spare)


def _dumped(data: bytes) -> tuple[bytes, list[object]]:
    p = _wire.dumps(data, shm=True)
    assert p.segments  # through shared memory
    return p.data, list(p.buffers)


def test_a_pooled_segment_is_written_and_read_through_mappings_that_stay() -> None:
    """Its sender writes each message into its mapping of the segment, its receiver
    reads each out of a mapping it keeps; a message of another size resizes the file
    (one that needs new pages is written, not stored through the mapping)."""
    _wire.release_segments()
    messages = [os.urandom(n * MIB // 2) for n in (8, 8, 6, 10, 3)]  # same, less, more
    inodes = set()
    for i, data in enumerate(messages):
        p = _wire.dumps(bytearray(data) if i == 2 else data, shm=True)
        (path,) = p.segments
        assert os.stat(path).st_size == len(data)
        inodes.add(os.stat(path).st_ino)
        got = _wire.loads(p.data, p.buffers)
        assert got == data and type(got) is (bytearray if i == 2 else bytes)
        assert len(_segments._pool) == 1 and len(_segments._maps) == 1
    assert len(inodes) == 1  # one file carried every message
    (kept,) = _segments._pool.values()
    assert kept.size == len(messages[-1])
    _wire.release_segments()
    assert _segments._pool == {} and len(_segments._maps) == 0 and shm_files() == set()


def test_a_receiver_keeps_a_bounded_number_of_mappings(monkeypatch: pytest.MonkeyPatch) -> None:
    _wire.release_segments()
    monkeypatch.setattr(_segments, "MAPS_KEPT", 2)
    payloads = [_wire.dumps(os.urandom(2 * MIB), shm=True) for _ in range(3)]  # 3 files
    assert len(_segments._pool) == 3
    for p in payloads:
        _wire.loads(p.data, p.buffers)
    assert len(_segments._maps) == 2  # the least recently used one was let go
    monkeypatch.setattr(_segments, "MAPS_BYTES", 3 * MIB)
    data = os.urandom(2 * MIB)
    again = _wire.dumps(data, shm=True)
    assert _wire.loads(again.data, again.buffers) == data
    assert len(_segments._maps) == 1  # 2 mappings of 2 MiB are more than 3 MiB
    _wire.release_segments()
    assert len(_segments._maps) == 0 and shm_files() == set()


def test_only_copied_kinds_and_sizes_in_range_are_pooled() -> None:
    small = _wire.dumps(os.urandom(MIB // 2), shm=True)  # under POOL_MIN
    array = _wire.dumps(np.ones(MIB, dtype=np.uint8), shm=True)  # mapped, not copied
    _wire.loads(small.data, small.buffers)
    _wire.loads(array.data, array.buffers)
    assert shm_files() == set()


def test_numpy_array_through_shared_memory_is_a_view_of_the_mapping() -> None:
    a = np.random.default_rng(0).random((512, 1024))  # 4 MiB
    ro = np.arange(MIB, dtype=np.int32)
    ro.flags.writeable = False
    p = _wire.dumps((a, ro), shm=True)
    assert p.buffers == [] and len(p.data) < 1000
    names = shm_files()
    assert len(names) == 2
    got, got_ro = _wire.loads(p.data, p.buffers)
    assert shm_files() == set()
    assert np.array_equal(got, a) and np.array_equal(got_ro, ro)
    for arr in (got, got_ro):
        where = mapped_file(arr.ctypes.data)
        assert where.endswith("(deleted)") and os.path.basename(where.split()[0]) in names
    assert got.flags.writeable and not got_ro.flags.writeable
    got[0, 0] = -1.0
    assert got[0, 0] == -1.0
    view = got[1:]  # the mapping outlives the array it came as, while a view remains
    del got
    assert view[0, 1] == a[1, 1]


def test_torch_tensor_through_shared_memory_is_a_view_of_the_mapping() -> None:
    t = torch.randn(1024, 1024)  # 4 MiB
    strided = torch.arange(4 * MIB, dtype=torch.int16)[::2]  # made contiguous by the sender
    p = _wire.dumps({"t": t, "s": strided}, shm=True)
    assert p.buffers == [] and len(p.data) < 1000
    names = shm_files()
    got = _wire.loads(p.data, p.buffers)
    assert shm_files() == set()
    assert torch.equal(got["t"], t) and torch.equal(got["s"], strided)
    for tensor in got.values():
        where = mapped_file(tensor.data_ptr())
        assert where.endswith("(deleted)") and os.path.basename(where.split()[0]) in names
    got["t"][0, 0] = 42.0
    assert got["t"][0, 0].item() == 42.0


def test_threshold_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    a = np.ones(2 * MIB // 8)
    monkeypatch.setenv("AMESH_SHM_THRESHOLD", str(4 * MIB))
    assert _wire.shm_threshold() == 4 * MIB
    p = _wire.dumps(a, shm=True)
    assert [b.nbytes for b in p.buffers] == [2 * MIB] and shm_files() == set()
    monkeypatch.setenv("AMESH_SHM_THRESHOLD", "1")
    assert _wire.shm_threshold() == 64 * 1024  # smaller buffers cannot leave the stream
    p = _wire.dumps(a, shm=True)
    assert p.buffers == [] and len(shm_files()) == 1
    assert np.array_equal(_wire.loads(p.data, p.buffers), a)


def test_release_segments_removes_unconsumed_ones() -> None:
    blob = os.urandom(MIB)
    consumed = _wire.dumps(blob, shm=True)
    assert _wire.loads(consumed.data, consumed.buffers) == blob
    for _ in range(2):
        _wire.dumps((blob, np.zeros(MIB)), shm=True)
    assert len(shm_files()) == 4
    assert _wire.release_segments() == 4
    assert shm_files() == set()
    assert _wire.release_segments() == 0


def test_loading_a_missing_segment_says_so() -> None:
    p = _wire.dumps(np.zeros(MIB), shm=True)
    _wire.release_segments()
    with pytest.raises(RuntimeError, match=r"shared-memory segment .*amesh-\d+-.* is gone"):
        _wire.loads(p.data, p.buffers)
    q = _wire.dumps(os.urandom(MIB), shm=True)
    _wire.loads(q.data, q.buffers)
    with pytest.raises(RuntimeError, match="already loaded once"):  # one receiver, once
        _wire.loads(q.data, q.buffers)


def test_registry_forgets_consumed_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMESH_SHM_THRESHOLD", "65536")
    blob = b"z" * 65536
    for _ in range(1100):
        p = _wire.dumps(blob, shm=True)
        assert _wire.loads(p.data, p.buffers) == blob
    assert len(_segments._made) < 1024


@pytest.mark.parametrize("where", ["missing", "a-file"])
def test_without_a_segment_directory_buffers_go_in_the_frame(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").touch()
    monkeypatch.setenv("AMESH_SHM_DIR", str(tmp_path / where))
    obj = (np.ones(MIB), os.urandom(2 * MIB))
    p = _wire.dumps(obj, shm=True)
    assert [b.nbytes for b in p.buffers] == [8 * MIB, 2 * MIB] and len(p.data) < 1000
    got = _wire.loads(p.data, p.buffers)
    assert np.array_equal(got[0], obj[0]) and got[1] == obj[1]


def test_a_full_segment_directory_sends_in_the_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: object, *offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    t = torch.arange(MIB, dtype=torch.float32)
    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        m.setattr(os, "pwrite", full)
        p = _wire.dumps((b"small", t), shm=True)
    assert shm_files() == set()  # the half-made segment is gone
    assert [b.nbytes for b in p.buffers] == [4 * MIB]
    assert torch.equal(_wire.loads(p.data, p.buffers)[1], t)


def test_no_leaks_reports_a_leaked_segment() -> None:
    with pytest.raises(LeakError, match="shared-memory segments"), no_leaks():
        _wire.dumps(np.zeros(MIB), shm=True)
    _wire.release_segments()
    assert _wire.shm_dir() == os.environ["AMESH_SHM_DIR"]  # this session's own


CHILD = """
import hashlib, pickle, sys
import numpy as np, torch
from amesh import _wire

data, buffers = pickle.loads(sys.stdin.buffer.read())
arr, t, blob = _wire.loads(data, [memoryview(b) for b in buffers])
assert arr.flags.writeable
arr[0] += 1.0  # writable: this process's own copy of the pages now
print(hashlib.sha256(arr.tobytes() + t.numpy().tobytes() + blob).hexdigest())
"""


def test_another_process_loads_the_segments() -> None:
    arr = np.random.default_rng(1).random(MIB)
    t = torch.randn(MIB)
    blob = os.urandom(3 * MIB)
    p = _wire.dumps((arr, t, blob), shm=True)
    assert p.buffers == [] and len(shm_files()) == 3
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=pickle.dumps((p.data, [bytes(b) for b in p.buffers])),
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr.decode()
    arr[0] += 1.0
    expected = hashlib.sha256(arr.tobytes() + t.numpy().tobytes() + blob).hexdigest()
    assert out.stdout.decode().strip() == expected
    (back,) = shm_files()  # the bytes' segment, handed back; the mapped ones are gone
    assert back.endswith(".free")
    assert _wire.release_segments() == 1
    assert shm_files() == set()


SENDER = """
import os, sys
import numpy as np
from amesh import _wire

_wire.dumps((np.zeros(1 << 20), os.urandom(1 << 21)), shm=True)
print(os.getpid(), flush=True)
if sys.argv[1] == "killed":
    os._exit(0)  # like SIGKILL: no atexit
"""


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_a_sender_that_ends_leaves_no_segment(end: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SENDER, end], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout)
    # amesh-<job>-<pid>.<start time>.<pid namespace>-<n>-<random>
    left = {name for name in shm_files() if name.split("-")[2].startswith(f"{pid}.")}
    if end == "exits":
        assert left == set()  # atexit released them
    else:
        assert len(left) == 2
        assert _wire.remove_segments_of(pid) == 2
    assert shm_files() == set()


FORKER = """
import os, signal, threading
from amesh import _wire
from amesh._wire import _segments

p = _wire.dumps(os.urandom(1 << 21), shm=True)  # pooled, then read through a mapping
assert _wire.loads(p.data, p.buffers) and _segments._pool and _segments._maps and _segments._made
free = _segments._maps_lock
held, done = threading.Event(), threading.Event()

def hold():
    with _segments._lock:  # held by a thread the child will not have
        held.set()
        done.wait()

t = threading.Thread(target=hold)
t.start()
held.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a hang here ends this child too, not only its parent
    ok = _segments._pool == {} and _segments._made == set() and len(_segments._maps) == 0
    ok = ok and _segments._maps_lock is free  # a free lock is kept, not made anew
    if _segments._lock.acquire(timeout=5):  # a new lock: the old one stays held
        _segments._lock.release()
        ok = ok and _wire.release_segments() == 0  # nothing of its parent's is its
    else:
        ok = False
    os._exit(0 if ok else 3)
done.set()
t.join()
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), len(_segments._pool), flush=True)
assert _wire.release_segments() == 1
"""


def test_a_forked_child_drops_its_parents_segments_and_held_locks() -> None:
    out = subprocess.run([sys.executable, "-c", FORKER], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"]  # the child passed; the parent's pool intact
    assert shm_files() == set()


def test_small_builtin_values_take_the_c_pickler_alone() -> None:
    """Scalars, short strings and bytes in small containers: one pickle, nothing out of
    band, loaded back equal; anything else (or anything big) takes the full path."""
    from amesh._wire._pickling import _plain

    dumps, loads = _wire.dumps, _wire.loads

    small = ((1, 2.5, None, True, 3j, "é" * 10, b"x" * 64), {"k": [1, (2, b"")]})
    assert _plain(small)
    payload = dumps(small)
    assert payload.buffers == [] and payload.segments == ()
    assert loads(payload.data) == small
    big = b"y" * (1 << 20)
    assert not _plain((big,))
    assert [m.nbytes for m in dumps((big,)).buffers] == [len(big)]  # out of band still
    assert _plain(({"a": {1, 2}},))  # sets too
    assert not _plain(({"a": range(3)},))  # any other object: cloudpickle
    assert not _plain(list(range(100)))  # too many nodes to check cheaply
    assert loads(dumps(list(range(100))).data) == list(range(100))
