"""Controller stall: what a blocked controller loop does to its workers.

A controller's event loop can stop for a long time without anything being wrong
with its workers: a synchronous data load, a debugger stop, a notebook idle between
cells. This script starts a mesh with the default heartbeat settings, blocks the
controller's loop with ``time.sleep(STALL)``, and then reports whether any worker was
declared lost, how long the first call after the stall took, and whether every rank
still answers.

Usage::

    python bench/bench_stall.py             # a 30 s stall, 4 workers
    python bench/bench_stall.py --stall 10 --procs 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import amesh
from amesh import Actor, Failure, ProcMesh, endpoint


class Echo(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


async def run(stall: float, n: int) -> dict[str, Any]:
    failures: list[Failure] = []

    def supervise(failure: Failure) -> bool:
        failures.append(failure)
        return True

    async with ProcMesh(per_host={"procs": n}, supervise=supervise) as procs:
        echo = await procs.spawn("echo", Echo)
        before = (await echo.pid.call()).values()
        t0 = time.perf_counter()
        time.sleep(stall)  # noqa: ASYNC251 -- the stall being measured
        t1 = time.perf_counter()
        after = (await echo.pid.call()).values()
        t2 = time.perf_counter()
        # let the heartbeat monitor look several times after the stall
        for _ in range(5):
            await procs._live().monitor_tick()
        again = (await echo.pid.call()).values()
    return {
        "stall_s": t1 - t0,
        "procs": n,
        "workers_lost": len(failures),
        "failures": [str(f) for f in failures],
        "first_call_after_ms": (t2 - t1) * 1e3,
        "same_processes": before == after == again,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--stall", type=float, default=30.0, help="seconds (default 30)")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = amesh.run(run, args.stall, args.procs)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"controller loop blocked for {result['stall_s']:.1f} s, {result['procs']} workers")
    print(f"  workers declared lost:      {result['workers_lost']}")
    for f in result["failures"]:
        print(f"    {f}")
    print(f"  first call after the stall: {result['first_call_after_ms']:.1f} ms")
    print(f"  same processes answer:      {result['same_processes']}")


if __name__ == "__main__":
    main()
