"""ping_pong: two actor meshes that talk to each other directly, not via the controller.

Each pinger is handed the ponger mesh in a message and calls its own partner.
Run it with ``python examples/ping_pong.py``.
"""

from __future__ import annotations

import sys

import amesh
from amesh import Actor, ActorMesh, ProcMesh, current_rank, endpoint


class Ponger(Actor):
    def __init__(self) -> None:
        self.hits = 0

    @endpoint
    def pong(self, ball: int) -> int:
        self.hits += 1
        return ball + 1

    @endpoint
    def hits_taken(self) -> int:
        return self.hits


class Pinger(Actor):
    @endpoint
    async def rally(self, partners: ActorMesh[Ponger], rounds: int) -> int:
        """Hit the ball back and forth with the partner of the same index."""
        me = current_rank()["pair"]
        partner = partners.slice(pair=me)
        ball = 0
        for _ in range(rounds):
            ball = await partner.pong.call_one(ball)
            ball += 1  # our own hit
        return ball


async def main(rounds: int = 100) -> None:
    async with (
        ProcMesh(per_host={"pair": 2}) as ping_procs,
        ProcMesh(per_host={"pair": 2}) as pong_procs,
    ):
        pongers = await pong_procs.spawn("pongers", Ponger)
        pingers = await ping_procs.spawn("pingers", Pinger)
        final = await pingers.rally.call(pongers, rounds)
        hits = await pongers.hits_taken.call()
        for point, ball in final.items():
            print(f"pair {point['pair']}: ball at {ball} after {rounds} rounds")
        print("hits taken by each ponger:", hits.values())
        assert final.values() == [2 * rounds] * 2
        assert hits.values() == [rounds] * 2


if __name__ == "__main__":
    amesh.run(main, backend="trio" if "--trio" in sys.argv else None)
