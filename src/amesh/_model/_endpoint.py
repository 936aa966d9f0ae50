"""Adverbs on a mesh endpoint: call, call_one, choose, stream, broadcast."""

from __future__ import annotations

import inspect
import math
import random
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, ParamSpec, TypeVar

import anyio

from .. import _wire
from .._errors import ActorError, DeadlockError, Failure, ProtocolError, SupervisionError
from .._runtime import Payloads, Pending, Stream, bridged, current_runtime, is_local, rank_label
from .._shape import Point
from ._value_mesh import ValueMesh

if TYPE_CHECKING:
    from ._actor import EndpointDescriptor
    from ._actor_mesh import ActorMesh

__all__ = ["MeshEndpoint"]

P = ParamSpec("P")
R = TypeVar("R")


class _Deadline(NamedTuple):
    """When an adverb gives up (``at``, on the event loop's clock), and the ``timeout``
    it was given, for the message."""

    at: float
    timeout: float | None


_NO_DEADLINE = _Deadline(math.inf, None)
#: a call's replies before it is sent: none (and none can be added)
_NO_ITEMS: deque[tuple[int, bool, Any]] = deque(maxlen=0)


def _not_sent() -> Awaitable[Any]:
    raise AssertionError("a call's replies are awaited after send_soon()")


#: A timeout's message lists at most this many of the ranks that did not answer.
_MAX_LISTED = 16


def _deadline(timeout: float | None) -> _Deadline:
    if timeout is None:
        return _NO_DEADLINE
    return _Deadline(anyio.current_time() + timeout, timeout)


def ranks_text(ranks: list[int], called: int) -> str:
    """``"rank 3"``, ``"ranks 3, 5 (of 8)"``: the first :data:`_MAX_LISTED` of
    ``ranks``, out of ``called`` ranks."""
    if called == 1 and len(ranks) == 1:
        return f"rank {ranks[0]}"
    listed = ", ".join(map(str, ranks[:_MAX_LISTED]))
    more = f" and {len(ranks) - _MAX_LISTED} more" if len(ranks) > _MAX_LISTED else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {listed}{more} (of {called})"


def _scattered(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | str]:
    """The positions and names of the arguments to scatter: the :class:`ValueMesh`
    ones (not those passed :meth:`~ValueMesh.whole`). Usually none, found at little
    cost."""
    for arg in args:
        if isinstance(arg, ValueMesh):
            break
    else:
        for arg in kwargs.values():
            if isinstance(arg, ValueMesh):
                break
        else:
            return []
    keys: list[int | str] = [
        i for i, arg in enumerate(args) if isinstance(arg, ValueMesh) and arg._scatter
    ]
    if kwargs:
        keys += [k for k, arg in kwargs.items() if isinstance(arg, ValueMesh) and arg._scatter]
    return keys


def _place(
    args: tuple[Any, ...], kwargs: dict[str, Any], items: Sequence[tuple[int | str, Any]]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with each ``(position or name, value)`` of ``items`` put in."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for key, value in items:
        if isinstance(key, int):
            new_args[key] = value
        else:
            new_kwargs[key] = value
    return tuple(new_args), new_kwargs


class _RankArgs:
    """One rank's arguments to a scattered call: those shared by every rank, pickled
    once, and the rank's own elements. Unpickled, it is ``(args, kwargs)``."""

    __slots__ = ("elements", "shared")

    def __init__(self, shared: _wire.Payload, elements: list[tuple[int | str, Any]]) -> None:
        self.shared = shared
        self.elements = elements

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rank_args, (self.shared, self.elements))


