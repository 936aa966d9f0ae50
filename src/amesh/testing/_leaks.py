"""Leak checks: child processes, socket files, listening abstract sockets, file
descriptors and shared-memory segments that outlive a test."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from typing import TypeVar

from .._transport import ipc_dir
from .._wire import shm_dir

__all__ = [
    "LeakError",
    "abstract_sockets",
    "child_pids",
    "descendant_pids",
    "ipc_dir",
    "no_leaks",
    "open_fds",
    "shm_dir",
    "shm_files",
    "socket_files",
]


_T = TypeVar("_T", bound=Sized)


class LeakError(AssertionError):
    """Something outlived the block that should have cleaned it up."""


def child_pids(pid: int | None = None) -> set[int]:
    """Direct children of ``pid`` (this process by default), zombies included (Linux)."""
    pid = pid or os.getpid()
    out: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.update(int(x) for x in f.read().split())
        except FileNotFoundError:
            continue
    return out


def descendant_pids(pid: int | None = None) -> set[int]:
    """Children of ``pid``, their children and so on (workers forked by a zygote are
    grandchildren of the controller)."""
    out: set[int] = set()
    todo = [pid or os.getpid()]
    while todo:
        for child in child_pids(todo.pop()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def socket_files() -> set[str]:
    """amesh's socket files that exist now."""
    try:
        return set(os.listdir(ipc_dir()))
    except FileNotFoundError:
        return set()


def shm_files() -> set[str]:
    """amesh's shared-memory segments that exist now (names of files in ``shm_dir()``)."""
    try:
        with os.scandir(shm_dir()) as entries:
            return {
                e.name
                for e in entries
                if e.name.startswith("amesh-") and e.is_file(follow_symlinks=False)
            }
    except (FileNotFoundError, NotADirectoryError):
        return set()


def open_fds() -> dict[int, str]:
    """This process's open file descriptors and what each points to (``socket:[N]``,
    ``pipe:[N]``, a path; Linux)."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the descriptor listdir itself used, closed since
            continue
    return out


#: ``Flags`` of a listening socket in ``/proc/net/unix`` (``__SO_ACCEPTCON``).
_ACCEPTCON = 0x10000


def _listening() -> dict[str, str]:
    """amesh's listening abstract unix sockets: inode -> name (``@amesh-...``)."""
    try:
        with open("/proc/net/unix") as f:
            lines = f.read().splitlines()[1:]
    except FileNotFoundError:
        return {}
    out: dict[str, str] = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 8 and fields[7].startswith("@amesh-") and int(fields[3], 16) & _ACCEPTCON:
            out[fields[6]] = fields[7]
    return out


def _process_wide() -> set[str]:
    """Sockets amesh keeps for the life of this process once used (the debug
    listener): not leaks; their names."""
    from .._debug import current_listener

    listener = current_listener()
    return set() if listener is None else {"@" + listener.address.split("://", 1)[1]}


def abstract_sockets() -> set[str]:
    """amesh's abstract unix sockets (``@amesh-...``) listening now that belong to this
    process (one of its descriptors is the socket, or the name carries its pid), but
    for those it keeps for its lifetime."""
    own = f"@amesh-{os.getpid()}-"
    inodes = {t[len("socket:[") : -1] for t in open_fds().values() if t.startswith("socket:[")}
    names = {n for i, n in _listening().items() if i in inodes or n.startswith(own)}
    return names - _process_wide()


#: How long a socket that a native I/O thread (NNG's, the ext transport's) closes
#: after ``close()`` returned may take to go.
SOCKET_CLOSE_GRACE = 2.0


def _settled(leaks: Callable[[], _T]) -> _T:
    """``leaks()``, once empty or, at the latest, after :data:`SOCKET_CLOSE_GRACE`."""
    deadline = time.monotonic() + SOCKET_CLOSE_GRACE
    while (found := leaks()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def _new_sockets(before: dict[int, str]) -> dict[int, str]:
    """Socket descriptors open now that were not in ``before``, but for the ones amesh
    keeps for the life of the process."""
    kept = {f"socket:[{i}]" for i, n in _listening().items() if n in _process_wide()}
    return {
        fd: t
        for fd, t in open_fds().items()
        if t.startswith("socket:") and before.get(fd) != t and t not in kept
    }


def _describe(fds: dict[int, str]) -> str:
    return ", ".join(f"{fd} -> {target}" for fd, target in sorted(fds.items()))


@contextmanager
def no_leaks() -> Iterator[None]:
    """Raise :class:`LeakError` if the block leaves a child process, a socket file, a
    listening abstract socket, a socket descriptor or a shared-memory segment.

    A socket descriptor counts as leaked when its number was free before the block
    and is open after it on a new socket. Other descriptors are not checked: event
    loops and native libraries open eventfds, epoll instances and pipes on first use
    and keep them.
    """
    kids = descendant_pids()
    files = socket_files()
    listening = abstract_sockets()
    fds = open_fds()
    segments = shm_files()
    yield
    leaked = descendant_pids() - kids
    if leaked:
        raise LeakError(f"leaked processes {sorted(leaked)}")
    new_files = socket_files() - files
    if new_files:
        raise LeakError(f"leaked socket files {sorted(new_files)}")
    new_listening = _settled(lambda: abstract_sockets() - listening)
    if new_listening:
        raise LeakError(f"leaked listening abstract sockets {sorted(new_listening)}")
    new_fds = _settled(lambda: _new_sockets(fds))
    if new_fds:
        raise LeakError(f"leaked socket descriptors {_describe(new_fds)}")
    new_segments = shm_files() - segments
    if new_segments:
        raise LeakError(f"leaked shared-memory segments {sorted(new_segments)} in {shm_dir()}")
