"""Failure-detection benchmark: how long until a dead or stopped worker fails a call.

What is measured, all with a call in flight to rank 1 of a 2-process mesh (an endpoint
that waits forever, known to have reached the worker before the signal is sent):

* ``SIGKILL`` -- ``t0 = time.perf_counter()`` right before ``os.kill(pid, SIGKILL)``,
  ``t1`` when the awaiting ``call_one`` raises :class:`amesh.SupervisionError`. Two
  series: one ProcMesh whose actor mesh has a ``one_for_one`` restart policy, so every
  trial kills the freshly restarted rank 1 (``await procs.ready()`` between trials; the
  time from the kill until ``ready()`` returns is reported as the restart time); and a
  fresh ProcMesh per trial with a ``supervise=`` callable (no restart policy, since a
  restart takes the place of supervision), which also gives the time until that
  callable is called with the :class:`amesh.Failure`.
* ``SIGSTOP`` -- a stopped process is alive to the OS, so only heartbeats can tell:
  ``heartbeat_period=0.1`` and ``heartbeat_timeout`` T in 0.5, 1 and 2 s; the time from
  ``os.kill(pid, SIGSTOP)`` until the call raises, and its ratio to T. The framework
  kills the stopped process when it declares it failed; a restart policy brings rank 1
  back for the next trial.

Reading the table: times are in milliseconds; ``p90`` interpolates between the sorted
trials. A SIGKILL is seen through the child's exit status, so its latency is event-loop
wake-ups, not a timeout; expect a few ms on an idle machine. For SIGSTOP the expected
ratio is a little over 1: the last heartbeat arrives up to one period before the stop,
and the monitor checks once per period. Figures move by tens of percent on a busy
2-CPU machine; compare within one run.

``--json`` prints ``{"backend", "sigkill": {series: {"n", "median_ms", "p90_ms",
"max_ms"}}, "sigstop": [{"timeout_s", "n", "median_ms", "max_ms", "median_ratio",
"max_ratio"}]}`` with series ``call_restart``, ``restart_ready``, ``call_supervise``,
``supervise_callable`` and ``call_non_owner`` (an actor of another mesh, handed the
sleepers, waits on rank 1: the time until its call raises, in its own process).

Usage::

    python bench/bench_detection.py                  # 50 SIGKILL trials, 3 per timeout
    python bench/bench_detection.py --quick --json   # 10 and 2 trials
    python bench/bench_detection.py --trials 20 --backend trio

No process is left behind: a stopped worker is sent SIGCONT in a ``finally`` block,
every mesh is left through ``async with`` (stop, then kill), and workers exit by
themselves when this process dies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any

import anyio

import amesh
from amesh import Actor, ActorMesh, Failure, ProcMesh, RestartPolicy, SupervisionError, endpoint

#: No single trial may take longer than this, in seconds.
TRIAL_TIMEOUT = 30.0
STOP_TIMEOUTS = (0.5, 1.0, 2.0)
STOP_PERIOD = 0.1


class Sleeper(Actor):
    """Has a call that never returns, and says when that call has arrived."""

    def __init__(self) -> None:
        self.hanging = anyio.Event()

    @endpoint(concurrent=True)
    async def hang(self) -> None:
        self.hanging.set()
        await anyio.sleep_forever()

    @endpoint(concurrent=True)
    async def wait_hanging(self) -> None:
        await self.hanging.wait()


async def signal_during_call(
    mesh: ActorMesh[Sleeper], pid: int, signo: int, expect: str
) -> tuple[float, float]:
    """Send ``signo`` to ``pid`` while a call to it is in flight; ``(t0, t1)`` in seconds.

    ``t0`` is taken right before the signal, ``t1`` when the call raises.

    Raises:
        RuntimeError: the call ended otherwise, or its error does not mention ``expect``.
    """
    got: list[tuple[float, SupervisionError]] = []

    async def call() -> None:
        try:
            await mesh.hang.call_one()
        except SupervisionError as exc:
            got.append((time.perf_counter(), exc))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await mesh.wait_hanging.call_one()  # the hang call is in the worker now
        t0 = time.perf_counter()
        os.kill(pid, signo)
    if not got:
        raise RuntimeError("the call in flight did not raise SupervisionError")
    t1, exc = got[0]
    if expect not in str(exc):
        raise RuntimeError(f"expected {expect!r} in the error, got: {exc}")
    return t0, t1


class Proxy(Actor):
    """Calls a mesh it was handed but does not own (a non-owner caller)."""

    @endpoint(concurrent=True)
    async def call_hang(self, other: ActorMesh[Sleeper]) -> float:
        """``time.perf_counter()`` when the call to ``other`` raised SupervisionError
        (CLOCK_MONOTONIC on Linux: comparable across processes)."""
        try:
            await other.hang.call_one()
        except SupervisionError:
            return time.perf_counter()
        raise RuntimeError("the call returned")


async def sigkill_non_owner(trials: int) -> list[float]:
    """Kill rank 1 ``trials`` times while an actor of another mesh (not the owner)
    waits on it: how long until that actor's call raises."""
    times: list[float] = []
    policy = RestartPolicy("one_for_one", max_restarts=trials + 1, within=3600)
    async with ProcMesh(per_host={"procs": 1}) as callers:
        proxy = await callers.spawn("proxy", Proxy)
        async with ProcMesh(per_host={"procs": 2}) as procs:
            mesh = await procs.spawn("sleepers", Sleeper, restart=policy)
            rank1 = mesh.slice(procs=1)
            for _ in range(trials):
                got: list[float] = []
                with anyio.fail_after(TRIAL_TIMEOUT):

                    async def call(got: list[float] = got) -> None:
                        got.append(await proxy.call_hang.call_one(rank1))

                    async def own_call() -> None:
                        # The non-owner may hear of the death first (its own broken
                        # link): wait until the owner has too, so that ready() below
                        # waits for the restart.
                        with contextlib.suppress(SupervisionError):
                            await rank1.hang.call_one()

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(call)
                        await rank1.wait_hanging.call_one()
                        tg.start_soon(own_call)
                        await rank1.wait_hanging.call_one()
                        t0 = time.perf_counter()
                        os.kill(procs.pids[1], signal.SIGKILL)
                    await procs.ready()
                times.append(got[0] - t0)
    return times


