"""The per-process runtime: one transport, a router, pending calls and actors.

Every process that takes part in a mesh (the controller and each worker) has exactly
one runtime while it is active. The router runs synchronously on the event loop for
each inbound frame: replies resolve pending calls, requests go to actor mailboxes.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from .. import _wire
from .._codec import Payload
from .._errors import DeadlockError, Failure, ProtocolError, SupervisionError
from .._transport import Transport, TransportClosed
from ._context import call_context, runtime_var
from ._mailbox import ActorInstance, Owned, type_name_of

__all__ = ["Pending", "Runtime", "RuntimeStats", "current_runtime"]

log = logging.getLogger("amesh.runtime")

#: How many recent requests are remembered to drop duplicates.
_RECENT = 65536


class RuntimeStats(msgspec.Struct, frozen=True):
    """Counters of one runtime (immutable snapshot)."""

    address: str
    frames_dropped: int
    duplicates_dropped: int
    bad_version: int
    calls_sent: int
    calls_pending: int
    actors: int
    frames_sent: int
    frames_received: int


class Pending:
    """Replies to one outgoing call, in arrival order.

    Items are ``(rank, ok, value)``: ``value`` is ``(pickle bytes, buffers)`` when
    ``ok``, else the exception to raise.
    """

    __slots__ = ("_event", "actor", "call_id", "items", "targets")

    def __init__(self, call_id: int, actor: str, targets: dict[int, str]) -> None:
        self.call_id = call_id
        self.actor = actor
        #: rank -> address for every rank that has not answered yet
        self.targets = targets
        self.items: deque[tuple[int, bool, Any]] = deque()
        self._event: anyio.Event | None = None

    def push(self, rank: int, ok: bool, value: Any) -> None:
        if self.targets.pop(rank, None) is None:
            return  # duplicate or unexpected: every rank answers at most once
        self.items.append((rank, ok, value))
        if self._event is not None:
            self._event.set()

    async def next(self) -> tuple[int, bool, Any]:
        while not self.items:
            self._event = anyio.Event()
            await self._event.wait()
        self._event = None
        return self.items.popleft()


def current_runtime() -> Runtime:
    """The runtime of the calling task.

    Raises:
        RuntimeError: no runtime is active (outside ``amesh.run`` / ``ProcMesh``).
    """
    rt = runtime_var.get()
    if rt is None or rt.closed:
        raise RuntimeError(
            "no amesh runtime is active here: use this inside `async with ProcMesh(...)` "
            "or `amesh.run(main)`"
        )
    return rt


class Runtime:
    """Routes frames between the transport, pending calls and local actors."""

    def __init__(self, transport: Transport, tg: TaskGroup) -> None:
        self.transport = transport
        self.address = transport.address
        self.pid = os.getpid()
        self.closed = False
        self._tg = tg
        self._ids = itertools.count(1)
        self.pending: dict[int, Pending] = {}
        self.actors: dict[str, ActorInstance] = {}
        #: (sender, call_id) of requests being handled, and their cancel scopes
        self.running: dict[tuple[str, int], anyio.CancelScope] = {}
        #: requests sitting in a mailbox, and those of them cancelled before they ran
        self.queued: set[tuple[str, int]] = set()
        self.cancelled: set[tuple[str, int]] = set()
        #: (address, actor key) -> calls this runtime has in flight there
        self.inflight: dict[tuple[str, str], int] = {}
        #: addresses of processes known to be dead -> why
        self.dead: dict[str, Failure] = {}
        self.ready_waiters: dict[str, Callable[[_wire.Ready], None]] = {}
        self.failure_handlers: dict[str, Callable[[_wire.FailureReport], None]] = {}
        #: addresses of workers -> when their last heartbeat came (anyio clock)
        self.heartbeats: dict[str, float] = {}
        #: meshes started outside any actor (owned by the controller itself)
        self.owned: list[Owned] = []
        #: unhandled failures of those meshes; they cancel the runtime's body
        self.root_failures: list[Failure] = []
        self._frames_dropped = 0
        self._duplicates = 0
        #: (sender, call id) of recent requests, to drop duplicated frames
        self._recent: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._bad_version = 0
        self._calls_sent = 0

    # -- ids, stats -----------------------------------------------------------------

    def next_id(self) -> int:
        return next(self._ids)

    def statistics(self) -> RuntimeStats:
        t = self.transport.statistics()
        return RuntimeStats(
            address=self.address,
            frames_dropped=self._frames_dropped,
            duplicates_dropped=self._duplicates,
            bad_version=self._bad_version,
            calls_sent=self._calls_sent,
            calls_pending=len(self.pending),
            actors=len(self.actors),
            frames_sent=t.frames_sent,
            frames_received=t.frames_received,
        )

    @property
    def task_group(self) -> TaskGroup:
        """The runtime's own task group (lives as long as the runtime)."""
        return self._tg

    def start_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in the runtime's own task group."""
        self._tg.start_soon(fn, *args)

    # -- sending --------------------------------------------------------------------

    async def send_frame(
        self, addr: str, env: _wire.Envelope, buffers: list[memoryview] | None = None
    ) -> None:
        """Encode and send; a vanished peer is not an error for the sender."""
        if addr in self.dead:
            return
        try:
            await self.transport.send(addr, _wire.encode(env, buffers))
        except TransportClosed:
            pass

    def send_frame_nowait(self, addr: str, env: _wire.Envelope) -> None:
        """Send without waiting; falls back to a background task when the link is full."""
        if addr in self.dead or self.closed:
            return
        frame = _wire.encode(env)
        try:
            if self.transport.try_send(addr, frame):
                return
        except TransportClosed:
            return
        self._tg.start_soon(self._send_later, addr, frame)

    async def _send_later(self, addr: str, frame: _wire.Frame) -> None:
        try:
            await self.transport.send(addr, frame)
        except TransportClosed:
            pass

    def fail_root(self, failure: Failure) -> None:
        """An unhandled failure reached the top of this process: cancel its body."""
        self.root_failures.append(failure)
        self._tg.cancel_scope.cancel()

    async def report_failure(self, owner: str, failure: _wire.FailureReport) -> None:
        """Tell ``owner`` that an actor here failed."""
        if owner == self.address:
            self._on_failure(failure)
        else:
            await self.send_frame(owner, failure)

    # -- outgoing calls ---------------------------------------------------------------

    def open_call(self, actor: str, targets: dict[int, str]) -> Pending:
        """Register a call before its requests go out, so no reply can be missed."""
        call_id = self.next_id()
        pending = Pending(call_id, actor, dict(targets))
        self.pending[call_id] = pending
        for addr in targets.values():
            k = (addr, actor)
            self.inflight[k] = self.inflight.get(k, 0) + 1
        return pending

    def close_call(self, pending: Pending, cancel: bool) -> None:
        """Forget ``pending``; with ``cancel``, ask the ranks that did not answer to stop."""
        self.pending.pop(pending.call_id, None)
        for addr in pending.targets.values():
            self._dec_inflight(addr, pending.actor)
        if cancel:
            for addr in set(pending.targets.values()):
                if addr not in self.dead:
                    self.send_frame_nowait(addr, _wire.Cancel(self.address, pending.call_id))
        pending.targets.clear()

    def _dec_inflight(self, addr: str, actor: str) -> None:
        k = (addr, actor)
        n = self.inflight.get(k, 0) - 1
        if n > 0:
            self.inflight[k] = n
        else:
            self.inflight.pop(k, None)

    async def send_requests(
        self,
        pending: Pending,
        method: str,
        labels: list[str],
        sizes: list[int],
        payload: Payload,
    ) -> None:
        """Send one :class:`~amesh._wire.Call` per target rank of ``pending``."""
        ctx = call_context.get()
        chain = ctx.chain if ctx is not None else []
        lengths = [b.nbytes for b in payload.buffers]
        dead = [(r, a) for r, a in pending.targets.items() if a in self.dead]
        if dead:
            # All or nothing: a call that includes a dead rank fails at once and
            # reaches no rank at all.
            for rank, addr in list(pending.targets.items()):
                why = self.dead.get(addr)
                if why is not None:
                    self._fail_rank(pending, rank, addr, why)
                else:
                    del pending.targets[rank]
                    self._dec_inflight(addr, pending.actor)
            return
        for rank, addr in list(pending.targets.items()):
            env = _wire.Call(
                self.address,
                pending.call_id,
                rank,
                pending.actor,
                method,
                labels,
                sizes,
                payload.data,
                chain,
                lengths,
            )
            await self.send_frame(addr, env, payload.buffers)
            self._calls_sent += 1

    def _fail_rank(self, pending: Pending, rank: int, addr: str, why: Failure) -> None:
        if rank in pending.targets:
            self._dec_inflight(addr, pending.actor)
            pending.push(rank, False, SupervisionError(str(why), [why]))

    async def send_casts(
        self,
        actor: str,
        targets: dict[int, str],
        method: str,
        labels: list[str],
        sizes: list[int],
        payload: Payload,
    ) -> None:
        """Send one :class:`~amesh._wire.Cast` per target: no reply is expected."""
        call_id = self.next_id()
        lengths = [b.nbytes for b in payload.buffers]
        for addr in targets.values():
            why = self.dead.get(addr)
            if why is not None:
                raise SupervisionError(str(why), [why])
        for rank, addr in targets.items():
            env = _wire.Cast(
                self.address, call_id, rank, actor, method, labels, sizes, payload.data, lengths
            )
            await self.send_frame(addr, env, payload.buffers)

    # -- failure of peers -------------------------------------------------------------

    def peer_failed(self, addr: str, why: Failure) -> None:
        """The process at ``addr`` is gone: fail every call waiting on it, now and later."""
        if addr in self.dead:
            return
        self.dead[addr] = why
        for pending in list(self.pending.values()):
            for rank, a in list(pending.targets.items()):
                if a == addr:
                    self._fail_rank(pending, rank, addr, why)
        self.transport.forget(addr)

    # -- local actors -------------------------------------------------------------------

    def add_actor(self, inst: ActorInstance) -> None:
        if inst.key in self.actors:
            raise ValueError(f"an actor with key {inst.key!r} already lives here")
        self.actors[inst.key] = inst
        self._tg.start_soon(inst.run)

    def remove_actor(self, key: str) -> ActorInstance | None:
        """Unregister an actor (stop it with :meth:`ActorInstance.stop`)."""
        return self.actors.pop(key, None)

    # -- inbound ----------------------------------------------------------------------

    def deliver(self, frame: bytes | memoryview) -> None:
        """Route one inbound frame. Never raises: bad frames are dropped and counted."""
        try:
            env, buffers = _wire.decode(frame)
        except _wire.BadFrame as exc:
            self._frames_dropped += 1
            log.warning("dropped a malformed frame of %d bytes: %s", len(frame), exc)
            return
        except _wire.BadVersion as exc:
            self._bad_version += 1
            msg = (
                f"protocol version {exc.version} is not supported by this runtime "
                f"(it speaks version {_wire.VERSION})"
            )
            log.warning("dropped a frame: %s", msg)
            if exc.sender:
                self._try_reply_error(exc.sender, exc.call_id, exc.rank, ProtocolError, msg)
            return
        try:
            self._route(env, buffers)
        except Exception:  # a router bug must not take the process down
            self._frames_dropped += 1
            log.exception("failed to route %s", type(env).__name__)

    def _try_reply_error(
        self, sender: str, call_id: int, rank: int, exc_type: type[BaseException], msg: str
    ) -> None:
        name = type_name_of(exc_type)
        try:
            self.send_frame_nowait(sender, _wire.Error(call_id, rank, name, msg, ""))
        except Exception:  # an unreachable or bogus sender address
            log.warning("could not answer %s", sender, exc_info=True)

    def _route(self, env: _wire.Envelope, buffers: list[memoryview]) -> None:
        if isinstance(env, (_wire.Reply, _wire.Error)):
            pending = self.pending.get(env.call_id)
            if pending is None:
                return  # a late reply to a call that was cancelled or timed out
            addr = pending.targets.get(env.rank)
            if addr is None:
                return
            self._dec_inflight(addr, pending.actor)
            if isinstance(env, _wire.Reply):
                pending.push(env.rank, True, (env.payload, buffers))
            else:
                pending.push(env.rank, False, env)
        elif isinstance(env, (_wire.Call, _wire.Cast)):
            inst = self.actors.get(env.actor)
            if inst is None:
                if isinstance(env, _wire.Call):
                    self._try_reply_error(
                        env.sender,
                        env.call_id,
                        env.rank,
                        LookupError,
                        f"no actor {env.actor!r} is running in process {self.pid}",
                    )
                return
            key = (env.sender, env.call_id)
            if key in self._recent:
                self._duplicates += 1  # at most once: a duplicated frame runs nothing
                return
            self._recent[key] = None
            if len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
            if inst.failed is not None:
                self._tg.start_soon(inst.refuse, env)
                return
            if isinstance(env, _wire.Call) and env.chain and self._deadlocks(inst, env):
                return
            self.queued.add((env.sender, env.call_id))
            inst.put(env, buffers)
        elif isinstance(env, _wire.Cancel):
            key = (env.sender, env.call_id)
            scope = self.running.get(key)
            if scope is not None:
                scope.cancel()
            elif key in self.queued:
                self.cancelled.add(key)
        elif isinstance(env, _wire.Ready):
            waiter = self.ready_waiters.pop(env.token, None)
            if waiter is not None:
                waiter(env)
        elif isinstance(env, _wire.FailureReport):
            self._on_failure(env)
        elif isinstance(env, _wire.Heartbeat):
            if env.addr in self.heartbeats:
                self.heartbeats[env.addr] = anyio.current_time()

    def _deadlocks(self, inst: ActorInstance, env: _wire.Call) -> bool:
        """Refuse a call to a serial endpoint whose actor is waiting on the caller."""
        handler = inst.handlers.get(env.method)
        if handler is not None and handler.concurrent:
            return False
        cycle = inst.waits_on(env.chain)
        if cycle is None:
            return False
        path = " -> ".join([*cycle, inst.label(env.method)])
        msg = (
            f"deadlock: {path} would wait on itself: {inst.label()} handles one message at "
            f"a time and is busy in {cycle[0]}, which waits on this call; make one of these "
            "endpoints @endpoint(concurrent=True)"
        )
        log.warning("refused a call: %s", msg)
        self._try_reply_error(env.sender, env.call_id, env.rank, DeadlockError, msg)
        return True

    def _on_failure(self, failure: _wire.FailureReport) -> None:
        handler = self.failure_handlers.get(failure.actor)
        if handler is None:
            log.error(
                "unowned failure of actor %s rank %d: %s",
                failure.actor,
                failure.rank,
                failure.cause,
            )
            return
        handler(failure)


