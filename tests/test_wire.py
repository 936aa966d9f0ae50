"""Bad input never crashes a worker: garbage and truncated frames, unknown versions."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest
from anyio.abc import TaskGroup

from amesh import ProcMesh, ProtocolError, _codec, _wire
from amesh._proc_agent import AGENT_KEY
from amesh._transport import open_transport

from .actors import Counter

pytestmark = pytest.mark.anyio


def _stats_call(reply_to: str, call_id: int) -> bytes:
    payload = _codec.dumps(((), {})).data
    return _wire.join(
        _wire.encode(
            _wire.Call(reply_to, call_id, 0, AGENT_KEY, "statistics", ["procs"], [1], payload)
        )
    )


def test_wire_roundtrip_and_rejects() -> None:
    env = _wire.Reply(3, 1, b"xyz")
    frame = _wire.join(_wire.encode(env))
    assert _wire.decode(frame) == (env, [])
    with pytest.raises(_wire.BadFrame):
        _wire.decode(b"garbage")
    with pytest.raises(_wire.BadFrame):
        _wire.decode(frame[:-2])
    # out-of-band buffers follow the envelope and come back as views; small ones
    # are joined into one bytes object, large ones stay separate parts (no copy)
    small = _wire.Reply(4, 0, b"p", [3, 2])
    joined = _wire.encode(small, [memoryview(b"abc"), memoryview(b"de")])
    assert isinstance(joined, bytes)
    got, bufs = _wire.decode(joined)
    assert got == small and [bytes(b) for b in bufs] == [b"abc", b"de"]
    blob = bytes(range(256)) * 1024
    big = _wire.Reply(4, 0, b"p", [len(blob), 2])
    parts = _wire.encode(big, [memoryview(blob), memoryview(b"de")])
    assert isinstance(parts, list) and len(parts) == 3 and parts[1].obj is blob
    got, bufs = _wire.decode(_wire.join(parts))
    assert got == big and [bytes(b) for b in bufs] == [blob, b"de"]
    # a large pickle travels as the first buffer, and comes back from there
    pickle_bytes = b"q" * _wire.INLINE_LIMIT
    inline, lengths, out = _wire.pack(pickle_bytes, [b"zz"])
    assert inline == b"" and lengths == [len(pickle_bytes), 2] and out[0] is pickle_bytes
    assert _wire.unpack(inline, out) == (pickle_bytes, [b"zz"])
    assert _wire.pack(b"small", [b"zz"]) == (b"small", [2], [b"zz"])
    with pytest.raises(_wire.BadFrame, match="truncated"):
        _wire.decode(_wire.join(parts)[:-1])
    with pytest.raises(_wire.BadFrame, match="stray"):
        _wire.decode(_wire.join(parts) + b"x")
    with pytest.raises(_wire.BadVersion) as info:
        body = msgspec.msgpack.encode(["call", "abstract://x", 9, 2, "a"])
        _wire.decode(b"AM\x07" + len(body).to_bytes(4, "little") + body)
    assert (info.value.version, info.value.sender, info.value.call_id, info.value.rank) == (
        7,
        "abstract://x",
        9,
        2,
    )


class RawPeer:
    """A bare transport of the default kind: sends any bytes, receives raw frames."""

    def __init__(self, tg: TaskGroup) -> None:
        self.transport = open_transport()
        self.address = self.transport.address
        send, self._inbox = anyio.create_memory_object_stream[bytes](100)
        tg.start_soon(self.transport.serve, lambda f, peer: send.send_nowait(bytes(f)))

    async def send(self, addr: str, frame: bytes) -> None:
        await self.transport.send(addr, frame)

    async def recv(self) -> _wire.Envelope:
        return _wire.decode(await self._inbox.receive())[0]


async def test_garbage_and_truncated_frames_are_dropped_and_counted() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            worker = procs._live().addrs[0]
            async with anyio.create_task_group() as tg:
                peer = RawPeer(tg)
                me = peer.address
                await peer.send(worker, b"\x00\x01 this is not a frame")
                good = _wire.join(
                    _wire.encode(
                        _wire.Cast(
                            me, 1, 0, c.key, "incr", ["procs"], [1], _codec.dumps(((), {})).data
                        )
                    )
                )
                await peer.send(worker, good[: len(good) // 2])  # truncated
                await peer.send(worker, b"")
                # Same sender, so FIFO: the stats call is handled after the bad frames.
                await peer.send(worker, _stats_call(me, 77))
                reply = await peer.recv()
                tg.cancel_scope.cancel()
            peer.transport.close()
            assert isinstance(reply, _wire.Reply) and reply.call_id == 77
            stats = _codec.loads(reply.payload)
            assert stats["frames_dropped"] == 3
            assert stats["bad_version"] == 0
            # the worker is healthy and the truncated cast did nothing
            assert await c.get.call_one() == 0


async def test_unknown_protocol_version_gets_a_clear_error() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            worker = procs._live().addrs[0]
            async with anyio.create_task_group() as tg:
                peer = RawPeer(tg)
                me = peer.address
                future = msgspec.msgpack.encode(["call", me, 5, 0, "something", "new"])
                await peer.send(worker, b"AM\x63" + len(future).to_bytes(4, "little") + future)
                reply = await peer.recv()
                assert isinstance(reply, _wire.Error)
                assert reply.call_id == 5
                assert reply.type_name == "amesh.ProtocolError"
                assert "protocol version 99" in reply.message
                assert f"version {_wire.VERSION}" in reply.message
                await peer.send(worker, _stats_call(me, 6))
                stats_reply = await peer.recv()
                tg.cancel_scope.cancel()
            peer.transport.close()
            assert isinstance(stats_reply, _wire.Reply)
            stats = _codec.loads(stats_reply.payload)
            assert stats["bad_version"] == 1
            assert await c.incr.call_one() == 1


async def test_a_call_in_another_protocol_version_raises_protocol_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's adverb raises the documented ProtocolError, naming both versions."""
    encode = _wire.encode

    def encode_get_as_v99(env: _wire.Envelope, buffers: list[Any] | None = None) -> _wire.Frame:
        frame = _wire.join(encode(env, buffers))
        if isinstance(env, _wire.Call) and env.method == "get":  # only this call
            return frame[:2] + bytes([99]) + frame[3:]
        return frame

    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            with monkeypatch.context() as patch:
                patch.setattr(_wire, "encode", encode_get_as_v99)
                with pytest.raises(ProtocolError) as info:
                    await c.get.call_one()
            assert "protocol version 99 is not supported" in str(info.value)
            assert f"speaks version {_wire.VERSION}" in str(info.value)
            assert str(info.value).startswith("c.get at ")
            assert await c.incr.call_one() == 1  # the worker is fine
