"""Where processes come from: this machine, machines with a host agent, and this
process (the in-process host: runtimes on this event loop).

The layers below (ProcMesh, the debugger) cannot import this one: :func:`plug_in`
tells them this machine's host, where persistent meshes live, and where paused ranks
on other machines are found. The package :mod:`amesh` calls it, once, in its
``__init__``: no module here registers anything when it is imported.
"""

from __future__ import annotations

from .._debug import set_remote_debuggers
from .._mesh._host import Host, ProcHandle, set_default_host, set_persistent_host
from ._inprocess import InProcessHost
from ._local import LocalHost, this_host
from ._remote import HostMesh, attach, attach_mesh, local_holder, remote_debuggers
from ._slurm import SlurmJob

__all__ = [
    "Host",
    "HostMesh",
    "InProcessHost",
    "LocalHost",
    "ProcHandle",
    "SlurmJob",
    "attach",
    "attach_mesh",
    "plug_in",
    "this_host",
]


def plug_in() -> None:
    """Make this machine the default host of a ProcMesh made without ``host=``, its
    local agent the holder of persistent meshes, and the agents this controller holds
    where :func:`amesh.debug` looks for paused ranks besides its own."""
    set_default_host(this_host())
    set_persistent_host(local_holder)
    set_remote_debuggers(remote_debuggers)
