"""What a caller's timeout does to sync endpoints, and slow pickling off the loop."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from amesh import ProcMesh, endpoint
from amesh._runtime import current_runtime
from amesh._runtime._mailbox import cheap_to_pickle

from .actors import Sync

pytestmark = pytest.mark.anyio


async def test_a_threaded_endpoint_sees_its_caller_give_up() -> None:
    """``thread=True``: the process answers other calls while the handler runs; the
    caller's timeout makes ``amesh.cancelled()`` true in the handler, which returns
    early; the actor's next (serial) message runs after it."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            s = await procs.spawn("s", Sync)
            assert await s.in_thread.call_one(1) == (True, 2)
            async with anyio.create_task_group() as tg:
                gave_up = anyio.Event()

                async def call() -> None:
                    with pytest.raises(TimeoutError):
                        await s.until_cancelled.options(timeout=3600).call_one()
                    gave_up.set()

                with anyio.CancelScope() as scope:
                    tg.start_soon(call)
                    # the loop is free while the handler runs in its thread
                    while not await s.is_running.call_one():
                        assert await s.ping.call_one() == "pong"
                    assert await s.seen_cancel.call_one() is False
                    scope.cancel()  # the caller gives up
                tg.cancel_scope.cancel()
            # serial: runs once the threaded handler returned, having seen the cancel
            assert await s.serial_seen_cancel.call_one() is True


async def test_a_sync_endpoint_on_the_loop_runs_to_the_end(tmp_path: Path) -> None:
    """A plain sync endpoint cannot be interrupted: the caller's timeout fires at
    once, the handler runs to its end, and its late result is dropped and counted."""
    go = tmp_path / "go"
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            s = await procs.spawn("s", Sync)
            rt = current_runtime()
            before = rt.statistics().replies_dropped
            with pytest.raises(TimeoutError):
                await s.on_loop.options(timeout=0.2).call_one(str(go), 8 << 20)
            go.touch()
            # behind the late reply on the same link
            assert await s.serial_seen_cancel.call_one() is False
            assert rt.statistics().replies_dropped == before + 1
            assert await s.on_loop.call_one(str(go), 3) == b"rrr"


async def test_a_slow_pickle_holds_up_only_its_own_call() -> None:
    """A result that takes long to pickle is pickled in a worker thread: the
    process's other calls are answered meanwhile."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            s = await procs.spawn("s", Sync)
            async with anyio.create_task_group() as tg:
                got: list[object] = []

                async def call() -> None:
                    got.append(await s.slow_result.call_one())

                tg.start_soon(call)
                for _ in range(20):
                    assert await s.ping.call_one() == "pong"
                assert got == []
                await s.release_pickle.call_one()
            assert got == ["pickled"]


def test_cheap_to_pickle() -> None:
    assert cheap_to_pickle(None)
    assert cheap_to_pickle((1, "a", b"x" * 10**6, {"k": [1.0, 2.0]}))
    assert not cheap_to_pickle(list(range(10_000)))
    assert not cheap_to_pickle({i: i for i in range(1000)})
    assert not cheap_to_pickle(object())
    assert not cheap_to_pickle([[[[]]]] * 300)


def test_thread_endpoints_must_be_sync() -> None:
    with pytest.raises(TypeError, match="needs a plain"):

        @endpoint(thread=True)
        async def f(self: object) -> None: ...
