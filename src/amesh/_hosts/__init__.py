"""Where processes come from: this machine, machines with a host agent, and this
process (the in-process host: runtimes on this event loop).

This is the package's front door: other packages import only what is exported here.
The main entry points are :func:`this_host` (this machine, through the zygote),
:class:`HostMesh` and :func:`attach` / :func:`attach_mesh` (host agents and the
persistent meshes they hold), :class:`SlurmJob`, :class:`InProcessHost`, and the
command line's: :func:`agent_main` (``amesh agent``), :func:`admin_main` (``amesh
list``, ``stop``, ``stacks``, ``logs``) and :func:`state_dir`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._agent import DEFAULT_GRACE, parse_listen
from ._agent import main as agent_main
from ._home import state_dir
from ._inprocess import InProcessHost
from ._local import LocalHost, this_host
from ._remote import HostMesh, attach, attach_mesh
from ._slurm import SlurmJob

if TYPE_CHECKING:
    from ._admin import main as admin_main

__all__ = [
    "DEFAULT_GRACE",
    "HostMesh",
    "InProcessHost",
    "LocalHost",
    "SlurmJob",
    "admin_main",
    "agent_main",
    "attach",
    "attach_mesh",
    "parse_listen",
    "state_dir",
    "this_host",
]


def __getattr__(name: str) -> object:
    # The admin commands' module (and the inspection modules it imports) is loaded on
    # first use: import amesh does not need them.
    if name == "admin_main":
        from ._admin import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
