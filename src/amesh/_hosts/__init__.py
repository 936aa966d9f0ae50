"""Where processes come from: this machine now; host agents and SLURM later."""

from __future__ import annotations

from ._local import Host, LocalHost, ProcHandle, this_host

__all__ = ["Host", "LocalHost", "ProcHandle", "this_host"]
