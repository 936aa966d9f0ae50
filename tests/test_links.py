"""Failures on the links: every caller learns of a death, a stalled controller kills
nobody, and nothing is lost in relay trees or flow control."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio
import anyio.to_thread
import pytest

import amesh
from amesh import Failure, ProcMesh, SupervisionError
from amesh._runtime import current_runtime
from amesh._transport import open_transport
from amesh.testing import FaultyTransport, InProcessHost, MemoryTransport, open_runtime

from .actors import Caller, Counter, Gate, Mortal, Sink

pytestmark = pytest.mark.anyio


async def test_a_caller_that_is_not_the_owner_learns_of_a_death() -> None:
    """Actor A was handed mesh b; b's process is SIGKILLed while A waits on it: A's call
    fails with a SupervisionError naming the rank, host, pid and cause, while the
    controller (b's owner) handles the failure."""
    failures: list[Failure] = []
    handled = anyio.Event()

    def handle(failure: Failure) -> bool:
        failures.append(failure)
        handled.set()
        return True

    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as a_procs:
            caller = await a_procs.spawn("caller", Caller)
            async with ProcMesh({"procs": 1}, supervise=handle) as b_procs:
                b = await b_procs.spawn("b", Counter)
                victim = b_procs.pids[0]
                async with anyio.create_task_group() as tg:
                    outcome: list[Any] = []

                    async def wait() -> None:
                        outcome.append(await caller.call.call_one(b, "hang_concurrent"))

                    tg.start_soon(wait)
                    await b.wait_started.call_one()  # A's call is running in b
                    os.kill(victim, signal.SIGKILL)
                kind, message = outcome[0]
                # A may hear of the death (its own broken link) before the owner does
                await handled.wait()
    assert kind == "SupervisionError"
    assert f"pid {victim}" in message and "host" in message, message
    assert "SIGKILL" in message or "connection" in message, message
    assert [f.pid for f in failures] == [victim]


async def test_a_stalled_controller_kills_no_worker() -> None:
    """The controller's loop blocks for several heartbeat timeouts (a synchronous data
    load, a debugger stop): no worker is declared lost, and the next call works."""
    failures: list[Failure] = []
    with anyio.fail_after(60):
        async with ProcMesh(
            {"procs": 2},
            heartbeat_period=0.1,
            heartbeat_timeout=1.0,
            supervise=lambda f: failures.append(f) or True,
        ) as procs:
            c = await procs.spawn("c", Counter)
            assert (await c.incr.call()).values() == [1, 1]
            time.sleep(3.5)  # noqa: ASYNC251 -- the stall under test, on purpose
            assert (await c.incr.call()).values() == [2, 2]
            # the heartbeat monitor looks again, several times: still nobody blamed
            for _ in range(5):
                await procs._live().monitor_tick()
                assert (await c.get.call()).values() == [2, 2]
    assert failures == []


async def test_a_silent_worker_is_still_found_after_a_stall() -> None:
    """After a controller stall, a worker that really is silent (SIGSTOP) is declared
    lost, and the failure says whose silence it was."""
    with anyio.fail_after(60):
        with pytest.raises(SupervisionError, match="worker was silent") as info:
            async with ProcMesh({"procs": 1}, heartbeat_period=0.1, heartbeat_timeout=1.0) as procs:
                c = await procs.spawn("c", Counter)
                time.sleep(1.5)  # noqa: ASYNC251 -- a controller stall first
                os.kill(procs.pids[0], signal.SIGSTOP)
                await c.hang.call_one()
    assert info.value.failures[0].pid is not None  # type: ignore[attr-defined]


async def test_broadcasts_behind_a_dead_relay_are_sent_again_around_it() -> None:
    """A relay dies holding broadcasts it had not forwarded: its subtree still gets
    every one of them, once each, in order, and nobody else gets any twice."""
    host = InProcessHost()
    failures: list[Failure] = []
    failed = anyio.Event()

    def handle(failure: Failure) -> bool:
        failures.append(failure)
        failed.set()
        return True

    with anyio.fail_after(60):
        async with open_runtime(MemoryTransport()) as rt:
            async with ProcMesh({"procs": 13}, host=host, fanout=3, supervise=handle) as procs:
                c = await procs.spawn("c", Counter)
                await c.incr.call()  # 1 everywhere; links dialled
                relay = host.worker(procs.pids[0])  # relays for 3, 4, 5 and 12
                relay.pause()
                for i in range(5):
                    await c.record.broadcast(i)
                relay.kill()
                live = c.slice(procs=slice(1, 13))
                await failed.wait()  # the owner hears of the death
                seen = (await live.seen_items.call()).values()
                assert seen == [list(range(5))] * 12
                assert rt.statistics().casts_resent > 0
    assert [f.rank for f in failures] == [0]


async def test_a_lost_credit_does_not_shrink_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credits are totals: with every other credit message dropped, the window comes
    back in full, so a broadcaster is never held back for good."""
    monkeypatch.setenv("AMESH_SEND_WINDOW", "64")
    faulty = FaultyTransport(open_transport())
    with anyio.fail_after(60):
        async with open_runtime(faulty) as rt:
            async with ProcMesh({"procs": 1}) as procs:
                sink = await procs.spawn("sink", Sink)
                faulty.drop_inbound(kinds={"Credit"}, count=3)
                for i in range(640):
                    await sink.note.broadcast(i)
                got, _ = await sink.received.call_one()
                assert got == list(range(640))
                addr = procs._live().addrs[0]
                # what is still uncredited is less than one credit batch
                assert rt.links.outstanding(addr, sink.key) < 32
                assert faulty.dropped == 3


async def test_broadcast_timeout() -> None:
    """``broadcast(timeout=)`` gives up waiting for credit, and leaves the window as
    it was: the broadcasts go on once the actor reads again."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            sink = await procs.spawn("sink", Sink)
            gate = await procs.spawn("gate", Gate)
            await sink.hold.broadcast()
            rt = current_runtime()
            sent = 0
            with pytest.raises(TimeoutError, match="took no message"):
                for i in range(5000):
                    await sink.note.options(timeout=0.5).broadcast(i)
                    sent += 1
            assert sent == rt.links.window - 1  # hold + notes fill the window
            await gate.open.call_one()
            await sink.note.options(timeout=10).broadcast(sent)
            got, _ = await sink.received.call_one()
            assert got == list(range(sent + 1))


async def test_a_cancelled_body_still_receives() -> None:
    """An unhandled failure cancels the body of amesh.run, not the receiving: cleanup
    code in the body (shielded) can still call the surviving ranks."""
    answers: list[Any] = []

    async def main() -> None:
        procs = await ProcMesh(per_host={"p": 2})
        m = await procs.spawn("m", Mortal)
        try:
            await m.slice(p=0).die.broadcast("exit")
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), anyio.fail_after(20):
                answers.append(await m.slice(p=1).bump.call_one())

    with anyio.fail_after(60):
        with pytest.raises(SupervisionError, match="exited with code 3"):
            await anyio.to_thread.run_sync(amesh.run, main)
    assert len(answers) == 1


