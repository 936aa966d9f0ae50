"""Property-based fault injection: random calls, failures, kills, stops and cancels.

A hypothesis state machine drives one ProcMesh through random steps: spawn actor
meshes, call them with every adverb on random slices, raise inside endpoints, cancel
calls, and kill, stop (SIGSTOP) and continue (SIGCONT) processes. After every step it
checks:

- every call resolved (a value or the right error) within a deadline, and no call is
  left pending in the runtime (no reply lost);
- successful calls return exactly what a model of the actors predicts (no message lost,
  duplicated or reordered);
- every process death reached the owner's ``supervise=`` exactly once;
- after the mesh is closed, no process, socket file or pending call is left.

Two machines run the same rules: one on real processes (asyncio + uvloop) and one on
in-process workers over the memory transport (trio), which is fast enough for many
more examples. ``AMESH_FAULTS_PROFILE=long`` selects a longer run.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, settings
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
from amesh._runtime._context import runtime_var
from amesh._runtime._runtime import Runtime, open_runtime
from amesh._transport import open_transport
from amesh.testing import InProcessHost, MemoryTransport

from ..actors import Model

N = 3
#: How long any single step may take before it counts as a hang.
STEP_DEADLINE = 30.0

LONG = os.environ.get("AMESH_FAULTS_PROFILE") == "long"
#: Examples run in CI (real processes / in-process); the long profile runs more.
REAL_EXAMPLES = 60 if LONG else 15
INPROC_EXAMPLES = 400 if LONG else 100
STEPS = 40 if LONG else 15

slices = st.tuples(st.integers(0, N - 1), st.integers(1, N)).map(
    lambda t: slice(t[0], max(t[0] + 1, t[1]))
)


class MeshMachine(RuleBasedStateMachine):
    """The rules; subclasses say how processes start, die, stop and continue."""

    backend: tuple[str, dict[str, Any]] = ("asyncio", {})
    #: the relay tree's fan-out (0: every rank is sent to directly)
    fanout = 0
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
        self.killed: set[int] = set()
        self.stopped: set[int] = set()
        self.model: dict[str, list[int]] = {}
        self.procs: ProcMesh | None = None
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

    # -- plumbing ---------------------------------------------------------------------------

    def count(self, rule: str) -> None:
        type(self).steps[rule] = type(self).steps.get(rule, 0) + 1

    def run(self, fn: Any, *args: Any) -> Any:
        async def step() -> Any:
            runtime_var.set(self.rt)
            with anyio.fail_after(STEP_DEADLINE):
                return await fn(*args)

        return self.portal.call(step)

    def supervise(self, failure: Failure) -> bool:
        self.failures.append(failure)
        if self._reported is not None:
            self._reported.set()
        return True  # handled: the rest of the mesh keeps working

    def live(self, s: slice) -> bool:
        ranks = set(range(N)[s])
        return not (ranks & self.killed) and not (ranks & self.stopped)

    # -- rules ------------------------------------------------------------------------------

    @initialize(target=meshes)
    def start(self) -> ActorMesh[Model]:
        async def start() -> ProcMesh:
            return await ProcMesh(
                per_host={"x": N},
                host=self.host(),
                supervise=self.supervise,
                heartbeat_period=0.2,
                heartbeat_timeout=120.0,
                fanout=self.fanout,
            )

        self.procs = self.run(start)
        self.pids = self.procs.pids
        type(self).examples += 1
        return self._spawn()

    def _spawn(self) -> ActorMesh[Model]:
        assert self.procs is not None
        self.spawned += 1
        mesh = self.run(self.procs.spawn, f"m{self.spawned}", Model)
        self.model[mesh.key] = [0] * N
        return mesh

    @precondition(lambda self: self.spawned < 2 and not self.killed and not self.stopped)
    @rule(target=meshes)
    def spawn(self) -> ActorMesh[Model]:
        self.count("spawn")
        return self._spawn()

    @rule(mesh=meshes, s=slices, adverb=st.sampled_from(["call", "stream", "broadcast"]))
    def bump(self, mesh: ActorMesh[Model], s: slice, adverb: str) -> None:
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

    async def _collect(self, view: ActorMesh[Model]) -> list[tuple[int, int]]:
        return [value async for _, value in view.bump.stream()]

    @rule(mesh=meshes, rank=st.integers(0, N - 1))
    def call_one(self, mesh: ActorMesh[Model], rank: int) -> None:
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
    def choose(self, mesh: ActorMesh[Model]) -> None:
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
    def raise_in_endpoint(self, mesh: ActorMesh[Model], rank: int) -> None:
        self.count("raise_in_endpoint")
        if rank in self.stopped:
            return
        view = mesh.slice(x=rank)
        expected = SupervisionError if rank in self.killed else ActorError
        with pytest.raises(expected):
            self.run(view.fail.call_one)

    @rule(mesh=meshes, rank=st.integers(0, N - 1))
    def cancel_call(self, mesh: ActorMesh[Model], rank: int) -> None:
        self.count("cancel_call")
        view = mesh.slice(x=rank)
        expected = SupervisionError if rank in self.killed else TimeoutError
        with pytest.raises(expected):
            self.run(lambda: view.hang.call_one(timeout=0.05))

    @precondition(lambda self: len(self.killed) < N)
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        self.count("kill")
        rank = data.draw(st.sampled_from(sorted(set(range(N)) - self.killed)))
        self.kill_proc(self.pids[rank])
        self.killed.add(rank)
        self.stopped.discard(rank)

    @precondition(lambda self: len(self.killed | self.stopped) < N)
    @rule(data=st.data())
    def stop(self, data: st.DataObject) -> None:
        self.count("stop")
        rank = data.draw(st.sampled_from(sorted(set(range(N)) - self.killed - self.stopped)))
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

    @invariant()
    def every_death_reported_once(self) -> None:
        async def reported() -> None:
            while len(self.failures) < len(self.killed):
                self._reported = anyio.Event()
                await self._reported.wait()

        if self.procs is None:
            return
        self.run(reported)
        ranks = [f.rank for f in self.failures]
        assert sorted(ranks) == sorted(self.killed), (ranks, self.killed)
        assert len(ranks) == len(set(ranks)), f"a failure was reported twice: {ranks}"

    @invariant()
    def no_call_left_pending(self) -> None:
        assert not self.rt.pending

    def teardown(self) -> None:
        try:
            for rank in list(self.stopped):
                self.cont_proc(self.pids[rank])
            if self.procs is not None:
                self.run(self.procs.stop)
            assert not self.rt.pending
        finally:
            self._rt_cm.__exit__(None, None, None)
            self._portal_cm.__exit__(None, None, None)


class RealProcesses(MeshMachine):
    backend = ("asyncio", {"use_uvloop": True})
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012


class InProcessWorkers(MeshMachine):
    backend = ("trio", {})
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    def __init__(self) -> None:
        self._host = InProcessHost()
        super().__init__()

    def transport(self) -> Any:
        return MemoryTransport()

    def host(self) -> Any:
        return self._host

    def kill_proc(self, pid: int) -> None:
        self.portal.call(self._sync, self._host.worker(pid).kill)

    def stop_proc(self, pid: int) -> None:
        self.portal.call(self._sync, self._host.worker(pid).pause)

    def cont_proc(self, pid: int) -> None:
        self.portal.call(self._sync, self._host.worker(pid).resume)

    async def _sync(self, fn: Any) -> None:
        fn()


class RelayTree(InProcessWorkers):
    """The same rules through a relay tree (fan-out 2 over 3 ranks: rank 2's messages
    go through rank 0). A stopped relay would hold its subtree's messages until it is
    declared dead, which the model does not follow, so this machine kills but does not
    stop; a broadcast is followed by a call to the same ranks, so that it has arrived
    (per-sender order, through the tree) before a relay may be killed."""

    backend = ("asyncio", {})
    fanout = 2
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    stop = None  # type: ignore[assignment]
    cont = None  # type: ignore[assignment]

    @rule(
        mesh=MeshMachine.meshes, s=slices, adverb=st.sampled_from(["call", "stream", "broadcast"])
    )
    def bump(self, mesh: ActorMesh[Model], s: slice, adverb: str) -> None:
        super().bump(mesh, s, adverb)
        ranks = list(range(N)[s])
        if adverb == "broadcast" and not set(ranks) & self.killed:
            counts = self.model[mesh.key]
            got = self.run(mesh.slice(x=s).peek.call).values()
            assert got == [(r, counts[r]) for r in ranks]


def _report(
    machine: type[MeshMachine],
    wanted: int,
    rules: tuple[str, ...] = ("bump", "kill", "stop", "cont", "cancel_call", "raise_in_endpoint"),
) -> None:
    print(f"{machine.__name__}: {machine.examples} examples, steps {machine.steps}")
    assert machine.examples >= wanted
    for name in rules:
        assert machine.steps.get(name, 0) > 0, f"rule {name} never ran"


_common = dict(
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.timeout(900 if LONG else 300)
def test_fault_injection_real_processes() -> None:
    RealProcesses.TestCase.settings = settings(max_examples=REAL_EXAMPLES, **_common)
    RealProcesses.TestCase().runTest()
    _report(RealProcesses, REAL_EXAMPLES)


@pytest.mark.timeout(900 if LONG else 300)
def test_fault_injection_in_process() -> None:
    InProcessWorkers.TestCase.settings = settings(max_examples=INPROC_EXAMPLES, **_common)
    InProcessWorkers.TestCase().runTest()
    _report(InProcessWorkers, INPROC_EXAMPLES)


@pytest.mark.timeout(900 if LONG else 300)
def test_fault_injection_relay_tree() -> None:
    RelayTree.TestCase.settings = settings(max_examples=INPROC_EXAMPLES // 2, **_common)
    RelayTree.TestCase().runTest()
    _report(RelayTree, INPROC_EXAMPLES // 2, ("bump", "kill", "cancel_call", "call_one"))
