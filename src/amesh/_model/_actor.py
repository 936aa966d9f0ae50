"""Actors and endpoints as users write them, and the call context they can query."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

import anyio

from .._config import settings
from .._runtime import Handler, call_context, can_wait, may_pause
from .._shape import Point

__all__ = [
    "Actor",
    "EndpointDescriptor",
    "cancelled",
    "current_actor",
    "current_rank",
    "current_size",
    "endpoint",
    "handlers_of",
]

P = ParamSpec("P")
R = TypeVar("R")


class EndpointDescriptor(Generic[P, R]):
    """An ``@endpoint`` method. On an actor instance it is the plain method.

    Typed by the method's parameters after ``self`` (``P``) and what a call returns
    (``R``; for an ``async def``, what it awaits to): a mesh's endpoint
    (:class:`~amesh.MeshEndpoint`) carries them to its adverbs.
    """

    def __init__(
        self, fn: Callable[..., Any], concurrent: bool = False, thread: bool = False
    ) -> None:
        if not callable(fn):
            raise TypeError(f"@endpoint needs a function, got {fn!r}")
        if thread and inspect.iscoroutinefunction(fn):
            raise TypeError(
                f"@endpoint(thread=True) needs a plain (sync) function; {fn.__name__} is "
                "async and runs on the event loop anyway"
            )
        self.fn = fn
        self.concurrent = concurrent
        self.thread = thread
        self.name = fn.__name__
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> EndpointDescriptor[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Any: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return self.fn.__get__(obj, owner)

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.fn)

    @functools.cached_property
    def _simple(self) -> tuple[tuple[str, ...], int] | None:
        """``(parameter names, number required)`` when every parameter after ``self``
        is plain positional-or-keyword; None for anything fancier."""
        params = list(self.signature.parameters.values())[1:]
        if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
            return None
        required = 0
        for p in params:
            if p.default is not inspect.Parameter.empty:
                break
            required += 1
        if any(p.default is inspect.Parameter.empty for p in params[required:]):
            return None
        return tuple(p.name for p in params), required

    def bind_check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise TypeError if ``(args, kwargs)`` do not fit the endpoint."""
        simple = self._simple
        if simple is not None:
            # the common case, without Signature.bind's cost (~20 µs)
            names, required = simple
            n = len(args)
            if n <= len(names) and (
                (not kwargs and n >= required)
                or (
                    all(k in names[n:] for k in kwargs)
                    and all(name in kwargs for name in names[n:required])
                )
            ):
                return
        try:
            self.signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            hint = ""
            if "timeout" in kwargs and "timeout" not in self.signature.parameters:
                # an adverb's timeout was once a keyword of the call itself
                timeout = kwargs["timeout"]
                hint = (
                    f" (a call's timeout is an option of the endpoint: "
                    f"mesh.{self.name}.options(timeout={timeout!r}).call(...))"
                )
            raise TypeError(f"endpoint {self.name}(): {exc}{hint}") from None


class _EndpointDecorator(Protocol):
    """What ``endpoint(concurrent=..., thread=...)`` returns: ``@endpoint`` itself."""

    @overload
    def __call__(
        self, fn: Callable[Concatenate[Any, P], Awaitable[R]], /
    ) -> EndpointDescriptor[P, R]: ...
    @overload
    def __call__(self, fn: Callable[Concatenate[Any, P], R], /) -> EndpointDescriptor[P, R]: ...


