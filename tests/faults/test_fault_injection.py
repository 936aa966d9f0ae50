"""Property-based fault injection: random calls, failures, kills, stops and cancels.

Hypothesis state machines (``_machine.py``, ``_machines.py``) drive a ProcMesh through
random steps: spawn actor meshes, call them with every adverb on random slices, from
several tasks at once and from a process that does not own them, raise inside
endpoints, cancel calls, and kill, stop (SIGSTOP) and continue (SIGCONT) processes.
After every step they check:

- every call resolved (a value or the right error) within a deadline, and no call is
  left pending in the runtime (no reply lost);
- successful calls return exactly what a model of the actors predicts (no message lost,
  duplicated or reordered; each sender's messages in its order, whatever the
  interleaving of concurrent senders);
- every process death reached the owner's ``supervise=`` exactly once, and a caller
  that does not own the mesh learnt of it too;
- after the mesh is closed, no process, socket file or pending call is left (the
  autouse leak fixture).

The machines: real processes (asyncio + uvloop; also connections from an attacker),
real processes with a short heartbeat timeout (SIGSTOP is detected), in-process workers
over the memory transport (trio; cheap, so many examples), the same through a relay
tree, through a faulty controller transport (drops, duplicates, delays, a small send
window), and with restart policies. ``AMESH_FAULTS_PROFILE=long`` runs about ten times
the examples (5,000 in all), of up to 40 steps instead of 15.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, settings

from ._machine import MeshMachine
from ._machines import (
    FaultyLinks,
    InProcessWorkers,
    RealProcesses,
    RelayTree,
    Restarts,
    SilentWorkers,
)

LONG = os.environ.get("AMESH_FAULTS_PROFILE") == "long"
#: Examples per machine, CI / long (at least 500 / 5,000 in all). On 2 cores a real
#: process example costs ~0.3 s (a silent one ~4 s: each death waits out the heartbeat
#: timeout), an in-process one 0.05-0.2 s (lost credits wait for a probe); CI takes
#: about 2 minutes, the long profile about 25.
EXAMPLES = {
    RealProcesses: 300 if LONG else 30,
    SilentWorkers: 40 if LONG else 6,
    InProcessWorkers: 1500 if LONG else 200,
    RelayTree: 1200 if LONG else 150,
    FaultyLinks: 1200 if LONG else 150,
    Restarts: 900 if LONG else 120,
}
STEPS = 40 if LONG else 15
TIMEOUT = 3600 if LONG else 300

_common = dict(
    stateful_step_count=STEPS,
    deadline=None,
    # CI draws the same examples every run, so "every key rule ran" below is a fact
    # about the machine, not luck; the long profile explores afresh each time.
    derandomize=not LONG,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

CORE = ("bump", "kill", "cancel_call", "call_one", "concurrent", "caller_bump")


def _run(machine: type[MeshMachine], rules: tuple[str, ...]) -> None:
    wanted = EXAMPLES[machine]
    machine.TestCase.settings = settings(max_examples=wanted, **_common)
    began = time.monotonic()
    machine.TestCase().runTest()
    took = time.monotonic() - began
    print(f"{machine.__name__}: {machine.examples} examples in {took:.0f} s, steps {machine.steps}")
    assert machine.examples >= wanted
    for name in rules:
        assert machine.steps.get(name, 0) > 0, f"rule {name} never ran"


@pytest.mark.timeout(TIMEOUT)
def test_fault_injection_real_processes() -> None:
    _run(RealProcesses, (*CORE, "stop", "cont", "kill_during_caller_call", "attacker"))


@pytest.mark.timeout(TIMEOUT)
def test_fault_injection_silent_workers() -> None:
    _run(SilentWorkers, ("bump", "concurrent", "silent_death"))


@pytest.mark.timeout(TIMEOUT)
def test_fault_injection_in_process() -> None:
    _run(InProcessWorkers, (*CORE, "stop", "cont", "raise_in_endpoint", "kill_during_caller_call"))


@pytest.mark.timeout(TIMEOUT)
def test_fault_injection_relay_tree() -> None:
    _run(
        RelayTree,
        (
            *CORE,
            "kill_during_caller_call",
            "relay_dies_holding_broadcasts",
            "relay_dies_during_call",
        ),
    )


@pytest.mark.timeout(TIMEOUT)
def test_fault_injection_faulty_links(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMESH_SEND_WINDOW", "64")  # the smallest: floods exceed it
    _run(
        FaultyLinks,
        (*CORE, "duplicate_requests", "drop_request", "drop_reply", "flood", "delayed_concurrent"),
    )


@pytest.mark.timeout(TIMEOUT)
def test_fault_injection_restarts() -> None:
    _run(Restarts, (*CORE, "call_while_restarting", "kill_during_caller_call"))
