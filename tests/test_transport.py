"""Conformance suite that every Transport implementation must pass, on both backends."""

from __future__ import annotations

import array
import gc
import math
import os
import select
import socket
import struct
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pynng
import pytest

from amesh import _identity, _wire
from amesh._native import _ext
from amesh._transport import (
    Frame,
    StreamTransport,
    Transport,
    TransportClosed,
    _auth,
    _nng_pipes,
    heartbeat_sender,
    ipc_dir,
    open_transport,
)
from amesh._transport import _stream_framing as wire
from amesh._transport._ext import ExtTransport
from amesh._transport._tags import dial_part, tag_of

pytestmark = pytest.mark.anyio


class AnyioStreamTransport(StreamTransport):
    """The stream transport's anyio path, also on asyncio."""

    fast_asyncio = False


class PyStreamTransport(StreamTransport):
    """The stream transport without the C extension: the pure-Python fallback."""

    accelerated = False


class PynngTransport(ExtTransport):
    """The NNG transport without the C extension: pynng's own I/O (the fallback)."""

    accelerated = False


class Impl:
    """One implementation under test, and a raw peer that speaks its wire protocol."""

    def __init__(self, cls: Callable[..., Transport], stream: bool) -> None:
        self.cls = cls
        self.stream = stream

    def nowhere(self) -> str:
        """An address nobody listens on (yet): a link to it fills up and stays full."""
        if self.stream:
            return wire.fresh_address("abstract")
        return _nng_pipes.fresh_address("abstract", "")

    @asynccontextmanager
    async def raw_sender(self, addr: str, proven: bool = True) -> AsyncIterator[RawPeer]:
        """A foreign peer that sends frames to ``addr``: one of this job that speaks the
        handshake by hand (``proven``), or one that skips it."""
        if not self.stream:
            gone = threading.Event()
            with pynng.Push0() as push:
                push.add_post_pipe_remove_cb(lambda pipe: gone.set())
                push.dial(dial_part(addr), block=True)
                if proven:
                    push.send(_auth.hello(addr, "raw"))
                yield RawPeer(push.send, gone)
            return
        family, sockaddr = wire.parse_address(addr)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(sockaddr)
            # the listener may run on this thread's event loop: wait for it elsewhere
            challenge = await anyio.to_thread.run_sync(recv_exact, sock, _auth.CHALLENGE_LEN)
            if proven:
                sock.sendall(_auth.answer(challenge, addr, "raw"))
            yield RawPeer(lambda frame: sock.sendall(struct.pack("<I", len(frame)) + frame), sock)

    @asynccontextmanager
    async def raw_receiver(self, addr: str) -> AsyncIterator[Callable[[], Any]]:
        """A foreign peer listening on ``addr``; yields ``await take()`` for a frame."""
        if not self.stream:
            async with nng_receiver(addr) as take_nng:
                yield take_nng
            return
        family, sockaddr = wire.parse_address(addr)
        tx, rx = anyio.create_memory_object_stream[bytes](math.inf)
        reader = wire.Reader(2**31, lambda frame: tx.send_nowait(bytes(frame)))

        async def accept(lsock: socket.socket) -> None:
            """Take one connection, challenge it, and read its frames."""
            await anyio.wait_readable(lsock)
            conn, _ = lsock.accept()
            with conn:
                conn.setblocking(False)
                gate = _auth.Gate(addr)
                conn.sendall(gate.challenge)
                rest = None
                while rest is None:
                    await anyio.wait_readable(conn)
                    n = conn.recv_into(gate.get_buffer())
                    assert n, "the link closed its connection"
                    rest = gate.buffer_updated(n)
                reader.get_buffer()[: len(rest)] = rest
                reader.buffer_updated(len(rest))
                while True:
                    await anyio.wait_readable(conn)
                    n = conn.recv_into(reader.get_buffer())
                    assert n, "the link closed its connection"
                    reader.buffer_updated(n)

        with socket.socket(family, socket.SOCK_STREAM) as lsock:
            lsock.bind(sockaddr)
            lsock.listen()
            async with anyio.create_task_group() as tg:
                tg.start_soon(accept, lsock)
                yield rx.receive
                tg.cancel_scope.cancel()


class RawPeer:
    """What :meth:`Impl.raw_sender` yields: call it with a frame to send it."""

    def __init__(self, send: Callable[[bytes], Any], ends: socket.socket | threading.Event):
        self._send = send
        self._ends = ends

    def __call__(self, frame: bytes) -> None:
        self._send(frame)

    async def closed(self) -> None:
        """Wait until the listener has closed the connection (or NNG pipe)."""
        ends = self._ends
        if isinstance(ends, threading.Event):
            assert await anyio.to_thread.run_sync(ends.wait, 10), "the pipe is still open"
            return
        ends.setblocking(False)
        while True:
            await anyio.wait_readable(ends)
            try:
                if not ends.recv(4096):
                    return
            except ConnectionResetError:
                return


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking ``sock``."""
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        assert got, "the peer closed the connection"
        data += got
    return data


IMPLS = [
    pytest.param(Impl(PynngTransport, False), id="ext-pynng"),
    pytest.param(Impl(ExtTransport, False), id="ext"),
    pytest.param(Impl(StreamTransport, True), id="stream"),
    pytest.param(Impl(AnyioStreamTransport, True), id="stream-anyio"),
    pytest.param(Impl(PyStreamTransport, True), id="stream-python"),
]


class Factory:
    """Makes transports of the implementation under test; the test closes them."""

    def __init__(self, impl: Impl) -> None:
        self.impl = impl
        self.made: list[Transport] = []

    def __call__(self, scheme: str = "abstract", **kwargs: Any) -> Transport:
        t: Transport = self.impl.cls(scheme, **kwargs)
        self.made.append(t)
        return t


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Impl:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
async def make(impl: Impl) -> AsyncIterator[Factory]:
    """Transports of the implementation under test, closed inside the event loop."""
    factory = Factory(impl)
    yield factory
    for t in factory.made:
        t.close()


@asynccontextmanager
async def nng_receiver(
    listen: str, tls: Any = None, target: str | None = None
) -> AsyncIterator[Callable[[], Any]]:
    """A raw Pull0 listening on ``listen`` (with ``tls``, a pynng TLSConfig, if given)
    that checks the hello of each pipe as the listener at ``target`` (default:
    ``listen``) would; yields ``await take()`` for a frame."""
    with pynng.Pull0(tls_config=tls) as pull:
        pull.listen(listen)
        hellos = _auth.HelloCheck(target or listen)
        proven: set[int] = set()

        async def take() -> bytes:
            while True:
                try:
                    msg = pull.recv_msg(block=False)
                except pynng.TryAgain:
                    await anyio.wait_readable(pull.recv_fd)
                    continue
                if msg.pipe.id in proven:
                    return msg.bytes  # type: ignore[no-any-return]
                hellos.check(msg.bytes)  # the first message of a pipe
                proven.add(msg.pipe.id)

        yield take


class Inbox:
    """Collects what a transport delivers: copies, and the frames as delivered."""

    def __init__(self) -> None:
        self._tx, self._rx = anyio.create_memory_object_stream[bytes](math.inf)
        self.kept: list[Any] = []
        #: the sender each frame came from, as the transport proved it
        self.peers: list[str] = []

    def deliver(self, frame: bytes, peer: str) -> None:
        self.kept.append(frame)
        self.peers.append(peer)
        self._tx.send_nowait(bytes(frame))

    async def take(self, n: int) -> list[bytes]:
        return [await self._rx.receive() for _ in range(n)]


async def serve_until_closed(t: Transport, deliver: Callable[[Any, str], None]) -> None:
    with pytest.raises(TransportClosed):
        await t.serve(deliver)


class Lost:
    """A lost handler that records what it hears, and lets a test wait for it."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, str]] = []
        self._heard = anyio.Event()

    def __call__(self, addr: str, why: str) -> None:
        self.reports.append((addr, why))
        self._heard.set()

    async def wait(self) -> None:
        await self._heard.wait()
        self._heard = anyio.Event()


