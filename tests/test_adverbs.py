"""Every adverb against real worker processes, on asyncio (uvloop) and trio."""

from __future__ import annotations

import threading

import anyio
import pytest

import amesh
from amesh import ActorError, ProcMesh
from amesh._runtime import current_runtime

from .actors import Counter, Gate

pytestmark = pytest.mark.anyio


async def test_call_returns_value_mesh_in_rank_order() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"gpus": 4}) as procs:
            assert procs.sizes == {"gpus": 4} and len(procs) == 4
            counters = await procs.spawn("counters", Counter, 10)
            result = await counters.incr.call(5)
            assert isinstance(result, amesh.ValueMesh)
            assert result.values() == [15, 15, 15, 15]
            assert len(result) == 4 and result.sizes == {"gpus": 4}
            pids = (await counters.pid.call()).values()
            assert pids == procs.pids and len(set(pids)) == 4
            assert [dict(p) for p, _ in result.items()] == [{"gpus": i} for i in range(4)]
            assert result.item(gpus=2) == 15
            assert result.slice(gpus=slice(1, 3)).values() == [15, 15]


async def test_call_one_choose_stream_broadcast() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}) as procs:
            c = await procs.spawn("c", Counter)
            assert await c.slice(procs=1).incr.call_one(2) == 2
            with pytest.raises(ValueError, match="exactly one rank"):
                await c.incr.call_one(1)
            # choose takes the rank with the fewest calls in flight: 1, while 0 and 2
            # each run one
            async with anyio.create_task_group() as tg:
                for busy in (0, 2):
                    tg.start_soon(c.slice(procs=busy).hang_concurrent.call_one)
                    await c.slice(procs=busy).wait_started.call_one()
                assert await c.now.choose() == 1
                tg.cancel_scope.cancel()
            seen = {point.rank: value async for point, value in c.get.stream()}
            assert seen == {0: 0, 1: 2, 2: 0}
            await c.incr.broadcast(10)
            assert (await c.get.call()).values() == [10, 12, 10]


async def test_sync_and_async_endpoints_and_current_actor() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            c = await procs.spawn("c", Counter)
            assert (await c.incr.call()).values() == [1, 1]  # sync endpoint
            assert (await c.get.call()).values() == [1, 1]  # async endpoint
            assert (await c.is_me.call()).values() == [True, True]


async def test_choose_prefers_least_loaded_rank() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            c = await procs.spawn("c", Counter)
            async with anyio.create_task_group() as tg:
                # Two calls in flight to rank 0 (concurrent endpoint, never released yet).
                tg.start_soon(c.slice(procs=0).wait_released.call_one)
                tg.start_soon(c.slice(procs=0).wait_released.call_one)
                rt = current_runtime()
                while rt.calls.in_flight(procs._live().addrs[0], c.key) < 2:
                    await anyio.lowlevel.checkpoint()
                for _ in range(5):
                    assert await c.now.choose() == 1
                await c.slice(procs=0).release.call_one()


async def test_stream_yields_in_arrival_order() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            c = await procs.spawn("c", Counter)
            await c.slice(procs=1).release.call_one()
            order = []
            async for point, value in c.wait_released.stream():
                order.append((point.rank, value))
                if len(order) == 1:
                    # rank 0 is still waiting; only now do we let it go
                    await c.slice(procs=0).release.call_one()
            assert order == [(1, 1), (0, 0)]


async def test_arguments_are_checked_at_the_call_site() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            rt = current_runtime()
            before = rt.statistics().calls_sent
            with pytest.raises(TypeError, match="incr"):
                await c.incr.call(1, 2, 3)
            with pytest.raises(TypeError, match="unexpected keyword"):
                await c.incr.call_one(nope=1)
            # issue 36, item 16: the old way of giving a call a timeout points to the new
            with pytest.raises(TypeError) as info:
                await c.incr.call(1, timeout=5)
            assert str(info.value) == (
                "endpoint incr(): got an unexpected keyword argument 'timeout' (a call's "
                "timeout is an option of the endpoint: mesh.incr.options(timeout=5).call(...))"
            )
            with pytest.raises(TypeError, match="cannot pickle"):
                await c.echo.call(threading.Lock())
            with pytest.raises(TypeError):
                await c.incr.broadcast("a", "b")
            assert rt.statistics().calls_sent == before
            with pytest.raises(AttributeError, match="no endpoint 'nope'"):
                c.nope  # noqa: B018
            with pytest.raises(TypeError, match="Counter"):
                await procs.spawn("d", Counter, 1, 2, 3)


