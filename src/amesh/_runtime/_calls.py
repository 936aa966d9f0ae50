"""Outgoing calls: the replies each one waits for, and how many are in flight where."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Collection, Sequence
from typing import Any

from .. import _wire
from .._errors import Failure, SupervisionError
from .._ratelog import RateLimitedLog
from ._context import native_waiter

__all__ = ["Calls", "Pending", "rank_label"]

#: where a call that every rank answered still waits: nowhere (one for all calls)
_NOWHERE: tuple[tuple[str, int], ...] = ()

_refusals = RateLimitedLog(logging.getLogger("amesh.runtime"))


class Pending:
    """Replies to one outgoing call, in arrival order.

    Items are ``(rank, ok, value)``: ``value`` is the reply's ``(payload, buffers)``
    (what :func:`amesh._wire.loads` takes) when ``ok``, else the exception to raise.
    """

    __slots__ = (
        "_event", "_new_event", "actor", "call_id", "ids", "items", "payload", "relays",
        "size", "slots", "targets", "via",
    )  # fmt: skip

    def __init__(
        self,
        call_id: int,
        actor: str,
        targets: dict[int, str],
        new_event: Any = None,
        slots: Sequence[int] = (),
    ) -> None:
        self.call_id = call_id
        self.actor = actor
        #: the rank in the whole actor mesh of each called rank (empty: the same)
        self.slots = slots
        #: rank -> address for every rank that has not answered yet
        self.targets = targets
        #: how many ranks the call went to
        self.size = len(targets)
        self.items: deque[tuple[int, bool, Any]] = deque()
        self._event: Any = None
        self._new_event = new_event or native_waiter()
        #: the relays the call went through, and the relays on each rank's path
        self.relays: set[str] = set()
        self.via: dict[int, tuple[str, ...]] = {}
        #: rank -> id of the request it got, when each rank got its own (a scattered
        #: call, see :meth:`request_id`); its replies still come for ``call_id``
        self.ids: dict[int, int] = {}
        #: the call's arguments, while they have shared-memory segments
        self.payload: _wire.Payload | None = None

    def push(self, rank: int, ok: bool, value: Any) -> None:
        if self.targets.pop(rank, None) is None:
            return  # duplicate or unexpected: every rank answers at most once
        self.items.append((rank, ok, value))
        event = self._event
        if event is not None:
            self._event = None
            if not event.done():  # (its waiter was cancelled)
                event.set_result(None)

    def request_id(self, rank: int) -> int:
        """The id of the request that ``rank`` got (which a cancel names)."""
        return self.ids.get(rank, self.call_id)

    def cancels(self) -> set[tuple[str, int]]:
        """``(address, request id)`` for each rank that has not answered, and each relay
        still gathering for one: what to cancel when the call ends early."""
        if not self.ids:
            return {(a, self.call_id) for a in (*self.targets.values(), *self.relays)}
        out = set()
        for rank, addr in self.targets.items():
            rid = self.ids[rank]
            out.add((addr, rid))
            out.update((relay, rid) for relay in self.via.get(rank, ()))
        return out

    def mesh_rank(self, rank: int) -> int:
        """The rank in the whole actor mesh of called rank ``rank``."""
        return self.slots[rank] if self.slots else rank

    def where(self, rank: int) -> str:
        """How messages name called rank ``rank`` (see :func:`rank_label`)."""
        return rank_label(self.mesh_rank(rank), rank)

    def arrival(self) -> Awaitable[Any]:
        """What to await (once, with no reply in :attr:`items`) until one arrives
        (no coroutine of its own)."""
        waiting: Awaitable[Any] = self._new_event()
        self._event = waiting
        return waiting


def rank_label(whole: int, rank: int) -> str:
    """``"rank 5"``, or ``"rank 5 (rank 1 of the called slice)"`` for rank 1 of a slice
    that is rank 5 of the whole mesh."""
    return f"rank {whole}" + (f" (rank {rank} of the called slice)" if whole != rank else "")


def mesh_name(actor_key: str) -> str:
    """The actor mesh's name from its key (``NAME-<12 hex digits>``)."""
    name, _, tag = actor_key.rpartition("-")
    return name if name and len(tag) == 12 else actor_key


