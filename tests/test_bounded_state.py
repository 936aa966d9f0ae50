"""State that lives as long as a process stays bounded however many peers and actor
meshes come and go: the counts of flow control go with their actor mesh, and the
table of dead peers keeps the most recent deaths."""

from __future__ import annotations

import anyio
import pytest

from amesh import Actor, ActorMesh, ProcMesh, endpoint
from amesh._runtime import _peers, current_runtime
from amesh.testing import InProcessHost, MemoryTransport, open_runtime

from .actors import Caller, Counter, Sink

pytestmark = pytest.mark.anyio

#: actor meshes spawned and stopped, and short-lived meshes started and stopped
CYCLES = 300


class Inspect(Actor):
    """Reports what its process's runtime holds."""

    @endpoint
    def held(self) -> dict[str, int]:
        rt = current_runtime()
        links = rt.links
        return {
            "out": len(links._out),
            "taken": len(links._taken),
            "credit_waiters": len(links._credit_waiters),
            "dead": len(rt.peers.dead),
        }


async def test_actor_meshes_spawned_and_stopped_leave_no_flow_control_state() -> None:
    """Before, each cycle left an entry per rank in the controller's ``Links._out`` and
    one per sender in each worker's ``Links._taken``, until the peer process died."""
    with anyio.fail_after(120):
        async with ProcMesh({"procs": 2}) as procs:
            rt = current_runtime()
            inspect = await procs.spawn("inspect", Inspect)
            for _ in range(CYCLES):
                sink = await procs.spawn("sink", Sink)
                for j in range(3):
                    await sink.note.broadcast(j)
                for got, _ in (await sink.received.call()).values():
                    assert got == [0, 1, 2]
                await sink.stop()
            assert (len(rt.links._out), len(rt.links._credit_waiters)) == (0, 0)
            for held in (await inspect.held.call()).values():
                assert (held["taken"], held["out"], held["credit_waiters"]) == (0, 0, 0), held
            # flow control still holds for the next one: a window's worth and more
            sink = await procs.spawn("sink", Sink)
            for j in range(3000):
                await sink.note.broadcast(j)
            for got, _ in (await sink.received.call()).values():
                assert got == list(range(3000))
            assert len(rt.links._out) == 2  # (its two ranks, while it lives)


async def test_a_cast_for_a_gone_actor_is_credited_as_gone() -> None:
    """A cast that comes after its actor stopped is dropped, and its sender told that
    the actor is gone: nothing is kept on either side, and the sender is never held
    for good."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            rt = current_runtime()
            inspect = await procs.spawn("inspect", Inspect)
            sink = await procs.spawn("sink", Sink)
            await sink.note.broadcast(0)
            await sink.stop()
            addr = procs._live().addrs[0]
            # a handle of it that no owner stopped (one an actor was handed)
            stale = ActorMesh(sink.name, sink.key, Sink, sink._shape, sink._procs)
            for i in range(3000):  # more than a window (1,024): credit must come back
                await stale.note.broadcast(i)
            await inspect.held.call_one()  # (the credits came before this answer)
            assert rt.links.outstanding(addr, sink.key) == 0
            assert len(rt.links._out) == 0
            assert (await inspect.held.call_one())["taken"] == 0


async def test_the_dead_peer_table_keeps_the_most_recent_deaths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Short-lived meshes come and go, each calling a long-lived one: the controller
    and the long-lived worker each keep ``DEAD_KEPT`` dead peers (before: every one of
    them), and a send to a dead peer still fails at once, remembered or not."""
    kept = 50
    monkeypatch.setattr(_peers, "DEAD_KEPT", kept)
    host = InProcessHost()
    with anyio.fail_after(120):
        async with open_runtime(MemoryTransport()) as rt:
            async with ProcMesh({"procs": 1}, host=host) as long_lived:
                counter = await long_lived.spawn("counter", Counter)
                caller = await long_lived.spawn("caller", Caller)
                inspect = await long_lived.spawn("inspect", Inspect)
                handles = []
                for _ in range(CYCLES):
                    async with ProcMesh({"procs": 1}, host=host) as short:
                        calling = await short.spawn("calling", Caller)
                        assert (await calling.call.call_one(counter, "incr"))[0] == "ok"
                        handles.append(await short.spawn("gone", Counter))
                assert len(rt.peers.dead) == kept
                assert (await inspect.held.call_one())["dead"] == kept
                # the last one dead is remembered with its cause; the first, forgotten,
                # fails as soon as its connection cannot be made
                for handle, cause in ((handles[-1], "closed"), (handles[0], "cannot connect")):
                    with anyio.fail_after(5):
                        kind, message = await caller.call.call_one(handle, "incr")
                    assert kind == "SupervisionError" and cause in message, message
                assert (await counter.get.call_one()) == CYCLES
