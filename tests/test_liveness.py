"""Liveness does not depend on the GIL or on allocation (see :mod:`amesh._worker`).

A worker's heartbeats come from a thread of the C extension that never takes the GIL:
a worker whose event loop's thread is inside one long C call is alive, and one whose
main thread sleeps uninterruptibly in the kernel (state D) is declared dead. A stopped
worker sends nothing: see
``test_supervision.py::test_stopped_process_is_declared_failed_by_heartbeat``.

Large inbound frames are read into memory that nobody zero-fills under the GIL: a
header that claims 2 GiB costs the worker neither its life nor that memory.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import mmap
import os
import socket
import threading
import tracemalloc
import weakref

import anyio
import pytest

from amesh import ProcMesh, SupervisionError, _wire
from amesh._runtime import current_runtime
from amesh._transport import StreamTransport, _auth
from amesh._transport import _stream_framing as wire
from amesh._transport._ext import ExtTransport
from amesh._worker import NativeBeats

from .liveness_actors import Busy
from .test_lifecycle import wait_pid_gone
from .test_transport import Inbox, recv_exact

pytestmark = pytest.mark.anyio

PERIOD, TIMEOUT = 0.2, 1.0


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    """Only the workers' liveness is tested (they run asyncio, whatever the controller)."""
    return ("asyncio", {"use_uvloop": True})


def mesh() -> ProcMesh:
    return ProcMesh({"procs": 1}, heartbeat_period=PERIOD, heartbeat_timeout=TIMEOUT)


