"""Context variables: the runtime of this task, and the call being handled."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Coroutine, Generator
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

import sniffio

from .._shape import Point, Shape

if TYPE_CHECKING:
    from ._mailbox import ActorInstance
    from ._runtime import Runtime

T = TypeVar("T")

__all__ = [
    "CallContext",
    "call_context",
    "call_soon_threadsafe",
    "context_coroutine",
    "in_context",
    "is_local",
    "is_local_cached",
    "native_event_class",
    "runtime_var",
]

runtime_var: ContextVar[Runtime | None] = ContextVar("amesh_runtime", default=None)


class CallContext:
    """What an endpoint (or ``__init__``) may ask about itself.

    Attributes:
        actor: the user's actor object.
        instance: its :class:`ActorInstance` (None while ``__init__`` runs).
        point: the receiving rank in the mesh or slice that sent the message; worked
            out on first use, since most handlers never ask.
        sender: the address of the caller's runtime.
        call_id: the caller's call id.
        chain: serial handlers that wait on this one (see ``_wire.Call.chain``),
            including this one when it is serial; outgoing calls carry it on.
        scope: the handler's cancel scope (None outside a handler, and in a handler that
            cannot wait, which no cancel can reach): its ``cancel_called`` says the
            caller gave up (see :func:`amesh.cancelled`).
        method: the endpoint the message is for ("" outside a handler).
    """

    __slots__ = (
        "_point", "_where", "actor", "call_id", "chain", "instance", "method", "scope", "sender",
    )  # fmt: skip

    def __init__(
        self,
        actor: Any,
        where: Point | tuple[list[str], list[int], int],
        sender: str,
        call_id: int,
        instance: ActorInstance | None = None,
        chain: list[str] | None = None,
        method: str = "",
    ) -> None:
        self.actor = actor
        self.instance = instance
        self._where = where
        self._point: Point | None = None
        self.sender = sender
        self.call_id = call_id
        self.chain = chain or []
        self.method = method
        self.scope: Any = None

    @property
    def point(self) -> Point:
        if self._point is None:
            where = self._where
            if isinstance(where, Point):
                self._point = where
            else:
                labels, sizes, rank = where
                self._point = Shape(labels, sizes).point(rank)
        return self._point


call_context: ContextVar[CallContext | None] = ContextVar("amesh_call", default=None)


_LOCAL_PREFIXES = ("abstract://", "ipc://", "stream+abstract://", "stream+ipc://")
_LOOPBACK = ("127.", "[::1]", "localhost")


def is_local(addr: str) -> bool:
    """True if ``addr`` is surely on this host (unix sockets, loopback tcp)."""
    if addr.startswith(_LOCAL_PREFIXES):
        return True
    rest = addr.split("://", 1)[-1]
    return rest.startswith(_LOOPBACK)


#: :func:`is_local` of the addresses asked about so far: a worker asks it of its caller
#: on every call
_local_addresses: dict[str, bool] = {}


def is_local_cached(addr: str) -> bool:
    """:func:`is_local`, remembered (for a bounded number of addresses)."""
    local = _local_addresses.get(addr)
    if local is None:
        local = is_local(addr)
        if len(_local_addresses) < 65536:
            _local_addresses[addr] = local
    return local


def call_soon_threadsafe() -> Callable[[Callable[[], None]], object]:
    """How another thread schedules a callback on the running event loop; the callback
    may use anyio (start a task: sniffio tells the library there)."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    loop = asyncio.get_running_loop()

    def soon(callback: Callable[[], None]) -> None:
        # an asyncio callback runs in no task, where sniffio finds no library unless
        # the context says it
        context = contextvars.copy_context()
        context.run(sniffio.current_async_library_cvar.set, "asyncio")
        loop.call_soon_threadsafe(callback, context=context)

    return soon


def native_event_class() -> Any:
    """The running event loop's own Event class (``asyncio.Event`` or ``trio.Event``).

    On the hot path an anyio Event costs a backend lookup each time it is made; the
    loop's own is cheaper and waits the same way (cancellable by anyio's scopes).
    """
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.Event
    return asyncio.Event


class _Wakeup:
    """A one-shot wake-up for one waiter, on asyncio: a bare future. An
    ``asyncio.Event`` looks its loop up and keeps a list of waiters on every wait,
    which the mailbox and every pending call pay per message. The loop is given, not
    looked up: on Python 3.11 ``asyncio.get_running_loop()`` makes a ``getpid()``
    system call each time."""

    __slots__ = ("_fut",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._fut: asyncio.Future[None] = loop.create_future()

    def set(self) -> None:
        fut = self._fut
        if not fut.done():
            fut.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """What to await (once) until :meth:`set`."""
        return self._fut


class _TrioWaiter:
    """:func:`native_waiter`'s on trio: a ``trio.Event`` with a future's methods."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        import trio

        self._event = trio.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def set_result(self, result: None) -> None:
        self._event.set()

    def __await__(self) -> Generator[Any, None, None]:
        return self._event.wait().__await__()


def native_waiter() -> Callable[[], Any]:
    """What makes a one-shot waiter of the running loop with a future's protocol
    (await it; ``done()``; ``set_result(None)``): a bare future of this asyncio loop,
    made, awaited and set without a Python call (a reply's waiter, one per call that
    waits), or a :class:`_TrioWaiter` on trio."""
    if sniffio.current_async_library() == "trio":
        return _TrioWaiter
    return asyncio.get_running_loop().create_future


def native_wakeup_class() -> Callable[[], Any]:
    """What makes the cheapest one-shot, one-waiter event of the running loop: a
    :class:`_Wakeup` on this asyncio loop, a ``trio.Event`` on trio. Make a new one
    for each wait, on this loop only."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.Event
    return partial(_Wakeup, asyncio.get_running_loop())


class _InContext:
    """Awaiting it runs coroutine ``coro``, every step of it inside ``ctx``."""

    __slots__ = ("_coro", "_ctx")

    def __init__(self, ctx: contextvars.Context, coro: Coroutine[Any, Any, T]) -> None:
        self._ctx = ctx
        self._coro = coro

    def __await__(self) -> Generator[Any, Any, Any]:
        run, coro = self._ctx.run, self._coro
        try:
            yielded = run(coro.send, None)
        except StopIteration as stop:
            return stop.value
        while True:
            try:
                value = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancel, thrown into the coroutine
                try:
                    yielded = run(coro.throw, exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = run(coro.send, value)
                except StopIteration as stop:
                    return stop.value


def context_coroutine(awaiting: Any) -> Any:
    """The coroutine that ``awaiting`` (an awaitable in a task's chain) runs in a
    context (see :func:`in_context`), if it is one: what a stack shows below it."""
    frame = getattr(awaiting, "gi_frame", None)
    if frame is None or frame.f_code is not _InContext.__await__.__code__:
        return None
    return frame.f_locals["coro"]


def in_context(ctx: contextvars.Context, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """Await ``coro`` with every step of it run in ``ctx`` (a context that code outside
    the task can enter too, between its steps), on asyncio or trio."""
    return cast("Awaitable[T]", _InContext(ctx, coro))
