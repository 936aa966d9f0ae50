"""Code shipped by value, with its source lines.

Classes and functions from ``__main__`` (scripts, notebooks) travel by value
(cloudpickle); their code objects go through :func:`reduce_code`, with their real file
name and the source lines they span, which the receiver puts in ``linecache``
(:func:`_load_code`): its tracebacks show them.
"""

from __future__ import annotations

import linecache
import marshal
import types
from typing import Any

__all__ = ["reduce_code"]


def reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    """Code shipped by value (``__main__``, a notebook cell), with its source lines.

    cloudpickle's own reduction renames the file ``<dynamic-code>``; marshal keeps the
    real name. The lines the code spans (nested functions included) go along, so that
    a traceback through it in another process shows them (:func:`_load_code`): the
    receiver may not have the file (another host, a notebook cell).
    """
    first = code.co_firstlineno
    lines = linecache.getlines(code.co_filename)[first - 1 : _last_line(code)]
    return _load_code, (marshal.dumps(code), code.co_filename, first, lines)


def _last_line(code: types.CodeType) -> int:
    """The last source line of ``code`` and of the code nested in it."""
    last = max((line for _, _, line in code.co_lines() if line is not None), default=0)
    for const in code.co_consts:
        if type(const) is types.CodeType:
            last = max(last, _last_line(const))
    return last


def _load_code(data: bytes, filename: str, first: int, lines: list[str]) -> types.CodeType:
    """Rebuild code from :func:`reduce_code`, and give ``linecache`` its source lines.

    The lines go under the code's own file name (``mtime`` None: ``linecache`` never
    checks them against a file), over what is known of that file already; lines of
    the file that no shipped code spans stay blank.
    """
    if lines:
        _remember_lines(filename, first, lines)
    code: types.CodeType = marshal.loads(data)
    return code


def _remember_lines(filename: str, first: int, lines: list[str]) -> None:
    """Put ``lines`` at line ``first`` of ``filename`` in ``linecache``."""
    entry = linecache.cache.get(filename)
    known: list[str] = []
    unchecked = False  # lines no file is checked against (mtime None), ours to change
    if entry is not None and len(entry) == 4:
        known, unchecked = entry[2], entry[1] is None
    start, end = first - 1, first - 1 + len(lines)
    if unchecked and known[start:end] == lines:
        return  # already there (the same code shipped again)
    if not unchecked:
        known = list(known)
    if len(known) < start:
        known.extend("\n" for _ in range(start - len(known)))
    known[start:end] = lines
    linecache.cache[filename] = (0, None, known, filename)  # the size counts with an mtime
