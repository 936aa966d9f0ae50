"""Peers: who is gone, who is watched, and how a death reaches every caller.

A death is learnt three ways, whichever comes first:

- the supervisor of a process (the owner of its mesh) sees its exit or its silence
  and calls :meth:`Peers.failed`, which also tells the other processes that may be
  calling it (a :class:`~amesh._wire.Died` notice to every process it supervises and
  to its own parent);
- such a notice arrives from another process's supervisor;
- the transport reports that the link to a peer broke (EOF, reset, refused). For a
  process this runtime supervises, the supervisor decides (it has the exit status);
  for any other peer, the link's loss is its death.

Every call waiting on a dead peer fails at once, and later sends to it fail at once.

The table of dead peers keeps the :data:`DEAD_KEPT` most recent deaths: a process
that outlives many short-lived peers (a controller starting mesh after mesh, a worker
called by many) would otherwise keep an entry for each of them for good. What goes
is the oldest: nothing more waits on it (its calls failed when it died), no frame of
it arrives any more (its link was closed), and a send that still comes for it (a
handle kept that long) fails when its connection cannot be made, as a peer's link
loss does, rather than with the cause first seen.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType

import anyio

from .. import _wire
from .._errors import Failure
from ._calls import Calls
from ._links import Links
from ._router import Router

__all__ = ["DEAD_KEPT", "LINK_LOST", "Peers", "peer_of"]

log = logging.getLogger("amesh.runtime")

#: The cause of a peer whose link broke begins so, followed by why in parentheses.
LINK_LOST = "its connection was lost"
#: Dead peers remembered, the most recent: a mesh of this many ranks lost at once still
#: fails every send at once with each rank's cause; ~1 MB at ~0.5-0.9 KB an entry.
DEAD_KEPT = 1024

_PID_IN_NAME = re.compile(r"amesh-(\d+)-[0-9a-f]+")


def peer_of(addr: str) -> tuple[str | None, int | None]:
    """``(host, pid)`` of the process at ``addr``, as far as its address tells."""
    rest = addr.split("://", 1)[-1]
    m = _PID_IN_NAME.search(rest)
    pid = int(m.group(1)) if m else None
    if addr.split("://", 1)[0].endswith("tcp"):
        return rest.rsplit(":", 1)[0].strip("[]"), pid
    return None, pid


class Peers:
    """The peer table of one runtime: the only writer of who is dead.

    The other parts read the table through :attr:`dead`, a read-only view; the
    router and the links are given with :meth:`connect` (they are made after the
    peers, with that view).
    """

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._router: Router | None = None
        self._links: Links | None = None
        #: addresses of processes known to be dead -> why
        self._dead: dict[str, Failure] = {}
        self.dead: Mapping[str, Failure] = MappingProxyType(self._dead)
        #: addresses of workers this runtime supervises -> when their last heartbeat
        #: came (anyio clock)
        self._heartbeats: dict[str, float] = {}
        #: supervised addresses -> what to do when their link breaks
        self._watchers: dict[str, Callable[[str], None]] = {}
        #: the address of this process's own supervisor, if any
        self.parent = ""
        self.notices = 0
        self.heartbeats_received = 0

    def connect(self, router: Router, links: Links) -> None:
        """The parts a death reaches: the calls the router sent through a dead relay,
        and the link to the dead process."""
        self._router, self._links = router, links

    def watch(self, addr: str, on_link_lost: Callable[[str], None], now: float) -> None:
        """This runtime supervises ``addr``: its heartbeats count from ``now``, and a
        broken link to it goes to ``on_link_lost(why)`` instead of failing it."""
        self._watchers[addr] = on_link_lost
        self._heartbeats[addr] = now

    def last_heartbeat(self, addr: str) -> float | None:
        """When the last heartbeat of supervised ``addr`` came (anyio clock), or None if
        it is not watched."""
        return self._heartbeats.get(addr)

    def on_heartbeat(self, env: _wire.Heartbeat) -> None:
        """A heartbeat from ``env.addr`` (which its link proved)."""
        self.heartbeats_received += 1
        if env.addr in self._heartbeats:
            self._heartbeats[env.addr] = anyio.current_time()

    def unwatch(self, addr: str) -> None:
        self._watchers.pop(addr, None)
        self._heartbeats.pop(addr, None)

    def failed(self, addr: str, why: Failure, announce: bool = False) -> None:
        """The process at ``addr`` is gone: fail every call waiting on it, now and
        later; with ``announce``, tell the processes that may be calling it."""
        if addr in self._dead:
            return
        self._dead[addr] = why
        if len(self._dead) > DEAD_KEPT:
            del self._dead[next(iter(self._dead))]  # the oldest death (see the module doc)
        self._heartbeats.pop(addr, None)
        self._calls.fail_addr(addr, why)
        assert self._router is not None and self._links is not None, "connect() first"
        self._router.peer_failed(addr, why)
        self._links.forget(addr)
        if announce:
            self._announce(addr, why)

    def revive(self, addr: str) -> None:
        """Take the process at ``addr`` for alive again: a well-known address (a host
        agent's, which has no tag) that someone asks for anew may name a new process
        there, started after the one that this runtime saw die."""
        if self._dead.pop(addr, None) is not None:
            log.info("%s is asked for again: no longer taken for dead", addr)

    def _announce(self, addr: str, why: Failure) -> None:
        notice = _wire.Died(
            addr,
            _wire.clip(why.mesh, _wire.MAX_NAME),
            why.rank,
            why.pid,
            _wire.clip(why.host, _wire.MAX_NAME),
            _wire.clip(why.cause),
            why.exit_code,
            why.signal,
        )
        assert self._links is not None, "connect() first"
        for peer in [*self._watchers, self.parent]:
            if peer and peer != addr and peer not in self._dead:
                self._links.send_nowait(peer, notice)

    def on_notice(self, env: _wire.Died, peer: str) -> bool:
        """A supervisor at ``peer`` says ``env.addr`` is gone (ignored for our own).

        Only this process's own supervisor and the processes it supervises send
        notices; from anyone else a notice is refused (False)."""
        if peer != self.parent and peer not in self._watchers:
            return False
        assert self._links is not None, "connect() first"
        if env.addr in self._watchers or env.addr == self._links.address:
            return True
        self.notices += 1
        why = Failure(
            env.mesh, env.rank, env.pid, env.cause, env.exit_code, env.signal, host=env.host
        )
        self.failed(env.addr, why)
        return True

    def link_lost(self, addr: str, why: str) -> None:
        """The transport's link to ``addr`` broke."""
        if addr in self._dead:
            return
        watcher = self._watchers.get(addr)
        if watcher is not None:
            watcher(why)
            return
        host, pid = peer_of(addr)
        failure = Failure(f"process at {addr}", -1, pid, f"{LINK_LOST} ({why})")
        if host is not None:
            failure = dataclasses.replace(failure, host=host)
        log.info("lost the connection to %s: %s", addr, why)
        self.failed(addr, failure)