@pytest.mark.parametrize("impl", ["stream", "ext"])
async def test_a_worker_inside_one_long_gil_holding_call_is_alive(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One C call that holds the GIL for several heartbeat timeouts: the worker is not
    declared dead, and the call returns its value."""
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", impl)
    with anyio.fail_after(120):
        async with mesh() as procs:
            busy = await procs.spawn("busy", Busy)
            pid = await busy.pid.call_one()
            n, total, took = await busy.hold_the_gil.call_one(3 * TIMEOUT)
            assert total == n * (n - 1) // 2
            print(f"{impl}: sum(range({n})) held the GIL {took:.1f} s (timeout {TIMEOUT:g} s)")
            assert await busy.pid.call_one() == pid == procs.pids[0]


async def test_a_worker_hung_in_the_kernel_is_declared_dead() -> None:
    """The event loop's thread sleeps uninterruptibly (state D, as a vfork parent):
    the heartbeats stop after the heartbeat timeout, and the worker is declared dead."""
    with anyio.fail_after(120):
        with pytest.raises(SupervisionError, match="no heartbeat") as info:
            async with mesh() as procs:
                busy = await procs.spawn("busy", Busy)
                victim = procs.pids[0]
                # returns (and the test fails) unless the worker is killed first
                await busy.hang_in_kernel.call_one(20 * TIMEOUT)
        assert info.value.failures[0].pid == victim
        assert wait_pid_gone(victim, 10)


#: What the peer in the next test announces, and the most the worker accepts.
HUGE = 2**31 - 1


def nng_message(body: bytes) -> bytes:
    """NNG's framing over a unix socket: a type byte, a u64 BE length, the body."""
    return b"\x01" + len(body).to_bytes(8, "big") + body


async def open_proven(addr: str) -> socket.socket:
    """A connection to ``addr`` (a stream, or an NNG abstract address) that has proven
    itself with the job key, as a peer of this job would."""
    nng = not wire.is_stream_address(addr)
    family: int
    sockaddr: wire.SockAddr
    if nng:
        family, sockaddr = socket.AF_UNIX, "\0" + addr.removeprefix("abstract://")
    else:
        family, sockaddr = wire.parse_address(addr)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(10)
        sock.connect(sockaddr)
        if nng:
            sock.sendall(b"\x00SP\x00\x00\x50\x00\x00")  # a Push0 peer
            await anyio.to_thread.run_sync(recv_exact, sock, 8)
            sock.sendall(nng_message(_auth.hello(addr, "abstract://liveness-peer")))
        else:
            challenge = await anyio.to_thread.run_sync(recv_exact, sock, _auth.CHALLENGE_LEN)
            sock.sendall(_auth.answer(challenge, addr, "stream+abstract://liveness-peer"))
    except BaseException:
        sock.close()
        raise
    return sock


@pytest.mark.parametrize("impl", ["stream", "ext"])
async def test_a_header_claiming_a_huge_frame_does_not_stall_the_worker(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proven peer announces a frame of 2**31 - 1 bytes and sends one: the worker
    reserves the memory without touching it, stays alive for several heartbeat
    timeouts and answers calls; the memory goes with the connection. A real large
    frame takes the same path."""
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", impl)
    monkeypatch.setenv("AMESH_TRANSPORT", "abstract")
    with anyio.fail_after(120):
        async with mesh() as procs:
            busy = await procs.spawn("busy", Busy)
            size, rss = await busy.memory.call_one()
            with await open_proven(procs._live().addrs[0]) as sock:
                if impl == "stream":
                    sock.sendall(wire.HEADER.pack(HUGE) + b"x")
                else:  # the type byte and length of a message, as nng_message() makes
                    sock.sendall(b"\x01" + HUGE.to_bytes(8, "big") + b"x")
                while (await busy.memory.call_one())[0] - size < HUGE:
                    pass  # until the worker has taken the header
                await busy.idle.call_one(3 * TIMEOUT)
                now_size, now_rss = await busy.memory.call_one()
                print(
                    f"{impl}: {HUGE} bytes announced: address space +{now_size - size >> 20}"
                    f" MiB, resident +{now_rss - rss >> 20} MiB"
                )
                assert now_size - size >= HUGE  # still waiting for the rest
                assert now_rss - rss < 256 * 2**20, f"resident memory grew by {now_rss - rss}"
            while (await busy.memory.call_one())[0] - size >= HUGE:
                pass  # until the worker has dropped the connection, and the memory
            data = os.urandom(8 * 2**20)
            assert await busy.digest.call_one(data) == (len(data), hashlib.sha256(data).hexdigest())
            assert current_runtime().statistics().heartbeats_received > 0


def test_large_frames_are_read_into_untouched_mappings() -> None:
    """The reader's memory for a large frame: an anonymous mapping, nothing allocated
    (or zero-filled) under the GIL, writable, freed with its last view."""
    frames: list[wire.Buf] = []
    reader = wire.Reader(wire.MAX_SIZE, frames.append)
    tracemalloc.start()
    try:
        reader.get_buffer()[:5] = wire.HEADER.pack(2**31 - 1) + b"x"
        reader.buffer_updated(5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak
    rest = reader.get_buffer()
    assert len(rest) == 2**31 - 2 and not rest.readonly
    assert isinstance(rest.obj, mmap.mmap)
    gone = weakref.ref(rest.obj)
    del rest, reader
    gc.collect()
    assert gone() is None and not frames

    # a whole frame, read in pieces as from a socket
    payload = os.urandom(3 * 2**20 + 5)
    data = wire.HEADER.pack(len(payload)) + payload
    reader = wire.Reader(wire.MAX_SIZE, frames.append)
    pos = 0
    while pos < len(data):
        buf = reader.get_buffer()
        n = min(len(buf), 65536, len(data) - pos)
        buf[:n] = data[pos : pos + n]
        del buf
        reader.buffer_updated(n)
        pos += n
    [frame] = frames
    assert isinstance(frame, memoryview) and not frame.readonly
    assert isinstance(frame.obj, mmap.mmap) and frame == payload
    frame[0] ^= 0xFF  # the frame's own memory
    gone = weakref.ref(frame.obj)
    del frame, frames[:]
    gc.collect()
    assert gone() is None

    # below the threshold: a bytearray, as before
    reader = wire.Reader(wire.MAX_SIZE, frames.append)
    reader.get_buffer()[:4] = wire.HEADER.pack(wire.MAPPED - 1)
    reader.buffer_updated(4)
    assert isinstance(reader.get_buffer().obj, bytearray)


@pytest.mark.parametrize("keeper", ["thread", "loop"])
@pytest.mark.parametrize("kind", ["stream", "nng"])
async def test_the_heartbeats_connect_again_after_a_break(kind: str, keeper: str) -> None:
    """The listener drops the heartbeat connection: the C thread finds it broken (a
    stream) or the pipe goes (NNG), or the event loop sees the connection end (as in a
    worker), the keeper (a watchdog thread, or that loop) connects again, and the
    heartbeats go on, proven as the worker's."""
    t = ExtTransport("abstract") if kind == "nng" else StreamTransport("abstract")
    own = "stream+abstract://beating" if kind == "stream" else "abstract://beating"
    inbox = Inbox()
    beats = NativeBeats(t.address, own, PERIOD / 4, threading.get_native_id(), TIMEOUT)
    stop = threading.Event()
    watchdog = threading.Thread(target=beats.watch, args=(stop,), name="test-watchdog")
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(t.serve, inbox.deliver)
                await anyio.to_thread.run_sync(beats.renew)  # blocks for its handshake
                first = beats.beat
                assert first is not None
                await inbox.take(2)
                if keeper == "thread":
                    watchdog.start()
                else:
                    tg.start_soon(beats.keep)
                if isinstance(t, StreamTransport):
                    for conn in list(t._inbound):
                        conn.abort()
                else:
                    for pipe in t._box.sock.pipes:
                        pipe.close()
                while beats.beat is first or beats.beat is None:
                    await inbox.take(1)  # beats still come while a new connection is made
                [frame] = await inbox.take(1)
                assert frame == _wire.join(_wire.encode(_wire.Heartbeat(own, os.getpid())))
                assert inbox.peers[-1] == own
                if kind == "stream" and keeper == "thread":
                    # the watchdog renews a broken connection only; the loop sees the
                    # listener's end itself, and may replace the connection before the
                    # C thread wrote to it again (under load, once: not broken yet)
                    assert first.broken and first.error in (errno.EPIPE, errno.ECONNRESET)
                tg.cancel_scope.cancel()
    finally:
        stop.set()
        beats.close()
        if watchdog.is_alive():
            await anyio.to_thread.run_sync(watchdog.join)
        t.close()
    assert beats.beat is None


async def test_closing_the_heartbeats_ends_the_loop_that_keeps_them() -> None:
    """``close()`` while the event loop waits on the heartbeat connection (a worker's
    exit, or its adoption by another controller): the wait ends at once, without
    connecting again, and the connection is closed, so the listener sees it end."""
    t = StreamTransport("abstract")
    own = "stream+abstract://closing"
    inbox = Inbox()
    beats = NativeBeats(t.address, own, PERIOD / 4, threading.get_native_id(), TIMEOUT)
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(t.serve, inbox.deliver)
                await anyio.to_thread.run_sync(beats.renew)
                first = beats.beat
                assert first is not None
                await inbox.take(2)
                ended = anyio.Event()

                async def keep() -> None:
                    await beats.keep()
                    ended.set()

                tg.start_soon(keep)
                await anyio.wait_all_tasks_blocked()
                fd = beats._watched
                assert fd >= 0  # it waits on the connection
                inode = os.fstat(fd).st_ino
                beats.close()
                await ended.wait()
                assert beats.beat is None and beats._watched == -1
                try:  # the connection's descriptor is closed (or the number reused)
                    assert os.fstat(fd).st_ino != inode
                except OSError as exc:
                    assert exc.errno == errno.EBADF
                tg.cancel_scope.cancel()
    finally:
        beats.close()
        t.close()
