"""Bad input never crashes a worker: garbage and truncated frames, unknown versions."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest
from anyio.abc import TaskGroup
from hypothesis import given, settings
from hypothesis import strategies as st

from amesh import ProcMesh, ProtocolError, _wire
from amesh._model import AGENT_KEY
from amesh._transport import open_transport
from amesh._wire import _envelopes

from .actors import Counter

pytestmark = pytest.mark.anyio


def _stats_call(reply_to: str, call_id: int) -> bytes:
    payload = _wire.dumps(((), {})).data
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
    large = _wire.dumps((b"q" * _wire.INLINE_LIMIT, bytearray(b"z" * _wire.OOB_THRESHOLD)))
    assert len(large.data) >= _wire.INLINE_LIMIT and len(large.buffers) == 1
    assert large.inline == b"" and large.parts[0] is large.data
    assert large.lengths == [len(large.data), _wire.OOB_THRESHOLD]
    assert (
        _wire.loads(large.inline, large.parts)
        == large.load()
        == _wire.loads(large.data, large.buffers)
    )
    small = _wire.dumps((b"small", bytearray(b"z" * _wire.OOB_THRESHOLD)))
    assert small.inline == small.data and small.lengths == [_wire.OOB_THRESHOLD]
    assert small.parts == small.buffers
    assert small.load() == (b"small", bytearray(b"z" * _wire.OOB_THRESHOLD))
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
                            me, 1, 0, c.key, "incr", ["procs"], [1], _wire.dumps(((), {})).data
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
            stats = _wire.loads(reply.payload)
            assert stats["frames_dropped"] == 3
            assert stats["bad_version"] == 0
            # the worker is healthy and the truncated cast did nothing
            assert await c.get.call_one() == 0


async def test_a_pickle_beside_the_envelope_goes_and_comes_back() -> None:
    """A pickle of INLINE_LIMIT bytes or more travels as the frame's first part, with
    out-of-band buffers after it: the worker loads the arguments, and the caller the
    replies, through the one ``loads``; down a relay tree and back up it too."""
    big = (list(range(20_000)), bytearray(b"z" * _wire.OOB_THRESHOLD), "end")
    sent = _wire.dumps(((big,), {}))
    assert sent.inline == b"" and len(sent.parts) == 2  # the pickle, then the buffer
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}, fanout=2) as procs:  # 3 > 2: a tree
            c = await procs.spawn("c", Counter)
            assert await c.slice(procs=1).echo.call_one(big) == big
            assert (await c.echo.call(big)).values() == [big, big, big]


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
            stats = _wire.loads(stats_reply.payload)
            assert stats["bad_version"] == 1
            assert await c.incr.call_one() == 1


async def test_a_call_in_another_protocol_version_raises_protocol_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's adverb raises the documented ProtocolError, naming both versions."""
    encode, encode_envelope = _wire.encode, _wire.encode_envelope

    def encode_get_as_v99(env: _wire.Envelope, buffers: list[Any] | None = None) -> _wire.Frame:
        frame = _wire.join(encode(env, buffers)) if buffers else encode_envelope(env)
        if isinstance(env, _wire.Call) and env.method == "get":  # only this call
            return frame[:2] + bytes([99]) + frame[3:]
        return frame

    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            with monkeypatch.context() as patch:
                patch.setattr(_wire, "encode", encode_get_as_v99)
                patch.setattr(_wire, "encode_envelope", encode_get_as_v99)
                with pytest.raises(ProtocolError) as info:
                    await c.get.call_one()
            assert "protocol version 99 is not supported" in str(info.value)
            assert f"speaks version {_wire.VERSION}" in str(info.value)
            assert str(info.value).startswith("c.get at ")
            assert await c.incr.call_one() == 1  # the worker is fine


# -- the C codec agrees with the Python one ---------------------------------------------

_ADDR = "stream+abstract://amesh-1-0123456789ab"
_ENVELOPES = [
    _wire.Call(_ADDR, 7, 0, "k", "echo", ["procs"], [1], b"\x80\x05N."),
    _wire.Call(_ADDR, 2**63 - 1, 3, "k", "m", ["x", "y"], [2, 2], b"p", ["a#b#c"], [4], _ADDR, 9),
    _wire.Cast(_ADDR, 1, 0, "k", "m", [], [], b""),
    _wire.Reply(3, 1, b"xyz"),
    _wire.Reply(4, 0, b"", [3, 0, 5]),
    _wire.Error(1, 0, "ValueError", "bad", "Traceback ..."),
    _wire.Gathered(1, [_wire.Reply(1, 0, b"", [2, 3]), _wire.Error(1, 1, "E", "", "")], [2, 3]),
    _wire.Cancel(_ADDR, 5),
    _wire.Heartbeat(_ADDR, 17),
]