async def sigkill_with_restart(trials: int) -> tuple[list[float], list[float]]:
    """Kill rank 1 ``trials`` times under a restart policy: (call latencies, restart times)."""
    calls: list[float] = []
    ready: list[float] = []
    policy = RestartPolicy("one_for_one", max_restarts=trials + 1, within=3600)
    async with ProcMesh(per_host={"procs": 2}) as procs:
        mesh = await procs.spawn("sleepers", Sleeper, restart=policy)
        rank1 = mesh.slice(procs=1)
        for _ in range(trials):
            with anyio.fail_after(TRIAL_TIMEOUT):
                t0, t1 = await signal_during_call(rank1, procs.pids[1], signal.SIGKILL, "SIGKILL")
                await procs.ready()
                t2 = time.perf_counter()
            calls.append(t1 - t0)
            ready.append(t2 - t0)
        if procs.restarts != trials:
            raise RuntimeError(f"expected {trials} restarts, saw {procs.restarts}")
    return calls, ready


async def sigkill_with_supervise(trials: int) -> tuple[list[float], list[float]]:
    """Kill rank 1 of a fresh mesh per trial: (call latencies, supervise= latencies)."""
    calls: list[float] = []
    heard: list[float] = []
    for _ in range(trials):
        seen: list[float] = []
        event = anyio.Event()

        def supervise(failure: Failure, seen: list[float] = seen, event: Any = event) -> bool:
            seen.append(time.perf_counter())
            event.set()
            return True

        with anyio.fail_after(TRIAL_TIMEOUT):
            async with ProcMesh(per_host={"procs": 2}, supervise=supervise) as procs:
                mesh = await procs.spawn("sleepers", Sleeper)
                t0, t1 = await signal_during_call(
                    mesh.slice(procs=1), procs.pids[1], signal.SIGKILL, "SIGKILL"
                )
                await event.wait()
        calls.append(t1 - t0)
        heard.append(seen[0] - t0)
    return calls, heard


async def sigstop(timeout: float, trials: int) -> list[float]:
    """Stop rank 1 ``trials`` times with heartbeat timeout ``timeout``: detection times."""
    times: list[float] = []
    policy = RestartPolicy("one_for_one", max_restarts=trials + 1, within=3600)
    async with ProcMesh(
        per_host={"procs": 2}, heartbeat_period=STOP_PERIOD, heartbeat_timeout=timeout
    ) as procs:
        mesh = await procs.spawn("sleepers", Sleeper, restart=policy)
        for _ in range(trials):
            pid = procs.pids[1]
            detected = False
            try:
                with anyio.fail_after(TRIAL_TIMEOUT):
                    t0, t1 = await signal_during_call(
                        mesh.slice(procs=1), pid, signal.SIGSTOP, "no heartbeat"
                    )
                    detected = True
                    await procs.ready()
            finally:
                if not detected:  # not killed by the framework: let it run (and stop)
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            times.append(t1 - t0)
    return times


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the sorted values (``q`` in 0..1)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {
        "n": len(ms),
        "median_ms": quantile(ms, 0.5),
        "p90_ms": quantile(ms, 0.9),
        "max_ms": max(ms),
    }


