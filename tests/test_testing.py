"""amesh.testing: the in-memory transport, the faulty transport, in-process meshes."""

from __future__ import annotations

import os
import socket

import anyio
import pytest

from amesh import ActorError, Failure, ProcMesh, SupervisionError
from amesh._transport import open_transport
from amesh.testing import (
    FaultyTransport,
    InProcessHost,
    LeakError,
    MemoryTransport,
    no_leaks,
    open_runtime,
)
from amesh.testing._leaks import abstract_sockets

from .actors import Counter, Mortal

pytestmark = pytest.mark.anyio


async def test_in_process_mesh_on_memory_transport() -> None:
    host = InProcessHost()
    with anyio.fail_after(30):
        async with open_runtime(MemoryTransport()) as rt:
            assert rt.address.startswith("memory://")
            async with ProcMesh(per_host={"x": 2, "y": 2}, host=host) as procs:
                c = await procs.spawn("c", Counter, 1)
                assert (await c.incr.call()).values() == [2, 2, 2, 2]
                assert [w[1] for w in (await c.slice(x=1).where.call()).values()] == [0, 1]
                with pytest.raises(ActorError, match="boom"):
                    await c.slice(x=0, y=0).fail.call_one("boom")
                async with anyio.create_task_group() as tg:
                    tg.start_soon(c.slice(x=0, y=0).hang_concurrent.call_one)
                    await c.slice(x=0, y=0).wait_started.call_one()
                    tg.cancel_scope.cancel()
                assert (await c.slice(x=0, y=0).cancelled_count.call_one()) == 1


async def test_in_process_kill_pause_resume() -> None:
    host = InProcessHost()
    failures: list[Failure] = []

    def handle(failure: Failure) -> bool:
        failures.append(failure)
        return True

    with anyio.fail_after(30):
        async with open_runtime(MemoryTransport()):
            async with ProcMesh(
                per_host={"procs": 3},
                host=host,
                supervise=handle,
                heartbeat_period=0.05,
                heartbeat_timeout=2.0,
            ) as procs:
                m = await procs.spawn("m", Mortal)
                pid0, pid1, pid2 = procs.pids
                host.worker(pid1).kill()
                with pytest.raises(SupervisionError, match="SIGKILL"):
                    await m.slice(procs=1).hang.call_one()
                # a pause shorter than the timeout is harmless
                host.worker(pid0).pause()
                host.worker(pid0).resume()
                assert (await m.slice(procs=0).bump.call_one())[1] == 1
                # a pause longer than the timeout is a failure (and the worker is killed)
                host.worker(pid2).pause()
                with pytest.raises(SupervisionError, match="no heartbeat"):
                    await m.slice(procs=2).bump.call_one()
        assert [(f.rank, f.pid) for f in failures] == [(1, pid1), (2, pid2)]
        assert "was killed by SIGKILL" in failures[0].cause


async def test_faulty_transport_duplicates_run_once_and_drops_time_out() -> None:
    faulty = FaultyTransport(open_transport())
    with anyio.fail_after(60):
        async with open_runtime(faulty) as rt:
            async with ProcMesh(per_host={"procs": 2}) as procs:
                c = await procs.spawn("c", Counter)
                faulty.duplicate(kinds={"Call", "Cast"})
                assert (await c.incr.call()).values() == [1, 1]
                await c.incr.broadcast()
                assert (await c.get.call()).values() == [2, 2]  # each ran exactly once
                faulty.clear()
                stats = await procs.statistics()
                assert [s["duplicates_dropped"] for s in stats.values()] == [3, 3]
                faulty.drop_inbound(kinds={"Reply"}, count=1)
                with pytest.raises(TimeoutError):
                    await c.slice(procs=0).get.options(timeout=0.5).call_one()
                assert await c.slice(procs=0).get.call_one() == 2  # the link still works
                faulty.cut(procs._live().addrs[1])
                with pytest.raises(TimeoutError):
                    await c.slice(procs=1).get.options(timeout=0.5).call_one()
                faulty.heal()
                assert await c.slice(procs=1).incr.call_one() == 3
                assert faulty.dropped >= 2 and faulty.duplicated == 6
            assert not rt.pending  # nothing is left waiting


async def test_faulty_transport_delay_keeps_order() -> None:
    faulty = FaultyTransport(open_transport())
    with anyio.fail_after(60):
        async with open_runtime(faulty):
            async with ProcMesh(per_host={"procs": 1}) as procs:
                c = await procs.spawn("c", Counter)
                faulty.delay(0.05, kinds={"Cast"}, count=3)
                for i in range(6):
                    await c.record.broadcast(i)
                assert await c.seen_items.call_one() == list(range(6))
                assert faulty.delayed == 3


def test_no_leaks_catches_a_listening_abstract_socket_and_its_descriptor() -> None:
    name = f"amesh-{os.getpid()}-leak-on-purpose"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(LeakError, match=f"leaked listening abstract sockets.*{name}"):
            with no_leaks():
                sock.bind("\0" + name)
                sock.listen(1)
        assert f"@{name}" in abstract_sockets()
    finally:
        sock.close()
    assert f"@{name}" not in abstract_sockets()
    # a socket that never listens still holds a descriptor
    with pytest.raises(LeakError, match=r"leaked socket descriptors \d+ -> socket:\["):
        with no_leaks():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.close()
    with no_leaks():  # closed in the block: nothing to report
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
