"""Tracebacks that show the user's code: amesh's own frames left out, notebook cells
named as IPython names them.

Remote tracebacks are formatted without amesh's frames where they are made (the worker:
:func:`format_traceback`); a controller leaves them out of its own tracebacks when it
prints them, which :func:`hide_amesh_frames` arranges (``sys.excepthook``, and
IPython's display of a cell's error). ``AMESH_DEBUG=1`` keeps them all: the callers,
which read the setting, then do not ask.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["RUNNERS", "cell_names", "format_traceback", "hide_amesh_frames", "user_frames"]

#: Frames of files under this directory are amesh's own.
AMESH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: The libraries amesh runs the user's code through (event loops, worker threads,
#: futures): their frames right after amesh's (or first in a stack) are amesh's work.
RUNNERS = ("anyio", "asyncio", "concurrent", "outcome", "trio", "uvloop")

_FILE_LINE = re.compile(r'^(\s*)File "([^"]+)", line (\d+)', re.MULTILINE)


def _package_dir(name: str) -> str | None:
    """The directory of imported package ``name`` (with a trailing separator)."""
    file = getattr(sys.modules.get(name), "__file__", None)
    return os.path.dirname(file) + os.sep if file else None


def _hidden(filenames: list[str]) -> list[bool]:
    """Which of a stack's frames (their files, outermost first) are amesh's work: its
    own, and those of a library it runs things through that come first or right after
    one hidden (a user's own call into asyncio stays)."""
    # (uvloop's compiled frames name their source relative to the package: uvloop/...)
    runners = (*filter(None, map(_package_dir, RUNNERS)), *(f"{r}/" for r in RUNNERS))
    hidden: list[bool] = []
    for name in filenames:
        after = not hidden or hidden[-1]
        hidden.append(name.startswith(AMESH_DIR) or (after and name.startswith(runners)))
    return hidden


def user_frames(stack: traceback.StackSummary) -> traceback.StackSummary:
    """``stack`` without the frames of amesh's work (see :func:`_hidden`)."""
    frames = list(stack)
    keep = _hidden([f.filename for f in frames])
    return traceback.StackSummary.from_list([f for f, h in zip(frames, keep) if not h])


def format_traceback(exc: BaseException, with_amesh: bool = False) -> str:
    """The traceback text of ``exc``, causes and contexts included, as Python prints
    it; unless ``with_amesh`` (``AMESH_DEBUG``), without amesh's own frames and the
    frames of the libraries it called the user's code through."""
    te = traceback.TracebackException.from_exception(exc)
    if not with_amesh:
        for t in _chain(te):
            t.stack = user_frames(t.stack)
    return "".join(te.format())


def _chain(te: traceback.TracebackException) -> list[traceback.TracebackException]:
    """``te`` and every exception it holds: causes, contexts, members of a group."""
    found: dict[int, traceback.TracebackException] = {}
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) not in found:
            found[id(t)] = t
            todo += [x for x in (t.__cause__, t.__context__) if x is not None]
            todo += t.exceptions or ()
    return list(found.values())


def _without_amesh(tb: TracebackType | None) -> TracebackType | None:
    """A traceback of the same frames as ``tb`` less those of amesh's work."""
    entries: list[TracebackType] = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    hidden = _hidden([e.tb_frame.f_code.co_filename for e in entries])
    kept: TracebackType | None = None
    for entry, hide in zip(reversed(entries), reversed(hidden)):
        if not hide:
            kept = TracebackType(kept, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return kept


def cell_names(text: str) -> str:
    """``text`` (a traceback) with the files of notebook cells named as IPython names
    them, ``Cell In[3], line 4``, when this process runs IPython: code of a cell that
    travelled by value keeps the name the kernel compiled it under, a temporary file."""
    shell = _ipython()
    cells: dict[str, int] = getattr(getattr(shell, "compile", None), "_filename_map", {})
    if not cells:
        return text

    def name(m: re.Match[str]) -> str:
        indent, path, line = m.groups()
        if path not in cells:
            return m.group(0)
        return f"{indent}Cell In[{cells[path]}], line {line}"

    return _FILE_LINE.sub(name, text)


def _ipython() -> Any:
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    return get() if get is not None else None


_installed = False


def hide_amesh_frames() -> None:
    """From now on, print the tracebacks of this process's uncaught errors (and of a
    notebook cell's) without amesh's frames. A hook someone else set is left alone."""
    global _installed
    if _installed:
        return
    _installed = True
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _excepthook
    shell = _ipython()
    if shell is not None and not shell.custom_exceptions:
        shell.set_custom_exc((Exception,), _show_in_ipython)


def _excepthook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    try:
        text = format_traceback(value)
    except Exception:  # never lose the error for want of a shorter traceback
        sys.__excepthook__(etype, value, tb)
        return
    sys.stderr.write(text)
    sys.stderr.flush()


def _show_in_ipython(
    shell: Any,
    etype: type[BaseException],
    value: BaseException,
    tb: TracebackType | None,
    tb_offset: int | None = None,
) -> None:
    """What IPython does with a cell's error (its custom handler, given every
    ``Exception``), the traceback less amesh's frames."""
    show: Callable[..., Any] = shell.showtraceback
    show((etype, value, _without_amesh(tb)), tb_offset, running_compiled_code=True)
