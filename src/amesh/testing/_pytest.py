"""pytest fixtures for testing code that uses amesh.

Enable with ``pytest_plugins = ["amesh.testing.pytest_plugin"]`` in a conftest.py, then
request ``amesh_no_leaks`` (or make it autouse in your conftest).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from ._leaks import no_leaks

__all__ = ["amesh_no_leaks", "pytest_configure", "pytest_unconfigure"]

_OWN_DIR: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Give this test session its own ipc:// directory, so leak checks see only ours."""
    if not os.environ.get("AMESH_IPC_DIR"):
        path = tempfile.mkdtemp(prefix="amesh-test-")
        os.environ["AMESH_IPC_DIR"] = path
        _OWN_DIR.append(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _OWN_DIR:
        shutil.rmtree(_OWN_DIR.pop(), ignore_errors=True)
        os.environ.pop("AMESH_IPC_DIR", None)


@pytest.fixture
def amesh_no_leaks() -> Iterator[None]:
    """Fail the test if it leaves a child process or an amesh socket file behind."""
    with no_leaks():
        yield
