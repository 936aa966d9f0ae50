"""Where processes come from: this machine, and machines with a host agent."""

from __future__ import annotations

from .._mesh._host import Host, ProcHandle
from ._local import LocalHost, this_host
from ._remote import HostMesh, attach, attach_mesh
from ._slurm import SlurmJob

__all__ = [
    "Host",
    "HostMesh",
    "LocalHost",
    "ProcHandle",
    "SlurmJob",
    "attach",
    "attach_mesh",
    "this_host",
]
