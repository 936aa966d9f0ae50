"""Outgoing calls: the replies each one waits for, and how many are in flight where."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

from .. import _wire
from .._errors import Failure, SupervisionError
from ._context import native_event_class

__all__ = ["Calls", "Pending"]


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


def mesh_name(actor_key: str) -> str:
    """The actor mesh's name from its key (``NAME-<12 hex digits>``)."""
    name, _, tag = actor_key.rpartition("-")
    return name if name and len(tag) == 12 else actor_key


class Calls:
    """Every call this runtime has in flight, by id."""

    def __init__(self, new_event: Any) -> None:
        self._ids = itertools.count(1)
        self._new_event = new_event
        self.pending: dict[int, Pending] = {}
        #: (address, actor key) -> calls this runtime has in flight there
        self.inflight: dict[tuple[str, str], int] = {}
        self.sent = 0

    def next_id(self) -> int:
        return next(self._ids)

    def open(self, actor: str, targets: dict[int, str]) -> Pending:
        """Register a call before its requests go out, so no reply can be missed."""
        pending = Pending(self.next_id(), actor, dict(targets), self._new_event)
        self.pending[pending.call_id] = pending
        for addr in targets.values():
            k = (addr, actor)
            self.inflight[k] = self.inflight.get(k, 0) + 1
        return pending

    def close(self, pending: Pending) -> set[str]:
        """Forget ``pending``; returns where it still waits (ranks and relays)."""
        self.pending.pop(pending.call_id, None)
        for addr in pending.targets.values():
            self.dec_inflight(addr, pending.actor)
        waiting = set(pending.targets.values()) | pending.relays
        pending.targets.clear()
        return waiting

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
                f"actor {mesh_name(pending.actor)!r}", rank, why.pid, why.cause, host=why.host
            )
        pending.push(rank, False, SupervisionError(msg or str(why), [why]))

    def fail_addr(self, addr: str, why: Failure) -> None:
        """Fail every call's ranks at ``addr``."""
        for pending in list(self.pending.values()):
            for rank, a in list(pending.targets.items()):
                if a == addr:
                    self.fail_rank(pending, rank, why)

    def on_reply(self, env: _wire.Reply | _wire.Error, buffers: list[Any], call_id: int) -> bool:
        """A reply for call ``call_id``; False when no such call is open."""
        pending = self.pending.get(call_id)
        if pending is None:
            return False
        addr = pending.targets.get(env.rank)
        if addr is None:
            return True
        self.dec_inflight(addr, pending.actor)
        if isinstance(env, _wire.Reply):
            pending.push(env.rank, True, _wire.unpack(env.payload, buffers))
        else:
            pending.push(env.rank, False, env)
        return True
