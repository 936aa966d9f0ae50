"""Relaying: pass a request down this process's subtree, and gather the replies up.

See :mod:`amesh._runtime._tree` for the shape of the tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from .. import _wire
from ._calls import Calls
from ._links import Links
from ._tree import Gather, sources, split

__all__ = ["Relays"]


class Relays:
    """The gathers of the calls this process relays."""

    def __init__(self, calls: Calls, links: Links) -> None:
        self._calls = calls
        self._links = links
        #: gathers of replies by id, and their ids by (sender, call id)
        self.gathers: dict[int, Gather] = {}
        self._ids: dict[tuple[str, int], int] = {}
        self.relayed = 0
        #: replies dropped because they came from a peer the request did not go to
        self.refused = 0

    @property
    def address(self) -> str:
        """This process's address (its links'), where gathered replies come back."""
        return self._links.address

    def relay(
        self, env: _wire.Relay, buffers: list[Any], accept: Callable[[Any, list[Any]], None]
    ) -> None:
        """Run a relayed message here (``accept``, if we are a target) and pass it on."""
        self.relayed += 1
        if env.reply_to and (env.rank >= 0 or env.nodes):  # a call, with someone to run it
            gid = self._calls.next_id()
            key = (env.sender, env.call_id)
            self.gathers[gid] = Gather(
                key, env.reply_to, env.reply_id, sources(env.rank, self.address, env.nodes)
            )
            self._ids[key] = gid
            # replies from below come here, to be gathered
            env = msgspec.structs.replace(env, reply_to=self.address, reply_id=gid)
        for addr, rank, nodes in split(env.nodes):
            self._links.send_nowait(addr, _wire.addressed(env, rank, nodes), buffers)
        if env.rank >= 0:
            local = _wire.addressed(env, env.rank, [])
            assert not isinstance(local, _wire.Relay)
            accept(local, buffers)

    def on_reply(
        self, env: _wire.Reply | _wire.Error, buffers: list[Any], gid: int, peer: str
    ) -> bool:
        """A reply from ``peer`` below for gather ``gid``; False when there is no such
        gather (a late reply). One from a peer the request did not go to is dropped."""
        gather = self.gathers.get(gid)
        if gather is None:
            return False
        if gather.source.get(env.rank, peer) != peer:
            self.refused += 1
        elif gather.add(env, buffers):
            self._send_up(gid, gather)
        return True

    def cancel(self, key: tuple[str, int]) -> bool:
        """The sender cancelled its call ``key``: stop gathering; True if we were."""
        gid = self._ids.pop(key, None)
        if gid is None:
            return False
        gather = self.gathers.pop(gid, None)
        if gather is not None:
            # replies gathered so far go nowhere now: free their shared memory
            pos = 0
            for item in gather.items:
                if isinstance(item, _wire.Reply):
                    n = len(item.buffers)
                    _wire.discard_segments(item.payload, gather.parts[pos : pos + n])
                    pos += n
        return True

    def prune(self, env: _wire.Prune) -> None:
        """Stop waiting for ranks whose relay below died."""
        gid = self._ids.get((env.sender, env.call_id))
        gather = self.gathers.get(gid) if gid is not None else None
        if gid is not None and gather is not None:
            if gather.prune(env.ranks):
                self._send_up(gid, gather)
            if not gather.waiting:
                self._end(gid, gather)

    def _send_up(self, gid: int, gather: Gather) -> None:
        env, parts = gather.take()
        self._links.send_nowait(gather.reply_to, env, parts)
        if not gather.waiting:
            self._end(gid, gather)

    def _end(self, gid: int, gather: Gather) -> None:
        self.gathers.pop(gid, None)
        if self._ids.get(gather.key) == gid:
            del self._ids[gather.key]