def fill(t: Transport, addr: str, limit: int = 1_000_000) -> int:
    """try_send until the link to ``addr`` is full; the count that went in."""
    for i in range(limit):
        if not t.try_send(addr, b"f" * 1024):
            return i
    raise AssertionError(f"the link to {addr} took {limit} frames and is not full")


# -- ordering, sizes, content ------------------------------------------------------------


async def test_ordering(make: Factory) -> None:
    a, b, inbox = make(), make(), Inbox()
    n = 10_000
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            for i in range(n):
                frame = i.to_bytes(4, "little") + b"x" * 60
                if i % 2 or not a.try_send(b.address, frame):
                    await a.send(b.address, frame)
            got = await inbox.take(n)
            tg.cancel_scope.cancel()
    assert [int.from_bytes(f[:4], "little") for f in got] == list(range(n))
    # every frame is delivered with the address its sender proved it speaks for
    assert set(inbox.peers) == {a.address}
    assert a.statistics().frames_sent == n
    assert a.statistics().bytes_sent == 64 * n
    assert a.statistics().peers == 1
    assert b.statistics().frames_received == n
    assert b.statistics().bytes_received == 64 * n


async def test_large_message(make: Factory) -> None:
    a, b, inbox = make(), make(), Inbox()
    big = bytes(range(256)) * (64 * 1024 * 1024 // 256)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, big)
            await a.send(b.address, b"after")
            got = await inbox.take(2)
            tg.cancel_scope.cancel()
    assert len(got[0]) == len(big)
    assert got[0] == big
    assert got[1] == b"after"


async def test_delivered_frames_decode_and_stay_valid(make: Factory) -> None:
    """What ``deliver`` gets decodes with the wire schema, and it and views into it
    (out-of-band buffers) can be kept after the transport is gone."""
    a, b, inbox = make(), make(), Inbox()
    blobs = [bytes([i]) * (i * 100) for i in range(50)]
    envs = [_wire.Reply(i, 0, b"p", [len(blob)]) for i, blob in enumerate(blobs)]
    frames = [_wire.encode(e, [memoryview(x)]) for e, x in zip(envs, blobs)]
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            for frame in frames:
                await a.send(b.address, frame)
            await inbox.take(len(frames))
            tg.cancel_scope.cancel()
    decoded = [_wire.decode(f) for f in inbox.kept]
    views = [bufs[0] for _, bufs in decoded]
    del decoded
    b.close()
    inbox.kept.clear()
    assert [bytes(v) for v in views] == blobs


async def test_multipart_frame(make: Factory) -> None:
    """A frame given as parts arrives as one frame, the parts back to back."""
    a, b, inbox = make(max_frame=10), make(), Inbox()
    with anyio.fail_after(30):
        with pytest.raises(ValueError, match="11 bytes"):
            a.try_send(b.address, [b"x" * 6, memoryview(b"y" * 5)])
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, [b"ab", memoryview(b"cd"), memoryview(bytearray(b"ef")), b""])
            await a.send(b.address, [])
            assert await inbox.take(2) == [b"abcdef", b""]
            tg.cancel_scope.cancel()
    assert a.statistics().bytes_sent == 6


async def test_bad_frames(make: Factory) -> None:
    """Zero-length and garbage frames are delivered as they are; nothing breaks."""
    a, b, inbox = make(), make(), Inbox()
    garbage = [b"", b"\x00", b"AM", b"AM\x01\xff\xff", bytes(range(256)) * 3, b""]
    good = _wire.join(_wire.encode(_wire.Reply(7, 1, b"ok")))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            for frame in garbage:
                await a.send(b.address, frame)
            await a.send(b.address, good)
            got = await inbox.take(len(garbage) + 1)
            # The same from a foreign, raw peer.
            async with make.impl.raw_sender(b.address) as raw_send:
                for frame in garbage:
                    raw_send(frame)
                raw_send(good)
                got += await inbox.take(len(garbage) + 1)
            tg.cancel_scope.cancel()
    assert got == 2 * [*garbage, good]
    for frame in inbox.kept[: len(garbage)]:
        with pytest.raises(_wire.BadFrame):
            _wire.decode(frame)
    assert _wire.decode(inbox.kept[-1])[0] == _wire.Reply(7, 1, b"ok")


async def test_max_frame(make: Factory) -> None:
    a, b, inbox = make(max_frame=1000), make(), Inbox()
    assert a.max_frame == 1000
    with anyio.fail_after(30):
        with pytest.raises(ValueError, match="1001 bytes"):
            a.try_send(b.address, b"x" * 1001)
        with pytest.raises(ValueError, match="1001 bytes"):
            await a.send(b.address, b"x" * 1001)
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, b"y" * 1000)
            assert await inbox.take(1) == [b"y" * 1000]
            tg.cancel_scope.cancel()
    assert a.statistics().frames_sent == 1


# -- peers going away, closing -----------------------------------------------------------


async def test_peer_death(make: Factory) -> None:
    a, b, c, inbox = make(), make(), make(), Inbox()
    lost = Lost()
    a.set_lost_handler(lost)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, b"hello")
            assert await inbox.take(1) == [b"hello"]
            tg.cancel_scope.cancel()
        b.close()
        await lost.wait()  # the link broke, and is dropped
        assert a.statistics().peers == 0
        # Sends to the dead peer dial afresh, fill the link and then wait (for as long
        # as a first connect may take); none fails or crashes.
        fill(a, b.address)
        with anyio.move_on_after(0.2):
            await a.send(b.address, b"maybe")
        a.forget(b.address)
        assert a.statistics().peers == 0
        # The transport still works with others.
        async with anyio.create_task_group() as tg:
            tg.start_soon(c.serve, inbox.deliver)
            await a.send(c.address, b"still here")
            assert await inbox.take(1) == [b"still here"]
            tg.cancel_scope.cancel()


