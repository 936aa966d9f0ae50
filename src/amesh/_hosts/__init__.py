"""Where processes come from: this machine now; host agents and SLURM later."""

from __future__ import annotations

from .._mesh._host import Host, ProcHandle
from ._local import LocalHost, this_host

__all__ = ["Host", "LocalHost", "ProcHandle", "this_host"]