class Calls:
    """Every call this runtime has in flight, by id; ``new_event`` makes the waiter
    of a call that waits for a reply (see :func:`~amesh._runtime._context.native_waiter`)."""

    def __init__(self, new_event: Any) -> None:
        self._ids = itertools.count(1)
        self._new_event = new_event
        self.pending: dict[int, Pending] = {}
        #: (address, actor key) -> calls this runtime has in flight there
        self.inflight: dict[tuple[str, str], int] = {}
        self.sent = 0
        #: replies dropped because they came from a peer the call did not go to
        self.refused = 0

    def next_id(self) -> int:
        return next(self._ids)

    def open(self, actor: str, targets: dict[int, str], slots: Sequence[int] = ()) -> Pending:
        """Register a call before its requests go out, so no reply can be missed.

        ``slots`` gives the rank in the whole actor mesh of each called rank, for
        messages (empty when the call is to the whole mesh)."""
        pending = Pending(next(self._ids), actor, dict(targets), self._new_event, slots)
        self.pending[pending.call_id] = pending
        for addr in targets.values():
            k = (addr, actor)
            self.inflight[k] = self.inflight.get(k, 0) + 1
        return pending

    def close(self, pending: Pending) -> Collection[tuple[str, int]]:
        """Forget ``pending``; returns where it still waits, as ``(address, request
        id)`` of ranks and relays (see :meth:`Pending.cancels`)."""
        self.pending.pop(pending.call_id, None)
        targets = pending.targets
        if not targets:  # every rank answered (the common case)
            if pending.items or pending.payload is not None:
                self._drop(pending)
            return _NOWHERE
        for addr in targets.values():
            self.dec_inflight(addr, pending.actor)
        out = pending.cancels()
        targets.clear()
        self._drop(pending)
        return out

    def _drop(self, pending: Pending) -> None:
        """Let go of what ``pending`` still holds: replies nobody read, arguments."""
        # Replies nobody will read (the call ended early), and the arguments' segments
        # (a receiver that has not loaded them by now never will).
        for _, ok, value in pending.items:
            if ok:
                _wire.discard_segments(*value)
        pending.items.clear()
        if pending.payload is not None:
            _wire.release_payload(pending.payload)
            pending.payload = None

    def in_flight(self, addr: str, actor: str) -> int:
        """How many calls to ``actor`` at ``addr`` wait for their reply."""
        return self.inflight.get((addr, actor), 0)

    def dec_inflight(self, addr: str, actor: str) -> None:
        k = (addr, actor)
        n = self.inflight.get(k, 0) - 1
        if n > 0:
            self.inflight[k] = n
        else:
            self.inflight.pop(k, None)

    def fail_rank(self, pending: Pending, rank: int, why: Failure, msg: str | None = None) -> None:
        """``rank`` of ``pending`` will never answer, because of ``why``."""
        addr = pending.targets.get(rank)
        if addr is None:
            return
        self.dec_inflight(addr, pending.actor)
        if why.rank < 0:
            # A death learnt without its place in a mesh (a lost connection): name
            # it by the called mesh and rank, which the caller knows.
            why = Failure(
                f"actor {mesh_name(pending.actor)!r}",
                pending.mesh_rank(rank),
                why.pid,
                why.cause,
                host=why.host,
            )
        pending.push(rank, False, SupervisionError(msg or str(why), [why]))

    def fail_addr(self, addr: str, why: Failure) -> None:
        """Fail every call's ranks at ``addr``."""
        for pending in list(self.pending.values()):
            for rank, a in list(pending.targets.items()):
                if a == addr:
                    self.fail_rank(pending, rank, why)

    def on_reply(
        self, env: _wire.Reply | _wire.Error, buffers: list[Any], call_id: int, peer: str
    ) -> bool:
        """A reply for call ``call_id`` from the process at ``peer``; False when no such
        call is open.

        A reply counts only when it comes from where the call went for its rank: the
        rank's own process, or the first relay on its path. Anything else (a forged or
        misdirected reply) is dropped and counted in :attr:`refused`.
        """
        pending = self.pending.get(call_id)
        if pending is None:
            return False
        addr = pending.targets.get(env.rank)
        if addr is None:
            return True
        path = pending.via.get(env.rank)
        if peer != (path[0] if path else addr):
            self.refused += 1
            _refusals.warning(
                "dropped a reply for call %d rank %d from %s, which the call did not go to",
                call_id,
                env.rank,
                peer,
            )
            return True
        self.dec_inflight(addr, pending.actor)
        if type(env) is _wire.Reply:
            pending.push(env.rank, True, (env.payload, buffers))
        else:
            pending.push(env.rank, False, env)
        return True