async def test_close_while_busy(make: Factory) -> None:
    """close() ends a running serve() and a send() waiting on a full link."""
    a, b, sink = make(), make(), make.impl.nowhere()
    ended: dict[str, BaseException | None] = {}

    async def run(name: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            await fn(*args)
            ended[name] = None
        except TransportClosed as exc:
            ended[name] = exc

    fill(a, sink)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "serve", a.serve, Inbox().deliver)
            tg.start_soon(run, "send", a.send, sink, b"blocked")
            await anyio.wait_all_tasks_blocked()
            a.close()
    assert set(ended) == {"serve", "send"}
    assert isinstance(ended["send"], TransportClosed)
    with pytest.raises(TransportClosed):
        a.try_send(b.address, b"x")
    with pytest.raises(TransportClosed):
        await a.send(b.address, b"x")
    a.close()  # idempotent


async def test_close_while_delivering(make: Factory) -> None:
    """Closing from inside ``deliver`` ends serve() without a crash."""
    a, b = make(), make()
    seen: list[bytes] = []

    def deliver(frame: bytes, peer: str) -> None:
        seen.append(bytes(frame))
        b.close()

    with anyio.fail_after(30):
        for i in range(100):
            await a.send(b.address, bytes([i]))
        with pytest.raises(TransportClosed):
            await b.serve(deliver)
    assert seen[0] == b"\x00"


async def test_lost_links_are_reported(make: Factory) -> None:
    """The end of an established link is reported at once, and the link dropped; one
    closed by forget() or close() is not reported."""
    a, b, c, inbox = make(), make(), make(), Inbox()
    lost = Lost()
    a.set_lost_handler(lost)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for t in (a, b, c):
                tg.start_soon(serve_until_closed, t, inbox.deliver)
            await a.send(b.address, b"to b")
            await a.send(c.address, b"to c")
            assert sorted(await inbox.take(2)) == [b"to b", b"to c"]
            a.forget(c.address)  # reports nothing, even when c goes
            c.close()
            b.close()
            await lost.wait()
            assert [addr for addr, _ in lost.reports] == [b.address]
            assert a.statistics().peers == 0
            tg.cancel_scope.cancel()
    a.close()
    assert len(lost.reports) == 1


async def test_a_listener_that_never_comes_is_reported(make: Factory) -> None:
    """A first connect is tried for a short while (the listener may not listen yet),
    then reported; senders waiting on the link are woken."""
    a, addr = make(), make.impl.nowhere()
    lost = Lost()
    a.set_lost_handler(lost)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.serve, Inbox().deliver)
            a.try_send(addr, b"lost")
            await lost.wait()
            tg.cancel_scope.cancel()
    assert lost.reports[0][0] == addr and "connect" in lost.reports[0][1], lost.reports
    assert a.statistics().peers == 0


@pytest.mark.parametrize("proof", ["none", "wrong key", "garbage"])
async def test_unproven_peers_are_refused(make: Factory, proof: str) -> None:
    """A peer that does not prove it holds the job key is refused and counted; nothing
    it sent is delivered, and proven peers go on."""
    a, b, inbox = make(), make(), Inbox()
    frame = _wire.join(_wire.encode(_wire.Reply(1, 0, b"forged")))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            if proof == "wrong key":
                key = _identity.job_key()
                _identity.adopt_key(bytes(32))
                try:
                    async with make.impl.raw_sender(b.address) as raw:
                        _identity.adopt_key(key)
                        raw(frame)
                        await raw.closed()
                finally:
                    _identity.adopt_key(key)
            else:
                async with make.impl.raw_sender(b.address, proven=False) as raw:
                    raw(b"\xff" * 100 if proof == "garbage" else frame)
                    await raw.closed()
            assert b.statistics().auth_refused >= 1
            await a.send(b.address, b"proven")
            assert await inbox.take(1) == [b"proven"]
            tg.cancel_scope.cancel()
    assert [bytes(f) for f in inbox.kept] == [b"proven"]
    assert b.statistics().frames_received == 1


# -- cancellation ------------------------------------------------------------------------


async def test_cancel_serve(make: Factory) -> None:
    a, b, inbox = make(), make(), Inbox()
    with anyio.fail_after(30):
        with anyio.move_on_after(0.05) as scope:
            await b.serve(inbox.deliver)
        assert scope.cancelled_caught
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await b.serve(inbox.deliver)
        # Serving again after a cancellation loses nothing.
        await a.send(b.address, b"one")
        with anyio.move_on_after(0.05):
            await b.serve(inbox.deliver)
        await a.send(b.address, b"two")
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            assert await inbox.take(2) == [b"one", b"two"]
            tg.cancel_scope.cancel()


async def test_cancel_send(make: Factory) -> None:
    a, addr = make(), make.impl.nowhere()
    got: list[bytes] = []
    with anyio.fail_after(30):
        queued = fill(a, addr)
        with anyio.move_on_after(0.05) as scope:
            await a.send(addr, b"cancelled")
        assert scope.cancelled_caught
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await a.send(addr, b"cancelled")
        # Two waiters on one full link, both cancelled.
        with anyio.move_on_after(0.05) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.send, addr, b"cancelled")
                tg.start_soon(a.send, addr, b"cancelled")
        assert scope.cancelled_caught
        # The link drains once the peer appears; a send that was cancelled never went.
        async with make.impl.raw_receiver(addr) as take:
            await a.send(addr, b"last")
            while len(got) < queued + 1:
                got.append(await take())
    assert got[-1] == b"last"
    assert b"cancelled" not in got


@pytest.mark.parametrize(
    ("sender", "receiver"),
    [(PynngTransport, ExtTransport), (ExtTransport, PynngTransport)],
    ids=["pynng-to-ext", "ext-to-pynng"],
)
async def test_implementations_interoperate(
    sender: Callable[[str], Transport], receiver: Callable[[str], Transport]
) -> None:
    """Processes may pick different implementations: the wire is the same."""
    a, b, inbox = sender("abstract"), receiver("abstract"), Inbox()
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.serve, inbox.deliver)
                for i in range(1000):
                    await a.send(b.address, i.to_bytes(2, "little"))
                await a.send(b.address, b"")
                got = await inbox.take(1001)
                tg.cancel_scope.cancel()
        assert got == [i.to_bytes(2, "little") for i in range(1000)] + [b""]
    finally:
        a.close()
        b.close()


# -- the stream transport ----------------------------------------------------------------


