"""A transport wrapper that drops, delays, duplicates frames and cuts links."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from .. import _wire
from .._transport import Deliver, Transport, TransportStats

__all__ = ["FaultyTransport"]


def _kind(frame: _wire.Frame) -> str:
    try:
        return type(_wire.decode(_wire.join(frame))[0]).__name__
    except Exception:
        return "bad"


@dataclass
class _Rule:
    action: str  # drop, delay, duplicate
    to: str | None
    kinds: frozenset[str] | None
    remaining: int | None
    seconds: float = 0.0
    inbound: bool = False

    def matches(self, addr: str, frame: _wire.Frame, inbound: bool) -> bool:
        if self.inbound != inbound or self.remaining == 0:
            return False
        if self.to is not None and addr != self.to:
            return False
        if self.kinds is not None and _kind(frame) not in self.kinds:
            return False
        if self.remaining is not None:
            self.remaining -= 1
        return True


class FaultyTransport:
    """Wraps a transport and injects faults into what goes through it.

    Every rule takes ``to=`` (a peer address; all when None), ``kinds=`` (envelope
    names such as ``{"Call", "Reply", "Heartbeat"}``; all when None) and ``count=``
    (how many frames it affects; unlimited when None).

    Args:
        inner: the real transport.
    """

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self._rules: list[_Rule] = []
        self._cut: set[str] = set()
        self.dropped = 0
        self.duplicated = 0
        self.delayed = 0

    # -- faults -------------------------------------------------------------------------

    def _add(self, rule: _Rule) -> None:
        self._rules.append(rule)

    def drop(
        self, *, to: str | None = None, kinds: set[str] | None = None, count: int | None = None
    ) -> None:
        """Drop outgoing frames."""
        self._add(_Rule("drop", to, frozenset(kinds) if kinds else None, count))

    def drop_inbound(self, *, kinds: set[str] | None = None, count: int | None = None) -> None:
        """Drop incoming frames (before the runtime sees them)."""
        self._add(_Rule("drop", None, frozenset(kinds) if kinds else None, count, inbound=True))

    def duplicate(
        self, *, to: str | None = None, kinds: set[str] | None = None, count: int | None = None
    ) -> None:
        """Send outgoing frames twice."""
        self._add(_Rule("duplicate", to, frozenset(kinds) if kinds else None, count))

    def delay(
        self,
        seconds: float,
        *,
        to: str | None = None,
        kinds: set[str] | None = None,
        count: int | None = None,
    ) -> None:
        """Hold outgoing frames back for ``seconds`` (the link stays in order)."""
        self._add(_Rule("delay", to, frozenset(kinds) if kinds else None, count, seconds))

    def cut(self, addr: str) -> None:
        """Drop everything sent to ``addr`` until :meth:`heal`."""
        self._cut.add(addr)

    def heal(self, addr: str | None = None) -> None:
        """Undo :meth:`cut` for ``addr`` (for every address when None)."""
        if addr is None:
            self._cut.clear()
        else:
            self._cut.discard(addr)

    def clear(self) -> None:
        """Remove every rule and heal every link."""
        self._rules.clear()
        self._cut.clear()

    def _match(self, addr: str, frame: _wire.Frame, inbound: bool = False) -> _Rule | None:
        for rule in self._rules:
            if rule.matches(addr, frame, inbound):
                return rule
        return None

    # -- the Transport protocol -------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._inner.address

    @property
    def max_frame(self) -> int:
        return self._inner.max_frame

    def try_send(self, addr: str, frame: _wire.Frame) -> bool:
        if addr in self._cut:
            self.dropped += 1
            return True
        rule = self._match(addr, frame)
        if rule is None:
            return self._inner.try_send(addr, frame)
        if rule.action == "drop":
            self.dropped += 1
            return True
        if rule.action == "duplicate":
            self.duplicated += 1
            ok = self._inner.try_send(addr, frame)
            if ok:
                self._inner.try_send(addr, frame)
            return ok
        # delay: refuse here, so the caller takes the waiting path; put the rule back
        if rule.remaining is not None:
            rule.remaining += 1
        return False

    async def send(self, addr: str, frame: _wire.Frame) -> None:
        if addr in self._cut:
            self.dropped += 1
            return
        rule = self._match(addr, frame)
        if rule is not None and rule.action == "delay":
            self.delayed += 1
            await anyio.sleep(rule.seconds)
        elif rule is not None and rule.action == "drop":
            self.dropped += 1
            return
        elif rule is not None and rule.action == "duplicate":
            self.duplicated += 1
            await self._inner.send(addr, frame)
        await self._inner.send(addr, frame)

    async def serve(self, deliver: Deliver) -> None:
        def filtered(frame: Any, peer: str) -> None:
            if self._match(self.address, frame, inbound=True) is not None:
                self.dropped += 1
                return
            deliver(frame, peer)

        await self._inner.serve(filtered)

    def forget(self, addr: str) -> None:
        self._inner.forget(addr)

    def set_lost_handler(self, handler: Callable[[str, str], None] | None) -> None:
        self._inner.set_lost_handler(handler)

    def statistics(self) -> TransportStats:
        return self._inner.statistics()

    def close(self) -> None:
        self._inner.close()
