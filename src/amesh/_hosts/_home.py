"""This machine's own host agent, started on demand: it holds the persistent meshes of
controllers on this machine (``ProcMesh(..., name=, persistent=True)``).

Its files live in the state directory (``AMESH_STATE_DIR``, else ``~/.cache/amesh``,
made readable by its owner only):

- ``key``: the key of this user's persistent meshes on this machine (made on first use,
  like ``amesh keygen``). A controller that starts or attaches to such a mesh adopts it
  as its job key, so it must do so before it starts any other mesh, or be started
  with ``AMESH_KEY_FILE`` naming this file;
- ``agent.addr``: where the agent listens (loopback tcp), written once it listens and
  removed when it exits;
- ``agent.run``: locked by the running agent, with its pid and address in it: a
  controller finds the agent through it when ``agent.addr`` is missing or damaged,
  and never starts a second one while it is held;
- ``agent.log``: what it logs;
- ``meshes/``: the live meshes of this user's controllers on this machine (see
  :mod:`amesh._mesh._registry`).

The agent is started in a session of its own (it is nobody's child: it outlives the
controller that started it) and exits by itself once it has had no worker and no
controller for ``AMESH_LOCAL_AGENT_IDLE`` seconds (30 by default). A lock file
(``agent.lock``) makes sure that two controllers starting at once start one agent.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from .._config import settings
from .._identity import write_key_file
from .._mesh import set_registry_dir

__all__ = [
    "found_agent",
    "hold_agent_lock",
    "local_agent",
    "local_agent_address",
    "local_key",
    "running_agent",
    "state_dir",
]

log = logging.getLogger("amesh.hosts")

#: How long a starting agent may take to listen.
START_TIMEOUT = 30.0
#: What the local agent's address looks like (it listens on loopback streams)
_ADDRESS = re.compile(r"stream\+tcp://[0-9.:\[\]a-f]+:[0-9]{1,5}(/[0-9a-f]{12})?")


def state_dir() -> Path:
    """``AMESH_STATE_DIR``, else ``~/.cache/amesh`` (created, mode 0700)."""
    path = Path(settings().state_dir or Path.home() / ".cache" / "amesh")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


# the controllers' live meshes, for ``amesh list`` (see amesh._mesh._registry)
set_registry_dir(lambda: state_dir() / "meshes")


def local_key() -> Path:
    """The key file of this machine's persistent meshes (made on first use)."""
    path = state_dir() / "key"
    try:
        write_key_file(str(path))
    except FileExistsError:
        pass
    return path


def _address(text: str, where: Path) -> str | None:
    """``text`` if it is the local agent's address; else None, and a warning."""
    addr = text.strip()
    if not addr:
        return None
    if not _ADDRESS.fullmatch(addr):
        log.warning("ignoring %s: %r is not an agent's address", where, addr[:60])
        return None
    return addr


def local_agent_address() -> str | None:
    """Where the local agent listens, if one announced itself (it may be gone)."""
    path = state_dir() / "agent.addr"
    try:
        return _address(path.read_text(errors="replace"), path)
    except FileNotFoundError:
        return None


def hold_agent_lock(path: str, addr: str) -> int | None:
    """Lock ``path`` (``agent.run``) for the agent at ``addr``, this process, and say
    so in it: the descriptor that holds the lock (closing it lets go), or None when
    another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {addr}\n".encode())
    return fd


def running_agent() -> tuple[int, str | None] | None:
    """The pid of the local agent that holds ``agent.run``, and its address (None when
    it has not written it yet, or it is damaged); None when no agent runs."""
    path = state_dir() / "agent.run"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, addr = os.read(fd, 4096).decode(errors="replace").partition(" ")
            return (int(pid) if pid.isdigit() else 0), _address(addr, path)
        return None  # (the lock goes with the descriptor)
    finally:
        os.close(fd)


async def local_agent(reachable: Callable[[str], Awaitable[bool]]) -> str:
    """The address of this machine's agent, started if none answers.

    Args:
        reachable: ``async (addr) -> bool``: whether an agent answers at ``addr``.
    """
    addr = local_agent_address()
    if addr is not None and await reachable(addr):
        return addr
    lock = await anyio.to_thread.run_sync(_lock)
    try:
        addr = local_agent_address()  # another controller may have started it meanwhile
        if addr is not None and await reachable(addr):
            return addr
        running = await found_agent(reachable)
        return running if running is not None else await _start()
    finally:
        os.close(lock)


async def found_agent(reachable: Callable[[str], Awaitable[bool]]) -> str | None:
    """The address of the local agent found through its lock (``agent.addr`` did not
    name it), None when none runs.

    Raises:
        RuntimeError: one runs but does not answer (a second would orphan its meshes).
    """
    with anyio.move_on_after(START_TIMEOUT):
        while True:
            running = running_agent()
            if running is None:
                return None
            pid, addr = running
            if addr is not None:  # (else it is about to write it)
                break
            await anyio.sleep(0.02)
    if addr is not None and await reachable(addr):
        return addr
    where = f"at {addr}" if addr is not None else "(it did not say where it listens)"
    raise RuntimeError(
        f"this machine's amesh agent (pid {pid}) runs but does not answer {where}: see "
        f"{state_dir() / 'agent.log'}; stop it (kill {pid}) and a new one starts (its "
        "persistent meshes end with it)"
    )


def _lock() -> int:
    fd = os.open(state_dir() / "agent.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


async def _start() -> str:
    home = state_dir()
    await anyio.to_thread.run_sync(_spawn_agent, home)
    with anyio.move_on_after(START_TIMEOUT):
        while True:
            addr = local_agent_address()
            if addr is not None:
                return addr
            await anyio.sleep(0.02)  # the agent writes the file once it listens
    raise RuntimeError(
        f"the local amesh agent did not start within {START_TIMEOUT:g} s; see {home / 'agent.log'}"
    )


def _spawn_agent(home: Path) -> None:
    announce = home / "agent.addr"
    announce.unlink(missing_ok=True)
    idle = settings().local_agent_idle
    cmd = [sys.executable, "-m", "amesh", "agent", "--listen", "stream+tcp://127.0.0.1:0"]
    cmd += ["--key-file", str(local_key()), "--announce", str(announce)]
    cmd += ["--lock", str(home / "agent.run")]
    cmd += ["--idle-exit", str(idle)]
    env = dict(os.environ)
    # the workers import what this controller imports
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    with open(home / "agent.log", "ab") as log:
        # a new session, and a shell that does not wait for it: the agent is nobody's
        # child here, and outlives this process
        subprocess.run(
            ["/bin/sh", "-c", '"$@" </dev/null &', "sh", *cmd],
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
            check=True,
        )
