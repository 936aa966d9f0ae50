"""Worker processes on this machine, started fresh (spawn + exec, never fork)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec
import sniffio

from .. import _wire
from .._errors import SupervisionError
from .._runtime._runtime import Runtime

if TYPE_CHECKING:
    from .._proc_mesh import ProcMesh

__all__ = [
    "Host",
    "LocalHost",
    "ProcHandle",
    "ProcessLike",
    "ReadyWaiter",
    "describe_exit",
    "this_host",
]

#: How long a worker may take from exec to listening.
STARTUP_TIMEOUT = 60.0


class Bootstrap(msgspec.Struct, frozen=True):
    """What a worker needs to know at start, passed in ``AMESH_BOOTSTRAP``."""

    parent: str
    parent_pid: int
    token: str
    scheme: str
    host: str
    sys_path: list[str]
    heartbeat_period: float
    #: whether the worker may ask for the kernel's parent-death signal
    pdeathsig: bool


def describe_exit(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGKILL"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class ProcessLike(Protocol):
    """What a host hands back for a worker: an OS process or a stand-in for one."""

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...

    async def aclose(self) -> None: ...


class ProcHandle:
    """One worker process: its address, pid and OS handle."""

    def __init__(self, addr: str, pid: int, process: ProcessLike) -> None:
        self.addr = addr
        self.pid = pid
        self.process = process
        self.expected_exit = False
        #: a failure of this process was already reported
        self.failed = False

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def stop(self, grace: float) -> None:
        """Wait ``grace`` seconds for a requested exit, then terminate, then kill."""
        proc = self.process
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(grace):
                await proc.wait()
            if proc.returncode is None:
                proc.terminate()
                with anyio.move_on_after(2.0):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await proc.aclose()


class ReadyWaiter:
    """Waits for the Ready of the worker that is started with :attr:`token`."""

    def __init__(self, rt: Runtime) -> None:
        self.token = uuid.uuid4().hex
        self.msg: _wire.Ready | None = None
        self._rt = rt
        self._ready = anyio.Event()
        rt.ready_waiters[self.token] = self._on_ready

    def _on_ready(self, msg: _wire.Ready) -> None:
        self.msg = msg
        self._ready.set()

    async def wait(self) -> _wire.Ready:
        await self._ready.wait()
        assert self.msg is not None
        return self.msg

    def cancel(self) -> None:
        self._rt.ready_waiters.pop(self.token, None)


class Host(Protocol):
    """Where a ProcMesh's processes come from (this machine, later agents and SLURM)."""

    async def start_proc(
        self,
        rt: Runtime,
        scheme: str,
        host: str,
        env: Mapping[str, str] | None = None,
        *,
        heartbeat_period: float = 0.5,
    ) -> ProcHandle:
        """Start one worker that reports Ready to ``rt`` and heartbeats to it."""
        ...


class LocalHost:
    """This machine. ``spawn_procs`` gives a :class:`~amesh.ProcMesh` on it."""

    def __repr__(self) -> str:
        return "<LocalHost>"

    def spawn_procs(self, per_host: Mapping[str, int] | None = None, **kwargs: Any) -> ProcMesh:
        """A :class:`~amesh.ProcMesh` of processes on this host; enter it to start them."""
        from .._proc_mesh import ProcMesh

        return ProcMesh(per_host, host=self, **kwargs)

    async def start_proc(
        self,
        rt: Runtime,
        scheme: str,
        host: str,
        env: Mapping[str, str] | None = None,
        *,
        heartbeat_period: float = 0.5,
    ) -> ProcHandle:
        """Start one worker and wait until it listens.

        Raises:
            SupervisionError: it exited, or did not report in time.
        """
        ready = ReadyWaiter(rt)
        token = ready.token
        # asyncio (and uvloop) fork from the event loop's own thread; trio forks from a
        # cached worker thread that exits when idle, which would fire the signal.
        pdeathsig = (
            sniffio.current_async_library() == "asyncio"
            and threading.current_thread() is threading.main_thread()
        )
        boot = Bootstrap(
            rt.address,
            os.getpid(),
            token,
            scheme,
            host,
            list(sys.path),
            heartbeat_period,
            pdeathsig,
        )
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env["AMESH_BOOTSTRAP"] = msgspec.json.encode(boot).decode()
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            process = await anyio.open_process(
                [sys.executable, "-m", "amesh._worker"],
                stdin=subprocess.PIPE,
                stdout=None,
                stderr=None,
                env=child_env,
            )
        except BaseException:
            ready.cancel()
            raise
        exited = anyio.Event()
        try:
            with anyio.move_on_after(STARTUP_TIMEOUT):
                async with anyio.create_task_group() as tg:

                    async def watch() -> None:
                        await process.wait()
                        exited.set()
                        tg.cancel_scope.cancel()

                    tg.start_soon(watch)
                    await ready.wait()
                    tg.cancel_scope.cancel()
            if ready.msg is None:
                if exited.is_set():
                    why = describe_exit(process.returncode or 0)
                else:
                    why = f"did not report within {STARTUP_TIMEOUT:.0f} s"
                raise SupervisionError(f"worker process {process.pid} {why} while starting")
        except BaseException:
            ready.cancel()
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()
                await process.aclose()
            raise
        return ProcHandle(ready.msg.addr, ready.msg.pid, process)


_THIS_HOST = LocalHost()


def this_host() -> LocalHost:
    """The local machine."""
    return _THIS_HOST
