"""Actors for tests/test_shm_debris.py, and the controller it runs, kills and restarts.

As a script (``python tests/shm_debris_helper.py MODE``) it is a controller on stdout:

- ``traffic``: prints ``job <job id>``, starts a mesh of two workers, makes each
  worker and itself hold one unloaded segment, prints ``pids <pid> <pid>``, then
  sends and receives payloads above the shared-memory threshold from several tasks
  at once, printing ``done`` after each round trip, until it is killed. If the mesh
  fails (a worker was killed), it prints ``failed <why>`` and exits 0.
- ``start``: starts a mesh of one worker (which sweeps what dead processes left),
  prints ``started`` and exits.
"""

from __future__ import annotations

import os
import sys
import time

import anyio

import amesh
from amesh import Actor, ProcMesh, _identity, _wire, endpoint

MIB = 1 << 20
#: Every payload of the traffic is this big: above the default threshold (1 MiB).
BLOB = 2 * MIB
#: The longest an endpoint waits for a gate file before giving up.
GATE_TIMEOUT = 60.0


class Echo(Actor):
    """Large payloads in and out; a blocking endpoint; a segment kept unloaded."""

    def __init__(self) -> None:
        self.kept: _wire.Payload | None = None

    @endpoint
    def echo(self, blob: bytes) -> bytes:
        # a fresh object of the same size: the reply makes its own segment
        return bytes(reversed(blob[:16])) + blob[16:]

    @endpoint
    def big_when_released(self, gate: str, nbytes: int) -> bytes:
        """Block this worker (a sync handler) until ``gate`` exists, then return
        ``nbytes`` bytes. The wait is the workload, not synchronisation."""
        deadline = time.monotonic() + GATE_TIMEOUT
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate} did not appear")
            time.sleep(0.005)
        return bytes(nbytes)

    @endpoint
    def take(self, blob: bytes) -> int:
        return len(blob)

    @endpoint
    def ping(self) -> int:
        return os.getpid()

    @endpoint
    def hold(self, nbytes: int) -> str:
        """Make a segment that nobody loads; its path."""
        self.kept = _wire.dumps(bytes(nbytes), shm=True)
        (path,) = self.kept.segments
        return path


async def _traffic() -> None:
    print("job", _identity.job_id(), flush=True)
    try:
        async with ProcMesh(per_host={"procs": 2}) as procs:
            echo = await procs.spawn("echo", Echo)
            await echo.hold.call(BLOB)
            kept = _wire.dumps(bytes(BLOB), shm=True)
            assert kept.segments, "the controller made no segment"
            print("pids", *procs.pids, flush=True)
            blob = os.urandom(BLOB)

            async def loop(rank: int) -> None:
                one = echo.slice(procs=rank)
                while True:
                    got = await one.echo.call_one(blob)
                    assert len(got) == BLOB
                    print("done", flush=True)

            async with anyio.create_task_group() as tg:
                for rank in (0, 1, 0, 1):
                    tg.start_soon(loop, rank)
    except Exception as exc:  # a worker was killed: SupervisionError, in a group or not
        print("failed", type(exc).__name__, str(exc).replace("\n", " ")[:300], flush=True)


async def _start() -> None:
    async with ProcMesh(per_host={"procs": 1}):
        pass
    print("started", flush=True)


if __name__ == "__main__":
    amesh.run({"traffic": _traffic, "start": _start}[sys.argv[1]])
