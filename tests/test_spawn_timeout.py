"""A slow ``__init__``: ``procs.options(timeout=...).spawn`` gives up on it, and so does a
cancelled spawn; the processes where it still runs are killed and reported."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest

import amesh
from amesh import Actor, Failure, ProcMesh, SupervisionError, endpoint

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

#: The longest an ``__init__`` waits for its gate: far beyond every test's timeout.
GATE_TIMEOUT = 60.0


class SlowInit(Actor):
    """Its ``__init__`` blocks its process (a sync wait) until ``gate`` exists, on rank
    ``slow_rank`` (every rank: -1). The wait is the workload, not synchronisation."""

    def __init__(self, gate: str, slow_rank: int = -1) -> None:
        self.cleaned = False
        if slow_rank in (-1, amesh.current_rank().rank):
            deadline = time.monotonic() + GATE_TIMEOUT
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.005)

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Failures:
    """A ``supervise=`` handler that takes every failure and lets a test wait for one."""

    def __init__(self) -> None:
        self.seen: list[Failure] = []
        self._event = anyio.Event()

    def __call__(self, failure: Failure) -> bool:
        self.seen.append(failure)
        self._event.set()
        return True

    async def first(self) -> Failure:
        await self._event.wait()
        return self.seen[0]


async def test_a_spawn_timeout_kills_the_ranks_still_in_init(tmp_path: Path) -> None:
    gate = str(tmp_path / "never")
    failures = Failures()
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}, supervise=failures) as procs:
            pids = procs.pids
            # this module imported on every rank first, so that rank 0's quick __init__
            # surely answers within the timeout
            await procs.spawn("warm", SlowInit, gate, slow_rank=5)
            with pytest.raises(TimeoutError) as info:
                await procs.options(timeout=2).spawn("slow", SlowInit, gate, slow_rank=1)
            assert str(info.value) == (
                "spawn of actor mesh 'slow': SlowInit.__init__ did not return within 2 s "
                "on rank 1 (of 2), whose process was killed (a sync __init__ cannot be "
                "interrupted)"
            )
            failure = await failures.first()
            assert (failure.rank, failure.pid) == (1, pids[1])
            assert failure.cause == (
                "SlowInit.__init__ did not return within 2 s (spawn timeout); "
                "the process was killed"
            )
            # Rank 0 goes on, and nothing of the actor mesh is left there: its name is
            # free again (and its __init__ is quick on rank 0).
            again = await procs.slice(procs=0).spawn("slow", SlowInit, gate, slow_rank=1)
            assert await again.pid.call_one() == pids[0]
            assert len(failures.seen) == 1


async def test_a_spawn_timeout_fails_a_mesh_without_a_handler(tmp_path: Path) -> None:
    """Killed ranks are failures as any other: without ``supervise=`` the scope ends
    with a SupervisionError that says why they were killed."""
    gate = str(tmp_path / "never")
    with anyio.fail_after(60):
        with pytest.raises(SupervisionError, match=r"spawn timeout\); the process was killed"):
            async with ProcMesh(per_host={"procs": 1}) as procs:
                with pytest.raises(TimeoutError, match="on rank 0, whose process"):
                    await procs.options(timeout=0.2).spawn("slow", SlowInit, gate)
                await anyio.sleep_forever()  # until the failure cancels the scope


async def test_a_cancelled_spawn_kills_the_ranks_still_in_init(tmp_path: Path) -> None:
    """Before, a cancelled spawn left ``__init__`` running: the next call to that
    process waited for it to end."""
    gate = str(tmp_path / "never")
    failures = Failures()
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}, supervise=failures) as procs:
            (pid,) = procs.pids
            with anyio.move_on_after(0.3) as scope:
                await procs.spawn("slow", SlowInit, gate)
            assert scope.cancelled_caught
            failure = await failures.first()
            assert (failure.rank, failure.pid) == (0, pid)
            assert failure.cause == (
                "its spawn was cancelled while SlowInit.__init__ ran; the process was killed"
            )
            await gone(pid)


async def gone(pid: int) -> None:
    """Wait until process ``pid`` has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


async def test_options_checks_its_timeout() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            with pytest.raises(ValueError, match="timeout must be >= 0, got -1"):
                procs.options(timeout=-1)
            quick = await procs.options(timeout=30).spawn("quick", SlowInit, "", slow_rank=5)
            assert await quick.pid.call_one() == procs.pids[0]
