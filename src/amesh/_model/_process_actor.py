"""The system actor that every worker process runs: spawns and stops user actors."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from .. import _reload, _wire
from .._bootstrap import WorkerSpec, this_worker
from .._runtime import (
    ActorInstance,
    CallContext,
    call_context,
    current_runtime,
    format_stacks,
    output_identity,
)
from .._shape import Shape
from ._actor import Actor, endpoint, handlers_of

__all__ = ["AGENT_KEY", "CONTROLLER_KEY", "ControllerAgent", "ProcAgent", "serve_controller"]

AGENT_KEY = "_proc"
#: The key of the system actor of a controller whose meshes are in this machine's
#: registry (``amesh logs``).
CONTROLLER_KEY = "_controller"
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

    def __init__(self, shutdown: anyio.Event, adopt: Callable[[str], None] | None = None) -> None:
        self._shutdown = shutdown
        self._adopt = adopt
        #: replaced actors kept for their successor's ``__reload__``, by mesh name
        self._retired: dict[str, Any] = {}
        self._code = _reload.CodeTracker()

    @endpoint
    def spawn_actor(
        self,
        key: str,
        name: str,
        payload: _wire.Payload,
        owner: str,
        labels: list[str],
        sizes: list[int],
        ranks: list[int],
    ) -> int:
        """Construct an actor (``__init__`` runs here) and start its mailbox.

        ``ranks[i]`` is the rank in the actor mesh (of shape ``labels``/``sizes``) of
        the agent that is rank ``i`` of this call. An actor of the same name that
        :meth:`stop_actor` kept (``hand_over``) is passed to the new one's
        ``__reload__`` once its ``__init__`` returned.
        """
        rt = current_runtime()
        old = self._retired.pop(name, None)
        cls, args, kwargs = payload.load()
        ctx = call_context.get()
        assert ctx is not None
        rank = ranks[ctx.point.rank]
        point = Shape(labels, sizes).point(rank)
        obj = cls.__new__(cls)
        token = call_context.set(CallContext(obj, point, ctx.sender, ctx.call_id))
        whose = output_identity.set((name, rank))  # what __init__ prints is the actor's
        try:
            obj.__init__(*args, **kwargs)
            if old is not None and hasattr(obj, "__reload__"):
                obj.__reload__(old)
        finally:
            output_identity.reset(whose)
            call_context.reset(token)
        rt.add_actor(ActorInstance(rt, key, name, obj, handlers_of(cls), owner, rank))
        return rt.pid

    @endpoint
    async def stop_actor(self, key: str, replaced: bool = False, hand_over: bool = False) -> bool:
        """Stop taking messages, finish the queued ones, run ``__cleanup__``.

        Requests that still come for it are answered with an error that says it was
        stopped, or ``replaced``. ``hand_over``: keep the stopped actor for the
        ``__reload__`` of the next actor of its name spawned here.
        """
        rt = current_runtime()
        inst = rt.remove_actor(key)
        if inst is None:
            return False
        rt.dispatch.gone(
            key,
            f"actor mesh {inst.name!r} was replaced (use the ActorMesh that "
            "spawn(..., replace=True) returned)"
            if replaced
            else f"actor mesh {inst.name!r} was stopped",
        )
        whose = output_identity.set((inst.name, inst.rank))  # what __cleanup__ prints
        try:
            await inst.stop()
        finally:
            output_identity.reset(whose)
        if hand_over:
            self._retired[inst.name] = inst.obj
        return True

    @endpoint
    def code_versions(self, modules: list[str]) -> dict[str, tuple[str, str]]:
        """For :meth:`ProcMesh.sync_code`: see :meth:`amesh._reload.CodeTracker.versions`."""
        return self._code.versions(modules)

    @endpoint
    def load_code(self, updates: list[_reload.Update]) -> list[str]:
        """For :meth:`ProcMesh.sync_code`: see :meth:`amesh._reload.CodeTracker.load`."""
        return self._code.load(updates)

    @endpoint
    def move_code(self, trees: list[str]) -> list[str]:
        """For :meth:`ProcMesh.sync`: ``trees`` is ``[old, new]`` (both "": this
        process has no workspace); see :meth:`amesh._reload.CodeTracker.move_root`."""
        old, new = trees
        return self._code.move_root(old, new) if old and new else []

    @endpoint
    def statistics(self) -> dict[str, Any]:
        """This worker's runtime counters."""
        stats = msgspec.structs.asdict(current_runtime().statistics())
        stats["parent_death_signal"] = _parent_death_signal()
        return stats

    @endpoint
    def spec(self) -> WorkerSpec | None:
        """What this worker's mesh asked of it (None: a rank in its controller's
        process)."""
        return this_worker()

    @endpoint
    def status(self) -> dict[str, Any]:
        """What this worker does now: its pid, and per user actor
        :meth:`ActorInstance.status <amesh._runtime._mailbox.ActorInstance.status>`."""
        rt = current_runtime()
        actors = [
            inst.status()
            for key, inst in rt.dispatch.actors.items()
            if key not in (AGENT_KEY, CONTROLLER_KEY)
        ]
        return {"pid": rt.pid, "actors": actors}

    @endpoint
    def stacks(self, full: bool = False) -> str:
        """Every thread's current Python stack and the event loop's pending tasks', the
        user's first (``full``: amesh's own frames too; see
        :mod:`amesh._runtime._stacks`)."""
        return format_stacks(full)

    @endpoint
    def adopt(self) -> int:
        """The caller owns this worker from now on (a controller that took over a
        persistent mesh): heartbeats, death notices and failure reports go to it.
        Returns the pid."""
        ctx = call_context.get()
        assert ctx is not None
        if self._adopt is None:
            raise RuntimeError("this process cannot change its owner")
        self._adopt(ctx.sender)
        return current_runtime().pid

    @endpoint
    def shutdown(self) -> None:
        """Let the worker exit."""
        self._shutdown.set()


