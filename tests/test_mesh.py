"""Meshes: slicing, context, ordering, dispatch, several meshes, passing meshes around."""

from __future__ import annotations

import anyio
import pytest

import amesh
from amesh import ProcMesh

from .actors import Counter, Pinger, Ponger

pytestmark = pytest.mark.anyio


async def test_current_rank_is_relative_to_the_slice() -> None:
    with anyio.fail_after(60):
        async with amesh.this_host().spawn_procs(per_host={"x": 2, "y": 3}) as procs:
            c = await procs.spawn("c", Counter)
            whole = await c.where.call()
            assert [w[1] for w in whole.values()] == list(range(6))
            assert whole.item(x=1, y=2)[0] == {"x": 1, "y": 2}
            # __init__ saw its place in the spawned mesh
            assert whole.item(x=1, y=0)[3] == {"x": 1, "y": 0}
            row = c.slice(x=1)
            assert row.sizes == {"y": 3}
            got = await row.where.call()
            assert [v[:3] for v in got.values()] == [({"y": i}, i, {"y": 3}) for i in range(3)]
            col = c.slice(y=slice(1, 3))
            got = await col.where.call()
            assert [v[0] for v in got.values()] == [
                {"x": 0, "y": 0},
                {"x": 0, "y": 1},
                {"x": 1, "y": 0},
                {"x": 1, "y": 1},
            ]
            flat = c.flatten("all").slice(all=slice(4, 6))
            assert [v[2] for v in (await flat.where.call()).values()] == [{"all": 2}] * 2
            assert (await flat.pid.call()).values() == procs.pids[4:6]
            renamed = c.rename(x="dp", y="tp")
            assert (await renamed.where.call()).item(dp=0, tp=1)[0] == {"dp": 0, "tp": 1}
            split = procs.flatten("n").split("n", a=3, b=-1)
            assert split.sizes == {"a": 3, "b": 2}
            assert split.pids == procs.pids


async def test_spawn_on_a_slice_of_procs() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}) as procs:
            part = await procs.slice(procs=slice(1, 3)).spawn("part", Counter)
            assert len(part) == 2
            assert (await part.pid.call()).values() == procs.pids[1:]
            assert [w[1] for w in (await part.where.call()).values()] == [0, 1]


async def test_several_proc_meshes_and_actor_meshes() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"a": 2}) as p1, ProcMesh(per_host={"b": 2}) as p2:
            c1 = await p1.spawn("c", Counter, 1)
            c2 = await p1.spawn("d", Counter, 2)
            c3 = await p2.spawn("c", Counter, 3)
            with pytest.raises(ValueError, match="already has an actor mesh"):
                await p1.spawn("c", Counter)
            got = [(await m.get.call()).values() for m in (c1, c2, c3)]
            assert got == [[1, 1], [2, 2], [3, 3]]
            assert set(p1.pids).isdisjoint(p2.pids)
            await c2.stop()
            with pytest.raises(LookupError, match="actor mesh 'd' was stopped"):
                await c2.get.call()
            assert (await c1.get.call()).values() == [1, 1]


async def test_per_sender_fifo_with_broadcasts_and_calls() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            c = await procs.spawn("c", Counter)
            expected = []
            for i in range(200):
                if i % 3 == 0:
                    await c.record.call(i)
                else:
                    await c.record.broadcast(i)
                expected.append(i)
            seen = await c.seen_items.call()
            assert seen.values() == [expected, expected]


async def test_serial_dispatch_by_default() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(c.serial_work.call_one, i)
            order = await c.work_order.call_one()
            assert len(order) == 8
            # never interleaved: every start is followed by its own end
            for k in range(0, 8, 2):
                assert order[k][0] == "start" and order[k + 1] == ("end", order[k][1])


async def test_concurrent_endpoint_calls_interleave() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            results = []

            async def one() -> None:
                results.append(await c.rendezvous.call_one(3))

            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(one)
            assert results == [3, 3, 3]


async def test_actor_calls_another_mesh_directly() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            pongs = await procs.slice(procs=1).spawn("pong", Ponger)
            pings = await procs.slice(procs=0).spawn("ping", Pinger)
            value, sender_seen, pinger_addr = await pings.ping.call_one(pongs, 41)
            assert value == 42
            # the Ponger was called by the Pinger's process, not through the controller
            assert sender_seen == pinger_addr
            back = await pings.hand_back.call_one(pongs)
            assert isinstance(back, amesh.ActorMesh) and back.key == pongs.key
            assert (await back.pong.call_one(1))[0] == 2


async def test_value_mesh_as_argument() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}) as procs:
            c = await procs.spawn("c", Counter)
            ones = await c.incr.call()
            # whole(): every rank gets the ValueMesh itself, not its own element
            totals = await c.total.call(ones.whole())
            assert totals.values() == [3, 3, 3]
            echoed = await c.slice(procs=0).echo.call_one(ones.slice(procs=slice(0, 2)).whole())
            assert isinstance(echoed, amesh.ValueMesh) and echoed.values() == [1, 1]
