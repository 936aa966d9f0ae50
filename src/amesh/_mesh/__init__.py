"""The parts behind :class:`~amesh.ProcMesh`: process lifecycle, supervision, and the
Host interface it starts its processes through (:mod:`._host`).

:class:`ProcMesh` (:mod:`._proc_mesh`) is the user-facing facade over them.

This is the package's front door: other packages import only what is exported here.
The main entry points are :class:`Host` and :class:`ProcHandle` (what a host
implements and gives back, and the default and persistent hosts that the hosts layer
registers), :class:`Lifecycle` and :class:`MeshSupervisor` (a mesh's processes from
start to stop, and what watches them), and the registry of this process's live meshes
that ``amesh list`` reads (:func:`registry_update`, :func:`registry_read_all`).
"""

from __future__ import annotations

from ._host import (
    Holder,
    Host,
    ProcessLike,
    ProcHandle,
    default_host,
    describe_exit,
    exit_cause,
    persistent_host,
    set_default_host,
    set_persistent_host,
)
from ._lifecycle import STOP_ACTORS_TIMEOUT, Lifecycle, MeshState, Spawned, failure_of
from ._proc_mesh import ProcMesh
from ._registry import forget as registry_forget
from ._registry import read_all as registry_read_all
from ._registry import set_registry_dir, unlisted
from ._registry import update as registry_update
from ._supervisor import MeshSupervisor, pid_alive

__all__ = [
    "STOP_ACTORS_TIMEOUT",
    "Holder",
    "Host",
    "Lifecycle",
    "MeshState",
    "MeshSupervisor",
    "ProcHandle",
    "ProcMesh",
    "ProcessLike",
    "Spawned",
    "default_host",
    "describe_exit",
    "exit_cause",
    "failure_of",
    "persistent_host",
    "pid_alive",
    "registry_forget",
    "registry_read_all",
    "registry_update",
    "set_default_host",
    "set_persistent_host",
    "set_registry_dir",
    "unlisted",
]
