"""The per-process runtime: wires the parts that route frames for one process.

Every process that takes part in a mesh (the controller and each worker) has exactly
one runtime while it is active. The runtime is made of parts with one job each:

- :class:`~amesh._runtime._links.Links`: the ordered outbox and flow-control credit;
- :class:`~amesh._runtime._calls.Calls`: outgoing calls and the replies they wait for;
- :class:`~amesh._runtime._router.Router`: where requests go (direct or down the relay
  tree), and what a relay's death means for them;
- :class:`~amesh._runtime._relay.Relays`: requests this process relays, and gathers;
- :class:`~amesh._runtime._peers.Peers`: liveness, deaths and who must hear of them;
- :class:`~amesh._runtime._dispatch.Dispatch`: local actors, dedup, cancels, deadlocks;
- :class:`~amesh._runtime._output.Outputs`: the printers of its workers' output.

:meth:`Runtime.deliver` runs synchronously on the event loop for each inbound frame and
hands each envelope to the part that owns it, through one table keyed by envelope type.
Each part owns its state: the others (and other packages) use its methods, or read it
through a read-only view (who is dead: :attr:`Peers.dead`; the actors here:
:attr:`Dispatch.actors`); the runtime keeps no copies of them.

Service tasks (the transport's receive loop, outbox drains, actors, the watchers of
meshes) run in the runtime's own task group; the body that opened the runtime runs in
a cancel scope of its own inside it. An unhandled failure cancels only that body, so a
process keeps receiving (replies, failure reports) while it tears down.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import msgspec
import sniffio
from anyio.abc import TaskGroup

from .. import _wire
from .._errors import Failure, ProtocolError, SupervisionError
from .._ratelog import RateLimitedLog
from .._transport import Transport, TransportClosed
from ._calls import Calls, Pending
from ._context import (
    call_soon_threadsafe,
    is_local,
    native_event_class,
    native_waiter,
    runtime_var,
)
from ._dispatch import Dispatch
from ._links import CREDIT_BATCH, CREDIT_BATCH_BYTES, Links, send_window
from ._mailbox import ActorInstance, Owned
from ._output import Outputs
from ._peers import Peers
from ._relay import Relays
from ._router import Payloads, Router, Tree

__all__ = [
    "CREDIT_BATCH",
    "CREDIT_BATCH_BYTES",
    "Payloads",
    "Pending",
    "Runtime",
    "RuntimeStats",
    "Tree",
    "current_runtime",
    "is_local",
    "send_window",
]

log = logging.getLogger("amesh.runtime")
#: dropped frames are counted in statistics(); the log gets one line per interval
_drops = RateLimitedLog(log)


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
    auth_refused: int
    casts_resent: int
    death_notices: int
    replies_dropped: int
    replies_refused: int
    frames_refused: int
    sends_dropped: int


def current_runtime() -> Runtime:
    """The runtime of the calling task.

    Raises:
        RuntimeError: no runtime is active (outside ``amesh.run`` / ``ProcMesh``).
    """
    rt = runtime_var.get()
    if rt is None or rt.links.closed:  # (closed, without the property's call)
        raise RuntimeError(
            "no amesh runtime is active here: use this inside `async with ProcMesh(...)`, "
            "`amesh.run(main)`, or through what amesh's awaitables do outside them (the "
            "session: `await procs.spawn(...)`, `.get()`)"
        )
    return rt


class Runtime:
    """Routes frames between the transport, pending calls and local actors."""

    def __init__(self, transport: Transport, tg: TaskGroup) -> None:
        self.transport = transport
        self.address = transport.address
        self.pid = os.getpid()
        self._tg = tg
        #: the thread of the runtime's event loop (made there), and how another thread
        #: (``asyncio.to_thread``'s, whose context has this runtime) schedules on it
        self.thread = threading.get_ident()
        self.call_soon_threadsafe = call_soon_threadsafe()
        #: the body's cancel scope (see open_runtime); None for a bare runtime
        self.body: anyio.CancelScope | None = None
        #: the event loop's own Event class (cheaper than anyio's on the hot path)
        self.new_event = native_event_class()
        self.calls = Calls(native_waiter())  # one waiter per pending call that waits
        self.peers = Peers(self.calls)  # the only writer of who is dead
        self.links = Links(
            transport, self._route_own, self.start_soon, self.peers.dead, self.new_event
        )
        self.router = Router(self.calls, self.links, self.peers.dead)
        self.peers.connect(self.router, self.links)
        self.relays = Relays(self.calls, self.links)
        self.dispatch = Dispatch(self.links, self.start_soon)
        #: printers of the output of the workers this runtime supervises
        self.outputs = Outputs()
        #: broken links reported outside any task (a loop callback), for _serve_lost
        self._lost: deque[tuple[str, str]] = deque()
        self._lost_wake: Any = None
        transport.set_lost_handler(self._link_lost)
        #: what a Ready with a given token goes to (see :meth:`expect_ready`)
        self._ready_waiters: dict[str, Callable[[_wire.Ready], None]] = {}
        #: actor key -> what to do with a failure report from ``peer``
        self._failure_handlers: dict[str, Callable[[_wire.FailureReport, str], None]] = {}
        #: meshes (and what they need) started outside any actor: the controller's own
        self._owned: list[Owned] = []
        #: unhandled failures of those meshes; they cancel the runtime's body
        self.root_failures: list[Failure] = []
        #: instead of cancelling the body, what to do with such a failure (the
        #: session's runtime has no body to cancel: it prints them)
        self.on_root_failure: Callable[[Failure], None] | None = None
        #: inbound frames by envelope type -> the part (or method) that takes them;
        #: a call and a reply may also come from this process itself
        self._routes: dict[type[_wire.Envelope], Callable[[Any, list[Any], str], None]] = {
            _wire.Reply: self._on_reply,
            _wire.Error: self._on_reply,
            _wire.Call: self._on_request,
            _wire.Cast: self._on_request,
            _wire.Relay: self._on_relay,
            _wire.Gathered: self._on_gathered,
            _wire.Credit: self._on_credit,
            _wire.Cancel: self._on_cancel,
            _wire.Prune: self._on_prune,
            _wire.Ready: self._on_ready,
            _wire.FailureReport: self._on_failure,
            _wire.Heartbeat: self._on_heartbeat,
            _wire.Died: self._on_died,
            _wire.Output: self._on_output,
        }
        self._frames_dropped = 0
        #: replies to calls no longer open (late, after a timeout or cancel)
        self._late = 0
        #: frames whose sender field names another process than the one that sent them
        self._refused = 0
        self._bad_version = 0

    @property
    def closed(self) -> bool:
        return self.links.closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self.links.closed = value

    def next_id(self) -> int:
        return self.calls.next_id()

    def _link_lost(self, addr: str, why: str) -> None:
        """The transport says the link to ``addr`` broke. Handled at once inside a
        task; from a bare loop callback (an NNG pipe event), in :meth:`_serve_lost`,
        since what it starts needs a task's context."""
        try:
            sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            self._lost.append((addr, why))
            if self._lost_wake is not None:
                self._lost_wake.set()
            return
        self.peers.link_lost(addr, why)

    async def _serve(self, transport: Transport) -> None:
        """Deliver what ``transport`` receives until it closes; one that
        :meth:`listen_instead` replaced ends quietly."""
        try:
            await transport.serve(self.deliver)
        except TransportClosed:
            if transport is self.transport:
                raise

    def listen_instead(self, transport: Transport) -> None:
        """Take ``transport`` (listening) as this runtime's own, in place of the one it
        was opened with (closed): a controller that learns only at :func:`amesh.attach`
        that other machines must reach it. The address is the process's identity in
        every frame, so it can change only while no other process knows it.

        Raises:
            RuntimeError: this runtime sent or received a frame already, or holds
                actors; the message names its address.
        """
        used = self.transport.statistics()
        if used.frames_sent or used.frames_received or self.dispatch.actors or self._owned:
            transport.close()
            raise RuntimeError(
                f"this controller listens at {self.address}, which other machines cannot "
                "reach, and processes of this machine know it already: call amesh.attach "
                "before starting anything else, or start the controller with "
                "AMESH_TRANSPORT=tcp (or tls+tcp) and AMESH_HOST=<its address on their "
                "network>"
            )
        old, self.transport = self.transport, transport
        self.address = transport.address
        self.links.use(transport)
        transport.set_lost_handler(self._link_lost)
        self._tg.start_soon(self._serve, transport)
        old.close()

    async def _serve_lost(self) -> None:
        while True:
            while self._lost:
                self.peers.link_lost(*self._lost.popleft())
            self._lost_wake = self.new_event()
            if not self._lost:
                await self._lost_wake.wait()
            self._lost_wake = None

    def statistics(self) -> RuntimeStats:
        t = self.transport.statistics()
        return RuntimeStats(
            address=self.address,
            frames_dropped=self._frames_dropped,
            duplicates_dropped=self.dispatch.duplicates,
            bad_version=self._bad_version,
            calls_sent=self.calls.sent,
            calls_pending=len(self.calls.pending),
            actors=len(self.dispatch.actors),
            frames_sent=t.frames_sent,
            frames_received=t.frames_received,
            relayed=self.relays.relayed,
            gathers=len(self.relays.gathers),
            credit_waits=self.links.credit_waits,
            heartbeats_received=self.peers.heartbeats_received,
            auth_refused=t.auth_refused,
            casts_resent=self.router.resent,
            death_notices=self.peers.notices,
            replies_dropped=self._late,
            replies_refused=self.calls.refused + self.relays.refused,
            frames_refused=self._refused,
            sends_dropped=self.links.dropped,
        )

    @property
    def task_group(self) -> TaskGroup:
        """The runtime's own service task group (lives as long as the runtime)."""
        return self._tg

    def start_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in the runtime's own task group."""
        self._tg.start_soon(fn, *args)

    # -- sending (see Links and Router) ---------------------------------------------------

    async def send_frame(
        self, addr: str, env: _wire.Envelope, buffers: list[Any] | None = None
    ) -> None:
        """Encode and send; a vanished peer is not an error for the sender."""
        await self.links.send(addr, env, buffers)

    def send_frame_nowait(
        self, addr: str, env: _wire.Envelope, buffers: list[Any] | None = None
    ) -> None:
        """Send without waiting, in order behind what waits for ``addr``."""
        self.links.send_nowait(addr, env, buffers)

    def taken(self, sender: str, actor: str, nbytes: int) -> None:
        """A cast from ``sender`` left ``actor``'s mailbox (see :meth:`Links.taken`)."""
        self.links.taken(sender, actor, nbytes)

    def cancel_requests(self, waits: Iterable[tuple[str, int]]) -> None:
        """Ask the ranks (and relays) where a closed call still waits, as
        :meth:`Calls.close` returns them, to stop."""
        for addr, request_id in waits:
            if addr not in self.peers.dead:
                self.links.send_nowait(addr, _wire.Cancel(self.address, request_id))

    async def send_casts(
        self,
        actor: str,
        targets: dict[int, str],
        method: str,
        labels: list[str],
        sizes: list[int],
        payload: Payloads,
        tree: Tree | None = None,
        deadline: float = math.inf,
    ) -> None:
        """Send a cast to each target (down ``tree``); see :meth:`Router.send_casts`."""
        await self.router.send_casts(actor, targets, method, labels, sizes, payload, tree, deadline)

    # -- failures -----------------------------------------------------------------------

    def peer_failed(self, addr: str, why: Failure, announce: bool = False) -> None:
        """The process at ``addr`` is gone (see :meth:`Peers.failed`)."""
        self.peers.failed(addr, why, announce)

    def fail_root(self, failure: Failure) -> None:
        """An unhandled failure reached the top of this process: cancel its body."""
        if self.on_root_failure is not None:
            self.on_root_failure(failure)
            return
        self.root_failures.append(failure)
        if self.body is not None:
            self.body.cancel()
        else:
            self._tg.cancel_scope.cancel()

    async def report_failure(self, owner: str, failure: _wire.FailureReport) -> None:
        """Tell ``owner`` that an actor here failed."""
        if owner == self.address:
            self._on_failure(failure, [], self.address)
        else:
            await self.send_frame(owner, failure)

    def handle_failures(
        self, actor: str, handler: Callable[[_wire.FailureReport, str], None] | None
    ) -> None:
        """Failure reports of actor mesh ``actor`` go to ``handler(report, peer)`` from
        now on (None: nobody's; a report that comes then is dropped and logged)."""
        if handler is None:
            self._failure_handlers.pop(actor, None)
        else:
            self._failure_handlers[actor] = handler

    def own(self, owned: Owned, first: bool = False) -> None:
        """Stop ``owned`` at this runtime's exit, in reverse order of owning (``first``:
        stopped after everything owned so far and later)."""
        if first:
            self._owned.insert(0, owned)
        else:
            self._owned.append(owned)

    def disown(self, owned: Owned) -> None:
        """``owned`` was stopped already (or is stopped by somebody else)."""
        if owned in self._owned:
            self._owned.remove(owned)

    def expect_ready(self, token: str, waiter: Callable[[_wire.Ready], None] | None) -> None:
        """The first :class:`~amesh._wire.Ready` with ``token`` goes to ``waiter`` (None:
        nothing waits for it any more)."""
        if waiter is None:
            self._ready_waiters.pop(token, None)
        else:
            self._ready_waiters[token] = waiter

    def _on_failure(self, failure: _wire.FailureReport, buffers: list[Any], peer: str) -> None:
        handler = self._failure_handlers.get(failure.actor)
        if handler is None:
            self._frames_dropped += 1
            _drops.warning(
                "unowned failure of actor %s rank %d from %s: %s",
                failure.actor,
                failure.rank,
                peer,
                failure.cause,
            )
            return
        handler(failure, peer)

    # -- local actors -------------------------------------------------------------------

    def add_actor(self, inst: ActorInstance) -> None:
        """Start ``inst`` here (see :meth:`Dispatch.add`)."""
        self.dispatch.add(inst)
        self._tg.start_soon(inst.run)

    def remove_actor(self, key: str) -> ActorInstance | None:
        """Unregister an actor (stop it with :meth:`ActorInstance.stop`)."""
        return self.dispatch.remove(key)

    # -- inbound ----------------------------------------------------------------------

    def deliver(self, frame: bytes | memoryview, peer: str) -> None:
        """Route one inbound frame from ``peer`` (the address its sender proved it
        speaks for). Never raises: bad frames are dropped and counted."""
        got = _wire.try_decode(frame)
        if got is None:
            got = self._undecodable(frame, peer)
            if got is None:
                return
        env, buffers = got
        try:
            self._routes[type(env)](env, buffers, peer)
        except Exception as exc:  # a router bug must not take the process down
            self._frames_dropped += 1
            # (the traceback formatted only for a line that is logged: a bug that
            # fails every frame of a kind must not also cost a traceback each)
            _drops.warning(
                "failed to route %s from %s: %s", type(env).__name__, peer, _Formatted(exc)
            )

    def _undecodable(
        self, frame: bytes | memoryview, peer: str
    ) -> tuple[_wire.Envelope, list[Any]] | None:
        """A frame that :func:`_wire.try_decode` did not take: dropped and counted, and a
        call in another protocol version answered; None. (What decodes after all,
        which only a broken extension would cause, is returned.)"""
        try:
            return _wire.decode(frame)
        except _wire.BadFrame as exc:
            self._frames_dropped += 1
            _drops.warning("dropped a malformed frame of %d bytes: %s", len(frame), exc)
            return None
        except _wire.BadVersion as exc:
            self._bad_version += 1
            msg = (
                f"protocol version {exc.version} is not supported by this runtime "
                f"(it speaks version {_wire.VERSION})"
            )
            _drops.warning("dropped a frame: %s", msg)
            if exc.sender == peer:  # a direct call from the peer: answer it
                self.dispatch.reply_error(peer, exc.call_id, exc.rank, ProtocolError, msg)
        return None

    def _route_own(self, env: _wire.Envelope, buffers: list[Any]) -> None:
        """Route a frame this process sent to itself."""
        self._routes[type(env)](env, buffers, self.address)

    def _refuse(self, env: _wire.Envelope, claimed: str, peer: str) -> None:
        """Drop a frame that speaks for ``claimed`` but came from ``peer``."""
        self._refused += 1
        _drops.warning(
            "dropped a %s from %s that claims to come from %s", type(env).__name__, peer, claimed
        )

    # -- the routes (see _routes): one per envelope type ----------------------------------

    def _on_reply(
        self, env: _wire.Reply | _wire.Error, buffers: list[Any], peer: str, cid: int = 0
    ) -> None:
        """A reply for call ``cid`` (its own ``call_id`` unless given): to the call, a
        relay's gather, or late."""
        if not cid:
            cid = env.call_id
        if self.calls.on_reply(env, buffers, cid, peer):
            if self.outputs.holding:
                pending = self.calls.pending.get(cid)
                if pending is not None and not pending.targets:
                    # the call's last reply: what its handlers printed is shown first
                    self.outputs.release()
        elif not self.relays.on_reply(env, buffers, cid, peer):
            self._late += 1
            if isinstance(env, _wire.Reply):
                # nobody will load it: its shared-memory segments go now
                _wire.discard_segments(env.payload, buffers)

    def _on_request(self, env: _wire.Call | _wire.Cast, buffers: list[Any], peer: str) -> None:
        # A request may have come down the relay tree: its sender is the caller, not
        # the peer that passed it on.
        dispatch = self.dispatch
        if not dispatch.is_duplicate(env.sender, env.call_id):
            dispatch.accept(env, buffers)

    def _on_relay(self, env: _wire.Relay, buffers: list[Any], peer: str) -> None:
        if not self.dispatch.is_duplicate(env.sender, env.call_id):
            self.relays.relay(env, buffers, self.dispatch.accept)

    def _on_gathered(self, env: _wire.Gathered, buffers: list[Any], peer: str) -> None:
        pos = 0
        for item in env.replies:
            n = len(item.buffers) if isinstance(item, _wire.Reply) else 0
            # a reply in a Gathered keeps the id of the relay's gather
            self._on_reply(item, buffers[pos : pos + n], peer, env.call_id)
            pos += n

    def _on_credit(self, env: _wire.Credit, buffers: list[Any], peer: str) -> None:
        # credit and probes come straight from the process they speak for
        if env.addr != peer:
            self._refuse(env, env.addr, peer)
        elif env.count < 0:
            self.links.on_probe(env, env.actor in self.dispatch.actors)
        else:
            count = self.links.on_credit(env)
            self.router.credited(env.addr, env.actor, count)

    def _on_cancel(self, env: _wire.Cancel, buffers: list[Any], peer: str) -> None:
        # a cancel comes straight from the caller, also to the relays
        if env.sender != peer:
            self._refuse(env, env.sender, peer)
            return
        key = (env.sender, env.call_id)
        self.dispatch.cancel(key, relayed=self.relays.cancel(key))

    def _on_prune(self, env: _wire.Prune, buffers: list[Any], peer: str) -> None:
        if env.sender != peer:
            self._refuse(env, env.sender, peer)
            return
        self.relays.prune(env)

    def _on_ready(self, env: _wire.Ready, buffers: list[Any], peer: str) -> None:
        if env.addr != peer:
            self._refuse(env, env.addr, peer)
            return
        waiter = self._ready_waiters.pop(env.token, None)
        if waiter is not None:
            waiter(env)
            self.outputs.started(env.addr)

    def _on_heartbeat(self, env: _wire.Heartbeat, buffers: list[Any], peer: str) -> None:
        if env.addr != peer:
            self._refuse(env, env.addr, peer)
            return
        self.peers.on_heartbeat(env)

    def _on_died(self, env: _wire.Died, buffers: list[Any], peer: str) -> None:
        if not self.peers.on_notice(env, peer):
            self._refused += 1
            _drops.warning("dropped a death notice for %s from %s", env.addr, peer)

    def _on_output(self, env: _wire.Output, buffers: list[Any], peer: str) -> None:
        # only from a process this runtime supervises (it has a printer)
        if not self.outputs.deliver(env, peer):
            self._refused += 1
            _drops.warning("dropped the output of %s, which is not supervised here", peer)


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

    The body runs in a cancel scope of its own inside the runtime's service task
    group: an unhandled failure cancels the body, never the receiving.

    Args:
        transport_factory: makes the transport (listening) when entered.
    """

    def __init__(self, transport_factory: Callable[[], Transport]) -> None:
        self._factory = transport_factory
        self._tg: TaskGroup | None = None
        self._rt: Runtime | None = None
        self._token: Any = None
        self._library: Any = None

    async def __aenter__(self) -> Runtime:
        global _open_runtimes
        # Say which library runs this context, as anyio.run does, where nothing did
        # (a bare asyncio loop: asyncio.run, a notebook's): sniffio then knows only
        # inside a task, and the transport's protocol callbacks, whose contexts are
        # copies of this one, could not use anyio (a heartbeat's arrival went
        # unrecorded, and every worker was failed for silence after heartbeat_timeout).
        if sniffio.current_async_library_cvar.get() is None:
            self._library = sniffio.current_async_library_cvar.set(sniffio.current_async_library())
        try:
            transport = self._factory()
        except BaseException:
            self._forget_library()
            raise
        _open_runtimes += 1
        tg = anyio.create_task_group()
        await tg.__aenter__()
        rt = Runtime(transport, tg)
        tg.start_soon(rt._serve, transport)
        tg.start_soon(rt._serve_lost)
        rt.body = anyio.CancelScope()
        rt.body.__enter__()
        self._tg, self._rt = tg, rt
        self._token = runtime_var.set(rt)
        return rt

    def _forget_library(self) -> None:
        if self._library is not None:
            try:
                sniffio.current_async_library_cvar.reset(self._library)
            except ValueError:  # left in another context than it was entered in
                pass
            self._library = None

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._tg is not None and self._rt is not None
        rt = self._rt
        assert rt.body is not None
        # Leave the body's scope first: a cancel of the body (a root failure) stops
        # here, and the teardown below runs uncancelled while we still receive.
        body_cancelled = rt.body.cancel_called
        try:
            swallowed = rt.body.__exit__(*exc)
        except BaseException as raised:
            exc = (type(raised), raised, raised.__traceback__)
            swallowed = False
        if swallowed:
            exc = (None, None, None)
        with anyio.CancelScope(shield=True):
            owned, rt._owned = rt._owned, []
            for res in reversed(owned):
                try:
                    await res.stop()
                except Exception:
                    log.exception("stopping a mesh at runtime exit")
        runtime_var.reset(self._token)
        rt.closed = True
        for inst in list(rt.dispatch.actors.values()):
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
                _wire.release_segments()
            self._forget_library()
        suppressed = suppressed or swallowed
        if rt.root_failures and (
            exc[1] is None or suppressed or body_cancelled or is_supervision(exc[1])
        ):
            failures = list(rt.root_failures)
            raise SupervisionError(
                f"{len(failures)} unhandled supervision failure(s): "
                + "; ".join(str(f).splitlines()[0] for f in failures),
                failures,
            ) from None  # not the body's cancellation: that is how the failure stopped it
        return suppressed


class _Formatted:
    """An exception's traceback, formatted when it is printed."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def __str__(self) -> str:
        return "".join(traceback.format_exception(self._exc))


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
