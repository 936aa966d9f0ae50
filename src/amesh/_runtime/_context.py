"""Context variables: the runtime of this task, and the call being handled."""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._shape import Point
    from ._runtime import Runtime

__all__ = ["CallContext", "call_context", "runtime_var"]

runtime_var: ContextVar[Runtime | None] = ContextVar("amesh_runtime", default=None)


class CallContext:
    """What an endpoint (or ``__init__``) may ask about itself."""

    __slots__ = ("actor", "call_id", "point", "sender")

    def __init__(self, actor: Any, point: Point, sender: str, call_id: int) -> None:
        self.actor = actor
        self.point = point
        self.sender = sender
        self.call_id = call_id


call_context: ContextVar[CallContext | None] = ContextVar("amesh_call", default=None)
