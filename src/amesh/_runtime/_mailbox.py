"""One actor instance in this process: its mailbox, dispatch loop and failure state.

Messages start in arrival order (so per-sender FIFO holds). Serial handlers run one
at a time, each after the previous one finished; concurrent handlers start as soon as
every earlier message has started, and interleave with everything at their awaits.
The instance's task group also hosts the watchers of the meshes the actor owns, so
they live exactly as long as the actor. Each message runs as one :class:`Invocation`,
whichever path started it.
"""

from __future__ import annotations

import contextvars
import dis
import inspect
import logging
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import TaskGroup

from .. import _wire
from .._config import debug
from .._tracebacks import format_traceback
from ._capture import before_reply
from ._context import (
    CallContext,
    call_context,
    in_context,
    is_local_cached,
    native_wakeup_class,
    runtime_var,
)
from ._pausable import LazyScope, end_direct, handler_local, run_handler_in

if TYPE_CHECKING:
    from ._runtime import Runtime


__all__ = [
    "ActorInstance",
    "Handler",
    "Invocation",
    "Owned",
    "can_wait",
    "error_of",
    "type_name_of",
]

log = logging.getLogger("amesh.actor")

#: A queued request: the envelope and views of its out-of-band buffers.
_Request = tuple[_wire.Call | _wire.Cast, list[memoryview]]
#: what the mailbox holds: requests, and (None, an awaitable) for what a handler run by
#: ActorInstance.put left to the loop
_Item = tuple[_wire.Call | _wire.Cast | None, Any]

#: Bounded wait for an actor's ``__cleanup__`` and its owned meshes at stop.
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Handler:
    """How to run one endpoint: the function, whether calls may interleave, whether
    it runs in a worker thread (sync endpoints only), whether it runs in a greenlet of
    its own so that a debugger can pause it alone (see :mod:`._pausable`), whether
    ``fn`` is a coroutine function, and if so whether its code can wait at all
    (:func:`can_wait`: one that cannot runs to its end in one step, without a cancel
    scope)."""

    fn: Callable[..., Any]
    concurrent: bool
    thread: bool = False
    pausable: bool = True
    coroutine: bool = False
    waits: bool = True
    #: it runs to its end in one step, on the loop's own stack: an idle actor may run
    #: it the moment its message arrives (see :meth:`ActorInstance.put`)
    now: bool = field(init=False)

    def __post_init__(self) -> None:
        now = not (self.waits or self.pausable or self.thread or self.concurrent)
        object.__setattr__(self, "now", now)


#: What a coroutine's code waits with (``await``, ``async with``, ``async for``): the
#: instruction that hands a value to the event loop (its opcode: every instruction is
#: two bytes, opcode first, so the even bytes of ``co_code`` are the opcodes).
_WAIT_OPS = frozenset({dis.opmap["YIELD_VALUE"]})


def _one_step(steps: Any, fn: Callable[..., Any]) -> Any:
    """The result of coroutine ``steps`` of ``fn``, whose code cannot wait (see
    :func:`can_wait`): it ends in its first step."""
    try:
        steps.send(None)
    except StopIteration as stop:
        return stop.value
    steps.close()
    raise RuntimeError(f"{fn!r} waited, with no await")


def can_wait(fn: Callable[..., Any]) -> bool:
    """Whether the coroutine function ``fn`` may wait (give the event loop a turn): its
    own code awaits something. True when there is no code to read."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return True
    return not _WAIT_OPS.isdisjoint(code.co_code[::2])


#: A result made of at most this many small objects is pickled on the event loop;
#: anything bigger is pickled in a worker thread, so the process's other calls go on.
_CHEAP_NODES = 256
_SCALARS = (type(None), bool, int, float, complex, bytes, bytearray, memoryview)


def _cheap_leaf(x: Any) -> bool:
    t = type(x)
    if t in _SCALARS or (t is str and len(x) < 1 << 20):
        return True
    # a tensor's or an array's data goes out of band
    return t.__module__ in ("torch", "numpy") and t.__name__ in ("Tensor", "ndarray")


def cheap_to_pickle(obj: Any) -> bool:
    """True if pickling ``obj`` surely takes microseconds: scalars, strings, byte
    buffers (they travel out of band), arrays and tensors, and small containers of
    those. Anything else (big containers, arbitrary objects) may take seconds."""
    return _wire.small_tree(obj, _CHEAP_NODES, _cheap_leaf)


class Owned(Protocol):
    """Something an actor owns and stops with it (a mesh it started)."""

    def stop(self) -> Awaitable[None]: ...


def type_name_of(t: type[BaseException]) -> str:
    """``"ValueError"``, ``"pkg.mod.MyError"``; amesh's own errors as ``"amesh.X"``."""
    if t.__module__ == "builtins":
        return t.__qualname__
    if t.__module__ == "amesh._errors":
        return f"amesh.{t.__qualname__}"
    return f"{t.__module__}.{t.__qualname__}"


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as inner:  # a user's __str__ may raise: say so, keep going
        try:
            args = repr(exc.args)
        except Exception:
            args = "(args not printable)"
        return f"<str() raised {type(inner).__name__}; args {args}>"


