"""Shared fixtures: both anyio backends, and a check that no test leaks anything."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"use_uvloop": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


def child_pids(pid: int | None = None) -> set[int]:
    """Direct children of ``pid`` (this process by default), zombies included."""
    pid = pid or os.getpid()
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.update(int(x) for x in f.read().split())
        except FileNotFoundError:
            continue
    return out


IPC_DIR = os.path.join(tempfile.gettempdir(), f"amesh-{os.getuid()}")


def socket_files() -> set[str]:
    try:
        return set(os.listdir(IPC_DIR))
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves a child process or a socket file behind."""
    kids_before = child_pids()
    files_before = socket_files()
    yield
    leaked = child_pids() - kids_before
    assert not leaked, f"test leaked child processes {sorted(leaked)}"
    new_files = socket_files() - files_before
    assert not new_files, f"test leaked socket files {sorted(new_files)}"
