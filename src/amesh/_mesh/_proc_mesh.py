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
import os
import re
import uuid
from collections.abc import Generator, Iterable, Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, TypeVar

import anyio
import sniffio
from anyio.abc import TaskGroup

from .. import _reload, _wire
from .._config import default_transport, for_mesh, heartbeats, warn_unknown
from .._config import settings as process_settings
from .._errors import ActorError, Failure, SupervisionError
from .._model import (
    AGENT_KEY,
    Actor,
    ActorMesh,
    MeshView,
    ProcAgent,
    RestartPolicy,
    Supervisor,
    ValueMesh,
    ranks_text,
    restart_policy,
    serve_controller,
    unpicklable,
)
from .._runtime import (
    ActorInstance,
    Op,
    Runtime,
    bridged,
    bridged_always,
    call_context,
    current_runtime,
    is_supervision,
    open_runtime,
    output_mode,
    pass_cancellation,
    runtime_var,
)
from .._shape import Shape
from .._tracebacks import hide_amesh_frames
from .._transport import open_transport
from ._host import Holder, Host, ProcHandle, default_host, persistent_host
from ._lifecycle import STOP_ACTORS_TIMEOUT, Lifecycle, MeshState, Spawned, checked_env
from ._persistent import Detacher, listing_of, named_actor_mesh, record_of, spawned_from
from ._registry import forget as registry_forget
from ._registry import update as registry_update
from ._supervisor import MeshSupervisor, unhandled_error

__all__ = ["ProcMesh", "default_transport"]

A = TypeVar("A", bound=Actor)
log = logging.getLogger("amesh.mesh")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")


