"""RPC benchmark: amesh ``call_one``/``call`` against a plain pynng request/reply baseline.

What is measured, in one run, with a 64-byte ``bytes`` payload echoed back:

* ``call_one latency`` -- sequential round trips to one actor in one worker process
  (``mesh.slice(procs=0).echo.call_one(payload)``), p50 and p99 in microseconds.
* ``pipelined throughput`` -- calls per second with 64 ``call_one`` loops running
  concurrently in one task group against that same actor.
* ``call() to N`` -- latency of one ``call`` to the first N ranks of a 16-process mesh
  (N = 1, 4, 16): the time until all N replies are in.

The baseline is the same work done with nothing but pynng: the bench process (client,
asyncio ``asend``/``arecv``) talks to 16 child processes that each run a synchronous
``Rep0`` echo loop on an ``ipc://`` socket in a temporary directory. Latency is a
``Req0`` round trip; throughput uses 64 ``Req0`` contexts of one socket; "call() to N"
is N concurrent round trips to N servers. The baseline client always runs on asyncio
(uvloop when installed, as ``amesh.run`` does); ``--backend`` only changes amesh's loop.

Reading the table: the ``amesh/pynng`` column is the ratio of the two figures. For
latencies it is the slowdown (2.0 = amesh takes twice as long per call); for throughput
below 1.0 means amesh completes fewer calls per second. A round trip includes waking
the other process, ~40 us per hop across the two CPUs of this VM (a pipe ping-pong), and
NNG's own thread hand-offs; ``--cpus 0`` (like ``taskset -c 0``) pins this process and
every child to one CPU to compare. amesh uses its default transport (abstract sockets
on Linux); the baseline uses ``ipc://`` files. Figures move by tens of percent between
runs on a busy machine: compare ratios from one run, not figures across runs.

``--json`` prints ``{metric: {"amesh": x, "pynng": y, "ratio": x / y}}`` with metrics
``call_one_p50_us``, ``call_one_p99_us``, ``pipelined_calls_per_s`` and
``call_{1,4,16}_{p50,p99}_us``; ``pynng``/``ratio`` are null where there is no baseline.

Usage::

    python bench/bench_rpc.py                  # full run, table
    python bench/bench_rpc.py --quick --json   # small counts (~10-15 s), JSON
    python bench/bench_rpc.py --backend trio --cpus 0

The run leaves no processes or socket files behind, also on Ctrl-C or SIGTERM: the
servers are killed and the temporary directory removed in ``finally`` blocks, and the
servers (like amesh workers) also exit by themselves when this process dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pynng

if TYPE_CHECKING:
    from amesh import ActorMesh

# amesh itself is imported lazily (in the controller only), so that the 16 baseline
# servers, which run this file with ``--server``, start without paying for it.

PAYLOAD = b"x" * 64
MESH_SIZES = (1, 4, 16)
CONCURRENCY = 64
SERVER_START_TIMEOUT = 30.0
#: Upper bound for any one measured phase; a hang fails the run instead of blocking it.
PHASE_TIMEOUT = 120.0


@dataclass(frozen=True)
class Plan:
    """Sample counts of one run."""

    warmup: int
    latency_samples: int
    throughput_calls: int
    mesh_samples: int


FULL = Plan(warmup=300, latency_samples=2000, throughput_calls=20_000, mesh_samples=1000)
QUICK = Plan(warmup=30, latency_samples=200, throughput_calls=2_000, mesh_samples=50)


# -- statistics -----------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of ``samples``."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Figures:
    """Everything one side (amesh or pynng) measured; latencies in seconds."""

    latency: list[float]
    throughput: float
    mesh: dict[int, list[float] | None]


async def time_calls(fn: Callable[[], Awaitable[object]], warmup: int, n: int) -> list[float]:
    """Await ``fn()`` ``warmup`` times, then ``n`` times timed one by one."""
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t0)
    return samples


def split_work(total: int, tasks: int) -> list[int]:
    """``total`` calls spread over ``tasks`` loops as evenly as possible."""
    return [total // tasks + (1 if i < total % tasks else 0) for i in range(tasks)]


# -- pynng baseline: servers ------------------------------------------------------------------


def _die_with_parent() -> None:
    """Exit when the bench process goes away, however it goes."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG

    def watch_stdin() -> None:  # the parent holds our stdin pipe open while it lives
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()


def serve(addr: str) -> None:
    """The baseline server (``--server ADDR``): a synchronous Rep0 echo loop."""
    # The parent decides when we stop (it kills us in its cleanup).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    sock = pynng.Rep0()
    sock.listen(addr)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        sock.send(sock.recv())


