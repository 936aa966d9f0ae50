"""The session runtime: amesh outside ``amesh.run`` and ``async with``.

A notebook cell, ``python -m asyncio``, a script under ``asyncio.run`` or a plain
synchronous script has no amesh runtime of its own. The first time such code uses amesh
(``await amesh.ProcMesh(...)``, ``procs.spawn(...).get()``), a *session* starts: a
daemon thread runs an event loop (uvloop when installed) with one runtime, which owns
every mesh made outside a runtime from then on. Each cell is a new task, on whatever
loop the caller has, or none: that does not matter, since the work is done on the
session's loop, and only the result travels back.

Everything that can be awaited in amesh returns an :class:`Op`:

- ``await op`` inside a runtime (``amesh.run``, an ``async with`` mesh, an actor's
  handler) runs it right there, as a coroutine would;
- ``await op`` elsewhere, on an asyncio loop, runs it on the session and waits for it
  without blocking the caller's loop;
- ``op.get(timeout=None)`` runs it on the session and blocks the calling thread until
  it is done. On the thread of a runtime's own loop that would wait forever (the loop
  that must do the work is the one blocked), so it raises instead; from another thread
  whose context has a runtime (``asyncio.to_thread``'s) it is done on that runtime.

A failure of a session's mesh has no body to cancel: it is printed at once, and every
later use of that mesh raises the :class:`~amesh.SupervisionError` until it is
stopped. The session stops its meshes (but persistent ones) when the interpreter exits.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import functools
import sys
import threading
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterator,
)
from typing import Any, Generic, ParamSpec, TypeVar

import anyio

from .._config import debug, default_transport, loop_options
from .._errors import Failure
from .._tracebacks import hide_amesh_frames
from .._transport import open_transport
from ._context import call_context, runtime_var
from ._runtime import Runtime, open_runtime

__all__ = ["Op", "Stream", "bridged", "bridged_always", "in_session", "session_runtime"]

T = TypeVar("T")
P = ParamSpec("P")

#: How long the interpreter's exit waits for the session to stop its meshes.
CLOSE_TIMEOUT = 60.0

#: How much longer than its ``timeout`` ``.get(timeout)`` waits for an op that keeps
#: that timeout itself (an endpoint's adverb): only a session loop too busy to run
#: the op's own deadline makes the wait end first.
_GET_MARGIN = 5.0


class _Session:
    """The session's thread, loop and runtime."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.runtime: Runtime | None = None
        self._stop: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._registered = False

    def start(self) -> asyncio.AbstractEventLoop:
        """The session's loop, started on first use."""
        with self._lock:
            if self.loop is not None and self.thread is not None and self.thread.is_alive():
                return self.loop
            ready = threading.Event()
            self._error = None
            self.thread = threading.Thread(
                target=self._run, args=(ready,), name="amesh-session", daemon=True
            )
            self.thread.start()
            ready.wait()
            if self._error is not None:
                raise RuntimeError(f"the amesh session could not start: {self._error}")
            if not self._registered:  # (after the transport's own atexit: runs first)
                atexit.register(self.close)
                self._registered = True
                if not debug():
                    hide_amesh_frames()
            assert self.loop is not None
            return self.loop

    def _run(self, ready: threading.Event) -> None:
        try:
            anyio.run(self._main, ready, backend="asyncio", backend_options=loop_options("asyncio"))
        except BaseException as exc:  # the session's runtime failed to open, or to close
            self._error = exc
        finally:
            self.loop = self.runtime = None
            ready.set()

    async def _main(self, ready: threading.Event) -> None:
        scheme, host = default_transport()
        async with open_runtime(lambda: open_transport(scheme, host=host)) as rt:
            rt.on_root_failure = _print_failure
            self.runtime = rt
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            ready.set()
            await self._stop.wait()

    def submit(
        self, fn: Callable[..., Coroutine[Any, Any, T]], args: Any, kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Run ``fn(*args, **kwargs)`` on the session's loop, with its runtime."""
        loop = self.start()

        async def run() -> T:
            runtime_var.set(self.runtime)
            call_context.set(None)
            return await fn(*args, **kwargs)

        # In a context of its own, not a copy of the caller's: what it starts (a mesh's
        # output printers, its supervision) outlives the call, and must not print with
        # the caller's context vars. ipykernel 7 keeps the cell an output belongs to in
        # one: it would go to the cell that started the mesh, not to the one running.
        return contextvars.Context().run(asyncio.run_coroutine_threadsafe, run(), loop)

    def close(self) -> None:
        """Stop the session's meshes and its loop (at the interpreter's exit)."""
        loop, thread, stop = self.loop, self.thread, self._stop
        if loop is None or thread is None or stop is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(stop.set)
        thread.join(CLOSE_TIMEOUT)
        if self._error is not None:
            print(f"amesh: closing the session: {self._error}", file=sys.stderr)


_session = _Session()


def _print_failure(failure: Failure) -> None:
    print(
        f"amesh: unhandled supervision failure (the next use of its mesh raises it):\n  {failure}",
        file=sys.stderr,
        flush=True,
    )


def in_session() -> bool:
    """Whether the calling thread is the session's."""
    return _session.thread is threading.current_thread()


def _on_loop_thread(rt: Runtime | None) -> bool:
    """Whether the calling thread runs the loop of ``rt`` (the caller's runtime), or the
    session's: blocking it would stop the loop that must do the work. A worker thread of
    that loop (``asyncio.to_thread``, ``anyio.to_thread.run_sync``) has ``rt`` in its
    context, copied, but not its loop."""
    return in_session() or (rt is not None and not rt.closed and rt.thread == threading.get_ident())


def _submit_to(
    rt: Runtime, fn: Callable[..., Coroutine[Any, Any, T]], args: Any, kwargs: Any
) -> concurrent.futures.Future[T]:
    """Run ``fn(*args, **kwargs)`` on ``rt``'s loop, from another thread; cancelling the
    future (left pending until the result is in) cancels the run."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    scopes: list[anyio.CancelScope] = []  # made on the loop (anyio wants one there)

    def cancel() -> None:
        for scope in scopes:
            scope.cancel()

    async def run() -> None:
        runtime_var.set(rt)
        call_context.set(None)
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            if future.cancelled():
                return
            try:
                result = await fn(*args, **kwargs)
            except anyio.get_cancelled_exc_class():
                _settle(future.set_exception, RuntimeError("its amesh runtime closed"))
                raise
            except BaseException as exc:  # the caller's to raise, not the runtime's
                _settle(future.set_exception, exc)
            else:
                _settle(future.set_result, result)

    def cancelled(done: concurrent.futures.Future[T]) -> None:
        if done.cancelled() and not rt.closed:
            rt.call_soon_threadsafe(cancel)

    def start() -> None:
        try:
            rt.start_soon(run)
        except RuntimeError as exc:  # its task group is closing: say so, never hang
            _settle(future.set_exception, RuntimeError(f"its amesh runtime closed ({exc})"))

    future.add_done_callback(cancelled)
    rt.call_soon_threadsafe(start)
    return future


def _settle(how: Callable[[Any], None], value: Any) -> None:
    try:
        how(value)
    except concurrent.futures.InvalidStateError:  # cancelled by the waiting thread
        pass


def session_runtime() -> Runtime:
    """The session's runtime (started on first use)."""
    _session.start()
    assert _session.runtime is not None
    return _session.runtime


class Op(Generic[T]):
    """Something amesh will do: ``await`` it, or ``.get()`` it (see the module doc)."""

    __slots__ = ("_args", "_check_failed", "_fn", "_iter", "_kwargs")

    def __init__(
        self,
        fn: Callable[..., Coroutine[Any, Any, T]],
        args: Any,
        kwargs: Any,
        check_failed: bool = True,
    ) -> None:
        self._fn = fn
        self._args = args
        self._kwargs = kwargs
        self._check_failed = check_failed
        self._iter: Generator[Any, None, T] | None = None

    def __repr__(self) -> str:
        return f"<amesh.Op {getattr(self._fn, '__qualname__', self._fn)}>"

    def __await__(self) -> Generator[Any, None, T]:
        if runtime_var.get() is not None:
            return self._fn(*self._args, **self._kwargs).__await__()
        return self._bridge().__await__()

    def _check(self) -> None:
        """A mesh whose unhandled failure was printed raises it on every later use."""
        target = self._args[0] if self._args and self._check_failed else None
        failed = getattr(target, "_session_failure", None)
        if failed is not None:
            error = failed()
            if error is not None:
                raise error

    # A coroutine's methods, so that an Op is one (``collections.abc.Coroutine``):
    # ``tg.start_soon(mesh.ep.call_one, x)`` and ``asyncio.create_task(op)`` take it.

    def _steps(self) -> Generator[Any, None, T]:
        if self._iter is None:
            self._iter = self.__await__()
        return self._iter

    def send(self, value: Any) -> Any:
        return self._steps().send(value)

    def throw(self, *exc: Any) -> Any:
        return self._steps().throw(*exc)

    def close(self) -> None:
        if self._iter is not None:
            self._iter.close()

    async def _bridge(self) -> T:
        self._check()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "no amesh runtime here, and the session needs an asyncio caller: use "
                "amesh.run(main, backend=...) on trio, or .get() in synchronous code"
            ) from None
        return await asyncio.wrap_future(_session.submit(self._fn, self._args, self._kwargs))

    def get(self, timeout: float | None = None) -> T:
        """Do it and wait for the result, blocking this thread.

        Raises:
            TimeoutError: ``timeout`` seconds passed (what was started is cancelled);
                an endpoint's adverb says which ranks did not answer, as under ``await``.
            RuntimeError: called on the thread of an amesh runtime's event loop, which
                would then never get to do it; ``await`` it there.
        """
        rt = runtime_var.get()
        if _on_loop_thread(rt):
            raise RuntimeError(
                f"{self!r}.get() would block the event loop that must do the work: "
                "use `await` here (get() is for synchronous code)"
            )
        self._check()
        args, wait = self._args, timeout
        # an endpoint's adverb keeps the timeout itself, so that its TimeoutError names
        # the endpoint and the ranks that did not answer, as under ``await``
        if timeout is not None and args:
            bounded = getattr(args[0], "_bounded", None)
            if bounded is not None:
                args, wait = (bounded(timeout), *args[1:]), timeout + _GET_MARGIN
        if rt is None or rt.closed:
            future = _session.submit(self._fn, args, self._kwargs)
        else:  # a worker thread of that runtime's loop (asyncio.to_thread): run it there
            future = _submit_to(rt, self._fn, args, self._kwargs)
        try:
            # (not ``future.result(wait)``: the TimeoutError an op raises is the one
            # that result() raises when the wait ends, since Python 3.11)
            if future in concurrent.futures.wait((future,), wait).done:
                return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt: stop the work too
            raise
        future.cancel()
        name = getattr(self._fn, "__qualname__", self._fn)
        raise TimeoutError(f"{name}: did not finish within {timeout:g} s (.get's timeout)")