def error_of(exc: BaseException) -> tuple[str, str, str]:
    """``(type name, message, traceback text)`` of ``exc``, for the wire.

    Never raises: an exception whose ``__str__`` or ``__repr__`` raises is still
    described by its type, what could be printed, and its frames. Each part is cut to
    what an :class:`~amesh._wire.Error` may carry.
    """
    message = _safe_str(exc)
    try:
        tb = format_traceback(exc, with_amesh=debug())
    except Exception:
        frames = traceback.format_tb(exc.__traceback__)
        tb = "".join(["Traceback (most recent call last):\n", *frames])
        tb += f"{type_name_of(type(exc))}: {message}\n"
    return _wire.clip(type_name_of(type(exc)), _wire.MAX_NAME), _wire.clip(message), _wire.clip(tb)


def _run_in_thread(
    fn: Callable[..., Any], obj: Any, args: Any, kwargs: Any, reply: bool, shm: bool
) -> tuple[Any, _wire.Payload | None]:
    """Run a threaded endpoint, and pickle its result if it goes in a reply."""
    try:
        result = fn(obj, *args, **kwargs)
    finally:
        if handler_local.ends:  # a debugger session ends with the handler
            end_direct()
    return result, (_wire.dumps(result, shm=shm) if reply else None)


#: What :meth:`Invocation.step` leaves to its continuation for a result that may take
#: long to pickle (see :func:`cheap_to_pickle`)
_PICKLE = object()

#: Results that are never awaitable: no need to ask (``inspect.isawaitable`` is an
#: ABC check).
_NOT_AWAITABLE = frozenset({type(None), bool, int, float, str, bytes, tuple, list, dict})


