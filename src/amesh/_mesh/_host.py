"""What a ProcMesh needs from where its processes come from: the Host interface.

Hosts (:mod:`amesh._hosts`) implement it and sit above ProcMesh, since
``host.spawn_procs()`` makes a ProcMesh; the interface, the handle a host gives back
for a process, and the default host live here, below ProcMesh, so that the mesh never
imports the hosts layer. The package :mod:`amesh` plugs this machine in as the default
host (:func:`amesh._hosts.plug_in`, in its ``__init__``, which every ``amesh.*``
import runs first).
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .._runtime import stacks_by_signal

if TYPE_CHECKING:
    from .._bootstrap import WorkerSpec
    from .._runtime import Runtime

__all__ = [
    "Holder",
    "Host",
    "ProcHandle",
    "ProcessLike",
    "default_host",
    "describe_exit",
    "exit_cause",
    "persistent_host",
    "set_default_host",
    "set_persistent_host",
]


def describe_exit(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGKILL"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def exit_cause(process: ProcessLike) -> str:
    """How ``process`` ended: ``"was killed by SIGKILL"``, or, for a process on another
    machine, why its host can no longer say (its ``lost``: the agent was lost)."""
    lost: str | None = getattr(process, "lost", None)
    return lost or describe_exit(process.returncode or 0)


class ProcessLike(Protocol):
    """What a host hands back for a worker: an OS process or a stand-in for one."""

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...

    async def aclose(self) -> None: ...


class ProcHandle:
    """One worker process: its address, pid and OS handle (``local``: on this
    machine, so its pid means something here)."""

    def __init__(
        self, addr: str, pid: int, process: ProcessLike, local: bool = True, host: str = ""
    ) -> None:
        self.addr = addr
        self.pid = pid
        self.process = process
        self.local = local
        #: the machine it runs on, for failures ("": this one)
        self.host = host
        self.expected_exit = False
        #: a failure of this process was already reported
        self.failed = False

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def exit_cause(self) -> str:
        """How it ended (see :func:`exit_cause`)."""
        return exit_cause(self.process)

    async def stacks_by_signal(self, full: bool = False) -> str:
        """Its stacks, taken without its event loop (which did not answer): here for a
        process on this machine, else by its host (the process's ``stacks_by_signal``,
        a host agent's); see :mod:`amesh._runtime._stackdump`."""
        if self.local:
            return await stacks_by_signal(self.pid, full)
        remote = getattr(self.process, "stacks_by_signal", None)
        if remote is None:
            return f"(its event loop did not answer, and its host {self.host} takes no stacks)\n"
        text: str = await remote(full)
        return text

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


class Host(Protocol):
    """Where a ProcMesh's processes come from (this machine, later agents and SLURM).

    A host may say how many descriptors the controller holds per process it starts
    (``open_files_per_process``; :data:`amesh._limits.PER_PROCESS` if it does not, 0
    for ranks that are no OS process), and how many threads each of its processes adds
    to the user's count on this machine (``tasks_per_process``; 0 if it does not, as
    for processes on other machines), for the room a mesh makes before it starts. A
    host whose processes run on other machines may check there before any starts
    (``async make_room(slots)``, raising OSError where they do not fit). A host that
    gives its processes a workspace tree may move them to the workspace as it is now
    (``async sync_workspace(slots)``: sends it, and returns each slot's ``(old tree,
    new tree)``, ``("", "")`` for none; see :meth:`ProcMesh.sync`). A host that
    brought machines up for the mesh lets go of them in ``async aclose()``, which the
    mesh awaits once its processes have stopped, or when its first ones did not start.
    """

    async def start_proc(self, rt: Runtime, spec: WorkerSpec) -> ProcHandle:
        """Start one worker as ``spec`` asks, that reports Ready to ``rt`` and
        heartbeats to it every ``spec.heartbeat_period`` seconds (``rt`` declares it
        dead after ``spec.heartbeat_timeout`` seconds of silence)."""
        ...


class Holder(Host, Protocol):
    """A Host whose processes may outlive their controller (host agents): it starts
    them for persistent mesh :attr:`mesh_name`, and keeps the record another
    controller needs to take that mesh over."""

    #: the persistent mesh it starts processes for
    mesh_name: str
    #: processes per machine (the relay tree goes by machine)
    per_host: int

    async def hold(self, record: dict[str, Any]) -> None:
        """Keep ``record`` (shape, processes, actor meshes) where the mesh's
        machines are, replacing what was kept."""
        ...

    async def release(self) -> None:
        """Forget the record (the mesh was stopped)."""
        ...


_default_host: Host | None = None
_persistent_host: Callable[[str, int], Awaitable[Holder]] | None = None


def set_persistent_host(factory: Callable[[str, int], Awaitable[Holder]]) -> None:
    """Register ``factory(name, count)``: the Holder on this machine (its local agent,
    started on demand) for persistent mesh ``name`` of ``count`` processes."""
    global _persistent_host
    _persistent_host = factory


async def persistent_host(name: str, count: int) -> Holder:
    """The Holder for a persistent mesh on this machine (see :func:`set_persistent_host`)."""
    if _persistent_host is None:
        raise RuntimeError("no persistent host: `import amesh` registers this machine's")
    return await _persistent_host(name, count)


def set_default_host(host: Host) -> None:
    """Make ``host`` where a ProcMesh made without ``host=`` starts its processes."""
    global _default_host
    _default_host = host


def default_host() -> Host:
    """The host registered by :func:`set_default_host` (this machine, once amesh is imported).

    Raises:
        RuntimeError: none was registered.
    """
    if _default_host is None:
        raise RuntimeError("no default host: `import amesh` registers this machine")
    return _default_host
