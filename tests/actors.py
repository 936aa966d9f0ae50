"""Actor classes used by the tests (importable by workers, so pickled by reference)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import anyio

import amesh
from amesh import Actor, ActorMesh, ValueMesh, current_actor, current_rank, current_size, endpoint
from amesh._runtime import call_context, current_runtime


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.seen: list[Any] = []
        self.cancelled = 0
        self.cleanup_file: str | None = None
        self.init_point = dict(current_rank())
        self.released = anyio.Event()
        self.started = anyio.Event()
        self.arrived = 0
        self.all_arrived = anyio.Event()
        self.order: list[tuple[str, int]] = []

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    async def get(self) -> int:
        return self.n

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def where(self) -> tuple[dict[str, int], int, dict[str, int], dict[str, int]]:
        p = current_rank()
        return dict(p), p.rank, current_size(), self.init_point

    @endpoint
    def is_me(self) -> bool:
        return current_actor() is self

    @endpoint
    async def fail(self, msg: str) -> None:
        raise ValueError(msg)

    @endpoint
    async def fail_on(self, rank: int, when_released: bool = False) -> int:
        """Rank ``rank`` fails (once :meth:`release` d, if ``when_released``); the
        others wait to be cancelled."""
        if current_rank().rank == rank:
            if when_released:
                await self.released.wait()
            raise RuntimeError(f"rank {rank} fails")
        await self._wait_cancelled()
        return -1

    async def _wait_cancelled(self) -> None:
        self.started.set()
        try:
            await anyio.sleep_forever()
        finally:
            self.cancelled += 1

    @endpoint
    async def hang(self) -> None:
        await self._wait_cancelled()

    @endpoint(concurrent=True)
    async def hang_concurrent(self) -> None:
        self.started.set()
        await self._wait_cancelled()

    @endpoint(concurrent=True)
    async def wait_started(self) -> None:
        await self.started.wait()

    @endpoint
    def cancelled_count(self) -> int:
        return self.cancelled

    @endpoint
    def record(self, item: Any) -> None:
        self.seen.append(item)

    @endpoint
    def seen_items(self) -> list[Any]:
        return self.seen

    @endpoint
    def unpicklable(self) -> Any:
        return threading.Lock()

    @endpoint
    def apply(self, fn: Any, x: Any) -> Any:
        return fn(x)

    @endpoint
    def total(self, values: ValueMesh[int]) -> int:
        return sum(values.values())

    @endpoint
    def echo(self, x: Any) -> Any:
        return x

    @endpoint
    async def serial_work(self, i: int) -> None:
        self.order.append(("start", i))
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        self.order.append(("end", i))

    @endpoint
    def work_order(self) -> list[tuple[str, int]]:
        return self.order

    @endpoint(concurrent=True)
    async def rendezvous(self, n: int) -> int:
        """Completes only once ``n`` calls are inside at the same time."""
        self.arrived += 1
        if self.arrived >= n:
            self.all_arrived.set()
        await self.all_arrived.wait()
        return self.arrived

    @endpoint(concurrent=True)
    async def wait_released(self, tag: Any = None) -> int:
        """``tag``: anything, e.g. a scattered argument."""
        self.started.set()
        await self.released.wait()
        return current_rank().rank

    @endpoint
    async def hold(self) -> None:
        """Keep the (serial) mailbox busy, the next requests queued, until a
        :class:`Gate` in this process opens."""
        self.started.set()
        await _gate().wait()

    @endpoint(concurrent=True)
    def release(self) -> None:
        self.released.set()

    @endpoint(concurrent=True)
    async def now(self) -> int:
        return current_rank().rank

    def __cleanup__(self) -> None:
        path = os.environ.get("AMESH_TEST_CLEANUP_DIR")
        if path:
            with open(os.path.join(path, f"cleanup-{os.getpid()}"), "w") as f:
                f.write(str(self.n))


class BadInit(Actor):
    def __init__(self, fail_rank: int) -> None:
        if current_rank().rank == fail_rank:
            raise KeyError("bad init on purpose")


class Ponger(Actor):
    @endpoint
    def pong(self, n: int) -> tuple[int, str]:
        ctx = call_context.get()
        assert ctx is not None
        return n + 1, ctx.sender


class Pinger(Actor):
    @endpoint
    async def ping(self, other: ActorMesh[Ponger], n: int) -> tuple[int, str, str]:
        value, sender = await other.pong.call_one(n)
        return value, sender, current_runtime().address

    @endpoint
    def hand_back(self, other: ActorMesh[Ponger]) -> ActorMesh[Ponger]:
        return other


class Mortal(Actor):
    """Dies on request in various ways; counts its incarnations via __init__."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.calls = 0

    @endpoint
    def die(self, how: str) -> None:
        if how == "exit":
            os._exit(3)
        if how == "segv":
            import ctypes

            ctypes.string_at(0)
        raise ValueError(f"unknown death {how}")

    @endpoint
    def bump(self) -> tuple[int, int]:
        self.calls += 1
        return os.getpid(), self.calls

    @endpoint
    def explode(self) -> None:
        raise RuntimeError("exploded under broadcast")

    @endpoint
    async def hang(self) -> None:
        await anyio.sleep_forever()


