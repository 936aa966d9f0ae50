"""ProcMesh: a scope that owns worker processes and the actor meshes spawned on them.

``async with ProcMesh(...)`` is a supervision scope in the structured-concurrency
sense: when a process dies or an actor fails outside a call (a raising broadcast),
the body is cancelled wherever it awaits, and the failure is raised at the block's
exit as one :class:`SupervisionError`. Leaving the block stops the actors
(``__cleanup__`` runs), then the processes, each wait bounded, with a kill last.
"""

from __future__ import annotations

import inspect
import logging
import os
import uuid
from collections.abc import Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from . import _codec
from ._actor import Actor
from ._actor_mesh import ActorMesh
from ._errors import ActorError, SupervisionError
from ._hosts._local import LocalHost, ProcHandle, describe_exit, this_host
from ._proc_agent import AGENT_KEY, ProcAgent
from ._runtime._context import runtime_var
from ._runtime._runtime import Runtime, open_runtime, pass_cancellation
from ._shape import Shape
from ._transport import NngTransport
from ._value_mesh import MeshView
from ._wire import Failure

__all__ = ["ProcMesh", "default_transport"]

A = TypeVar("A", bound=Actor)
log = logging.getLogger("amesh.mesh")

#: Bounded waits of a polite shutdown, in seconds.
STOP_ACTORS_TIMEOUT = 5.0
EXIT_GRACE = 5.0


def default_transport() -> tuple[str, str]:
    """``(scheme, host)`` from ``AMESH_TRANSPORT`` (auto, abstract, ipc, tcp)."""
    scheme = os.environ.get("AMESH_TRANSPORT", "auto")
    host = os.environ.get("AMESH_HOST", "127.0.0.1")
    return scheme, host


def _is_supervision(exc: BaseException) -> bool:
    """True if ``exc`` is only a consequence of supervision failures.

    That is a SupervisionError, or a cancellation, or an exception group of them (a
    task group in the body collects the failed calls of its tasks).
    """
    kinds = (SupervisionError, anyio.get_cancelled_exc_class())
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(kinds)
        return rest is None
    return isinstance(exc, kinds)


class _State:
    """What a ProcMesh and all its views share."""

    def __init__(self, runtime: Runtime, tg: TaskGroup, procs: list[ProcHandle]) -> None:
        self.runtime = runtime
        self.tg = tg
        self.procs = procs
        self.addrs = tuple(p.addr for p in procs)
        self.actor_meshes: dict[str, ActorMesh[Any]] = {}
        self.failures: list[str] = []
        self.closing = False