def _frames() -> st.SearchStrategy[bytes]:
    """Frames of every kind: well-formed ones, the same cut, grown, with a byte
    changed or another version, and bytes at random."""
    good = st.sampled_from(
        [
            _wire.join(_wire.encode(env)) + bytes(range(sum(getattr(env, "buffers", None) or [])))
            for env in _ENVELOPES
        ]
    )

    def spoil(frame: bytes, how: int, at: int, byte: int) -> bytes:
        at %= len(frame) + 1
        if how == 4:
            return frame
        if how == 0:
            return frame[:at]
        if how == 1:
            return frame + bytes([byte]) * (1 + at % 3)
        if how == 2 and at < len(frame):
            return frame[:at] + bytes([byte]) + frame[at + 1 :]
        return frame[:2] + bytes([byte]) + frame[3:]

    spoiled = st.builds(
        spoil, good, st.integers(0, 4), st.integers(0, 1 << 16), st.integers(0, 255)
    )
    return st.one_of(spoiled, st.binary(max_size=64))


def _same(got: tuple[_wire.Envelope, list[Any]] | None) -> Any:
    return None if got is None else (got[0], [bytes(b) for b in got[1]])


def test_the_c_codec_is_in_use() -> None:
    from amesh._native import _ext

    assert isinstance(_wire.try_decode, _ext.EnvelopeDecoder)
    assert isinstance(_wire.encode_envelope, _ext.EnvelopeEncoder)


@given(frame=_frames(), kind=st.sampled_from([bytes, bytearray, memoryview]))
@settings(max_examples=3000, deadline=None, database=None, derandomize=True)
def test_the_c_decoder_takes_exactly_what_the_python_one_takes(frame: bytes, kind: Any) -> None:
    """For any frame, in any buffer, the C decoder returns what the Python decoder
    returns, or None where the Python decoder raises."""
    want = _same(_envelopes._try_decode(frame))
    got = _wire.try_decode(kind(frame))
    assert _same(got) == want
    if got is not None:
        assert all(
            isinstance(b, memoryview) and b.readonly == (kind is not bytearray) for b in got[1]
        )


def test_the_c_encoder_makes_the_python_ones_frames() -> None:
    for env in _ENVELOPES:
        frame = _wire.encode_envelope(env)
        assert frame == _envelopes._encode_envelope(env) == _wire.join(_wire.encode(env, []))
        tail = bytes(sum(getattr(env, "buffers", None) or []))
        assert _wire.decode(frame + tail)[0] == env
    with pytest.raises(TypeError):
        _wire.encode_envelope(object())


def test_the_c_decoder_refuses_to_leave_the_frame_s_memory_behind() -> None:
    """A decode function that keeps the view it was given gets it released, and the
    caller an error, so nothing reads the frame after it is gone."""
    from amesh._native import _ext

    kept: list[memoryview] = []

    def keep(view: memoryview) -> Any:
        kept.append(view)
        return _envelopes._decoder.decode(view)

    frame = _wire.join(_wire.encode(_ENVELOPES[3]))
    with pytest.raises(RuntimeError, match="kept"):
        _ext.EnvelopeDecoder(_wire.MAGIC + bytes([_wire.VERSION]), keep, {})(frame)
    with pytest.raises(ValueError, match="released"):
        bytes(kept[0])

    # a check that raises, or says what is wrong, leaves the frame to the Python decoder
    def boom(env: Any) -> str:
        raise KeyError(env)

    for check in (boom, lambda env: "wrong"):
        decoder = _ext.EnvelopeDecoder(
            _wire.MAGIC + bytes([_wire.VERSION]), _envelopes._decoder.decode, {_wire.Reply: check}
        )
        assert decoder(frame) is None
    with pytest.raises(ValueError):
        _ext.EnvelopeDecoder(b"", _envelopes._decoder.decode, {})
    with pytest.raises(TypeError):
        _ext.EnvelopeDecoder(b"AM\x03", _envelopes._decoder.decode, {})(frame, frame)