class Invocation:
    """One message to one handler, from its start to its reply.

    :meth:`step` runs the handler as far as it can without waiting: a handler whose
    code cannot wait runs to its end (its coroutine stepped once), and a result that
    pickles at once is pickled and sent. What is left (the waits of a handler that can
    wait, a threaded or pausable handler, an awaitable that a plain function returned,
    a big result to pickle in a worker thread, a reply waiting for room on its link) is
    returned as one awaitable, which ends with the reply. The two drivers differ only
    in who awaits it: :meth:`ActorInstance.put` (a call that arrives while the actor is
    idle) hands it to the dispatch loop, ahead of any later message, so the actor stays
    serial; the loop and a handler's task await it themselves.
    """

    __slots__ = ("actor", "ctx", "env", "handler", "scope")

    def __init__(
        self, actor: ActorInstance, env: _wire.Call | _wire.Cast, handler: Handler | None
    ) -> None:
        self.actor = actor
        self.env = env
        self.handler = handler
        #: made (by LazyScope) only once the handler waits, see :meth:`_open_scope`
        self.scope: LazyScope | None = None

    def step(self, buffers: list[Any], queued: bool = True) -> Awaitable[None] | None:
        """Run the handler (arguments in ``buffers``' views) as far as it can without
        waiting, and reply if it is done. Returns the rest to await, if any.
        ``queued``: the message waited in the mailbox (where a cancel may have found
        it), which it now leaves; one run the moment it came never was there."""
        actor, env, handler = self.actor, self.env, self.handler
        if queued and not actor.runtime.dispatch.start(self.key):  # cancelled before it ran
            return None
        method = env.method
        is_call = type(env) is _wire.Call
        chain = list(env.chain) if type(env) is _wire.Call else []
        if handler is not None and not handler.concurrent:
            entry = actor._entries.get(method)  # (chain_entry, without a call)
            chain.append(entry if entry is not None else actor.chain_entry(method))
        where = (env.labels, env.sizes, env.rank)
        ctx = self.ctx = CallContext(
            actor.obj, where, env.sender, env.call_id, actor, chain, method
        )
        # A handler that cannot wait runs to its end without the loop taking a turn:
        # no cancel can reach it, so it needs no scope, nor to be found by one.
        if handler is None or handler.waits or handler.pausable or handler.thread:
            self._open_scope()
        token = call_context.set(ctx)
        result: Any = None
        payload: _wire.Payload | None = None
        failure: BaseException | None = None
        later: Any = None
        try:
            if handler is None:
                raise AttributeError(f"actor {actor.name!r} has no endpoint {env.method!r}")
            args, kwargs = _wire.loads(env.payload, buffers)
            if handler.thread or handler.pausable:
                return self._rest(None, args, kwargs)
            try:
                result = handler.fn(actor.obj, *args, **kwargs)
                if handler.coroutine and not handler.waits:
                    result = _one_step(result, handler.fn)  # no await in its code
                elif handler.coroutine or (
                    type(result) not in _NOT_AWAITABLE and inspect.isawaitable(result)
                ):
                    later, result = result, None
            finally:
                if handler_local.ends:  # it paused, holding the loop (see _pausable)
                    end_direct()
            if later is None and is_call:
                # (a few builtins pickle at once; only a bigger result may take long)
                payload = _wire.dumps_plain(result)
                if payload is None and not cheap_to_pickle(result):
                    later = _PICKLE
        except Exception as exc:  # any pickling error is the call's, not the process's
            failure = exc
        finally:
            call_context.reset(token)
        if later is not None:
            return self._rest(later, (), {}, result)
        if self.scope is None and type(env) is _wire.Call:  # no cancel to look for
            actor.handled += 1
            return self._reply(env, result, payload, failure)
        self._ended()
        return self._answer(result, payload, failure)

    @property
    def key(self) -> tuple[str, int]:
        """How the runtime's dispatch knows the request: ``(sender, call id)``."""
        return (self.env.sender, self.env.call_id)

    @property
    def shm(self) -> bool:
        """Whether large buffers of the result may go through shared memory: one
        receiver, on this host (asked only of a result that is not plain)."""
        env = self.env
        return type(env) is _wire.Call and is_local_cached(env.reply_to or env.sender)

    def _open_scope(self) -> LazyScope:
        """The handler's scope, where a cancel (and :meth:`ActorInstance.status`) finds
        it."""
        scope = self.scope = self.ctx.scope = LazyScope()
        self.actor.runtime.dispatch.running(self.key, scope)
        self.actor._running[scope] = self.env.method
        return scope

    def _ended(self) -> None:
        scope = self.scope
        if scope is not None:
            self.actor.runtime.dispatch.ended(self.key)
            self.actor._running.pop(scope, None)
        self.actor.handled += 1

    async def _rest(
        self, later: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any = None
    ) -> None:
        """What :meth:`step` left: run a threaded or pausable handler (``later`` None),
        await what the handler returned, or pickle its ``result`` in a worker thread
        (``_PICKLE``), all inside its scope; then reply."""
        handler = self.handler
        assert handler is not None
        obj, shm = self.actor.obj, self.shm
        is_call = type(self.env) is _wire.Call
        payload: _wire.Payload | None = None
        failure: BaseException | None = None
        token = call_context.set(self.ctx)
        try:
            if later is None and handler.thread:
                # In a worker thread, which pickles the result too; a cancel waits for
                # it to return (the actor stays serial), and amesh.cancelled() tells
                # the handler it may stop early.
                run = partial(_run_in_thread, handler.fn, obj, args, kwargs, is_call, shm)
                with self._scope().open():
                    result, payload = await anyio.to_thread.run_sync(run)
            elif later is None:
                # in a greenlet of its own: a breakpoint() pauses the handler only
                result = await run_handler_in(self.scope, handler.fn, (obj, *args), kwargs)
            elif later is not _PICKLE:
                try:
                    with self._scope().open():
                        result = await later
                finally:
                    if handler_local.ends:  # it paused, holding the loop (see _pausable)
                        end_direct()
            if is_call and payload is None:
                payload = _wire.dumps_plain(result)
                if payload is None and not cheap_to_pickle(result):
                    with self._scope().open():
                        dump = partial(_wire.dumps, result, shm=shm)
                        payload = await anyio.to_thread.run_sync(dump)
        except Exception as exc:  # any pickling error is the call's, not the process's
            failure = exc
        finally:
            self._ended()
            call_context.reset(token)
        waiting = self._answer(result, payload, failure)
        if waiting is not None:  # the link is full: wait for room
            await waiting

    def _scope(self) -> LazyScope:
        return self.scope if self.scope is not None else self._open_scope()

    def _answer(
        self, result: Any, payload: _wire.Payload | None, failure: BaseException | None
    ) -> Awaitable[None] | None:
        """Reply to a call, or fail the actor for a cast that raised. Returns what to
        await while the link is full, if it is."""
        if self.scope is not None and self.scope.cancel_called:
            # The caller gave up (or the actor failed); it waits for nothing more.
            if payload is not None:
                _wire.release_payload(payload)
            return None
        env = self.env
        if type(env) is _wire.Call:
            return self._reply(env, result, payload, failure)
        if failure is not None:
            actor = self.actor
            name, message, tb = error_of(failure)
            label = actor.label(env.method)
            log.error("endpoint %s raised under broadcast:\n%s", label, tb)
            actor.fail(f"endpoint {label} raised under broadcast: {name}: {message}")
        return None

    def _reply(
        self,
        env: _wire.Call,
        result: Any,
        payload: _wire.Payload | None,
        failure: BaseException | None,
    ) -> Awaitable[None] | None:
        """Send the reply: ``result`` (pickled now, unless ``payload`` has it) or
        ``failure``."""
        links = self.actor.runtime.links
        dest, reply_id, rank = env.reply_to or env.sender, env.reply_id or env.call_id, env.rank
        if failure is None:
            try:
                if payload is None:
                    payload = _wire.dumps(result, shm=self.shm)
            except Exception as exc:  # any pickling error is the call's
                failure = exc
            else:
                reply = _wire.Reply(reply_id, rank, payload.inline, payload.lengths)
                before_reply()  # what the handler printed reaches the caller first
                try:
                    return links.send_soon(dest, reply, payload.parts)
                except ValueError as exc:  # larger than the transport takes: say so
                    failure = exc
        name, message, tb = error_of(failure)
        before_reply()
        return links.send_soon(dest, _wire.Error(reply_id, rank, name, message, tb))