@pytest.fixture(
    params=[
        pytest.param(StreamTransport, id="stream"),
        pytest.param(AnyioStreamTransport, id="stream-anyio"),
        pytest.param(PyStreamTransport, id="stream-python"),
    ]
)
async def make_stream(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    """Stream transports (both I/O paths), closed inside the event loop."""
    factory = Factory(Impl(request.param, True))
    yield factory
    for t in factory.made:
        t.close()


async def test_a_turns_frames_keep_their_order(make_stream: Factory) -> None:
    """Small frames written after a turn's first wait for its end (asyncio batches
    them); a large one sent meanwhile goes after them. Closing in the same turn loses
    none of them: a closed link still writes what it took before."""
    a, b, inbox = make_stream(), make_stream(), Inbox()
    big = memoryview(bytearray(b"B" * (256 * 1024)))
    frames: list[Frame] = []
    for i in range(200):
        frames.append(i.to_bytes(4, "little") + b"s" * (i % 50))
        if i in (7, 150):
            frames.append([big])
    expected = [b"B" * len(big) if isinstance(f, list) else f for f in frames]
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, b"first")  # connected: later frames go by the link
            assert await inbox.take(1) == [b"first"]
            for frame in frames:  # one turn: no await in between
                assert a.try_send(b.address, frame)
            big[:1] = b"X"  # the caller may change its buffer once the send returned
            a.close()
            got = await inbox.take(len(frames))
            tg.cancel_scope.cancel()
    assert [bytes(f) for f in got] == expected


@pytest.mark.parametrize("scheme", ["abstract", "ipc", "tcp", "auto"])
async def test_stream_schemes(make_stream: Factory, scheme: str) -> None:
    """Every scheme works; tcp reports the real port; an ipc file goes at close."""
    a, b, inbox = make_stream(scheme), make_stream(scheme), Inbox()
    kind = "abstract" if scheme == "auto" else scheme
    assert b.address.startswith(f"stream+{kind}://")
    if scheme == "tcp":
        host, port = dial_part(b.address)[len("stream+tcp://") :].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert b.address == f"{dial_part(b.address)}/{tag_of(b.address)}"  # see _tags
    path = b.address[len("stream+ipc://") :]
    if scheme == "ipc":
        assert os.path.dirname(path) == ipc_dir() and os.path.exists(path)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, b"over " + scheme.encode())
            assert await inbox.take(1) == [b"over " + scheme.encode()]
            tg.cancel_scope.cancel()
    b.close()
    assert not os.path.exists(path)


async def test_stream_tcp_ipv6(make_stream: Factory) -> None:
    b = make_stream("tcp", host="::1")
    a, inbox = make_stream(), Inbox()
    assert b.address.startswith("stream+tcp://[::1]:")
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, b"v6")
            assert await inbox.take(1) == [b"v6"]
            tg.cancel_scope.cancel()


async def test_stream_huge_frame_in_parts(make_stream: Factory) -> None:
    """A 64 MiB frame of parts arrives whole and writable; the sender may reuse its
    buffers as soon as send returns."""
    a, b, inbox = make_stream(), make_stream(), Inbox()
    body = bytearray(bytes(range(256)) * (64 * 1024 * 1024 // 256))
    expected = b"head" + bytes(body) + b"tail"
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, [b"head", memoryview(body), memoryview(b"tail")])
            body[:] = bytes(len(body))  # reused at once: what was sent must not change
            await a.send(b.address, b"after")
            got = await inbox.take(2)
            tg.cancel_scope.cancel()
    assert got[0] == expected
    assert got[1] == b"after"
    frame = inbox.kept[0]
    assert not memoryview(frame).readonly


async def test_stream_refuses_other_addresses(make_stream: Factory) -> None:
    a = make_stream()
    for addr in ("abstract://amesh-x", "ipc:///tmp/x.sock", "tcp://127.0.0.1:1", "stream+tcp://x"):
        with pytest.raises(ValueError, match="not a stream transport address"):
            a.try_send(addr, b"x")
    with pytest.raises(ValueError, match="unknown transport scheme"):
        make_stream("udp")
    with pytest.raises(ValueError, match="max_frame"):
        make_stream(max_frame=2**32)


async def test_stream_drops_a_peer_that_breaks_the_framing(make_stream: Factory) -> None:
    """A connection that announces a frame above max_frame is closed; others go on."""
    a, b, inbox = make_stream(), make_stream(max_frame=100), Inbox()
    family, sockaddr = wire.parse_address(b.address)
    with socket.socket(family, socket.SOCK_STREAM) as raw, anyio.fail_after(30):
        raw.connect(sockaddr)
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            challenge = await anyio.to_thread.run_sync(recv_exact, raw, _auth.CHALLENGE_LEN)
            raw.sendall(
                _auth.answer(challenge, b.address, "raw")
                + struct.pack("<I", 5)
                + b"fine!"
                + struct.pack("<I", 101)
                + b"x" * 101
            )
            assert await inbox.take(1) == [b"fine!"]
            raw.setblocking(False)
            await anyio.wait_readable(raw)
            try:
                assert raw.recv(1) == b""  # closed by b
            except ConnectionResetError:
                pass
            await a.send(b.address, b"still here")
            assert await inbox.take(1) == [b"still here"]
            tg.cancel_scope.cancel()


async def test_stream_link_waits_for_a_listener_that_comes_late(make_stream: Factory) -> None:
    """A first connect is tried again while the listener is not there yet; once the
    connection broke, the link is dropped and a later send dials afresh."""
    a = make_stream()
    impl = make_stream.impl
    addr = impl.nowhere()
    lost = Lost()
    a.set_lost_handler(lost)
    with anyio.fail_after(30):
        await a.send(addr, b"early")  # nobody listens yet
        async with impl.raw_receiver(addr) as take:
            assert await take() == b"early"
        await lost.wait()  # the receiver closed its end
        assert lost.reports == [(addr, "the peer closed the connection")]
        assert a.statistics().peers == 0
        async with impl.raw_receiver(addr) as take:
            await a.send(addr, b"again")
            assert await take() == b"again"


async def test_stream_link_to_a_listener_that_is_no_amesh_one_is_reported(
    make_stream: Factory,
) -> None:
    """A listener that speaks first, but no amesh challenge (an ssh server, say): the
    link is reported lost, saying why, on every I/O path. (The anyio path's task once
    died of it: on trio that ended the run, on asyncio the link was never reported
    and its senders waited for ever.)"""
    a, addr, lost = make_stream(), make_stream.impl.nowhere(), Lost()
    a.set_lost_handler(lost)
    family, sockaddr = wire.parse_address(addr)
    with socket.socket(family, socket.SOCK_STREAM) as lsock, anyio.fail_after(30):
        lsock.bind(sockaddr)
        lsock.listen()
        lsock.setblocking(False)
        assert a.try_send(addr, b"x")
        await anyio.wait_readable(lsock)
        conn, _ = lsock.accept()
        with conn:
            conn.sendall(b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n")
            await lost.wait()
    assert lost.reports == [(addr, "the peer did not send an amesh challenge")]
    assert a.statistics().peers == 0


async def test_stream_deliver_failure_loses_nothing_else(make_stream: Factory) -> None:
    """An exception from deliver ends serve(); frames behind it wait for the next one."""
    a, b, inbox = make_stream(), make_stream(), Inbox()

    def deliver(frame: bytes, peer: str) -> None:
        if frame == b"boom":
            raise KeyError("boom")
        inbox.deliver(frame, peer)

    with anyio.fail_after(30):
        for frame in (b"1", b"boom", b"2", b"3"):
            await a.send(b.address, frame)
        with pytest.raises(KeyError, match="boom"):
            await b.serve(deliver)
        await a.send(b.address, b"4")
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, deliver)
            assert await inbox.take(4) == [b"1", b"2", b"3", b"4"]
            with pytest.raises(RuntimeError, match="already running"):
                await b.serve(deliver)
            tg.cancel_scope.cancel()


async def test_stream_forget_wakes_waiting_senders(make_stream: Factory) -> None:
    a, addr = make_stream(), make_stream.impl.nowhere()
    fill(a, addr)
    with anyio.fail_after(30):
        with pytest.RaisesGroup(pytest.RaisesExc(TransportClosed, match="link to")):
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.send, addr, b"waits")
                await anyio.wait_all_tasks_blocked()
                a.forget(addr)
    assert a.statistics().peers == 0
    assert a.try_send(addr, b"a new link")