async def run_all(trials: int, stop_trials: int, progress: bool) -> dict[str, Any]:
    def say(text: str) -> None:
        if progress:
            print(text, file=sys.stderr, flush=True)

    say(f"SIGKILL under a restart policy, {trials} trials ...")
    call_restart, restart_ready = await sigkill_with_restart(trials)
    say(f"SIGKILL seen by a caller that is not the owner, {trials} trials ...")
    call_non_owner = await sigkill_non_owner(trials)
    say(f"SIGKILL with a supervise= callable, {trials} fresh meshes ...")
    call_supervise, supervise_callable = await sigkill_with_supervise(trials)
    stops = []
    for timeout in STOP_TIMEOUTS:
        say(f"SIGSTOP with heartbeat_timeout {timeout:g} s, {stop_trials} trials ...")
        times = await sigstop(timeout, stop_trials)
        ratios = [t / timeout for t in times]
        stops.append(
            {
                "timeout_s": timeout,
                "n": len(times),
                "median_ms": quantile(times, 0.5) * 1e3,
                "max_ms": max(times) * 1e3,
                "median_ratio": quantile(ratios, 0.5),
                "max_ratio": max(ratios),
            }
        )
    return {
        "sigkill": {
            "call_restart": summary(call_restart),
            "restart_ready": summary(restart_ready),
            "call_supervise": summary(call_supervise),
            "supervise_callable": summary(supervise_callable),
            "call_non_owner": summary(call_non_owner),
        },
        "sigstop": stops,
    }


LABELS = {
    "call_restart": "call raises (restart policy mesh)",
    "restart_ready": "kill -> procs.ready() (restarted)",
    "call_supervise": "call raises (fresh mesh, supervise=)",
    "supervise_callable": "supervise= callable called",
    "call_non_owner": "call raises in a non-owner actor",
}


def print_table(result: dict[str, Any], trials: int, stop_trials: int) -> None:
    print(f"SIGKILL of rank 1, 2-process mesh, {trials} trials, backend {result['backend']}")
    print(f"  {'time from os.kill until':<38}{'median':>9}{'p90':>9}{'max':>9}  (ms)")
    for key, label in LABELS.items():
        s = result["sigkill"][key]
        print(f"  {label:<38}{s['median_ms']:>9.2f}{s['p90_ms']:>9.2f}{s['max_ms']:>9.2f}")
    print()
    print(
        f"SIGSTOP of rank 1, heartbeat_period {STOP_PERIOD:g} s, {stop_trials} trials per "
        "heartbeat_timeout T"
    )
    print(f"  {'T (s)':>6}{'median ms':>12}{'max ms':>10}{'median/T':>10}{'max/T':>8}")
    for s in result["sigstop"]:
        print(
            f"  {s['timeout_s']:>6g}{s['median_ms']:>12.1f}{s['max_ms']:>10.1f}"
            f"{s['median_ratio']:>10.2f}{s['max_ratio']:>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--trials", type=int, help="SIGKILL trials per series (default 50)")
    parser.add_argument(
        "--stop-trials", type=int, help="SIGSTOP trials per heartbeat timeout (default 3)"
    )
    parser.add_argument("--quick", action="store_true", help="10 SIGKILL and 2 SIGSTOP trials")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--verbose", action="store_true", help="keep amesh's failure logs")
    args = parser.parse_args()
    trials = args.trials or (10 if args.quick else 50)
    stop_trials = args.stop_trials or (2 if args.quick else 3)
    if trials < 1 or stop_trials < 1:
        parser.error("trial counts must be at least 1")
    if not args.verbose:
        # every trial is a failure that amesh logs at ERROR; the table says it all
        logging.getLogger("amesh").setLevel(logging.CRITICAL)
    result = amesh.run(run_all, trials, stop_trials, not args.json, backend=args.backend)
    result["backend"] = args.backend
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, trials, stop_trials)


if __name__ == "__main__":
    main()
