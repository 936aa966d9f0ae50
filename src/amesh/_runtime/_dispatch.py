"""Requests for this process's actors: dedup, mailboxes, cancellation, deadlocks."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import anyio

from .. import _wire
from .._errors import DeadlockError
from .._ratelog import RateLimitedLog
from ._links import Links
from ._mailbox import ActorInstance, type_name_of
from ._pausable import LazyScope

__all__ = ["Dispatch"]

log = logging.getLogger("amesh.runtime")
#: a peer may send calls that are refused by the thousand: one line per interval
_refusals = RateLimitedLog(log)

#: How many recent requests are remembered to drop duplicates: the last half of this
#: at least, all of it at most.
_RECENT = 65536
#: How many stopped actors are remembered, to say why a request finds none.
_GONE = 1024


class Dispatch:
    """The actors of this process and the requests they are handling."""

    def __init__(self, links: Links, spawn: Callable[..., None]) -> None:
        self._links = links
        self._spawn = spawn
        self.pid = os.getpid()
        self._actors: dict[str, ActorInstance] = {}
        #: the actors of this process by key (read-only: see :meth:`add`, :meth:`remove`)
        self.actors: Mapping[str, ActorInstance] = MappingProxyType(self._actors)
        #: why recently stopped actors are gone, by key (see :meth:`gone`)
        self._gone: OrderedDict[str, str] = OrderedDict()
        #: (sender, call_id) of requests being handled, and their cancel scopes
        self._running: dict[tuple[str, int], LazyScope] = {}
        #: requests sitting in a mailbox, and those of them cancelled before they ran
        self._queued: set[tuple[str, int]] = set()
        self._cancelled: set[tuple[str, int]] = set()
        #: call ids of recent requests by sender, to drop duplicated frames: the
        #: newer generation, and the one before it. Ids count up, so each set's keys
        #: lie close together in memory, and forgetting is dropping a generation,
        #: not a request at a time.
        self._recent: dict[str, set[int]] = {}
        self._older: dict[str, set[int]] = {}
        self._recent_count = 0
        self.duplicates = 0

    def add(self, inst: ActorInstance) -> None:
        """Take requests for ``inst`` from now on.

        Raises:
            ValueError: an actor with its key lives here already.
        """
        if inst.key in self._actors:
            raise ValueError(f"an actor with key {inst.key!r} already lives here")
        self._actors[inst.key] = inst

    def remove(self, key: str) -> ActorInstance | None:
        """Take no more requests for actor ``key``; returns it, if it lived here."""
        return self._actors.pop(key, None)

    def start(self, key: tuple[str, int]) -> bool:
        """Request ``key`` leaves its mailbox to run: False if it was cancelled while it
        waited there (it runs nothing then)."""
        self._queued.discard(key)
        if key in self._cancelled:
            self._cancelled.discard(key)
            return False
        return True

    def drop_if_cancelled(self, key: tuple[str, int]) -> bool:
        """True (and the request is forgotten) if request ``key``, still queued, was
        cancelled; it stays queued otherwise, so a later cancel still finds it."""
        if key in self._cancelled:
            self._queued.discard(key)
            self._cancelled.discard(key)
            return True
        return False

    def unqueue(self, key: tuple[str, int]) -> None:
        """Request ``key`` leaves its mailbox without running (its actor failed)."""
        self._queued.discard(key)

    def running(self, key: tuple[str, int], scope: LazyScope) -> None:
        """Request ``key`` runs in ``scope``, where a cancel finds it."""
        self._running[key] = scope

    def ended(self, key: tuple[str, int]) -> None:
        """Request ``key`` (one that registered a scope) ended."""
        self._running.pop(key, None)

    def seen(self, sender: str, call_id: int) -> bool:
        """Whether request ``call_id`` of ``sender`` came recently."""
        ids = self._recent.get(sender)
        if ids is not None and call_id in ids:
            return True
        ids = self._older.get(sender)
        return ids is not None and call_id in ids

    def is_duplicate(self, sender: str, call_id: int) -> bool:
        """True if this request was seen already (at most once: it runs nothing);
        else remember it."""
        recent = self._recent.get(sender)
        if recent is None:
            recent = self._recent[sender] = set()
        elif call_id in recent:
            self.duplicates += 1
            return True
        older = self._older.get(sender)
        if older is not None and call_id in older:
            self.duplicates += 1
            return True
        recent.add(call_id)
        self._recent_count += 1
        if self._recent_count >= _RECENT // 2:  # a new generation; the oldest goes
            self._older, self._recent, self._recent_count = self._recent, {}, 0
        return False

    def accept(self, env: _wire.Call | _wire.Cast, buffers: list[Any]) -> None:
        """Queue a request for a local actor, or answer why it cannot run."""
        inst = self._actors.get(env.actor)
        if inst is None:
            why = self._gone.get(env.actor)  # (stopped or replaced: says which mesh)
            self._decline(env, why or f"no actor {env.actor!r} is running in process {self.pid}")
            return
        if inst.failed is not None:
            if isinstance(env, _wire.Cast):
                self._links.taken(env.sender, env.actor, _wire.payload_size(env))
            self._spawn(inst.refuse, env)
            return
        if isinstance(env, _wire.Call) and env.chain and self._deadlocks(inst, env):
            return
        try:
            if inst.put(env, buffers):  # (one that ran at once never was in the mailbox)
                self._queued.add((env.sender, env.call_id))
        except anyio.ClosedResourceError:  # the actor is stopping: it takes nothing more
            self._decline(env, f"actor {env.actor!r} is stopping in process {self.pid}")

    def gone(self, key: str, why: str) -> None:
        """Actor ``key`` was stopped: requests that still come for it are answered
        with ``why`` (for the most recent :data:`_GONE` of them)."""
        self._gone[key] = why
        if len(self._gone) > _GONE:
            self._gone.popitem(last=False)

    def _decline(self, env: _wire.Call | _wire.Cast, why: str) -> None:
        """A request no actor here will run: a call is answered with a
        :data:`~amesh._wire.NO_ACTOR` error, a cast with a credit that says the actor
        is gone (its sender must not wait for it, and nothing is counted for it)."""
        if isinstance(env, _wire.Cast):
            self._links.declined(env.sender, env.actor)
        else:
            to, call_id = env.reply_to or env.sender, env.reply_id or env.call_id
            self.reply_error(to, call_id, env.rank, _wire.NO_ACTOR, why)

    def cancel(self, key: tuple[str, int], relayed: bool) -> None:
        """The sender cancelled request ``key`` (``relayed``: we were gathering it)."""
        scope = self._running.get(key)
        if scope is not None:
            scope.cancel()
        elif key in self._queued:
            self._cancelled.add(key)
        elif not relayed and not self.seen(*key):
            # The cancel overtook the request (it came down the relay tree): the
            # request, when it comes, is dropped like a duplicate.
            self.is_duplicate(*key)

    def reply_error(
        self, sender: str, call_id: int, rank: int, exc_type: type[BaseException] | str, msg: str
    ) -> None:
        """Answer call ``call_id`` of ``sender`` with an error (a type, or its name on
        the wire), if we can reach it."""
        name = exc_type if isinstance(exc_type, str) else type_name_of(exc_type)
        try:
            self._links.send_nowait(sender, _wire.Error(call_id, rank, name, msg, ""))
        except Exception as exc:  # one that cannot even be encoded
            self._links.drop("could not answer %r: %s", sender, exc)

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
        _refusals.warning("refused a call: %s", msg)
        self.reply_error(
            env.reply_to or env.sender, env.reply_id or env.call_id, env.rank, DeadlockError, msg
        )
        return True