#: A peer in a process of its own, holding the key it reads first on its stdin: it
#: answers each frame with ``re:`` and the frame, until its stdin closes.
ECHO_PEER = """
import sys

import anyio
import anyio.to_thread

from amesh import _identity
from amesh._transport import StreamTransport

_identity.adopt_key(bytes.fromhex(sys.stdin.readline()))


async def main():
    t = StreamTransport("abstract")
    print(t.address, flush=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(t.serve, lambda frame, peer: t.try_send(peer, b"re:" + bytes(frame)))
        await anyio.to_thread.run_sync(sys.stdin.read)
        tg.cancel_scope.cancel()
    t.close()


anyio.run(main)
"""


@asynccontextmanager
async def echo_peers(keys: list[bytes]) -> AsyncIterator[list[str]]:
    """An :data:`ECHO_PEER` holding each of ``keys``; yields their addresses, and
    closes their stdin (they end) and waits for them on the way out."""
    async with AsyncExitStack() as stack:
        addrs = []
        for key in keys:
            cmd = [sys.executable, "-c", ECHO_PEER]
            proc = await stack.enter_async_context(await anyio.open_process(cmd, stderr=None))
            assert proc.stdin is not None and proc.stdout is not None
            await proc.stdin.send(key.hex().encode() + b"\n")
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive()
            addrs.append(line.decode().strip())
        yield addrs


@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio-selector"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)
async def test_one_transport_after_another_each_with_its_key(anyio_backend: Any) -> None:
    """What `amesh list` does on the asyncio fast path (its loop a plain selector loop):
    a transport with one key that closes in the turn its serve() starts (the runtime
    that asks this machine's agent, when there is none), then one per controller,
    each with that controller's key: every later transport hears its peers' replies.

    (This once failed, and the key was blamed: asyncio's own server registers the
    listener with the selector and then yields once; a transport closed meanwhile
    left that registration behind, and the next listener, given the same descriptor
    number, was never watched: its peers' replies never arrived.)"""
    keys = [os.urandom(32), os.urandom(32)]
    with anyio.fail_after(60):
        async with echo_peers(keys) as peers:
            with _identity.borrowed_key(os.urandom(32)):
                first = StreamTransport("abstract")
                async with anyio.create_task_group() as tg:
                    tg.start_soon(serve_until_closed, first, Inbox().deliver)
                    await anyio.lowlevel.checkpoint()  # its serve() has started
                    first.close()
            for key, peer in zip(keys, peers):
                with _identity.borrowed_key(key), anyio.fail_after(20):
                    t, inbox = StreamTransport("abstract"), Inbox()
                    try:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(t.serve, inbox.deliver)
                            await t.send(peer, b"ping")
                            assert await inbox.take(1) == [b"re:ping"]
                            assert inbox.peers == [peer]
                            tg.cancel_scope.cancel()
                    finally:
                        t.close()


@pytest.mark.parametrize("kind", ["nng", "stream"])
async def test_heartbeat_sender(kind: str) -> None:
    """The blocking sender the worker's heartbeat thread uses, for both kinds of
    address: it proves itself, sends, drops rather than block, and dials again. It
    blocks for its handshake, so it runs in a thread here as in a worker."""
    t = ExtTransport("abstract") if kind == "nng" else StreamTransport("abstract")
    inbox = Inbox()
    sender = heartbeat_sender(t.address, own="stream+abstract://beating")

    async def send(frame: bytes) -> bool:
        return await anyio.to_thread.run_sync(sender.send, frame)

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(t.serve, inbox.deliver)
                assert await send(b"beat")
                assert await inbox.take(1) == [b"beat"]
                tg.cancel_scope.cancel()
        assert t.statistics().auth_refused == 0
    finally:
        t.close()
    if kind == "stream":
        sender.close()
        sender = heartbeat_sender(t.address)
        assert not await send(b"beat")  # nobody listens: dropped at once
        sender.close()
        addr = wire.fresh_address("abstract")
        sender = heartbeat_sender(addr)
        assert not await send(b"beat")
        async with Impl(StreamTransport, True).raw_receiver(addr) as take:
            assert await send(b"beat")  # dialled again
            with anyio.fail_after(5):
                assert await take() == b"beat"
    sender.close()
    sender.close()


def test_open_transport_picks_the_stream_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", "stream")
    t = open_transport("ipc")
    try:
        assert isinstance(t, StreamTransport)
        assert t.address.startswith("stream+ipc://")
    finally:
        t.close()
    # A worker follows its parent: a stream+ scheme means a stream transport.
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", "nng")
    t = open_transport("stream+abstract")
    t.close()
    assert isinstance(t, StreamTransport)
    # ``reach`` picks what can send to that address, whatever the default.
    t = open_transport("abstract", reach="abstract://amesh-parent")
    t.close()
    assert not isinstance(t, StreamTransport)
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", "stream")
    t = open_transport("stream+abstract", reach="abstract://amesh-parent")
    t.close()
    assert not isinstance(t, StreamTransport)
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", "nng")
    t = open_transport("abstract", reach="stream+abstract://amesh-parent")
    t.close()
    assert isinstance(t, StreamTransport)
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", "udp")
    with pytest.raises(ValueError, match="AMESH_TRANSPORT_IMPL"):
        open_transport()