class ControllerAgent(Actor):
    """Lives under :data:`CONTROLLER_KEY` in a controller once it runs a mesh: answers
    ``amesh logs``, and ``amesh stacks`` for ranks whose event loop does not."""

    def __init__(self) -> None:
        #: this controller's running meshes (ProcMeshes, which sit above this layer)
        self.meshes: weakref.WeakSet[Any] = weakref.WeakSet()

    @endpoint
    def logs(self, name: str, n: int = 100, since: int | None = None) -> tuple[list[str], int]:
        """The last ``n`` lines of output of this controller's mesh ``name``, or those
        since ``since``; see :meth:`Outputs.recent <amesh._runtime._output.Outputs.recent>`."""
        return current_runtime().outputs.recent(name, n, since)

    @endpoint(concurrent=True)
    async def stacks(self, name: str, slot: int, full: bool = False) -> str:
        """The stacks of process ``slot`` of this controller's mesh ``name``, taken by a
        signal (its event loop did not answer ``amesh stacks``)."""
        for mesh in list(self.meshes):
            if mesh.name == name and mesh.listing() is not None:
                text: str = await mesh._stacks_by_signal(slot, full)
                return text
        raise LookupError(f"this controller runs no mesh named {name!r}")

    @endpoint
    def holder(self, name: str) -> str | None:
        """Whether this controller holds persistent mesh ``name``: its pid and host
        (how another controller's refusal names it), else None."""
        if any(self._held(name)):
            return f"pid {os.getpid()} on {socket.gethostname()}"
        return None

    @endpoint
    def let_go(self, name: str, by: str) -> bool:
        """Let go of persistent mesh ``name``: the controller ``by`` (its pid and
        host) takes it over. Whether this controller held it."""
        return any([mesh._let_go(by) for mesh in self._held(name)])

    def _held(self, name: str) -> list[Any]:
        return [
            mesh
            for mesh in list(self.meshes)
            if mesh.name == name and mesh.persistent and mesh.listing() is not None
        ]


def serve_controller(rt: Any, mesh: Any) -> None:
    """Run a :class:`ControllerAgent` in ``rt`` (once), which answers for ``mesh`` (a
    running ProcMesh) too."""
    inst = rt.dispatch.actors.get(CONTROLLER_KEY)
    if inst is None:
        agent = ControllerAgent()
        inst = ActorInstance(
            rt, CONTROLLER_KEY, CONTROLLER_KEY, agent, handlers_of(ControllerAgent), "", 0
        )
        rt.add_actor(inst)
    inst.obj.meshes.add(mesh)
