"""Tools for testing code that uses amesh, and amesh itself.

- :class:`MemoryTransport`: runtimes in one process talk without sockets.
- :class:`FaultyTransport`: drop, delay, duplicate frames, cut links.
- :class:`InProcessHost`: a ProcMesh whose workers are runtimes in this process,
  with deterministic kill / pause (SIGSTOP) / resume (SIGCONT).
- :func:`open_runtime`: run the controller on a transport of your choice.
- :func:`no_leaks` and the pytest plugin ``amesh.testing.pytest_plugin`` (fixture
  ``amesh_no_leaks``): fail a test that leaks a process, a socket file or a
  shared-memory segment (:func:`shm_files`).
"""

from __future__ import annotations

from .._runtime._runtime import Runtime as Runtime
from .._runtime._runtime import open_runtime as _open_runtime
from .._transport import Transport as Transport
from .._transport._nng import NngTransport as NngTransport
from ._faulty import FaultyTransport as FaultyTransport
from ._inprocess import InProcessHost as InProcessHost
from ._inprocess import InProcessWorker as InProcessWorker
from ._leaks import LeakError as LeakError
from ._leaks import child_pids as child_pids
from ._leaks import descendant_pids as descendant_pids
from ._leaks import no_leaks as no_leaks
from ._leaks import shm_files as shm_files
from ._leaks import socket_files as socket_files
from ._memory import MemoryTransport as MemoryTransport

__all__ = [
    "FaultyTransport",
    "InProcessHost",
    "InProcessWorker",
    "LeakError",
    "MemoryTransport",
    "NngTransport",
    "Runtime",
    "Transport",
    "child_pids",
    "descendant_pids",
    "no_leaks",
    "open_runtime",
    "shm_files",
    "socket_files",
]


def open_runtime(transport: Transport) -> _open_runtime:
    """``async with open_runtime(t) as rt:`` runs this task's amesh runtime on ``t``.

    Meshes started inside use it; ``rt.statistics()`` shows its counters.
    """
    return _open_runtime(lambda: transport)
