"""Tools for testing code that uses amesh, and amesh itself.

- :class:`MemoryTransport`: runtimes in one process talk without sockets.
- :class:`FaultyTransport`: drop, delay, duplicate frames, cut links.
- :class:`InProcessHost`: a ProcMesh whose workers are runtimes in this process,
  with deterministic kill / pause (SIGSTOP) / resume (SIGCONT).
- :func:`open_runtime`: run the controller on a transport of your choice.
- :func:`no_leaks` and the pytest plugin ``amesh.testing.pytest_plugin`` (fixture
  ``amesh_no_leaks``): fail a test (with :class:`LeakError`) that leaks a process, a
  socket file, a listening abstract socket, a file descriptor or a shared-memory
  segment.
"""

from __future__ import annotations

from .._hosts import InProcessHost as InProcessHost
from .._runtime import open_runtime as _open_runtime
from .._transport import MemoryTransport as MemoryTransport
from .._transport import Transport as _Transport
from ._faulty import FaultyTransport as FaultyTransport
from ._leaks import LeakError as LeakError
from ._leaks import no_leaks as no_leaks

__all__ = [
    "FaultyTransport",
    "InProcessHost",
    "LeakError",
    "MemoryTransport",
    "no_leaks",
    "open_runtime",
]


def open_runtime(transport: _Transport) -> _open_runtime:
    """``async with open_runtime(t) as rt:`` runs this task's amesh runtime on ``t``.

    Meshes started inside use it; ``rt.statistics()`` shows its counters.
    """
    return _open_runtime(lambda: transport)
