"""pytest fixtures for testing code that uses amesh.

Enable with ``pytest_plugins = ["amesh.testing.pytest_plugin"]`` in a conftest.py, then
request ``amesh_no_leaks`` (or make it autouse in your conftest). ``amesh_settings``
is autouse: each test reads amesh's settings afresh.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator

import pytest

from .. import _wire
from .._config import reset as reset_settings
from ._leaks import no_leaks

__all__ = ["amesh_no_leaks", "amesh_settings", "pytest_configure", "pytest_unconfigure"]

_OWN_DIRS: list[tuple[str, str]] = []  # (environment variable, directory we made)
#: a session's directory: ``amesh-test-[shm-]<pid>.<start>.<pid namespace>-<random>``,
#: its process named as a shared-memory segment's maker is (see :func:`amesh._wire.this_process`)
_SESSION_DIR = re.compile(r"amesh-test-(?:shm-)?(\d+)\.(\d+)\.(\d+)-[^-]+")


def pytest_configure(config: pytest.Config) -> None:
    """Give this test session its own ipc:// and shared-memory directories, and remove
    those of sessions that ended without removing theirs (see :func:`sweep_sessions`).

    Leak checks then see only this session's socket files and segments. The segment
    directory is on /dev/shm where there is one (segments are memory there).
    """
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    for place in {tempfile.gettempdir(), shm}:
        if place is not None:
            sweep_sessions(place)
    tag = f"{_wire.this_process()}-"
    if not os.environ.get("AMESH_IPC_DIR"):
        _own("AMESH_IPC_DIR", tempfile.mkdtemp(prefix=f"amesh-test-{tag}"))
    if not os.environ.get("AMESH_SHM_DIR"):
        try:
            path = tempfile.mkdtemp(prefix=f"amesh-test-shm-{tag}", dir=shm)
        except OSError:
            path = tempfile.mkdtemp(prefix=f"amesh-test-shm-{tag}")
        _own("AMESH_SHM_DIR", path)


def sweep_sessions(place: str) -> int:
    """Remove the directories of this plugin's test sessions in ``place`` whose process
    ended: a session killed before its end (SIGKILL, or pytest-timeout's ``thread``
    method, which ends the process at once) leaves them, with the socket files and
    shared-memory segments in them (memory, on /dev/shm). Only this user's, of this pid
    namespace, whose process surely ended (as for segments: its pid free, or reused
    since); returns how many it removed."""
    procfs, ns, uid, removed = _wire.has_procfs(), _wire.pid_namespace(), os.getuid(), 0
    try:
        names = os.listdir(place)
    except OSError:
        return 0
    for name in names:
        m = _SESSION_DIR.fullmatch(name)
        if m is None or int(m[3]) != ns:
            continue
        if not _wire.is_dead(int(m[1]), int(m[2]) if procfs else 0, procfs):
            continue
        path = os.path.join(place, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == uid and stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


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
