"""supervision: what a dead worker looks like from the controller, and what to do about it.

Four short scenes, each printed under its own heading:

1. a handled failure: a ``supervise=`` callable hears of a SIGKILLed worker; the call
   in flight fails with :class:`amesh.SupervisionError`; the other ranks keep working;
2. an escalated failure: nobody handles a worker's ``os._exit(3)``, so the body of
   ``async with ProcMesh(...)`` is cancelled and the failure is raised at its exit;
3. a restart: a ``one_for_one`` restart policy starts a fresh process for a dead rank
   and its ``on_restart`` hook re-sends the state the new actor lacks;
4. a three-level tree: an actor that owns a mesh of its own handles its child's death
   in ``__supervise__``; the controller never hears of it.

Run it with ``python examples/supervision.py`` (add ``--trio`` for the trio backend).
amesh logs each failure on stderr as well; this script prints what the API reports.
"""

from __future__ import annotations

import os
import signal
import sys

import anyio

import amesh
from amesh import Actor, ActorMesh, Failure, ProcMesh, SupervisionError, current_rank, endpoint


class Worker(Actor):
    """Holds some state, can hang (to have a call in flight) and can die on request."""

    def __init__(self) -> None:
        self.state = "empty"
        self.hanging = anyio.Event()

    @endpoint
    def load(self, state: str) -> None:
        self.state = state

    @endpoint
    def whoami(self) -> tuple[int, int, str]:
        return current_rank().rank, os.getpid(), self.state

    @endpoint(concurrent=True)
    async def hang(self) -> None:
        self.hanging.set()
        await anyio.sleep_forever()

    @endpoint(concurrent=True)
    async def wait_hanging(self) -> None:
        await self.hanging.wait()

    @endpoint
    def exit_now(self, code: int) -> None:
        os._exit(code)


async def kill_during_call(mesh: ActorMesh[Worker], pid: int) -> SupervisionError:
    """SIGKILL ``pid`` while a ``hang`` call to it is in flight; return the call's error."""
    error: list[SupervisionError] = []

    async def call() -> None:
        try:
            await mesh.hang.call_one()
        except SupervisionError as exc:
            error.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await mesh.wait_hanging.call_one()  # the hang call has reached the worker
        os.kill(pid, signal.SIGKILL)
    return error[0]


async def handled_failure() -> None:
    print("== 1. handled failure: a supervise= callable")
    heard = anyio.Event()

    def on_failure(failure: Failure) -> bool:
        print(f"   supervise= callable got: {failure}")
        print(f"     rank={failure.rank} pid={failure.pid} signal={failure.signal}")
        heard.set()
        return True  # handled: the `async with` body lives on

    async with ProcMesh(per_host={"gpus": 3}, supervise=on_failure) as procs:
        workers = await procs.spawn("workers", Worker)
        victim = procs.pids[1]
        print(f"   3 workers, pids {procs.pids}; SIGKILL rank 1 (pid {victim}) mid-call")
        exc = await kill_during_call(workers.slice(gpus=1), victim)
        # the message says where in the called slice (its rank 0); failures name the mesh rank
        print(f"   the call in flight raised SupervisionError: {exc}")
        f = exc.failures[0]
        print(f"     failures: rank={f.rank} pid={f.pid} cause={f.cause!r}")
        await heard.wait()
        try:
            await workers.whoami.call()
        except SupervisionError as later:
            print(f"   a later call to all ranks fails at once: ranks {later.ranks}")
        # ranks inside a slice are relative to it: pids tell which processes answered
        alive = await workers.slice(gpus=slice(0, 3, 2)).whoami.call()
        print(f"   the slice without rank 1 still works: pids {[p for _, p, _ in alive.values()]}")


async def escalated_failure() -> None:
    print("== 2. escalated failure: nobody handles it")
    try:
        async with ProcMesh(per_host={"gpus": 2}) as procs:
            workers = await procs.spawn("workers", Worker)
            print("   rank 0 calls os._exit(3); the body then waits forever")
            await workers.slice(gpus=0).exit_now.broadcast(3)
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                print("   the body of `async with ProcMesh(...)` was cancelled")
                raise
    except SupervisionError as exc:
        print(f"   raised at the block's exit: SupervisionError: {exc}")
        for f in exc.failures:
            print(f"     failure: rank={f.rank} pid={f.pid} exit_code={f.exit_code} ({f.cause})")


async def restart() -> None:
    print("== 3. restart: one_for_one, the hook re-sends state")
    state = "weights v7"
    reloaded = anyio.Event()

    async def on_restart(mesh: ActorMesh[Worker], ranks: list[int]) -> None:
        print(f"   on_restart: ranks {ranks} are new; re-sending {state!r}")
        for rank in ranks:
            await mesh.slice(gpus=rank).load.call_one(state)
        reloaded.set()

    policy = amesh.RestartPolicy("one_for_one", max_restarts=3, within=60, on_restart=on_restart)
    async with ProcMesh(per_host={"gpus": 2}) as procs:
        workers = await procs.spawn("workers", Worker, restart=policy)
        await workers.load.call(state)
        before = procs.pids
        exc = await kill_during_call(workers.slice(gpus=1), before[1])
        print(f"   the call in flight raised SupervisionError: {exc.failures[0].cause}")
        await procs.ready()
        await reloaded.wait()  # the hook runs once the restart is done
        after = procs.pids
        print(f"   rank 1: old pid {before[1]}, new pid {after[1]}; restarts={procs.restarts}")
        for rank, pid, held in (await workers.whoami.call()).values():
            print(f"   rank {rank} (pid {pid}) holds {held!r}")


class Owner(Actor):
    """Owns a mesh of two Workers (the controller's grandchildren) and supervises it."""

    procs: ProcMesh
    workers: ActorMesh[Worker]

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.heard = anyio.Event()

    @endpoint
    async def start(self) -> list[int]:
        self.procs = await ProcMesh(per_host={"p": 2})
        self.workers = await self.procs.spawn("workers", Worker)
        return self.procs.pids

    def __supervise__(self, failure: Failure) -> bool:
        self.seen.append(str(failure))
        self.heard.set()
        return True  # handled here: the controller never hears of it

    @endpoint(concurrent=True)
    async def wait_failure(self) -> list[str]:
        await self.heard.wait()
        return self.seen

    @endpoint
    async def ask_child(self, rank: int) -> tuple[int, int, str]:
        return await self.workers.slice(p=rank).whoami.call_one()  # type: ignore[no-any-return]


async def tree() -> None:
    print("== 4. three-level tree: controller -> owner actor -> its own mesh")
    async with ProcMesh(per_host={"p": 1}) as procs:
        owner = await procs.spawn("owner", Owner)
        children = await owner.start.call_one()
        print(f"   owner pid {procs.pids[0]} owns workers {children}; SIGKILL {children[0]}")
        os.kill(children[0], signal.SIGKILL)
        print(f"   owner's __supervise__ got: {(await owner.wait_failure.call_one())[0]}")
        _, pid, _ = await owner.ask_child.call_one(1)
        print(f"   the owner lives on, and its other worker (pid {pid}) still answers")


async def main() -> None:
    with anyio.fail_after(60):
        await handled_failure()
        await escalated_failure()
        await restart()
        await tree()
    print("supervision example done")


if __name__ == "__main__":
    amesh.run(main, backend="trio" if "--trio" in sys.argv else None)
