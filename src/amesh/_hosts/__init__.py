"""Where processes come from: this machine, machines with a host agent, and this
process (the in-process host: runtimes on this event loop).

This is the package's front door: other packages import only what is exported here.
The main entry points are :func:`this_host` (this machine, through the zygote),
:class:`HostMesh` and :func:`attach` / :func:`attach_mesh` (host agents and the
persistent meshes they hold), :class:`SlurmJob` and :class:`SshHosts` (given an
:class:`AgentBundle`, see :func:`agent_bundle`, on hosts that have nothing but Python),
:class:`InProcessHost`, and the command line's: :func:`agent_main` (``amesh agent``),
:func:`admin_main` (``amesh list``, ``stop``, ``stacks``, ``logs``) and :func:`state_dir`.

The layers below (ProcMesh, the debugger) cannot import this one: :func:`plug_in`
tells them this machine's host, where persistent meshes live, and where paused ranks
on other machines are found. The package :mod:`amesh` calls it, once, in its
``__init__``: no module here registers anything when it is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._debug import set_remote_debuggers
from .._mesh import set_default_host, set_persistent_host
from ._agent import DEFAULT_GRACE, parse_listen
from ._agent import main as agent_main
from ._bundle import AgentBundle, agent_bundle
from ._deliver import Delivered, EnvPackages, ProvisionError
from ._home import state_dir
from ._inprocess import InProcessHost
from ._local import LocalHost, this_host
from ._remote import (
    HostMesh,
    attach,
    attach_mesh,
    local_holder,
    local_hosts,
    remote_debuggers,
)
from ._slurm import SlurmJob
from ._ssh import SshHosts

if TYPE_CHECKING:
    from ._admin import main as admin_main

__all__ = [
    "DEFAULT_GRACE",
    "AgentBundle",
    "Delivered",
    "EnvPackages",
    "HostMesh",
    "InProcessHost",
    "LocalHost",
    "ProvisionError",
    "SlurmJob",
    "SshHosts",
    "admin_main",
    "agent_bundle",
    "agent_main",
    "attach",
    "attach_mesh",
    "local_hosts",
    "parse_listen",
    "plug_in",
    "state_dir",
    "this_host",
]


def plug_in() -> None:
    """Make this machine the default host of a ProcMesh made without ``host=``, its
    local agent the holder of persistent meshes, and the agents this controller holds
    where :func:`amesh.debug` looks for paused ranks besides its own."""
    set_default_host(this_host())
    set_persistent_host(local_holder)
    set_remote_debuggers(remote_debuggers)


def __getattr__(name: str) -> object:
    # The admin commands' module (and the inspection modules it imports) is loaded on
    # first use: import amesh does not need them.
    if name == "admin_main":
        from ._admin import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
