"""Leak checks: child processes, socket files and shared-memory segments that outlive a test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from .._codec import shm_dir
from .._transport._paths import ipc_dir

__all__ = [
    "LeakError",
    "child_pids",
    "descendant_pids",
    "ipc_dir",
    "no_leaks",
    "shm_dir",
    "shm_files",
    "socket_files",
]


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


@contextmanager
def no_leaks() -> Iterator[None]:
    """Raise :class:`LeakError` if the block leaves a child process, socket file or segment."""
    kids = descendant_pids()
    files = socket_files()
    segments = shm_files()
    yield
    leaked = descendant_pids() - kids
    if leaked:
        raise LeakError(f"leaked processes {sorted(leaked)}")
    new_files = socket_files() - files
    if new_files:
        raise LeakError(f"leaked socket files {sorted(new_files)}")
    new_segments = shm_files() - segments
    if new_segments:
        raise LeakError(f"leaked shared-memory segments {sorted(new_segments)} in {shm_dir()}")
