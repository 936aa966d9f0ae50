"""The exceptions users see. Remote failures travel as data and are rebuilt here."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._tracebacks import cell_names

__all__ = [
    "ActorError",
    "DeadlockError",
    "Failure",
    "ProtocolError",
    "RemoteTraceback",
    "SupervisionError",
]

_HOST = socket.gethostname()


@dataclass(frozen=True)
class Failure:
    """One supervision failure: what failed, where, and why.

    Attributes:
        mesh: the mesh that failed, e.g. ``"ProcMesh {'gpus': 4}"`` or ``"actor 'trainers'"``.
        rank: the failed rank in that mesh.
        pid: the process id, when known.
        cause: why, e.g. ``"was killed by SIGKILL"``, ``"exited with code 3"``,
            ``"sent no heartbeat for 2.0 s"``, or a nested failure's text.
        exit_code: the exit code, when the process exited.
        signal: the signal number, when the process was killed by one.
        host: the host name.
    """

    mesh: str
    rank: int
    pid: int | None
    cause: str
    exit_code: int | None = None
    signal: int | None = None
    host: str = field(default=_HOST)

    def __str__(self) -> str:
        pid = f", pid {self.pid}" if self.pid is not None else ""
        return f"{self.mesh} rank {self.rank} (host {self.host}{pid}): {self.cause}"


class RemoteTraceback(Exception):
    """Carries the remote traceback text; set as ``ActorError.__cause__``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text.rstrip()


class ActorError(Exception):
    """An endpoint raised on a remote actor.

    Attributes:
        type_name: qualified name of the remote exception type.
        message: ``str()`` of the remote exception.
        traceback: the remote traceback, formatted: the user's frames, with the source
            lines of code shipped by value too (a notebook cell's named as IPython
            names it, ``Cell In[3]``); amesh's own frames only with ``AMESH_DEBUG=1``
            in the worker's environment.
        actor: the name of the actor mesh that was called.
        point: the coordinates of the failing rank in the mesh (or slice) that was
            called, with ``"rank"``.
    """

    def __init__(
        self,
        type_name: str,
        message: str,
        traceback: str,
        actor: str = "",
        point: Mapping[str, int] | None = None,
    ) -> None:
        self.type_name = type_name
        self.message = message
        self.traceback = traceback = cell_names(traceback)
        self.actor = actor
        self.point = dict(point or {})
        super().__init__(type_name, message, traceback, actor, point)
        self.__cause__ = RemoteTraceback(traceback) if traceback else None

    def __str__(self) -> str:
        where = f" in actor {self.actor!r}" if self.actor else ""
        at = ""
        if self.point:
            at = " at " + ", ".join(f"{k}={v}" for k, v in self.point.items())
        return f"{self.type_name}: {self.message}{where}{at}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ActorError, (self.type_name, self.message, self.traceback, self.actor, self.point))


class SupervisionError(Exception):
    """A process or actor failed in a way that no reply can carry.

    Raised for in-flight and later calls to the failed ranks, and at the exit of the
    owning ``async with ProcMesh(...)`` block when nobody handled the failure.

    Attributes:
        message: the summary.
        failures: every :class:`Failure` this error stands for.
    """

    def __init__(self, message: str, failures: Sequence[Failure] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.failures: tuple[Failure, ...] = tuple(failures)

    @property
    def ranks(self) -> list[int]:
        """The failed ranks, in the order the failures happened."""
        return [f.rank for f in self.failures]

    def __reduce__(self) -> tuple[Any, ...]:
        return (SupervisionError, (self.message, self.failures))


class DeadlockError(ActorError):
    """A call would wait on itself under serial dispatch (A -> B -> A).

    Raised instead of hanging; the message names the cycle.
    """


class ProtocolError(Exception):
    """A peer spoke a protocol version or frame this runtime does not understand."""
