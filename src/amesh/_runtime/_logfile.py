"""The log files of a persistent mesh's workers, which ``amesh logs`` reads through
their host agent once no controller holds the mesh (a controller keeps only the last
lines it printed, and only while it runs).

A host agent that starts a worker of a persistent mesh names a file for it
(``AMESH_OUTPUT_FILE``, in the agent's directory ``<state dir>/logs/<agent pid>/``);
the worker's capture (:mod:`amesh._runtime._capture`) appends each line it sends to
it (:class:`LogWriter`): ``<unix time> [label rank] text``, so that the lines of
several files merge in time order. A file holds at most ``AMESH_LOG_FILE_BYTES``
(4 MiB by default); past that it is renamed ``<file>.1`` (replacing the one before)
and a new one begins: at most twice that per worker. The agent removes the files when
the mesh is stopped, and its directory when it exits.

:func:`read` gives the last lines of some files, or those written since a cursor
(``amesh logs -f``).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence

__all__ = ["LogWriter", "rank_of", "read"]

log = logging.getLogger("amesh.worker")

#: a line of a file: its time, and its text (``[label rank] ...``)
_LINE = re.compile(rb"(\d+\.\d+) (.*)")
_RANK = re.compile(r"\[[^\]]* (\d+)\] ")

#: per file, ``[inode, offset]`` of what was read of it
Cursor = dict[str, list[int]]


class LogWriter:
    """Appends lines to ``path``, rotated past ``cap`` bytes (see the module's doc).

    Never raises: a file that cannot be written (a full disk, its directory removed
    with the mesh) is given up, and the lines go on to the controller as before.
    """

    def __init__(self, path: str, cap: int) -> None:
        self._path = path
        self._cap = cap
        self._fd = -1
        self._size = 0
        self._open()

    def _open(self) -> None:
        try:
            self._fd = os.open(
                self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            log.debug("no log file %s: %s", self._path, exc)
            self._fd = -1

    def write(self, texts: Iterable[str]) -> None:
        """Append ``texts`` (lines, without their ends), stamped with the time now."""
        if self._fd < 0:
            return
        stamp = f"{time.time():.6f} "
        data = "".join(f"{stamp}{t}\n" for t in texts).encode("utf-8", "backslashreplace")
        if not data:
            return
        if len(data) > self._cap:  # more than a whole file: its last lines only
            data = data[data.index(b"\n", len(data) - self._cap) + 1 :]
        try:
            if self._size + len(data) > self._cap:
                os.close(self._fd)
                self._fd = -1
                os.replace(self._path, self._path + ".1")
                self._open()
                if self._fd < 0:
                    return
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            self._size += len(data)
        except OSError as exc:
            log.debug("log file %s given up: %s", self._path, exc)
            self.close()

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def rank_of(line: str) -> int | None:
    """The rank of a line ``[label rank] text`` (None: not such a line)."""
    m = _RANK.match(line)
    return int(m[1]) if m is not None else None


def _lines(path: str, start: int = 0) -> tuple[list[tuple[float, str]], int, int]:
    """``(lines, inode, end)``: the whole lines of ``path`` from byte ``start``, and
    where the last one ends (no file: nothing, inode 0)."""
    try:
        with open(path, "rb") as f:
            inode = os.fstat(f.fileno()).st_ino
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return [], 0, 0
    whole = data[: data.rfind(b"\n") + 1]
    found = []
    for raw in whole.splitlines():
        m = _LINE.fullmatch(raw)
        if m is not None:
            found.append((float(m[1]), m[2].decode("utf-8", "replace")))
    return found, inode, start + len(whole)


def _new_lines(path: str, seen: list[int] | None) -> tuple[list[tuple[float, str]], list[int]]:
    """The lines of ``path`` (and of its rotated ``path.1``) after ``seen``."""
    rotated = path + ".1"
    if seen is None:
        old, _, _ = _lines(rotated)
        new, inode, end = _lines(path)
        return old + new, [inode, end]
    inode, offset = seen
    new, now, end = _lines(path, offset if inode else 0)
    if now == inode or not inode:
        return new, [now, end]
    # rotated since: the rest of the file read before (now path.1, if only once), then
    # the new one from its start
    rest, was, _ = _lines(rotated, offset)
    new, now, end = _lines(path)
    return (rest if was == inode else []) + new, [now, end]


def read(
    paths: Sequence[str], n: int = 100, rank: int | None = None, cursor: Cursor | None = None
) -> tuple[list[tuple[float, str]], Cursor]:
    """The lines of the log files ``paths`` (of rank ``rank`` only, when given), in
    time order, each ``(time, text)``: the last ``n``, or, with a ``cursor`` (from an
    earlier call), all those written since. Returns them and the cursor at their end."""
    merged: list[list[tuple[float, str]]] = []
    after: Cursor = {}
    for path in paths:
        lines, after[path] = _new_lines(path, None if cursor is None else cursor.get(path))
        if rank is not None:
            lines = [line for line in lines if rank_of(line[1]) == rank]
        merged.append(lines)
    found = list(heapq.merge(*merged, key=lambda line: line[0]))
    if cursor is None:
        found = found[-n:] if n > 0 else []
    return found, after