@overload
def endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]], /) -> EndpointDescriptor[P, R]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, P], R], /) -> EndpointDescriptor[P, R]: ...
@overload
def endpoint(*, concurrent: bool = False, thread: bool = False) -> _EndpointDecorator: ...
def endpoint(fn: Any = None, /, *, concurrent: bool = False, thread: bool = False) -> Any:
    """Mark an actor method as callable through a mesh.

    Use bare (``@endpoint``) or with options (``@endpoint(concurrent=True)``). The
    method may be sync or async. By default an actor handles one message at a time;
    ``concurrent=True`` lets calls of this endpoint interleave at their ``await``s.

    Where handlers run, and what a caller's timeout or cancel does to them:

    - async endpoints run on the process's event loop; a cancel interrupts them at
      their next ``await``.
    - sync endpoints run on the event loop's thread (the thread that ran ``__init__``:
      what CUDA's current device and stream expect). While one runs, the process
      handles nothing else, and nothing can interrupt it: a caller that gave up gets
      its ``TimeoutError`` at once, and the result is discarded when the handler
      returns.
    - ``thread=True`` runs a sync endpoint in a worker thread: the process goes on
      with its other calls, cancels and heartbeats meanwhile. Nothing can stop a
      thread from outside either; after a cancel :func:`cancelled` returns True in
      it, so a long handler can check it and return early. The actor stays serial:
      its next message waits until the handler returned, cancelled or not.

    A result that is not obviously cheap to pickle (large containers, arbitrary
    objects) is pickled in a worker thread, so a slow pickle holds up only its own
    call.
    """
    if fn is None:
        return lambda f: EndpointDescriptor(f, concurrent, thread)
    return EndpointDescriptor(fn, concurrent, thread)


class Actor:
    """Base class of actors.

    Subclass it, mark methods with :func:`endpoint`, and spawn it with
    ``await procs.spawn(name, Cls, *args)``. ``__init__`` runs on every rank before
    the first message. Optional hooks: ``__cleanup__(self)`` (sync or async) runs when
    the actor is stopped.
    """

    _amesh_endpoints: ClassVar[dict[str, EndpointDescriptor[Any, Any]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        eps: dict[str, EndpointDescriptor[Any, Any]] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                if isinstance(value, EndpointDescriptor):
                    eps[name] = value
                elif name in eps:
                    del eps[name]  # overridden by a plain attribute
        cls._amesh_endpoints = eps


def handlers_of(cls: type) -> dict[str, Handler]:
    """The dispatch table of an actor class (one per actor instance: it may change, see
    :meth:`~amesh._runtime._mailbox.ActorInstance.pause_in_greenlet`)."""
    eps: dict[str, EndpointDescriptor[Any, Any]] = getattr(cls, "_amesh_endpoints", {})
    anywhere = settings().pause_anywhere
    return {
        name: Handler(
            ep.fn,
            ep.concurrent,
            ep.thread,
            pausable=anywhere or may_pause(ep.fn),
            coroutine=inspect.iscoroutinefunction(ep.fn),
            waits=can_wait(ep.fn),
        )
        for name, ep in eps.items()
    }


def _ctx() -> Any:
    ctx = call_context.get()
    if ctx is None:
        raise RuntimeError(
            "current_rank()/current_size()/current_actor() only work inside an actor's "
            "endpoint or __init__"
        )
    return ctx


def current_rank() -> Point:
    """The point of this actor in the mesh (or slice) that sent the current message."""
    point: Point = _ctx().point
    return point


def current_size() -> dict[str, int]:
    """The sizes of the mesh (or slice) that sent the current message."""
    return dict(_ctx().point.sizes)


def cancelled() -> bool:
    """True once the caller of the current message gave up on it (timeout, cancel,
    the caller's death), or the actor failed. For ``@endpoint(thread=True)``
    handlers, which nothing can interrupt from outside: check it and return early.

    Raises:
        RuntimeError: outside an endpoint.
    """
    scope = _ctx().scope
    if scope is None:
        return False
    try:
        return bool(scope.cancel_called)
    except RuntimeError:  # trio reads its clock for it, which a worker thread cannot
        return bool(anyio.from_thread.run_sync(lambda: scope.cancel_called))


def current_actor() -> Actor:
    """The actor instance handling the current message."""
    actor: Actor = _ctx().actor
    return actor
