"""How many files a process may open and how many threads its user may run, and making
room for a mesh.

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

Processes: Linux counts a user's threads against its ``RLIMIT_NPROC`` (``ulimit -u``),
which some distributions set to 4,096 for users other than root; a worker runs ~5
threads, so ~800 local workers reach it, and the next fork or thread start fails with
EAGAIN in the middle of the start. So a controller raises its soft limit up to the hard
one before it starts local processes that need it, and refuses a mesh that the hard
limit cannot hold next to what the user runs already, before anything starts
(:func:`make_room`); a zygote and a host agent raise theirs when they start
(:func:`raise_processes`).
The kernel does not apply the limit to root (or to a process with ``CAP_SYS_RESOURCE``
or ``CAP_SYS_ADMIN``).
"""

from __future__ import annotations

import errno
import os
import resource

__all__ = [
    "PER_PROCESS",
    "TASKS_PER_PROCESS",
    "make_room",
    "open_files",
    "raise_open_files",
    "raise_processes",
]

#: Descriptors a controller holds per process it starts (~4.1 measured with a local
#: mesh of 64), rounded up.
PER_PROCESS = 5
#: Descriptors kept free for everything else.
SPARE = 64
#: Threads a local worker runs (its loop's, the output reader, the heartbeat writer and
#: its watch, the parent watch).
TASKS_PER_PROCESS = 5
#: Capability bits that lift RLIMIT_NPROC: CAP_SYS_ADMIN, CAP_SYS_RESOURCE.
_EXEMPT_CAPS = (1 << 21) | (1 << 24)
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


def raise_processes() -> int:
    """Raise this process's soft limit on the user's processes and threads to its hard
    limit; the soft limit then (``RLIM_INFINITY`` for none)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def make_room(descriptors: int, tasks: int = 0) -> None:
    """Make room in this process's descriptor table for ``descriptors`` more (a
    mesh's: :data:`PER_PROCESS` per process), and some to spare; and, for ``tasks``
    more threads of this user on this machine (:data:`TASKS_PER_PROCESS` per local
    process), in its process limit.

    Raises:
        OSError: (EMFILE) its hard limit on open files cannot hold them; (EAGAIN) its
            hard limit on processes cannot hold the user's threads and ``tasks``.
    """
    if descriptors > 0:
        needed = open_files() + descriptors + SPARE
        soft = raise_open_files(needed)
        if soft < needed:
            raise OSError(
                errno.EMFILE,
                f"starting these processes needs ~{needed} open files in this process, "
                f"and it may open {soft}: raise its hard limit (`ulimit -Hn`, or a "
                "service's LimitNOFILE)",
            )
    if tasks > 0:
        _room_for_tasks(tasks)


def _room_for_tasks(tasks: int) -> None:
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if soft == resource.RLIM_INFINITY or _exempt():
        return
    if _system_tasks() + tasks <= soft:  # every thread of the machine's: no need to count
        return
    running = _user_tasks()
    if running + tasks <= soft:
        return
    soft = raise_processes()
    if soft != resource.RLIM_INFINITY and running + tasks > soft:
        raise OSError(
            errno.EAGAIN,
            f"starting these processes needs ~{tasks} more threads of this user's, who "
            f"runs {running} already and may run {soft}: raise the hard process limit "
            "(`ulimit -Hu`, or a service's LimitNPROC)",
        )


def _system_tasks() -> int:
    """Threads on this machine, every user's (``/proc/loadavg``): a bound on the user's,
    read in one go (where it cannot be read, a bound that never fits)."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return 1 << 62


def _exempt() -> bool:
    """Whether the kernel lets this process exceed RLIMIT_NPROC (root, or the
    capabilities that lift it)."""
    if os.getuid() == 0:
        return True
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & _EXEMPT_CAPS)
    except (OSError, ValueError):
        pass
    return False


def _user_tasks() -> int:
    """Threads of this process's real user on this machine, as the kernel counts them
    against RLIMIT_NPROC (0 where ``/proc`` cannot tell)."""
    uid, total = os.getuid(), 0
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:  # ("Uid:" comes before "Threads:")
                    if line.startswith("Uid:") and int(line.split()[1]) != uid:
                        break
                    if line.startswith("Threads:"):
                        total += int(line.split()[1])
                        break
        except (OSError, ValueError):  # gone meanwhile
            continue
    return total


def _ceiling() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return _NR_OPEN
