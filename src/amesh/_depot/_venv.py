"""A venv per environment on a host, built once from wheels in the blob store.

``realise_venv`` builds ``root/venvs/<env hash>`` with uv (``uv venv``, then ``uv pip
install --offline --no-index --find-links DIR --require-hashes``: no index, no
network; only the wheels given, each checked against the lock's hash), and reuses it
from then on without running uv at all.

Why a venv is built where it stays, not in a temporary directory renamed into place as
the store's blobs and the workspaces' trees are: a venv names its own absolute path
(the scripts' ``#!`` lines, ``pyvenv.cfg``, uv's ``RECORD`` files), so one built
elsewhere and renamed would point at a directory that is gone. Instead:

- a builder holds ``venvs/<hash>.lock`` (``fcntl.flock``) while it builds: a second
  builder of the same environment on the same host (another agent, another call)
  waits for it, with a deadline, then finds the venv made;
- the venv is complete once its marker (``.amesh-complete``) exists, written last, in
  one step (a rename); a venv without it is never used;
- the lock is passed to the uv processes too, so that it is held until every process
  of a build has exited: a builder killed (SIGKILL) mid-install leaves uv to finish or
  fail, and only then can the next builder take the lock, find a venv without a
  marker, remove it and build it again. A lock held by a file descriptor is released
  by the kernel when its last holder dies: no pid files, no stale locks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ._python import check_python
from ._store import BlobStore, check_digest

__all__ = ["MARKER", "VenvError", "realise_venv", "venv_python"]

log = logging.getLogger("amesh.depot")

#: the file whose presence says that a venv is complete (written last)
MARKER = ".amesh-complete"
#: seconds a build may take, and a second builder wait for the first, by default
BUILD_TIMEOUT = 600.0
#: seconds between tries of a held build lock (flock has no timeout of its own)
_LOCK_POLL = 0.05
#: what an environment's hash looks like (it names a directory)
_ENV_HASH = re.compile(r"[0-9A-Za-z_-]{1,128}")
#: lines of uv's output an error shows
_SHOWN_LINES = 20


class VenvError(RuntimeError):
    """A venv could not be built: the message names the host and the package."""


def venv_python(venv: Path) -> Path:
    """The interpreter of ``venv``."""
    return venv / "bin" / "python"


def realise_venv(
    store: BlobStore,
    root: str | os.PathLike[str],
    env_hash: str,
    requirements: str,
    wheels: Sequence[tuple[str, str]],
    python: str = sys.executable,
    *,
    python_spec: str = "",
    host: str = "",
    timeout: float = BUILD_TIMEOUT,
) -> Path:
    """The interpreter of environment ``env_hash``'s venv on this host, built first if
    it is not there (see the module doc).

    Args:
        store: holds the wheels.
        root: the venvs go under ``root/venvs``.
        env_hash: the environment's identity (names its venv).
        requirements: a requirements text, every line pinned with its ``--hash``.
        wheels: ``(filename, sha256)`` of each wheel it installs, all in ``store``.
        python: the interpreter the venv is made from.
        python_spec: the versions of Python the environment takes (``">=3.11"``).
        host: this host's name, for errors.
        timeout: seconds the build may take, or wait for another builder.

    Returns:
        The venv's ``bin/python``.

    Raises:
        PythonError: ``python`` does not satisfy ``python_spec``.
        VenvError: a wheel is not in the store, or uv failed (the message has what it
            said, which names the package); no venv is left marked complete.
        TimeoutError: another builder held the lock past ``timeout``.
    """
    if not _ENV_HASH.fullmatch(env_hash):
        raise ValueError(f"not an environment hash: {env_hash!r}")
    venvs = Path(root) / "venvs"
    venv = venvs / env_hash
    if (venv / MARKER).exists():
        return venv_python(venv)
    host = host or os.uname().nodename
    version = check_python(python, python_spec, host)
    missing = [name for name, digest in wheels if not store.has(check_digest(digest))]
    if missing:
        raise VenvError(f"host {host}: the wheels {', '.join(missing)} were never sent here")
    venvs.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(venvs / f"{env_hash}.lock", timeout) as lock:
        if (venv / MARKER).exists():  # built while we waited
            return venv_python(venv)
        for old in venvs.glob(f".wheels-{env_hash}-*"):  # a dead builder's
            shutil.rmtree(old, ignore_errors=True)
        if venv.exists():
            log.warning("removing the venv %s that a builder left unfinished", venv)
            shutil.rmtree(venv)
        started = time.monotonic()
        try:
            _build(store, venv, requirements, wheels, python, lock, host, timeout)
            _mark(venv, env_hash, version)
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        log.info("built venv %s in %.2f s", venv, time.monotonic() - started)
    return venv_python(venv)


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[int]:
    """Hold an exclusive flock on ``path`` (waiting at most ``timeout`` seconds); its
    descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another build of {path.stem} held {path} for over {timeout:g} s"
                    ) from None
                time.sleep(_LOCK_POLL)
        yield fd
    finally:
        os.close(fd)