async def test_leaving_a_mesh_while_it_restarts_a_process() -> None:
    """The scope ends while a restart is under way: no failure is raised, and the
    process being started for the restart is stopped too (the leak check sees to it)."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 2}) as procs:
            c = await procs.spawn("c", Counter, restart="one_for_one")
            os.kill(procs.pids[1], signal.SIGKILL)
            with pytest.raises(SupervisionError):
                await c.slice(procs=1).hang.call_one()
            # the owner has seen the death (the call failed), the restart is under way
            assert procs._live().restarting == 1


async def test_direct_requests_after_a_full_link_wait_for_it_and_go_in_order() -> None:
    """A call's requests go to each rank at once, without a coroutine, while every
    link takes its frame; once one is full, the rest of them wait for it, then go,
    each to its own rank, and every one is counted as sent."""
    from amesh import _wire
    from amesh._runtime._calls import Calls
    from amesh._runtime._context import native_waiter
    from amesh._runtime._router import Router
    from amesh._wire import plain_payload

    class Links:
        def __init__(self) -> None:
            self.address = "me"
            self.sent: list[tuple[str, int]] = []
            self.room = anyio.Event()

        def send_soon(self, addr: str, env: Any, parts: Any) -> Any:
            self.sent.append((addr, env.rank))
            return self.room.wait() if addr == "full" else None

        async def send(self, addr: str, env: Any, parts: Any) -> None:
            assert type(env) is _wire.Call
            self.sent.append((addr, env.rank))

    links = Links()
    calls = Calls(native_waiter())
    router = Router(calls, links, {})  # type: ignore[arg-type]
    payload = plain_payload(b"args")
    with anyio.fail_after(10):
        pending = calls.open("actor", {0: "a", 1: "b"})
        assert router.send_requests_soon(pending, "m", ["x"], [2], payload) is None
        assert links.sent == [("a", 0), ("b", 1)] and calls.sent == 2
        links.sent.clear()
        pending = calls.open("actor", {0: "a", 1: "full", 2: "b", 3: "c"})
        waiting = router.send_requests_soon(pending, "m", ["x"], [4], payload)
        assert waiting is not None
        assert links.sent == [("a", 0), ("full", 1)] and calls.sent == 3

        async def rest() -> None:
            await waiting

        async with anyio.create_task_group() as tg:
            tg.start_soon(rest)
            await anyio.wait_all_tasks_blocked()
            assert links.sent == [("a", 0), ("full", 1)]  # the rest wait for room
            links.room.set()
        assert links.sent == [("a", 0), ("full", 1), ("b", 2), ("c", 3)]
        assert calls.sent == 6


def test_a_request_is_remembered_for_half_the_window_at_least_and_the_whole_at_most() -> None:
    """Dedup: a (sender, id) seen in the last ``_RECENT // 2`` requests is dropped as a
    duplicate, one ``_RECENT`` requests old is forgotten; senders do not collide."""
    from amesh._runtime import _dispatch
    from amesh._runtime._dispatch import Dispatch

    d = Dispatch(None, lambda *a: None)  # type: ignore[arg-type]
    half = _dispatch._RECENT // 2
    assert not d.is_duplicate("a", 1) and not d.is_duplicate("b", 1)  # its own ids
    assert d.is_duplicate("a", 1) and d.seen("b", 1) and not d.seen("b", 2)
    for i in range(2, half + 1):  # a new generation starts at the half
        assert not d.is_duplicate("b", i)
    assert d.is_duplicate("a", 1) and d.is_duplicate("b", half)  # in the older one
    assert d.duplicates == 3
    for i in range(half + 1, 2 * half + 1):
        assert not d.is_duplicate("b", i)
    assert not d.seen("a", 1) and not d.is_duplicate("a", 1)  # forgotten: runs again
    assert d.is_duplicate("b", 2 * half)
