"""hello_mesh: spawn a mesh of processes and actors, and use every adverb.

Run it with ``python examples/hello_mesh.py`` (add ``--trio`` for the trio backend).
"""

from __future__ import annotations

import sys

import amesh
from amesh import Actor, ActorError, ProcMesh, current_rank, current_size, endpoint


class Greeter(Actor):
    """One greeter per process; it remembers how many times it was greeted."""

    def __init__(self, greeting: str) -> None:
        self.greeting = greeting
        self.count = 0

    @endpoint
    async def greet(self, name: str) -> str:
        self.count += 1
        point = current_rank()
        coords = ", ".join(f"{k}={v}" for k, v in point.items())
        return f"{self.greeting}, {name}! from ({coords}) of {current_size()}"

    @endpoint
    def times_greeted(self) -> int:  # endpoints may be sync too
        return self.count

    @endpoint
    def fail(self) -> None:
        raise RuntimeError("this greeter refuses")


async def main() -> None:
    async with ProcMesh(per_host={"hosts": 2, "gpus": 2}) as procs:
        print(f"started {len(procs)} worker processes: {procs.sizes}, pids {procs.pids}")
        greeters = await procs.spawn("greeters", Greeter, "Hello")

        # call: every rank, results as a ValueMesh shaped like the mesh
        hellos = await greeters.greet.call("world")
        for point, text in hellos.items():
            print("call      ", point, "->", text)

        # call_one: exactly one rank (slice with an int to drop a dimension)
        one = await greeters.slice(hosts=1, gpus=0).greet.call_one("slice")
        print("call_one  ", one)

        # choose: one rank, the one with the fewest calls in flight from us
        print("choose    ", await greeters.greet.choose("anyone"))

        # stream: results in arrival order; a slice keeps ranks relative to itself
        async for point, text in greeters.slice(gpus=slice(1, 2)).greet.stream("stream"):
            print("stream    ", point, "->", text)

        # broadcast: no reply; per-sender FIFO means the next call sees its effect
        await greeters.greet.broadcast("broadcast")
        counts = await greeters.times_greeted.call()
        print("counts    ", counts.values(), "total", sum(counts.values()))

        # views: flatten, rename and split, as in Monarch
        flat = greeters.flatten("rank")
        print(
            "flatten   ",
            flat.sizes,
            "rename",
            greeters.rename(gpus="tp").sizes,
            "split",
            flat.split("rank", dp=2, tp=-1).sizes,
        )

        # a remote exception is an ActorError with the remote traceback
        try:
            await greeters.slice(hosts=0, gpus=1).fail.call_one()
        except ActorError as exc:
            print("ActorError", exc)
            print("remote traceback ends with:", exc.traceback.strip().splitlines()[-1])
    print("all processes stopped")


if __name__ == "__main__":
    amesh.run(main, backend="trio" if "--trio" in sys.argv else None)
