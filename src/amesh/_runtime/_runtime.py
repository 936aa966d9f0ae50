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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import anyio
import msgspec
from anyio.abc import TaskGroup

from .. import _codec, _wire
from .._codec import Payload
from .._errors import DeadlockError, Failure, ProtocolError, SupervisionError
from .._transport import Transport, TransportClosed
from ._context import call_context, is_local, native_event_class, runtime_var
from ._mailbox import ActorInstance, Owned, type_name_of
from ._tree import Gather, Nodes, plan, ranks_of, split

__all__ = ["Pending", "Runtime", "RuntimeStats", "Tree", "current_runtime", "is_local"]

log = logging.getLogger("amesh.runtime")

#: How many recent requests are remembered to drop duplicates.
_RECENT = 65536
#: A receiver returns credit after this many messages (or bytes) left a mailbox.
CREDIT_BATCH = 32
CREDIT_BATCH_BYTES = 8 * 1024 * 1024


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {raw!r}") from None
    return max(value, minimum)


def send_window() -> tuple[int, int]:
    """``(messages, bytes)`` one sender may have waiting in one actor's mailbox.

    From ``AMESH_SEND_WINDOW`` (default 1024, at least 2 x the credit batch of 32) and
    ``AMESH_SEND_WINDOW_BYTES`` (default 256 MiB, at least 16 MiB).
    """
    return (
        _env_int("AMESH_SEND_WINDOW", 1024, 2 * CREDIT_BATCH),
        _env_int("AMESH_SEND_WINDOW_BYTES", 256 << 20, 2 * CREDIT_BATCH_BYTES),
    )


class Tree(NamedTuple):
    """The relay tree of an actor mesh: its processes by slot, and the fan-out."""

    procs: Sequence[str]
    slots: Mapping[int, int]
    fanout: int


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
    relayed: int
    gathers: int
    credit_waits: int
    heartbeats_received: int


