"""An environment opened: its file read, its lock made or checked, its identity."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from ._base import EnvError
from ._file import EnvSpec, load_spec
from ._lock import (
    Lock,
    amesh_requirements,
    env_hash,
    lock_inputs,
    lock_path,
    read_lock,
    resolve,
    this_platform,
    this_python,
)

__all__ = ["Env", "lock_env", "open_env", "stale_reason"]

log = logging.getLogger("amesh.env")


class Env(msgspec.Struct, frozen=True):
    """An environment: its file and its lock.

    Attributes:
        spec: the file, checked.
        lock: its dependencies, resolved.
        hash: its identity (sha256 hex of its settings and lock).
    """

    spec: EnvSpec
    lock: Lock
    hash: str

    @property
    def short_hash(self) -> str:
        """The first 12 hex digits of :attr:`hash`, as names and messages show it."""
        return self.hash[:12]


def stale_reason(spec: EnvSpec, lock: Lock | None) -> str:
    """Why ``lock`` is not ``spec``'s lock ("" if it is): missing, made for another
    environment, Python or platform, or for other dependencies."""
    if lock is None:
        return "there is no lock"
    if lock.env != spec.name:
        return f"the lock is environment {lock.env!r}'s"
    if (lock.python, lock.platform) != (this_python(), this_platform()):
        return (
            f"the lock is for Python {lock.python} on {lock.platform}, this controller "
            f"runs {this_python()} on {this_platform()}"
        )
    amesh = amesh_requirements() if lock.amesh else []
    if lock.inputs != lock_inputs(spec, lock.python, lock.platform, amesh):
        return "the dependencies changed since it was made"
    return ""


def _write(path: Path, text: str) -> None:
    """``text`` into ``path`` atomically (a reader sees the old lock or the new one)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def lock_env(
    spec: EnvSpec,
    *,
    include_amesh: bool = True,
    find_links: Sequence[str | Path] = (),
    no_index: bool = False,
) -> Lock:
    """Resolve ``spec`` (see :func:`amesh._env.resolve`) and write its lock beside its
    file (``<stem>.lock``).

    Raises:
        EnvError: the spec has no file, or does not resolve.
    """
    if not spec.file:
        raise EnvError(f"{spec.name}: an environment read from no file has nowhere to lock")
    lock = resolve(spec, include_amesh=include_amesh, find_links=find_links, no_index=no_index)
    _write(lock_path(spec.file), lock.text())
    return lock


def open_env(
    path: str | Path,
    *,
    locked: bool = False,
    include_amesh: bool = True,
    find_links: Sequence[str | Path] = (),
    no_index: bool = False,
) -> Env:
    """The environment of the file at ``path``, locked: its lock is read, and made
    again (with a warning that says why) when missing or stale.

    Args:
        path: the environment file.
        locked: refuse a missing or stale lock rather than make it.
        include_amesh: a new lock holds amesh's own requirements too.
        find_links: where a new lock's distributions may come from, besides the index.
        no_index: from ``find_links`` only.

    Raises:
        EnvError: a bad file, a bad lock, a missing or stale lock with ``locked``, or
            dependencies that do not resolve.
    """
    spec = load_spec(path)
    where = lock_path(spec.file)
    lock = read_lock(where)
    why = stale_reason(spec, lock)
    if why and locked:
        raise EnvError(f"{where}: {why}, and locked=True: run `amesh env lock {spec.file}`")
    if lock is None or why:
        log.warning("%s: %s: locking %s", where, why, spec.name)
        lock = lock_env(spec, include_amesh=include_amesh, find_links=find_links, no_index=no_index)
    return Env(spec, lock, env_hash(spec, lock))