# -- the extension itself ----------------------------------------------------------------


def test_ext_constants_match_pynng() -> None:
    from pynng import _nng

    assert _ext.NNG_EAGAIN == _nng.lib.NNG_EAGAIN
    assert _ext.NNG_ECLOSED == _nng.lib.NNG_ECLOSED


_EXIT_WITH_AN_OPEN_SOCKET = """
import sys, pynng
import amesh._transport._ext  # amesh's NNG transports: what a worker or agent imports

real = pynng.nng.lib


class Spy:
    def __getattr__(self, name):
        return getattr(real, name)

    def nng_fini(self):
        print("nng_fini", flush=True)
        real.nng_fini()


pynng.nng.lib = Spy()
push = pynng.Push0()
push.dial(sys.argv[1], block=True)
print("dialled", flush=True)
"""


def test_exit_closes_the_sockets_and_leaves_nng_to_the_kernel(tmp_path: Any) -> None:
    """A process that imported amesh's NNG transports exits with a socket still open:
    amesh closes it at exit and does not call pynng's ``nng_fini()``, whose teardown
    races with NNG's own threads (NNG 1.11 aborted with "panic: pthread_mutex_lock:
    Invalid argument" from ``tls_reap`` at about one exit in 400 with TLS links)."""
    import subprocess
    import sys

    gone = threading.Event()
    with pynng.Pull0() as pull:
        pull.add_post_pipe_remove_cb(lambda pipe: gone.set())
        addr = f"ipc://{tmp_path}/exit.sock"
        pull.listen(addr)
        out = subprocess.run(
            [sys.executable, "-c", _EXIT_WITH_AN_OPEN_SOCKET, addr],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout == "dialled\n"  # and no nng_fini
        assert gone.wait(10)


def test_ext_message_is_a_writable_buffer_that_outlives_the_frame() -> None:
    with pynng.Pull0() as pull, pynng.Push0() as push:
        rx = _ext.Receiver(pull.socket.id, 4)
        rx.close()
        with pytest.raises(RuntimeError, match="closed"):
            rx.start()
        rx = _ext.Receiver(pull.socket.id, 4)
        rx.start()
        addr = "inproc://amesh-test-ext-message"
        pull.listen(addr)
        push.dial(addr)
        assert _ext.send(push.socket.id, b"abc")
        assert select.select([rx.fileno()], [], [], 10)[0]
        (msg,) = msgs = rx.drain(8)
        view = memoryview(msg)
        assert not view.readonly and len(msg) == 3 and bytes(view) == b"abc"
        view[0] = ord("x")  # the receiver owns the message: arrays on it may be mutated
        del msg, msgs
        assert view.tobytes() == b"xbc"  # the view keeps the message alive
        rx.close()
        with pytest.raises(_ext.NngError) as info:
            rx.drain(8)
        assert info.value.errno == _ext.NNG_ECLOSED
        with pytest.raises(TypeError):
            _ext.Message()
    with pytest.raises(_ext.NngError):
        _ext.send(push.socket.id, b"closed")


def test_ext_receiver_queue_is_bounded() -> None:
    """A full queue stops receiving (NNG buffers the rest) until it is drained."""
    with pynng.Pull0(recv_buffer_size=2) as pull, pynng.Push0(send_buffer_size=64) as push:
        rx = _ext.Receiver(pull.socket.id, 2)
        rx.start()
        addr = "inproc://amesh-test-ext-bounded"
        pull.listen(addr)
        push.dial(addr)
        sent = [bytes([i]) * i for i in range(40)]
        for frame in sent:
            assert _ext.send(push.socket.id, frame)
        got: list[bytes] = []
        while len(got) < len(sent):
            assert select.select([rx.fileno()], [], [], 10)[0]
            batch = rx.drain(100)
            assert len(batch) <= 2
            got += [bytes(m) for m in batch]
        assert got == sent
        rx.close()


async def test_ext_copies_a_large_frame_off_the_event_loop() -> None:
    """Copying a large frame into NNG happens in a worker thread: the event loop runs
    other tasks meanwhile, and a frame sent after it still arrives after it."""
    from amesh._transport._ext import THREAD_SEND, ExtTransport

    a, b, inbox = ExtTransport(), ExtTransport(), Inbox()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.serve, inbox.deliver)
                await a.send(b.address, b"first")  # the link is up
                assert await inbox.take(1) == [b"first"]
                tg.start_soon(tick)
                await anyio.lowlevel.checkpoint()
                before = ticks
                await a.send(b.address, bytes(THREAD_SEND))
                assert ticks > before  # the loop ran while the frame was copied
                assert a.try_send(b.address, b"after")
                got = await inbox.take(2)
                tg.cancel_scope.cancel()
        assert len(got[0]) == THREAD_SEND and got[1] == b"after"
    finally:
        a.close()
        b.close()


async def test_the_default_stream_transport_reads_frames_in_c() -> None:
    from amesh._transport._stream_aio import AioInbound

    a, b, inbox = StreamTransport("abstract"), StreamTransport("abstract"), Inbox()
    try:
        assert isinstance(a.reader(lambda frame: None), _ext.FrameReader)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.serve, inbox.deliver)
                await a.send(b.address, b"first")
                assert await inbox.take(1) == [b"first"]
                [conn] = b._inbound
                if isinstance(conn, AioInbound):  # asyncio: the loop reads into C itself
                    assert conn._transport is not None
                    assert isinstance(conn._transport.get_protocol(), _ext.FrameReader)
                else:
                    assert isinstance(conn.reader, _ext.FrameReader)
                assert a.try_send(b.address, b"second")
                assert await inbox.take(1) == [b"second"]
                tg.cancel_scope.cancel()
    finally:
        a.close()
        b.close()
    fallback = PyStreamTransport("abstract")
    try:
        reader = fallback.reader(lambda frame: None)
        assert isinstance(reader, wire.Reader) and reader._cut is wire.cut_frames_py
    finally:
        fallback.close()


# -- the asyncio connection's writer: Python (AioConn) and C (FastConn) ------------------


class FakeLoop:
    """Keeps what ``call_soon`` was given; the test ends the turn itself."""

    def __init__(self) -> None:
        self.soon: list[Callable[[], None]] = []

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.soon.append(fn)

    def end_turn(self) -> None:
        soon, self.soon = self.soon, []
        for fn in soon:
            fn()


class FakeLink:
    """What a connection asks of its :class:`AioLink`."""

    def __init__(self, small: int | None) -> None:
        self._loop = FakeLoop()
        self.batching = True
        self.small = small
        self.closed = False
        self.pending: list[Any] = []
        self.pending_bytes = 0
        self.conn: Any = None
        self.fast: Any = None
        self.failed: list[str] = []

    def wake(self) -> None:
        pass

    def fail(self, why: str) -> None:
        self.failed.append(why)