class ServerPool:
    """``n`` baseline server processes, each listening on ``ipc://<tmpdir>/sN.sock``.

    A context manager: leaving it kills the processes and removes the directory.
    """

    def __init__(self, n: int) -> None:
        self._n = n
        self._dir: str | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self.addrs: list[str] = []

    def __enter__(self) -> ServerPool:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="amesh-bench-")
        for i in range(self._n):
            addr = f"ipc://{os.path.join(self._dir, f's{i}.sock')}"
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--server", addr],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                process_group=0,  # a terminal's Ctrl-C is for us; we stop them
            )
            self._procs.append(proc)
            self.addrs.append(addr)
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        for proc in self._procs:  # they start concurrently; wait for each "ready"
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
            if not ready or proc.stdout.readline() != b"ready\n":
                raise RuntimeError(f"baseline server {proc.pid} did not start")

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._procs.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


# -- pynng baseline: client -------------------------------------------------------------------


async def pynng_figures(addrs: list[str], plan: Plan) -> Figures:
    socks = []
    try:
        for addr in addrs:
            sock = pynng.Req0()
            socks.append(sock)
            sock.dial(addr, block=True)
        first = socks[0]

        async def round_trip(s: Any = first) -> bytes:  # a Req0 socket or context
            await s.asend(PAYLOAD)
            reply: bytes = await s.arecv()
            return reply

        async with asyncio.timeout(PHASE_TIMEOUT):
            if await round_trip() != PAYLOAD:
                raise RuntimeError("the baseline server did not echo the payload")
            latency = await time_calls(round_trip, plan.warmup, plan.latency_samples)

        # Pipelining: a Req0 socket has one request in flight, but each context of it
        # is an independent requester, so 64 contexts on one socket give 64 concurrent
        # request/reply exchanges over one connection, as amesh's 64 call_one loops do
        # (both sides correlate replies to requests; Push/Pull pairs would not).
        contexts = [first.new_context() for _ in range(CONCURRENCY)]
        try:

            async def loop(ctx: Any, n: int) -> None:
                for _ in range(n):
                    await round_trip(ctx)

            async with asyncio.timeout(PHASE_TIMEOUT):
                for ctx in contexts:  # warm up every context
                    await round_trip(ctx)
                counts = split_work(plan.throughput_calls, CONCURRENCY)
                t0 = time.perf_counter()
                async with asyncio.TaskGroup() as tg:
                    for ctx, n in zip(contexts, counts):
                        tg.create_task(loop(ctx, n))
                throughput = sum(counts) / (time.perf_counter() - t0)
        finally:
            for ctx in contexts:
                ctx.close()

        # call() to N: N concurrent round trips, one to each of N servers.
        mesh: dict[int, list[float] | None] = {}
        for n in MESH_SIZES:
            if n > len(socks):
                mesh[n] = None
                continue
            targets = socks[:n]

            async def scatter(targets: list[Any] = targets) -> None:
                await asyncio.gather(*(round_trip(s) for s in targets))

            async with asyncio.timeout(PHASE_TIMEOUT):
                mesh[n] = await time_calls(scatter, plan.warmup, plan.mesh_samples)
        return Figures(latency, throughput, mesh)
    finally:
        for sock in socks:
            sock.close()


_interrupted = threading.Event()


def _raise_interrupt(signum: int, frame: object) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def run_pynng(plan: Plan) -> Figures:
    loop_factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    # asyncio.Runner turns Ctrl-C into cancelling the main task, but pynng's arecv
    # swallows a cancellation that races with its reply, and the run then goes on as if
    # nothing happened. So Ctrl-C raises KeyboardInterrupt right away instead, and since
    # that too is lost when it lands in a __del__, a flag is checked at the end.
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        with ServerPool(max(MESH_SIZES)) as pool:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                figures = runner.run(pynng_figures(pool.addrs, plan))
        if _interrupted.is_set():
            raise KeyboardInterrupt
        return figures
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


# -- amesh ------------------------------------------------------------------------------------


def echo_actor_class() -> type[Any]:
    """The echo actor (built here so that ``--server`` processes need not import amesh)."""
    from amesh import Actor, endpoint

    class Echo(Actor):
        @endpoint
        async def echo(self, x: bytes) -> bytes:
            return x

    return Echo


