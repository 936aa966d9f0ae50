"""Which process this is, for good, and whether another one still runs.

A shared-memory segment's name says which process made it (:mod:`._segments`), and a
test session's directories say which session made them (``amesh.testing``):
``<pid>.<start>.<pidns>``, where ``<start>`` is the process's start time (in clock
ticks since boot, field 22 of /proc/<pid>/stat) and ``<pidns>`` the inode of its pid
namespace. A pid reused by a later process has another start time, so a name made
this way belongs to one process for good, and :func:`is_dead` tells once it ended.
"""

from __future__ import annotations

import os

__all__ = ["has_procfs", "is_dead", "pid_namespace", "stat_of", "this_process"]

_self: tuple[int, str] | None = None  # (pid, "<pid>.<start>.<pidns>") of this process


def this_process() -> str:
    """``<pid>.<start>.<pidns>`` of this process (0 for what /proc does not tell)."""
    global _self
    pid = os.getpid()
    cached = _self
    if cached is None or cached[0] != pid:
        ps = stat_of(pid) if has_procfs() else None
        cached = _self = (pid, f"{pid}.{ps[1] if ps else 0}.{pid_namespace()}")
    return cached[1]


def has_procfs() -> bool:
    """Whether /proc tells processes' start times here."""
    return os.path.exists("/proc/self/stat")


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def stat_of(pid: int) -> tuple[bytes, int] | None:
    """(state, start time) of process ``pid``; None if there is no such process.

    Raises:
        OSError, ValueError, IndexError: /proc could not tell.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its end.
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0], int(fields[19])


def is_dead(pid: int, start: int, procfs: bool) -> bool:
    """True if process ``pid`` that started at ``start`` (0: unknown) surely ended."""
    if pid <= 0:
        return False
    if start and procfs:
        try:
            ps = stat_of(pid)
        except (OSError, ValueError, IndexError):
            return False
        # another start time: the pid was reused; Z/X: it exited, only not reaped yet
        return ps is None or ps[1] != start or ps[0] in (b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists
        return False
    return False
