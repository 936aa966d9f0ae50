"""This process's live ProcMeshes, in a file that ``amesh list`` on this machine reads.

Each controller (any process that started a ProcMesh) keeps
``<state dir>/meshes/<pid>.json`` (mode 0600, in the user-only state directory of
:mod:`amesh._hosts._home`): per live mesh its name, shape, workers' addresses and pids
by slot and actor meshes (and their key, in hex, when it is not the job key), with
the job key in hex (the same trust as the state directory's ``key`` file). It is
rewritten (atomically) when a mesh starts, spawns or stops an actor mesh, restarts
processes or stops, and removed when the process's last mesh stops. The hosts layer
registers where the state directory is (see :func:`set_registry_dir`); without one,
nothing is written.

A file that does not hold such a record (damaged, or written by hand) is skipped with
a warning: the others are still listed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import msgspec

from .._identity import job_key, key_for

__all__ = [
    "Listed",
    "forget",
    "read_all",
    "registry_dir",
    "set_registry_dir",
    "unlisted",
    "update",
]

log = logging.getLogger("amesh.mesh")


class Listed(Protocol):
    """A mesh as the registry lists it."""

    def listing(self) -> dict[str, Any] | None:
        """Its entry (None: not running)."""
        ...


_registry_dir: Callable[[], Path] | None = None
#: the live meshes of this process, in the order they started
_live: dict[int, Listed] = {}
#: meshes are not written while this is set (see :func:`unlisted`)
_unlisted = False


def set_registry_dir(where: Callable[[], Path]) -> None:
    """Register where the files of the registry live (the hosts layer does, on import)."""
    global _registry_dir
    _registry_dir = where


@contextmanager
def unlisted() -> Iterator[None]:
    """Write no file while in the block: the zygote's rehearsal, a mesh that no one
    should find, stop or take for a controller's."""
    global _unlisted
    _unlisted = True
    try:
        yield
    finally:
        _unlisted = False


def registry_dir() -> Path | None:
    """The directory of the registry files (None: none registered)."""
    return _registry_dir() if _registry_dir is not None else None


def update(mesh: Listed) -> None:
    """``mesh`` started or changed: rewrite this process's file."""
    _live[id(mesh)] = mesh
    _write()


def forget(mesh: Listed) -> None:
    """``mesh`` stopped (or was let go of): rewrite the file, or remove it if it was
    the last one."""
    if _live.pop(id(mesh), None) is not None:
        _write()


def _keyed(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry``, with the key its workers hold when it is not the job key (a
    persistent mesh's, in a process that holds two: see :func:`amesh._identity.hold_key`)."""
    addrs = entry.get("addrs")
    key = key_for(addrs[0]) if addrs else job_key()
    return entry if key == job_key() else {**entry, "key": key.hex()}


def _write() -> None:
    try:
        where = registry_dir()
        if where is None or _unlisted:
            return
        path = where / f"{os.getpid()}.json"
        meshes = [_keyed(e) for e in (m.listing() for m in _live.values()) if e is not None]
        if not meshes:
            path.unlink(missing_ok=True)
            return
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "key": job_key().hex(), "meshes": meshes}
        tmp = where / f".{os.getpid()}.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: amesh list just won't see this process
        log.debug("cannot write the mesh registry: %s", exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Entry(msgspec.Struct):
    """What a reader of a mesh's entry relies on (see ``ProcMesh.listing``)."""

    name: str
    labels: list[str]
    sizes: list[int]
    addrs: list[str]
    pids: list[int]
    actors: list[str]
    controller: str
    key: str = ""


class _Record(msgspec.Struct):
    """What a reader of a controller's file relies on (see :func:`_write`)."""

    pid: int
    key: str
    meshes: list[_Entry]


def _checked(path: Path, pid: int) -> dict[str, Any] | None:
    """The record in ``path`` (the file of controller ``pid``); None, and a warning,
    when it does not hold one."""
    try:
        data = path.read_bytes()
    except OSError:  # removed meanwhile
        return None
    try:
        record = msgspec.json.decode(data)
        checked = msgspec.convert(record, _Record)
        for key in [checked.key, *(e.key for e in checked.meshes)]:
            bytes.fromhex(key)
        if checked.pid != pid:
            raise ValueError(f"it names pid {checked.pid}")
        for entry in checked.meshes:
            if len(entry.addrs) != len(entry.pids):
                raise ValueError(
                    f"mesh {entry.name!r} has {len(entry.addrs)} addresses "
                    f"for {len(entry.pids)} pids"
                )
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        log.warning("skipping %s, which is not a mesh registry file: %s", path, exc)
        return None
    assert isinstance(record, dict)  # (msgspec.convert made a _Record of it)
    return record


def read_all() -> list[dict[str, Any]]:
    """The records of the live controllers on this machine, by pid; the files of
    controllers that are gone are removed, those that do not hold a record skipped
    (with a warning)."""
    where = registry_dir()
    if where is None or not where.is_dir():
        return []
    records = []
    for path in sorted(where.glob("*.json")):
        try:
            pid = int(path.stem)
        except ValueError:
            continue
        if not _alive(pid):
            path.unlink(missing_ok=True)
            continue
        record = _checked(path, pid)
        if record is not None:
            records.append(record)
    return sorted(records, key=lambda r: int(r["pid"]))