class Owner(Actor):
    """Records the failures its ``__supervise__`` sees; handles them if ``handle``."""

    def __init__(self, handle: bool) -> None:
        self.handle = handle
        self.seen: list[str] = []
        self.supervised = anyio.Event()

    def _record(self, failure: Any) -> bool:
        self.seen.append(str(failure))
        self.supervised.set()
        return self.handle

    @endpoint(concurrent=True)
    async def wait_supervised(self) -> list[str]:
        await self.supervised.wait()
        return self.seen


class Leaf(Owner):
    """Owns a mesh of one Mortal process (the grandchild of the controller's actor)."""

    @endpoint
    async def start(self) -> list[int]:
        from amesh import ProcMesh

        self.procs = await ProcMesh(per_host={"p": 1})
        self.mortals = await self.procs.spawn("mortal", Mortal)
        return self.procs.pids

    @endpoint
    async def bump_child(self) -> tuple[int, int]:
        return await self.mortals.bump.call_one()

    def __supervise__(self, failure: Any) -> bool:
        return self._record(failure)

    @endpoint
    def ping(self) -> str:
        return "leaf"


class Mid(Owner):
    """Owns a mesh of one Leaf actor."""

    def __init__(self, handle: bool, leaf_handles: bool) -> None:
        super().__init__(handle)
        self.leaf_handles = leaf_handles

    @endpoint
    async def start(self) -> tuple[list[int], list[int]]:
        from amesh import ProcMesh

        self.procs = await ProcMesh(per_host={"p": 1})
        self.leaf = await self.procs.spawn("leaf", Leaf, self.leaf_handles)
        grandchildren = await self.leaf.start.call_one()
        return self.procs.pids, grandchildren

    @endpoint
    async def call_leaf(self) -> str:
        return await self.leaf.ping.call_one()

    @endpoint
    async def leaf_seen(self) -> list[str]:
        return await self.leaf.wait_supervised.call_one()

    @endpoint
    async def leaf_bump_child(self) -> tuple[int, int]:
        return await self.leaf.bump_child.call_one()

    async def __supervise__(self, failure: Any) -> bool:  # async hooks are awaited
        await anyio.lowlevel.checkpoint()
        return self._record(failure)

    @endpoint
    def ping(self) -> str:
        return "mid"


class Cyclic(Actor):
    """A calls B calls A: serial endpoints deadlock, concurrent ones do not."""

    @endpoint
    async def call_other(self, other: ActorMesh[Cyclic], back: ActorMesh[Cyclic], ep: str) -> str:
        return await other.bounce.call_one(back, ep)  # type: ignore[no-any-return]

    @endpoint
    async def bounce(self, back: ActorMesh[Cyclic], ep: str) -> str:
        return await getattr(back, ep).call_one()  # type: ignore[no-any-return]

    @endpoint
    def serial_ping(self) -> str:
        return "serial pong"

    @endpoint(concurrent=True)
    def concurrent_ping(self) -> str:
        return "concurrent pong"

    @endpoint
    async def call_self(self, me: ActorMesh[Cyclic]) -> str:
        return await me.serial_ping.call_one()  # type: ignore[no-any-return]


