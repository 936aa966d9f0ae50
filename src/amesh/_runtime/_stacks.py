"""The current Python stacks of a process, as text (``amesh stacks``,
``ProcMesh.stacks``): the user's frames first.

A worker's stacks are mostly amesh's and the event loop's own: the loop's thread runs
the ``stacks`` handler itself, amesh runs threads and tasks of its own, and a handler's
task starts with a dozen frames of dispatch. So, unless ``full`` (``AMESH_DEBUG=1``,
``--full``), the threads and tasks with a frame of the user's code come first, each
with its frames of amesh, the standard library and the libraries amesh runs on
(:data:`_OWN_PACKAGES`) folded into one line (``... 9 frames of amesh, asyncio``) but
the innermost (where it waits now); the others are counted in a last line.

The stacks come from the process itself (:func:`format_stacks`, on its event loop:
threads and tasks), or from a signal when its loop does not answer
(:func:`format_dump`, of what :func:`amesh._runtime._stackdump.dump` took: threads
only).
"""

from __future__ import annotations

import functools
import io
import os
import re
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from types import FrameType
from typing import Any

import sniffio

from ._context import context_coroutine
from ._pausable import awaited_handler

__all__ = ["Stack", "format_dump", "format_stacks", "parse_dump", "render"]

#: Libraries outside the standard library that amesh runs user code on: their frames
#: fold with amesh's.
_OWN_PACKAGES = ("anyio", "trio", "outcome", "sniffio", "uvloop", "greenlet")
_AMESH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass
class Stack:
    """One thread's or task's stack: ``title`` (``thread MainThread (1401)``, ``task
    Task-3``) and its frames, outermost first."""

    title: str
    frames: list[traceback.FrameSummary]


def format_stacks(full: bool = False) -> str:
    """Every thread's current stack, then the event loop's pending tasks' (asyncio or
    trio; called on the loop's thread), the user's first (see the module's doc)."""
    return render(_loop_stacks(), full)


def format_dump(text: str, note: str, full: bool = False) -> str:
    """The stacks of ``text`` (a :mod:`faulthandler` dump), under ``note`` (how they
    were taken)."""
    return f"({note})\n" + render(parse_dump(text), full)


def _loop_stacks() -> list[Stack]:
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = [
        Stack(f"thread {names.get(ident, '?')} ({ident})", _extract(traceback.walk_stack(frame)))
        for ident, frame in sys._current_frames().items()
    ]
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return stacks
    if library == "asyncio":
        import asyncio

        for task in asyncio.all_tasks():
            frames = list(_await_frames(task.get_coro()))
            stacks.append(Stack(f"task {task.get_name()}", _extract(frames, outermost=True)))
    elif library == "trio":
        import trio

        for t in _trio_walk(trio.lowlevel.current_root_task()):
            frames = list(_await_frames(t.coro))
            stacks.append(Stack(f"task {t.name}", _extract(frames, outermost=True)))
    return stacks


def _extract(
    frames: Iterator[tuple[FrameType, int]] | list[tuple[FrameType, int]], outermost: bool = False
) -> list[traceback.FrameSummary]:
    """Frame summaries, outermost first (``walk_stack`` gives the innermost first)."""
    summary = list(traceback.StackSummary.extract(iter(frames)))
    return summary if outermost else summary[::-1]


