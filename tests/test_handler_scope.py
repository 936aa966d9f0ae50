"""A handler's cancel scope is made only when the handler waits (amesh._runtime._pausable)."""

from __future__ import annotations

import contextvars

import anyio
import anyio.lowlevel
import pytest

from amesh import Actor, ProcMesh, endpoint
from amesh._runtime._pausable import LazyScope, run_handler_in

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_handler_that_returns_without_waiting_gets_no_scope() -> None:
    lazy = LazyScope()
    assert await run_handler_in(lazy, lambda x: x + 1, (1,), {}) == 2
    assert lazy._scope is None


async def test_a_handler_that_waits_runs_in_its_scope() -> None:
    lazy = LazyScope()
    started = anyio.Event()

    async def wait_forever() -> str:
        started.set()
        await anyio.sleep_forever()
        return "not reached"

    async with anyio.create_task_group() as tg:

        async def run() -> None:
            assert await run_handler_in(lazy, wait_forever, (), {}) is None

        tg.start_soon(run)
        await started.wait()
        assert lazy._scope is not None
        lazy.cancel()  # ends the handler at its wait, and only it
    assert lazy.cancel_called


async def test_a_cancel_asked_before_the_first_wait_applies_to_it() -> None:
    lazy = LazyScope()
    reached: list[str] = []

    async def handler() -> None:
        lazy.cancel()  # e.g. the actor failed while the handler's first step ran
        reached.append("first step")
        await anyio.lowlevel.checkpoint()
        reached.append("after the wait")

    assert await run_handler_in(lazy, handler, (), {}) is None
    assert reached == ["first step"]


async def test_scopes_the_handler_enters_on_its_first_step_nest_inside_its_own() -> None:
    lazy = LazyScope()

    async def handler() -> int:
        with anyio.CancelScope():
            await anyio.lowlevel.checkpoint()
            with anyio.move_on_after(30):
                await anyio.lowlevel.checkpoint()
        return 7

    assert await run_handler_in(lazy, handler, (), {}) == 7


async def test_the_errors_of_both_kinds_reach_the_caller() -> None:
    def sync() -> None:
        raise KeyError("sync")

    async def coro() -> None:
        await anyio.lowlevel.checkpoint()
        raise KeyError("async")

    with pytest.raises(KeyError, match="sync"):
        await run_handler_in(LazyScope(), sync, (), {})
    with pytest.raises(KeyError, match="async"):
        await run_handler_in(LazyScope(), coro, (), {})


class Mixed(Actor):
    @endpoint
    def quick(self, x: int) -> int:
        return x * 2

    @endpoint
    async def slow(self) -> str:
        await anyio.sleep_forever()
        return "never"


async def test_through_an_actor_sync_answers_and_async_cancels() -> None:
    with anyio.fail_after(50):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            mesh = await procs.spawn("mixed", Mixed)
            one = mesh.slice(procs=0)
            assert await one.quick.call_one(21) == 42
            with anyio.move_on_after(0.5) as waited:
                await one.slow.call_one()
            assert waited.cancelled_caught
            # the cancelled handler is gone, and the actor serves the next call
            assert await one.quick.call_one(4) == 8


def test_can_wait_reads_a_coroutine_functions_code() -> None:
    from amesh._runtime import can_wait

    async def returns(x: int) -> int:
        return x

    async def awaits() -> None:
        await anyio.lowlevel.checkpoint()

    async def enters(lock: anyio.Lock) -> None:
        async with lock:
            pass

    async def iterates(items: object) -> None:
        async for _ in items:  # type: ignore[attr-defined]
            pass

    assert not can_wait(returns)
    assert can_wait(awaits)
    assert can_wait(enters)
    assert can_wait(iterates)
    assert can_wait(len)  # no code to read: assume it may


class Plain(Actor):
    """Endpoints of every kind, none of which calls breakpoint(): each is called
    without a greenlet (see amesh._runtime._pausable)."""

    def __init__(self) -> None:
        self.n = 0

    @endpoint
    async def bump(self, x: int) -> int:  # async, but never waits: one step
        self.n += x
        return self.n

    @endpoint
    async def refuse(self) -> None:  # the same, raising
        raise KeyError("refused in the first step")

    @endpoint
    async def slow(self) -> str:  # waits: in a cancel scope
        await anyio.sleep_forever()
        return "never"

    @endpoint
    def pending(self) -> object:  # a plain function that returns an awaitable
        return anyio.lowlevel.checkpoint()


async def test_endpoints_without_a_greenlet_answer_raise_and_cancel() -> None:
    from amesh import ActorError

    with anyio.fail_after(50):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            one = (await procs.spawn("plain", Plain)).slice(procs=0)
            assert await one.bump.call_one(2) == 2
            assert await one.bump.call_one(3) == 5
            with pytest.raises(ActorError, match="refused in the first step") as info:
                await one.refuse.call_one()
            assert "raise KeyError" in info.value.traceback  # the handler's own frame
            assert await one.pending.call_one() is None  # awaited, like a coroutine
            with anyio.move_on_after(0.5) as waited:
                await one.slow.call_one()
            assert waited.cancelled_caught
            assert await one.bump.call_one(1) == 6  # the actor serves on


_seen: contextvars.ContextVar[int] = contextvars.ContextVar("seen", default=0)


class Immediate(Actor):
    """Endpoints that cannot wait: an idle actor runs them as their message arrives,
    a busy one from its loop; either way they behave alike."""

    @endpoint
    def remember(self, x: int) -> int:
        previous = _seen.get()
        _seen.set(x)
        return previous

    @endpoint
    def big(self, n: int) -> dict[int, list[int]]:  # too big to pickle on the loop
        return {i: [i] for i in range(n)}


async def test_handlers_run_on_arrival_or_from_the_loop_alike() -> None:
    with anyio.fail_after(50):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            one = (await procs.spawn("now", Immediate)).slice(procs=0)
            # one at a time (the actor idle at each): a ContextVar set by one handler is
            # what the next one finds
            assert await one.remember.call_one(1) == 0
            assert await one.remember.call_one(2) == 1
            # many at once (most of them queued): the same, in arrival order
            seen: list[int] = []
            async with anyio.create_task_group() as tg:
                for x in range(3, 13):
                    tg.start_soon(lambda x=x: _append(seen, one.remember.call_one(x)))
                    await anyio.lowlevel.checkpoint()
            assert sorted(seen) == list(range(2, 12))
            assert await one.remember.call_one(0) == 12
            # a result pickled in a worker thread, then the next call: both answered
            big, after = await _both(one.big.call_one(2000), one.remember.call_one(7))
            assert big == {i: [i] for i in range(2000)}
            assert after == 0  # it ran after big, as it came after it
            assert await one.remember.call_one(8) == 7


async def _append(out: list[int], call: object) -> None:
    out.append(await call)  # type: ignore[misc]


async def _both(first: object, second: object) -> tuple[object, object]:
    results: list[object] = [None, None]

    async def run(i: int, call: object) -> None:
        results[i] = await call  # type: ignore[misc]

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, 0, first)
        await anyio.lowlevel.checkpoint()
        tg.start_soon(run, 1, second)
    return results[0], results[1]
