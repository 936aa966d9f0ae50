"""``breakpoint()`` on a rank that a host agent started: ``amesh.debug()`` at the
controller relays the session through the agent, and ``amesh debug`` works on the
agent's machine. The agent runs on loopback tcp and stands for another machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pexpect
import pytest

from .test_agent import Agent, ancestors, shared_key
from .test_debug import (
    CONTROLLER,
    Start,
    _announced,
    _breakpoint_line,
    _cli_session,
    _finish,
    _pdb_session,
    _spawn,
    _worker_pids,
)

#: The controller of tests/test_debug.py, its processes on the agent at ``argv[3]``.
REMOTE_CONTROLLER = CONTROLLER.replace(
    '    async with amesh.ProcMesh(per_host={"procs": 2}) as procs:\n',
    "    hosts = await amesh.attach([sys.argv[3]])\n"
    '    async with hosts.spawn_procs({"procs": 2}) as procs:\n',
)
assert REMOTE_CONTROLLER != CONTROLLER


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def agent(tmp_path: Path, state: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    """An ``amesh agent`` on loopback (its state directory: ``state``); the controllers
    started after it use its key and listen on tcp."""
    key = shared_key(tmp_path)
    for name in ("PYTHONBREAKPOINT", "AMESH_OUTPUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AMESH_STATE_DIR", str(state))
    started = Agent(key)
    try:
        anyio.run(started.listening)
        monkeypatch.setenv("AMESH_KEY_FILE", str(key))
        monkeypatch.setenv("AMESH_TRANSPORT", "tcp")
        monkeypatch.setenv("AMESH_HOST", "127.0.0.1")
        yield started
    finally:
        rc = started.stop()
    assert rc == 0, "".join(started.log)


@pytest.fixture
def controller(tmp_path: Path, state: Path, agent: Agent) -> Iterator[Start]:
    """``controller.py`` on the agent, waiting in ``amesh.debug()`` or not (``mode``),
    started by the test (``.start(stop, mode)``)."""
    script = tmp_path / "controller.py"
    script.write_text(REMOTE_CONTROLLER)
    children: list[pexpect.spawn] = []

    def start(stop: str, mode: str) -> pexpect.spawn:
        child = _spawn([str(script), stop, mode, agent.addr], tmp_path, state)
        children.append(child)
        return child

    yield start
    for child in children:
        child.close(force=True)


@pytest.mark.timeout(120)
def test_a_breakpoint_under_an_agent_is_debugged_at_the_controller(
    controller: Start, agent: Agent
) -> None:
    child = controller("1", "debug")
    pids = _worker_pids(child)
    assert all(agent.proc.pid in ancestors(pid) for pid in pids)
    child.expect(rf"attached to w\[1\] at controller\.py:{_breakpoint_line()}")
    _pdb_session(child)
    _finish(child, pids)
    assert "amesh: w[1] at controller.py" in child.before  # "... goes on"


@pytest.mark.timeout(120)
def test_amesh_debug_on_the_agents_machine(
    controller: Start, agent: Agent, tmp_path: Path, state: Path
) -> None:
    child = controller("0", "wait")
    pids = _worker_pids(child)
    # the worker says so itself: the agent's listener prints on the agent's terminal
    child.expect(
        r"amesh: w\[0\] at controller\.py:\d+ paused \(pid \d+ on [^)]+\): attach with "
        r"`await amesh\.debug\(\)` at the controller"
    )
    anyio.run(agent.logged, "w[0] at controller.py")  # its listener says it paused
    path, entry = _announced(state)
    assert entry["pid"] == agent.proc.pid
    _cli_session(tmp_path, state)
    _finish(child, pids)
    agent.stop()
    assert not path.exists()