def _build(
    store: BlobStore,
    venv: Path,
    requirements: str,
    wheels: Sequence[tuple[str, str]],
    python: str,
    lock: int,
    host: str,
    timeout: float,
) -> None:
    """``uv venv`` and ``uv pip install`` into ``venv``, from ``wheels`` only."""
    from uv import find_uv_bin  # (the amesh[env] extra; imported when a venv is built)

    uv = find_uv_bin()
    with tempfile.TemporaryDirectory(prefix=f".wheels-{venv.name}-", dir=venv.parent) as tmp:
        links = Path(tmp) / "wheels"
        links.mkdir()
        for name, digest in wheels:
            if "/" in name or name.startswith("."):
                raise VenvError(f"host {host}: not a wheel's file name: {name!r}")
            _link(store.path(digest), links / name)
        req = Path(tmp) / "requirements.txt"
        req.write_text(requirements)
        env = _uv_env(Path(store.root))
        _uv(
            host,
            [uv, "venv", "--no-config", "-q", "--python", python, str(venv)],
            env,
            lock,
            timeout,
        )
        install = [uv, "pip", "install", "--no-config", "--offline", "--no-index"]
        install += ["--find-links", str(links), "--require-hashes", "-r", str(req)]
        install += ["--python", str(venv_python(venv))]
        _uv(host, install, env, lock, timeout)


def _link(src: Path, dst: Path) -> None:
    """Hard-link ``src`` as ``dst``; a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _uv_env(root: Path) -> dict[str, str]:
    """uv's environment: its cache beside the store, never a download of Python, and
    nothing of the venv this process may run in."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["UV_CACHE_DIR"] = str(root / "uv-cache")
    env["UV_PYTHON_DOWNLOADS"] = "never"
    env["UV_NO_PROGRESS"] = "1"
    return env


def _uv(host: str, cmd: list[str], env: dict[str, str], lock: int, timeout: float) -> None:
    """Run uv (holding the build lock too: see the module doc).

    Raises:
        VenvError: it failed; with the last lines it wrote.
    """
    try:
        done = subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            pass_fds=(lock,),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise VenvError(f"host {host}: `uv {cmd[1]}` took over {timeout:g} s") from None
    if done.returncode != 0:
        said = "\n".join(done.stderr.strip().splitlines()[-_SHOWN_LINES:])
        raise VenvError(f"host {host}: `uv {' '.join(cmd[1:3])}` failed:\n{said}")


def _mark(venv: Path, env_hash: str, version: tuple[int, int, int]) -> None:
    """Write the marker that says ``venv`` is complete, in one step."""
    tmp = venv / f"{MARKER}.tmp"
    tmp.write_text(json.dumps({"env": env_hash, "python": list(version), "at": time.time()}))
    os.replace(tmp, venv / MARKER)
