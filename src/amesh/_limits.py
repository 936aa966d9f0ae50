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
which some distributions set to 4,096 for users other than root; a worker runs ~4
threads, so ~1,000 local workers reach it, and the next fork or thread start fails with
EAGAIN in the middle of the start. So a controller raises its soft limit up to the hard
one before it starts local processes that need it, and refuses a mesh that the hard
limit cannot hold next to what the user runs already, before anything starts
(:func:`make_room`); a zygote and a host agent raise theirs when they start
(:func:`raise_processes`).
The kernel does not apply the limit to root (or to a process with ``CAP_SYS_RESOURCE``
or ``CAP_SYS_ADMIN``).

A container, a systemd service or a batch job may also cap the tasks of its control
group (``pids.max``: Docker's ``--pids-limit``, systemd's ``TasksMax``, a Kubernetes
pod's PID limit), for root as for anyone, and nothing inside may raise it. So a mesh
whose local processes would not fit under the tightest such cap, next to the tasks
running under it already, is refused before anything starts, with the cap it met; and
so is one that would pass what the kernel lets the whole machine run
(``kernel.pid_max``, ``kernel.threads-max``).
"""

from __future__ import annotations

import errno
import os
import resource
from typing import NamedTuple

__all__ = [
    "PER_PROCESS",
    "TASKS_PER_PROCESS",
    "PidsCap",
    "make_room",
    "open_files",
    "pids_cap",
    "raise_open_files",
    "raise_processes",
]

#: Descriptors a controller holds per process it starts (~4.1 measured with a local
#: mesh of 64), rounded up.
PER_PROCESS = 5
#: Descriptors kept free for everything else.
SPARE = 64
#: Threads a local worker runs (its loop's, the output reader, the heartbeat writer, the
#: parent watch).
TASKS_PER_PROCESS = 4
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
    cap = pids_cap()
    if cap is not None and cap.limit - cap.current < tasks:
        raise OSError(
            errno.EAGAIN,
            f"starting these processes needs ~{tasks} more threads, and the control "
            f"group {cap.path} lets its processes run {cap.limit}, {cap.current} of "
            "which run already: raise its pids.max (a container's --pids-limit, a "
            "service's TasksMax, a pod's PID limit)",
        )
    everyone = _loadavg_tasks()  # every user's threads on this machine
    limit, name = _kernel_tasks()
    if limit is not None and everyone is not None and everyone + tasks > limit:
        raise OSError(
            errno.EAGAIN,
            f"starting these processes needs ~{tasks} more threads, and this machine "
            f"runs {everyone} of the {limit} its kernel allows: raise {name} (sysctl)",
        )
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if soft == resource.RLIM_INFINITY or _exempt():
        return
    if everyone is not None and everyone + tasks <= soft:  # the user's fit: no need to count
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


def _kernel_tasks() -> tuple[int | None, str]:
    """How many threads the kernel lets this machine run, all users' together (the
    lower of ``kernel.pid_max``, less the 300 numbers it never hands out again, and
    ``kernel.threads-max``), and that setting's name; None where neither can be read."""
    limits = []
    for name, less in (("kernel.pid_max", 300), ("kernel.threads-max", 0)):
        try:
            with open("/proc/sys/" + name.replace(".", "/")) as f:
                limits.append((int(f.read()) - less, name))
        except (OSError, ValueError):
            continue
    if not limits:
        return None, ""
    return min(limits)


def _loadavg_tasks() -> int | None:
    """Threads on this machine, every user's (``/proc/loadavg``), read in one go; None
    where that cannot be read."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return None


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


class PidsCap(NamedTuple):
    """A control group's cap on the tasks (threads) of its processes."""

    path: str  #: its directory
    limit: int  #: its ``pids.max``
    current: int  #: its ``pids.current``: the tasks under it now


def pids_cap(proc: str = "/proc") -> PidsCap | None:
    """The tightest ``pids.max`` over this process's control group and those above it
    (the one with the least room left), or None where none is capped or none can be
    read (no ``pids`` controller, no ``/proc``). ``proc``: where procfs is."""
    try:
        with open(f"{proc}/self/cgroup") as f:
            groups = f.read().splitlines()
        with open(f"{proc}/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    v1 = v2 = None  # (the hierarchy's path mounted, where) of the pids controller's
    for line in mounts:
        fields, _, fs = line.partition(" - ")
        left, right = fields.split(), fs.split()
        if len(left) < 5 or len(right) < 3:
            continue
        if right[0] == "cgroup" and "pids" in right[2].split(",") and v1 is None:
            v1 = (left[3], left[4])
        elif right[0] == "cgroup2" and v2 is None:
            v2 = (left[3], left[4])
    for line in groups:  # "id:controllers:path"; cgroup v2's is "0::path"
        _, controllers, path = line.split(":", 2)
        if v1 is not None and "pids" in controllers.split(","):
            return _tightest(*v1, path)
        if v1 is None and v2 is not None and controllers == "":
            return _tightest(*v2, path)
    return None


def _tightest(root: str, mount: str, path: str) -> PidsCap | None:
    """The capped group with the least room from ``path`` (a group in the hierarchy
    whose ``root`` is mounted at ``mount``) up to the mount."""
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]  # (a container that sees its own group as the root)
    here = os.path.normpath(mount + "/" + path.lstrip("/"))
    best: PidsCap | None = None
    while here == mount or here.startswith(mount + "/"):
        try:
            with open(os.path.join(here, "pids.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(here, "pids.current")) as f:
                    cap = PidsCap(here, int(limit), int(f.read()))
                if best is None or cap.limit - cap.current < best.limit - best.current:
                    best = cap
        except (OSError, ValueError):  # the root group (no pids.max), or gone
            pass
        if here == mount:
            break
        here = os.path.dirname(here)
    return best
