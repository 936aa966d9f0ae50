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
"""

from __future__ import annotations

import inspect
import logging
import os
import uuid
from collections.abc import Generator, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from . import _codec
from ._actor import Actor
from ._actor_mesh import ActorMesh
from ._errors import ActorError, Failure, SupervisionError
from ._hosts._local import Host, ProcHandle, describe_exit, this_host
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
from ._supervision import (
    RestartPolicy,
    RestartWindow,
    Supervisor,
    call_hook,
    call_supervisor,
    restart_policy,
)
from ._transport import open_transport
from ._value_mesh import MeshView, ValueMesh
from ._wire import FailureReport

__all__ = ["ProcMesh", "default_transport"]

A = TypeVar("A", bound=Actor)
log = logging.getLogger("amesh.mesh")

#: Bounded waits of a polite shutdown, in seconds.
STOP_ACTORS_TIMEOUT = 5.0
EXIT_GRACE = 5.0
#: The same waits once the mesh has failed: survivors are often stuck waiting on the
#: dead (a collective), so politeness is cut short.
FAILED_STOP_TIMEOUT = 1.0
FAILED_EXIT_GRACE = 1.0
#: A heartbeat monitor tick this much later than asked means this process's own loop
#: stalled (and could hear nobody): worker silence is counted from after the stall.
STALL_SLACK = 0.5
#: How long a worker whose link broke may take to exit before it is killed.
LINK_LOSS_GRACE = 1.0


def default_transport() -> tuple[str, str]:
    """``(scheme, host)`` from ``AMESH_TRANSPORT`` (auto, abstract, ipc, tcp)."""
    scheme = os.environ.get("AMESH_TRANSPORT", "auto")
    host = os.environ.get("AMESH_HOST", "127.0.0.1")
    return scheme, host


def _pid_alive(pid: int) -> bool:
    """False once ``pid`` has exited (gone, or a zombie not reaped yet); Linux /proc.

    Pids beyond any kernel's ``pid_max`` (in-process test workers) count as alive.
    """
    if pid >= 1 << 22:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # no /proc: assume alive, the watchers will tell
    return state not in ("Z", "X")


def default_fanout() -> int:
    """``AMESH_FANOUT`` (default 16; 0: no relay tree)."""
    raw = os.environ.get("AMESH_FANOUT", "16")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"AMESH_FANOUT must be an integer, not {raw!r}") from None


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass
class _Spawned:
    """How an actor mesh was made, so it can be made again on a restart."""

    mesh: ActorMesh[Any]
    payload: _codec.Payload
    policy: RestartPolicy | None


class _State:
    """What a ProcMesh and all its views share."""

    def __init__(self, runtime: Runtime, tg: TaskGroup, procs: list[ProcHandle]) -> None:
        self.runtime = runtime
        self.tg = tg
        self.procs = procs
        #: addresses by slot; ActorMesh handles share this list, so a restarted
        #: process is found at its new address
        self.addrs: list[str] = [p.addr for p in procs]
        self.spawned: dict[str, _Spawned] = {}
        self.unhandled: list[Failure] = []
        self.handled: list[Failure] = []
        #: pids whose failure went through _escalate, and who waits for the next one
        self.escalated: set[int | None] = set()
        self.escalation: anyio.Event | None = None
        self.closing = False
        self.closed = anyio.Event()
        self.restarting = 0
        self.restarted = anyio.Event()
        self.restarts = 0
        self.window = RestartWindow()
        #: set (and replaced) each time the heartbeat monitor has looked
        self._ticked = anyio.Event()

    def ticked(self) -> None:
        self._ticked.set()
        self._ticked = anyio.Event()

    async def monitor_tick(self) -> None:
        """Wait until the heartbeat monitor has looked at every worker once more."""
        await self._ticked.wait()


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
            (``AMESH_HEARTBEAT_TIMEOUT``, default 5).
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
        self._host: Host = host or this_host()
        self._env = dict(env or {})
        self._supervise = supervise
        self._hb_period = heartbeat_period or _env_float("AMESH_HEARTBEAT_PERIOD", 0.5)
        self._hb_timeout = heartbeat_timeout or _env_float("AMESH_HEARTBEAT_TIMEOUT", 5.0)
        if self._hb_period <= 0 or self._hb_timeout <= self._hb_period:
            raise ValueError("need 0 < heartbeat_period < heartbeat_timeout")
        self._state: _State | None = None
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

    def _live(self) -> _State:
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

    def _scheme(self, rt: Runtime) -> tuple[str, str]:
        # workers listen the way the controller does ("stream+tcp", "abstract", ...)
        scheme, rest = rt.address.split("://", 1)
        host = default_transport()[1]
        if scheme.removeprefix("stream+") == "tcp":
            host = rest.rsplit(":", 1)[0].strip("[]")
        return scheme, host

    async def _start_procs(self, rt: Runtime, n: int) -> list[ProcHandle]:
        scheme, host = self._scheme(rt)
        procs: list[ProcHandle | None] = [None] * n

        async def start(i: int) -> None:
            procs[i] = await self._host.start_proc(
                rt, scheme, host, self._env, heartbeat_period=self._hb_period
            )

        try:
            async with anyio.create_task_group() as starters:
                for i in range(n):
                    starters.start_soon(start, i)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for p in procs:
                    if p is not None:
                        p.process.kill()
                        await p.stop(0)
            raise
        return [p for p in procs if p is not None]

    async def _start(self, rt: Runtime, tg: TaskGroup) -> None:
        handles = await self._start_procs(rt, len(self._shape))
        st = self._state = _State(rt, tg, handles)
        for slot, handle in enumerate(handles):
            self._supervise_proc(st, slot, handle)
        tg.start_soon(self._monitor_heartbeats, st)

    def _supervise_proc(self, st: _State, slot: int, handle: ProcHandle) -> None:
        """Watch ``handle``'s exit, heartbeats and link from now on."""

        def link_lost(why: str) -> None:
            if not (st.closing or handle.expected_exit or handle.failed):
                st.tg.start_soon(self._confirm_lost, st, slot, handle, why)

        st.runtime.peers.watch(handle.addr, link_lost, anyio.current_time())
        st.tg.start_soon(self._watch, st, handle, slot)

    # -- failure detection ----------------------------------------------------------------

    def _failure(self, slot: int, handle: ProcHandle, cause: str) -> Failure:
        rc = handle.returncode
        return Failure(
            mesh=f"ProcMesh {self.sizes}",
            rank=slot,
            pid=handle.pid,
            cause=cause,
            exit_code=rc if rc is not None and rc >= 0 else None,
            signal=-rc if rc is not None and rc < 0 else None,
        )

    async def _watch(self, st: _State, handle: ProcHandle, slot: int) -> None:
        await handle.process.wait()
        # shared-memory segments it sent that nobody took (a killed process never
        # cleans up after itself)
        _codec.remove_segments_of(handle.pid)
        if st.closing or handle.expected_exit or handle.failed:
            return
        handle.failed = True
        failure = self._failure(slot, handle, describe_exit(handle.returncode or 0))
        self._proc_failed(st, slot, handle, failure)

    async def _confirm_lost(self, st: _State, slot: int, handle: ProcHandle, why: str) -> None:
        """The link to a worker broke: it is dead if it exits (its exit status says
        how, through :meth:`_watch`), or is killed if it lingers without a link."""
        with anyio.move_on_after(LINK_LOSS_GRACE):
            await handle.process.wait()
            return
        if st.closing or handle.expected_exit or handle.failed:
            return
        handle.failed = True
        cause = f"its connection broke ({why}) and it did not exit; the process was killed"
        failure = self._failure(slot, handle, cause)
        handle.process.kill()
        self._proc_failed(st, slot, handle, failure)

    async def _monitor_heartbeats(self, st: _State) -> None:
        """Declare lost a worker that was silent while this process could hear it.

        Heartbeats are read by this process's event loop, so a loop that stalls (a
        blocking call, a debugger stop, a notebook idle between cells) hears nobody
        and must not blame the workers for it. A worker's silence is counted only
        from the later of its last heartbeat and the end of the last stall of this
        monitor (a tick that came much later than asked), which gives every worker a
        full timeout after the loop runs again to be heard.
        """
        rt = st.runtime
        last_tick = hearing_since = anyio.current_time()
        while not st.closing:
            await anyio.sleep(self._hb_period)
            now = anyio.current_time()
            if now - last_tick > self._hb_period + STALL_SLACK:
                hearing_since = now
                log.debug(
                    "event loop stalled for %.1f s: heartbeats count from now", now - last_tick
                )
            last_tick = now
            for slot, handle in enumerate(list(st.procs)):
                last = rt.heartbeats.get(handle.addr)
                if handle.failed or handle.expected_exit or last is None:
                    continue
                silent = now - max(last, hearing_since)
                if handle.returncode is None and silent > self._hb_timeout:
                    handle.failed = True
                    cause = (
                        f"sent no heartbeat for {silent:.1f} s while this controller was "
                        f"listening (timeout {self._hb_timeout:g} s); the worker was silent, "
                        "not its controller; the process was killed"
                    )
                    failure = self._failure(slot, handle, cause)
                    handle.process.kill()
                    self._proc_failed(st, slot, handle, failure)
            st.ticked()

    def _proc_failed(self, st: _State, slot: int, handle: ProcHandle, failure: Failure) -> None:
        """A process is gone: fail its calls at once, then restart or escalate."""
        if st.closing:
            return
        slots = self._restart_slots(st, slot)
        if slots is not None:
            st.restarting += 1  # before the calls fail, so `ready()` sees it
        # every process that may be calling it hears of it (Died notices)
        st.runtime.peer_failed(handle.addr, failure, announce=True)
        st.runtime.peers.unwatch(handle.addr)
        log.error("supervision failure: %s", failure)
        if slots is not None:
            st.tg.start_soon(self._restart, st, slots, failure)
        else:
            st.tg.start_soon(self._escalate, st, failure)

    def _on_actor_failure(self, report: FailureReport) -> None:
        st = self._state
        if st is None or st.closing:
            return
        spawned = st.spawned.get(report.actor)
        name = spawned.mesh.name if spawned is not None else report.actor
        failure = Failure(
            mesh=f"actor {name!r}", rank=report.rank, pid=report.pid, cause=report.cause
        )
        log.error("supervision failure: %s", failure)
        st.tg.start_soon(self._escalate, st, failure)

    async def _escalate(self, st: _State, failure: Failure) -> None:
        try:
            await self._escalate_to_owner(st, failure)
        finally:
            st.escalated.add(failure.pid)
            if st.escalation is not None:
                st.escalation.set()

    async def _escalate_to_owner(self, st: _State, failure: Failure) -> None:
        if self._supervise is not None:
            handled = await call_supervisor(self._supervise, failure)
        elif self._owner is not None:
            handled = await self._owner.supervise(failure)
        else:
            handled = False
        if handled:
            st.handled.append(failure)
            return
        st.unhandled.append(failure)
        if self._scoped:
            st.tg.cancel_scope.cancel()
        elif self._owner is not None:
            self._owner.fail(f"unhandled failure of a mesh it owns: {failure}")
        else:
            st.runtime.fail_root(failure)

    # -- restarts -----------------------------------------------------------------------

    def _restart_slots(self, st: _State, slot: int) -> list[int] | None:
        """The process slots to restart for a failure at ``slot``, or None to escalate."""
        on_slot = [s for s in st.spawned.values() if slot in s.mesh.shape.slots]
        if not on_slot or any(s.policy is None for s in on_slot):
            return None
        policies = [s.policy for s in on_slot if s.policy is not None]
        slots = {slot}
        for s in on_slot:
            if s.policy is not None and s.policy.strategy == "one_for_all":
                slots.update(s.mesh.shape.slots)
        # every actor mesh on a restarted process must agree to be restarted
        for s in st.spawned.values():
            if slots & set(s.mesh.shape.slots) and s.policy is None:
                return None
        strictest = min(policies, key=lambda p: p.max_restarts)
        if not st.window.allow(strictest):
            log.error(
                "restart intensity exceeded (%d in %g s)", strictest.max_restarts, strictest.within
            )
            return None
        return sorted(slots)

    async def _restart(self, st: _State, slots: list[int], failure: Failure) -> None:
        rt = st.runtime
        try:
            old = [st.procs[s] for s in slots]
            for h in old:
                h.expected_exit = True
                rt.peers.unwatch(h.addr)
                if h.addr not in rt.dead:
                    rt.peer_failed(
                        h.addr,
                        Failure(
                            mesh=f"ProcMesh {self.sizes}",
                            rank=st.procs.index(h),
                            pid=h.pid,
                            cause=f"restarted with its mesh after: {failure}",
                        ),
                        announce=True,
                    )
            async with anyio.create_task_group() as tg:
                for h in old:
                    if h.returncode is None:
                        h.process.kill()
                    tg.start_soon(h.stop, 0)
            fresh = await self._start_procs(rt, len(slots))
            for s, h in zip(slots, fresh):
                st.procs[s] = h
                st.addrs[s] = h.addr
                self._supervise_proc(st, s, h)
            affected = [sp for sp in st.spawned.values() if set(slots) & set(sp.mesh.shape.slots)]
            for sp in affected:
                await self._spawn_ranks(st, sp, set(slots))
            st.restarts += 1
            log.warning("restarted process slot(s) %s after: %s", slots, failure)
        except Exception as exc:
            log.exception("restart failed")
            st.restarting -= 1
            st.restarted.set()
            st.restarted = anyio.Event()
            await self._escalate(
                st,
                Failure(
                    mesh=failure.mesh,
                    rank=failure.rank,
                    pid=failure.pid,
                    cause=f"{failure.cause}; the restart failed: {exc}",
                ),
            )
            return
        # The hooks re-send state before `ready()` returns, so the first call after
        # it finds the restarted actors as the owner wants them.
        for sp in affected:
            hook = sp.policy.on_restart if sp.policy is not None else None
            if hook is not None:
                ranks = [r for r, s in enumerate(sp.mesh.shape.slots) if s in slots]
                await call_hook(hook, sp.mesh, ranks)
        st.restarting -= 1
        st.restarted.set()
        st.restarted = anyio.Event()

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
            if remote:
                await self._settle(st)
            await self._shutdown(st)
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

    async def _settle(self, st: _State) -> None:
        """Let the deaths that already happened be noticed and escalated (bounded).

        A remote error can beat the news of the death that caused it: a peer's
        collective fails as soon as the kernel closes the dead process's sockets.
        """
        gone = [
            p for p in st.procs if p.failed or p.returncode is not None or not _pid_alive(p.pid)
        ]
        with anyio.move_on_after(FAILED_STOP_TIMEOUT):
            while any(p.pid not in st.escalated for p in gone):
                st.escalation = anyio.Event()
                await st.escalation.wait()

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
            await self._shutdown(st)
        rt = st.runtime
        if self in rt.owned:
            rt.owned.remove(self)
        if self._owner is not None and self in self._owner.owned:
            self._owner.owned.remove(self)

    async def _shutdown(self, st: _State) -> None:
        if st.closing:
            await st.closed.wait()
            return
        rt = st.runtime
        alive = [p for p in st.procs if p.addr not in rt.dead and p.returncode is None]
        agents = self._agents_of(alive)
        failed = bool(st.unhandled)
        with anyio.move_on_after(FAILED_STOP_TIMEOUT if failed else STOP_ACTORS_TIMEOUT):
            for key in reversed(list(st.spawned)):
                try:
                    await agents.stop_actor.call(key)
                except (ActorError, SupervisionError) as exc:
                    log.warning("stopping actor mesh %s: %s", key, exc)
        for key in st.spawned:
            rt.failure_handlers.pop(key, None)
        st.closing = True
        for p in st.procs:
            p.expected_exit = True
        alive = [p for p in st.procs if p.addr not in rt.dead and p.returncode is None]
        try:
            await self._agents_of(alive).shutdown.broadcast()
        except Exception as exc:  # the processes are stopped below either way
            log.warning("asking workers to exit: %s", exc)
        async with anyio.create_task_group() as tg:
            for p in st.procs:
                tg.start_soon(p.stop, FAILED_EXIT_GRACE if failed else EXIT_GRACE)
        for slot, p in enumerate(st.procs):
            rt.peers.unwatch(p.addr)
            rt.peer_failed(p.addr, self._failure(slot, p, "was stopped by its owner"))
            _codec.remove_segments_of(p.pid)
        st.closed.set()

    def _agents_of(self, procs: list[ProcHandle]) -> ActorMesh[ProcAgent]:
        shape = Shape(["procs"], [len(procs)])
        # the control plane stays direct: no relay may be mid-exit while relaying
        return ActorMesh(AGENT_KEY, AGENT_KEY, ProcAgent, shape, [p.addr for p in procs])

    def _agents(self, st: _State) -> ActorMesh[ProcAgent]:
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
        if not isinstance(name, str) or not name:
            raise ValueError("an actor mesh needs a non-empty name")
        if any(s.mesh.name == name for s in st.spawned.values()):
            raise ValueError(f"this ProcMesh already has an actor mesh named {name!r}")
        try:
            inspect.signature(actor_class).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{actor_class.__qualname__}(): {exc}") from None
        payload = _codec.dumps((actor_class, args, kwargs))
        key = f"{name}-{uuid.uuid4().hex[:12]}"
        mesh = ActorMesh(name, key, actor_class, self._shape, st.addrs, self._fanout)
        mesh._owner = self
        spawned = _Spawned(mesh, payload, policy)
        st.spawned[key] = spawned
        st.runtime.failure_handlers[key] = self._on_actor_failure
        try:
            await self._spawn_ranks(st, spawned, None)
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

    async def _spawn_ranks(self, st: _State, sp: _Spawned, slots: set[int] | None) -> None:
        """Construct the actors of ``sp`` on every rank, or on those in ``slots``."""
        mesh = sp.mesh
        shape = mesh.shape
        ranks = [r for r, s in enumerate(shape.slots) if slots is None or s in slots]
        owner = st.runtime.address
        labels, sizes = list(shape.labels), list(shape.sizes)
        agents = ActorMesh(
            AGENT_KEY,
            AGENT_KEY,
            ProcAgent,
            Shape(["ranks"], [len(ranks)], [shape.slots[r] for r in ranks]),
            st.addrs,
        )
        try:
            await agents.spawn_actor.call(
                mesh.key, mesh.name, sp.payload, owner, labels, sizes, ranks
            )
        except ActorError as exc:
            # name the failing rank in the actor mesh, not in the agents' view
            rank = ranks[int(exc.point.get("rank", 0))]
            raise ActorError(
                exc.type_name,
                exc.message,
                exc.traceback,
                mesh.name,
                {**shape.coords(rank), "rank": rank},
            ) from None

    async def _stop_actor_mesh(self, mesh: ActorMesh[Any]) -> None:
        st = self._live()
        if mesh.key not in st.spawned:
            raise ValueError(f"{mesh!r} is not owned by this ProcMesh (or already stopped)")
        del st.spawned[mesh.key]
        alive = [p for p in st.procs if p.addr not in st.runtime.dead]
        await self._agents_of(alive).stop_actor.call(mesh.key)
        st.runtime.failure_handlers.pop(mesh.key, None)
