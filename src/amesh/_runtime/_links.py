"""Links to peers: the ordered outbox, and flow control by credit.

Flow control: a broadcaster may have at most a window of messages (and bytes) waiting
in one actor's mailbox at one process; beyond that ``acquire`` waits. The receiver
returns credit in batches as messages leave the mailbox. Credits are cumulative (the
total taken so far, not a delta), so a lost or duplicated credit message costs at most
a delay until the next one, never a window shrunk for good.

The counts of a (peer, actor) pair live as long as the actor: once it stopped, its
process sends each sender whose casts it counted a credit of :data:`GONE` and drops
the counts, and a sender that gets one drops its own. A cast (or a probe) that comes
later for an actor that is no longer there is answered the same way, keeping nothing:
an actor's key is never reused, so no count of it is needed again. Without that, each
actor mesh spawned and stopped left an entry per process on both sides for as long as
the processes lived.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from .. import _wire
from .._config import settings
from .._errors import Failure
from .._ratelog import RateLimitedLog
from .._transport import Transport, TransportClosed

__all__ = ["CREDIT_BATCH", "CREDIT_BATCH_BYTES", "GONE", "Links", "send_window"]

log = logging.getLogger("amesh.runtime")
#: frames that could not be sent (an address no transport here can reach, a frame
#: too large): one log line per interval, each counted in ``Links.dropped``
_drops = RateLimitedLog(log)

#: A receiver returns credit after this many messages (or bytes) left a mailbox.
CREDIT_BATCH = 32
CREDIT_BATCH_BYTES = 8 * 1024 * 1024
#: A sender held back this long asks the receiver for its credit totals again.
CREDIT_PROBE = 0.5
#: The credit of an actor that is gone (stopped, or not there): it takes every cast,
#: so nothing waits on it, and its sender forgets what it counted for it.
GONE = 2**63 - 1


def send_window() -> tuple[int, int]:
    """``(messages, bytes)`` one sender may have waiting in one actor's mailbox.

    From ``AMESH_SEND_WINDOW`` (default 1024, at least 2 x :data:`CREDIT_BATCH`) and
    ``AMESH_SEND_WINDOW_BYTES`` (default 256 MiB, at least 2 x :data:`CREDIT_BATCH_BYTES`);
    see :mod:`amesh._config`.
    """
    config = settings()
    return config.send_window, config.send_window_bytes


class Links:
    """Sends frames in order per peer, and keeps the credit of each (peer, actor).

    Args:
        transport: the process's transport.
        route_local: takes frames addressed to this process itself.
        spawn: starts a background task (the runtime's service task group).
        dead: addresses of peers known to be gone (nothing is sent there).
        new_event: the loop's own Event class.
    """

    def __init__(
        self,
        transport: Transport,
        route_local: Callable[[_wire.Envelope, list[Any]], None],
        spawn: Callable[..., None],
        dead: Mapping[str, Failure],
        new_event: Any,
    ) -> None:
        self.transport = transport
        self.address = transport.address
        self.closed = False
        self._route_local = route_local
        self._spawn = spawn
        self._dead = dead
        self._new_event = new_event
        #: frames waiting, in order, for a link that was full (see post)
        self._outq: dict[str, deque[_wire.Frame]] = {}
        self.window, self.window_bytes = send_window()
        #: sending side: (address, actor) -> [sent, bytes sent, credited, bytes credited]
        self._out: dict[tuple[str, str], list[int]] = {}
        self._credit_waiters: dict[tuple[str, str], Any] = {}
        self.credit_waits = 0
        #: receiving side: (sender, actor) -> [taken, bytes taken, credited, bytes credited]
        self._taken: dict[tuple[str, str], list[int]] = {}
        #: frames and messages dropped here, rather than sent or handled (see drop)
        self.dropped = 0

    def use(self, transport: Transport) -> None:
        """Send through ``transport`` from now on, as its address (the process moved to
        it before any peer knew the old one: see :meth:`Runtime.listen_instead`)."""
        self.transport = transport
        self.address = transport.address

    # -- the outbox ---------------------------------------------------------------------

    async def send(self, addr: str, env: _wire.Envelope, buffers: list[Any] | None = None) -> None:
        """Encode and send, waiting while the link is full; a vanished peer is not an
        error for the sender (its failure reaches the calls waiting on it), nor is an
        address that no transport here can reach (the frame is dropped and counted).

        Raises:
            ValueError: the frame is larger than the transport takes.
        """
        waiting = self.send_soon(addr, env, buffers)
        if waiting is not None:
            await waiting

    def send_soon(
        self, addr: str, env: _wire.Envelope, buffers: list[Any] | None = None
    ) -> Awaitable[None] | None:
        """:meth:`send` without a coroutine where the link takes the frame at once:
        None once it is handed over (or dropped, as :meth:`send` would), else what
        to await while the link is full.

        Raises:
            ValueError: the frame is larger than the transport takes.
        """
        if addr == self.address:
            self._route_local(env, buffers or [])
            return None
        if addr in self._dead:
            return None
        frame = _wire.encode(env, buffers) if buffers else _wire.encode_envelope(env)
        if addr in self._outq:
            self.post(addr, frame)
            return None
        try:
            if self.transport.try_send(addr, frame):
                return None
        except Exception as exc:
            self._failed(addr, frame, exc)
            return None
        return self._send_waiting(addr, frame)

    async def _send_waiting(self, addr: str, frame: _wire.Frame) -> None:
        try:
            await self.transport.send(addr, frame)
        except Exception as exc:
            self._failed(addr, frame, exc)

    def _failed(self, addr: str, frame: _wire.Frame, exc: Exception) -> None:
        """A send raised ``exc``: too large (raised again), closed, or unreachable."""
        if isinstance(exc, TransportClosed):
            return
        if isinstance(exc, ValueError) and _wire.frame_size(frame) > self.transport.max_frame:
            raise exc
        self.drop("dropped a frame to %r: %s", addr, exc)

    def drop(self, msg: str, *args: Any) -> None:
        """Count a frame or message dropped here, and log it (one line per interval)."""
        self.dropped += 1
        _drops.warning(msg, *args)

    def send_nowait(self, addr: str, env: _wire.Envelope, buffers: list[Any] | None = None) -> None:
        """Send without waiting (see :meth:`post`)."""
        if addr == self.address:
            self._route_local(env, buffers or [])
            return
        if addr in self._dead or self.closed:
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
        except Exception as exc:  # too large, or an address no transport here reaches
            self.drop("dropped a frame to %r: %s", addr, exc)
            return
        self._outq[addr] = deque([frame])
        self._spawn(self._drain, addr)

    async def _drain(self, addr: str) -> None:
        queue = self._outq[addr]
        try:
            while queue and addr not in self._dead:
                try:
                    await self.transport.send(addr, queue[0])
                except TransportClosed:
                    return
                except Exception as exc:  # this frame only (see post)
                    self.drop("dropped a frame to %r: %s", addr, exc)
                queue.popleft()
        finally:
            if self._outq.get(addr) is queue:
                del self._outq[addr]

    # -- credit, sending side -----------------------------------------------------------

    async def acquire(
        self, addrs: list[str], actor: str, nbytes: Sequence[int], deadline: float = math.inf
    ) -> list[int]:
        """Wait until ``actor`` at each of ``addrs`` may take one more message from us
        (of ``nbytes`` bytes, one size per address), then take that room at all of them
        at once (all or nothing, so a timeout or a cancel leaves every window as it was).

        Returns:
            each message's number among those sent to that address (1, 2, ...).

        Raises:
            TimeoutError: ``deadline`` (anyio clock) passed first.
        """
        outs = []
        for addr in addrs:
            out = self._out.get((addr, actor))
            if out is None:
                out = self._out[(addr, actor)] = [0, 0, 0, 0]
            outs.append(out)
        while True:
            full = next(
                (
                    addr
                    for addr, out, size in zip(addrs, outs, nbytes)
                    if out[0] > out[2]
                    and (
                        out[0] - out[2] >= self.window or out[1] - out[3] + size > self.window_bytes
                    )
                    and addr not in self._dead
                ),
                None,
            )
            if full is None or self.closed:
                break
            key = (full, actor)
            self.credit_waits += 1
            event = self._credit_waiters.get(key)
            if event is None:
                event = self._credit_waiters[key] = self._new_event()
            wait = min(deadline - anyio.current_time(), CREDIT_PROBE)
            with anyio.move_on_after(wait) as scope:
                await event.wait()
            if scope.cancelled_caught and anyio.current_time() < deadline:
                # No credit for a while: ask for the totals, in case a credit
                # message was lost (the receiver may have nothing left to take).
                self.send_nowait(full, _wire.Credit(self.address, actor, -1, -1))
                continue
            if scope.cancelled_caught:
                out = self._out.get(key, [0, 0, 0, 0])
                raise TimeoutError(
                    f"actor {actor} at {full} took no message for the whole timeout: "
                    f"{out[0] - out[2]} messages ({out[1] - out[3]} bytes) are waiting there"
                )
            # a peer that died meanwhile has no window any more
            outs = [self._out.setdefault((a, actor), [0, 0, 0, 0]) for a in addrs]
        seqs = []
        for out, size in zip(outs, nbytes):
            out[0] += 1
            out[1] += size
            seqs.append(out[0])
        return seqs

    def on_credit(self, env: _wire.Credit) -> int:
        """Credit from a receiver; returns how many of our messages it has taken
        (:data:`GONE`: all of them, ever, and what we counted is dropped)."""
        key = (env.addr, env.actor)
        if env.count == GONE:
            self._out.pop(key, None)
            event = self._credit_waiters.pop(key, None)
            if event is not None:
                event.set()
            return GONE
        out = self._out.get(key)
        if out is None:
            return 0
        out[2] = max(out[2], env.count)
        out[3] = max(out[3], env.nbytes)
        event = self._credit_waiters.pop(key, None)
        if event is not None:
            event.set()
        return out[2]

    def outstanding(self, addr: str, actor: str) -> int:
        """Our casts to ``actor`` at ``addr`` that it has not confirmed yet."""
        out = self._out.get((addr, actor))
        return out[0] - out[2] if out is not None else 0

    def credited(self, addr: str, actor: str) -> int:
        """How many of our casts ``actor`` at ``addr`` has confirmed taking."""
        out = self._out.get((addr, actor))
        return out[2] if out is not None else 0

    # -- credit, receiving side -----------------------------------------------------------

    def taken(self, sender: str, actor: str, nbytes: int) -> None:
        """A cast from ``sender`` left ``actor``'s mailbox: return credit in batches.

        Only casts (broadcasts) are counted: a call is bounded by its caller, who
        waits for the reply, and must not queue behind casts (a call to a concurrent
        endpoint may be what lets a busy actor finish).
        """
        key = (sender, actor)
        taken = self._taken.get(key)
        if taken is None:
            taken = self._taken[key] = [0, 0, 0, 0]
        taken[0] += 1
        taken[1] += nbytes
        if taken[0] - taken[2] >= CREDIT_BATCH or taken[1] - taken[3] >= CREDIT_BATCH_BYTES:
            taken[2], taken[3] = taken[0], taken[1]
            self.send_nowait(sender, _wire.Credit(self.address, actor, taken[0], taken[1]))

    def on_probe(self, env: _wire.Credit, live: bool) -> None:
        """A sender (``env.addr``) asks for ``env.actor``'s credit totals again
        (``live``: the actor runs here; else it is gone)."""
        if not live:
            self.declined(env.addr, env.actor)
            return
        taken = self._taken.get((env.addr, env.actor))
        if taken is not None:
            taken[2], taken[3] = taken[0], taken[1]
            self.send_nowait(env.addr, _wire.Credit(self.address, env.actor, taken[0], taken[1]))

    def declined(self, sender: str, actor: str) -> None:
        """A cast from ``sender`` for ``actor``, which is not here (any more), was
        dropped: the sender must not wait for it, and nothing is kept."""
        self.send_nowait(sender, _wire.Credit(self.address, actor, GONE, GONE))

    def forget_actor(self, actor: str) -> None:
        """Actor ``actor`` of this process stopped and takes nothing more: tell each
        sender whose casts it counted, and drop the counts."""
        for key in [k for k in self._taken if k[1] == actor]:
            del self._taken[key]
            self.declined(key[0], actor)

    # -- peers that are gone ----------------------------------------------------------------

    def forget(self, addr: str) -> None:
        """``addr`` is gone: drop its queue, windows and credit, wake who waits."""
        for key in [k for k in self._out if k[0] == addr]:
            del self._out[key]
        for key in [k for k in self._taken if k[0] == addr]:
            del self._taken[key]
        for key in [k for k in self._credit_waiters if k[0] == addr]:
            self._credit_waiters.pop(key).set()
        self._outq.pop(addr, None)
        self.transport.forget(addr)
