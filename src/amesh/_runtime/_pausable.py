"""Handlers that a debugger can pause without stopping their process's event loop.

All actors of a process share one event loop thread. A ``breakpoint()`` in a handler
stops that thread where the handler stands: pdb waits there for its next line of input,
and with a plain call nothing else in the process would run until the user typed
``continue`` (not the other actors, not the replies, not the process's heartbeats).

So :func:`run_handler` runs a handler in a greenlet of its own, on the loop's thread:
the handler's code, and every step of its coroutine, run in that greenlet, and each time
the coroutine waits, the greenlet hands what it waits on to the task that drives it.
When pdb needs a line, :func:`wait_off_loop` leaves the handler's greenlet with the
blocking read, the driving task awaits that read in a worker thread, and meanwhile the
loop serves everything else. pdb's trace function is set only while the handler's
greenlet runs, so that stepping stays in the paused handler.

Outside such a greenlet (a handler in a worker thread, code that is no handler)
:func:`wait_off_loop` just blocks.

A greenlet costs a round trip about a tenth of its time (the switches in and out, on a
cold cache), so the mailbox gives one only to handlers that may pause:
:func:`may_pause` finds ``breakpoint()`` or ``pdb.set_trace()`` in an endpoint's own
code, a handler that paused once without a greenlet gets one from then on
(:func:`paused_outside`), and the ``pause_anywhere`` setting gives every handler one.
A handler called directly that pauses (its ``breakpoint()`` is in a function it calls)
holds the event loop while it waits for the debugger; :func:`end_direct` ends the
session when the handler returns, as a greenlet's end does.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import anyio
from greenlet import getcurrent, greenlet

__all__ = [
    "LazyScope",
    "awaited_handler",
    "debugged_here",
    "end_direct",
    "handler_local",
    "may_pause",
    "paused_outside",
    "run_handler",
    "run_handler_in",
    "wait_off_loop",
]

T = TypeVar("T")

#: what a handler's greenlet hands its driver: a value its coroutine yields to the loop,
#: a blocking function to run in a worker thread, that a coroutine is about to start
#: (the driver opens its cancel scope first), or how the handler ended
_YIELD, _WAIT, _SCOPE, _RETURNED, _RAISED = range(5)
#: what the driver hands back: a value to send into the coroutine, or one to throw
_SEND, _THROW = 0, 1
#: a handler call: the function, its positional and its keyword arguments
_Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
#: Idle handler greenlets kept for reuse, per thread: a new one costs some microseconds.
_IDLE_MAX = 64
#: Names whose use in an endpoint's code means it may stop in a debugger.
_PAUSES = frozenset({"breakpoint", "set_trace", "post_mortem"})


def may_pause(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` may stop in a debugger by itself: its code (or a function or
    lambda defined in it, or a function it wraps) names ``breakpoint``, ``set_trace``
    or ``post_mortem``. True for a callable without Python code (nothing to read)."""
    codes: list[types.CodeType] = []
    f: Any = fn
    while f is not None and len(codes) < 64:  # (a __wrapped__ chain may loop)
        code = getattr(f, "__code__", None)
        if code is None:  # an object with __call__, a builtin
            call = inspect.getattr_static(type(f), "__call__", None)
            code = getattr(call, "__code__", None)
            if code is None:
                return True
        codes.append(code)
        f = getattr(f, "__wrapped__", None)
    while codes:
        code = codes.pop()
        if not _PAUSES.isdisjoint(code.co_names):
            return True
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


class _Handler(greenlet):  # type: ignore[misc]  # greenlet has no stubs for subclassing
    """A greenlet that runs handler calls, one at a time, as :func:`run_handler` gives
    them: ``switch((fn, args, kwargs))``, or ``switch(None)`` to end it."""

    def __init__(self) -> None:
        super().__init__(self._serve)
        #: a debugger session in the handler running now: it ends with the handler
        self.debugger: Callable[[], None] | None = None
        #: what the handler running now returned to be awaited (its coroutine)
        self.awaiting: Any = None

    def _leave(self, request: tuple[int, Any]) -> tuple[int, Any]:
        """Hand ``request`` to the driver and return its answer; a debugger's trace
        function is set only while this greenlet runs."""
        trace = sys.gettrace() if self.debugger is not None else None
        if trace is not None:
            sys.settrace(None)
        try:
            answer: tuple[int, Any] = self.parent.switch(request)
        finally:
            if trace is not None:
                sys.settrace(trace)
        return answer

    def _serve(self, job: _Job | None) -> None:
        while job is not None:
            fn, args, kwargs = job
            del job
            try:
                ended: tuple[int, Any] = (_RETURNED, self._call(fn, args, kwargs))
            except BaseException as exc:  # the driver raises it in the handler's task
                ended = (_RAISED, exc)
            finally:
                if self.debugger is not None:  # still stepping: not on into the loop's code
                    self.debugger()
                    self.debugger = None
                    sys.settrace(None)
            del fn, args, kwargs
            self.awaiting = None
            job = self.parent.switch(ended)

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = fn(*args, **kwargs)
        if not inspect.isawaitable(result):
            return result
        self.awaiting = result
        steps = result.__await__()
        # Before its first step enters scopes of its own: the handler's goes outside.
        self._leave((_SCOPE, None))
        kind: int = _SEND
        value: Any = None
        while True:
            try:
                if kind == _THROW:
                    yielded = steps.throw(value)
                else:
                    yielded = steps.send(value)
            except StopIteration as stop:
                return stop.value
            kind, value = self._leave((_YIELD, yielded))


class _Idle(threading.local):
    def __init__(self) -> None:
        self.handlers: list[_Handler] = []
        #: debugger sessions begun in a handler called without a greenlet on this
        #: thread, to end with it (see end_direct)
        self.ends: list[Callable[[], None]] = []


