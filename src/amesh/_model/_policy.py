"""Supervision policy: who hears about a failure, and when a mesh restarts instead.

A failure goes to the owner of the mesh that failed. The owner is the actor that
started the mesh (its ``__supervise__``), a ``supervise=`` callable given to the mesh,
or the controller itself. Unhandled, it cancels the owner's scope (``async with``), or
fails the owning actor (which reports to *its* owner), or cancels the controller's
``amesh.run`` body. Restart policies act before any of that.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio

from .._errors import Failure

__all__ = [
    "RestartPolicy",
    "RestartWindow",
    "Supervisor",
    "call_hook",
    "call_supervisor",
    "restart_policy",
]

log = logging.getLogger("amesh.supervision")

#: A ``supervise=`` callable: return True when the failure is handled.
Supervisor = Callable[[Failure], "bool | Awaitable[bool | None] | None"]


@dataclass(frozen=True)
class RestartPolicy:
    """Restart an actor mesh's processes when they fail, instead of escalating.

    Args:
        strategy: ``"one_for_one"`` restarts only the failed rank's process (and the
            actors on it); ``"one_for_all"`` restarts every process of the mesh (for a
            torch process group that cannot lose a member).
        max_restarts: at most this many restarts within ``within`` seconds; one more
            failure escalates as if there were no policy.
        within: the window of ``max_restarts``, in seconds.
        on_restart: called (sync or async) as ``on_restart(actor_mesh, ranks)`` after a
            restart, so the owner can re-send state.

    Calls in flight at the failure fail with SupervisionError; calls made while the
    restart runs fail at once; calls after it succeed. ``await procs.ready()`` waits for
    a restart in progress.
    """

    strategy: Literal["one_for_one", "one_for_all"] = "one_for_one"
    max_restarts: int = 3
    within: float = 60.0
    on_restart: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.strategy not in ("one_for_one", "one_for_all"):
            raise ValueError(f"unknown restart strategy {self.strategy!r}")
        if self.max_restarts < 0 or self.within <= 0:
            raise ValueError("max_restarts must be >= 0 and within > 0")


def restart_policy(value: RestartPolicy | str | None) -> RestartPolicy | None:
    """Accept a policy, a strategy name, or None."""
    if value is None or isinstance(value, RestartPolicy):
        return value
    if isinstance(value, str):
        return RestartPolicy(strategy=value)  # type: ignore[arg-type]
    raise TypeError(f"restart= takes a RestartPolicy or a strategy name, not {value!r}")


class RestartWindow:
    """Counts restarts in a sliding window (restart intensity)."""

    def __init__(self) -> None:
        self._times: deque[float] = deque()

    def allow(self, policy: RestartPolicy) -> bool:
        now = anyio.current_time()
        while self._times and now - self._times[0] > policy.within:
            self._times.popleft()
        if len(self._times) >= policy.max_restarts:
            return False
        self._times.append(now)
        return True


async def call_supervisor(fn: Supervisor, failure: Failure) -> bool:
    """Run a ``supervise=`` callable; an exception in it means "not handled"."""
    try:
        result: Any = fn(failure)
        if inspect.isawaitable(result):
            result = await result
        return bool(result)
    except Exception:
        log.exception("supervise callable raised; the failure escalates")
        return False


async def call_hook(fn: Callable[..., Any], *args: Any) -> None:
    """Run a user hook (sync or async); an exception in it is logged, not raised."""
    try:
        result = fn(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("hook %r raised", fn)
