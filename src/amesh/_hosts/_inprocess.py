"""A host whose "processes" are runtimes in this process, on this event loop.

``ProcMesh(per_host=..., host=InProcessHost())`` behaves like a mesh of real
processes (same runtime, same messages, same supervision) but starts in microseconds,
runs on asyncio and trio alike, and lets a test kill, stop and continue a "process"
deterministically. :mod:`amesh.testing` exports it; it lives here, in the product,
because the zygote's rehearsal (:func:`amesh._hosts._zygote_main._rehearse`) plays a
one-process mesh on it, and product code never imports test code.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import anyio

from .. import _wire
from .._bootstrap import WorkerSpec
from .._mesh import ProcHandle, ProcMesh
from .._runtime import Runtime
from .._transport import MemoryTransport, Transport, open_transport
from ._ready import ReadyWaiter

__all__ = ["InProcessHost", "InProcessWorker"]

log = logging.getLogger("amesh.testing")

_pids = itertools.count(1_000_000_000)


class InProcessWorker:
    """Stands in for an OS process: ``wait``, ``kill``, ``terminate``, ``returncode``."""

    def __init__(self, transport: Transport) -> None:
        self.pid = next(_pids)
        self.transport = transport
        self.returncode: int | None = None
        self._exit_code: int | None = None
        self._scope = anyio.CancelScope()
        self._exited = anyio.Event()

    async def run(self, parent: str, token: str, heartbeat_period: float) -> None:
        from .._worker import serve

        @contextmanager
        def heartbeats(rt: Runtime, to: str) -> Iterator[None]:
            scope = anyio.CancelScope()

            async def beat() -> None:
                with scope:
                    await self._beat(rt, to, heartbeat_period)

            rt.start_soon(beat)
            try:
                yield
            finally:
                scope.cancel()

        code = 0
        try:
            with self._scope:
                await serve(lambda: self.transport, parent, token, heartbeats)
        except Exception:
            log.exception("in-process worker %d crashed", self.pid)
            code = 1
        finally:
            self.transport.close()
            self.returncode = self._exit_code if self._exit_code is not None else code
            self._exited.set()

    async def _beat(self, rt: Runtime, parent: str, period: float) -> None:
        frame = _wire.join(_wire.encode(_wire.Heartbeat(rt.address, rt.pid)))
        while True:
            await rt.transport.send(parent, frame)
            await anyio.sleep(period)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def _end(self, code: int) -> None:
        if self.returncode is None and self._exit_code is None:
            self._exit_code = code
            self._scope.cancel()

    def kill(self) -> None:
        """Like SIGKILL: the worker stops at once; nothing runs its cleanup."""
        self._end(-9)

    def terminate(self) -> None:
        self._end(-15)

    async def aclose(self) -> None:
        await self.wait()

    def pause(self) -> None:
        """Like SIGSTOP: nothing is delivered or sent (memory transport only)."""
        if not isinstance(self.transport, MemoryTransport):
            raise TypeError("pause() needs the memory transport")
        self.transport.pause()

    def resume(self) -> None:
        """Like SIGCONT."""
        if isinstance(self.transport, MemoryTransport):
            self.transport.resume()


class InProcessHost:
    """Runs each worker of a ProcMesh as a runtime in this process.

    The workers use the controller's kind of transport: the memory transport when
    the controller runs on one (``amesh.testing.open_runtime(MemoryTransport())``),
    NNG sockets otherwise. They live in the controller runtime's task group, so they
    end with it, as real workers die with their controller.
    """

    #: no OS process per worker, no pidfd: the only descriptors are its transport's
    #: (none on the memory transport), so a mesh makes no room for them (see _limits)
    open_files_per_process = 0

    def __init__(self) -> None:
        self.workers: dict[int, InProcessWorker] = {}

    def __repr__(self) -> str:
        return "<InProcessHost>"

    def spawn_procs(self, per_host: Mapping[str, int] | None = None, **kwargs: Any) -> ProcMesh:
        """A ProcMesh of in-process workers; enter or await it to start them."""
        return ProcMesh(per_host, host=self, **kwargs)

    def _transport(self, scheme: str, host: str) -> Transport:
        if scheme == "memory":
            return MemoryTransport()
        return open_transport(scheme, host=host)

    async def start_proc(self, rt: Runtime, spec: WorkerSpec) -> ProcHandle:
        """Start one rank as a runtime in this process (``spec``'s environment, event
        loop and output do not apply: it shares this process's)."""
        worker = InProcessWorker(self._transport(spec.scheme, spec.host))
        ready = ReadyWaiter(rt)
        rt.task_group.start_soon(worker.run, rt.address, ready.token, spec.heartbeat_period)
        with anyio.fail_after(30):
            msg = await ready.wait()
        self.workers[worker.pid] = worker
        return ProcHandle(msg.addr, worker.pid, worker)

    def worker(self, pid: int) -> InProcessWorker:
        """The worker with fake ``pid`` (as in ``procs.pids``)."""
        return self.workers[pid]
