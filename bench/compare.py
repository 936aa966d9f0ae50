"""amesh side by side with raw pynng, an asyncio floor, Ray, xoscar and Monarch.

One run measures every system in turn and prints one markdown table: each system's
figure and, in parentheses, its ratio to amesh's (system / amesh). The systems:

* ``amesh`` -- this package, default transport (abstract sockets on Linux), ``amesh.run``
  (asyncio + uvloop).
* ``pynng`` -- raw pynng: a ``Req0`` client on asyncio (uvloop) talking to synchronous
  ``Rep0`` echo servers, one process each, over ``ipc://`` files. No broadcast (Req/Rep
  has no fire-and-forget): ``n/a``.
* ``uvloop`` -- the floor for an event-loop program: length-prefixed frames over unix
  sockets between asyncio (Buffered)Protocols on uvloop, client and one server process
  per "actor".
* ``ray`` (Ray actors, ``async def`` methods, ``await ref``), ``xoscar`` (an actor pool
  with one sub-pool process per actor, driver on uvloop) and ``monarch``
  (``monarch.actor``: ``this_host().spawn_procs``, ``@endpoint``, ``call_one`` /
  ``call`` / ``broadcast``), when importable; otherwise every cell reads ``missing``.

What is measured (a 64-byte ``bytes`` payload that every actor echoes, unless noted):

* ``call_one`` round trip to one actor: p50 and p99 in microseconds;
* pipelined ``call_one``: calls per second with 64 calls in flight to that actor;
* ``call()`` to the first 1, 4, 16 (and 64) actors: p50 in milliseconds, until every
  reply is in; 64 actors means a second mesh of 64 processes (not with ``--quick``,
  and skipped when the memory that 16 processes took says 64 would not fit);
* broadcast: fire-and-forget to 16 actors, repeated, then a barrier (every actor's
  count of messages, polled until all arrived): deliveries per second;
* echo of 1 KiB, 1 MiB, 16 MiB and 64 MiB (64 MiB not with ``--quick``): GB/s,
  payload bytes out and back over the median round trip;
* spawn of 1, 4 and 16 processes with an actor in each, until every actor answered a
  call (s); a runtime's own start (``ray.init``) is not included (JSON: ``setup_s``);
* memory with the 16 processes up: PSS of the driver and all its descendants (MiB).

Every system runs in its own subprocess (its own session), which writes its figures to
a JSON file after each measurement; a per-measurement timeout turns a hang into a
``timeout`` cell and a failure into ``error`` (details below the table, tracebacks in
``<json dir>/compare-<system>.log``), and a per-system timeout ends a stuck system.
Everything stays on loopback: unix sockets, ``127.0.0.1`` for xoscar's pool, and Ray
with ``_node_ip_address="127.0.0.1"``, no dashboard, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
and usage stats off. Each system gets its own temporary directory (``TMPDIR``, Ray's
``_temp_dir``, ``XOSCAR_DIR``; ``HOME`` for Ray, whose auth token goes to ``~/.ray``);
it is removed at the end, and this process (a child subreaper) kills whatever a system
left running, also on Ctrl-C or SIGTERM. Monarch always logs to
``/tmp/<user>/monarch_log.log``; that file stays.

Reading the table: figures come from one run, one system after the other, so compare
ratios, not figures across runs. On a 2-CPU VM a round trip is dominated by waking the
other process (~40 us per hop across CPUs); run under ``taskset -c 0`` to see the
software's own cost (every process inherits the affinity).

Usage::

    python bench/compare.py                          # everything installed, full run
    python bench/compare.py --quick                  # small counts, no 64 actors/64 MiB
    python bench/compare.py --only amesh,ray --json /tmp/c.json
    taskset -c 0 python bench/compare.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

THIS = os.path.abspath(__file__)
SYSTEMS = (
    "amesh",
    "amesh-ext",
    "amesh-stream",
    "pynng",
    "uvloop",
    "ray",
    "xoscar",
    "monarch",
)
#: amesh with one transport implementation forced (``AMESH_TRANSPORT_IMPL``); the one
#: that is amesh's default is the ``amesh`` column and is not run twice.
AMESH_IMPLS = {"amesh-ext": "ext", "amesh-stream": "stream"}
TITLES = {
    "amesh": "amesh",
    "amesh-ext": "amesh (NNG + C ext)",
    "amesh-stream": "amesh (event-loop streams)",
    "pynng": "pynng Req/Rep",
    "uvloop": "uvloop floor",
    "ray": "Ray",
    "xoscar": "xoscar",
    "monarch": "Monarch",
}
#: The module that must be importable for a system to run.
MODULES = {
    "amesh": "amesh",
    "amesh-ext": "amesh",
    "amesh-stream": "amesh",
    "pynng": "pynng",
    "uvloop": "uvloop",
    "ray": "ray",
    "xoscar": "xoscar",
    "monarch": "monarch",
}
#: The distribution whose version is reported.
DISTS = {
    "amesh": "amesh",
    "amesh-ext": "amesh",
    "amesh-stream": "amesh",
    "pynng": "pynng",
    "uvloop": "uvloop",
    "ray": "ray",
    "xoscar": "xoscar",
    "monarch": "torchmonarch",
}

PAYLOAD = b"x" * 64
CONCURRENCY = 64
MESH = 16
BIG_MESH = 64
CALL_SIZES = (1, 4, 16, BIG_MESH)
SPAWN_SIZES = (1, 4, MESH)
ECHO_SIZES = {"1KiB": 1 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20}
CLOSE_TIMEOUT = 60.0
#: Memory kept free when deciding whether the 64-process mesh fits (bytes): the machine
#: may be shared.
MEMORY_RESERVE = 6 << 30

MU = "\u00b5"  # micro sign
TIMES = "\u00d7"  # multiplication sign


@dataclass(frozen=True)
class MetricDef:
    key: str
    label: str
    unit: str
    higher_is_better: bool


def _plural(n: int, word: str, suffix: str = "s") -> str:
    return f"{n} {word}{suffix if n != 1 else ''}"


METRICS = (
    MetricDef("call_one_p50_us", "call_one round trip p50", f"{MU}s", False),
    MetricDef("call_one_p99_us", "call_one round trip p99", f"{MU}s", False),
    MetricDef(
        "pipelined_calls_per_s", f"pipelined call_one, {CONCURRENCY} in flight", "calls/s", True
    ),
    *(
        MetricDef(f"call_{n}_p50_ms", f"call() to {_plural(n, 'actor')} p50", "ms", False)
        for n in CALL_SIZES
    ),
    MetricDef(
        "broadcast_deliveries_per_s",
        f"broadcast to {MESH} actors + barrier",
        "deliveries/s",
        True,
    ),
    *(
        MetricDef(f"echo_{name}_GBps", f"echo {name} (out and back)", "GB/s", True)
        for name in ECHO_SIZES
    ),
    *(
        MetricDef(
            f"spawn_{n}_s", f"spawn {_plural(n, 'process', 'es')}, an actor in each", "s", False
        )
        for n in SPAWN_SIZES
    ),
    MetricDef("mesh_16_pss_mib", f"memory, {MESH} processes up (PSS)", "MiB", False),
)
MESH_KEYS = [
    m.key
    for m in METRICS
    if not m.key.startswith(("spawn_", f"call_{BIG_MESH}_")) and m.key != "mesh_16_pss_mib"
]


@dataclass(frozen=True)
class Plan:
    """Sample counts and time limits of one run."""

    name: str
    warmup: int
    latency_samples: int
    pipelined_calls: int
    call_samples: int
    big_call_samples: int  # call() to 64; 0 skips the 64-process mesh
    broadcast_rounds: int
    echo_reps: tuple[tuple[str, int], ...]  # sizes not listed are skipped
    measure_timeout: float
    spawn_timeout: float
    big_spawn_timeout: float
    system_timeout: float


FULL = Plan(
    name="full",
    warmup=50,
    latency_samples=1000,
    pipelined_calls=5000,
    call_samples=100,
    big_call_samples=30,
    broadcast_rounds=100,
    echo_reps=(("1KiB", 200), ("1MiB", 30), ("16MiB", 8), ("64MiB", 4)),
    measure_timeout=120.0,
    spawn_timeout=180.0,
    big_spawn_timeout=400.0,
    system_timeout=1200.0,
)
QUICK = Plan(
    name="quick",
    warmup=10,
    latency_samples=200,
    pipelined_calls=1000,
    call_samples=20,
    big_call_samples=0,
    broadcast_rounds=20,
    echo_reps=(("1KiB", 30), ("1MiB", 5), ("16MiB", 3)),
    measure_timeout=60.0,
    spawn_timeout=120.0,
    big_spawn_timeout=0.0,
    system_timeout=480.0,
)
PLANS = {p.name: p for p in (FULL, QUICK)}


# -- processes ---------------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, str]]:
    """``pid -> (ppid, state)`` of every process, from ``/proc``."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data.rsplit(b")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), fields[0].decode())
    return table


