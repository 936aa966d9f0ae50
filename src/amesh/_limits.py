"""How many files a process may open, and making room for a mesh.

A controller holds about four descriptors per process it starts (the connection, the
pidfd its zygote hands over, ...), a zygote one per child, a host agent a few per
worker. Linux's usual soft limit is 1,024 open files (the hard one much higher), which
a mesh of ~250 processes would exhaust: the next ``accept`` or ``pidfd_open`` fails with
EMFILE somewhere in the middle of the start. So, as Ray does:

- a controller raises its soft limit up to the hard one before it starts a mesh that
  needs it (:func:`make_room`), and refuses one that the hard limit cannot hold with
  an error that says so, before anything starts;
- a zygote and a host agent raise theirs when they start (:func:`raise_open_files`);
  their workers inherit the higher limit.

A process that never needs more descriptors opens no more of them, whatever its limit:
code that still uses ``select.select`` (descriptors under 1,024 only) is not affected.
"""

from __future__ import annotations

import errno
import os
import resource

__all__ = ["PER_PROCESS", "make_room", "open_files", "raise_open_files"]

#: Descriptors a controller holds per process it starts (~4.1 measured with a local
#: mesh of 64), rounded up.
PER_PROCESS = 5
#: Descriptors kept free for everything else.
SPARE = 64
#: The kernel's ceiling where the hard limit is "unlimited" (``fs.nr_open``'s default).
_NR_OPEN = 1 << 20


def open_files() -> int:
    """How many descriptors this process holds (0 where that cannot be read)."""
    for directory in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(directory))
        except OSError:
            continue
    return 0


def raise_open_files(needed: int | None = None) -> int:
    """Raise this process's soft limit on open files to its hard limit (only where it
    is under ``needed``, when given); the soft limit then."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _ceiling()
    if needed is not None and soft >= needed:
        return soft
    target = hard if hard != resource.RLIM_INFINITY else _ceiling()
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # a ceiling lower than the hard limit: keep what we have
    return soft


def make_room(descriptors: int) -> None:
    """Make room in this process's descriptor table for ``descriptors`` more (a
    mesh's: :data:`PER_PROCESS` per process), and some to spare.

    Raises:
        OSError: (EMFILE) its hard limit cannot hold them.
    """
    if descriptors <= 0:
        return
    needed = open_files() + descriptors + SPARE
    soft = raise_open_files(needed)
    if soft < needed:
        raise OSError(
            errno.EMFILE,
            f"starting these processes needs ~{needed} open files in this process, and "
            f"it may open {soft}: raise its hard limit (`ulimit -Hn`, or a service's "
            "LimitNOFILE)",
        )


def _ceiling() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return _NR_OPEN