class ProcMesh(MeshView):
    """Worker processes with named dimensions, e.g. ``ProcMesh(per_host={"gpus": 4})``.

    Use it as ``async with``: entering starts the processes (concurrently), leaving
    stops everything it owns. Slicing gives views that share the processes.

    Args:
        per_host: ``{dim: size}`` of processes on the host.
        host: where the processes run; this machine by default.
        env: extra environment variables for the workers.
    """

    def __init__(
        self,
        per_host: Mapping[str, int] | None = None,
        *,
        host: LocalHost | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._shape = Shape.from_sizes(per_host if per_host is not None else {"procs": 1})
        self._host = host or this_host()
        self._env = dict(env or {})
        self._state: _State | None = None
        self._stack: AsyncExitStack | None = None
        self._root = True

    def _with_shape(self, shape: Shape) -> ProcMesh:
        view = ProcMesh.__new__(ProcMesh)
        view._shape = shape
        view._host = self._host
        view._env = self._env
        view._state = self._live()
        view._stack = None
        view._root = False
        return view

    def __repr__(self) -> str:
        return f"<ProcMesh {self.sizes}>"

    def _live(self) -> _State:
        if self._state is None:
            raise RuntimeError("this ProcMesh is not running: use `async with ProcMesh(...)`")
        if self._state.closing:
            raise RuntimeError("this ProcMesh is shutting down")
        return self._state

    @property
    def pids(self) -> list[int]:
        """The OS process ids, in rank order."""
        st = self._live()
        return [st.procs[s].pid for s in self._shape.slots]

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> ProcMesh:
        if not self._root:
            raise RuntimeError("a slice of a ProcMesh cannot be entered; enter the mesh")
        if self._state is not None:
            raise RuntimeError("this ProcMesh was already started")
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            rt = runtime_var.get()
            scheme, host = default_transport()
            if rt is None or rt.closed:
                rt = await stack.enter_async_context(
                    open_runtime(lambda: NngTransport(scheme, host=host))
                )
            else:
                scheme = rt.address.split("://", 1)[0]
            tg = await stack.enter_async_context(anyio.create_task_group())
            procs: list[ProcHandle | None] = [None] * len(self._shape)

            async def start(i: int) -> None:
                procs[i] = await self._host.start_proc(rt, scheme, host, self._env)

            try:
                async with anyio.create_task_group() as starters:
                    for i in range(len(procs)):
                        starters.start_soon(start, i)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    for p in procs:
                        if p is not None:
                            p.process.kill()
                            await p.stop(0)
                raise
            handles = [p for p in procs if p is not None]
            self._state = _State(rt, tg, handles)
            for rank, handle in enumerate(handles):
                tg.start_soon(self._watch, handle, rank)
        except BaseException as exc:
            await stack.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._stack = stack
        return self

    async def _watch(self, handle: ProcHandle, rank: int) -> None:
        await handle.process.wait()
        st = self._state
        if st is None or st.closing or handle.expected_exit:
            return
        why = (
            f"process {handle.pid} (rank {rank} of ProcMesh {self.sizes}) "
            f"{describe_exit(handle.returncode or 0)}"
        )
        st.runtime.peer_failed(handle.addr, why)
        self._fail(why)

    def _on_actor_failure(self, failure: Failure) -> None:
        st = self._state
        if st is None:
            return
        mesh = st.actor_meshes.get(failure.actor)
        name = mesh.name if mesh is not None else failure.actor
        self._fail(f"actor {name!r} rank {failure.rank} (pid {failure.pid}): {failure.cause}")

    def _fail(self, why: str) -> None:
        st = self._state
        if st is None or st.closing:
            return
        log.error("supervision failure: %s", why)
        st.failures.append(why)
        st.tg.cancel_scope.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        st = self._state
        stack = self._stack
        assert st is not None and stack is not None
        with anyio.CancelScope(shield=True):
            await self._shutdown(st)
        suppressed = await stack.__aexit__(*pass_cancellation(exc_type, exc, tb))
        if st.failures:
            if exc is None or suppressed or _is_supervision(exc):
                failures = list(st.failures)
                raise SupervisionError(
                    f"{len(failures)} supervision failure(s) in ProcMesh {self.sizes}: "
                    + "; ".join(f.splitlines()[0] for f in failures),
                    failures,
                )
        return suppressed

    async def _shutdown(self, st: _State) -> None:
        rt = st.runtime
        alive = [p for p in st.procs if p.addr not in rt.dead and p.returncode is None]
        agents = self._agents_of(st, alive)
        with anyio.move_on_after(STOP_ACTORS_TIMEOUT):
            for key in list(st.actor_meshes):
                try:
                    await agents.stop_actor.call(key)
                except (ActorError, SupervisionError) as exc:
                    log.warning("stopping actor mesh %s: %s", key, exc)
                rt.failure_handlers.pop(key, None)
        st.closing = True
        for p in st.procs:
            p.expected_exit = True
        live = [p for p in st.procs if p.addr not in rt.dead and p.returncode is None]
        try:
            await self._agents_of(st, live).shutdown.broadcast()
        except Exception as exc:  # the processes are stopped below either way
            log.warning("asking workers to exit: %s", exc)
        async with anyio.create_task_group() as tg:
            for p in st.procs:
                tg.start_soon(p.stop, EXIT_GRACE)
        for p in st.procs:
            rt.peer_failed(p.addr, f"process {p.pid} was stopped")

    def _agents_of(self, st: _State, procs: list[ProcHandle]) -> ActorMesh[ProcAgent]:
        return ActorMesh(
            AGENT_KEY,
            AGENT_KEY,
            ProcAgent,
            Shape(["procs"], [len(procs)]),
            tuple(p.addr for p in procs),
        )

    # -- actors -------------------------------------------------------------------------

    async def spawn(
        self, name: str, actor_class: type[A], *args: Any, **kwargs: Any
    ) -> ActorMesh[A]:
        """Spawn one ``actor_class(*args, **kwargs)`` per rank of this mesh.

        Returns after ``__init__`` ran on every rank.

        Raises:
            TypeError: ``actor_class`` is not an Actor, or the arguments do not fit its
                ``__init__`` (nothing is sent).
            ValueError: a live actor mesh of this ProcMesh already has ``name``.
            SupervisionError: ``__init__`` raised on some rank; its ``__cause__`` is the
                :class:`ActorError` with the remote traceback.
        """
        st = self._live()
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn needs a subclass of amesh.Actor, got {actor_class!r}")
        if not isinstance(name, str) or not name:
            raise ValueError("an actor mesh needs a non-empty name")
        if any(m.name == name for m in st.actor_meshes.values()):
            raise ValueError(f"this ProcMesh already has an actor mesh named {name!r}")
        try:
            inspect.signature(actor_class).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{actor_class.__qualname__}(): {exc}") from None
        payload = _codec.dumps((actor_class, args, kwargs))
        key = f"{name}-{uuid.uuid4().hex[:12]}"
        mesh = ActorMesh(name, key, actor_class, self._shape, st.addrs)
        st.actor_meshes[key] = mesh
        st.runtime.failure_handlers[key] = self._on_actor_failure
        agents = ActorMesh(AGENT_KEY, AGENT_KEY, ProcAgent, self._shape, st.addrs)
        try:
            await agents.spawn_actor.call(key, name, payload, st.runtime.address)
        except ActorError as exc:
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_ACTORS_TIMEOUT):
                try:
                    await agents.stop_actor.call(key)
                except (ActorError, SupervisionError):
                    pass
            del st.actor_meshes[key]
            st.runtime.failure_handlers.pop(key, None)
            raise SupervisionError(
                f"{actor_class.__qualname__}.__init__ failed for actor mesh {name!r}: {exc}",
                [str(exc)],
            ) from exc
        return mesh

    async def stop(self, mesh: ActorMesh[Any]) -> None:
        """Stop an actor mesh early (``__cleanup__`` runs); its processes live on."""
        st = self._live()
        if mesh.key not in st.actor_meshes:
            raise ValueError(f"{mesh!r} is not owned by this ProcMesh (or already stopped)")
        del st.actor_meshes[mesh.key]
        alive = [p for p in st.procs if p.addr not in st.runtime.dead]
        await self._agents_of(st, alive).stop_actor.call(mesh.key)
        st.runtime.failure_handlers.pop(mesh.key, None)
