"""No single message or result takes a healthy process down."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import anyio
import pytest

from amesh import ActorError, ProcMesh, _wire
from amesh._ratelog import RateLimitedLog
from amesh._runtime import current_runtime
from amesh._transport import StreamTransport

from .actors import Awkward, Counter

pytestmark = pytest.mark.anyio


async def test_errors_that_cannot_be_printed_or_pickled_reach_the_caller() -> None:
    """An exception whose ``__str__`` and ``__repr__`` raise, and a result whose
    pickling raises, each reach the caller as an ActorError; the worker lives on."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            a = await procs.spawn("a", Awkward)
            pid = await a.ok.call_one()
            with pytest.raises(ActorError) as info:
                await a.raise_bad_str.call_one()
            assert info.value.type_name.endswith("BadStr")
            assert "str() raised RuntimeError" in info.value.message
            assert "42" in info.value.message  # what could be recovered: the args
            assert "raise_bad_str" in info.value.traceback
            with pytest.raises(ActorError, match="refuses to be pickled"):
                await a.unpicklable_result.call_one()
            assert await a.ok.call_one() == pid  # the same process still serves


def test_drop_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """A flood of malformed frames costs one log line per interval, with a count."""
    log = logging.getLogger("amesh.test.ratelog")
    limited = RateLimitedLog(log, interval=3600)
    with caplog.at_level(logging.WARNING, logger="amesh.test.ratelog"):
        for i in range(1000):
            limited.warning("dropped frame %d", i)
        assert [r.getMessage() for r in caplog.records] == ["dropped frame 0"]
        limited._next = 0.0  # the interval is over
        limited.warning("dropped frame %d", 1000)
    assert caplog.records[-1].getMessage() == (
        "dropped frame 1000 (and 999 more like it in the last 3600 s)"
    )


def test_the_ipc_directory_must_be_ours_and_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A socket directory that others can enter, or that belongs to someone else, is
    refused with a clear error; a missing one is created with mode 0700."""
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("AMESH_IPC_DIR", str(fresh))
    StreamTransport("ipc").close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    monkeypatch.setenv("AMESH_IPC_DIR", str(loose))
    with pytest.raises(PermissionError, match="has mode 755"):
        StreamTransport("ipc")
    assert os.listdir(loose) == []  # nothing was bound there

    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        other = 65534
    else:
        theirs, other = Path("/"), 0  # root's, not ours
    monkeypatch.setenv("AMESH_IPC_DIR", str(theirs))
    with pytest.raises(PermissionError, match=f"belongs to uid {other}"):
        StreamTransport("ipc")


async def test_forged_replies_are_refused() -> None:
    """A process of the job that the call did not go to sprays replies (plain and
    gathered) for every call id, and heartbeats and credit in a worker's name: all are
    dropped and counted; the user's call returns the worker's own result."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            rt = current_runtime()
            async with anyio.create_task_group() as tg:
                result: list[int] = []

                async def call() -> None:
                    result.append(await c.wait_released.call_one())

                tg.start_soon(call)
                await c.wait_started.call_one()
                (pending,) = [p for p in rt.calls.pending.values() if p.targets]
                in_flight, (worker,) = pending.call_id, pending.targets.values()
                forged = _wire.dumps("forged")
                data, lengths, parts = forged.inline, forged.lengths, forged.parts
                mole = StreamTransport()
                try:
                    ids = sorted({in_flight, *range(1, 3000)})
                    for cid in ids:
                        await mole.send(
                            rt.address, _wire.encode(_wire.Reply(cid, 0, data, lengths), parts)
                        )
                        gathered = _wire.Gathered(
                            cid, [_wire.Reply(cid, 0, data, lengths)], lengths
                        )
                        await mole.send(rt.address, _wire.encode(gathered, parts))
                    await mole.send(rt.address, _wire.encode(_wire.Heartbeat(worker, 1)))
                    await mole.send(
                        rt.address, _wire.encode(_wire.Credit(worker, c.key, 10**6, 10**9))
                    )
                    # frames of one connection arrive in order: once this one is
                    # in, every forged frame before it was handled
                    done = anyio.Event()
                    rt.expect_ready("mole", lambda env: done.set())
                    await mole.send(rt.address, _wire.encode(_wire.Ready("mole", mole.address, 1)))
                    await done.wait()
                finally:
                    mole.close()
                stats = rt.statistics()
                # the call in flight was answered twice by the mole: both refused
                assert stats.replies_refused == 2
                assert stats.replies_dropped == 2 * (len(ids) - 1)
                assert stats.frames_refused == 2
                assert rt.calls.pending  # still waiting for the worker's answer
                await c.release.call_one()
            assert result == [0]


async def test_a_routing_bug_costs_one_formatted_traceback_a_logged_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame the router fails on is dropped and counted, and the process lives on;
    the failure is logged with its traceback, at most one line an interval, and the
    traceback is formatted only for the line logged (a bug failing every heartbeat
    formatted one each: ~0.5 ms of the controller's CPU a frame)."""
    from amesh._runtime import _runtime
    from amesh.testing import MemoryTransport, open_runtime

    def broken(self: object, env: object, buffers: object, peer: str) -> None:
        raise ValueError("a router bug")

    formatted = []
    real = _runtime.traceback.format_exception

    def counting(exc: BaseException) -> list[str]:
        formatted.append(exc)  # (kept: their ids stay theirs)
        return real(exc)

    monkeypatch.setattr(_runtime.Runtime, "_on_heartbeat", broken)  # (routed by type)
    monkeypatch.setattr(_runtime.traceback, "format_exception", counting)
    monkeypatch.setattr(_runtime, "_drops", RateLimitedLog(_runtime.log, interval=3600))
    with anyio.fail_after(30), caplog.at_level(logging.WARNING, logger=_runtime.log.name):
        async with open_runtime(MemoryTransport()) as rt:
            frame = _wire.join(_wire.encode(_wire.Heartbeat(rt.address, os.getpid())))
            for _ in range(5):
                rt.deliver(frame, rt.address)
            assert rt.statistics().frames_dropped == 5
            peer = rt.address
    lines = [r.getMessage() for r in caplog.records if "failed to route" in r.getMessage()]
    # one exception formatted (as often as the log's handlers print its line), not five
    assert len(lines) == 1 and len({id(exc) for exc in formatted}) == 1, lines
    assert f"Heartbeat from {peer}" in lines[0]
    assert "Traceback" in lines[0] and "ValueError: a router bug" in lines[0]