def _rank_args(
    shared: _wire.Payload, elements: list[tuple[int | str, Any]]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What a receiver unpickles for a :class:`_RankArgs`."""
    args, kwargs = shared.load()
    return _place(args, kwargs, elements)


def unpicklable(
    args: tuple[Any, ...], kwargs: dict[str, Any], where: str, exc: TypeError
) -> TypeError:
    """The error to raise when ``(args, kwargs)`` of ``where`` (``trainers.step``) could
    not be pickled (``exc``): it names the argument, found by pickling them one by one."""
    named: list[tuple[str, Any]] = [(str(i), a) for i, a in enumerate(args)]
    named += [(repr(k), v) for k, v in kwargs.items()]
    what, why = "the arguments", exc.__cause__ or exc
    for name, value in named:
        try:
            _wire.dumps(value)
        except TypeError as one:
            what, why = f"argument {name}", one.__cause__ or one
            break
    return TypeError(f"cannot pickle {what} of {where}: {why}")


class MeshEndpoint(Generic[P, R]):
    """One endpoint of an actor mesh (or a slice of one).

    Typed by the endpoint's parameters (``P``, after ``self``) and result (``R``):
    each adverb takes the endpoint's own arguments, so a type checker catches wrong
    ones. Options of the adverbs themselves come from :meth:`options`
    (``ep.options(timeout=5).call(x)``), so they never collide with an endpoint's
    parameter of the same name.

    Per-rank arguments: an argument (positional or keyword) that is a
    :class:`ValueMesh` is scattered, so each rank gets only its own element, the one at
    its point; the ValueMesh must have the called mesh's (or slice's) shape. Results
    of one mesh feed another of the same shape: ``await b.consume.call(await
    a.produce.call())``; ``ValueMesh.of(mesh, values)`` makes one from a list. Only
    arguments themselves are scattered, not ValueMeshes inside them; to pass a
    ValueMesh whole to every rank, pass ``vm.whole()``.

    A scattered request is one message per rank, each down the relay tree along its
    rank's own path, so it keeps its order behind the requests before it (the sender
    sends one frame per rank instead of one per subtree).
    """

    __slots__ = ("_desc", "_mesh", "_timeout")

    def __init__(
        self, mesh: ActorMesh[Any], desc: EndpointDescriptor[P, R], timeout: float | None = None
    ) -> None:
        self._mesh = mesh
        self._desc = desc
        self._timeout = timeout

    def __repr__(self) -> str:
        timeout = "" if self._timeout is None else f" (timeout {self._timeout:g} s)"
        return f"<endpoint {self._mesh.name}.{self._desc.name} over {self._mesh.sizes}{timeout}>"

    def options(self, *, timeout: float | None = None) -> MeshEndpoint[P, R]:
        """This endpoint with options for its adverbs: ``ep.options(timeout=5).call(x)``.

        Args:
            timeout: seconds an adverb waits before it raises ``TimeoutError`` (for
                :meth:`broadcast`: waits on flow control); None waits for ever.

        Raises:
            ValueError: ``timeout`` is negative.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        return MeshEndpoint(self._mesh, self._desc, timeout)

    def _bounded(self, timeout: float) -> MeshEndpoint[P, R]:
        """This endpoint, its adverbs given up after ``timeout`` seconds at the latest:
        what ``.get(timeout)`` of an adverb runs (see :meth:`amesh.Op.get`)."""
        own = self._timeout
        return MeshEndpoint(self._mesh, self._desc, timeout if own is None else min(own, timeout))

    def _session_failure(self) -> Exception | None:
        """See :meth:`amesh.ProcMesh._session_failure` (a session's failed mesh)."""
        owner = self._mesh._owner
        return owner._session_failure() if owner is not None else None

    def _encode(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        targets: dict[int, str],
        shm: bool = True,
    ) -> Payloads:
        """The arguments for ``targets``, pickled: one payload for all, or one per
        target rank when some are scattered or go through shared memory. ``shm``:
        large buffers for receivers on this host may go through shared memory (never
        for casts, whose sender cannot tell when they were loaded)."""
        self._desc.bind_check(args, kwargs)
        # a few builtins (most calls): pickled at once, never through shared memory
        # (and none of them a ValueMesh to scatter)
        plain = _wire.dumps_args(args, kwargs)
        if plain is not None:
            return plain
        keys = _scattered(args, kwargs)
        if keys:
            return self._encode_each(args, kwargs, keys, targets, shm)
        # receivers on this host: large buffers may go through shared memory
        if shm:
            if len(targets) == 1:
                shm = is_local(next(iter(targets.values())))
            else:
                shm = all(is_local(addr) for addr in targets.values())
        payload = self._dump_args(args, kwargs, shm)
        if len(targets) == 1 or not payload.segments:
            return payload
        # several receivers: written once, each maps it by a name of its own
        try:
            return _wire.for_receivers(payload, list(targets))
        except OSError:
            return self._dump_args(args, kwargs, False)

    def _encode_each(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        keys: list[int | str],
        targets: dict[int, str],
        shm: bool,
    ) -> Payloads:
        """Scatter: each target rank gets its own element of the ValueMesh arguments
        ``keys``; the other arguments are pickled once for all ranks."""
        scattered = [(key, self._elements(key, args, kwargs)) for key in keys]

        def own(rank: int) -> list[tuple[int | str, Any]]:
            return [(key, elements[rank]) for key, elements in scattered]

        if len(targets) == 1:
            ((rank, addr),) = targets.items()
            return self._dump_args(*_place(args, kwargs, own(rank)), shm and is_local(addr))
        shared = self._dump_args(*_place(args, kwargs, [(key, None) for key in keys]), False)

        def dump(rank: int, addr: str) -> _wire.Payload:
            try:
                return _wire.dumps(_RankArgs(shared, own(rank)), shm=shm and is_local(addr))
            except TypeError:
                self._dump_args(*_place(args, kwargs, own(rank)), False)  # names the culprit
                raise

        return {rank: dump(rank, addr) for rank, addr in targets.items()}

    def _elements(self, key: int | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The elements of ValueMesh argument ``key``, in the called mesh's rank order.

        Raises:
            ValueError: it does not have the called mesh's shape.
        """
        vm: ValueMesh[Any] = args[key] if isinstance(key, int) else kwargs[key]
        mesh = self._mesh
        if vm.shape.labels != mesh.shape.labels or vm.shape.sizes != mesh.shape.sizes:
            raise ValueError(
                f"endpoint {self._desc.name}(): argument {self._arg_name(key)} is a "
                f"ValueMesh over {vm.sizes}, but {mesh.name} is called over {mesh.sizes}: "
                "a ValueMesh argument is scattered (each rank gets its own element), so "
                "it needs the called mesh's shape; pass vm.whole() to send it whole"
            )
        return vm.values()

    def _arg_name(self, key: int | str) -> str:
        """How an error names argument ``key`` (a position or a keyword)."""
        if isinstance(key, str):
            return repr(key)
        params = list(self._desc.signature.parameters.values())[1:]  # after self
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if key < len(params) and params[key].kind in positional:
            return repr(params[key].name)
        return f"#{key} (positional)"

    def _dump_args(self, args: tuple[Any, ...], kwargs: dict[str, Any], shm: bool) -> _wire.Payload:
        """Pickle a call's arguments.

        Raises:
            TypeError: one cannot be pickled; the message names it (only then are the
                arguments pickled one by one, to find it).
        """
        try:
            return _wire.dumps((args, kwargs), shm=shm)
        except TypeError as exc:
            where = f"{self._mesh.name}.{self._desc.name}"
            raise unpicklable(args, kwargs, where, exc) from None

    def _where(self, rank: int) -> tuple[int, str]:
        """The mesh rank of called rank ``rank``, and how to name it in a message."""
        whole = self._mesh._shape.slots[rank]
        return whole, rank_label(whole, rank)

    def _raise(self, rank: int, value: Any) -> None:
        """Raise the error that called rank ``rank`` answered with (``value``)."""
        if isinstance(value, _wire.Error):
            shape = self._mesh._dense_shape()
            point = {**shape.coords(rank), "rank": rank}
            if value.type_name == "amesh.SupervisionError":
                # the actor failed, or an endpoint's own supervision scope did
                whole, where = self._where(rank)
                failure = Failure(f"actor {self._mesh.name!r}", whole, None, value.message)
                raise SupervisionError(
                    f"{self._mesh.name}.{self._desc.name} at {where}: {value.message}",
                    [failure],
                )
            if value.type_name == _wire.NO_ACTOR:
                # no actor ran: it was stopped or replaced (the message says which)
                where = self._where(rank)[1]
                raise LookupError(
                    f"{self._mesh.name}.{self._desc.name} at {where}: {value.message}"
                )
            if value.type_name == "amesh.ProtocolError":
                # the worker does not speak our protocol version: no actor ran
                where = self._where(rank)[1]
                raise ProtocolError(
                    f"{self._mesh.name}.{self._desc.name} at {where}: {value.message}"
                )
            cls = DeadlockError if value.type_name == "amesh.DeadlockError" else ActorError
            raise cls(value.type_name, value.message, value.traceback, self._mesh.name, point)
        if isinstance(value, SupervisionError):
            raise SupervisionError(
                f"{self._mesh.name}.{self._desc.name} at {self._where(rank)[1]}: {value.message}",
                value.failures,
            )
        raise value

    @bridged
    async def call(self, *args: P.args, **kwargs: P.kwargs) -> ValueMesh[R]:
        """Call every rank; returns their results as a :class:`ValueMesh`.

        The first error cancels the rest of the call (locally and remotely). A
        :class:`ValueMesh` argument is scattered: each rank gets its own element (see
        :class:`MeshEndpoint`).

        Raises:
            TypeError: the arguments do not fit the endpoint (nothing was sent), or
                one cannot be pickled (the message names it).
            ValueError: a ValueMesh argument does not have the called mesh's shape
                (nothing was sent).
            ActorError: an endpoint raised.
            LookupError: the actor mesh was stopped, or replaced (no endpoint ran).
            SupervisionError: a rank's process or actor failed.
            TimeoutError: the timeout given to :meth:`options` passed; the message
                names the ranks that did not answer.
        """
        mesh = self._mesh
        targets = mesh._targets()
        payload = self._encode(args, kwargs, targets)
        shape = mesh._dense_shape()
        results: list[Any] = [None] * len(shape)
        op = _Call(self, targets)
        try:
            sending = op.send_soon(payload)
            if sending is not None:
                await sending
            for _ in range(len(targets)):
                rank, value = await op.reply()
                results[rank] = value
        finally:
            op.close()
        return ValueMesh(shape, results)

    @bridged
    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        """Call a mesh of exactly one rank and return its result.

        Raises:
            ValueError: the mesh does not have exactly one rank, or as :meth:`call`.
            ActorError, LookupError, SupervisionError, TimeoutError, TypeError: as
                :meth:`call`.
        """
        mesh = self._mesh
        targets = mesh._targets()
        if len(targets) != 1:
            raise ValueError(
                f"call_one needs a mesh of exactly one rank, {mesh.name} has "
                f"{len(mesh)} ({mesh.sizes}); slice it or use call()"
            )
        payload = self._encode(args, kwargs, targets)
        return self._one(targets, payload)  # (its coroutine: no second one around it)

    @bridged
    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        """Call one rank: the one with the fewest calls in flight from this caller.

        It gets its own element of a scattered (:class:`ValueMesh`) argument.
        """
        self._desc.bind_check(args, kwargs)
        rt = current_runtime()
        mesh = self._mesh
        targets = mesh._targets()
        if not targets:
            raise ValueError(f"{mesh.name} has no ranks to choose from")
        live = {r: a for r, a in targets.items() if a not in rt.peers.dead} or targets
        load = {r: rt.calls.in_flight(a, mesh.key) for r, a in live.items()}
        least = min(load.values())
        rank = random.choice([r for r, n in load.items() if n == least])
        chosen = {rank: targets[rank]}
        payload = self._encode(args, kwargs, chosen)
        return self._one(chosen, payload)

    async def _one(self, target: dict[int, str], payload: Payloads) -> R:
        """Call the one rank of ``target`` (:meth:`call_one`, :meth:`choose`): its
        result."""
        op = _Call(self, target)
        try:
            sending = op.send_soon(payload)
            if sending is not None:
                await sending
            while not op.items:  # (op.reply()'s loop, without its coroutine)
                await op.arrival()
            result: R = op.take()[1]
        finally:
            op.close()
        return result

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Stream[tuple[Point, R]]:
        """Call every rank and yield ``(point, result)`` in arrival order: ``async for
        point, value in ep.stream(...)`` (or a plain ``for`` in synchronous code).

        Leaving the loop early cancels the ranks that have not answered. Arguments are
        scattered as for :meth:`call`.
        """
        return Stream(lambda: self._stream(args, kwargs))

    async def _stream(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AsyncGenerator[tuple[Point, R], None]:
        mesh = self._mesh
        targets = mesh._targets()
        payload = self._encode(args, kwargs, targets)
        shape = mesh._dense_shape()
        op = _Call(self, targets)
        try:
            sending = op.send_soon(payload)
            if sending is not None:
                await sending
            for _ in range(len(targets)):
                rank, value = await op.reply()
                yield shape.point(rank), value
        finally:
            op.close()

    @bridged
    async def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every rank without waiting for results.

        Returns once the messages are handed to the transport (back-pressure: it
        waits while a rank has a full window of this sender's broadcasts unread). An
        exception in the endpoint is a supervision failure reported to the owner.
        Arguments are scattered as for :meth:`call`.

        Raises:
            ValueError: a ValueMesh argument does not have the mesh's shape (nothing
                was sent).
            TimeoutError: flow control held the broadcast for the timeout given to
                :meth:`options`; ranks already handed the message keep it.
            SupervisionError: a rank of the mesh is known to be dead.
        """
        targets = self._mesh._targets()
        op = _Call(self, targets)
        await op.cast(self._encode(args, kwargs, targets, shm=False))


class _Call:
    """One call of an endpoint to some of its ranks, from its requests to its last
    reply: the one operation that every adverb drives, each its own way:
    :meth:`~MeshEndpoint.call` and :meth:`~MeshEndpoint.stream` read every reply,
    :meth:`~MeshEndpoint.call_one` and :meth:`~MeshEndpoint.choose` the one,
    :meth:`~MeshEndpoint.broadcast` sends casts and reads none.

    A call that waits for replies is sent in a ``try`` whose ``finally`` runs
    :meth:`close`. The deadline (the endpoint's timeout) runs from the call's making.
    """

    __slots__ = ("_deadline", "_ep", "_pending", "_rt", "_targets", "arrival", "items")

    def __init__(self, ep: MeshEndpoint[Any, Any], targets: dict[int, str]) -> None:
        self._ep = ep
        self._targets = targets
        timeout = ep._timeout
        self._deadline = _NO_DEADLINE if timeout is None else _deadline(timeout)
        self._rt = current_runtime()
        self._pending: Pending | None = None
        #: the replies that came and were not taken yet (once sent)
        self.items: deque[tuple[int, bool, Any]] = _NO_ITEMS
        #: (once sent) what to call, with no reply to :meth:`take`, for what to await
        #: until one comes; awaiting it raises TimeoutError if the deadline passes first
        self.arrival: Callable[[], Awaitable[Any]] = _not_sent

    def send_soon(self, payload: Payloads) -> Awaitable[None] | None:
        """Open the call with the runtime (so no reply can be missed) and send its
        requests: None once they all went (most calls: each rank directly, each link
        taking its frame at once), else what to await until they did (a full link, a
        relay tree). No coroutine of its own: this is every call's path."""
        rt, mesh = self._rt, self._ep._mesh
        pending = self._pending = rt.calls.open(mesh.key, self._targets, mesh._shape.slots)
        self.items = pending.items
        if self._deadline is _NO_DEADLINE:  # (no coroutine of its own in the common case)
            self.arrival = pending.arrival
        else:
            self.arrival = partial(self._before_deadline, pending)
        labels, sizes, tree = mesh._route()
        return rt.router.send_requests_soon(
            pending, self._ep._desc.name, labels, sizes, payload, tree
        )

    async def cast(self, payload: Payloads) -> None:
        """Send casts instead (no replies: nothing to open); their deadline holds
        for flow control."""
        mesh = self._ep._mesh
        labels, sizes, tree = mesh._route()
        await self._rt.send_casts(
            mesh.key, self._targets, self._ep._desc.name, labels, sizes, payload, tree,
            self._deadline.at,
        )  # fmt: skip

    async def reply(self) -> tuple[int, Any]:
        """The next reply, in arrival order: ``(called rank, result)``.

        Raises:
            ActorError, LookupError, ProtocolError, SupervisionError: the rank's
                answer (see :meth:`MeshEndpoint._raise`).
            TimeoutError: the deadline passed; the message names the endpoint and the
                (mesh) ranks that did not answer.
        """
        while not self.items:
            await self.arrival()
        return self.take()

    def take(self) -> tuple[int, Any]:
        """The next of the replies that came (:attr:`items` is not empty): see
        :meth:`reply`, which waits for :attr:`arrival` while :attr:`items` is empty,
        then takes; a caller that waits for one reply runs that loop itself, one
        coroutine fewer per call."""
        rank, ok, value = self.items.popleft()
        if not ok:
            self._ep._raise(rank, value)
        return rank, _wire.loads(*value)

    async def _before_deadline(self, pending: Pending) -> None:
        """:attr:`arrival` of a call with a deadline.

        Raises:
            TimeoutError: the deadline passed first, as :meth:`reply` says.
        """
        deadline = self._deadline
        try:
            with anyio.fail_after(max(0.0, deadline.at - anyio.current_time())):
                await pending.arrival()
        except TimeoutError:
            silent = sorted(pending.mesh_rank(r) for r in pending.targets)
            where = f"{self._ep._mesh.name}.{self._ep._desc.name}"
            raise TimeoutError(
                f"{where}: no answer within {deadline.timeout:g} s"
                f" from {ranks_text(silent, pending.size)}"
            ) from None

    def close(self) -> None:
        """Forget the call (once sent); the ranks that have not answered are asked to
        stop."""
        if self._pending is not None:
            waits = self._rt.calls.close(self._pending)
            if waits:  # (the call ended early: an error, a timeout, a cancel)
                self._rt.cancel_requests(waits)