def descendants(root: int, *, live_only: bool = False) -> list[int]:
    """Every process below ``root`` (children first), optionally without zombies."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    if live_only:
        found = [p for p in found if table.get(p, (0, "Z"))[1] != "Z"]
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _reap() -> None:
    """Collect exited children (ours, and orphans handed to us as subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_below(root: int, *, reap: bool) -> list[str]:
    """SIGKILL every live process below ``root``; returns what was found alive."""
    killed: list[str] = []
    for _ in range(50):
        pids = descendants(root, live_only=True)
        if not pids:
            break
        for pid in pids:
            killed.append(f"{_comm(pid)}[{pid}]")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if reap:
            _reap()
        time.sleep(0.1)
    if reap:
        _reap()
    return sorted(set(killed))


def tree_pss_mib(root: int) -> float:
    """Proportional set size of ``root`` and all its descendants, in MiB."""
    total_kib = 0
    for pid in [root, *descendants(root, live_only=True)]:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total_kib += int(line.split()[1])
                        break
        except OSError:
            continue
    return total_kib / 1024


def _affinities() -> list[list[int]]:
    """The distinct CPU sets this process and its descendants may run on."""
    found = set()
    for pid in [os.getpid(), *descendants(os.getpid(), live_only=True)]:
        with contextlib.suppress(OSError):
            found.add(tuple(sorted(os.sched_getaffinity(pid))))
    return [list(cpus) for cpus in sorted(found)]


def mem_available() -> int:
    """``MemAvailable`` in bytes (0 if unknown)."""
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 0


def _watch_parent(on_exit: Callable[[], None] | None = None, *, deathsig: bool) -> None:
    """Exit when the process that started us goes away (it holds our stdin open)."""
    if deathsig and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PDEATHSIG

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        if on_exit is not None:
            with contextlib.suppress(Exception):
                on_exit()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


# -- statistics and helpers --------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def split_work(total: int, tasks: int) -> list[int]:
    return [total // tasks + (1 if i < total % tasks else 0) for i in range(tasks)]


async def _await(aw: Awaitable[T]) -> T:
    return await aw


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all at once; the first failure cancels the rest."""
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(_await(aw)) for aw in aws]
    return [t.result() for t in tasks]


async def time_calls(fn: Callable[[], Awaitable[object]], warmup: int, n: int) -> list[float]:
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t0)
    return samples


class Unsupported(Exception):
    """The system has no such operation (the cell reads ``n/a``)."""


# -- the systems -------------------------------------------------------------------------------


class Group:
    """``size`` processes with one echo actor each, rank 0 first."""

    size: int

    async def call_one(self, payload: bytes) -> bytes:
        raise NotImplementedError

    def callers(self, k: int) -> list[Callable[[bytes], Awaitable[bytes]]]:
        """``k`` independent ways to call rank 0 concurrently."""
        return [self.call_one] * k

    async def call(self, k: int, payload: bytes) -> None:
        """Call the first ``k`` ranks, return when all replied."""
        raise NotImplementedError

    async def broadcast(self, payload: bytes) -> None:
        """Fire-and-forget ``bump`` to every rank."""
        raise Unsupported("no fire-and-forget")

    async def counts(self) -> list[int]:
        """Every rank's count of ``bump`` messages handled."""
        raise Unsupported("no fire-and-forget")

    async def close(self) -> None:
        raise NotImplementedError


class Driver:
    """How one system starts, calls and stops its processes."""

    loop = "asyncio"

    def run(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        asyncio.run(fn(*args))

    async def setup(self) -> None:
        pass

    async def start(self, n: int) -> Group:
        raise NotImplementedError

    async def teardown(self) -> None:
        pass


def _run_on_uvloop(fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(fn(*args))


# -- amesh


def _amesh_actor() -> type[Any]:
    from amesh import Actor, endpoint

    class Echo(Actor):
        def __init__(self) -> None:
            self.n = 0

        @endpoint
        async def echo(self, x: bytes) -> bytes:
            return x

        @endpoint
        async def bump(self, x: bytes) -> None:
            self.n += 1

        @endpoint
        async def count(self) -> int:
            return self.n

    return Echo


class AmeshGroup(Group):
    def __init__(self, stack: contextlib.AsyncExitStack, mesh: Any, n: int) -> None:
        self.size = n
        self._stack = stack
        self._mesh = mesh
        self._one = mesh.slice(procs=0)
        self._subs = {k: mesh.slice(procs=slice(0, k)) for k in CALL_SIZES if k <= n}

    async def call_one(self, payload: bytes) -> bytes:
        reply: bytes = await self._one.echo.call_one(payload)
        return reply

    async def call(self, k: int, payload: bytes) -> None:
        await self._subs[k].echo.call(payload)

    async def broadcast(self, payload: bytes) -> None:
        await self._mesh.bump.broadcast(payload)

    async def counts(self) -> list[int]:
        return list((await self._mesh.count.call()).values())

    async def close(self) -> None:
        await self._stack.aclose()


class AmeshDriver(Driver):
    loop = "amesh.run (asyncio + uvloop)"

    def __init__(self) -> None:
        import amesh

        self._amesh = amesh
        self._cls = _amesh_actor()

    def run(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        self._amesh.run(fn, *args)

    async def start(self, n: int) -> Group:
        stack = contextlib.AsyncExitStack()
        try:
            procs = await stack.enter_async_context(self._amesh.ProcMesh(per_host={"procs": n}))
            mesh = await procs.spawn("echo", self._cls)
            await mesh.count.call()
        except BaseException:
            await stack.aclose()
            raise
        return AmeshGroup(stack, mesh, n)


# -- baseline servers (this file with --serve KIND ADDR)

_serial = iter(range(1 << 30))


class Servers:
    """``n`` server processes of one kind, each listening on its own unix socket."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.dir = tempfile.mkdtemp(prefix=f"{kind}-")
        self.addrs: list[str] = []
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, n: int) -> None:
        for _ in range(n):
            path = os.path.join(self.dir, f"s{next(_serial)}.sock")
            addr = f"ipc://{path}" if self.kind == "pynng" else path
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                THIS,
                "--serve",
                self.kind,
                addr,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            self.procs.append(proc)
            self.addrs.append(addr)
        for proc in self.procs:
            assert proc.stdout is not None
            if await proc.stdout.readline() != b"ready\n":
                raise RuntimeError(f"{self.kind} server {proc.pid} did not start")

    async def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in self.procs:
            await proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _ready() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()


def serve(kind: str, addr: str) -> None:
    """A baseline server: a sync pynng ``Rep0`` echo loop, or the uvloop floor server."""
    _watch_parent(deathsig=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if kind == "pynng":
        import pynng

        sock = pynng.Rep0()
        sock.listen(addr)
        _ready()
        while True:
            sock.send(sock.recv())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(FloorServer, addr)
        _ready()
        async with server:
            await server.serve_forever()

    _run_on_uvloop(main)


# -- pynng


class PynngGroup(Group):
    def __init__(self, servers: Servers, socks: list[Any]) -> None:
        self.size = len(socks)
        self._servers = servers
        self._socks = socks
        self._contexts: list[Any] = []

    @staticmethod
    async def _round_trip(sock: Any, payload: bytes) -> bytes:  # a Req0 socket or context
        await sock.asend(payload)
        reply: bytes = await sock.arecv()
        return reply

    async def call_one(self, payload: bytes) -> bytes:
        return await self._round_trip(self._socks[0], payload)

    def callers(self, k: int) -> list[Callable[[bytes], Awaitable[bytes]]]:
        # A Req0 socket has one request in flight; each of its contexts is a requester.
        contexts = [self._socks[0].new_context() for _ in range(k)]
        self._contexts.extend(contexts)
        return [functools.partial(self._round_trip, c) for c in contexts]

    async def call(self, k: int, payload: bytes) -> None:
        await gather_all(self._round_trip(s, payload) for s in self._socks[:k])

    async def broadcast(self, payload: bytes) -> None:
        raise Unsupported("Req/Rep has no fire-and-forget")

    async def counts(self) -> list[int]:
        raise Unsupported("Req/Rep has no fire-and-forget")

    async def close(self) -> None:
        for ctx in self._contexts:
            ctx.close()
        for sock in self._socks:
            sock.close()
        await self._servers.close()


class PynngDriver(Driver):
    loop = "asyncio + uvloop (servers: sync Rep0)"

    def __init__(self) -> None:
        import pynng

        self._pynng = pynng

    def run(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        _run_on_uvloop(fn, *args)

    async def start(self, n: int) -> Group:
        servers = Servers("pynng")
        socks: list[Any] = []
        try:
            await servers.start(n)
            for addr in servers.addrs:
                sock = self._pynng.Req0()
                socks.append(sock)
                sock.dial(addr, block=True)
            group = PynngGroup(servers, socks)
            await group.call(n, PAYLOAD)
        except BaseException:
            for sock in socks:
                sock.close()
            await servers.close()
            raise
        return group


# -- the uvloop floor: length-prefixed frames between asyncio Protocols

HEADER = struct.Struct("!IB")  # body length, kind
ECHO, BUMP, COUNT = 0, 1, 2
SMALL = 1 << 16  # frames up to this size are parsed from one receive buffer


def send_frame(transport: Any, kind: int, body: bytes | bytearray) -> None:
    header = HEADER.pack(len(body), kind)
    if len(body) < 4096:
        transport.write(header + body)
    else:
        transport.writelines((header, body))


class FrameProtocol(asyncio.BufferedProtocol):
    """Receives frames into one buffer, a large frame straight into its own bytearray."""

    def __init__(self) -> None:
        self.transport: Any = None
        self._buf = bytearray(SMALL)
        self._start = 0
        self._end = 0
        self._big: bytearray | None = None
        self._big_pos = 0
        self._big_kind = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def frame_received(self, kind: int, body: bytes | bytearray) -> None:
        raise NotImplementedError

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._big_pos :]
        if self._start and len(self._buf) - self._end < 4096:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None:
            self._big_pos += nbytes
            if self._big_pos == len(self._big):
                body, self._big = self._big, None
                self.frame_received(self._big_kind, body)
            return
        self._end += nbytes
        buf = self._buf
        while self._end - self._start >= HEADER.size:
            n, kind = HEADER.unpack_from(buf, self._start)
            body_at = self._start + HEADER.size
            if HEADER.size + n > SMALL:
                have = self._end - body_at
                big = bytearray(n)
                big[:have] = buf[body_at : self._end]
                self._start = self._end = 0
                self._big, self._big_pos, self._big_kind = big, have, kind
                return
            if self._end - body_at < n:
                break
            self._start = body_at + n
            self.frame_received(kind, bytes(memoryview(buf)[body_at : body_at + n]))
        if self._start == self._end:
            self._start = self._end = 0


class FloorServer(FrameProtocol):
    bumps = 0  # per server process (one client connection each)

    def frame_received(self, kind: int, body: bytes | bytearray) -> None:
        if kind == ECHO:
            send_frame(self.transport, ECHO, body)
        elif kind == BUMP:
            FloorServer.bumps += 1
        else:
            send_frame(self.transport, COUNT, struct.pack("!q", FloorServer.bumps))


class FloorClient(FrameProtocol):
    def __init__(self) -> None:
        super().__init__()
        self._waiters: deque[asyncio.Future[bytes | bytearray]] = deque()

    def frame_received(self, kind: int, body: bytes | bytearray) -> None:
        fut = self._waiters.popleft()
        if not fut.done():
            fut.set_result(body)

    def connection_lost(self, exc: Exception | None) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(ConnectionError("floor server connection lost"))

    async def request(self, kind: int, body: bytes) -> bytes | bytearray:
        fut: asyncio.Future[bytes | bytearray] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        send_frame(self.transport, kind, body)
        return await fut


class FloorGroup(Group):
    def __init__(self, servers: Servers, conns: list[FloorClient]) -> None:
        self.size = len(conns)
        self._servers = servers
        self._conns = conns

    async def call_one(self, payload: bytes) -> bytes:
        return await self._conns[0].request(ECHO, payload)  # type: ignore[return-value]

    async def call(self, k: int, payload: bytes) -> None:
        await gather_all(c.request(ECHO, payload) for c in self._conns[:k])

    async def broadcast(self, payload: bytes) -> None:
        for conn in self._conns:
            send_frame(conn.transport, BUMP, payload)

    async def counts(self) -> list[int]:
        replies = await gather_all(c.request(COUNT, b"") for c in self._conns)
        return [struct.unpack("!q", r)[0] for r in replies]

    async def close(self) -> None:
        for conn in self._conns:
            if conn.transport is not None:
                conn.transport.close()
        await self._servers.close()


class FloorDriver(Driver):
    loop = "uvloop, asyncio Protocols"

    def __init__(self) -> None:
        import uvloop  # noqa: F401  (the floor needs it on both ends)

    def run(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        _run_on_uvloop(fn, *args)

    async def start(self, n: int) -> Group:
        servers = Servers("uvloop")
        conns: list[FloorClient] = []
        try:
            await servers.start(n)
            loop = asyncio.get_running_loop()
            for path in servers.addrs:
                _, conn = await loop.create_unix_connection(FloorClient, path)
                conns.append(conn)
            group = FloorGroup(servers, conns)
            await group.call(n, PAYLOAD)
        except BaseException:
            for conn in conns:
                conn.transport.close()
            await servers.close()
            raise
        return group


# -- Ray


def _ray_actor(ray: Any) -> Any:
    class Echo:
        def __init__(self) -> None:
            self.n = 0

        async def echo(self, x: bytes) -> bytes:
            return x

        async def bump(self, x: bytes) -> None:
            self.n += 1

        async def count(self) -> int:
            return self.n

    return ray.remote(Echo)


class RayGroup(Group):
    def __init__(self, ray: Any, actors: list[Any]) -> None:
        self.size = len(actors)
        self._ray = ray
        self._actors = actors

    async def call_one(self, payload: bytes) -> bytes:
        reply: bytes = await self._actors[0].echo.remote(payload)
        return reply

    async def call(self, k: int, payload: bytes) -> None:
        await gather_all(a.echo.remote(payload) for a in self._actors[:k])

    async def broadcast(self, payload: bytes) -> None:
        for actor in self._actors:
            actor.bump.remote(payload)  # the ObjectRef is dropped: fire-and-forget

    async def counts(self) -> list[int]:
        return await gather_all(a.count.remote() for a in self._actors)

    async def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)


class RayDriver(Driver):
    loop = "asyncio (await ObjectRef)"

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._cls = _ray_actor(ray)

    async def setup(self) -> None:
        self._ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=os.cpu_count(),
            object_store_memory=1 << 30,
            _temp_dir=os.path.join(tempfile.gettempdir(), "ray"),
            log_to_driver=False,
        )

    async def start(self, n: int) -> Group:
        # num_cpus=0: actors only need a CPU to be scheduled by default, and 2 CPUs
        # would allow only 2 of them.
        actors = [self._cls.options(num_cpus=0).remote() for _ in range(n)]
        group = RayGroup(self._ray, actors)
        try:
            await group.counts()
        except BaseException:
            await group.close()
            raise
        return group

    async def teardown(self) -> None:
        self._ray.shutdown()


# -- xoscar


def _xoscar_actor() -> type[Any]:
    import xoscar as xo

    class Echo(xo.Actor):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        async def echo(self, x: bytes) -> bytes:
            return x

        async def bump(self, x: bytes) -> None:
            self.n += 1

        async def count(self) -> int:
            return self.n

    return Echo


class XoscarGroup(Group):
    def __init__(self, pool: Any, refs: list[Any]) -> None:
        self.size = len(refs)
        self._pool = pool
        self._refs = refs

    async def call_one(self, payload: bytes) -> bytes:
        reply: bytes = await self._refs[0].echo(payload)
        return reply

    async def call(self, k: int, payload: bytes) -> None:
        await gather_all(r.echo(payload) for r in self._refs[:k])

    async def broadcast(self, payload: bytes) -> None:
        for ref in self._refs:
            await ref.bump.tell(payload)

    async def counts(self) -> list[int]:
        return await gather_all(r.count() for r in self._refs)

    async def close(self) -> None:
        await self._pool.stop()


class XoscarDriver(Driver):
    loop = "uvloop (driver = main pool)"

    def __init__(self) -> None:
        import xoscar

        self._xo = xoscar
        self._cls = _xoscar_actor()

    def run(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        _run_on_uvloop(fn, *args)

    async def start(self, n: int) -> Group:
        xo = self._xo
        pool = await xo.create_actor_pool("127.0.0.1:0", n_process=n)
        try:
            serial = next(_serial)
            refs = await gather_all(
                xo.create_actor(
                    self._cls,
                    uid=f"echo-{serial}-{i}",
                    address=pool.external_address,
                    allocate_strategy=xo.allocate_strategy.ProcessIndex(i + 1),
                )
                for i in range(n)
            )
            group = XoscarGroup(pool, refs)
            await group.counts()
        except BaseException:
            await pool.stop()
            raise
        return group


# -- Monarch


def _monarch_actor() -> type[Any]:
    from monarch.actor import Actor, endpoint

    # Monarch: one actor class cannot mix sync and async endpoints.
    class Echo(Actor):
        def __init__(self) -> None:
            self.n = 0

        @endpoint
        async def echo(self, x: bytes) -> bytes:
            return x

        @endpoint
        async def bump(self, x: bytes) -> None:
            self.n += 1

        @endpoint
        async def count(self) -> int:
            return self.n

    return Echo


class MonarchGroup(Group):
    def __init__(self, procs: Any, mesh: Any, n: int) -> None:
        self.size = n
        self._procs = procs
        self._mesh = mesh
        self._one = mesh.slice(procs=0)
        self._subs = {k: mesh.slice(procs=slice(0, k)) for k in CALL_SIZES if k <= n}

    async def call_one(self, payload: bytes) -> bytes:
        reply: bytes = await self._one.echo.call_one(payload)
        return reply

    async def call(self, k: int, payload: bytes) -> None:
        await self._subs[k].echo.call(payload)

    async def broadcast(self, payload: bytes) -> None:
        self._mesh.bump.broadcast(payload)

    async def counts(self) -> list[int]:
        return list((await self._mesh.count.call()).values())

    async def close(self) -> None:
        await self._procs.stop()


class MonarchDriver(Driver):
    loop = "asyncio"

    def __init__(self) -> None:
        from monarch.actor import enable_transport, this_host

        enable_transport("ipc")  # unix sockets (also the default); before any other call
        self._this_host = this_host
        self._cls = _monarch_actor()

    async def start(self, n: int) -> Group:
        procs = self._this_host().spawn_procs(per_host={"procs": n})
        try:
            await procs.initialized
            mesh = procs.spawn("echo", self._cls)
            await mesh.count.call()
        except BaseException:
            await procs.stop()
            raise
        return MonarchGroup(procs, mesh, n)


DRIVERS: dict[str, Callable[[], Driver]] = {
    "amesh": AmeshDriver,
    "amesh-ext": AmeshDriver,
    "amesh-stream": AmeshDriver,
    "pynng": PynngDriver,
    "uvloop": FloorDriver,
    "ray": RayDriver,
    "xoscar": XoscarDriver,
    "monarch": MonarchDriver,
}


# -- measuring (in a system's own process) -----------------------------------------------------


class Recorder:
    """A system's results, rewritten to a JSON file after every change."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"status": "running", "metrics": {}, "errors": {}, "meta": {}}
        self.flush()

    def set(self, key: str, value: float | str, error: str | None = None) -> None:
        self.data["metrics"][key] = value
        if error:
            self.data["errors"][key] = error
        self.flush()

    def meta(self, key: str, value: Any) -> None:
        self.data["meta"][key] = value
        self.flush()

    def status(self, status: str, detail: str | None = None) -> None:
        self.data["status"] = status
        if detail:
            self.data["detail"] = detail
        self.flush()

    def flush(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


async def guarded(
    rec: Recorder, keys: list[str], timeout: float, fn: Callable[[], Awaitable[T]]
) -> T | None:
    """``await fn()`` within ``timeout``; on failure mark ``keys`` and return None."""
    try:
        async with asyncio.timeout(timeout):
            return await fn()
    except TimeoutError:
        traceback.print_exc()
        for key in keys:
            rec.set(key, "timeout", f"no result within {timeout:.0f} s")
    except Unsupported as exc:
        for key in keys:
            rec.set(key, "n/a", str(exc))
    except Exception as exc:
        traceback.print_exc()
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        for key in keys:
            rec.set(key, "error", message)
    return None


async def close_quietly(group: Group, rec: Recorder) -> None:
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await group.close()
    except Exception as exc:
        traceback.print_exc()
        rec.meta(f"close_error_{group.size}", f"{type(exc).__name__}: {exc}"[:300])


async def _pipelined(group: Group, plan: Plan) -> float:
    callers = group.callers(CONCURRENCY)

    async def loop(call: Callable[[bytes], Awaitable[bytes]], n: int) -> None:
        for _ in range(n):
            await call(PAYLOAD)

    await gather_all(loop(c, 1) for c in callers)  # warm every caller up
    counts = split_work(plan.pipelined_calls, CONCURRENCY)
    t0 = time.perf_counter()
    await gather_all(loop(c, n) for c, n in zip(callers, counts))
    return sum(counts) / (time.perf_counter() - t0)


async def _broadcast(group: Group, rounds: int) -> float:
    async def deliver(n: int) -> None:
        expected = [c + n for c in await group.counts()]
        for _ in range(n):
            await group.broadcast(PAYLOAD)
        # The barrier: poll every actor's count until all messages arrived (some
        # systems do not keep one sender's messages in order). Bounded by the timeout.
        for _ in range(1 << 30):
            counts = await group.counts()
            if all(c >= e for c, e in zip(counts, expected)):
                return
            await asyncio.sleep(0.001)

    await deliver(max(1, rounds // 10))  # warm-up
    t0 = time.perf_counter()
    await deliver(rounds)
    return rounds * group.size / (time.perf_counter() - t0)


async def measure_mesh(group: Group, plan: Plan, rec: Recorder) -> None:
    """Everything measured on the 16-process mesh."""
    limit = plan.measure_timeout
    rec.set("mesh_16_pss_mib", tree_pss_mib(os.getpid()))
    rec.meta("cpu_affinities", _affinities())

    async def latency() -> list[float]:
        if bytes(await group.call_one(PAYLOAD)) != PAYLOAD:
            raise RuntimeError("the actor did not echo the payload")
        return await time_calls(lambda: group.call_one(PAYLOAD), plan.warmup, plan.latency_samples)

    keys = ["call_one_p50_us", "call_one_p99_us"]
    samples = await guarded(rec, keys, limit, latency)
    if samples is not None:
        rec.set(keys[0], percentile(samples, 0.5) * 1e6)
        rec.set(keys[1], percentile(samples, 0.99) * 1e6)

    rate = await guarded(rec, ["pipelined_calls_per_s"], limit, lambda: _pipelined(group, plan))
    if rate is not None:
        rec.set("pipelined_calls_per_s", rate)

    for k in CALL_SIZES:
        if k > group.size:
            continue
        key = f"call_{k}_p50_ms"
        samples = await guarded(
            rec,
            [key],
            limit,
            lambda k=k: time_calls(  # type: ignore[misc]
                lambda: group.call(k, PAYLOAD), plan.warmup, plan.call_samples
            ),
        )
        if samples is not None:
            rec.set(key, percentile(samples, 0.5) * 1e3)

    key = "broadcast_deliveries_per_s"
    rate = await guarded(rec, [key], limit, lambda: _broadcast(group, plan.broadcast_rounds))
    if rate is not None:
        rec.set(key, rate)

    reps = dict(plan.echo_reps)
    for name, size in ECHO_SIZES.items():
        key = f"echo_{name}_GBps"
        if name not in reps:
            rec.set(key, "skipped")
            continue
        payload = b"x" * size

        async def echo(payload: bytes = payload, n: int = reps[name]) -> list[float]:
            if len(await group.call_one(payload)) != len(payload):
                raise RuntimeError("the echo came back with another size")
            return await time_calls(lambda: group.call_one(payload), 1, n)

        samples = await guarded(rec, [key], limit, echo)
        if samples is not None:
            rec.set(key, 2 * size / statistics.median(samples) / 1e9)
        del payload


async def measure_big(driver: Driver, plan: Plan, rec: Recorder) -> None:
    """call() to 64 actors, on a mesh of 64 processes of its own."""
    key = f"call_{BIG_MESH}_p50_ms"
    if not plan.big_call_samples:
        rec.set(key, "skipped", "--quick")
        return
    pss = rec.data["metrics"].get("mesh_16_pss_mib")
    if isinstance(pss, float):
        need = int(pss * (1 << 20) * BIG_MESH / MESH * 1.25)
        have = mem_available()
        rec.meta("big_mesh_estimated_bytes", need)
        if have and need + MEMORY_RESERVE > have:
            rec.set(key, "skipped", f"needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} available")
            return
    t0 = time.perf_counter()
    group = await guarded(rec, [key], plan.big_spawn_timeout, lambda: driver.start(BIG_MESH))
    if group is None:
        return
    rec.meta(f"spawn_{BIG_MESH}_s", time.perf_counter() - t0)
    rec.meta(f"mesh_{BIG_MESH}_pss_mib", tree_pss_mib(os.getpid()))
    try:
        samples = await guarded(
            rec,
            [key],
            plan.measure_timeout,
            lambda: time_calls(lambda: group.call(BIG_MESH, PAYLOAD), 3, plan.big_call_samples),
        )
        if samples is not None:
            rec.set(key, percentile(samples, 0.5) * 1e3)
    finally:
        await close_quietly(group, rec)


async def measure_all(driver: Driver, plan: Plan, rec: Recorder) -> None:
    t0 = time.perf_counter()
    async with asyncio.timeout(plan.spawn_timeout):
        await driver.setup()
    rec.meta("setup_s", time.perf_counter() - t0)
    try:
        mesh: Group | None = None
        for n in SPAWN_SIZES:
            key = f"spawn_{n}_s"
            t0 = time.perf_counter()
            group = await guarded(rec, [key], plan.spawn_timeout, lambda n=n: driver.start(n))
            if group is None:
                continue
            rec.set(key, time.perf_counter() - t0)
            if n == MESH:
                mesh = group
            else:
                await close_quietly(group, rec)
        if mesh is None:
            for key in [*MESH_KEYS, "mesh_16_pss_mib"]:
                rec.set(key, "error", f"the {MESH}-process mesh did not start")
        else:
            try:
                await measure_mesh(mesh, plan, rec)
            finally:
                await close_quietly(mesh, rec)
        await measure_big(driver, plan, rec)
    finally:
        await driver.teardown()


def _version(system: str) -> str | None:
    try:
        return importlib.metadata.version(DISTS[system])
    except importlib.metadata.PackageNotFoundError:
        return None


def child_main(system: str, plan: Plan, out: str) -> int:
    rec = Recorder(out)
    me = os.getpid()
    sysdir = os.path.dirname(os.path.abspath(out))

    def orphaned() -> None:
        # The parent holds our stdin; when it dies, take our processes and files with us.
        kill_below(me, reap=False)
        shutil.rmtree(sysdir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(sysdir))  # the run's directory, once empty

    _watch_parent(orphaned, deathsig=False)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    try:
        driver = DRIVERS[system]()
    except ImportError as exc:
        rec.status("missing", f"{type(exc).__name__}: {exc}")
        return 0
    except Exception as exc:
        traceback.print_exc()
        rec.status("error", f"{type(exc).__name__}: {exc}"[:300])
        return 1
    rec.meta("version", _version(system))
    rec.meta("loop", driver.loop)
    try:
        driver.run(measure_all, driver, plan, rec)
    except KeyboardInterrupt:
        rec.status("interrupted")
        return 130
    except BaseException as exc:
        traceback.print_exc()
        rec.status("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        return 1
    rec.status("ok")
    return 0


# -- the parent: one subprocess per system, the table ------------------------------------------


def _become_subreaper() -> None:
    """Orphans of our children are re-parented to us, so none escapes the cleanup."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _child_env(system: str, sysdir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TMPDIR=sysdir,
        XOSCAR_DIR=sysdir,
        AMESH_IPC_DIR=sysdir,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
    )
    if system in AMESH_IMPLS:
        env["AMESH_TRANSPORT_IMPL"] = AMESH_IMPLS[system]
    if system == "ray":  # ~/.ray/auth_token
        env["HOME"] = os.path.join(sysdir, "home")
        os.makedirs(env["HOME"])
    return env


def _stop_child(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM (the child cleans up), then SIGKILL for it and everything below it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    kill_below(proc.pid, reap=False)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def run_system(system: str, plan: Plan, rundir: str, logdir: str, timeout: float) -> dict[str, Any]:
    if importlib.util.find_spec(MODULES[system]) is None:
        return {"status": "missing", "detail": f"module {MODULES[system]!r} not installed"}
    sysdir = os.path.join(rundir, system)
    os.makedirs(sysdir)
    out = os.path.join(sysdir, "result.json")
    log_path = os.path.join(logdir, f"compare-{system}.log")
    t0 = time.monotonic()
    timed_out = interrupted = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, THIS, "--child", system, "--plan", plan.name, "--out", out],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(system, sysdir),
            start_new_session=True,  # a terminal's Ctrl-C is for us; we stop it
        )
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_child(proc)
        except KeyboardInterrupt:  # keep what it measured, then stop the run
            interrupted = True
            _stop_child(proc)
        except BaseException:
            _stop_child(proc)
            raise
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            leftovers = kill_below(os.getpid(), reap=True)
    result: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        with open(out) as f:
            result = json.load(f)
    result.setdefault("metrics", {})
    result.setdefault("errors", {})
    result.setdefault("meta", {})
    if interrupted:
        result["status"] = "interrupted"
        result["detail"] = "Ctrl-C or SIGTERM"
    elif timed_out:
        result["status"] = "timeout"
        result["detail"] = f"stopped after the per-system timeout of {timeout:.0f} s"
    elif result.get("status") in (None, "running"):
        result["status"] = "crashed"
        result["detail"] = f"exit status {proc.returncode}; see {log_path}"
    shutil.rmtree(sysdir, ignore_errors=True)
    result["wall_s"] = time.monotonic() - t0
    result["log"] = log_path
    result["meta"]["leftover_processes_killed"] = leftovers
    return result


def _fill(result: dict[str, Any]) -> None:
    """Give every metric a cell: missing systems, and what a crash or timeout cut off."""
    status = result["status"]
    cell = {"missing": "missing", "timeout": "timeout", "interrupted": "-"}.get(status, "error")
    for m in METRICS:
        if m.key not in result["metrics"]:
            result["metrics"][m.key] = cell
            if status not in ("ok", "missing"):
                result["errors"].setdefault(m.key, f"system {status}: {result.get('detail', '')}")


def fmt(v: float) -> str:
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def fmt_ratio(r: float) -> str:
    if r >= 10:
        return f"{r:.0f}"
    if r >= 1:
        return f"{r:.2f}"
    return f"{r:.2g}"


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    base = results.get("amesh", {}).get("metrics", {})
    out: dict[str, dict[str, float | None]] = {}
    for system, result in results.items():
        out[system] = {}
        for m in METRICS:
            v, b = result["metrics"].get(m.key), base.get(m.key)
            ok = isinstance(v, int | float) and isinstance(b, int | float) and b
            out[system][m.key] = v / b if ok else None  # type: ignore[operator]
    return out


def render_table(results: dict[str, dict[str, Any]]) -> str:
    systems = list(results)
    rel = ratios(results)
    lines = [
        "| metric | unit | " + " | ".join(TITLES[s] for s in systems) + " |",
        "|---|---|" + "---:|" * len(systems),
    ]
    for m in METRICS:
        cells = []
        for s in systems:
            v = results[s]["metrics"].get(m.key)
            r = rel[s][m.key]
            if not isinstance(v, int | float):
                cells.append(str(v))
            elif s == "amesh" or r is None:
                cells.append(fmt(v))
            else:
                cells.append(f"{fmt(v)} ({fmt_ratio(r)}{TIMES})")
        lines.append(f"| {m.label} | {m.unit} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    model = platform.processor() or "?"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    mem_total = 0
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
    return {
        "nproc": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "cpu_model": model,
        "mem_total_gib": round(mem_total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _amesh_default_impl() -> str | None:
    """amesh's default transport implementation here (None without amesh)."""
    try:
        from amesh._transport import default_impl
    except ImportError:
        return None
    return default_impl()


def parent_main(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    systems = list(SYSTEMS)
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(wanted) - set(SYSTEMS))
        if unknown:
            print(f"unknown system(s) {unknown}; known: {','.join(SYSTEMS)}", file=sys.stderr)
            return 2
        systems = [s for s in SYSTEMS if s in wanted]
    default = _amesh_default_impl()
    if "amesh" in systems:
        # the default implementation's own column would repeat the amesh column
        systems = [s for s in systems if AMESH_IMPLS.get(s) != default]
    timeout = args.system_timeout or plan.system_timeout
    json_path = os.path.abspath(args.json)
    logdir = os.path.dirname(json_path)
    os.makedirs(logdir, exist_ok=True)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    _become_subreaper()
    doc: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "plan": plan.name,
        "machine": machine_info(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "metrics": [m.__dict__ for m in METRICS],
    }
    results: dict[str, dict[str, Any]] = {}
    interrupted = False
    rundir = tempfile.mkdtemp(prefix="amc-")
    try:
        for system in systems:
            print(f"[compare] {system} ...", file=sys.stderr, flush=True)
            results[system] = result = run_system(system, plan, rundir, logdir, timeout)
            wall = result.get("wall_s", 0.0)
            print(f"[compare] {system}: {result['status']} ({wall:.0f} s)", file=sys.stderr)
            if result["status"] == "interrupted":
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
        print("[compare] interrupted", file=sys.stderr)
    finally:
        kill_below(os.getpid(), reap=True)
        shutil.rmtree(rundir, ignore_errors=True)
    for result in results.values():
        _fill(result)
    doc["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    doc["interrupted"] = interrupted
    doc["systems"] = results
    doc["ratios_to_amesh"] = ratios(results)
    table = render_table(results) if results else "(nothing measured)"
    doc["table"] = table
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=2)

    machine = doc["machine"]
    print(
        f"amesh vs peers, {plan.name} run, {doc['date']}; {machine['nproc']} CPUs "
        f"({machine['cpu_model']}), affinity {machine['affinity']}, "
        f"{machine['mem_total_gib']} GiB; load average {doc['loadavg_before'][0]} before, "
        f"{doc['loadavg_after'][0]} after\n"
    )
    print(table)
    print(
        f"\n(r{TIMES}) = system / amesh: for {MU}s, ms, s and MiB above 1 means slower or "
        "bigger than amesh; for calls/s, deliveries/s and GB/s above 1 means faster."
    )
    for system, result in results.items():
        notes = [
            f"{k}: {v}"
            for k, v in result["errors"].items()
            if result["metrics"].get(k) not in ("n/a", "skipped") or not v.startswith("--quick")
        ]
        if result["status"] not in ("ok",) or notes:
            head = f"- {system}: {result['status']}"
            if result.get("detail"):
                head += f" ({result['detail']})"
            print(head)
            for note in dict.fromkeys(notes):
                print(f"  - {note}")
        left = result["meta"].get("leftover_processes_killed")
        if left:
            print(f"- {system}: killed {len(left)} leftover process(es): {', '.join(left[:8])}")
    print(f"\nJSON: {json_path}; logs: {logdir}/compare-<system>.log")
    return 130 if interrupted else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=f"systems: {', '.join(SYSTEMS)}",
    )
    p.add_argument("--quick", action="store_true", help="small counts; no 64 actors or 64 MiB")
    p.add_argument("--only", metavar="LIST", help="comma-separated systems, e.g. amesh,ray")
    p.add_argument(
        "--json",
        metavar="PATH",
        default=os.path.join(os.path.dirname(THIS), "results", "compare.json"),
        help="where to write the JSON (default bench/results/compare.json); the "
        "systems' logs go next to it",
    )
    p.add_argument(
        "--system-timeout",
        type=float,
        metavar="S",
        help="seconds one system may take in all (default 1200, 480 with --quick)",
    )
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--plan", choices=sorted(PLANS), default="full", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--serve", nargs=2, metavar=("KIND", "ADDR"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return 0
    if args.child:
        return child_main(args.child, PLANS[args.plan], args.out)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