class Model(Actor):
    """A counter per rank, for the fault-injection state machine."""

    def __init__(self) -> None:
        self.rank = current_rank().rank
        self.count = 0

    @endpoint
    def bump(self) -> tuple[int, int]:
        self.count += 1
        return self.rank, self.count

    @endpoint
    def peek(self) -> tuple[int, int]:
        return self.rank, self.count

    @endpoint
    def fail(self) -> None:
        raise ValueError("model failure")

    @endpoint
    async def hang(self) -> None:
        await anyio.sleep_forever()


_GATES: dict[str, anyio.Event] = {}


def _gate() -> anyio.Event:
    """One event per process (made on first use, on the worker's loop)."""
    if "gate" not in _GATES:
        _GATES["gate"] = anyio.Event()
    return _GATES["gate"]


class Gate(Actor):
    """Opens what :meth:`Sink.hold` waits for: another actor, so another mailbox."""

    @endpoint
    def open(self) -> None:
        _gate().set()


class Sink(Actor):
    """A slow consumer: each message takes a few milliseconds of work."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.nbytes = 0

    @endpoint
    async def hold(self) -> None:
        """Keep the (serial) mailbox busy until a :class:`Gate` in this process opens."""
        await _gate().wait()

    @endpoint
    async def take(self, i: int, blob: bytes) -> None:
        await anyio.sleep(0.005)  # work, not synchronisation
        self.got.append(i)
        self.nbytes += len(blob)

    @endpoint
    def note(self, i: int) -> None:
        self.got.append(i)

    @endpoint
    def received(self) -> tuple[list[int], int]:
        return self.got, self.nbytes

    @endpoint
    def peak_rss_mib(self) -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM in /proc/self/status")


class BadStr(Exception):
    """An exception that cannot be printed."""

    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


class Unpicklable:
    def __reduce__(self) -> Any:
        raise ValueError("refuses to be pickled")


class Awkward(Actor):
    """Endpoints whose errors or results are hard to send back."""

    @endpoint
    def raise_bad_str(self) -> None:
        raise BadStr("secret", 42)

    @endpoint
    def unpicklable_result(self) -> Any:
        return Unpicklable()

    @endpoint
    def ok(self) -> int:
        return os.getpid()


class Ledger(Model):
    """A :class:`Model` that also records who bumped it, in the order it ran the bumps,
    and can be held inside a call (for the fault-injection state machines)."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[tuple[int, int]] = []
        self.holds = 0
        self._held = anyio.Event()

    @endpoint
    def note(self, tag: int, seq: int) -> tuple[int, int]:
        """Bump, recording ``(tag, seq)``: which sender's which message this was."""
        self.count += 1
        self.notes.append((tag, seq))
        return self.rank, self.count

    @endpoint
    def take_notes(self) -> list[tuple[int, int]]:
        """The notes recorded since the last time, in the order they ran."""
        notes, self.notes = self.notes, []
        return notes

    async def _hold(self) -> None:
        self.holds += 1
        held, self._held = self._held, anyio.Event()
        held.set()
        await anyio.sleep_forever()

    @endpoint(concurrent=True)
    async def hold(self) -> None:
        """Wait until cancelled (or the process dies)."""
        await self._hold()

    @endpoint
    async def block(self) -> None:
        """Wait until cancelled, keeping the (serial) mailbox busy meanwhile."""
        await self._hold()

    @endpoint(concurrent=True)
    async def wait_holds(self, n: int) -> None:
        """Return once ``n`` calls of :meth:`hold` or :meth:`block` have started here."""
        while self.holds < n:
            await self._held.wait()


class Caller(Actor):
    """Calls a mesh it was handed, which it does not own."""

    @endpoint(concurrent=True)
    async def call(self, other: ActorMesh[Any], method: str) -> tuple[str, Any]:
        """``other.<method>.call_one()``: ``("ok", result)``, or the exception's type
        name and message."""
        try:
            return "ok", await getattr(other, method).call_one()
        except Exception as exc:
            return type(exc).__name__, str(exc)


#: released by Sync.release_pickle; SlowPickle waits for it while being pickled
_PICKLE_GATE = threading.Event()