class ActorInstance:
    """An actor object living in this runtime.

    Args:
        runtime: the runtime that routes to it.
        key: its unique routing key.
        name: the actor mesh name, for errors.
        obj: the user's actor object.
        handlers: endpoint name -> :class:`Handler`.
        owner: address of the owner's runtime (receives failure reports).
        rank: this instance's rank in the mesh it was spawned as.
    """

    def __init__(
        self,
        runtime: Runtime,
        key: str,
        name: str,
        obj: Any,
        handlers: MutableMapping[str, Handler],
        owner: str,
        rank: int,
    ) -> None:
        self.runtime = runtime
        self.key = key
        self.name = name
        self.obj = obj
        self.handlers = handlers
        self.owner = owner
        self.rank = rank
        self._queue: deque[_Item] = deque()
        #: method -> this actor's entry in a call chain (see chain_entry)
        self._entries: dict[str, str] = {}
        self._closed = False
        self._wakeup: Any = None
        #: the context handlers run in (see run)
        self._ctx = contextvars.Context()
        #: one-shot wake-ups (one waiter each: the dispatch loop)
        self._new_event = native_wakeup_class()
        #: without concurrent endpoints, handlers run in the loop's own task
        self._inline = not any(h.concurrent for h in handlers.values())
        self.handled = 0
        #: why the actor failed, once it has
        self.failed: str | None = None
        #: meshes this actor started and stops with it
        self.owned: list[Owned] = []
        self.tg: TaskGroup | None = None
        #: the scopes of the handlers running now, and their endpoints' names
        self._running: dict[LazyScope, str] = {}
        self._serial_done: Any = None
        #: 1 while the loop holds a serial message until the running one is done
        self._held = 0
        self._drained = anyio.Event()
        self._stopping = anyio.Event()
        #: set when the dispatch loop has ended
        self.done = anyio.Event()

    def status(self) -> dict[str, Any]:
        """What it does now: its mesh's name and its rank, the messages waiting in its
        mailbox (``queued``), its handlers running (``running``) and their endpoints
        (``now``), and how many it has handled."""
        return {
            "name": self.name,
            "rank": self.rank,
            "queued": len(self._queue) + self._held,
            "running": len(self._running),
            "now": sorted(self._running.values()),
            "handled": self.handled,
            "failed": self.failed,
        }

    def label(self, method: str = "") -> str:
        return f"{self.name}[{self.rank}]" + (f".{method}" if method else "")

    def put(self, env: _wire.Call | _wire.Cast, buffers: list[Any]) -> bool:
        """Queue a message and its out-of-band buffers (never blocks): True if it
        waits in the mailbox, False if it ran at once (its rest, if any, then goes
        ahead of any later message).

        Raises:
            anyio.ClosedResourceError: the actor is stopping.
        """
        if self._closed:
            raise anyio.ClosedResourceError(f"actor {self.label()} is stopping")
        if self._wakeup is not None and self._inline and type(env) is _wire.Call:
            # The loop waits for a message (none is queued or running): a call to an
            # endpoint that cannot wait runs right here, as the loop would run it,
            # without the loop's turn in between.
            handler = self.handlers.get(env.method)
            if handler is not None and handler.now:
                left = self._ctx.run(Invocation(self, env, handler).step, buffers, False)
                if left is not None:  # the loop awaits it before any later message
                    self._later(left)
                return False
        self._queue.append((env, buffers))
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            wakeup.set()
        return True

    def pause_in_greenlet(self, method: str) -> bool:
        """The handler of ``method`` running now pauses in a debugger: True if it runs
        on the event loop without a greenlet of its own (its ``breakpoint()`` is in
        code it calls), so that the pause holds the loop. The endpoint then runs in
        one from its next call on, and a pause there holds that handler only."""
        handler = self.handlers.get(method)
        if handler is None or handler.pausable or handler.thread:
            return False
        self.handlers[method] = replace(handler, pausable=True)
        return True

    def close(self) -> None:
        """Stop taking messages; the loop ends once the queue is drained."""
        self._closed = True
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            wakeup.set()

    # -- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """The dispatch loop; returns once the actor is stopped."""
        # This task may have been started from another runtime's context (in-process
        # workers); its handlers must see their own runtime.
        runtime_var.set(self.runtime)
        call_context.set(None)
        # Handlers run in this context, whether the loop runs them or put() does: what
        # one sets in a ContextVar, the next one sees, either way.
        self._ctx = contextvars.copy_context()
        try:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                await in_context(self._ctx, self._loop(tg))
                self._drained.set()
                await self._stopping.wait()
                tg.cancel_scope.cancel()
        finally:
            self._drained.set()
            self.done.set()

    async def _loop(self, tg: TaskGroup) -> None:
        rt = self.runtime
        queue = self._queue
        while True:
            while not queue:  # the next message (written out: it runs for every one)
                if self._closed:
                    return
                wakeup = self._wakeup = self._new_event()
                await wakeup.wait()
            env, buffers = queue.popleft()
            if env is None:  # what a handler run by put() left to wait for
                await buffers
                continue
            key = (env.sender, env.call_id)
            if isinstance(env, _wire.Cast):
                rt.taken(env.sender, self.key, _wire.payload_size(env))
            # The request counts as queued until its handler registers as running, so
            # a cancel in between (waiting for the serial handler, or for its task to
            # start) is not lost: the handler sees it and does not run.
            if rt.dispatch.drop_if_cancelled(key):
                continue
            if self.failed is not None:
                rt.dispatch.unqueue(key)
                await self.refuse(env)
                continue
            handler = self.handlers.get(env.method)
            if self._inline:
                # every endpoint is serial: no task per message (and no coroutine for
                # a call to one that cannot wait)
                left = Invocation(self, env, handler).step(buffers)
                if left is not None:
                    await left
                continue
            if handler is not None and handler.concurrent:
                tg.start_soon(self._handle, env, buffers, handler)
                continue
            # A serial message starts once the previous serial handler has finished.
            # Meanwhile the loop takes nothing else, so messages start in arrival order;
            # but concurrent handlers that already started keep running, which is what
            # lets a serial handler be re-entered through a concurrent endpoint.
            if self._serial_done is not None:
                self._held = 1  # taken from the queue, still waiting: queued
                await self._serial_done.wait()
                self._held = 0
            done = self._serial_done = self._new_event()
            tg.start_soon(self._handle_serial, env, buffers, handler, done)

    async def _handle_serial(
        self,
        env: _wire.Call | _wire.Cast,
        buffers: list[memoryview],
        handler: Handler | None,
        done: Any,
    ) -> None:
        try:
            await self._handle(env, buffers, handler)
        finally:
            done.set()

    def chain_entry(self, method: str) -> str:
        entry = self._entries.get(method)
        if entry is None:
            entry = f"{self.runtime.address}#{self.key}#{self.label(method)}"
            self._entries[method] = entry
        return entry

    def waits_on(self, chain: list[str]) -> list[str] | None:
        """The cycle, if a serial handler of this actor is in ``chain``."""
        prefix = f"{self.runtime.address}#{self.key}#"
        for i, entry in enumerate(chain):
            if entry.startswith(prefix):
                # (an entry from a peer may be malformed: then it is shown whole)
                return [e.split("#", 2)[-1] for e in chain[i:]]
        return None

    async def refuse(self, env: _wire.Call | _wire.Cast) -> None:
        """Answer a message to a failed actor with a supervision error."""
        if isinstance(env, _wire.Call):
            msg = _wire.clip(f"actor {self.label()} failed earlier: {self.failed}")
            await self.runtime.send_frame(
                env.reply_to or env.sender,
                _wire.Error(
                    env.reply_id or env.call_id, env.rank, "amesh.SupervisionError", msg, ""
                ),
            )

    async def _handle(
        self, env: _wire.Call | _wire.Cast, buffers: list[memoryview], handler: Handler | None
    ) -> None:
        """Run one message in this task, to its reply."""
        left = Invocation(self, env, handler).step(buffers)
        if left is not None:
            await left

    def _later(self, awaitable: Awaitable[Any]) -> None:
        """Have the loop await ``awaitable`` before any later message."""
        self._queue.appendleft((None, awaitable))
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            wakeup.set()

    # -- supervision ----------------------------------------------------------------------

    async def supervise(self, failure: Any) -> bool:
        """Offer ``failure`` of a mesh this actor owns to its ``__supervise__``.

        Returns:
            True if the actor handled it; False if the actor fails because of it.
        """
        hook = getattr(self.obj, "__supervise__", None)
        if hook is None:
            return False
        ctx = CallContext(self.obj, ([], [], 0), self.owner, 0, self, [])
        token = call_context.set(ctx)
        try:
            result = hook(failure)
            if inspect.isawaitable(result):
                result = await result
            return bool(result)
        except Exception:
            log.exception("%s.__supervise__ raised; the failure escalates", self.label())
            return False
        finally:
            call_context.reset(token)

    def fail(self, cause: str) -> None:
        """The actor failed: refuse further messages and tell the owner, once."""
        if self.failed is not None:
            return
        self.failed = cause
        for scope in list(self._running):
            scope.cancel()
        rt = self.runtime
        text = _wire.clip(f"actor {self.label()}: {cause}")
        report = _wire.FailureReport(self.key, self.rank, rt.pid, text)
        rt.start_soon(rt.report_failure, self.owner, report)
        rt.start_soon(self._stop_owned)

    async def _stop_owned(self) -> None:
        owned, self.owned = self.owned, []
        for res in reversed(owned):
            try:
                await res.stop()
            except Exception:
                log.exception("stopping a mesh owned by %s", self.label())

    async def stop(self) -> None:
        """Finish queued messages, run ``__cleanup__``, stop owned meshes, end the loop."""
        self.close()
        with anyio.move_on_after(STOP_TIMEOUT):
            await self._drained.wait()
        try:
            with anyio.move_on_after(STOP_TIMEOUT):
                cleanup = getattr(self.obj, "__cleanup__", None)
                if cleanup is not None:
                    result: Any = cleanup()
                    if inspect.isawaitable(result):
                        await result
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_owned()
                self._stopping.set()
                await self.done.wait()
            # it takes no cast any more: its senders' windows and counts go
            self.runtime.links.forget_actor(self.key)
