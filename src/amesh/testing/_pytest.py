"""pytest fixtures for testing code that uses amesh.

Enable with ``pytest_plugins = ["amesh.testing.pytest_plugin"]`` in a conftest.py, then
request ``amesh_no_leaks`` (or make it autouse in your conftest). ``amesh_settings``
is autouse: each test reads amesh's settings afresh.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from .._config import reset as reset_settings
from ._leaks import no_leaks

__all__ = ["amesh_no_leaks", "amesh_settings", "pytest_configure", "pytest_unconfigure"]

_OWN_DIRS: list[tuple[str, str]] = []  # (environment variable, directory we made)


def pytest_configure(config: pytest.Config) -> None:
    """Give this test session its own ipc:// and shared-memory directories.

    Leak checks then see only this session's socket files and segments. The segment
    directory is on /dev/shm where there is one (segments are memory there).
    """
    if not os.environ.get("AMESH_IPC_DIR"):
        _own("AMESH_IPC_DIR", tempfile.mkdtemp(prefix="amesh-test-"))
    if not os.environ.get("AMESH_SHM_DIR"):
        try:
            path = tempfile.mkdtemp(prefix="amesh-test-shm-", dir="/dev/shm")
        except OSError:
            path = tempfile.mkdtemp(prefix="amesh-test-shm-")
        _own("AMESH_SHM_DIR", path)


def _own(var: str, path: str) -> None:
    os.environ[var] = path
    _OWN_DIRS.append((var, path))


def pytest_unconfigure(config: pytest.Config) -> None:
    while _OWN_DIRS:
        var, path = _OWN_DIRS.pop()
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(var, None)


@pytest.fixture(autouse=True)
def amesh_settings() -> Iterator[None]:
    """Each test starts from the settings of its environment: amesh reads its
    ``AMESH_*`` variables once per process, so a test that sets them (before its first
    use of amesh) and those after it see what they set, and :func:`amesh.configure`
    in one test does not reach the next."""
    reset_settings()
    yield
    reset_settings()


@pytest.fixture
def amesh_no_leaks() -> Iterator[None]:
    """Fail the test if it leaves a child process, socket file or segment behind."""
    with no_leaks():
        yield
