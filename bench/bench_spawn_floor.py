"""What any forked Python worker costs to start, against what an amesh worker costs.

A process that imports what amesh's zygote imports (its own ``_preload``, then
``gc.collect()``, ``gc.freeze()`` and the types' attribute cache emptied, as the zygote
does) forks ``--children`` children for each case below, one after another; each child
does less than an amesh worker does before its first answer:

- ``exit``: nothing (CPython's after-fork work and the return into Python);
- ``loop``: a uvloop event loop (``asyncio.Runner``) running one coroutine;
- ``echo``: that, and one connection (a socketpair) read and answered through asyncio
  streams: the least a worker that answers over a socket does;
- ``echo+anyio``: the echo under ``anyio.run`` (uvloop), as amesh runs its loop;
- ``echo+4 threads``: the echo, with 4 idle threads started first (a worker runs 5).

Each child reports its page faults (``ru_minflt``, since the fork) and its CPU time;
the medians are printed, and then those of a real ``ProcMesh`` of ``--workers`` amesh
workers from their start to their first answer (``/proc/PID/stat`` and ``schedstat``,
as ``bench_scale.py`` reads them). On this page-copy-bound path the faults are what a
worker's start is made of: on a VM whose host must back each fresh page, each one
costs several microseconds more (see bench/README.md, "Scale on one machine").

Run: ``.venv/bin/python bench/bench_spawn_floor.py [--children 32] [--workers 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def _echo(sock: socket.socket) -> Callable[[], Any]:
    async def main() -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    return main


def _run_case(case: str, sock: socket.socket) -> None:
    import anyio
    import uvloop

    if case == "exit":
        return
    if case == "loop":

        async def nothing() -> None:
            await asyncio.sleep(0)

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(nothing())
        return
    if case == "echo+4 threads":
        stop = threading.Event()
        for _ in range(4):
            threading.Thread(target=stop.wait, daemon=True).start()
    if case == "echo+anyio":
        anyio.run(_echo(sock), backend="asyncio", backend_options={"use_uvloop": True})
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_echo(sock)())


def _child(case: str, sock: socket.socket, report: int) -> None:
    try:
        _run_case(case, sock)
    finally:
        usage = resource.getrusage(resource.RUSAGE_SELF)  # this process's, since the fork
        cpu = time.process_time()
        os.write(report, json.dumps([usage.ru_minflt, cpu]).encode())
        os._exit(0)


def _cases(children: int) -> dict[str, tuple[float, float]]:
    out = {}
    for case in ("exit", "loop", "echo", "echo+anyio", "echo+4 threads"):
        faults, cpus = [], []
        for _ in range(children):
            ours, theirs = socket.socketpair()
            rp, wp = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(rp)
                ours.close()
                _child(case, theirs, wp)
            os.close(wp)
            theirs.close()
            if case != "exit":
                ours.sendall(b"ping")
                if case != "loop":
                    ours.recv(4)
            ours.close()
            data = b""
            while chunk := os.read(rp, 4096):
                data += chunk
            os.close(rp)
            os.waitpid(pid, 0)
            f, c = json.loads(data)
            faults.append(f)
            cpus.append(c)
        out[case] = (statistics.median(faults), statistics.median(cpus) * 1e3)
    return out


def _amesh_workers(n: int) -> tuple[float, float]:
    """Median page faults and CPU (ms) of ``n`` amesh workers to their first answer,
    from a controller in a fresh process (this one was prepared as a zygote is)."""
    import subprocess

    code = f"""
import json, os, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import amesh
from bench_scale import _faults, _proc_cpu

class Node(amesh.Actor):
    @amesh.endpoint
    def noop(self) -> None:
        return None

async def main():
    async with amesh.ProcMesh(per_host={{"procs": {n}}}) as procs:
        nodes = await procs.spawn("nodes", Node)
        await nodes.noop.call()
        return [(_faults(p), _proc_cpu(p)) for p in procs.pids]

got = amesh.run(main)
print("RESULT " + json.dumps([sorted(f for f, _ in got)[len(got) // 2],
                              sorted(c for _, c in got)[len(got) // 2] * 1e3]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    f, c = json.loads(line[len("RESULT ") :])
    return f, c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--children", type=int, default=32)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from amesh._hosts import _zygote_main

    _zygote_main._preload()
    gc.collect()
    gc.freeze()
    sys._clear_type_cache()
    rows = _cases(args.children)
    rows["amesh worker"] = _amesh_workers(args.workers)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    ref = rows["amesh worker"][0]
    print(f"medians of {args.children} children each; amesh: {args.workers} workers")
    print("| child | page faults | CPU (ms) | faults, of an amesh worker's |")
    print("|---|---:|---:|---:|")
    for case, (f, c) in rows.items():
        print(f"| {case} | {f:,.0f} | {c:.2f} | {f / ref:.0%} |")


if __name__ == "__main__":
    main()