def _await_frames(coro: Any) -> Iterator[tuple[FrameType, int]]:
    """The frames of ``coro`` and of what it awaits, outermost first (a task's whole
    stack: ``Task.get_stack`` has its outermost frame only)."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            return
        yield frame, frame.f_lineno
        below = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if below is None:
            # a handler's coroutine runs in a greenlet of its own, its waits passed
            # on; an actor's loop runs in a context of its own, its steps passed on
            below = awaited_handler(coro) or context_coroutine(coro)
        coro = below


def _trio_walk(task: Any) -> Iterator[Any]:
    """``task`` and every task below it (in its nurseries), depth first."""
    if task is None:
        return
    todo = [task]
    while todo:
        t = todo.pop()
        yield t
        for nursery in t.child_nurseries:
            todo.extend(nursery.child_tasks)


_HEADER = re.compile(r"(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'  File "(.*)", line (\d+|\?\?\?) in (.*)$')


def parse_dump(text: str) -> list[Stack]:
    """The threads of a :mod:`faulthandler` dump (taken by signalling the main thread,
    so its "current thread" is the main one), frames outermost first, with their
    source lines where the files are here."""
    stacks: list[Stack] = []
    for line in text.splitlines():
        if m := _HEADER.match(line):
            main = " (main: runs the event loop)" if m[1] == "Current thread" else ""
            stacks.append(Stack(f"thread {m[2]}{main}", []))
        elif (m := _FRAME.match(line)) and stacks:
            known = m[2].isdigit()
            frame = traceback.FrameSummary(m[1], int(m[2]) if known else 0, m[3], lookup_line=known)
            stacks[-1].frames.insert(0, frame)
    return stacks


@functools.cache
def _roots() -> tuple[tuple[tuple[str, ...], str], ...]:
    """``(prefixes, label)`` of the places whose frames are not the user's: amesh, each
    of :data:`_OWN_PACKAGES`, the standard library (label: its top module)."""
    import sysconfig

    roots: list[tuple[tuple[str, ...], str]] = [((_AMESH_DIR,), "amesh")]
    for name in _OWN_PACKAGES:
        try:
            spec = find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            roots.append(
                (tuple(os.path.join(p, "") for p in spec.submodule_search_locations), name)
            )
    paths = sysconfig.get_paths()
    stdlib = {os.path.join(paths[k], "") for k in ("stdlib", "platstdlib")}
    roots.append((tuple(stdlib), ""))
    return tuple(roots)


@functools.cache
def whose(filename: str) -> str | None:
    """Whose code ``filename`` is when not the user's: ``amesh``, ``anyio``,
    ``asyncio`` (the standard library's, by top module); None for the user's."""
    if filename.startswith("<frozen "):
        return filename[len("<frozen ") :].rstrip(">").split(".")[0]
    parts = filename.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        # (the standard library's directory holds site-packages outside a venv)
        roots = _roots()[:-1]
    else:
        roots = _roots()
    for prefixes, label in roots:
        for prefix in prefixes:
            if filename.startswith(prefix):
                if label:
                    return label
                top = filename[len(prefix) :].split(os.sep)[0]
                return top.removesuffix(".py")
    return None


def render(stacks: list[Stack], full: bool = False) -> str:
    """``stacks`` as text: all of every one when ``full``, else the user's first (see
    the module's docstring)."""
    out = io.StringIO()
    if full:
        for stack in stacks:
            out.write(f"--- {stack.title}\n")
            out.write("".join(traceback.StackSummary.from_list(stack.frames).format()))
        return out.getvalue()
    theirs = [s for s in stacks if any(whose(f.filename) is None for f in s.frames)]
    for stack in theirs:
        out.write(f"--- {stack.title}\n")
        _fold(stack.frames, out)
    rest = [s for s in stacks if s not in theirs]
    if rest:
        threads = sum(1 for s in rest if s.title.startswith("thread"))
        counts = [
            f"{n} {what}{'s' if n > 1 else ''}"
            for n, what in ((threads, "thread"), (len(rest) - threads, "task"))
            if n
        ]
        head = "and " if theirs else "no frame of the user's code: "
        out.write(
            f"({head}{' and '.join(counts)} in amesh's and its libraries' code only: "
            "--full, full=True or AMESH_DEBUG=1 shows them)\n"
        )
    return out.getvalue()


def _fold(frames: list[traceback.FrameSummary], out: io.StringIO) -> None:
    """Write ``frames``, each run of frames not the user's as one line but the
    innermost frame."""
    run: list[traceback.FrameSummary] = []

    def flush() -> None:
        if len(run) > 1:
            labels = list(dict.fromkeys(whose(f.filename) for f in run))
            out.write(f"  ... {len(run)} frames of {', '.join(map(str, labels))}\n")
        else:
            out.write("".join(traceback.StackSummary.from_list(run).format()))
        run.clear()

    for i, frame in enumerate(frames):
        if whose(frame.filename) is not None and i < len(frames) - 1:
            run.append(frame)
            continue
        flush()
        out.write("".join(traceback.StackSummary.from_list([frame]).format()))
