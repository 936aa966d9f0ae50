"""ProcMesh: worker processes with named dimensions, and the actor meshes on them.

Two ways to own one:

- ``async with ProcMesh(...) as procs:`` is a supervision scope in the structured
  concurrency sense: an unhandled failure (a process dies or stops answering, an actor
  fails outside a call) cancels the body wherever it awaits, and is raised at the
  block's exit as one :class:`SupervisionError`.
- ``procs = await ProcMesh(...)`` (or ``await this_host().spawn_procs(...)``) inside an
  actor gives a mesh that the actor owns: it lives until the actor stops, and its
  failures go to the actor's ``__supervise__``; unhandled, the actor fails and reports
  to its own owner. At the controller, the mesh lives until ``amesh.run`` returns and an
  unhandled failure cancels the ``amesh.run`` body.

Leaving stops the actors (``__cleanup__`` runs), then the processes, each wait
bounded, with a kill last.

This class is the user-facing facade; the work is done by
:class:`~amesh._mesh._lifecycle.Lifecycle` (starting and stopping processes and
actors) and :class:`~amesh._mesh._supervisor.MeshSupervisor` (failure detection,
restarts, escalation).
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Generator, Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from . import _codec
from ._actor import Actor
from ._actor_mesh import ActorMesh
from ._config import default_fanout, default_transport, env_float
from ._errors import ActorError, Failure, SupervisionError
from ._mesh._host import Host, default_host
from ._mesh._lifecycle import STOP_ACTORS_TIMEOUT, Lifecycle, MeshState, Spawned
from ._mesh._supervisor import MeshSupervisor
from ._proc_agent import AGENT_KEY, ProcAgent
from ._runtime._context import call_context, runtime_var
from ._runtime._mailbox import ActorInstance
from ._runtime._runtime import (
    Runtime,
    current_runtime,
    is_supervision,
    open_runtime,
    pass_cancellation,
)
from ._shape import Shape
from ._supervision import RestartPolicy, Supervisor, restart_policy
from ._transport import open_transport
from ._value_mesh import MeshView, ValueMesh

__all__ = ["ProcMesh", "default_transport"]

A = TypeVar("A", bound=Actor)
log = logging.getLogger("amesh.mesh")


class ProcMesh(MeshView):
    """Worker processes with named dimensions, e.g. ``ProcMesh(per_host={"gpus": 4})``.

    Enter it (``async with``) for a supervision scope, or ``await`` it inside an actor
    for a mesh that the actor owns. Starting launches the processes concurrently.
    Slicing gives views that share the processes.

    Args:
        per_host: ``{dim: size}`` of processes on the host.
        host: where the processes run; this machine by default.
        env: extra environment variables for the workers.
        supervise: called with each :class:`~amesh.Failure` of this mesh (sync or
            async); return True when handled. Without it, failures go to the owning
            actor's ``__supervise__``, or escalate.
        heartbeat_period: seconds between a worker's heartbeats
            (``AMESH_HEARTBEAT_PERIOD``, default 0.5).
        heartbeat_timeout: a worker silent this long is declared failed and killed
            (``AMESH_HEARTBEAT_TIMEOUT``, default 5). A heartbeat proves that the
            process is scheduled (not stopped, not frozen) and that its main thread is
            not stuck in the kernel, not that its event loop makes progress: a handler
            busy in Python or in a long C call is alive (see :mod:`amesh._worker`).
        fanout: calls and broadcasts to a mesh of more than ``fanout`` processes go
            down a relay tree of the workers with this fan-out, and replies come back
            up it in batches (``AMESH_FANOUT``, default 16; 0 sends to every rank
            directly).
    """

    def __init__(
        self,
        per_host: Mapping[str, int] | None = None,
        *,
        host: Host | None = None,
        env: Mapping[str, str] | None = None,
        supervise: Supervisor | None = None,
        heartbeat_period: float | None = None,
        heartbeat_timeout: float | None = None,
        fanout: int | None = None,
    ) -> None:
        self._fanout = default_fanout() if fanout is None else fanout
        if self._fanout < 0 or self._fanout == 1:
            raise ValueError(f"fanout must be 0 (no tree) or at least 2, got {self._fanout}")
        self._shape = Shape.from_sizes(per_host if per_host is not None else {"procs": 1})
        self._host: Host = host or default_host()
        #: processes per host, when the host places them on several machines
        self._group: int = getattr(self._host, "per_host", 0)
        self._env = dict(env or {})
        self._supervise = supervise
        self._hb_period = heartbeat_period or env_float("AMESH_HEARTBEAT_PERIOD", 0.5)
        self._hb_timeout = heartbeat_timeout or env_float("AMESH_HEARTBEAT_TIMEOUT", 5.0)
        if self._hb_period <= 0 or self._hb_timeout <= self._hb_period:
            raise ValueError("need 0 < heartbeat_period < heartbeat_timeout")
        self._life = Lifecycle(
            self._host, self._env, self._hb_period, f"ProcMesh {self.sizes}", self._hb_timeout
        )
        self._sup: MeshSupervisor | None = None
        self._state: MeshState | None = None
        self._stack: AsyncExitStack | None = None
        self._root = True
        self._scoped = False
        self._owner: ActorInstance | None = None

    def _with_shape(self, shape: Shape) -> ProcMesh:
        view = ProcMesh.__new__(ProcMesh)
        view.__dict__.update(self.__dict__)
        view._shape = shape
        view._state = self._live()
        view._root = False
        return view

    def __repr__(self) -> str:
        return f"<ProcMesh {self.sizes}>"

    def _live(self) -> MeshState:
        if self._state is None:
            raise RuntimeError(
                "this ProcMesh is not running: use `async with ProcMesh(...)` or "
                "`procs = await ProcMesh(...)`"
            )
        if self._state.closing:
            raise RuntimeError("this ProcMesh is shutting down")
        return self._state

    @property
    def pids(self) -> list[int]:
        """The OS process ids, in rank order."""
        st = self._live()
        return [st.procs[s].pid for s in self._shape.slots]

    @property
    def restarts(self) -> int:
        """How many restarts the restart policies of this mesh have done."""
        return self._live().restarts

    async def ready(self) -> None:
        """Wait until no restart is in progress (returns at once when healthy)."""
        st = self._live()
        while st.restarting:
            await st.restarted.wait()

    async def statistics(self) -> ValueMesh[dict[str, Any]]:
        """Each worker's runtime counters (frames dropped, bad versions, calls, ...)."""
        return await self._agents(self._live()).statistics.call()

    # -- starting -----------------------------------------------------------------------

    def _check_fresh(self) -> None:
        if not self._root:
            raise RuntimeError("a slice of a ProcMesh cannot be started; start the mesh")
        if self._state is not None:
            raise RuntimeError("this ProcMesh was already started")

    async def __aenter__(self) -> ProcMesh:
        self._check_fresh()
        self._scoped = True
        ctx = call_context.get()
        self._owner = ctx.instance if ctx is not None else None
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            rt = runtime_var.get()
            if rt is None or rt.closed:
                scheme, host = default_transport()
                rt = await stack.enter_async_context(
                    open_runtime(lambda: open_transport(scheme, host=host))
                )
            tg = await stack.enter_async_context(anyio.create_task_group())
            await self._start(rt, tg)
        except BaseException as exc:
            await stack.__aexit__(*pass_cancellation(type(exc), exc, exc.__traceback__))
            raise
        self._stack = stack
        return self

    def __await__(self) -> Generator[Any, None, ProcMesh]:
        return self._start_owned().__await__()

    async def _start_owned(self) -> ProcMesh:
        self._check_fresh()
        rt = current_runtime()
        ctx = call_context.get()
        owner = ctx.instance if ctx is not None else None
        if owner is not None and owner.tg is not None:
            self._owner = owner
            await self._start(rt, owner.tg)
            owner.owned.append(self)
        else:
            await self._start(rt, rt.task_group)
            rt.owned.append(self)
        return self

    async def _start(self, rt: Runtime, tg: TaskGroup) -> None:
        # Shared-memory segments of processes that ended without cleaning up: a killed
        # controller's workers die with it, so nobody else ever removes them. Once per
        # mesh (restarts need not look again).
        _codec.sweep_segments()
        handles = await self._life.start_procs(rt, list(range(len(self._shape))))
        st = self._state = MeshState(rt, tg, handles)
        self._sup = MeshSupervisor(
            self._life.label,
            self._life,
            self._supervise,
            self._owner,
            self._scoped,
            self._hb_period,
            self._hb_timeout,
        )
        self._sup.start(st)

    # -- stopping -------------------------------------------------------------------------

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        st = self._state
        stack = self._stack
        assert st is not None and stack is not None
        remote = isinstance(exc, ActorError)
        with anyio.CancelScope(shield=True):
            if remote and self._sup is not None:
                await self._sup.settle(st)
            await self._life.shutdown(st)
        passed = pass_cancellation(exc_type, exc, tb)
        suppressed = bool(await stack.__aexit__(*passed)) and passed[1] is not None
        if st.unhandled and (exc is None or suppressed or remote or is_supervision(exc)):
            # An endpoint's error that escapes while a process of the mesh is dead is
            # most often its consequence (a collective whose peer died): the failure
            # is what the owner must see, with the error as its cause.
            failures = list(st.unhandled)
            error = SupervisionError(
                f"{len(failures)} supervision failure(s) in ProcMesh {self.sizes}: "
                + "; ".join(str(f).splitlines()[0] for f in failures),
                failures,
            )
            if remote:
                raise error from exc
            raise error
        return suppressed

    async def stop(self) -> None:
        """Stop every actor and process of this mesh (idempotent).

        An ``async with`` mesh stops at the block's exit; an awaited one stops with
        its owner, or earlier through this method.
        """
        if not self._root:
            raise RuntimeError("stop the ProcMesh itself, not a slice of it")
        st = self._state
        if st is None or st.closing:
            return
        with anyio.CancelScope(shield=True):
            await self._life.shutdown(st)
        rt = st.runtime
        if self in rt.owned:
            rt.owned.remove(self)
        if self._owner is not None and self in self._owner.owned:
            self._owner.owned.remove(self)

    def _agents(self, st: MeshState) -> ActorMesh[ProcAgent]:
        return ActorMesh(AGENT_KEY, AGENT_KEY, ProcAgent, self._shape, st.addrs)

    # -- actors -------------------------------------------------------------------------

    async def spawn(
        self,
        name: str,
        actor_class: type[A],
        *args: Any,
        restart: RestartPolicy | str | None = None,
        **kwargs: Any,
    ) -> ActorMesh[A]:
        """Spawn one ``actor_class(*args, **kwargs)`` per rank of this mesh.

        Returns after ``__init__`` ran on every rank.

        Args:
            name: the actor mesh's name, unique among this ProcMesh's live meshes.
            actor_class: a subclass of :class:`~amesh.Actor`.
            restart: a :class:`~amesh.RestartPolicy` (or ``"one_for_one"`` /
                ``"one_for_all"``): restart failed processes instead of escalating.

        Raises:
            TypeError: ``actor_class`` is not an Actor, or the arguments do not fit its
                ``__init__`` (nothing is sent).
            ValueError: a live actor mesh of this ProcMesh already has ``name``.
            SupervisionError: ``__init__`` raised on some rank; its ``__cause__`` is the
                :class:`ActorError` with the remote traceback.
        """
        st = self._live()
        policy = restart_policy(restart)
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn needs a subclass of amesh.Actor, got {actor_class!r}")
        if not isinstance(name, str) or not name or len(name) > 1000:
            raise ValueError(
                f"an actor mesh needs a name of 1 to 1000 characters, not {name!r:.60}"
            )
        if any(s.mesh.name == name for s in st.spawned.values()):
            raise ValueError(f"this ProcMesh already has an actor mesh named {name!r}")
        try:
            inspect.signature(actor_class).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{actor_class.__qualname__}(): {exc}") from None
        payload = _codec.dumps((actor_class, args, kwargs))
        key = f"{name}-{uuid.uuid4().hex[:12]}"
        mesh = ActorMesh(name, key, actor_class, self._shape, st.addrs, self._fanout, self._group)
        mesh._owner = self
        spawned = Spawned(mesh, payload, policy)
        st.spawned[key] = spawned
        assert self._sup is not None
        st.runtime.failure_handlers[key] = self._sup.on_actor_failure
        try:
            await self._life.spawn_ranks(st, spawned, None)
        except ActorError as exc:
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_ACTORS_TIMEOUT):
                try:
                    await self._agents(st).stop_actor.call(key)
                except (ActorError, SupervisionError):
                    pass
            del st.spawned[key]
            st.runtime.failure_handlers.pop(key, None)
            raise SupervisionError(
                f"{actor_class.__qualname__}.__init__ failed for actor mesh {name!r}: {exc}",
                [Failure(f"actor {name!r}", int(exc.point.get("rank", 0)), None, str(exc))],
            ) from exc
        return mesh

    async def _stop_actor_mesh(self, mesh: ActorMesh[Any]) -> None:
        st = self._live()
        if mesh.key not in st.spawned:
            raise ValueError(f"{mesh!r} is not owned by this ProcMesh (or already stopped)")
        del st.spawned[mesh.key]
        alive = [p for p in st.procs if p.addr not in st.runtime.dead]
        await self._life.agents_of(alive).stop_actor.call(mesh.key)
        st.runtime.failure_handlers.pop(mesh.key, None)
