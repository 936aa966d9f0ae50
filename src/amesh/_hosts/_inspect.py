"""``amesh stacks`` and ``amesh logs`` for a persistent mesh that no controller holds
(its controller left): through this machine's local agent, which keeps its workers
and their log files (see :mod:`amesh._runtime._logfile`). The workers are asked for
their stacks directly, and their agent takes those of a worker whose event loop does
not answer (see :mod:`amesh._runtime._stackdump`). Called within a runtime that holds
the local key.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import anyio

from .._errors import SupervisionError
from .._mesh import describe_exit
from .._model import AGENT_KEY, ActorMesh, ProcAgent
from .._runtime import DUMP_TIMEOUT, LOOP_TIMEOUT
from .._shape import Shape
from ._live import FOLLOW_PERIOD
from ._remote import find_held

__all__ = ["held_logs", "held_stacks"]


async def held_stacks(
    name: str,
    rank: int | None,
    full: bool,
    hosts: Sequence[str] | None = None,
    key_file: str | None = None,
) -> list[tuple[int, int, str]]:
    """``(rank, pid, stacks)`` of ``rank`` (else every rank) of persistent mesh
    ``name``, on the agents at ``hosts`` (with ``key_file``; this machine's when
    None).

    Raises:
        LookupError: no such mesh, or no such rank.
    """
    agents, record = await find_held(name, hosts, key_file)
    procs: list[list[Any]] = record["procs"]
    addrs = [addr for addr, _ in procs]
    exits: dict[int, int] = record["exits"]
    ranks = list(range(len(procs))) if rank is None else [rank]
    if not all(0 <= r < len(procs) for r in ranks):
        raise LookupError(f"persistent mesh {name!r} has no rank {rank}")
    texts: dict[int, str] = {}

    async def one(r: int) -> None:
        pid = procs[r][1]
        if pid in exits:
            texts[r] = f"(its process {describe_exit(exits[pid])})"
            return
        agent = ActorMesh(AGENT_KEY, AGENT_KEY, ProcAgent, Shape(["procs"], [1], [r]), addrs)
        host = agents._agents.slice(hosts=r // int(record["per_host"]))
        try:
            texts[r] = await agent.stacks.options(timeout=LOOP_TIMEOUT).call_one(full)
        except TimeoutError:  # busy: its agent takes them by a signal
            ep = host.stacks.options(timeout=DUMP_TIMEOUT + LOOP_TIMEOUT)
            texts[r] = await ep.call_one(pid, full)
        except (SupervisionError, OSError) as exc:
            texts[r] = f"(no answer: {exc})"

    async with anyio.create_task_group() as tg:
        for r in ranks:
            tg.start_soon(one, r)
    return [(r, procs[r][1], texts[r]) for r in ranks]


async def held_logs(
    name: str,
    n: int,
    rank: int | None,
    follow: bool,
    hosts: Sequence[str] | None = None,
    key_file: str | None = None,
) -> None:
    """Print the last ``n`` lines of persistent mesh ``name``'s output (of rank
    ``rank`` only, when given), in time order, from the agents at ``hosts`` (with
    ``key_file``; this machine's when None); with ``follow``, then those that come,
    until the mesh is stopped.

    Raises:
        LookupError: no such mesh.
    """
    mesh, _ = await find_held(name, hosts, key_file)
    agents = [mesh._agents.slice(hosts=i) for i in range(len(mesh))]
    cursors: list[dict[str, list[int]] | None] = [None] * len(agents)

    async def new_lines() -> list[tuple[float, str]]:
        found = []
        for i, agent in enumerate(agents):
            lines, cursors[i] = await agent.logs.call_one(name, n, rank, cursors[i])
            found.append(lines)
        return list(heapq.merge(*found, key=lambda line: line[0]))

    lines = (await new_lines())[-n:] if n > 0 else []
    for _, text in lines:
        print(text, flush=True)
    if not lines and not follow:
        print(f"no output from {name!r} yet")
    while follow:
        await anyio.sleep(FOLLOW_PERIOD)
        try:
            lines = await new_lines()
        except Exception as exc:  # stopped (its agent knows it no more), or the agent is gone
            print(f"({name!r} is gone: {exc})", flush=True)
            return
        for _, text in lines:
            print(text, flush=True)
