"""Scale on one machine: meshes of 16 to 1,024 worker processes, and a 4,096-rank mesh of
in-process workers.

For each size N (``--sizes``), in a fresh process of its own (``amesh.run``, default
settings: event-loop streams, fan-out 16):

- ``spawn_s``: ``ProcMesh(per_host={"procs": N})`` entered, an actor spawned on every
  process, and a first ``call()`` answered by all: from nothing to N answers;
- ``call_p50_ms`` / ``call_p99_ms``: ``call()`` of a no-op endpoint to all N ranks
  (``--calls`` of them, after 3 warm-up calls);
- ``floor_ms``: the CPU floor of such a call on this machine: the CPU time the whole
  process tree spent per call (every thread's, from ``/proc/*/task/*/schedstat``),
  divided by the CPUs (``os.cpu_count()``), i.e. what the call would take if every CPU
  did nothing else;
- ``worker_cpu_us``: the median worker's CPU per call (a leaf of the relay tree: one
  call in, one reply out), the per-message CPU that the floor is mostly made of;
- ``bcast_per_s``: broadcast deliveries per second (``--casts`` broadcasts to all N
  ranks, then a call that sees every one delivered);
- ``pss_mib_per_worker``: PSS of the workers (``/proc/<pid>/smaps_rollup``) divided by N;
- ``stop_s``: leaving the ``ProcMesh`` block: every worker stopped and gone;
- ``spawn_cpu_ms`` and ``spawn_faults``: a worker's CPU (as ``floor_ms``) and page faults
  (``/proc/PID/stat``) from its start to its first answer, medians; ``forked``: how many
  workers the zygote forked (the others were exec'd: ``AMESH_ZYGOTE=0``, or the zygote
  failed; the output then says so). The faults are
  mostly the copies of the zygote's pages it writes, and do not change from run to run;
  the CPU does, with what a fresh page costs the machine: ~10 ms a worker here once
  the VM's memory is in use, about twice that where its host backs each page at the
  first touch (see bench/README.md). ``spawn_cpu_split_s``: the spawn's CPU seconds in
  this process, in the zygote (its start and its forks) and in all the workers.

Then a 4,096-rank mesh of in-process workers (``amesh.testing.InProcessHost`` on the
memory transport): the frames the controller sends per broadcast and per ``call()``
(the relay tree: O(fan-out)), and the time of one ``call()`` through the tree.

Run: ``.venv/bin/python bench/bench_scale.py [--sizes 16,64,256,1024] [--json]``.
1,024 processes take a few GiB of memory and most of a minute on 2 CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

CLK = os.sysconf("SC_CLK_TCK")


#: whether this kernel keeps ``schedstat`` (CONFIG_SCHEDSTATS / SCHED_INFO)
_SCHEDSTAT = os.path.exists("/proc/self/schedstat")


def _proc_cpu(pid: int) -> float:
    """CPU seconds of process ``pid``, every thread of it (0 once it is gone).

    From ``/proc/PID/task/TID/schedstat`` (the scheduler's own nanoseconds on a CPU):
    ``/proc/PID/stat``'s ``utime + stime`` comes from the timer tick and, on the VM of
    bench/README.md, said 4.3 ms per ``call()`` to 64 workers where the scheduler said
    6.7 (29.7 against 37.7 at 256). Falls back to ``/proc/PID/stat`` where the kernel
    keeps no ``schedstat``.
    """
    if _SCHEDSTAT:
        total_ns = 0
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return 0.0
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total_ns += int(f.read().split()[0])
            except OSError:
                continue  # a thread that ended meanwhile
        return total_ns / 1e9
    fields = _stat(pid)
    if not fields:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK  # utime, stime


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name (state first; none once
    the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and its live descendants (see :func:`_proc_cpu`)."""
    return sum(_proc_cpu(pid) for pid in [root, *_descendants(root)])


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat(int(name))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _pss_mib(pids: list[int]) -> float:
    kib = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        kib += int(line.split()[1])
                        break
        except OSError:
            continue
    return kib / 1024


def _faults(pid: int) -> int:
    """Minor page faults of process ``pid``, every thread of it."""
    fields = _stat(pid)
    return int(fields[7]) if fields else 0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _one_size(n: int, calls: int, casts: int) -> dict[str, Any]:
    import amesh

    class Node(amesh.Actor):
        def __init__(self) -> None:
            self.seen = 0

        @amesh.endpoint
        def noop(self) -> None:
            return None

        @amesh.endpoint
        def bump(self) -> None:
            self.seen += 1

        @amesh.endpoint
        def count(self) -> int:
            return self.seen

    async def main() -> dict[str, Any]:
        me = os.getpid()
        mine0 = _proc_cpu(me)
        t0 = time.perf_counter()
        async with amesh.ProcMesh(per_host={"procs": n}) as procs:
            nodes = await procs.spawn("nodes", Node)
            await nodes.noop.call()
            spawn = time.perf_counter() - t0
            mine = _proc_cpu(me) - mine0
            started = [(_proc_cpu(pid), _faults(pid)) for pid in procs.pids]
            ppids = [int(_stat(pid)[1]) for pid in procs.pids]
            # a worker whose parent is this process was exec'd, not forked by the zygote
            forked = sum(1 for p in ppids if p != me)
            zygotes = sum(_proc_cpu(p) for p in set(ppids) if p != me)
            for _ in range(3):
                await nodes.noop.call()
            pids = list(procs.pids)
            cpu0 = _tree_cpu(me)
            each0 = [_proc_cpu(pid) for pid in pids]
            samples = []
            for _ in range(calls):
                t = time.perf_counter()
                await nodes.noop.call()
                samples.append(time.perf_counter() - t)
            cpu = (_tree_cpu(me) - cpu0) / calls
            each = [(_proc_cpu(pid) - c) / calls for pid, c in zip(pids, each0)]
            t = time.perf_counter()
            for _ in range(casts):
                await nodes.bump.broadcast()
            counts = (await nodes.count.call()).values()
            cast_s = time.perf_counter() - t
            if counts != [casts] * n:
                raise AssertionError("a broadcast was lost")
            pss = _pss_mib(list(procs.pids)) / n
            t = time.perf_counter()
        stop = time.perf_counter() - t
        return {
            "n": n,
            "spawn_s": spawn,
            "call_p50_ms": _pct(samples, 0.5) * 1e3,
            "call_p99_ms": _pct(samples, 0.99) * 1e3,
            "cpu_per_call_ms": cpu * 1e3,
            # a median worker is a leaf (relays are one in fan-out)
            "worker_cpu_us": _pct(each, 0.5) * 1e6,
            "floor_ms": cpu / (os.cpu_count() or 1) * 1e3,
            "bcast_per_s": casts * n / cast_s,
            "pss_mib_per_worker": pss,
            "stop_s": stop,
            "spawn_cpu_ms": _pct([c for c, _ in started], 0.5) * 1e3,
            "spawn_faults": _pct([float(f) for _, f in started], 0.5),
            # where the spawn's CPU went: this process (every thread), the zygote (its
            # start, and the forks), the workers (all of them, to their first answer)
            "spawn_cpu_split_s": [mine, zygotes, sum(c for c, _ in started)],
            "forked": forked,
        }

    result: dict[str, Any] = amesh.run(main)
    return result


def _in_process(n: int, fanout: int) -> dict[str, Any]:
    import anyio

    import amesh
    from amesh.testing import InProcessHost, MemoryTransport, open_runtime

    class Node(amesh.Actor):
        @amesh.endpoint
        def noop(self) -> None:
            return None

    async def main() -> dict[str, Any]:
        async with open_runtime(MemoryTransport()) as rt:
            async with InProcessHost().spawn_procs({"procs": n}, fanout=fanout) as procs:
                nodes = await procs.spawn("nodes", Node)
                await nodes.noop.call()
                s0 = rt.statistics().frames_sent
                await nodes.noop.broadcast()
                s1 = rt.statistics().frames_sent
                times = []
                for _ in range(5):
                    t = time.perf_counter()
                    await nodes.noop.call()
                    times.append(time.perf_counter() - t)
                s2 = rt.statistics().frames_sent
        return {
            "n": n,
            "fanout": fanout,
            "frames_per_cast": s1 - s0,
            "frames_per_call": (s2 - s1) / 5,
            "call_ms": _pct(times, 0.5) * 1e3,
        }

    result: dict[str, Any] = anyio.run(main)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,64,256,1024")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--casts", type=int, default=100)
    parser.add_argument("--in-process", type=int, default=4096)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--one-in-process", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(_one_size(args.one, args.calls, args.casts)), flush=True)
        return
    if args.one_in_process:
        print("RESULT " + json.dumps(_in_process(args.one_in_process, 16)), flush=True)
        return
    rows = []
    jobs = [["--one", s] for s in args.sizes.split(",")]
    if args.in_process:
        jobs.append(["--one-in-process", str(args.in_process)])
    for flag, value in jobs:
        argv = [sys.executable, __file__, flag, value, "--calls", str(args.calls)]
        argv += ["--casts", str(args.casts)]
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
        found = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not found:
            print(out.stderr[-2000:], file=sys.stderr)
            last = [x for x in out.stderr.splitlines() if x.strip()][-1:] or [""]
            rows.append({"n": int(value), "error": out.returncode, "why": last[0][-300:]})
            continue
        rows.append(json.loads(found[0][len("RESULT ") :]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{os.cpu_count()} CPUs; Python {platform.python_version()}; default settings (fan-out 16)"
    )
    print(
        "| processes | spawn + first answer (s) | call() to all p50 / p99 (ms) | CPU per "
        "call (ms) | floor (ms) | a worker's CPU per call, median (µs) | broadcast "
        "deliveries/s | PSS per worker (MiB) | stop (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "spawn_s" not in r:
            continue
        print(
            f"| {r['n']} | {r['spawn_s']:.2f} | {r['call_p50_ms']:.1f} / {r['call_p99_ms']:.1f} "
            f"| {r['cpu_per_call_ms']:.1f} | {r['floor_ms']:.1f} | {r['worker_cpu_us']:.0f} "
            f"| {r['bcast_per_s']:,.0f} "
            f"| {r['pss_mib_per_worker']:.1f} | {r['stop_s']:.2f} |"
        )
    spawned = [r for r in rows if "spawn_faults" in r]
    if spawned:
        print(
            "\na worker's CPU and page faults from its start to its first answer "
            "(medians): "
            + "; ".join(
                f"{r['n']}: {r['spawn_cpu_ms']:.1f} ms, {r['spawn_faults']:,.0f}" for r in spawned
            )
        )
        print(
            "the spawn's CPU (s): "
            + "; ".join(
                f"{r['n']}: controller {r['spawn_cpu_split_s'][0]:.2f}, zygote "
                f"{r['spawn_cpu_split_s'][1]:.2f}, workers {r['spawn_cpu_split_s'][2]:.2f} "
                f"(wall {r['spawn_s']:.2f} x {os.cpu_count()} CPUs)"
                for r in spawned
            )
        )
        for r in spawned:
            if r["forked"] != r["n"]:
                print(
                    f"!! {r['n'] - r['forked']} of {r['n']} workers were exec'd, not forked by "
                    "the zygote (AMESH_ZYGOTE=0, or it failed: see any warning above); these "
                    "figures are not a zygote's"
                )
    for r in rows:
        if "frames_per_cast" in r:
            print(
                f"\nin-process mesh of {r['n']} ranks, fan-out {r['fanout']}: the controller "
                f"sends {r['frames_per_cast']} frames per broadcast and "
                f"{r['frames_per_call']:.0f} per call(); one call() takes {r['call_ms']:.1f} ms"
            )
        elif "error" in r:
            print(f"\n{r['n']}: failed (exit {r['error']}): {r.get('why', '')}")


if __name__ == "__main__":
    main()
