"""Outgoing requests: straight to each rank, or down the relay tree.

A call or cast to ranks behind a relay depends on that relay. When a relay dies:

- a call fails the ranks behind it at once (as a failure of the relay's rank), and
  the relays above are told to stop waiting for them;
- a cast (broadcast) is sent again, around the dead relay, to every rank behind it
  that has not yet confirmed it by credit. Receivers drop a request they have seen
  (by sender and call id), so a rank that did get it runs it once, and since the
  resend goes out before anything newer, per-sender order holds. The sender keeps
  each relayed cast until every rank behind a relay credited it, which flow control
  bounds by the send window.

A scattered request (each rank its own arguments: see :data:`Payloads`) cannot share
one frame down a subtree: it is one request per rank, each with its own id, down the
tree along that rank's own path, so it stays in order behind earlier requests to the
rank. A scattered call's requests all answer for the call's id (their ``reply_id``);
its cancels and prunes name each rank's own request. A scattered cast is sent again if
a relay on a rank's path dies, like any other.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import msgspec

from .. import _wire
from .._errors import Failure, SupervisionError
from .._wire import Payload
from ._calls import Calls, Pending
from ._context import call_context
from ._links import Links
from ._tree import Nodes, plan

__all__ = ["Payloads", "Router", "Tree"]

#: a request's arguments: one payload for every target, or one per target rank
Payloads: TypeAlias = Payload | Mapping[int, Payload]


class Tree(NamedTuple):
    """The relay tree of an actor mesh: its processes by slot, and the fan-out."""

    procs: Sequence[str]
    slots: Mapping[int, int]
    fanout: int
    #: processes per host, hosts first (0: one host); see :func:`~._tree.plan`
    group: int = 0


class _Relayed:
    """A cast that went through relays, kept until the ranks behind them credit it."""

    __slots__ = ("parts", "remaining", "req", "seqs", "tree", "via")

    def __init__(self, req: _wire.Relay, parts: list[Any], tree: Tree) -> None:
        self.req = req
        self.parts = parts
        self.tree = tree
        #: rank -> relays on its path, for ranks behind a relay
        self.via: dict[int, tuple[str, ...]] = {}
        #: rank -> (address, the cast's number among those sent there)
        self.seqs: dict[int, tuple[str, int]] = {}
        self.remaining = 0


class Router:
    """Sends calls and casts to their ranks, and handles the death of a relay."""

    def __init__(self, calls: Calls, links: Links, dead: Mapping[str, Failure]):
        self._calls = calls
        self._links = links
        self._dead = dead
        #: actor key -> relayed casts not yet credited by every rank behind a relay
        self._relayed: dict[str, deque[_Relayed]] = {}
        #: (address, actor key) -> (number, cast) of relayed casts awaiting its credit
        self._awaiting: dict[tuple[str, str], deque[tuple[int, _Relayed]]] = {}
        self.resent = 0

    @property
    def address(self) -> str:
        """This process's address (its links'), which requests name as their sender."""
        return self._links.address

    def _heads(
        self, targets: dict[int, str], tree: Tree | None, pending: Pending | None = None
    ) -> list[tuple[str, int, Nodes]]:
        """Where a message to ``targets`` goes first: each rank directly, or the heads
        of the relay tree with their subtrees (recorded in ``pending`` for a call)."""
        if tree is None:
            return [(addr, rank, []) for rank, addr in targets.items()]
        route = plan(
            {r: tree.slots[r] for r in targets}, tree.procs, tree.fanout, self._dead, tree.group
        )
        if pending is not None:
            pending.relays, pending.via = route.relays, route.via
        return route.heads

    def send_requests_soon(
        self,
        pending: Pending,
        method: str,
        labels: list[str],
        sizes: list[int],
        payload: Payloads,
        tree: Tree | None = None,
    ) -> Awaitable[None] | None:
        """Send the call of ``pending`` to each of its target ranks, down ``tree`` (a
        scattered call, with a payload per rank, as one request per rank).

        Returns None once every request is handed over, without a coroutine (the
        common case: each rank directly, each link taking its frame at once), else
        what to await until the rest are. The payloads' shared-memory segments are
        released when the call closes."""
        if isinstance(payload, Payload):
            if payload.segments:
                pending.payload = payload
        else:
            segments = [s for p in payload.values() for s in p.segments]
            if segments:
                pending.payload = Payload(b"", (), segments)  # every rank's, for release
        ctx = call_context.get()
        chain = ctx.chain if ctx is not None else []
        if self._dead and any(a in self._dead for a in pending.targets.values()):
            # All or nothing: a call that includes a dead rank fails at once and
            # reaches no rank at all.
            for rank, addr in list(pending.targets.items()):
                why = self._dead.get(addr)
                if why is not None:
                    self._calls.fail_rank(pending, rank, why)
                else:
                    del pending.targets[rank]
                    self._calls.dec_inflight(addr, pending.actor)
            return None
        if not isinstance(payload, Payload):
            return self._send_each(pending, method, labels, sizes, payload, chain, tree)
        parts = payload.parts
        call_id = pending.call_id
        me = self._links.address
        if tree is not None:
            req = _wire.Relay(
                me, call_id, -1, pending.actor, method, labels, sizes, payload.inline, chain,
                payload.lengths, me, call_id, [],
            )  # fmt: skip
            return self._send_down(req, parts, self._heads(pending.targets, tree, pending))
        # each rank directly (a call_one, a small mesh)
        # (a copy: ranks that answer while we wait for room leave pending.targets)
        ranks = list(pending.targets.items())
        for i, (rank, addr) in enumerate(ranks):
            call = _wire.Call(
                me, call_id, rank, pending.actor, method, labels, sizes, payload.inline,
                chain, payload.lengths, me, call_id,
            )  # fmt: skip
            waiting = self._links.send_soon(addr, call, parts)
            if waiting is not None:
                return self._send_rest(waiting, ranks[i + 1 :], call, parts)
            self._calls.sent += 1
        return None

    async def _send_rest(
        self,
        waiting: Awaitable[None],
        ranks: list[tuple[int, str]],
        call: _wire.Call,
        parts: list[Any],
    ) -> None:
        """The rest of :meth:`send_requests_soon`'s direct requests, once ``waiting``
        (a full link's) is done: ``call`` readdressed to each of ``ranks``."""
        await waiting
        self._calls.sent += 1
        for rank, addr in ranks:
            await self._links.send(addr, msgspec.structs.replace(call, rank=rank), parts)
            self._calls.sent += 1

    async def _send_down(
        self, req: _wire.Relay, parts: list[Any], heads: list[tuple[str, int, Nodes]]
    ) -> None:
        """Send ``req`` to each head of its relay tree, with the subtree it relays to."""
        for addr, rank, nodes in heads:
            await self._links.send(addr, _wire.addressed(req, rank, nodes), parts)
            self._calls.sent += 1

    async def _send_each(
        self,
        pending: Pending,
        method: str,
        labels: list[str],
        sizes: list[int],
        payloads: Mapping[int, Payload],
        chain: list[str],
        tree: Tree | None,
    ) -> None:
        """Send each target rank of ``pending`` its own payload, in a request of its
        own, along its own path down ``tree``; the replies come for the call's id."""
        # a copy: ranks that answer while we send leave pending.targets
        for rank, addr in list(pending.targets.items()):
            payload = payloads[rank]
            request_id = pending.ids[rank] = self._calls.next_id()
            req = _wire.Relay(
                self.address, request_id, -1, pending.actor, method, labels, sizes,
                payload.inline, chain, payload.lengths, self.address, pending.call_id, [],
            )  # fmt: skip
            heads: list[tuple[str, int, Nodes]] = [(addr, rank, [])]
            if tree is not None:
                route = plan(
                    {rank: tree.slots[rank]}, tree.procs, tree.fanout, self._dead, tree.group
                )
                heads = route.heads
                pending.relays |= route.relays
                pending.via.update(route.via)
            for head, head_rank, nodes in heads:
                await self._links.send(head, _wire.addressed(req, head_rank, nodes), payload.parts)
                self._calls.sent += 1

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
        """Send a :class:`~amesh._wire.Cast` to each target (down ``tree``): no replies.

        A scattered cast (a payload per rank) is one cast per rank, each down its
        own path of the tree; it takes flow-control room at every target at once.

        Raises:
            SupervisionError: a target is known to be dead (nothing is sent).
            TimeoutError: flow control held the cast past ``deadline``.
        """
        for addr in targets.values():
            why = self._dead.get(addr)
            if why is not None:
                raise SupervisionError(str(why), [why])
        if isinstance(payload, Payload):
            packed = [(targets, payload)]
            nbytes = [payload.nbytes] * len(targets)
        else:
            packed = [({rank: addr}, payload[rank]) for rank, addr in targets.items()]
            nbytes = [payload[rank].nbytes for rank in targets]
        addrs = list(targets.values())
        numbers = await self._links.acquire(addrs, actor, nbytes, deadline)
        seqs = dict(zip(targets, zip(addrs, numbers)))
        # Posted, not awaited: the windows just taken are counted as sent, so the
        # frames must go out even if the caller is cancelled now (flow control
        # bounds what may queue).
        for to, each in packed:
            req = _wire.Relay(
                self.address, self._calls.next_id(), -1, actor, method, labels, sizes,
                each.inline, [], each.lengths, "", 0, [],
            )  # fmt: skip
            self._post_cast(req, each.parts, to, tree, seqs)

    def _post_cast(
        self,
        req: _wire.Relay,
        parts: list[Any],
        targets: dict[int, str],
        tree: Tree | None,
        seqs: dict[int, tuple[str, int]],
    ) -> None:
        """Post cast ``req`` to ``targets`` (down ``tree``; kept until credited when
        it goes through relays); ``seqs``: each rank's (address, cast number)."""
        if tree is None:
            heads = self._heads(targets, None)
        else:
            route = plan(
                {r: tree.slots[r] for r in targets}, tree.procs, tree.fanout, self._dead, tree.group
            )
            heads = route.heads
            if route.via:
                self._keep(req, parts, tree, route.via, seqs)
        for addr, rank, nodes in heads:
            self._links.send_nowait(addr, _wire.addressed(req, rank, nodes), parts)

    # -- relayed casts ----------------------------------------------------------------

    def _keep(
        self,
        req: _wire.Relay,
        parts: list[Any],
        tree: Tree,
        via: dict[int, tuple[str, ...]],
        seqs: dict[int, tuple[str, int]],
    ) -> None:
        kept = _Relayed(req, parts, tree)
        kept.via = via
        for rank in via:
            addr, seq = seqs[rank]
            kept.seqs[rank] = (addr, seq)
            self._awaiting.setdefault((addr, req.actor), deque()).append((seq, kept))
        kept.remaining = len(via)
        self._relayed.setdefault(req.actor, deque()).append(kept)

    def credited(self, addr: str, actor: str, count: int) -> None:
        """``actor`` at ``addr`` took ``count`` of our casts: release what it confirms."""
        waiting = self._awaiting.get((addr, actor))
        if waiting is None:
            return
        while waiting and waiting[0][0] <= count:
            waiting.popleft()[1].remaining -= 1
        if not waiting:
            del self._awaiting[(addr, actor)]
        self._release(actor)

    def _release(self, actor: str) -> None:
        kept = self._relayed.get(actor)
        while kept and kept[0].remaining <= 0:
            kept.popleft()
        if kept is not None and not kept:
            del self._relayed[actor]

    def _resend(self, relay: str) -> None:
        """Send the casts that went through ``relay`` again, around it."""
        for actor, kept in list(self._relayed.items()):
            for cast in kept:
                lost = {}
                for rank, path in cast.via.items():
                    addr, seq = cast.seqs[rank]
                    if (
                        relay in path
                        and addr not in self._dead
                        and self._links.credited(addr, actor) < seq
                    ):
                        lost[rank] = addr
                if not lost:
                    continue
                tree = cast.tree
                slots = {r: tree.slots[r] for r in lost}
                route = plan(slots, tree.procs, tree.fanout, self._dead, tree.group)
                for rank in lost:
                    cast.via[rank] = route.via.get(rank, ())
                for addr, rank, nodes in route.heads:
                    self._links.send_nowait(
                        addr, _wire.addressed(cast.req, rank, nodes), cast.parts
                    )
                self.resent += 1

    # -- deaths -------------------------------------------------------------------------

    def peer_failed(self, addr: str, why: Failure) -> None:
        """``addr`` is gone: fail the calls it relayed, resend the casts it relayed."""
        for pending in list(self._calls.pending.values()):
            if addr in pending.relays:
                self._relay_failed(pending, addr, why)
        for key in [k for k in self._awaiting if k[0] == addr]:
            for _, cast in self._awaiting.pop(key):
                cast.remaining -= 1
            self._release(key[1])
        self._resend(addr)

    def _relay_failed(self, pending: Pending, addr: str, why: Failure) -> None:
        """A relay of ``pending`` died: the replies behind it are lost; fail them fast
        (as a failure of the relay's rank only) and tell the relays above to stop
        waiting for them."""
        lost = [r for r, path in pending.via.items() if addr in path and r in pending.targets]
        # The requests may be running behind the dead relay: nobody waits for their
        # results now, so cancel them there, and the gathers of the relays below it
        # (paths run from the top; the relays above still gather for other ranks).
        # (A scattered call's ranks each have a request of their own, which is what
        # these cancels and prunes name.)
        behind: set[tuple[str, int]] = set()
        #: (relay, request id) -> the ranks it must stop waiting for
        prunes: dict[tuple[str, int], list[int]] = {}
        for r in lost:
            path, request_id = pending.via[r], pending.request_id(r)
            behind.add((pending.targets[r], request_id))
            behind.update((below, request_id) for below in path[path.index(addr) + 1 :])
            above = path[: path.index(addr)] if pending.ids else pending.relays
            for relay in above:
                prunes.setdefault((relay, request_id), []).append(r)
        for rank in lost:
            msg = (
                f"the result of {pending.where(rank)} was lost: the process relaying it {why.cause}"
            )
            self._calls.fail_rank(pending, rank, why, msg)
        for peer, request_id in behind:
            if peer not in self._dead:
                self._links.send_nowait(peer, _wire.Cancel(self.address, request_id))
        for (relay, request_id), ranks in prunes.items():
            if relay not in self._dead:
                self._links.send_nowait(relay, _wire.Prune(self.address, request_id, ranks))
