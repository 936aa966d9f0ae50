"""Adverbs on a mesh endpoint: call, call_one, choose, stream, broadcast."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio

from . import _codec, _wire
from ._errors import ActorError, DeadlockError, Failure, SupervisionError
from ._runtime._calls import rank_label
from ._runtime._context import is_local
from ._runtime._runtime import Pending, Runtime, current_runtime
from ._shape import Point, Shape
from ._value_mesh import ValueMesh

if TYPE_CHECKING:
    from ._actor import EndpointDescriptor
    from ._actor_mesh import ActorMesh

__all__ = ["MeshEndpoint"]

R = TypeVar("R")


def _deadline(timeout: float | None) -> float:
    if timeout is None:
        return math.inf
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout}")
    return anyio.current_time() + timeout


async def _next(pending: Pending, deadline: float) -> tuple[int, bool, Any]:
    if deadline == math.inf:
        return await pending.next()
    if pending.items:
        return pending.items.popleft()
    with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
        return await pending.next()


class MeshEndpoint(Generic[R]):
    """One endpoint of an actor mesh (or a slice of one)."""

    def __init__(self, mesh: ActorMesh[Any], desc: EndpointDescriptor[Any, R]) -> None:
        self._mesh = mesh
        self._desc = desc

    def __repr__(self) -> str:
        return f"<endpoint {self._mesh.name}.{self._desc.name} over {self._mesh.sizes}>"

    def _encode(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], targets: dict[int, str] | None = None
    ) -> _codec.Payload:
        self._desc.bind_check(args, kwargs)
        # one receiver on this host: large buffers may go through shared memory
        shm = targets is not None and len(targets) == 1 and is_local(next(iter(targets.values())))
        return _codec.dumps((args, kwargs), shm=shm)

    def _where(self, rank: int) -> tuple[int, str]:
        """The mesh rank of called rank ``rank``, and how to name it in a message."""
        whole = self._mesh._shape.slots[rank]
        return whole, rank_label(whole, rank)

    def _raise(self, shape: Shape, rank: int, value: Any) -> None:
        if isinstance(value, _wire.Error):
            point = {**shape.coords(rank), "rank": rank}
            if value.type_name == "amesh.SupervisionError":
                # the actor failed, or an endpoint's own supervision scope did
                whole, where = self._where(rank)
                failure = Failure(f"actor {self._mesh.name!r}", whole, None, value.message)
                raise SupervisionError(
                    f"{self._mesh.name}.{self._desc.name} at {where}: {value.message}",
                    [failure],
                )
            cls = DeadlockError if value.type_name == "amesh.DeadlockError" else ActorError
            raise cls(value.type_name, value.message, value.traceback, self._mesh.name, point)
        if isinstance(value, SupervisionError):
            raise SupervisionError(
                f"{self._mesh.name}.{self._desc.name} at {self._where(rank)[1]}: {value.message}",
                value.failures,
            )
        raise value

    async def _gather(
        self,
        rt: Runtime,
        targets: dict[int, str],
        shape: Shape,
        payload: _codec.Payload,
        deadline: float,
    ) -> AsyncGenerator[tuple[int, Any], None]:
        pending = rt.open_call(self._mesh.key, targets, self._mesh._shape.slots)
        done = False
        try:
            labels, sizes = self._mesh._wire_shape()
            await rt.send_requests(
                pending, self._desc.name, labels, sizes, payload, self._mesh._tree()
            )
            for _ in range(len(targets)):
                rank, ok, value = await _next(pending, deadline)
                if not ok:
                    self._raise(shape, rank, value)
                yield rank, _codec.loads(*value)
            done = True
        finally:
            rt.close_call(pending, cancel=not done)

    async def call(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> ValueMesh[R]:
        """Call every rank; returns their results as a :class:`ValueMesh`.

        The first error cancels the rest of the call (locally and remotely).

        Raises:
            TypeError: the arguments do not fit the endpoint (nothing was sent), or
                cannot be pickled.
            ActorError: an endpoint raised.
            SupervisionError: a rank's process or actor failed.
            TimeoutError: ``timeout`` seconds passed.
        """
        mesh = self._mesh
        targets = mesh._targets()
        payload = self._encode(args, kwargs, targets)
        deadline = _deadline(timeout)
        rt = current_runtime()
        shape = Shape(mesh.shape.labels, mesh.shape.sizes)
        results: list[Any] = [None] * len(shape)
        gen = self._gather(rt, targets, shape, payload, deadline)
        try:
            async for rank, value in gen:
                results[rank] = value
        finally:
            await gen.aclose()
        return ValueMesh(shape, results)

    async def call_one(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> R:
        """Call a mesh of exactly one rank and return its result.

        Raises:
            ValueError: the mesh does not have exactly one rank.
            ActorError, SupervisionError, TimeoutError, TypeError: as :meth:`call`.
        """
        mesh = self._mesh
        if len(mesh) != 1:
            raise ValueError(
                f"call_one needs a mesh of exactly one rank, {mesh.name} has "
                f"{len(mesh)} ({mesh.sizes}); slice it or use call()"
            )
        # the hot path: no generator, no ValueMesh
        targets = mesh._targets()
        payload = self._encode(args, kwargs, targets)
        deadline = _deadline(timeout)
        rt = current_runtime()
        labels, sizes = mesh._wire_shape()
        pending = rt.open_call(mesh.key, targets, mesh._shape.slots)
        done = False
        try:
            await rt.send_requests(pending, self._desc.name, labels, sizes, payload, mesh._tree())
            rank, ok, value = await _next(pending, deadline)
            if not ok:
                self._raise(Shape(labels, sizes), rank, value)
            result: R = _codec.loads(*value)
            done = True
            return result
        finally:
            rt.close_call(pending, cancel=not done)

    async def choose(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> R:
        """Call one rank: the one with the fewest calls in flight from this caller."""
        self._desc.bind_check(args, kwargs)
        deadline = _deadline(timeout)
        rt = current_runtime()
        mesh = self._mesh
        targets = mesh._targets()
        if not targets:
            raise ValueError(f"{mesh.name} has no ranks to choose from")
        live = {r: a for r, a in targets.items() if a not in rt.dead} or targets
        load = {r: rt.inflight.get((a, mesh.key), 0) for r, a in live.items()}
        least = min(load.values())
        rank = random.choice([r for r, n in load.items() if n == least])
        chosen = {rank: targets[rank]}
        payload = self._encode(args, kwargs, chosen)
        shape = Shape(mesh.shape.labels, mesh.shape.sizes)
        gen = self._gather(rt, chosen, shape, payload, deadline)
        try:
            async for _, value in gen:
                return value  # type: ignore[no-any-return]
        finally:
            await gen.aclose()
        raise AssertionError("unreachable: a call to one rank yields once")

    async def stream(
        self, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[tuple[Point, R]]:
        """Call every rank and yield ``(point, result)`` in arrival order.

        Leaving the loop early cancels the ranks that have not answered.
        """
        payload = self._encode(args, kwargs)
        deadline = _deadline(timeout)
        rt = current_runtime()
        mesh = self._mesh
        shape = Shape(mesh.shape.labels, mesh.shape.sizes)
        gen = self._gather(rt, mesh._targets(), shape, payload, deadline)
        try:
            async for rank, value in gen:
                yield shape.point(rank), value
        finally:
            await gen.aclose()

    async def broadcast(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Send to every rank without waiting for results.

        Returns once the messages are handed to the transport (back-pressure: it
        waits while a rank has a full window of this sender's broadcasts unread). An
        exception in the endpoint is a supervision failure reported to the owner.

        Raises:
            TimeoutError: flow control held the broadcast for ``timeout`` seconds;
                ranks already handed the message keep it.
            SupervisionError: a rank of the mesh is known to be dead.
        """
        deadline = _deadline(timeout)
        payload = self._encode(args, kwargs)
        rt = current_runtime()
        mesh = self._mesh
        shape = mesh.shape
        await rt.send_casts(
            mesh.key,
            mesh._targets(),
            self._desc.name,
            list(shape.labels),
            list(shape.sizes),
            payload,
            mesh._tree(),
            deadline,
        )
