"""One actor instance in this process: its mailbox and its dispatch loop.

Messages are taken in arrival order (so per-sender FIFO holds). Serial endpoints are
awaited before the next message is taken; concurrent endpoints start in order and
interleave at their awaits.
"""

from __future__ import annotations

import inspect
import logging
import math
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .. import _codec, _wire
from .._shape import Shape
from ._context import CallContext, call_context

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["ActorInstance", "Handler", "error_of"]

log = logging.getLogger("amesh.actor")


@dataclass(frozen=True)
class Handler:
    """How to run one endpoint: the function and whether calls may interleave."""

    fn: Callable[..., Any]
    concurrent: bool


def error_of(exc: BaseException) -> tuple[str, str, str]:
    """``(type name, message, traceback text)`` of ``exc``, for the wire."""
    t = type(exc)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    tb = "".join(traceback.format_exception(exc))
    return name, str(exc), tb


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
        handlers: Mapping[str, Handler],
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
        send, recv = anyio.create_memory_object_stream[_wire.Call | _wire.Cast](math.inf)
        self._send: MemoryObjectSendStream[_wire.Call | _wire.Cast] = send
        self._recv: MemoryObjectReceiveStream[_wire.Call | _wire.Cast] = recv
        self.handled = 0
        #: set when the dispatch loop has ended
        self.done = anyio.Event()

    def put(self, env: _wire.Call | _wire.Cast) -> None:
        """Queue a message (never blocks)."""
        self._send.send_nowait(env)

    def close(self) -> None:
        """Stop taking messages; the loop ends once the queue is drained."""
        self._send.close()

    async def run(self) -> None:
        """The dispatch loop; returns when the mailbox is closed and drained."""
        try:
            await self._loop()
        finally:
            self.done.set()

    async def _loop(self) -> None:
        rt = self.runtime
        async with anyio.create_task_group() as tg:
            async for env in self._recv:
                key = (env.sender, env.call_id)
                rt.queued.discard(key)
                if key in rt.cancelled:
                    rt.cancelled.discard(key)
                    continue
                handler = self.handlers.get(env.method)
                if handler is not None and handler.concurrent:
                    tg.start_soon(self._handle, env, handler)
                else:
                    await self._handle(env, handler)

    async def _handle(self, env: _wire.Call | _wire.Cast, handler: Handler | None) -> None:
        rt = self.runtime
        key = (env.sender, env.call_id)
        is_call = isinstance(env, _wire.Call)
        shape = Shape(env.labels, env.sizes)
        ctx = CallContext(self.obj, shape.point(env.rank), env.sender, env.call_id)
        token = call_context.set(ctx)
        scope = anyio.CancelScope()
        rt.running[key] = scope
        result: Any = None
        failure: BaseException | None = None
        try:
            with scope:
                if handler is None:
                    raise AttributeError(f"actor {self.name!r} has no endpoint {env.method!r}")
                args, kwargs = _codec.loads(env.payload)
                result = handler.fn(self.obj, *args, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
        except Exception as exc:
            failure = exc
        finally:
            rt.running.pop(key, None)
            call_context.reset(token)
            self.handled += 1
        if scope.cancelled_caught:
            # The caller gave up; it waits for nothing more.
            return
        if failure is None and is_call:
            try:
                payload = _codec.dumps(result)
            except TypeError as exc:
                failure = exc
            else:
                await rt.send_frame(env.sender, _wire.Reply(env.call_id, env.rank, payload))
                return
        if failure is None:
            return
        name, message, tb = error_of(failure)
        if is_call:
            await rt.send_frame(env.sender, _wire.Error(env.call_id, env.rank, name, message, tb))
        else:
            log.error("endpoint %s.%s raised under broadcast:\n%s", self.name, env.method, tb)
            await rt.report_failure(
                self.owner,
                _wire.Failure(
                    self.key,
                    self.rank,
                    rt.pid,
                    f"endpoint {self.name}.{env.method} raised under broadcast: "
                    f"{name}: {message}\n{tb}",
                ),
            )
