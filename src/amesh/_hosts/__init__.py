"""Where processes come from: this machine, machines with a host agent, and this
process (the in-process host: runtimes on this event loop)."""

from __future__ import annotations

from .._mesh import Host, ProcHandle
from ._inprocess import InProcessHost
from ._local import LocalHost, this_host
from ._remote import HostMesh, attach, attach_mesh
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
    "this_host",
]