async def test_endpoint_error_is_actor_error_and_actor_lives() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            c = await procs.spawn("c", Counter)
            with pytest.raises(ActorError) as info:
                await c.slice(procs=1).fail.call_one("boom")
            err = info.value
            assert err.type_name == "ValueError"
            assert err.message == "boom"
            assert err.actor == "c"
            assert err.point == {"rank": 0}  # the slice dropped the dim
            assert "in fail" in err.traceback and "raise ValueError(msg)" in err.traceback
            assert isinstance(err.__cause__, amesh.RemoteTraceback)
            assert "raise ValueError(msg)" in str(err.__cause__)
            # the actor keeps serving
            assert (await c.incr.call()).values() == [1, 1]


async def test_unpicklable_result_is_an_actor_error() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            with pytest.raises(ActorError, match="cannot pickle") as info:
                await c.unpicklable.call_one()
            assert info.value.type_name == "TypeError"
            assert await c.incr.call_one() == 1


async def test_first_error_cancels_the_rest_of_the_call() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}) as procs:
            c = await procs.spawn("c", Counter)

            async def fail_once_the_others_run() -> None:
                for other in (0, 2):
                    await c.slice(procs=other).wait_started.call_one()
                await c.slice(procs=1).release.call_one()

            async with anyio.create_task_group() as tg:
                tg.start_soon(fail_once_the_others_run)
                with pytest.raises(ActorError, match="rank 1 fails"):
                    await c.fail_on.call(1, True)
            # Ranks 0 and 2 were running and wait forever unless cancelled. Under serial
            # dispatch this call could not even start on them otherwise.
            counts = await c.cancelled_count.options(timeout=20).call()
            assert counts.values() == [1, 0, 1]


async def test_timeout_cancels_the_remote_request() -> None:
    """A timed-out call is cancelled on the worker like one whose caller is cancelled
    (a running handler: see the next test); queued, it is dropped unrun."""
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            gate = await procs.spawn("gate", Gate)
            # requests that time out while queued (behind a serial handler) are
            # dropped unrun: had one run, it would hang, and the count would never come
            async with anyio.create_task_group() as tg:
                tg.start_soon(c.hold.call_one)
                await c.wait_started.call_one()
                with pytest.raises(TimeoutError):
                    await c.hang.options(timeout=0.2).call_one()
                with pytest.raises(TimeoutError):
                    async for _ in c.hang.options(timeout=0.2).stream():
                        pass
                await gate.open.call_one()
            assert await c.cancelled_count.options(timeout=20).call_one() == 0
            with pytest.raises(ValueError):
                c.get.options(timeout=-1)


async def test_cancelling_the_caller_cancels_a_running_handler() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            async with anyio.create_task_group() as tg:
                tg.start_soon(c.hang_concurrent.call_one)
                await c.wait_started.call_one()  # the remote handler is running now
                tg.cancel_scope.cancel()
            # the remote handler saw the cancellation and its `finally` ran
            assert await c.cancelled_count.options(timeout=20).call_one() == 1


async def test_lambdas_and_local_functions_travel_by_value() -> None:
    offset = 7

    def local_fn(x: int) -> int:
        return x * 2 + offset

    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            c = await procs.spawn("c", Counter)
            assert (await c.apply.call(lambda x: x + 1, 1)).values() == [2, 2]
            assert (await c.apply.call(local_fn, 1)).values() == [9, 9]