def pass_cancellation(
    exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
) -> tuple[Any, Any, Any]:
    """What to hand an inner task group's ``__aexit__`` for the body's exception.

    A cancellation must reach the task group, which swallows its own. Any other
    exception is kept away from it, so it propagates to the user as raised, rather
    than wrapped in an ExceptionGroup.
    """
    if exc is not None and isinstance(exc, anyio.get_cancelled_exc_class()):
        return exc_type, exc, tb
    return None, None, None


class open_runtime:
    """Open a runtime for this task and the tasks it starts.

    Args:
        transport_factory: makes the transport (listening) when entered.
    """

    def __init__(self, transport_factory: Callable[[], Transport]) -> None:
        self._factory = transport_factory
        self._tg: TaskGroup | None = None
        self._rt: Runtime | None = None
        self._token: Any = None

    async def __aenter__(self) -> Runtime:
        transport = self._factory()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        rt = Runtime(transport, tg)
        tg.start_soon(transport.serve, rt.deliver)
        self._tg, self._rt = tg, rt
        self._token = runtime_var.set(rt)
        return rt

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._tg is not None and self._rt is not None
        rt = self._rt
        with anyio.CancelScope(shield=True):
            owned, rt.owned = rt.owned, []
            for res in reversed(owned):
                try:
                    await res.stop()
                except Exception:
                    log.exception("stopping a mesh at runtime exit")
        runtime_var.reset(self._token)
        rt.closed = True
        for inst in list(rt.actors.values()):
            inst.close()
        self._tg.cancel_scope.cancel()
        try:
            passed = pass_cancellation(*exc)
            # Only an exception handed in may be swallowed (our own cancellation);
            # anything else (KeyboardInterrupt, the body's errors) must propagate.
            suppressed = bool(await self._tg.__aexit__(*passed)) and passed[1] is not None
        finally:
            rt.transport.close()
        if rt.root_failures and (exc[1] is None or suppressed or is_supervision(exc[1])):
            failures = list(rt.root_failures)
            raise SupervisionError(
                f"{len(failures)} unhandled supervision failure(s): "
                + "; ".join(str(f).splitlines()[0] for f in failures),
                failures,
            )
        return suppressed


def is_supervision(exc: BaseException) -> bool:
    """True if ``exc`` is only a consequence of supervision failures.

    That is a SupervisionError, or a cancellation, or an exception group of them (a
    task group in the body collects the failed calls of its tasks).
    """
    kinds = (SupervisionError, anyio.get_cancelled_exc_class())
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(kinds)
        return rest is None
    return isinstance(exc, kinds)
