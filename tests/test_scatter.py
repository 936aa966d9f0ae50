"""Per-rank arguments: a ValueMesh argument is scattered, each rank gets its element."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from amesh import Actor, ActorError, ProcMesh, ValueMesh, current_rank, endpoint
from amesh._runtime import current_runtime

pytestmark = pytest.mark.anyio

MiB = 1 << 20


class Shard(Actor):
    def __init__(self) -> None:
        #: this actor's point in the whole mesh (a call's point is relative to a slice)
        self.home = dict(current_rank())
        self.records: list[Any] = []
        self.cancelled = 0

    @endpoint
    def take(self, x: Any, y: Any = None, z: Any = None) -> tuple[dict[str, int], Any, Any, Any]:
        return self.home, x, y, z

    @endpoint
    def size(self, data: bytes) -> tuple[int, int]:
        return len(data), data[0]

    @endpoint
    def record(self, item: Any) -> None:
        self.records.append(item)

    @endpoint
    def record_and_list(self, item: Any) -> list[Any]:
        self.records.append(item)
        return self.records

    @endpoint
    def recorded(self) -> list[Any]:
        return self.records

    @endpoint
    def produce(self) -> int:
        return 10 * current_rank().rank

    @endpoint
    def consume(self, value: int, plus: int = 0) -> int:
        return value + plus

    @endpoint
    async def hang_unless(self, answer: bool) -> bool:
        if not answer:
            try:
                await anyio.sleep_forever()
            finally:
                self.cancelled += 1
        return answer

    @endpoint
    def fail_if(self, fail: bool) -> bool:
        if fail:
            raise RuntimeError("this rank's element says fail")
        return fail

    @endpoint
    def cancelled_count(self) -> int:
        return self.cancelled


class CountsPickles:
    """Arrives as the string ``"shared"``; counts how often the caller pickled it."""

    pickled = 0

    def __reduce__(self) -> tuple[Any, ...]:
        CountsPickles.pickled += 1
        return (str, ("shared",))


def homes(*points: tuple[int, int]) -> list[dict[str, int]]:
    return [{"x": x, "y": y} for x, y in points]


async def test_call_scatters_positional_and_keyword_arguments() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"x": 2, "y": 2}) as procs:
            m = await procs.spawn("m", Shard)
            xs = ValueMesh.of(m, ["a", "b", "c", "d"])
            ys = ValueMesh.of(m, [0, 1, 2, 3])
            CountsPickles.pickled = 0
            got = await m.take.call(xs, y=ys, z=CountsPickles())
            assert got.sizes == {"x": 2, "y": 2}
            assert got.values() == [
                ({"x": 0, "y": 0}, "a", 0, "shared"),
                ({"x": 0, "y": 1}, "b", 1, "shared"),
                ({"x": 1, "y": 0}, "c", 2, "shared"),
                ({"x": 1, "y": 1}, "d", 3, "shared"),
            ]
            # the arguments that every rank gets alike are pickled once
            assert CountsPickles.pickled == 1
            # a large shared argument travels out of band next to each rank's element
            big = b"s" * (256 * 1024)
            got = await m.take.call(xs, z=big)
            assert [(x, len(z), z == big) for _, x, _, z in got.values()] == [
                ("a", len(big), True),
                ("b", len(big), True),
                ("c", len(big), True),
                ("d", len(big), True),
            ]
            # whole(): every rank gets the ValueMesh itself; so does one inside a container
            got = await m.take.call(xs.whole(), y=[ys])
            for _, x, y, _ in got.values():
                assert x == xs and y == [ys]


async def test_only_each_ranks_element_travels(monkeypatch: pytest.MonkeyPatch) -> None:
    # no shared memory: every byte an argument takes goes over the transport, counted
    monkeypatch.setenv("AMESH_SHM_THRESHOLD", str(1 << 40))
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"x": 2, "y": 2}) as procs:
            m = await procs.spawn("m", Shard)
            shards = ValueMesh.of(m, [bytes([i]) * MiB for i in range(4)])
            transport = current_runtime().transport
            before = transport.statistics().bytes_sent
            got = await m.size.call(shards)
            sent = transport.statistics().bytes_sent - before
            assert got.values() == [(MiB, 0), (MiB, 1), (MiB, 2), (MiB, 3)]
            # 4 MiB in all; the whole ValueMesh to every rank would be 16 MiB
            assert 4 * MiB <= sent < 2 * 4 * MiB


async def test_large_elements_go_through_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMESH_SHM_DIR", str(tmp_path))
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"x": 2, "y": 2}) as procs:
            m = await procs.spawn("m", Shard)
            shards = ValueMesh.of(m, [bytes([i]) * 2 * MiB for i in range(4)])
            transport = current_runtime().transport
            before = transport.statistics().bytes_sent
            got = await m.size.call(shards)
            sent = transport.statistics().bytes_sent - before
            assert got.values() == [(2 * MiB, 0), (2 * MiB, 1), (2 * MiB, 2), (2 * MiB, 3)]
            assert sent < MiB  # each element went to its rank in a segment of its own
            # each rank took its own and handed it back to the controller for reuse
            back = os.listdir(tmp_path)
            assert len(back) == 4 and all(name.endswith(".free") for name in back)
        assert os.listdir(tmp_path) == []  # removed as the controller's runtime closed


async def test_sliced_mesh_takes_a_value_mesh_of_the_slice_shape() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"x": 2, "y": 2}) as procs:
            m = await procs.spawn("m", Shard)
            column = m.slice(y=1)  # ranks 1 and 3 of the whole mesh
            got = await column.take.call(ValueMesh.of(column, ["u", "v"]))
            assert [(home, x) for home, x, _, _ in got.values()] == [
                ({"x": 0, "y": 1}, "u"),
                ({"x": 1, "y": 1}, "v"),
            ]
            # a slice of a whole-mesh result is the element at the same point
            ranks = await m.produce.call()
            got = await column.take.call(ranks.slice(y=1))
            assert [x for _, x, _, _ in got.values()] == [10, 30]
            one = m.slice(x=1, y=0)
            assert (await one.take.call_one(ranks.slice(x=1, y=0)))[1] == 20


async def test_wrong_shape_is_a_value_error_before_anything_is_sent() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"x": 2, "y": 2}) as procs:
            m = await procs.spawn("m", Shard)
            column = m.slice(y=1)
            rt = current_runtime()
            sent = rt.statistics().calls_sent
            whole = ValueMesh.of(m, [0, 1, 2, 3])
            with pytest.raises(ValueError, match=r"argument 'x'.*\{'x': 2, 'y': 2\}.*\{'x': 2\}"):
                await column.take.call(whole)
            with pytest.raises(ValueError, match=r"argument 'z'"):
                await column.take.call(1, z=whole)
            # the same sizes under other names are another shape
            renamed = ValueMesh.of(column.rename(x="a"), [0, 1])
            with pytest.raises(ValueError, match=r"argument 'y'.*\{'a': 2\}"):
                await column.take.call(1, renamed)
            with pytest.raises(ValueError, match=r"argument 'item'"):
                await m.record.broadcast(ValueMesh.of(column, [0, 1]))
            with pytest.raises(ValueError, match=r"argument 'x'"):
                async for _ in column.take.stream(whole):
                    pass
            with pytest.raises(ValueError, match=r"argument 'x'"):
                await column.take.choose(whole)
            assert rt.statistics().calls_sent == sent and not rt.calls.pending
            assert (await m.recorded.call()).values() == [[], [], [], []]
            with pytest.raises(ValueError, match="4 values for a mesh of 2 ranks"):
                ValueMesh.of(column, [0, 1, 2, 3])


async def test_broadcast_scatters_in_order_down_the_relay_tree() -> None:
    with anyio.fail_after(60):
        # fan-out 2 over 4 processes: broadcasts go down a relay tree
        async with ProcMesh(per_host={"x": 2, "y": 2}, fanout=2) as procs:
            m = await procs.spawn("m", Shard)
            assert m._route()[2] is not None  # (labels, sizes, relay tree)
            await m.record.broadcast("first")
            await m.record.broadcast(ValueMesh.of(m, ["a", "b", "c", "d"]))
            await m.record.broadcast("last")
            records = await m.recorded.call()
            assert records.values() == [["first", e, "last"] for e in "abcd"]
            # a scattered call goes down the tree too, each rank's request along its
            # own path: behind the broadcasts before it
            relayed = sum(s["relayed"] for s in (await procs.statistics()).values())
            await m.record.broadcast("again")
            got = await m.record_and_list.call(ValueMesh.of(m, ["A", "B", "C", "D"]))
            assert got.values() == [["first", e, "last", "again", e.upper()] for e in "abcd"]
            # rank 0 relays for ranks 2 and 3: the broadcast, and their requests
            now = sum(s["relayed"] for s in (await procs.statistics()).values())
            assert now - relayed == 1 + 2


async def test_stream_and_choose_scatter() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"x": 2, "y": 2}) as procs:
            m = await procs.spawn("m", Shard)
            xs = ValueMesh.of(m, ["a", "b", "c", "d"])
            seen = {point.rank: (home, x) async for point, (home, x, _, _) in m.take.stream(xs)}
            points = homes((0, 0), (0, 1), (1, 0), (1, 1))
            assert seen == {r: (points[r], "abcd"[r]) for r in range(4)}
            for _ in range(8):
                home, x, _, _ = await m.take.choose(xs)
                assert x == xs.item(**home)


async def test_results_of_one_mesh_feed_another() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"x": 2, "y": 2}) as procs:
            a = await procs.spawn("a", Shard)
            b = await procs.spawn("b", Shard)
            got = await b.consume.call(await a.produce.call(), plus=1)
            assert got.values() == [1, 11, 21, 31]
            got = await b.consume.call(1, plus=await a.produce.call())
            assert got.values() == [1, 11, 21, 31]


@pytest.mark.parametrize("fanout", [16, 2], ids=["direct", "relay-tree"])
async def test_scattered_call_errors_timeouts_and_cancels_as_any_call(fanout: int) -> None:
    with anyio.fail_after(60):
        # fan-out 2: ranks 2 and 3 are reached through rank 0
        async with ProcMesh(per_host={"x": 2, "y": 2}, fanout=fanout) as procs:
            m = await procs.spawn("m", Shard)
            with pytest.raises(ActorError, match="this rank's element says fail") as err:
                await m.fail_if.call(ValueMesh.of(m, [False, False, True, False]))
            assert err.value.point == {"x": 1, "y": 0, "rank": 2}
            with pytest.raises(TimeoutError):
                await m.hang_unless.options(timeout=0.5).call(
                    ValueMesh.of(m, [True, False, True, False])
                )
            # the ranks that did not answer were cancelled there (a later call runs after)
            assert (await m.cancelled_count.call()).values() == [0, 1, 0, 1]