class SlowPickle:
    """A result whose pickling takes as long as the test wants."""

    def __reduce__(self) -> tuple[Any, ...]:
        if not _PICKLE_GATE.wait(60):
            raise RuntimeError("never released")
        return (str, ("pickled",))


class Sync(Actor):
    """Sync endpoints: on the event loop's thread, and in a worker thread."""

    def __init__(self) -> None:
        self.saw_cancel = False
        self.loop_thread = threading.get_ident()
        self.running = threading.Event()

    @endpoint(thread=True)
    def until_cancelled(self) -> tuple[bool, str]:
        """Runs in a worker thread until its caller gives up (polling is the work)."""
        self.running.set()
        while not amesh.cancelled():
            time.sleep(0.01)
        self.saw_cancel = True
        return threading.get_ident() != self.loop_thread, "stopped"

    @endpoint(thread=True)
    def in_thread(self, x: int) -> tuple[bool, int]:
        return threading.get_ident() != self.loop_thread, x + 1

    @endpoint
    def on_loop(self, path: str, size: int) -> bytes:
        """Blocks the event loop until ``path`` exists, then returns ``size`` bytes."""
        while not os.path.exists(path):
            time.sleep(0.01)
        return b"r" * size

    @endpoint(concurrent=True)
    def is_running(self) -> bool:
        return self.running.is_set()

    @endpoint(concurrent=True)
    def seen_cancel(self) -> bool:
        return self.saw_cancel

    @endpoint
    def serial_seen_cancel(self) -> bool:
        return self.saw_cancel

    @endpoint(concurrent=True)
    def slow_result(self) -> SlowPickle:
        return SlowPickle()

    @endpoint(concurrent=True)
    def release_pickle(self) -> None:
        _PICKLE_GATE.set()

    @endpoint(concurrent=True)
    def ping(self) -> str:
        return "pong"


class Big(Actor):
    """Takes and makes large payloads."""

    def __init__(self) -> None:
        self.held: bytes = b""
        self.hoarded: list[bytes] = []

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def fingerprint(self, data: bytes) -> tuple[int, bytes, bytes]:
        return len(data), bytes(data[:: 1 << 20]), bytes(data[-100:])

    @endpoint
    def make(self, n: int) -> bytes:
        pattern = bytes(range(251))
        return (pattern * (n // len(pattern) + 1))[:n]

    @endpoint
    def keep(self, data: bytes) -> None:
        self.held = data

    @endpoint
    def echo(self, data: bytes) -> bytes:
        return data

    @endpoint
    def hoard(self, data: bytes) -> list[str]:
        """Keep ``data`` with every earlier one; the digests of all of them."""
        self.hoarded.append(data)
        return [hashlib.sha256(b).hexdigest() for b in self.hoarded]

    @endpoint
    def kept(self) -> tuple[int, bytes, bytes]:
        data, self.held = self.held, b""
        return len(data), bytes(data[:: 1 << 20]), bytes(data[-100:])

    @endpoint
    def peak_rss_mib(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ExitHooks(Actor):
    """Leaves work for the end of its process: an atexit handler, and a non-daemon
    thread that waits for the main thread to finish (as the interpreter's own exit
    marks it finished) before it writes."""

    @endpoint
    def arm(self, folder: str) -> None:
        import atexit

        path = os.path.join(folder, f"exit-{os.getpid()}")

        def note(what: str) -> None:
            with open(path, "a") as f:
                f.write(what + "\n")

        def after_main() -> None:
            threading.main_thread().join()
            note("thread")

        atexit.register(note, "atexit")
        threading.Thread(target=after_main, daemon=False).start()


class TlsIdentity(Actor):
    @endpoint
    def material(self) -> tuple[str, str, str, int]:
        """This process's ``tls+tcp`` certificates (CA, leaf, leaf key) and its parent."""
        from amesh._transport import _tls

        m = _tls.material()
        return m.ca, m.cert, m.key, os.getppid()


class Holder(Actor):
    @endpoint
    def hold(self, started: str, release: str) -> None:
        """Hold the event loop's thread until file ``release`` exists (``started``
        exists once it does)."""
        open(started, "w").close()
        while not os.path.exists(release):
            time.sleep(0.01)