def bridged(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Op[T]]:
    """Make ``async def fn`` return an :class:`Op` (awaitable anywhere, or ``.get()``).

    Outside a runtime, a method so made on an object with a ``_session_failure()``
    (a mesh) raises what that returns, if anything, instead of running."""

    @functools.wraps(fn)
    def op(*args: P.args, **kwargs: P.kwargs) -> Op[T]:
        return Op(fn, args, kwargs)

    return op


def bridged_always(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Op[T]]:
    """:func:`bridged`, but run even on a failed mesh (``stop``)."""

    @functools.wraps(fn)
    def op(*args: P.args, **kwargs: P.kwargs) -> Op[T]:
        return Op(fn, args, kwargs, check_failed=False)

    return op


class Stream(Generic[T]):
    """What ``endpoint.stream(...)`` returns: iterate it with ``async for`` (anywhere,
    as an :class:`Op` is awaited) or with a plain ``for`` (synchronous code)."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[], AsyncGenerator[T, None]]) -> None:
        self._make = make

    def __aiter__(self) -> AsyncIterator[T]:
        if runtime_var.get() is not None:
            return self._make()
        return _Bridged(self._make())

    def __iter__(self) -> Iterator[T]:
        if _on_loop_thread(runtime_var.get()):
            raise RuntimeError("use `async for` on the thread of an amesh runtime's loop")
        return _Blocking(self._make())


async def _step(gen: AsyncGenerator[T, None]) -> tuple[bool, T | None]:
    try:
        return True, await gen.__anext__()
    except StopAsyncIteration:
        return False, None


async def _close(gen: AsyncGenerator[T, None]) -> None:
    await gen.aclose()


class _Bridged(Generic[T]):
    """Drives an async generator on the session, for another loop's ``async for``."""

    def __init__(self, gen: AsyncGenerator[T, None]) -> None:
        self._gen = gen

    def __aiter__(self) -> _Bridged[T]:
        return self

    async def __anext__(self) -> T:
        more, item = await Op(_step, (self._gen,), {})
        if not more:
            raise StopAsyncIteration
        return item  # type: ignore[return-value]

    async def aclose(self) -> None:
        await Op(_close, (self._gen,), {})


class _Blocking(Generic[T]):
    """Drives an async generator on the session, for a plain ``for``."""

    def __init__(self, gen: AsyncGenerator[T, None]) -> None:
        self._gen = gen

    def __iter__(self) -> _Blocking[T]:
        return self

    def __next__(self) -> T:
        more, item = Op(_step, (self._gen,), {}).get()
        if not more:
            raise StopIteration
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop early: the ranks that have not answered are cancelled."""
        Op(_close, (self._gen,), {}).get()
