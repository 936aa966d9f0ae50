"""``.get()`` and a plain ``for`` over a stream, from the threads of a runtime's process:
refused on the thread of the runtime's loop (which would never get to do the work), done
on that loop from any other thread, a worker thread of the loop included."""

from __future__ import annotations

import asyncio

import anyio
import pytest
import sniffio

from amesh import ProcMesh

from .actors import Counter

pytestmark = pytest.mark.anyio


async def test_get_from_a_worker_thread_of_the_loop() -> None:
    """``anyio.to_thread.run_sync`` (and ``asyncio.to_thread``) copy the caller's context,
    runtime included, into a thread that is not the loop's: ``.get()`` there runs on the
    caller's runtime, as the work of a mesh that runtime owns must."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 2}) as procs:
            c = await procs.spawn("c", Counter)

            def work() -> tuple[int, list[int], int]:
                one = c.slice(procs=0).incr.call_one(2).get(timeout=30)
                ranks = sorted(p.rank for p, _ in c.get.stream())
                d = procs.spawn("d", Counter, 10).get()
                return one, ranks, d.slice(procs=1).incr.call_one().get()

            assert await anyio.to_thread.run_sync(work) == (2, [0, 1], 11)
            if sniffio.current_async_library() == "asyncio":
                assert await asyncio.to_thread(c.slice(procs=0).incr.call_one(3).get) == 5


async def test_get_on_the_loop_thread_is_refused() -> None:
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            with pytest.raises(RuntimeError, match="would block the event loop"):
                c.incr.call_one().get()
            with pytest.raises(RuntimeError, match="use `async for`"):
                iter(c.get.stream())
            assert await c.incr.call_one() == 1  # nothing was started


async def test_a_timeout_in_a_worker_thread_cancels_the_work() -> None:
    """The wait ends at the timeout, and what it started on the loop is cancelled
    (the loop's runtime then answers the next call at once)."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)

            def hang() -> None:
                c.hang_concurrent.call_one().get(timeout=0.5)

            with pytest.raises(TimeoutError):
                await anyio.to_thread.run_sync(hang)
            while await c.cancelled_count.call_one() == 0:
                pass  # the handler's cancellation is on its way
            assert await anyio.to_thread.run_sync(c.incr.call_one().get) == 1