class Pending:
    """Replies to one outgoing call, in arrival order.

    Items are ``(rank, ok, value)``: ``value`` is ``(pickle bytes, buffers)`` when
    ``ok``, else the exception to raise.
    """

    __slots__ = ("_event", "_new_event", "actor", "call_id", "items", "relays", "targets", "via")

    def __init__(
        self, call_id: int, actor: str, targets: dict[int, str], new_event: Any = None
    ) -> None:
        self.call_id = call_id
        self.actor = actor
        #: rank -> address for every rank that has not answered yet
        self.targets = targets
        self.items: deque[tuple[int, bool, Any]] = deque()
        self._event: Any = None
        self._new_event = new_event or native_event_class()
        #: the relays the call went through, and the relays on each rank's path
        self.relays: set[str] = set()
        self.via: dict[int, tuple[str, ...]] = {}

    def push(self, rank: int, ok: bool, value: Any) -> None:
        if self.targets.pop(rank, None) is None:
            return  # duplicate or unexpected: every rank answers at most once
        self.items.append((rank, ok, value))
        if self._event is not None:
            self._event.set()

    async def next(self) -> tuple[int, bool, Any]:
        while not self.items:
            self._event = self._new_event()
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
        #: the event loop's own Event class (cheaper than anyio's on the hot path)
        self.new_event = native_event_class()
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
        #: relays' gathers of replies by id, and their ids by (sender, call id)
        self.gathers: dict[int, Gather] = {}
        self._gather_ids: dict[tuple[str, int], int] = {}
        self._relayed = 0
        self._heartbeats = 0
        #: frames waiting, in order, for a link that was full (see post)
        self._outq: dict[str, deque[_wire.Frame]] = {}
        #: flow control, sending side: (address, actor) -> [messages, bytes] in flight
        self.window, self.window_bytes = send_window()
        self._out: dict[tuple[str, str], list[int]] = {}
        self._credit_waiters: dict[tuple[str, str], Any] = {}
        self._credit_waits = 0
        #: receiving side: (sender, actor) -> [messages, bytes] taken, not yet credited
        self._taken: dict[tuple[str, str], list[int]] = {}

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
            relayed=self._relayed,
            gathers=len(self.gathers),
            credit_waits=self._credit_waits,
            heartbeats_received=self._heartbeats,
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
        self, addr: str, env: _wire.Envelope, buffers: list[Any] | None = None
    ) -> None:
        """Encode and send; a vanished peer is not an error for the sender."""
        if addr == self.address:
            self._route(env, buffers or [])
            return
        if addr in self.dead:
            return
        if addr in self._outq:
            self.post(addr, _wire.encode(env, buffers))
            return
        try:
            await self.transport.send(addr, _wire.encode(env, buffers))
        except TransportClosed:
            pass

    def send_frame_nowait(
        self, addr: str, env: _wire.Envelope, buffers: list[Any] | None = None
    ) -> None:
        """Send without waiting (see :meth:`post`)."""
        if addr == self.address:
            self._route(env, buffers or [])
            return
        if addr in self.dead or self.closed:
            return
        self.post(addr, _wire.encode(env, buffers))

    def post(self, addr: str, frame: _wire.Frame) -> None:
        """Send without waiting, in order: behind frames already waiting for ``addr``,
        else at once if the link takes it, else queued for a background task."""
        queue = self._outq.get(addr)
        if queue is not None:
            queue.append(frame)
            return
        try:
            if self.transport.try_send(addr, frame):
                return
        except TransportClosed:
            return
        except ValueError:
            log.exception("dropped a frame to %s", addr)
            return
        self._outq[addr] = deque([frame])
        self._tg.start_soon(self._drain, addr)

    async def _drain(self, addr: str) -> None:
        queue = self._outq[addr]
        try:
            while queue and addr not in self.dead:
                await self.transport.send(addr, queue[0])
                queue.popleft()
        except TransportClosed:
            pass
        except ValueError:
            log.exception("dropped frames to %s", addr)
        finally:
            self._outq.pop(addr, None)

    # -- flow control -------------------------------------------------------------------

    async def _acquire(self, addr: str, actor: str, nbytes: int) -> None:
        """Wait until ``actor`` at ``addr`` may take one more message from us."""
        key = (addr, actor)
        out = self._out.get(key)
        if out is None:
            out = self._out[key] = [0, 0]
        while out[0] and (out[0] >= self.window or out[1] + nbytes > self.window_bytes):
            if addr in self.dead or self.closed:
                return
            self._credit_waits += 1
            event = self._credit_waiters.get(key)
            if event is None:
                event = self._credit_waiters[key] = self.new_event()
            await event.wait()
            out = self._out.setdefault(key, [0, 0])
        out[0] += 1
        out[1] += nbytes

    def _on_credit(self, env: _wire.Credit) -> None:
        key = (env.addr, env.actor)
        out = self._out.get(key)
        if out is not None:
            out[0] = max(0, out[0] - env.count)
            out[1] = max(0, out[1] - env.nbytes)
        event = self._credit_waiters.pop(key, None)
        if event is not None:
            event.set()

    def taken(self, sender: str, actor: str, nbytes: int) -> None:
        """A cast from ``sender`` left ``actor``'s mailbox: return credit in batches.

        Only casts (broadcasts) are counted: a call is bounded by its caller, who
        waits for the reply, and must not queue behind casts (a call to a concurrent
        endpoint may be what lets a busy actor finish).
        """
        key = (sender, actor)
        taken = self._taken.get(key)
        if taken is None:
            taken = self._taken[key] = [0, 0]
        taken[0] += 1
        taken[1] += nbytes
        if taken[0] >= CREDIT_BATCH or taken[1] >= CREDIT_BATCH_BYTES:
            del self._taken[key]
            self.send_frame_nowait(sender, _wire.Credit(self.address, actor, *taken))

    def _forget_window(self, addr: str) -> None:
        for key in [k for k in self._out if k[0] == addr]:
            del self._out[key]
        for key in [k for k in self._credit_waiters if k[0] == addr]:
            self._credit_waiters.pop(key).set()

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
        pending = Pending(call_id, actor, dict(targets), self.new_event)
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
            for addr in set(pending.targets.values()) | pending.relays:
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
        tree: Tree | None = None,
    ) -> None:
        """Send the call of ``pending`` to each of its target ranks (down ``tree``)."""
        ctx = call_context.get()
        chain = ctx.chain if ctx is not None else []
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
        data, lengths, parts = _wire.pack(payload.data, payload.buffers)
        call_id = pending.call_id
        req = _wire.Relay(
            self.address, call_id, -1, pending.actor, method, labels, sizes, data, chain,
            lengths, self.address, call_id, [],
        )  # fmt: skip
        for addr, rank, nodes in self._heads(pending.targets, tree, pending):
            await self.send_frame(addr, _wire.addressed(req, rank, nodes), parts)
            self._calls_sent += 1

    def _heads(
        self, targets: dict[int, str], tree: Tree | None, pending: Pending | None = None
    ) -> list[tuple[str, int, Nodes]]:
        """Where a message to ``targets`` goes first: each rank directly, or the heads
        of the relay tree with their subtrees (recorded in ``pending`` for a call)."""
        if tree is None:
            return [(addr, rank, []) for rank, addr in targets.items()]
        route = plan({r: tree.slots[r] for r in targets}, tree.procs, tree.fanout, self.dead)
        if pending is not None:
            pending.relays, pending.via = route.relays, route.via
        return route.heads

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
        tree: Tree | None = None,
    ) -> None:
        """Send a :class:`~amesh._wire.Cast` to each target (down ``tree``): no replies."""
        call_id = self.next_id()
        for addr in targets.values():
            why = self.dead.get(addr)
            if why is not None:
                raise SupervisionError(str(why), [why])
        data, lengths, parts = _wire.pack(payload.data, payload.buffers)
        nbytes = payload.nbytes
        for addr in targets.values():
            await self._acquire(addr, actor, nbytes)
        req = _wire.Relay(
            self.address, call_id, -1, actor, method, labels, sizes, data, [], lengths, "", 0,
            [],
        )  # fmt: skip
        for addr, rank, nodes in self._heads(targets, tree):
            await self.send_frame(addr, _wire.addressed(req, rank, nodes), parts)

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
            if addr in pending.relays:
                self._relay_failed(pending, addr, why)
        self._forget_window(addr)
        self._outq.pop(addr, None)
        self.transport.forget(addr)

    def _relay_failed(self, pending: Pending, addr: str, why: Failure) -> None:
        """A relay of ``pending`` died: the replies behind it are lost; fail them fast
        (as a failure of the relay's rank only) and tell the relays above to stop
        waiting for them."""
        lost = [r for r, path in pending.via.items() if addr in path and r in pending.targets]
        for rank in lost:
            target = pending.targets[rank]
            self._dec_inflight(target, pending.actor)
            msg = f"the result of rank {rank} was lost: the process relaying it {why.cause}"
            pending.push(rank, False, SupervisionError(msg, [why]))
        if lost:
            prune = _wire.Prune(self.address, pending.call_id, lost)
            for relay in pending.relays:
                if relay not in self.dead:
                    self.send_frame_nowait(relay, prune)

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

    def _route(self, env: _wire.Envelope, buffers: list[Any]) -> None:
        if isinstance(env, (_wire.Reply, _wire.Error)):
            self._on_reply(env, buffers)
        elif isinstance(env, (_wire.Call, _wire.Cast)):
            if self._is_duplicate(env.sender, env.call_id):
                return
            self._accept(env, buffers)
        elif isinstance(env, _wire.Relay):
            if self._is_duplicate(env.sender, env.call_id):
                return
            self._relay(env, buffers)
        elif isinstance(env, _wire.Gathered):
            pos = 0
            for item in env.replies:
                n = len(item.buffers) if isinstance(item, _wire.Reply) else 0
                self._on_reply(item, buffers[pos : pos + n], env.call_id)
                pos += n
        elif isinstance(env, _wire.Credit):
            self._on_credit(env)
        elif isinstance(env, _wire.Cancel):
            key = (env.sender, env.call_id)
            gid = self._gather_ids.pop(key, None)
            if gid is not None:
                self.gathers.pop(gid, None)
            scope = self.running.get(key)
            if scope is not None:
                scope.cancel()
            elif key in self.queued:
                self.cancelled.add(key)
            elif gid is None and key not in self._recent:
                # The cancel overtook the request (it came down the relay tree): the
                # request, when it comes, is dropped like a duplicate.
                self._is_duplicate(*key)
        elif isinstance(env, _wire.Prune):
            gid = self._gather_ids.get((env.sender, env.call_id))
            gather = self.gathers.get(gid) if gid is not None else None
            if gid is not None and gather is not None:
                if gather.prune(env.ranks):
                    self._send_up(gid, gather)
                if not gather.waiting:
                    self._end_gather(gid, gather)
        elif isinstance(env, _wire.Ready):
            waiter = self.ready_waiters.pop(env.token, None)
            if waiter is not None:
                waiter(env)
        elif isinstance(env, _wire.FailureReport):
            self._on_failure(env)
        elif isinstance(env, _wire.Heartbeat):
            self._heartbeats += 1
            if env.addr in self.heartbeats:
                self.heartbeats[env.addr] = anyio.current_time()

    def _is_duplicate(self, sender: str, call_id: int) -> bool:
        key = (sender, call_id)
        if key in self._recent:
            self._duplicates += 1  # at most once: a duplicated frame runs nothing
            return True
        self._recent[key] = None
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        return False

    def _on_reply(
        self, env: _wire.Reply | _wire.Error, buffers: list[Any], call_id: int | None = None
    ) -> None:
        """A reply for our call (or gather) ``call_id``; the envelope's own if None
        (a reply in a :class:`~amesh._wire.Gathered` keeps the id of the relay's gather)."""
        if call_id is None:
            call_id = env.call_id
        pending = self.pending.get(call_id)
        if pending is None:
            gather = self.gathers.get(call_id)
            if gather is not None and gather.add(env, buffers):
                self._send_up(call_id, gather)
            return  # else a late reply to a call that was cancelled or timed out
        addr = pending.targets.get(env.rank)
        if addr is None:
            return
        self._dec_inflight(addr, pending.actor)
        if isinstance(env, _wire.Reply):
            pending.push(env.rank, True, _wire.unpack(env.payload, buffers))
        else:
            pending.push(env.rank, False, env)

    def _accept(self, env: _wire.Call | _wire.Cast, buffers: list[Any]) -> None:
        """Queue a request for a local actor, or answer why it cannot run."""
        inst = self.actors.get(env.actor)
        if inst is None:
            if isinstance(env, _wire.Cast):
                self.taken(env.sender, env.actor, _wire.payload_size(env))
            if isinstance(env, _wire.Call):
                self._try_reply_error(
                    env.reply_to or env.sender,
                    env.reply_id or env.call_id,
                    env.rank,
                    LookupError,
                    f"no actor {env.actor!r} is running in process {self.pid}",
                )
            return
        if inst.failed is not None:
            if isinstance(env, _wire.Cast):
                self.taken(env.sender, env.actor, _wire.payload_size(env))
            self._tg.start_soon(inst.refuse, env)
            return
        if isinstance(env, _wire.Call) and env.chain and self._deadlocks(inst, env):
            return
        self.queued.add((env.sender, env.call_id))
        inst.put(env, buffers)

    def _relay(self, env: _wire.Relay, buffers: list[Any]) -> None:
        """Run a relayed message here (if we are a target) and pass it down the tree."""
        self._relayed += 1
        if env.reply_to:  # a call
            gid = self.next_id()
            key = (env.sender, env.call_id)
            self.gathers[gid] = Gather(
                key, env.reply_to, env.reply_id, ranks_of(env.rank, env.nodes)
            )
            self._gather_ids[key] = gid
            # replies from below come here, to be gathered
            env = msgspec.structs.replace(env, reply_to=self.address, reply_id=gid)
        for addr, rank, nodes in split(env.nodes):
            self.send_frame_nowait(addr, _wire.addressed(env, rank, nodes), buffers)
        if env.rank >= 0:
            local = _wire.addressed(env, env.rank, [])
            assert not isinstance(local, _wire.Relay)
            self._accept(local, buffers)

    def _send_up(self, gid: int, gather: Gather) -> None:
        env, parts = gather.take()
        self.send_frame_nowait(gather.reply_to, env, parts)
        if not gather.waiting:
            self._end_gather(gid, gather)

    def _end_gather(self, gid: int, gather: Gather) -> None:
        self.gathers.pop(gid, None)
        if self._gather_ids.get(gather.key) == gid:
            del self._gather_ids[gather.key]

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
        self._try_reply_error(
            env.reply_to or env.sender, env.reply_id or env.call_id, env.rank, DeadlockError, msg
        )
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


#: runtimes open in this process (in-process test workers are runtimes too)
_open_runtimes = 0


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
        global _open_runtimes
        transport = self._factory()
        _open_runtimes += 1
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
            global _open_runtimes
            _open_runtimes -= 1
            if not _open_runtimes:
                # shared-memory segments this process sent that nobody took
                _codec.release_segments()
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
