"""The system actor that every worker process runs: spawns and stops user actors."""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

import anyio
import msgspec

from . import _codec
from ._actor import Actor, endpoint, handlers_of
from ._runtime._context import CallContext, call_context
from ._runtime._mailbox import ActorInstance
from ._runtime._runtime import current_runtime
from ._shape import Shape

__all__ = ["AGENT_KEY", "ProcAgent"]

AGENT_KEY = "_proc"
_PR_GET_PDEATHSIG = 2
log = logging.getLogger("amesh.proc")


def _parent_death_signal() -> int:
    """The signal this process gets when its parent thread exits (0: none; Linux)."""
    if sys.platform != "linux":
        return 0
    sig = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    return sig.value


class ProcAgent(Actor):
    """Lives under :data:`AGENT_KEY` in every worker."""

    def __init__(self, shutdown: anyio.Event) -> None:
        self._shutdown = shutdown

    @endpoint
    def spawn_actor(
        self,
        key: str,
        name: str,
        payload: _codec.Payload,
        owner: str,
        labels: list[str],
        sizes: list[int],
        ranks: list[int],
    ) -> int:
        """Construct an actor (``__init__`` runs here) and start its mailbox.

        ``ranks[i]`` is the rank in the actor mesh (of shape ``labels``/``sizes``) of
        the agent that is rank ``i`` of this call.
        """
        rt = current_runtime()
        cls, args, kwargs = _codec.loads(payload.data, payload.buffers)
        ctx = call_context.get()
        assert ctx is not None
        rank = ranks[ctx.point.rank]
        point = Shape(labels, sizes).point(rank)
        obj = cls.__new__(cls)
        token = call_context.set(CallContext(obj, point, ctx.sender, ctx.call_id))
        try:
            obj.__init__(*args, **kwargs)
        finally:
            call_context.reset(token)
        rt.add_actor(ActorInstance(rt, key, name, obj, handlers_of(cls), owner, rank))
        return rt.pid

    @endpoint
    async def stop_actor(self, key: str) -> bool:
        """Stop taking messages, finish the queued ones, run ``__cleanup__``."""
        inst = current_runtime().remove_actor(key)
        if inst is None:
            return False
        await inst.stop()
        return True

    @endpoint
    def statistics(self) -> dict[str, Any]:
        """This worker's runtime counters."""
        stats = msgspec.structs.asdict(current_runtime().statistics())
        stats["parent_death_signal"] = _parent_death_signal()
        return stats

    @endpoint
    def shutdown(self) -> None:
        """Let the worker exit."""
        self._shutdown.set()
