"""Conformance suite that every Transport implementation must pass, on both backends."""

from __future__ import annotations

import math
import select
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pynng
import pytest

from amesh import _ext, _wire
from amesh._transport import NngTransport, Transport, TransportClosed
from amesh._transport._ext import ExtTransport
from amesh._transport._nng import _fresh_address

pytestmark = pytest.mark.anyio

Factory = Callable[..., Transport]


@pytest.fixture(params=[NngTransport, ExtTransport], ids=["nng", "ext"])
def make(request: pytest.FixtureRequest) -> Iterator[Factory]:
    """Makes transports of the implementation under test; closes them afterwards."""
    made: list[Transport] = []

    def factory(**kwargs: Any) -> Transport:
        t: Transport = request.param("abstract", **kwargs)
        made.append(t)
        return t

    yield factory
    for t in made:
        t.close()


class Inbox:
    """Collects what a transport delivers: copies, and the frames as delivered."""

    def __init__(self) -> None:
        self._tx, self._rx = anyio.create_memory_object_stream[bytes](math.inf)
        self.kept: list[Any] = []

    def deliver(self, frame: bytes) -> None:
        self.kept.append(frame)
        self._tx.send_nowait(bytes(frame))

    async def take(self, n: int) -> list[bytes]:
        return [await self._rx.receive() for _ in range(n)]


def nowhere() -> str:
    """An address nobody listens on (yet): a link to it fills up and stays full."""
    return _fresh_address("abstract", "")


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
            # The same from a foreign, raw NNG peer.
            with pynng.Push0(dial=b.address) as raw:
                for frame in garbage:
                    raw.send(frame)
                raw.send(good)
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
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, b"hello")
            assert await inbox.take(1) == [b"hello"]
            tg.cancel_scope.cancel()
        b.close()
        # Sends to the dead peer fill the link and then wait; none fails or crashes.
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


@pytest.mark.parametrize(
    "make",
    [pytest.param(NngTransport, id="nng"), pytest.param(ExtTransport, id="ext")],
    indirect=True,
)
async def test_close_while_busy(make: Factory) -> None:
    """close() ends a running serve() and a send() waiting on a full link."""
    a, b, sink = make(), make(), nowhere()
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

    def deliver(frame: bytes) -> None:
        seen.append(bytes(frame))
        b.close()

    with anyio.fail_after(30):
        for i in range(100):
            await a.send(b.address, bytes([i]))
        with pytest.raises(TransportClosed):
            await b.serve(deliver)
    assert seen[0] == b"\x00"


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
    a, addr = make(), nowhere()
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
        with pynng.Pull0(listen=addr) as pull:
            await a.send(addr, b"last")
            while len(got) < queued + 1:
                await anyio.wait_readable(pull.recv_fd)
                while True:
                    try:
                        got.append(pull.recv(block=False))
                    except pynng.TryAgain:
                        break
    assert got[-1] == b"last"
    assert b"cancelled" not in got


@pytest.mark.parametrize(
    ("sender", "receiver"),
    [(NngTransport, ExtTransport), (ExtTransport, NngTransport)],
    ids=["nng-to-ext", "ext-to-nng"],
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


# -- the extension itself ----------------------------------------------------------------


def test_ext_constants_match_pynng() -> None:
    from pynng import _nng

    assert _ext.NNG_EAGAIN == _nng.lib.NNG_EAGAIN
    assert _ext.NNG_ECLOSED == _nng.lib.NNG_ECLOSED


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