#: this thread's idle greenlets, and the debugger sessions to end with the handler
#: called directly now (``.ends``, see :func:`end_direct`; a caller on the hot path
#: checks it without a function call)
handler_local = _Idle()


class _Pass:
    """Awaiting it yields ``value`` to the event loop, as the coroutine of ``handler``
    did, and returns what the loop sends back (or raises what it throws)."""

    __slots__ = ("handler", "value")

    def __init__(self, value: Any, handler: _Handler) -> None:
        self.value = value
        self.handler = handler

    def __await__(self) -> Generator[Any, Any, Any]:
        return (yield self.value)


def awaited_handler(awaiting: Any) -> Any:
    """The coroutine of the handler that ``awaiting`` (the innermost awaitable of a
    task's chain) passes the waits of, if it is one: what a stack shows below it."""
    frame = getattr(awaiting, "gi_frame", None)
    if frame is None or frame.f_code is not _Pass.__await__.__code__:
        return None
    return frame.f_locals["self"].handler.awaiting


class LazyScope:
    """A handler's cancel scope, made only once the handler waits.

    Until its first wait a handler runs without giving the event loop a turn, so no
    cancel can arrive: one that was asked for before (or by the handler itself) is
    kept in :attr:`cancel_called` and applied to the real scope when it is made. A
    handler that returns without waiting (most synchronous endpoints) never pays for
    an anyio scope at all.
    """

    __slots__ = ("_scope", "cancel_called")

    def __init__(self) -> None:
        self.cancel_called = False
        self._scope: anyio.CancelScope | None = None

    def cancel(self) -> None:
        self.cancel_called = True
        if self._scope is not None:
            self._scope.cancel()

    def open(self) -> anyio.CancelScope:
        """The real scope for the waits from now on (enter it at once)."""
        scope = self._scope = anyio.CancelScope()
        if self.cancel_called:
            scope.cancel()
        return scope


async def run_handler(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, awaited if it returns an awaitable, in a greenlet of its
    own (see the module doc): a debugger may pause it while the loop goes on."""
    return await run_handler_in(None, fn, args, kwargs)


async def run_handler_in(
    lazy: LazyScope | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """:func:`run_handler`, the waits (if any) inside ``lazy``'s real scope."""
    idle = handler_local.handlers
    g = idle.pop() if idle else _Handler()
    here = getcurrent()
    g.parent = here
    # the handler sees (and changes) the context of the task that runs it
    g.gr_context = here.gr_context
    kind, value = g.switch((fn, args, kwargs))
    if kind < _SCOPE:  # a debugger paused the synchronous part
        kind, value = await _drive(g, kind, value)
    if kind != _SCOPE:  # it returned without waiting: no cancel could reach it
        return _ended(g, kind, value)
    if lazy is None:
        return _ended(g, *await _drive(g, *g.switch((_SEND, None))))
    with lazy.open():
        # (raised in here, a cancel of this scope ends at its edge)
        return _ended(g, *await _drive(g, *g.switch((_SEND, None))))
    return None  # cancelled: the caller sees lazy.cancel_called


def _ended(g: _Handler, kind: int, value: Any) -> Any:
    """Put ``g`` back for reuse; return what its handler returned or raise what it
    raised."""
    g.gr_context = None
    idle = handler_local.handlers
    if len(idle) < _IDLE_MAX:
        idle.append(g)
    else:
        g.switch(None)  # it ends
    if kind == _RAISED:
        try:
            raise value
        finally:
            del value
    return value


async def _drive(g: _Handler, kind: int, value: Any) -> tuple[int, Any]:
    """Serve the waits of the handler in ``g`` until it ends or its coroutine is about
    to start; how it ended (or ``_SCOPE``)."""
    while kind < _SCOPE:
        try:
            if kind == _WAIT:
                # the paused handler waits for its debugger, however the call fares; a
                # cancel reaches it at its next await
                with anyio.CancelScope(shield=True):
                    answer: tuple[int, Any] = (_SEND, await anyio.to_thread.run_sync(value))
            else:
                answer = (_SEND, await _Pass(value, g))
        except BaseException as exc:  # the handler's coroutine decides what it means
            answer = (_THROW, exc)
        kind, value = g.switch(answer)
    return kind, value


def wait_off_loop(fn: Callable[[], T]) -> T:
    """``fn()``, a blocking wait: from a handler run by :func:`run_handler`, in a worker
    thread while its event loop goes on; anywhere else, right here."""
    g = getcurrent()
    if not isinstance(g, _Handler):
        return fn()
    kind, value = g._leave((_WAIT, fn))
    if kind == _THROW:
        raise value
    result: T = value
    return result


def debugged_here(end: Callable[[], None]) -> None:
    """A debugger starts in the handler that calls this: its trace function is set
    only while the handler runs, and ``end()`` ends its session when the handler
    ends (if it is still on). In a handler called directly, :func:`end_direct` calls
    ``end()`` once the handler is over."""
    g = getcurrent()
    if isinstance(g, _Handler):
        g.debugger = end
    else:
        handler_local.ends.append(end)


def paused_outside() -> bool:
    """True if the code that asks runs on this thread's main greenlet, not in a
    handler's greenlet: a pause there holds the event loop of this thread."""
    return not isinstance(getcurrent(), _Handler)


def end_direct() -> None:
    """End the debugger sessions begun in the handler that just returned (called
    directly, without a greenlet, on this thread), and the tracing they set."""
    ends = handler_local.ends[:]
    handler_local.ends.clear()
    try:
        for end in ends:
            end()
    finally:
        sys.settrace(None)