class ProcMesh(MeshView):
    """Worker processes with named dimensions, e.g. ``ProcMesh(per_host={"gpus": 4})``.

    Enter it (``async with``) for a supervision scope, or ``await`` it inside an actor
    for a mesh that the actor owns. Starting launches the processes concurrently.
    Slicing gives views that share the processes. Arguments left None take the mesh's
    ``settings``, else amesh's (:func:`amesh.configure`, else ``AMESH_*``;
    docs/guides/configuration.md).

    Args:
        per_host: ``{dim: size}`` of processes on the host.
        host: where the processes run; this machine by default.
        env: extra environment variables for the workers (an ``AMESH_*`` one wins
            over the setting given to :func:`amesh.configure`, not over ``settings``);
            a name with ``=`` or NUL, or a value that is not a str without NUL, raises
            ValueError here.
        supervise: called with each :class:`~amesh.Failure` of this mesh (sync or
            async); return True when handled. Without it, failures go to the owning
            actor's ``__supervise__``, or escalate.
        heartbeat_period: seconds between a worker's heartbeats
            (``AMESH_HEARTBEAT_PERIOD``, default 0.5; unset, N/512 for a mesh of N >
            256 processes, so the controller hears about 512 a second at most).
        heartbeat_timeout: a worker silent this long is declared failed and killed
            (``AMESH_HEARTBEAT_TIMEOUT``, default 5; unset, at least 4 periods). A
            heartbeat proves that the process is scheduled (not stopped, not frozen)
            and that its main thread is not stuck in the kernel, not that its event
            loop makes progress: a handler busy in Python or in a long C call is alive
            (see :mod:`amesh._worker`).
        fanout: calls and broadcasts to a mesh of more than ``fanout`` processes go
            down a relay tree of the workers with this fan-out, and replies come back
            up it in batches (``AMESH_FANOUT``, default 16; 0 sends to every rank
            directly).
        name: the mesh's name (letters, digits, ``._-``); a persistent mesh needs one.
        persistent: the processes outlive this controller, held by a host agent
            (this machine's local agent, started on demand, unless ``host`` is a
            :class:`~amesh.HostMesh`'s), until :meth:`stop` or ``amesh stop NAME``.
            Leaving its owner (the ``async with`` block, the actor, ``amesh.run``)
            only lets go of it. Another controller takes it over with
            :func:`amesh.attach_mesh`. Its processes are started with the
            local key of persistent meshes (see :mod:`amesh._hosts._home`).
        output: what becomes of the workers' stdout, stderr, warnings and logging
            (``AMESH_OUTPUT``, default ``"folded"``): printed here, each line after
            its actor mesh's name and the actor's rank (``[trainers 3] ...``; outside
            handlers, this mesh's name, ``procs`` by default, and the process's slot),
            the same line from several ranks once (``[trainers 0-15] ...``);
            ``"raw"``: every line as it comes; ``"off"``: dropped (see
            :mod:`amesh._runtime._output`).
        backend: the event loop of the workers, ``"asyncio"`` (with uvloop) or
            ``"trio"``, so that endpoints may use that library's API; by default the
            controller's own (the loop that starts the mesh).
        settings: amesh settings of this mesh's workers, by name
            (``{"heartbeat_timeout": 60, "send_window": 256}``), over those given to
            :func:`amesh.configure` (one given here and as an argument above is refused).
            Only the settings marked "mesh" in docs/guides/configuration.md: the
            others belong to a whole process. The controller supervises the mesh
            (heartbeats), sends to it (fanout) and prints its output as they say; its
            workers take them all (their own sends, their tracebacks, their logging).
            An unknown name, a setting of the process, or a bad value raises
            :class:`~amesh.ConfigError` here, naming it.
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
        name: str | None = None,
        persistent: bool = False,
        output: str | None = None,
        backend: str | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        if backend not in (None, "asyncio", "trio"):
            raise ValueError(f"backend must be 'asyncio' or 'trio', not {backend!r}")
        self._backend = backend
        if name is not None and not _NAME.fullmatch(name):
            raise ValueError(
                f"a mesh name has 1 to 100 letters, digits, '.', '_' or '-', not {name!r:.60}"
            )
        if persistent and name is None:
            raise ValueError("a persistent ProcMesh needs a name (name=...)")
        holder = getattr(host, "mesh_name", None) == name
        if persistent and host is not None and not holder and host is not default_host():
            raise ValueError(
                "a persistent ProcMesh runs on host agents: leave host= out (this "
                "machine's agent) or use hosts.spawn_procs(..., persistent=True)"
            )
        self.name = name
        self._persistent = persistent
        self._detacher: Detacher | None = None
        given = {
            "fanout": fanout,
            "heartbeat_period": heartbeat_period,
            "heartbeat_timeout": heartbeat_timeout,
            "output": output,
        }
        own = for_mesh(settings or {}, given)
        fanout = own.get("fanout", fanout)
        self._fanout = process_settings().fanout if fanout is None else fanout
        if self._fanout < 0 or self._fanout == 1:
            raise ValueError(f"fanout must be 0 (no tree) or at least 2, got {self._fanout}")
        self._shape = Shape.from_sizes(per_host if per_host is not None else {"procs": 1})
        self._host: Host = host or default_host()
        #: processes per host, when the host places them on several machines
        self._group: int = getattr(self._host, "per_host", 0)
        self._env = checked_env(env or {})
        self._supervise = supervise
        self._hb_period, self._hb_timeout = heartbeats(
            len(self._shape),
            own.get("heartbeat_period", heartbeat_period),
            own.get("heartbeat_timeout", heartbeat_timeout),
        )
        warn_unknown(stacklevel=2)
        self._life = Lifecycle(
            self._host,
            self._env,
            self._hb_period,
            f"ProcMesh {self.sizes}",
            self._hb_timeout,
            output=output_mode(own.get("output", output)),
            name=name or "procs",
            settings=own,
        )
        self._sup: MeshSupervisor | None = None
        self._state: MeshState | None = None
        #: why this controller let go of this persistent mesh: another took it over
        #: (its actor meshes raise it on every call, see :meth:`_let_go`); else None
        self._taken_over: str | None = None
        self._stack: AsyncExitStack | None = None
        self._root = True
        self._scoped = False
        self._owner: ActorInstance | None = None
        #: how long :meth:`spawn` waits for ``__init__`` (see :meth:`options`)
        self._spawn_timeout: float | None = None

    def _with_shape(self, shape: Shape) -> ProcMesh:
        view = ProcMesh.__new__(ProcMesh)
        view.__dict__.update(self.__dict__)
        view._shape = shape
        view._state = self._live()
        view._root = False
        return view

    def __repr__(self) -> str:
        named = f" {self.name!r}" if self.name else ""
        return f"<ProcMesh{named} {self.sizes}>"

    @property
    def persistent(self) -> bool:
        """Whether the processes outlive their controller (see ``persistent=``)."""
        return self._persistent

    def _live(self) -> MeshState:
        if self._state is None:
            raise RuntimeError(
                "this ProcMesh is not running: use `async with ProcMesh(...)` or "
                "`procs = await ProcMesh(...)`"
            )
        if self._taken_over is not None:
            raise RuntimeError(self._taken_over)
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

    @bridged
    async def ready(self) -> None:
        """Wait until no restart is in progress (returns at once when healthy)."""
        st = self._live()
        while st.restarting:
            await st.restarted.wait()

    @bridged
    async def statistics(self) -> ValueMesh[dict[str, Any]]:
        """Each worker's runtime counters (frames dropped, bad versions, calls, ...)."""
        return await self._agents(self._live()).statistics.call()

    @bridged
    async def status(self) -> ValueMesh[dict[str, Any]]:
        """What each worker is doing: its pid, and per actor the actor mesh's name, the
        rank, how many messages wait in its mailbox (``queued``), how many handlers
        run (``running``) and the endpoints they run (``now``); see
        :meth:`ProcAgent.status <amesh._model._process_actor.ProcAgent.status>`."""
        return await self._agents(self._live()).status.call()

    @bridged
    async def stacks(self, rank: int | None = None, *, full: bool = False) -> str | ValueMesh[str]:
        """The current Python stacks of the workers (every thread's; the pending tasks'
        on asyncio and trio), as text: of the process of ``rank`` (in this mesh or
        slice), else a :class:`ValueMesh` of every process's.

        The threads and tasks that run the user's code come first, with amesh's and
        the standard library's frames folded (``full=True`` or ``AMESH_DEBUG=1``: all
        of them). A worker whose event loop does not answer within 2 s (a long
        synchronous call) has its threads' stacks taken by a signal instead, and the
        text says so.
        """
        st = self._live()
        full = full or process_settings().debug
        if rank is not None and not 0 <= rank < len(self._shape):
            raise IndexError(f"rank {rank} is not in {self!r}")
        slots = self._shape.slots if rank is None else [self._shape.slots[rank]]
        texts = await self._life.stacks(st, slots, full)
        return texts[0] if rank is not None else ValueMesh.of(self._shape, texts)

    async def _stacks_by_signal(self, slot: int, full: bool = False) -> str:
        """The stacks of process ``slot``, taken without its event loop (``amesh
        stacks``, through :class:`~amesh._model._process_actor.ControllerAgent`)."""
        st = self._live()
        if not 0 <= slot < len(st.procs):
            raise IndexError(f"{self!r} has no process {slot}")
        return await st.procs[slot].stacks_by_signal(full)

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
            if rt is None or rt.closed:  # a controller's first mesh, under asyncio.run
                if not process_settings().debug:
                    hide_amesh_frames()
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
        return Op(ProcMesh._start_owned, (self,), {}, check_failed=False).__await__()

    def get(self, timeout: float | None = None) -> ProcMesh:
        """Start the processes, blocking this thread (synchronous code, outside any
        runtime: the session owns the mesh); see :class:`~amesh.Op`."""
        return Op(ProcMesh._start_owned, (self,), {}, check_failed=False).get(timeout)

    def _session_failure(self) -> SupervisionError | None:
        """The unhandled failures of a mesh the session owns (it has no body to cancel:
        every later use raises them)."""
        st = self._state
        if st is None or not st.unhandled or st.runtime.on_root_failure is None:
            return None
        failures = list(st.unhandled)
        return SupervisionError(
            f"{len(failures)} unhandled supervision failure(s) in {self!r}: "
            + "; ".join(str(f).splitlines()[0] for f in failures)
            + " (stop it and start another)",
            failures,
        )

    async def _start_owned(self) -> ProcMesh:
        self._check_fresh()
        rt = current_runtime()
        ctx = call_context.get()
        owner = ctx.instance if ctx is not None else None
        if owner is not None and owner.tg is not None:
            self._owner = owner
            await self._start(rt, owner.tg)
        else:
            await self._start(rt, rt.task_group)
        self._own(rt)
        return self

    async def _start(self, rt: Runtime, tg: TaskGroup) -> None:
        # Shared-memory segments of processes that ended without cleaning up: a killed
        # controller's workers die with it, so nobody else ever removes them. Once per
        # mesh (restarts need not look again).
        _wire.sweep_segments()
        self._life.backend = self._backend or sniffio.current_async_library()
        if self._persistent and getattr(self._host, "mesh_name", None) != self.name:
            assert self.name is not None
            self._set_host(await persistent_host(self.name, len(self._shape)))
        try:
            handles = await self._life.start_procs(rt, list(range(len(self._shape))))
        except BaseException:
            await self._life.close_host()  # (no mesh to stop: nothing else would)
            raise
        st = self._state = MeshState(rt, tg, handles)
        self._taken_over = None
        self._supervise_state(st)
        st.publish = self._publish
        await self._publish()

    def _set_host(self, host: Host) -> None:
        self._host = self._life.host = host
        self._group = getattr(host, "per_host", 0)

    def _supervise_state(self, st: MeshState) -> None:
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

    # -- persistent meshes ----------------------------------------------------------

    async def _publish(self) -> None:
        """Record the processes and actor meshes: in this machine's registry of live
        meshes (``amesh list``), and a persistent mesh's with its host agents."""
        st = self._state
        if st is None or st.closing:
            return
        if self._persistent:
            holder: Holder = self._host  # type: ignore[assignment]
            hb = (self._hb_period, self._hb_timeout)
            await holder.hold(
                record_of(self.name, self._shape, self._fanout, hb, self._life.settings, st)
            )
        serve_controller(st.runtime, self)  # for `amesh logs` and `amesh stacks`
        registry_update(self)

    def listing(self) -> dict[str, Any] | None:
        """This mesh as ``amesh list`` finds it (see :mod:`amesh._mesh._registry`)."""
        st = self._state
        if st is None or st.closing:
            return None
        return listing_of(self._life.name, self._shape, st, self._persistent, self._life.output)

    async def _adopt(self, handles: list[ProcHandle], actors: list[dict[str, Any]]) -> None:
        """Own ``handles`` (the running processes of this persistent mesh, which
        another controller started) and its actor meshes ``actors`` (from its record)."""
        self._check_fresh()
        rt = current_runtime()
        ctx = call_context.get()
        owner = ctx.instance if ctx is not None else None
        tg = rt.task_group
        if owner is not None and owner.tg is not None:
            self._owner, tg = owner, owner.tg
        st = self._state = MeshState(rt, tg, handles)
        self._taken_over = None
        st.spawned.update(
            spawned_from(actors, self._shape, st.addrs, self._fanout, self._group, self)
        )
        self._supervise_state(st)
        assert self._sup is not None
        for key in st.spawned:
            rt.handle_failures(key, self._sup.on_actor_failure)
        self._life.attach_output(rt, handles)
        running = [p for p in handles if p.returncode is None]
        if running:
            # from now on their heartbeats, deaths, failure reports and output come here
            await self._life.agents_of(running).adopt.call()
        self._own(rt)
        st.publish = self._publish
        await self._publish()

    def _own(self, rt: Runtime) -> None:
        """Be stopped (a persistent mesh: let go of) with the owner."""
        owned: Any = self
        if self._persistent:
            owned = self._detacher = Detacher(self._detach)
        if self._owner is not None:
            self._owner.owned.append(owned)
        else:
            rt.own(owned)

    def _detach(self) -> None:
        """Let go of a persistent mesh without stopping it (its owner is leaving)."""
        st = self._state
        if st is not None and not st.closing:
            self._life.detach(st, self._scoped)
            registry_forget(self)

    def _let_go(self, by: str) -> bool:
        """Another controller (``by``: its pid and host) takes this persistent mesh
        over: let go of it (its workers run on, and this controller no longer watches
        them), and make every later use of this mesh and its actor meshes raise a
        RuntimeError that says so. Whether this controller held it."""
        st = self._state
        if st is None or st.closing:
            return False
        self._taken_over = (
            f"persistent mesh {self.name!r} was taken over by the controller {by} "
            "(attach_mesh(..., takeover=True)): this controller let go of it"
        )
        log.warning("%s", self._taken_over)
        self._detach()
        return True

    @bridged
    async def actor_mesh(self, name: str, actor_class: type[A] | None = None) -> ActorMesh[A]:
        """The live actor mesh of this ProcMesh named ``name`` (one taken over with a
        persistent mesh, or one spawned here).

        Args:
            actor_class: its class, when this process cannot load the one recorded
                with the mesh (a class of a module it cannot import).

        Raises:
            LookupError: there is none.
        """
        st = self._live()
        found: ActorMesh[A] = named_actor_mesh(
            st, name, actor_class, self._fanout, self._group, self, repr(self)
        )
        return found

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
            if self._persistent:
                self._detach()
            else:
                await self._life.shutdown(st)
            registry_forget(self)
        passed = pass_cancellation(exc_type, exc, tb)
        suppressed = bool(await stack.__aexit__(*passed)) and passed[1] is not None
        if st.unhandled and (exc is None or suppressed or remote or is_supervision(exc)):
            # An endpoint's error that escapes while a process of the mesh is dead is
            # most often its consequence (a collective whose peer died): the failure
            # is what the owner must see, with the error as its cause.
            error = unhandled_error(st.unhandled, f"ProcMesh {self.sizes}")
            # Not the body's cancellation as context: that is how the failure stopped
            # the body, amesh's business, not the user's.
            raise error from (exc if remote else None)
        return suppressed

    @bridged_always
    async def stop(self) -> None:
        """Stop every actor and process of this mesh (idempotent).

        An ``async with`` mesh stops at the block's exit; an awaited one stops with
        its owner, or earlier through this method. A persistent mesh stops only
        through this method (or ``amesh stop NAME``), and is forgotten by its agents.
        """
        if not self._root:
            raise RuntimeError("stop the ProcMesh itself, not a slice of it")
        st = self._state
        if st is None or st.closing:
            return
        with anyio.CancelScope(shield=True):
            await self._life.shutdown(st)
            registry_forget(self)
            if self._persistent:
                holder: Holder = self._host  # type: ignore[assignment]
                try:
                    await holder.release()
                except (ActorError, SupervisionError) as exc:
                    log.warning("forgetting persistent mesh %r: %s", self.name, exc)
        rt = st.runtime
        owned = self._detacher or self
        rt.disown(owned)
        if self._owner is not None and owned in self._owner.owned:
            self._owner.owned.remove(owned)

    def _agents(self, st: MeshState) -> ActorMesh[ProcAgent]:
        return ActorMesh(AGENT_KEY, AGENT_KEY, ProcAgent, self._shape, st.addrs)

    # -- actors -------------------------------------------------------------------------

    def options(self, *, timeout: float | None = None) -> ProcMesh:
        """This mesh with options for :meth:`spawn`, as endpoints take theirs:
        ``await procs.options(timeout=30).spawn("model", Model, path)``. (Options come
        first so that ``__init__`` stays free to have a ``timeout`` of its own.) A
        view of the same processes, as a slice is.

        Args:
            timeout: seconds ``spawn`` waits for every ``__init__`` to return; None
                waits for ever. A sync ``__init__`` blocks its process and cannot be
                interrupted: at the timeout the processes where it still runs are
                killed (see :meth:`spawn`).

        Raises:
            ValueError: ``timeout`` is negative.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        view = self._with_shape(self._shape)
        view._spawn_timeout = timeout
        return view

    @bridged
    async def spawn(
        self,
        name: str,
        actor_class: type[A],
        *args: Any,
        restart: RestartPolicy | str | None = None,
        replace: bool = False,
        **kwargs: Any,
    ) -> ActorMesh[A]:
        """Spawn one ``actor_class(*args, **kwargs)`` per rank of this mesh.

        Returns after ``__init__`` ran on every rank. A sync ``__init__`` blocks its
        process (its heartbeats go on; it handles nothing else) until it returns, and
        cannot be interrupted: bound it with ``procs.options(timeout=...)``. When the
        timeout passes, or the spawn is cancelled, the processes where ``__init__``
        still runs are killed and reported to supervision as failed (the ``cause``
        says why; a ``supervise=`` handler or restart policy may take them, else the
        failure escalates as any other), and the actor is stopped where it was
        constructed: nothing of the actor mesh is left.

        With ``replace=True``, a live actor mesh of this name is stopped first (its
        ``__cleanup__`` runs) and the new one takes its place on the same processes,
        which keep running, with their other actors and what they loaded: hot reload
        from a notebook, where a class redefined in a cell travels by value. Calls
        through handles of the replaced mesh fail with an error that says so. If the
        new class defines ``__reload__(self, old)``, it is called on each process
        where both run, after ``__init__``, with the replaced (stopped) actor, to take
        over its state.

        Args:
            name: the actor mesh's name, unique among this ProcMesh's live meshes.
            actor_class: a subclass of :class:`~amesh.Actor`.
            restart: a :class:`~amesh.RestartPolicy` (or ``"one_for_one"`` /
                ``"one_for_all"``): restart failed processes instead of escalating.
            replace: replace the live actor mesh named ``name``, if there is one.

        Raises:
            TypeError: ``actor_class`` is not an Actor, or the arguments do not fit its
                ``__init__`` (nothing is sent).
            ValueError: a live actor mesh of this ProcMesh already has ``name`` (and
                ``replace`` is false).
            SupervisionError: ``__init__`` raised on some rank; its ``__cause__`` is the
                :class:`ActorError` with the remote traceback.
            TimeoutError: ``__init__`` did not return within the timeout given to
                :meth:`options` on some ranks (named, with the actor mesh), whose
                processes were killed.
        """
        st = self._live()
        policy = restart_policy(restart)
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn needs a subclass of amesh.Actor, got {actor_class!r}")
        if not isinstance(name, str) or not name or len(name) > 1000:
            raise ValueError(
                f"an actor mesh needs a name of 1 to 1000 characters, not {name!r:.60}"
            )
        old = next((s.mesh for s in st.spawned.values() if s.mesh.name == name), None)
        if old is not None and not replace:
            raise ValueError(
                f"this ProcMesh already has an actor mesh named {name!r} "
                "(spawn(..., replace=True) replaces it)"
            )
        try:
            inspect.signature(actor_class).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{actor_class.__qualname__}(): {exc}") from None
        try:
            payload = _wire.dumps((actor_class, args, kwargs))
        except TypeError as exc:
            try:
                _wire.dumps(actor_class)
            except TypeError as bad:
                raise TypeError(
                    f"cannot pickle {actor_class.__qualname__}: {bad.__cause__ or bad}"
                ) from None
            raise unpicklable(args, kwargs, f"{actor_class.__qualname__}()", exc) from None
        if old is not None:
            hand_over = set(self._shape.slots) if hasattr(actor_class, "__reload__") else set()
            await self._life.stop_spawned(st, old, replaced=True, hand_over=hand_over)
        key = f"{name}-{uuid.uuid4().hex[:12]}"
        init = f"{actor_class.__qualname__}.__init__"
        mesh = ActorMesh(name, key, actor_class, self._shape, st.addrs, self._fanout, self._group)
        mesh._owner = self
        spawned = Spawned(mesh, payload, policy)
        st.spawned[key] = spawned
        assert self._sup is not None
        st.runtime.handle_failures(key, self._sup.on_actor_failure)
        answered: set[int] = set()
        timeout = self._spawn_timeout
        try:
            with anyio.move_on_after(timeout) as deadline:
                await self._life.spawn_ranks(st, spawned, None, answered=answered)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._life.abandon_spawn(
                    st, self._sup, spawned, answered, f"its spawn was cancelled while {init} ran"
                )
            raise
        except ActorError as exc:
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_ACTORS_TIMEOUT):
                try:
                    await self._agents(st).stop_actor.call(key)
                except (ActorError, SupervisionError):
                    pass
            del st.spawned[key]
            st.runtime.handle_failures(key, None)
            if old is not None and st.publish is not None:
                await st.publish()  # the replaced mesh is gone too
            raise SupervisionError(
                f"{actor_class.__qualname__}.__init__ failed for actor mesh {name!r}: {exc}",
                [Failure(f"actor {name!r}", int(exc.point.get("rank", 0)), None, str(exc))],
            ) from exc
        if deadline.cancelled_caught:
            stuck = await self._life.abandon_spawn(
                st,
                self._sup,
                spawned,
                answered,
                f"{init} did not return within {timeout:g} s (spawn timeout)",
            )
            whose = "whose process was" if len(stuck) == 1 else "whose processes were"
            raise TimeoutError(
                f"spawn of actor mesh {name!r}: {init} did not return within {timeout:g} s "
                f"on {ranks_text(stuck, len(self._shape))}, {whose} killed (a sync "
                "__init__ cannot be interrupted)"
            )
        if st.publish is not None:
            await st.publish()
        return mesh

    async def _stop_actor_mesh(self, mesh: ActorMesh[Any]) -> None:
        st = self._live()
        if mesh.key not in st.spawned:
            raise ValueError(f"{mesh!r} is not owned by this ProcMesh (or already stopped)")
        await self._life.stop_spawned(st, mesh)
        if st.publish is not None:
            await st.publish()

    @bridged
    async def sync_code(
        self, paths: Iterable[str | os.PathLike[str]] | None = None
    ) -> ValueMesh[list[str]]:
        """Push the controller's changed project modules to the workers, and reload
        them there: edit a ``.py`` file of the project and carry on with the same
        processes.

        The project's modules are the loaded modules whose file is under ``paths``
        (by default the current directory), except the running script and modules of
        the environment (``sys.prefix``, ``site-packages``) or of amesh. A worker
        reloads those it imported whose source differs from the controller's file (a
        content hash): from its own file when that already holds the controller's
        source (the same host, or a shared file system), else from the source sent,
        which its tracebacks then show. Nothing is written to a worker's disk, and
        modules a worker has not imported are left alone.

        Reloading is :func:`importlib.reload`'s: the module's code runs again in the
        same module object. Objects made before keep their old class, actors
        included: respawn those with ``replace=True`` to get the new code::

            await procs.sync_code()
            await procs.spawn("trainer", mymod.Trainer, replace=True)

        (``mymod.Trainer`` travels by reference and is looked up in the reloaded
        module; reload ``mymod`` in the controller too, ``importlib.reload(mymod)``,
        when endpoints were added.)

        Returns:
            The names of the modules each process reloaded.

        Raises:
            ActorError: a module failed to reload (an ``ImportError`` naming it).
        """
        st = self._live()
        sources = await anyio.to_thread.run_sync(_reload.project_sources, paths)
        agents = self._agents(st)
        versions = await agents.code_versions.call(list(sources))
        updates = [_reload.updates_for(sources, v) for v in versions.values()]
        if not any(updates):
            return ValueMesh.of(self, [[] for _ in updates])
        return await agents.load_code.call(ValueMesh.of(agents, updates))

    @bridged
    async def sync(self) -> ValueMesh[list[str]]:
        """Bring the workspace as it is now to the running processes of a mesh of an
        :class:`amesh.Environment`: each host gets the files that changed, and each
        process moves to the new tree and reloads the modules that changed, as
        :meth:`sync_code` does; returns their names. Processes started later start
        there. RuntimeError: no environment's mesh; ActorError: a reload failed.
        """
        st = self._live()
        return await self._life.move_to_workspace(self._agents(st), list(self._shape.slots))
