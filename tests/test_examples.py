"""Every example script runs, as a user would run it, and says what it should."""

from __future__ import annotations

import re
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


#: run by tests/test_torch.py
TORCH_EXAMPLES = {"train_ddp.py", "titan_mini.py", "rl_loop.py"}


def test_every_example_has_a_test() -> None:
    tested = {"hello_mesh.py", "ping_pong.py", "supervision.py", "fault_tolerant_training.py"}
    tested |= TORCH_EXAMPLES
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


@pytest.mark.parametrize("backend", [[], ["--trio"]], ids=["asyncio", "trio"])
def test_supervision(backend: list[str]) -> None:
    out = run_example("supervision.py", *backend)
    assert "supervise= callable got: ProcMesh {'gpus': 3} rank 1" in out
    assert "was killed by SIGKILL" in out
    assert "raised at the block's exit: SupervisionError" in out and "exited with code 3" in out
    assert "restarts=1" in out
    assert out.count("holds 'weights v7'") == 2
    assert "owner's __supervise__ got:" in out
    assert out.rstrip().endswith("supervision example done")


def test_fault_tolerant_training() -> None:
    out = run_example("fault_tolerant_training.py", "--steps", "30", "--kill-at", "17")
    assert "step 17: SIGKILL rank 1" in out
    assert "supervision: ProcMesh {'gpus': 2} rank 1" in out and "SIGKILL" in out
    assert "starting at step 10" in out  # the last checkpoint before the kill
    assert "training completed after 1 restart(s)" in out
    first, last = (
        float(x) for x in re.findall(r"first loss ([0-9.]+), last loss ([0-9.]+)", out)[0]
    )
    assert last < first / 5