class FakeTransport:
    """A socket's asyncio transport: what the kernel did not take waits in ``buffer``
    (written out by :meth:`drain`, as the loop would once the socket has room)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.closing = False

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return len(self.buffer)

    def write(self, data: Any) -> None:
        self.buffer += bytes(data)

    def writelines(self, parts: list[Any]) -> None:
        for part in parts:
            self.write(part)

    def abort(self) -> None:
        self.closing = True
        self.buffer = b""

    def drain(self) -> None:
        self.sock.setblocking(True)
        self.sock.sendall(self.buffer)
        self.buffer = b""


def _writer_kinds() -> list[Any]:
    from amesh._transport._stream_aio import AioConn, _FastConn

    return [pytest.param(AioConn, id="python"), pytest.param(_FastConn, id="c")]


def _frames_in(data: bytes) -> list[bytes]:
    """The length-prefixed frames of ``data``, which must end with a whole one."""
    frames, pos = [], 0
    while pos < len(data):
        (n,) = wire.HEADER.unpack_from(data, pos)
        frames.append(data[pos + wire.HLEN : pos + wire.HLEN + n])
        pos += wire.HLEN + n
    assert pos == len(data), "a frame was cut"
    return frames


class Writer:
    """One connection of the kind under test over a socket pair, and its peer's end."""

    def __init__(self, kind: Any, sndbuf: int = 0) -> None:
        from amesh._transport._stream_io import BATCH_FRAME

        self.fast = kind.__name__ == "FastConn"
        self.link = FakeLink(BATCH_FRAME if self.fast else None)
        ours, self.peer = socket.socketpair()
        if sndbuf:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        ours.setblocking(False)
        self.peer.setblocking(False)
        self.sock = ours
        self.transport = FakeTransport(ours)
        self.conn = kind(self.link, b"")
        self.conn.connection_made(self.transport)
        assert self.link.conn is self.conn
        assert (self.link.fast is self.conn) == self.fast
        self.reader = _ext.FrameReader(
            1 << 20, lambda frame: None, wire._frame_memory, wire.BadStream
        )

    def read_something(self) -> None:
        """A read, as an inbound connection's: the C reader's, or the Python one's."""
        if self.fast:
            self.reader.get_buffer(-1)
            self.reader.buffer_updated(0)
        else:
            from amesh._transport import _stream_aio

            _stream_aio._reads += 1

    def send(self, frame: bytes) -> bool:
        """As StreamTransport.try_send: False if the connection broke."""
        if self.fast:
            taken = self.conn.send(frame)
            if taken:
                return bool(taken > 0)
        ok: bool = self.conn.write([wire.HEADER.pack(len(frame)), frame], len(frame) + wire.HLEN)
        return ok

    def received(self) -> list[bytes]:
        """The frames that left the connection: what the peer can read now, then what
        waits in the transport for room in the socket."""
        data = b""
        while True:
            try:
                got = self.peer.recv(1 << 20)
            except BlockingIOError:
                break
            if not got:
                break
            data += got
        data, self.transport.buffer = data + self.transport.buffer, b""
        return _frames_in(data)

    def close(self) -> None:
        self.sock.close()
        self.peer.close()


@pytest.mark.parametrize("kind", _writer_kinds())
def test_a_frame_after_a_read_goes_at_once_later_ones_at_the_turns_end(kind: Any) -> None:
    """A frame goes to the kernel at once when something was read since the
    connection's last one went at once (a reply, a call after a reply); the frames
    after it in the turn go together when it ends."""
    w = Writer(kind)
    try:
        w.read_something()
        assert w.send(b"reply")
        assert w.received() == [b"reply"] and not w.link._loop.soon
        assert w.send(b"two") and w.send(b"three")
        assert w.received() == []  # they wait for the end of the turn
        assert len(w.link._loop.soon) == 1
        w.link._loop.end_turn()
        assert w.received() == [b"two", b"three"]
        w.read_something()
        assert w.send(b"after a read")
        assert w.received() == [b"after a read"]
        assert w.send(b"no read since")  # the next turn, with nothing read: it waits
        assert w.received() == []
        w.link._loop.end_turn()
        assert w.received() == [b"no read since"]
        w.link.batching = False
        if w.fast:
            w.conn.batching = False
        assert w.send(b"unbatched") and w.send(b"unbatched too")
        assert w.received() == [b"unbatched", b"unbatched too"] and not w.link._loop.soon
        assert w.link.failed == []
    finally:
        w.close()


