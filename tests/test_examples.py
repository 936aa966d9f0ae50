"""Every example script runs, as a user would run it, and says what it should."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_every_example_has_a_test() -> None:
    tested = {"hello_mesh.py", "ping_pong.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.parametrize("backend", [[], ["--trio"]], ids=["asyncio", "trio"])
def test_hello_mesh(backend: list[str]) -> None:
    out = run_example("hello_mesh.py", *backend)
    assert "started 4 worker processes" in out
    assert out.count("call       Point") == 4
    # 4 calls + 1 call_one + 1 choose + 2 streamed + 4 broadcast
    assert "total 12" in out
    assert "ActorError RuntimeError: this greeter refuses" in out
    assert "all processes stopped" in out


def test_ping_pong() -> None:
    out = run_example("ping_pong.py")
    assert "pair 0: ball at 200 after 100 rounds" in out
    assert "hits taken by each ponger: [100, 100]" in out
