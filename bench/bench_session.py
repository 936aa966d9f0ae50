"""The session runtime's cost: a round trip to one actor made inside ``amesh.run``
(the runtime on the caller's loop), awaited from a loop amesh did not start (the call
runs on the session's loop thread and its result hops back), and with ``.get()`` from
synchronous code; and a persistent mesh taken over by another controller.

    python bench/bench_session.py [--json] [--n N]

Each figure is the median of ``N`` sequential ``call_one`` round trips after a warm-up,
all in one run, so the ratios to the direct path are what to read. A persistent mesh
row: ``attach_mesh`` plus ``actor_mesh`` until a call answered, from a fresh process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import amesh
from amesh import Actor, endpoint


class Echo(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


async def _direct(n: int) -> float:
    async with amesh.ProcMesh({"procs": 1}) as procs:
        e = await procs.spawn("e", Echo)
        one = e.echo
        for i in range(200):
            await one.call_one(i)
        samples = []
        for i in range(n):
            t = time.perf_counter()
            await one.call_one(i)
            samples.append(time.perf_counter() - t)
        return _median_us(samples)


def _session(n: int) -> tuple[float, float]:
    procs = amesh.ProcMesh({"procs": 1}).get()
    e = procs.spawn("e", Echo).get()

    async def awaited() -> float:
        for i in range(200):
            await e.echo.call_one(i)
        samples = []
        for i in range(n):
            t = time.perf_counter()
            await e.echo.call_one(i)
            samples.append(time.perf_counter() - t)
        return _median_us(samples)

    bridged = asyncio.run(awaited())
    for i in range(200):
        e.echo.call_one(i).get()
    samples = []
    for i in range(n):
        t = time.perf_counter()
        e.echo.call_one(i).get()
        samples.append(time.perf_counter() - t)
    procs.stop().get()
    return bridged, _median_us(samples)


_MAKE = """
import amesh, sys
sys.path.insert(0, sys.argv[1])
from bench_session import Echo

async def main():
    procs = await amesh.ProcMesh({"procs": 4}, name="bench-session", persistent=True)
    await procs.spawn("e", Echo)

amesh.run(main)
"""

_TAKE = """
import amesh, sys, time
sys.path.insert(0, sys.argv[1])
from bench_session import Echo

async def main():
    t = time.perf_counter()
    procs = await amesh.attach_mesh("bench-session")
    e = await procs.actor_mesh("e")
    await e.echo.call(1)
    print(time.perf_counter() - t)
    await procs.stop()

amesh.run(main)
"""


def _take_over() -> float:
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "AMESH_STATE_DIR": state, "AMESH_LOCAL_AGENT_IDLE": "1"}
        subprocess.run([sys.executable, "-c", _MAKE, here], env=env, check=True)
        out = subprocess.run(
            [sys.executable, "-c", _TAKE, here], env=env, check=True, capture_output=True
        )
        return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    direct = amesh.run(_direct, args.n)
    bridged, blocking = _session(args.n)
    take = _take_over()
    rows: dict[str, Any] = {
        "call_one in amesh.run, p50 us": round(direct, 1),
        "call_one awaited from asyncio.run (session), p50 us": round(bridged, 1),
        "call_one .get() (session), p50 us": round(blocking, 1),
        "session / direct": round(bridged / direct, 2),
        ".get() / direct": round(blocking / direct, 2),
        "persistent mesh of 4 taken over: attach_mesh to first answer, s": round(take, 3),
    }
    if args.json:
        print(json.dumps(rows))
    else:
        for k, v in rows.items():
            print(f"{k:66} {v}")


if __name__ == "__main__":
    main()
