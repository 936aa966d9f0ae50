"""Relay trees: how a call or cast to many ranks reaches them, and how replies return.

The tree is fixed per actor mesh: over its process slots ``0..M-1`` with fan-out
``f``, the sender's children are slots ``0..f-1`` and slot ``s`` has children
``f*(s+1) .. f*(s+1)+f-1``. A message to any set of ranks follows the paths of that
one tree, so messages from one sender to one rank always take the same path and
per-sender order holds (links are FIFO and relays forward in arrival order). Nodes
on a path that are not targets only relay; a dead relay is skipped (its children hang
off its nearest live ancestor). A mesh of at most ``f`` processes is reached directly.

A relay gathers the replies of its subtree and sends them up in one
:class:`~amesh._wire.Gathered` when the subtree is complete, and at once when one is
an error (fail fast), so the sender gets O(fan-out) frames per call.

A relay that dies takes with it what it had not forwarded or sent up yet. For a call,
the sender fails the ranks behind it at once (as a failure of the relay's rank only)
and tells the relays above to stop waiting for them. A broadcast is sent again by its
sender, around the dead relay, to the ranks behind it that had not confirmed it (see
:mod:`amesh._runtime._router`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .. import _wire

__all__ = ["Gather", "Nodes", "Plan", "grouped", "plan", "sources", "split"]

#: ``(address, rank or -1, number of nodes below)``, in preorder
Nodes = list[tuple[str, int, int]]


class Plan:
    """Where a sender sends one message: its direct children and their subtrees.

    Attributes:
        heads: ``(address, rank or -1, subtree nodes)`` per child of the sender.
        via: rank -> addresses of the relays on its path (only ranks behind a relay).
        relays: every address that relays (has a subtree).
    """

    __slots__ = ("heads", "relays", "via")

    def __init__(self) -> None:
        self.heads: list[tuple[str, int, Nodes]] = []
        self.via: dict[int, tuple[str, ...]] = {}
        self.relays: set[str] = set()


def _parent(slot: int, fanout: int) -> int:
    return slot // fanout - 1 if slot >= fanout else -1


def _grouped_parent(slot: int, fanout: int, group: int) -> int:
    """The parent of ``slot`` when hosts come first: the first process of each host
    (its head) hangs off the sender in a tree of heads; the others hang off their
    head, in a tree of the host's processes."""
    host, j = divmod(slot, group)
    if j:
        return host * group + (j - 1) // fanout
    up = _parent(host, fanout)
    return up * group if up >= 0 else -1


def grouped(procs: Sequence[str], group: int) -> bool:
    """True if ``procs`` spans several hosts of ``group`` processes each."""
    return 0 < group < len(procs)


def plan(
    targets: Mapping[int, int],
    procs: Sequence[str],
    fanout: int,
    dead: Collection[str] = (),
    group: int = 0,
) -> Plan:
    """Route a message to ``targets`` (rank -> slot) over the tree of ``procs``.

    With ``group`` (processes per host, slots ``h*group ..`` on host ``h``) the tree's
    first level is one process per host, so a message crosses the network once per
    host. Returns a :class:`Plan`; with ``fanout < 2``, or one host of at most
    ``fanout`` processes, every target is a direct child of the sender.
    """
    out = Plan()
    if grouped(procs, group) and fanout >= 2:

        def parent(slot: int) -> int:
            return _grouped_parent(slot, fanout, group)
    else:

        def parent(slot: int) -> int:
            return _parent(slot, fanout)

    if fanout < 2 or (len(procs) <= fanout and not grouped(procs, group)):
        for rank, slot in targets.items():
            out.heads.append((procs[slot], rank, []))
        return out
    rank_of: dict[int, int] = {slot: rank for rank, slot in targets.items()}
    children: dict[int, list[int]] = {}
    seen: set[int] = set()
    for slot in sorted(rank_of):
        node = slot
        while node not in seen:
            seen.add(node)
            up = parent(node)
            # a dead relay is skipped: hang the node off its nearest live ancestor
            while up != -1 and up not in rank_of and procs[up] in dead:
                up = parent(up)
            children.setdefault(up, []).append(node)
            if up == -1:
                break
            node = up

    def subtree(slot: int, path: tuple[str, ...]) -> Nodes:
        nodes: Nodes = []
        for child in children.get(slot, ()):
            rank = rank_of.get(child, -1)
            if rank >= 0 and path:
                out.via[rank] = path
            below = subtree(child, (*path, procs[child]))
            if below:
                out.relays.add(procs[child])
            nodes.append((procs[child], rank, len(below)))
            nodes.extend(below)
        return nodes

    for head in children.get(-1, ()):
        addr = procs[head]
        below = subtree(head, (addr,))
        if below:
            out.relays.add(addr)
        out.heads.append((addr, rank_of.get(head, -1), below))
    return out


def split(nodes: Nodes) -> list[tuple[str, int, Nodes]]:
    """The children of a subtree given in preorder, each with its own subtree.

    A count of nodes below that runs past the end (a malformed relay) is cut there.
    """
    out = []
    i = 0
    n = len(nodes)
    while i < n:
        addr, rank, below = nodes[i]
        below = min(max(below, 0), n - i - 1)
        out.append((addr, rank, nodes[i + 1 : i + 1 + below]))
        i += 1 + below
    return out


def sources(own: int, address: str, nodes: Nodes) -> dict[int, str]:
    """The ranks a relay at ``address`` answers for (its own, if any, and those of its
    subtree ``nodes``), each with the address its reply comes from: the relay itself,
    or the child at the top of the rank's branch."""
    out: dict[int, str] = {}
    for child, rank, below in split(nodes):
        for _, r, _ in below:
            if r >= 0:
                out[r] = child
        if rank >= 0:
            out[rank] = child
    if own >= 0:
        out[own] = address
    return out


class Gather:
    """A relay's collection of its subtree's replies to one call."""

    __slots__ = ("items", "key", "parts", "reply_id", "reply_to", "source", "waiting")

    def __init__(self, key: tuple[str, int], reply_to: str, reply_id: int, source: dict[int, str]):
        self.key = key
        self.reply_to = reply_to
        self.reply_id = reply_id
        #: rank -> the address its reply must come from (its process, or the child
        #: relay whose subtree it is in)
        self.source = source
        #: ranks not heard from yet
        self.waiting = set(source)
        self.items: list[_wire.Reply | _wire.Error] = []
        self.parts: list[Any] = []

    def add(self, env: _wire.Reply | _wire.Error, buffers: Sequence[Any]) -> bool:
        """Take one reply; True if it should be sent up now (error or complete)."""
        if env.rank not in self.waiting:
            return False
        self.waiting.discard(env.rank)
        self.items.append(env)
        if isinstance(env, _wire.Reply):
            self.parts.extend(buffers)
            return not self.waiting
        return True

    def prune(self, ranks: Collection[int]) -> bool:
        """Stop waiting for ``ranks``; True if there is something to send now."""
        self.waiting.difference_update(ranks)
        return not self.waiting and bool(self.items)

    def take(self) -> tuple[_wire.Gathered, list[Any]]:
        """The collected replies as one frame's envelope and parts; starts afresh."""
        parts = self.parts
        env = _wire.Gathered(self.reply_id, self.items, [memoryview(p).nbytes for p in parts])
        self.items, self.parts = [], []
        return env, parts