async def amesh_figures(plan: Plan) -> Figures:
    import anyio

    from amesh import ProcMesh

    async with ProcMesh(per_host={"procs": max(MESH_SIZES)}) as procs:
        mesh: ActorMesh[Any] = await procs.spawn("echo", echo_actor_class())
        one = mesh.slice(procs=0)

        async def call_one() -> bytes:
            reply: bytes = await one.echo.call_one(PAYLOAD)
            return reply

        with anyio.fail_after(PHASE_TIMEOUT):
            if await call_one() != PAYLOAD:
                raise RuntimeError("the echo actor did not echo the payload")
            latency = await time_calls(call_one, plan.warmup, plan.latency_samples)

        async def loop(n: int) -> None:
            for _ in range(n):
                await call_one()

        with anyio.fail_after(PHASE_TIMEOUT):
            async with anyio.create_task_group() as tg:  # warm-up, as many in flight
                for _ in range(CONCURRENCY):
                    tg.start_soon(loop, 1)
            counts = split_work(plan.throughput_calls, CONCURRENCY)
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for n in counts:
                    tg.start_soon(loop, n)
            throughput = sum(counts) / (time.perf_counter() - t0)

        by_size: dict[int, list[float] | None] = {}
        for n in MESH_SIZES:
            sub = mesh.slice(procs=slice(0, n))

            async def call(sub: ActorMesh[Any] = sub) -> None:
                await sub.echo.call(PAYLOAD)

            with anyio.fail_after(PHASE_TIMEOUT):
                by_size[n] = await time_calls(call, plan.warmup, plan.mesh_samples)
        return Figures(latency, throughput, by_size)


def run_amesh(plan: Plan, backend: str) -> Figures:
    import amesh

    # On trio, Ctrl-C lands in whichever task runs, amesh's own included: amesh.run then
    # raises it inside an exception group, or even returns None (it swallows it).
    try:
        figures: Figures | None = amesh.run(amesh_figures, plan, backend=backend)
    except BaseExceptionGroup as group:
        interrupts, rest = group.split(KeyboardInterrupt)
        if interrupts is not None and rest is None:
            raise KeyboardInterrupt from None
        raise
    if figures is None:
        raise KeyboardInterrupt
    return figures


# -- report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    amesh: float
    pynng: float | None

    @property
    def ratio(self) -> float | None:
        return None if not self.pynng else self.amesh / self.pynng


def metrics(am: Figures, base: Figures) -> Iterator[Metric]:
    def us(samples: list[float] | None, q: float) -> float | None:
        return None if samples is None else percentile(samples, q) * 1e6

    for q, name in ((0.5, "p50"), (0.99, "p99")):
        yield Metric(
            f"call_one_{name}_us",
            f"call_one latency {name}",
            "us",
            percentile(am.latency, q) * 1e6,
            us(base.latency, q),
        )
    yield Metric(
        "pipelined_calls_per_s",
        f"pipelined throughput ({CONCURRENCY} in flight)",
        "calls/s",
        am.throughput,
        base.throughput,
    )
    for n in MESH_SIZES:
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            value = us(am.mesh[n], q)
            assert value is not None
            yield Metric(
                f"call_{n}_{name}_us", f"call() to {n} {name}", "us", value, us(base.mesh[n], q)
            )


def render_table(rows: list[Metric], header: str) -> str:
    def fmt(x: float | None, digits: int = 1) -> str:
        return "n/a" if x is None else f"{x:,.{digits}f}"

    lines = [
        header,
        f"{'metric':<36}{'unit':>8}{'amesh':>12}{'pynng':>12}{'amesh/pynng':>13}",
        "-" * 81,
    ]
    for m in rows:
        lines.append(
            f"{m.label:<36}{m.unit:>8}{fmt(m.amesh):>12}{fmt(m.pynng):>12}{fmt(m.ratio, 2):>13}"
        )
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="small sample counts (for tests)")
    p.add_argument("--json", action="store_true", help="print a JSON dict of metrics")
    p.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    p.add_argument(
        "--cpus",
        help="pin this process and all children to these CPUs, e.g. 0 or 0,1",
    )
    p.add_argument("--server", metavar="ADDR", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    # Take the Ctrl-C path, so every cleanup (servers, amesh workers) runs.
    signal.raise_signal(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server:
        serve(args.server)
        return 0
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    plan = QUICK if args.quick else FULL
    try:
        base = run_pynng(plan)
        am = run_amesh(plan, args.backend)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    rows = list(metrics(am, base))
    if args.json:
        out = {m.key: {"amesh": m.amesh, "pynng": m.pynng, "ratio": m.ratio} for m in rows}
        print(json.dumps(out, indent=2))
    else:
        cpus = sorted(os.sched_getaffinity(0))
        header = (
            f"amesh vs pynng RPC, {len(PAYLOAD)}-byte payload; amesh backend={args.backend}, "
            f"pynng client=asyncio; cpus={cpus}; {'quick' if args.quick else 'full'} run"
        )
        print(render_table(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