@pytest.mark.parametrize("kind", _writer_kinds())
def test_a_large_frame_goes_after_what_waits_and_a_full_batch_goes_at_once(kind: Any) -> None:
    from amesh._transport._stream_io import BATCH_BYTES, BATCH_FRAME

    w = Writer(kind)
    try:
        w.read_something()
        small = [bytes([i]) * 100 for i in range(5)]
        large = b"L" * (BATCH_FRAME + 1)
        for frame in small[:3]:
            assert w.send(frame)
        assert w.send(large)
        assert w.send(small[3])
        got = w.received()
        assert got == [small[0], small[1], small[2], large]  # what waited went first
        w.link._loop.end_turn()
        assert w.received() == [small[3]]
        # a batch of BATCH_BYTES goes at once, before the turn ends
        w.read_something()
        frames = [
            i.to_bytes(4, "little") * (BATCH_FRAME // 4)
            for i in range(BATCH_BYTES // BATCH_FRAME + 1)
        ]
        for frame in frames:
            assert w.send(frame)
        got = w.received()
        assert got == frames[: len(got)] and len(got) == len(frames)
    finally:
        w.close()


@pytest.mark.parametrize("kind", _writer_kinds())
def test_what_the_kernel_does_not_take_waits_in_the_transport_in_order(kind: Any) -> None:
    w = Writer(kind, sndbuf=4096)
    try:
        frames = [i.to_bytes(4, "little") * 1000 for i in range(200)]  # 4 KB each
        for frame in frames:
            w.read_something()  # each goes at once: into the socket, or behind it
            assert w.send(frame)
        assert w.transport.get_write_buffer_size() > 0  # the socket took only some
        drainer = threading.Thread(target=w.transport.drain)  # as the loop would
        drainer.start()
        w.peer.setblocking(True)
        w.peer.settimeout(30)
        data = b""
        want = sum(len(f) + wire.HLEN for f in frames)
        while len(data) < want:
            data += w.peer.recv(1 << 20)
        drainer.join(30)
        assert not drainer.is_alive()
        assert _frames_in(data) == frames
        assert w.link.failed == []
    finally:
        w.close()


@pytest.mark.parametrize("kind", _writer_kinds())
def test_a_write_to_a_broken_connection_aborts_it(kind: Any) -> None:
    w = Writer(kind)
    try:
        w.peer.close()
        w.read_something()
        assert not w.send(b"into the void")
        assert w.transport.closing  # aborted (the link then fails, and drops the connection)
    finally:
        w.sock.close()


@pytest.mark.parametrize("kind", _writer_kinds())
def test_frames_waiting_for_the_turns_end_never_reach_an_aborted_connection(kind: Any) -> None:
    """An aborted connection's fd may be reused at once: what waited is dropped, and the
    link fails, rather than written to whatever the number names now."""
    w = Writer(kind)
    try:
        w.read_something()
        assert w.send(b"first") and w.send(b"waits")
        assert w.received() == [b"first"]
        w.transport.closing = True  # aborted meanwhile
        w.link._loop.end_turn()
        assert w.link.failed == ["the connection broke"]
        assert w.received() == []  # nothing was written
    finally:
        w.close()


def test_the_c_writer_leaves_what_it_cannot_take_untouched() -> None:
    """FrameWriter.send takes only a small bytes frame on an open, unpaused
    connection; anything else is the Python path's (0: nothing done)."""
    from amesh._transport._stream_aio import _FastConn
    from amesh._transport._stream_io import BATCH_FRAME

    w = Writer(_FastConn)
    try:
        conn = w.conn
        w.read_something()
        assert conn.send(bytearray(b"not bytes")) == 0
        assert conn.send(memoryview(b"a view")) == 0
        assert conn.send(b"x" * (BATCH_FRAME + 1)) == 0
        conn.paused = True
        assert conn.send(b"paused") == 0
        conn.paused = False
        w.transport.closing = True
        assert conn.send(b"closing") == 0
        w.transport.closing = False
        fd, conn.fd = conn.fd, -1
        assert conn.send(b"no fd") == 0
        conn.fd = fd
        assert w.received() == [] and not w.link._loop.soon and conn.batched == 0
        assert conn.send(b"x" * BATCH_FRAME) == 1
        assert w.received() == [b"x" * BATCH_FRAME]
        with pytest.raises(ValueError):
            _ext.FrameWriter(-1, 10)
    finally:
        w.close()


def test_a_receive_through_nng_counts_as_a_read_for_the_c_writer() -> None:
    """What came in through NNG (another host's frames, say) lets the next frame go
    at once too: a Receiver's drain counts as a read."""
    from amesh._transport._stream_aio import _FastConn

    w = Writer(_FastConn)
    try:
        with pynng.Pull0() as pull, pynng.Push0() as push:
            rx = _ext.Receiver(pull.socket.id, 4)
            rx.start()
            addr = "inproc://amesh-test-ext-writer-turn"
            pull.listen(addr)
            push.dial(addr)
            w.read_something()
            assert w.send(b"first") and w.send(b"waits")
            assert w.received() == [b"first"]
            w.link._loop.end_turn()
            assert w.received() == [b"waits"]
            assert _ext.send(push.socket.id, b"a call")
            assert select.select([rx.fileno()], [], [], 10)[0]
            assert [bytes(m) for m in rx.drain(8)] == [b"a call"]
            assert w.send(b"its reply")
            assert w.received() == [b"its reply"] and not w.link._loop.soon
            rx.close()
    finally:
        w.close()


@pytest.mark.parametrize("kind", ["c", "python"])
def test_a_stopped_reader_lets_go_of_a_large_frames_memory_at_once(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection lost in the middle of a large frame gives its memory back then,
    not when the garbage collector gets to the reader (a peer that announced 2 GiB
    and left would hold them)."""
    made: list[weakref.ref[array.array[int]]] = []

    def memory(size: int) -> memoryview:
        arr = array.array("B", bytes(size))
        made.append(weakref.ref(arr))
        return memoryview(arr)

    frames: list[Any] = []
    reader: Any
    if kind == "c":
        reader = _ext.FrameReader(1 << 20, frames.append, memory, wire.BadStream)
    else:
        monkeypatch.setattr(wire, "_frame_memory", memory)
        reader = wire.Reader(1 << 20, frames.append)
    data = wire.HEADER.pack(100_000) + b"x" * 10
    gc.disable()  # what goes, goes by its reference count
    try:
        buf = reader.get_buffer(-1) if kind == "c" else reader.get_buffer()
        buf[: len(data)] = data
        del buf
        reader.buffer_updated(len(data))
        assert len(made) == 1 and made[0]() is not None and frames == []
        reader.stop()
        assert made[0]() is None and reader.stopped
        reader.buffer_updated(0)  # (a late read emits nothing)
        assert frames == []
    finally:
        gc.enable()


def test_a_lost_connections_c_writer_lets_go_of_everything() -> None:
    """Once its connection is lost, the C writer holds no batch memory and no
    reference back to itself: it goes with its last reference, collector or not."""
    from amesh._transport._stream_aio import _FastConn

    w = Writer(_FastConn)
    try:
        w.read_something()
        assert w.send(b"first") and w.send(b"batched")
        assert w.conn.batched > 0 and w.conn.end_turn is not None
        conn = weakref.ref(w.conn)
        gc.disable()
        try:
            w.conn.connection_lost(None)
            assert w.link.conn is None and w.link.fast is None
            assert w.link.failed == ["the peer closed the connection"]
            assert w.conn.batched == 0 and w.conn.fd == -1 and w.conn.end_turn is None
            assert w.conn.send(b"after") == 0
            w.link._loop.end_turn()  # the turn's end still comes, finding nothing
            del w.conn
            assert conn() is None
        finally:
            gc.enable()
        assert w.received() == [b"first"]
    finally:
        w.sock.close()
        w.peer.close()


@pytest.mark.parametrize("cls", [StreamTransport, PyStreamTransport], ids=["c", "python"])
def test_a_lost_inbound_connection_goes_with_its_last_reference(cls: Any) -> None:
    """A lost inbound connection leaves no reference cycle (its reader's callbacks,
    the C reader's way back to it): it goes, with its 64 KiB buffer, as soon as
    nothing refers to it, collector or not."""
    import asyncio

    from amesh._transport._stream_aio import AioInbound

    async def main() -> None:
        owner = cls("abstract")
        ours, theirs = socket.socketpair()
        gc.disable()
        try:
            conn = AioInbound(owner)
            transport = FakeTransport(ours)
            conn.connection_made(transport)
            assert conn in owner._inbound and transport.buffer  # the challenge went out
            ref = weakref.ref(conn)
            conn.connection_lost(None)
            assert conn not in owner._inbound
            del conn
            assert ref() is None
        finally:
            gc.enable()
            owner.close()
            ours.close()
            theirs.close()

    asyncio.run(main())
