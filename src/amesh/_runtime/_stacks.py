"""The current Python stacks of this process, as text (``amesh stacks``)."""

from __future__ import annotations

import io
import sys
import threading
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

import sniffio

from ._context import context_coroutine
from ._pausable import awaited_handler

__all__ = ["format_stacks"]


def format_stacks() -> str:
    """Every thread's current stack, then the event loop's pending tasks' (asyncio or
    trio; called on the loop's thread)."""
    out = io.StringIO()
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        out.write(f"--- thread {names.get(ident, '?')} ({ident})\n")
        out.write("".join(traceback.format_stack(frame)))
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return out.getvalue()
    if library == "asyncio":
        _asyncio_tasks(out)
    elif library == "trio":
        _trio_tasks(out)
    return out.getvalue()


def _asyncio_tasks(out: io.StringIO) -> None:
    import asyncio

    for task in asyncio.all_tasks():
        out.write(f"--- task {task.get_name()}\n")
        stack = traceback.StackSummary.extract(_await_frames(task.get_coro()))
        out.write("".join(stack.format()))


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


def _trio_tasks(out: io.StringIO) -> None:
    import trio

    for task in _trio_walk(trio.lowlevel.current_root_task()):
        out.write(f"--- task {task.name}\n")
        stack = traceback.StackSummary.extract(_await_frames(task.coro))
        out.write("".join(stack.format()))


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
