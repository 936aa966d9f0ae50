"""Tree fan-out: calls and broadcasts to many ranks go down a relay tree of workers."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from amesh import Failure, ProcMesh, SupervisionError, ValueMesh
from amesh._runtime import current_runtime
from amesh._runtime._tree import plan, split
from amesh.testing import InProcessHost, MemoryTransport, open_runtime

from .actors import Counter

pytestmark = pytest.mark.anyio


def _walk(heads: list[tuple[str, int, list[tuple[str, int, int]]]]) -> list[tuple[str, int]]:
    """Every (address, rank) a plan reaches, relays included, flattened."""
    out = []
    for addr, rank, nodes in heads:
        out.append((addr, rank))
        out.extend(_walk(split(nodes)))
    return out


def test_plan_reaches_every_target_once_along_fixed_paths() -> None:
    procs = [f"p{i}" for i in range(40)]
    everyone = plan({r: r for r in range(40)}, procs, 3)
    assert [a for a, _, _ in everyone.heads] == ["p0", "p1", "p2"]
    assert sorted(_walk(everyone.heads)) == sorted((f"p{i}", i) for i in range(40))
    # slot 39's path: 39 -> 12 -> 3 -> 0 (children of s are 3(s+1)..3(s+1)+2)
    assert everyone.via[39] == ("p0", "p3", "p12")
    # a subset takes the same paths; nodes on them that are not targets only relay
    one = plan({0: 39}, procs, 3)
    assert _walk(one.heads) == [("p0", -1), ("p3", -1), ("p12", -1), ("p39", 0)]
    assert one.via[0] == everyone.via[39] and one.relays == {"p0", "p3", "p12"}
    # a dead relay is skipped: its children hang off its nearest live ancestor
    around = plan({0: 39}, procs, 3, dead={"p3"})
    assert _walk(around.heads) == [("p0", -1), ("p12", -1), ("p39", 0)]
    # small meshes (and fan-out 0) are reached directly
    assert plan({0: 1, 1: 2}, procs[:3], 3).relays == set()
    direct = plan({r: r for r in range(40)}, procs, 0)
    assert len(direct.heads) == 40 and not direct.via


async def test_call_and_broadcast_go_down_the_tree_in_order() -> None:
    """The controller sends and receives O(fan-out) frames per call or broadcast,
    results are right, and a broadcast followed by a call arrives in order at every
    rank, however deep it sits in the tree."""
    n, fanout = 40, 3
    with anyio.fail_after(60):
        async with open_runtime(MemoryTransport()) as rt:
            async with ProcMesh(
                {"procs": n},
                host=InProcessHost(),
                fanout=fanout,
            ) as procs:
                c = await procs.spawn("c", Counter, 0)
                await c.incr.call()  # warm: links dialled

                def counters() -> tuple[int, int]:
                    s = rt.statistics()
                    return s.frames_sent, s.frames_received - s.heartbeats_received

                sent0, recv0 = counters()
                await c.incr.broadcast(5)
                got = await c.get.call()
                sent1, recv1 = counters()
                assert got.values() == [6] * n  # the broadcast arrived first everywhere
                assert sent1 - sent0 == 2 * fanout  # 3 for the broadcast, 3 for the call
                assert recv1 - recv0 == fanout  # one batch of replies per subtree

                where = await c.where.call()
                assert [w[1] for w in where.values()] == list(range(n))
                # a slice deep in the tree: routed through relays that are not targets
                deep = c.slice(procs=slice(30, 40))
                assert (await deep.incr.call(10)).values() == [16] * 10
                assert await c.slice(procs=39).get.call_one() == 16
                streamed = [(p.rank, v) async for p, v in deep.get.stream()]
                assert sorted(streamed) == [(r, 16) for r in range(10)]
                stats = (await procs.statistics()).values()
                assert sum(s["relayed"] for s in stats) > 0
                assert all(s["gathers"] == 0 for s in stats)  # every gather finished

                # a scattered call: a request per rank, each down its own path (one
                # frame per rank, to the heads), so it arrives behind the broadcast
                # before it; each rank's reply comes up through the relays
                before = (await c.get.call()).values()
                sent0, recv0 = counters()
                await c.incr.broadcast(100)
                got = await c.incr.call(ValueMesh.of(c, list(range(n))))
                sent1, recv1 = counters()
                assert got.values() == [b + 100 + r for r, b in enumerate(before)]
                assert sent1 - sent0 == fanout + n
                assert recv1 - recv0 == n
                stats = (await procs.statistics()).values()
                assert all(s["gathers"] == 0 for s in stats)


async def test_error_in_a_subtree_fails_the_call_fast() -> None:
    with anyio.fail_after(60):
        async with open_runtime(MemoryTransport()):
            async with ProcMesh({"procs": 13}, host=InProcessHost(), fanout=2) as procs:
                c = await procs.spawn("c", Counter, 0)
                # rank 12 is 3 levels down; the others hang until cancelled
                with pytest.raises(Exception, match="rank 12 fails"):
                    await c.fail_on.call(12)
                # every other rank's (serial) handler was cancelled, or its request
                # dropped if the cancel overtook it: the next call runs everywhere
                assert (await c.incr.call()).values() == [1] * 13


@pytest.mark.parametrize("scattered", [False, True], ids=["one-request", "scattered"])
async def test_relay_death_fails_only_that_rank_and_the_rest_completes(scattered: bool) -> None:
    """A relay dies while a call is in flight through it: the ranks behind it fail
    fast with the relay's failure (only the relay's rank is a failure), and calls that
    avoid the dead rank route around it. The same for a scattered call, whose ranks
    each got a request of their own down their own path."""
    host = InProcessHost()
    failures: list[Failure] = []
    failed = anyio.Event()

    def handle(failure: Failure) -> bool:
        failures.append(failure)
        failed.set()
        return True

    with anyio.fail_after(60):
        async with open_runtime(MemoryTransport()):
            async with ProcMesh({"procs": 13}, host=host, fanout=3, supervise=handle) as procs:
                c = await procs.spawn("c", Counter, 0)
                # slot 0 relays for 3, 4, 5 and, through 3, for 12
                relay_pid = procs.pids[0]
                results: list[tuple[int, Any]] = []
                errors: list[BaseException] = []

                async def stream() -> None:
                    try:
                        tags = ValueMesh.of(c, list(range(13))) if scattered else None
                        async for point, value in c.wait_released.stream(tags):
                            results.append((point.rank, value))
                    except SupervisionError as exc:
                        errors.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream)
                    await c.slice(procs=12).wait_started.call_one()
                    host.worker(relay_pid).kill()
                    await failed.wait()
                    # everyone else gets released and answers
                    await c.slice(procs=slice(1, 13)).release.call()
                assert [f.rank for f in failures] == [0]
                assert len(errors) == 1
                assert [f.rank for f in errors[0].failures] == [0]  # type: ignore[attr-defined]
                # the ranks that did not depend on the dead relay answered before it
                # (or lost their results with it): nobody answered twice
                assert len({r for r, _ in results}) == len(results)
                # calls that avoid rank 0 go around it, to the same ranks as before
                assert (await c.slice(procs=slice(1, 13)).now.call()).values() == list(range(12))
                assert current_runtime().peers.dead


async def test_tree_over_real_processes() -> None:
    """The same through real worker processes and sockets: 7 workers, fan-out 2."""
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 7}, fanout=2) as procs:
            c = await procs.spawn("c", Counter, 0)
            for _ in range(20):
                await c.incr.broadcast(1)
            assert (await c.get.call()).values() == [20] * 7
            blob = bytes(range(256)) * 4096  # 1 MiB: out-of-band buffers relayed too
            assert (await c.echo.call(blob)).values() == [blob] * 7
            stats = (await procs.statistics()).values()
            assert sum(s["relayed"] for s in stats) >= 2 * 21


def test_hosts_come_first() -> None:
    """With hosts of ``group`` processes, the sender sends once per host (to the
    host's first process), and every other process hangs below its own host's head,
    whatever the fan-out."""
    procs = [f"p{i}" for i in range(12)]  # 3 hosts of 4
    for fanout in (2, 3, 16):
        route = plan({r: r for r in range(12)}, procs, fanout, group=4)
        heads = [addr for addr, _, _ in route.heads]
        assert heads == ["p0", "p4", "p8"][: min(3, fanout)], (fanout, heads)

        def check(parent: int, nodes: list[tuple[str, int, int]]) -> None:
            for _, r, below in split(nodes):
                # a process that is not its host's head is reached from its own host
                assert r % 4 == 0 or r // 4 == parent // 4, (parent, r)
                check(r, below)

        for _, rank, nodes in route.heads:
            assert rank % 4 == 0  # only heads are sent to from the sender
            check(rank, nodes)
        reached = {r for _, r, _ in route.heads} | {
            r for _, _, nodes in route.heads for _, r, _ in nodes
        }
        assert reached == set(range(12))
    # a single host: as before (direct up to the fan-out)
    assert len(plan({r: r for r in range(4)}, procs[:4], 16, group=4).heads) == 4
