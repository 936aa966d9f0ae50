"""The processes of a mesh: starting them, stopping them, the actors on them."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from .. import _limits, _wire
from .._bootstrap import WorkerSpec
from .._config import default_transport, for_workers
from .._errors import ActorError, Failure, SupervisionError
from .._model import AGENT_KEY, ActorMesh, ProcAgent, RestartPolicy, RestartWindow, ValueMesh
from .._runtime import LOOP_TIMEOUT, OutputPrinter, Runtime
from .._shape import Shape
from ._host import Host, ProcHandle

if TYPE_CHECKING:
    from ._supervisor import MeshSupervisor

__all__ = [
    "EXIT_GRACE",
    "FAILED_EXIT_GRACE",
    "FAILED_STOP_TIMEOUT",
    "STOP_ACTORS_TIMEOUT",
    "Lifecycle",
    "MeshState",
    "Spawned",
    "checked_env",
    "failure_of",
]

log = logging.getLogger("amesh.mesh")
#: what ``putenv`` takes as a name
_ENV_NAME = re.compile(r"[^=\0]+")

#: Bounded waits of a polite shutdown, in seconds.
STOP_ACTORS_TIMEOUT = 5.0
EXIT_GRACE = 5.0
#: The same waits once the mesh has failed: survivors are often stuck waiting on the
#: dead (a collective), so politeness is cut short.
FAILED_STOP_TIMEOUT = 1.0
FAILED_EXIT_GRACE = 1.0


@dataclass
class Spawned:
    """How an actor mesh was made, so it can be made again on a restart."""

    mesh: ActorMesh[Any]
    payload: _wire.Payload
    policy: RestartPolicy | None


class MeshState:
    """What a running ProcMesh and all its views share."""

    def __init__(self, runtime: Runtime, tg: TaskGroup, procs: list[ProcHandle]) -> None:
        self.runtime = runtime
        self.tg = tg
        self.procs = procs
        #: addresses by slot; ActorMesh handles share this list, so a restarted
        #: process is found at its new address
        self.addrs: list[str] = [p.addr for p in procs]
        self.spawned: dict[str, Spawned] = {}
        self.unhandled: list[Failure] = []
        self.handled: list[Failure] = []
        #: pids whose failure went through escalation, and who waits for the next one
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
        #: a persistent mesh's: records its processes and actor meshes where another
        #: controller can find them (after a start, a spawn or a restart)
        self.publish: Callable[[], Awaitable[None]] | None = None

    def ticked(self) -> None:
        self._ticked.set()
        self._ticked = anyio.Event()

    async def monitor_tick(self) -> None:
        """Wait until the heartbeat monitor has looked at every worker once more."""
        await self._ticked.wait()


def failure_of(label: str, slot: int, handle: ProcHandle, cause: str) -> Failure:
    """The :class:`Failure` of process ``slot`` of mesh ``label``."""
    rc = handle.returncode
    return Failure(
        mesh=label,
        rank=slot,
        pid=handle.pid,
        cause=cause,
        exit_code=rc if rc is not None and rc >= 0 else None,
        signal=-rc if rc is not None and rc < 0 else None,
        **({"host": handle.host} if handle.host else {}),
    )


class Lifecycle:
    """Starts and stops the processes of one ProcMesh, and the actors on them.

    Args:
        host: where the processes run.
        env: extra environment variables for them.
        heartbeat_period: seconds between their heartbeats.
        heartbeat_timeout: how long a silent one lives on.
        label: the mesh, as failures name it (``"ProcMesh {'gpus': 4}"``).
        output: what becomes of the processes' output (see
            :mod:`amesh._runtime._output`).
        name: the mesh, as its processes' output names it (``[procs 3] ...``).
        settings: the mesh's own amesh settings for its processes, checked
            (:func:`amesh._config.for_mesh`).
    """

    def __init__(
        self,
        host: Host,
        env: dict[str, str],
        heartbeat_period: float,
        label: str,
        heartbeat_timeout: float = 5.0,
        output: str = "folded",
        name: str = "procs",
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.host = host
        self.env = env
        self.settings = settings or {}
        self.heartbeat_period = heartbeat_period
        self.heartbeat_timeout = heartbeat_timeout
        self.label = label
        self.output = output
        self.name = name
        #: the workers' event loop (``asyncio`` or ``trio``; see ``ProcMesh(backend=)``)
        self.backend = "asyncio"
        self._printer: OutputPrinter | None = None

    def scheme(self, rt: Runtime) -> tuple[str, str]:
        # workers listen the way the controller does ("stream+tcp", "abstract", ...)
        scheme, rest = rt.address.split("://", 1)
        host = default_transport()[1]
        if scheme.removeprefix("stream+") in ("tcp", "tls+tcp"):
            host = rest.rsplit(":", 1)[0].strip("[]")
        return scheme, host

    async def start_procs(self, rt: Runtime, slots: list[int]) -> list[ProcHandle]:
        """Start a process for each of ``slots``, in that order.

        Raises:
            OSError: (EMFILE) this process may not open the descriptors they need;
                (EAGAIN) this user may not run the threads they need.
        """
        n = len(slots)
        # a host without OS processes (in-process ranks) says it needs none
        _limits.make_room(
            n * getattr(self.host, "open_files_per_process", _limits.PER_PROCESS),
            n * getattr(self.host, "tasks_per_process", 0),
        )
        room = getattr(self.host, "make_room", None)  # (machines of their own: they check)
        if room is not None:
            await room(slots)
        spec = self.spec(*self.scheme(rt))
        procs: list[ProcHandle | None] = [None] * n

        async def start(i: int) -> None:
            own = msgspec.structs.replace(spec, slot=slots[i])
            procs[i] = await self.host.start_proc(rt, own)

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
                        _wire.remove_segments_of(p.pid)
            raise
        started = [p for p in procs if p is not None]
        printer = self.printer(rt)  # (the runtime kept their output until now)
        for slot, p in zip(slots, started):
            printer.attach(p.addr, slot)
        return started

    def spec(self, scheme: str, host: str) -> WorkerSpec:
        """What this mesh asks of each of its processes (their slots aside), listening
        as ``scheme`` on ``host``: its environment, its settings (those given to
        :func:`amesh.configure`, under the mesh's own), heartbeats, event loop, and
        what its output becomes. (Its interpreter and working directory are its
        host's.)"""
        return WorkerSpec(
            scheme=scheme,
            host=host,
            env=self.env,
            settings=for_workers(self.settings, self.env),
            heartbeat_period=self.heartbeat_period,
            heartbeat_timeout=self.heartbeat_timeout,
            backend=self.backend,
            output=self.output,
            output_label=self.name,
        )

    def printer(self, rt: Runtime) -> OutputPrinter:
        """What prints the output of this mesh's processes (made on first use)."""
        if self._printer is None:
            self._printer = OutputPrinter(rt.outputs, self.output, self.name, rt.new_event)
            if self.output == "folded":
                rt.start_soon(self._printer.run)
        return self._printer

    def attach_output(self, rt: Runtime, procs: list[ProcHandle]) -> None:
        """Print the output of ``procs`` (running processes taken over), by slot."""
        printer = self.printer(rt)
        for slot, p in enumerate(procs):
            printer.attach(p.addr, slot)

    def close_output(self) -> None:
        """Print what is held back, and no more output of this mesh's processes."""
        if self._printer is not None:
            self._printer.close()
            self._printer = None

    async def shutdown(self, st: MeshState) -> None:
        if st.closing:
            await st.closed.wait()
            return
        rt = st.runtime
        alive = [p for p in st.procs if p.addr not in rt.peers.dead and p.returncode is None]
        agents = self.agents_of(alive)
        failed = bool(st.unhandled)
        with anyio.move_on_after(FAILED_STOP_TIMEOUT if failed else STOP_ACTORS_TIMEOUT):
            for key in reversed(list(st.spawned)):
                try:
                    await agents.stop_actor.call(key)
                except (ActorError, SupervisionError) as exc:
                    log.warning("stopping actor mesh %s: %s", key, exc)
        for key in st.spawned:
            rt.handle_failures(key, None)
        st.closing = True
        for p in st.procs:
            p.expected_exit = True
        alive = [p for p in st.procs if p.addr not in rt.peers.dead and p.returncode is None]
        try:
            await self.agents_of(alive).shutdown.broadcast()
        except Exception as exc:  # the processes are stopped below either way
            log.warning("asking workers to exit: %s", exc)
        async with anyio.create_task_group() as tg:
            for p in st.procs:
                tg.start_soon(p.stop, FAILED_EXIT_GRACE if failed else EXIT_GRACE)
        if self._printer is not None:
            # the last output of those that exited well may still be on its way
            await self._printer.settle(p.addr for p in st.procs if p.returncode == 0)
            self.close_output()
        for slot, p in enumerate(st.procs):
            rt.peers.unwatch(p.addr)
            rt.peer_failed(p.addr, failure_of(self.label, slot, p, "was stopped by its owner"))
            _wire.remove_segments_of(p.pid)
        await self.close_host()
        st.closed.set()

    async def close_host(self) -> None:
        """Have a host that brought machines up for this mesh (an environment's) let go
        of them: the mesh has stopped, or its first processes did not start."""
        close_host = getattr(self.host, "aclose", None)
        if close_host is not None:
            with anyio.CancelScope(shield=True):
                await close_host()

    async def move_to_workspace(
        self, agents: ActorMesh[ProcAgent], slots: list[int]
    ) -> ValueMesh[list[str]]:
        """Have the host send the workspace as it is now (``sync_workspace``, see
        :class:`~._host.Host`) and ``agents`` (the processes of ``slots``) move to its
        new tree; the modules each reloaded (see :meth:`ProcMesh.sync`).

        Raises:
            RuntimeError: the host has no workspace to sync.
        """
        move = getattr(self.host, "sync_workspace", None)
        if move is None:
            raise RuntimeError(
                f"{self.label} has no workspace to sync: spawn it from an "
                "amesh.Environment (or push edited modules with sync_code())"
            )
        trees: list[tuple[str, str]] = await move(slots)
        return await agents.move_code.call(ValueMesh.of(agents, [list(t) for t in trees]))

    def agents_of(self, procs: list[ProcHandle]) -> ActorMesh[ProcAgent]:
        shape = Shape(["procs"], [len(procs)])
        # the control plane stays direct: no relay may be mid-exit while relaying
        return ActorMesh(AGENT_KEY, AGENT_KEY, ProcAgent, shape, [p.addr for p in procs])

    async def spawn_ranks(
        self,
        st: MeshState,
        sp: Spawned,
        slots: set[int] | None,
        addrs: list[str] | None = None,
        answered: set[int] | None = None,
    ) -> None:
        """Construct the actors of ``sp`` on every rank, or on those in ``slots``
        (at ``addrs`` by slot: restarted processes not yet published in ``st.addrs``),
        adding to ``answered`` each rank whose ``__init__`` returned, as it does."""
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
            st.addrs if addrs is None else addrs,
        )
        try:
            async for point, _ in agents.spawn_actor.stream(
                mesh.key, mesh.name, sp.payload, owner, labels, sizes, ranks
            ):
                if answered is not None:
                    answered.add(ranks[point.rank])
        except ActorError as exc:
            # name the failing rank in the actor mesh, not in the agents' view
            rank = ranks[int(exc.point.get("rank", 0))]
            err = ActorError(
                exc.type_name,
                exc.message,
                exc.traceback,
                mesh.name,
                {**shape.coords(rank), "rank": rank},
            )
            # chained to the remote traceback (what ``from None`` would drop), not to
            # the agents' view of the same error
            raise err from err.__cause__

    async def abandon_spawn(
        self, st: MeshState, sup: MeshSupervisor, sp: Spawned, answered: set[int], why: str
    ) -> list[int]:
        """Undo a spawn that did not finish: kill the processes where ``__init__`` still
        runs (it cannot be interrupted), each a failure for supervision (``sup``) whose
        cause says ``why``, and stop the actor where it was constructed. The ranks
        killed."""
        mesh = sp.mesh
        st.spawned.pop(mesh.key, None)
        st.runtime.handle_failures(mesh.key, None)
        stuck = [r for r in range(len(mesh.shape.slots)) if r not in answered]
        for rank in stuck:
            slot = mesh.shape.slots[rank]
            handle = st.procs[slot]
            if handle.failed or handle.expected_exit or handle.returncode is not None:
                continue
            handle.failed = True
            handle.process.kill()
            failure = failure_of(sup.label, slot, handle, f"{why}; the process was killed")
            sup.proc_failed(st, slot, handle, failure)
        built = [st.procs[mesh.shape.slots[r]] for r in sorted(answered)]
        if built:
            with anyio.move_on_after(STOP_ACTORS_TIMEOUT):
                try:
                    await self.agents_of(built).stop_actor.call(mesh.key)
                except (ActorError, SupervisionError):
                    pass
        if st.publish is not None:
            await st.publish()
        return stuck

    async def stop_spawned(
        self,
        st: MeshState,
        mesh: ActorMesh[Any],
        replaced: bool = False,
        hand_over: set[int] | None = None,
    ) -> None:
        """Stop actor mesh ``mesh`` on the live processes (its ``__cleanup__`` runs).

        Args:
            replaced: it is being replaced (what calls through its handles are told).
            hand_over: the slots whose processes keep the stopped actor for the
                ``__reload__`` of its replacement.
        """
        del st.spawned[mesh.key]
        alive = [
            (slot, p) for slot, p in enumerate(st.procs) if p.addr not in st.runtime.peers.dead
        ]
        agents = self.agents_of([p for _, p in alive])
        keep: bool | ValueMesh[bool] = False
        if hand_over:
            keep = ValueMesh.of(agents, [slot in hand_over for slot, _ in alive])
        await agents.stop_actor.call(mesh.key, replaced, keep)
        st.runtime.handle_failures(mesh.key, None)

    def detach(self, st: MeshState, scoped: bool) -> None:
        """Let go of a persistent mesh's processes without stopping them (its owner is
        leaving): no more watching them, their actors' failures, their output;
        ``scoped``: the mesh's task group is its own, and is cancelled."""
        st.closing = True
        rt = st.runtime
        for p in st.procs:
            p.expected_exit = True
            rt.peers.unwatch(p.addr)
        for key in st.spawned:
            rt.handle_failures(key, None)
        self.close_output()
        if scoped:
            st.tg.cancel_scope.cancel()  # the watches of the processes
        st.closed.set()

    async def stacks(self, st: MeshState, slots: Sequence[int], full: bool) -> list[str]:
        """The stacks of the processes of ``slots`` (see :meth:`ProcMesh.stacks`), each
        taken by a signal when its event loop does not answer within
        :data:`~amesh._runtime.LOOP_TIMEOUT`."""
        texts = [""] * len(slots)

        async def one(i: int, slot: int) -> None:
            agent = ActorMesh(
                AGENT_KEY, AGENT_KEY, ProcAgent, Shape(["procs"], [1], [slot]), st.addrs
            )
            try:
                texts[i] = await agent.stacks.options(timeout=LOOP_TIMEOUT).call_one(full)
            except TimeoutError:
                texts[i] = await st.procs[slot].stacks_by_signal(full)

        async with anyio.create_task_group() as tg:
            for i, slot in enumerate(slots):
                tg.start_soon(one, i, slot)
        return texts


def checked_env(env: Mapping[str, str]) -> dict[str, str]:
    """A mesh's ``env=``, as ``putenv`` takes it.

    Raises:
        ValueError: a name with ``=`` or NUL, or a value that is not a str without NUL.
    """
    out = dict(env)
    for key, value in out.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise ValueError(f"env: {key!r:.60} is not a name (a str without '=' or NUL)")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"env: {key}'s value is not a str without NUL: {value!r:.60}")
    return out
