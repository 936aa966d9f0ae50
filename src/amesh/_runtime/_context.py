"""Context variables: the runtime of this task, and the call being handled."""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._shape import Point
    from ._mailbox import ActorInstance
    from ._runtime import Runtime

__all__ = ["CallContext", "call_context", "runtime_var"]

runtime_var: ContextVar[Runtime | None] = ContextVar("amesh_runtime", default=None)


class CallContext:
    """What an endpoint (or ``__init__``) may ask about itself.

    Attributes:
        actor: the user's actor object.
        instance: its :class:`ActorInstance` (None while ``__init__`` runs).
        point: the receiving rank in the mesh or slice that sent the message.
        sender: the address of the caller's runtime.
        call_id: the caller's call id.
        chain: serial handlers that wait on this one (see ``_wire.Call.chain``),
            including this one when it is serial; outgoing calls carry it on.
    """

    __slots__ = ("actor", "call_id", "chain", "instance", "point", "sender")

    def __init__(
        self,
        actor: Any,
        point: Point,
        sender: str,
        call_id: int,
        instance: ActorInstance | None = None,
        chain: list[str] | None = None,
    ) -> None:
        self.actor = actor
        self.instance = instance
        self.point = point
        self.sender = sender
        self.call_id = call_id
        self.chain = chain or []


call_context: ContextVar[CallContext | None] = ContextVar("amesh_call", default=None)
