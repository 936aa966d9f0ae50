"""The rules every fault-injection machine runs, and the invariants it checks.

:class:`MeshMachine` drives one ProcMesh of ``N`` :class:`~tests.actors.Ledger` ranks
(the model mesh) and a second ProcMesh of one :class:`~tests.actors.Caller` (a process
that calls the model mesh without owning it). Subclasses (``_machines.py``) say how
processes start, die, stop and continue, and add the rules of their world.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future
from typing import Any

import anyio
import anyio.from_thread
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from amesh import ActorError, ActorMesh, Failure, ProcMesh, SupervisionError
from amesh._runtime import Runtime, open_runtime, runtime_var
from amesh._transport import open_transport

from ..actors import Caller, Ledger

N = 3
#: How long any single step may take before it counts as a hang.
STEP_DEADLINE = 30.0

slices = st.tuples(st.integers(0, N - 1), st.integers(1, N)).map(
    lambda t: slice(t[0], max(t[0] + 1, t[1]))
)
#: what each of several concurrent tasks sends, in its own order
plans = st.lists(
    st.lists(st.sampled_from(["call", "broadcast"]), min_size=1, max_size=5),
    min_size=2,
    max_size=4,
)


class MeshMachine(RuleBasedStateMachine):
    """The rules; subclasses say how processes start, die, stop and continue."""

    backend: tuple[str, dict[str, Any]] = ("asyncio", {})
    #: the relay tree's fan-out (0: every rank is sent to directly)
    fanout = 0
    heartbeat_period = 0.2
    heartbeat_timeout = 120.0
    meshes = Bundle("meshes")
    #: examples started and rules run, to show the run was not vacuous
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = anyio.from_thread.start_blocking_portal(*self.backend)
        self.portal = self._portal_cm.__enter__()
        self._rt_cm = self.portal.wrap_async_context_manager(open_runtime(self.transport))
        self.rt: Runtime = self._rt_cm.__enter__()
        self.failures: list[Failure] = []
        self.caller_failures: list[Failure] = []
        self.killed: set[int] = set()
        self.stopped: set[int] = set()
        #: actor mesh key -> the count each rank should have
        self.model: dict[str, list[int]] = {}
        self.meshes_by_key: dict[str, ActorMesh[Ledger]] = {}
        #: (actor mesh key, rank) -> calls of Ledger.hold started there
        self.holds: dict[tuple[str, int], int] = {}
        self.procs: ProcMesh | None = None
        self.caller_procs: ProcMesh | None = None
        self.caller: ActorMesh[Caller] | None = None
        self.pids: list[int] = []
        self.spawned = 0
        self._reported: anyio.Event | None = None

    # -- how the world works; overridden per machine --------------------------------------

    def transport(self) -> Any:
        return open_transport()

    def host(self) -> Any:
        return None

    def kill_proc(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def stop_proc(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)

    def cont_proc(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)

    def restart_policy(self) -> Any:
        """The ``restart=`` of the model's actor meshes (None: a death escalates)."""
        return None

    def died(self, rank: int) -> None:
        """Rank ``rank`` was killed: what the model expects from now on."""
        self.killed.add(rank)
        self.stopped.discard(rank)

    # -- plumbing ---------------------------------------------------------------------------

    def count(self, rule: str) -> None:
        type(self).steps[rule] = type(self).steps.get(rule, 0) + 1

    def run(self, fn: Any, *args: Any) -> Any:
        """``await fn(*args)`` on the runtime's loop, within the step deadline."""
        return self.start_soon(fn, *args).result()

    def start_soon(self, fn: Any, *args: Any) -> Future[Any]:
        """Start ``fn(*args)`` on the runtime's loop; its result (within the step
        deadline) comes later."""

        async def task() -> Any:
            runtime_var.set(self.rt)
            with anyio.fail_after(STEP_DEADLINE):
                return await fn(*args)

        return self.portal.start_task_soon(task)

    def supervise(self, failure: Failure) -> bool:
        self.failures.append(failure)
        if self._reported is not None:
            self._reported.set()
        return True  # handled: the rest of the mesh keeps working

    def caller_failed(self, failure: Failure) -> bool:
        self.caller_failures.append(failure)
        return True

    def live_ranks(self) -> list[int]:
        return sorted(set(range(N)) - self.killed - self.stopped)

    def kill(self, rank: int) -> None:
        self.kill_proc(self.pids[rank])
        self.died(rank)

    def check_counts(self, rank: int) -> None:
        """Every actor mesh at live ``rank`` has the count the model says (a call
        behind everything sent before it, from this process)."""
        for key, mesh in self.meshes_by_key.items():
            assert self.run(mesh.slice(x=rank).peek.call_one) == (rank, self.model[key][rank])

    # -- starting ---------------------------------------------------------------------------

    @initialize(target=meshes)
    def start(self) -> ActorMesh[Ledger]:
        async def start() -> tuple[ProcMesh, ProcMesh]:
            procs = await ProcMesh(
                per_host={"x": N},
                host=self.host(),
                supervise=self.supervise,
                heartbeat_period=self.heartbeat_period,
                heartbeat_timeout=self.heartbeat_timeout,
                fanout=self.fanout,
            )
            callers = await ProcMesh(
                per_host={"c": 1},
                host=self.host(),
                supervise=self.caller_failed,
                heartbeat_period=0.2,
                heartbeat_timeout=120.0,
            )
            return procs, callers

        self.procs, self.caller_procs = self.run(start)
        self.caller = self.run(self.caller_procs.spawn, "caller", Caller)
        self.pids = self.procs.pids
        type(self).examples += 1
        return self._spawn()

    def _spawn(self) -> ActorMesh[Ledger]:
        procs = self.procs
        assert procs is not None
        self.spawned += 1
        name = f"m{self.spawned}"
        policy = self.restart_policy()
        mesh = self.run(lambda: procs.spawn(name, Ledger, restart=policy))
        self.model[mesh.key] = [0] * N
        self.meshes_by_key[mesh.key] = mesh
        return mesh

    @precondition(lambda self: self.spawned < 2 and not self.killed and not self.stopped)
    @rule(target=meshes)
    def spawn(self) -> ActorMesh[Ledger]:
        self.count("spawn")
        return self._spawn()

    # -- calls from the owner ---------------------------------------------------------------

    @rule(mesh=meshes, s=slices, adverb=st.sampled_from(["call", "stream", "broadcast"]))
    def bump(self, mesh: ActorMesh[Ledger], s: slice, adverb: str) -> None:
        self.count("bump")
        view = mesh.slice(x=s)
        ranks = list(range(N)[s])
        counts = self.model[mesh.key]
        if set(ranks) & self.killed:
            with pytest.raises(SupervisionError):
                if adverb == "call":
                    self.run(view.bump.call)
                elif adverb == "broadcast":
                    self.run(view.bump.broadcast)
                else:
                    self.run(self._collect, view)
            return
        if set(ranks) & self.stopped and adverb != "broadcast":
            return  # a call would wait for SIGCONT; cancel_call covers stopped ranks
        if adverb == "broadcast":
            self.run(view.bump.broadcast)
            for r in ranks:
                counts[r] += 1
            return
        if adverb == "call":
            got = self.run(view.bump.call).values()
        else:
            got = sorted(self.run(self._collect, view))
        for r in ranks:
            counts[r] += 1
        assert got == [(r, counts[r]) for r in ranks]

    async def _collect(self, view: ActorMesh[Ledger]) -> list[tuple[int, int]]:
        return [value async for _, value in view.bump.stream()]

    @rule(mesh=meshes, rank=st.integers(0, N - 1))
    def call_one(self, mesh: ActorMesh[Ledger], rank: int) -> None:
        self.count("call_one")
        if rank in self.stopped:
            return
        view = mesh.slice(x=rank)
        if rank in self.killed:
            with pytest.raises(SupervisionError):
                self.run(view.bump.call_one)
            return
        self.model[mesh.key][rank] += 1
        assert self.run(view.bump.call_one) == (rank, self.model[mesh.key][rank])

    @precondition(lambda self: not self.stopped)
    @rule(mesh=meshes)
    def choose(self, mesh: ActorMesh[Ledger]) -> None:
        self.count("choose")
        if len(self.killed) == N:
            with pytest.raises(SupervisionError):
                self.run(mesh.peek.choose)
            return
        rank, count = self.run(mesh.bump.choose)
        assert rank not in self.killed
        self.model[mesh.key][rank] += 1
        assert count == self.model[mesh.key][rank]

    @rule(mesh=meshes, rank=st.integers(0, N - 1))
    def raise_in_endpoint(self, mesh: ActorMesh[Ledger], rank: int) -> None:
        self.count("raise_in_endpoint")
        if rank in self.stopped:
            return
        view = mesh.slice(x=rank)
        expected = SupervisionError if rank in self.killed else ActorError
        with pytest.raises(expected):
            self.run(view.fail.call_one)

    @rule(mesh=meshes, rank=st.integers(0, N - 1))
    def cancel_call(self, mesh: ActorMesh[Ledger], rank: int) -> None:
        self.count("cancel_call")
        view = mesh.slice(x=rank)
        expected = SupervisionError if rank in self.killed else TimeoutError
        with pytest.raises(expected):
            self.run(lambda: view.hang.options(timeout=0.05).call_one())

    # -- several tasks of the owner at once -----------------------------------------------

    @rule(mesh=meshes, s=slices, tasks=plans)
    def concurrent(self, mesh: ActorMesh[Ledger], s: slice, tasks: list[list[str]]) -> None:
        """Tasks call and broadcast to the same actors at once. Across tasks the order is
        arbitrary; each task's own messages run in the order it sent them, each once,
        and each call's result is the count at its place in the order the actor ran."""
        self.count("concurrent")
        view = mesh.slice(x=s)
        ranks = list(range(N)[s])
        if set(ranks) & self.stopped:
            return
        outcomes = self.run(self._concurrently, view, tasks)
        if set(ranks) & self.killed:
            # all or nothing: each call and broadcast fails, and reaches no rank
            assert all(isinstance(o, SupervisionError) for done in outcomes for o in done)
            return
        notes = self.run(view.take_notes.call).values()
        sent = sorted((i, j) for i, plan in enumerate(tasks) for j in range(len(plan)))
        counts = self.model[mesh.key]
        for k, r in enumerate(ranks):
            order = [tuple(n) for n in notes[k]]
            assert sorted(order) == sent, f"rank {r} ran {order}, sent {sent}"
            for i, plan in enumerate(tasks):
                assert [j for t, j in order if t == i] == list(range(len(plan))), (i, order)
                for j, op in enumerate(plan):
                    if op == "call":
                        place = order.index((i, j))
                        assert outcomes[i][j][k] == (r, counts[r] + place + 1), (i, j, order)
            counts[r] += len(order)

    async def _concurrently(self, view: ActorMesh[Ledger], tasks: list[list[str]]) -> list[Any]:
        outcomes: list[list[Any]] = [[] for _ in tasks]

        async def task(i: int, plan: list[str]) -> None:
            for j, op in enumerate(plan):
                try:
                    if op == "call":
                        outcomes[i].append((await view.note.call(i, j)).values())
                    else:
                        await view.note.broadcast(i, j)
                        outcomes[i].append(None)
                except SupervisionError as exc:
                    outcomes[i].append(exc)

        async with anyio.create_task_group() as tg:
            for i, plan in enumerate(tasks):
                tg.start_soon(task, i, plan)
        return outcomes

    # -- calls from a process that does not own the mesh -----------------------------------

    @rule(mesh=meshes, rank=st.integers(0, N - 1))
    def caller_bump(self, mesh: ActorMesh[Ledger], rank: int) -> None:
        """The Caller's calls to live ranks work; to dead ones they fail at once."""
        self.count("caller_bump")
        assert self.caller is not None
        if rank in self.stopped:
            return
        if rank not in self.killed:
            # our broadcasts have run there before the Caller's call (which another
            # sender's link may bring first)
            self.check_counts(rank)
        kind, value = self.run(self.caller.call.call_one, mesh.slice(x=rank), "bump")
        if rank in self.killed:
            assert kind == "SupervisionError", (kind, value)
            return
        assert kind == "ok", (kind, value)
        self.model[mesh.key][rank] += 1
        assert tuple(value) == (rank, self.model[mesh.key][rank])

    @precondition(lambda self: len(self.killed | self.stopped) < N)
    @rule(mesh=meshes, data=st.data())
    def kill_during_caller_call(self, mesh: ActorMesh[Ledger], data: st.DataObject) -> None:
        """A rank dies while the Caller waits on it: the Caller's call ends with a
        SupervisionError (a Died notice from the owner, or the broken link)."""
        self.count("kill_during_caller_call")
        assert self.caller is not None
        rank = data.draw(st.sampled_from(self.live_ranks()))
        view = mesh.slice(x=rank)
        outcome = self.call_held(self.caller, view, rank, "hold")
        self.kill(rank)
        kind, message = outcome.result(timeout=STEP_DEADLINE + 5)
        assert kind == "SupervisionError", (kind, message)

    def call_held(
        self, caller: ActorMesh[Caller] | None, view: ActorMesh[Ledger], rank: int, method: str
    ) -> Future[tuple[str, Any]]:
        """Start ``view.<method>`` (``hold`` or ``block``) from ``caller`` (None: from
        here), and wait until it runs at ``rank``; how it ends comes later."""
        n = self.holds[(view.key, rank)] = self.holds.get((view.key, rank), 0) + 1
        if caller is None:
            outcome = self.start_soon(self._call, view, method)
        else:
            outcome = self.start_soon(caller.call.call_one, view, method)
        self.run(view.wait_holds.call_one, n)
        return outcome

    @staticmethod
    async def _call(view: ActorMesh[Ledger], method: str) -> tuple[str, Any]:
        """What :meth:`Caller.call` returns, for a call from here."""
        try:
            return "ok", await getattr(view, method).call_one()
        except Exception as exc:
            return type(exc).__name__, str(exc)

    # -- failures -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.killed) < N)
    @rule(data=st.data())
    def kill_rank(self, data: st.DataObject) -> None:
        self.count("kill")
        self.kill(data.draw(st.sampled_from(sorted(set(range(N)) - self.killed))))

    @precondition(lambda self: len(self.killed | self.stopped) < N)
    @rule(data=st.data())
    def stop(self, data: st.DataObject) -> None:
        self.count("stop")
        rank = data.draw(st.sampled_from(self.live_ranks()))
        self.stop_proc(self.pids[rank])
        self.stopped.add(rank)

    @precondition(lambda self: bool(self.stopped))
    @rule(data=st.data())
    def cont(self, data: st.DataObject) -> None:
        self.count("cont")
        rank = data.draw(st.sampled_from(sorted(self.stopped)))
        self.cont_proc(self.pids[rank])
        self.stopped.discard(rank)

    # -- invariants ---------------------------------------------------------------------------

    def wait_reported(self) -> None:
        """Wait until the owner has heard of as many deaths as the model expects."""

        async def reported() -> None:
            while len(self.failures) < len(self.killed):
                self._reported = anyio.Event()
                await self._reported.wait()

        self.run(reported)

    @invariant()
    def every_death_reported_once(self) -> None:
        if self.procs is None:
            return
        self.wait_reported()
        ranks = [f.rank for f in self.failures]
        assert sorted(ranks) == sorted(self.killed), (ranks, self.killed)
        assert len(ranks) == len(set(ranks)), f"a failure was reported twice: {ranks}"

    @invariant()
    def the_caller_lives(self) -> None:
        assert not self.caller_failures

    @invariant()
    def no_call_left_pending(self) -> None:
        assert not self.rt.calls.pending

    def teardown(self) -> None:
        try:
            for rank in list(self.stopped):
                self.cont_proc(self.pids[rank])
            for procs in (self.procs, self.caller_procs):
                if procs is not None:
                    self.run(procs.stop)
            assert not self.rt.calls.pending
        finally:
            self._rt_cm.__exit__(None, None, None)
            self._portal_cm.__exit__(None, None, None)
