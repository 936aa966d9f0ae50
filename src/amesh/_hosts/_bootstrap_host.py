"""The program a launcher runs on a host that has nothing but Python: it makes the
agent's venv from the bundle's wheels (once per bundle), then runs ``amesh agent`` in
it and tells the controller the agent's address.

This module is a script, not a part of amesh: it imports the standard library only and
is sent as text (``python3 -c SOURCE ARGS``; see :func:`source`), so that a host needs
no amesh, no pip and no ``python3-venv``: the venv is made by ``uv``, taken out of its
own wheel, which the bundle carries (the agent needs it anyway, to build environments'
venvs). What it does, given the bundle's manifest (file name and sha256 of each wheel):

1. ``~/.cache/amesh/agents/<bundle hash>`` (``--home``) is the agent's venv. If its
   marker (``.amesh-complete``) is there, it is used as it is. Otherwise, holding
   ``<bundle hash>.lock`` (``flock``; a second bootstrap of the same bundle on the host
   waits, then finds it made), a venv left without its marker is removed, the wheels
   are fetched into a temporary directory beside it and checked against the manifest's
   hashes, the venv is built at its final path (a venv names its own path: it cannot be
   built elsewhere and renamed) and the marker written last.
2. The wheels come either from the controller over HTTP (``--fetch URL``: a launcher's
   short-lived server; each request carries an HMAC of itself with the job key), or on
   stdin (``--stdin``: the launcher's ssh session, see :func:`read_frames`).
3. The job key arrives in the environment (``AMESH_BOOT_KEY``, hex; SLURM's job
   script) or on stdin's first line (ssh); it is written to a file that only the user
   may read, removed when the agent exits, and taken out of the environment that the
   agent and its workers inherit. It is never printed.
4. The agent's address goes back the way the wheels came: a POST to the server, or a
   line ``agent ADDRESS`` on stdout. Then the bootstrap waits for the agent, passing it
   SIGTERM and SIGINT, and (``--stdin``) stops it when stdin closes: the controller's
   ssh session ended.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

#: the file whose presence says that an agent's venv is complete (written last)
MARKER = ".amesh-complete"
#: the environment variable that carries the job key (hex) to the bootstrap
KEY_VARIABLE = "AMESH_BOOT_KEY"
#: the header that carries a request's HMAC (hex) with the job key
AUTH_HEADER = "X-Amesh-Auth"
#: seconds a venv build may take, or a second bootstrap wait for it
BUILD_TIMEOUT = 600.0
#: seconds the agent has to write its address once started
START_TIMEOUT = 60.0
#: seconds an HTTP request to the controller may take
FETCH_TIMEOUT = 120.0


def source() -> str:
    """This script's text (what a launcher sends)."""
    return Path(__file__).read_text()


def sign(key: bytes, method: str, path: str, body: bytes = b"") -> str:
    """The HMAC (hex) that authenticates a request to the launcher's server."""
    message = method.encode() + b" " + path.encode() + b"\n" + body
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def bundle_digest(manifest: list[tuple[str, str]]) -> str:
    """A bundle's identity: the hash of its wheels' names and hashes."""
    text = "".join(f"{name} {sha}\n" for name, sha in sorted(manifest))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} was held for over {timeout:g} s") from None
                time.sleep(0.05)
        yield fd
    finally:
        os.close(fd)


def _check(path: Path, sha: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != sha:
        raise ValueError(f"{path.name}: its sha256 is not the bundle's")


def _fetch(url: str, key: bytes, manifest: list[tuple[str, str]], into: Path) -> None:
    """Every wheel of ``manifest`` from the launcher's server at ``url``."""
    for name, sha in manifest:
        path = f"/wheel/{sha}"
        request = urllib.request.Request(url + path, headers={AUTH_HEADER: sign(key, "GET", path)})
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT) as reply:
            with open(into / name, "wb") as f:
                shutil.copyfileobj(reply, f)
        _check(into / name, sha)


def read_frames(stream: IO[bytes], manifest: list[tuple[str, str]], into: Path) -> None:
    """The wheels of ``manifest`` from ``stream``: for each, a line ``SIZE`` then its
    bytes, in the manifest's order."""
    for name, sha in manifest:
        size = int(stream.readline())
        with open(into / name, "wb") as f:
            left = size
            while left:
                block = stream.read(min(left, 1 << 20))
                if not block:
                    raise EOFError(f"{name}: the stream ended {left} bytes short")
                f.write(block)
                left -= len(block)
        _check(into / name, sha)


def _uv(wheels: Path, manifest: list[tuple[str, str]]) -> Path:
    """uv's binary, taken out of its wheel (in ``wheels``) into ``wheels``."""
    for name, _ in manifest:
        if name.startswith("uv-"):
            with zipfile.ZipFile(wheels / name) as z:
                member = next(m for m in z.namelist() if m.endswith(".data/scripts/uv"))
                target = wheels / "uv"
                with z.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            target.chmod(target.stat().st_mode | stat.S_IXUSR)
            return target
    raise ValueError("the bundle has no uv wheel")


def _build(venv: Path, wheels: Path, manifest: list[tuple[str, str]], lock: int) -> None:
    uv = str(_uv(wheels, manifest))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(UV_CACHE_DIR=str(wheels / "uv-cache"), UV_PYTHON_DOWNLOADS="never")
    env.update(UV_NO_PROGRESS="1")
    files = [str(wheels / name) for name, _ in manifest]
    install = [uv, "pip", "install", "--no-config", "-q", "--offline", "--no-index"]
    install += ["--find-links", str(wheels), "--python", str(venv / "bin" / "python"), *files]
    for cmd in ([uv, "venv", "--no-config", "-q", "--python", sys.executable, str(venv)], install):
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT, pass_fds=(lock,)
        )
        if done.returncode != 0:
            raise RuntimeError(f"`uv {cmd[1]}` failed: {done.stderr.strip()[-2000:]}")


def realise(home: Path, manifest: list[tuple[str, str]], receive: Callable[[Path], None]) -> Path:
    """The agent venv's ``bin/python`` for ``manifest`` under ``home``, built first if
    it is not there; ``receive(dir)`` puts the wheels in ``dir`` (called only then)."""
    venv = home / bundle_digest(manifest)
    if (venv / MARKER).exists():
        return venv / "bin" / "python"
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(home / f"{venv.name}.lock", BUILD_TIMEOUT) as lock:
        if (venv / MARKER).exists():
            return venv / "bin" / "python"
        for old in home.glob(f".wheels-{venv.name}-*"):  # a dead bootstrap's
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f".wheels-{venv.name}-", dir=home) as tmp:
            receive(Path(tmp))
            received = time.monotonic()
            try:
                _build(venv, Path(tmp), manifest, lock)
                (venv / f"{MARKER}.tmp").write_text(json.dumps({"at": time.time()}))
                os.replace(venv / f"{MARKER}.tmp", venv / MARKER)
            except BaseException:
                shutil.rmtree(venv, ignore_errors=True)
                raise
        done = time.monotonic()
        _say(f"bundle {venv.name}: wheels {received - started:.2f} s, venv {done - received:.2f} s")
    return venv / "bin" / "python"


def _say(text: str) -> None:
    print(f"amesh bootstrap on {socket.gethostname()}: {text}", file=sys.stderr, flush=True)


def _key_file(home: Path, key: bytes) -> Path:
    keys = home / "keys"
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=keys, suffix=".key")  # (mode 0600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return Path(path)


def _start_agent(
    python: Path, args: argparse.Namespace, key_file: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """The agent, started; and its address once it listens."""
    announce = key_file.with_suffix(".addr")
    cmd = [str(python), "-m", "amesh", "agent", "--listen", args.listen]
    cmd += ["--route-to", args.route_to, "--key-file", str(key_file), "--announce", str(announce)]
    # The controller's settings name its own paths (a batch job inherits its
    # environment): on a host of its own, the agent takes the defaults.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMESH_")}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    # (its stdout to stderr: stdout is the launcher's channel, over ssh)
    agent = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    deadline = time.monotonic() + START_TIMEOUT
    while not announce.exists():
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited ({agent.returncode}) before it listened")
        if time.monotonic() > deadline:
            agent.kill()
            raise TimeoutError(f"the agent did not listen within {START_TIMEOUT:g} s")
        time.sleep(0.05)
    return agent, announce.read_text().strip()


def _post(url: str, key: bytes, path: str, body: bytes) -> None:
    headers = {AUTH_HEADER: sign(key, "POST", path, body)}
    request = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT):
        pass


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="amesh-bootstrap")
    p.add_argument("--manifest", required=True, help="JSON: [[file name, sha256], ...]")
    p.add_argument("--home", default=str(Path.home() / ".cache" / "amesh" / "agents"))
    p.add_argument("--listen", required=True)
    p.add_argument("--route-to", required=True)
    p.add_argument("--fetch", default="", help="the launcher's server (URL)")
    p.add_argument("--stdin", action="store_true", help="key, wheels and the end on stdin")
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    p.add_argument("--name", default=node, help="this host, to the launcher")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """Run the bootstrap (see the module doc); the agent's exit status."""
    args = _parse(argv)
    manifest = [(str(n), str(s)) for n, s in json.loads(args.manifest)]
    home = Path(args.home).expanduser()
    stdin = sys.stdin.buffer
    if args.stdin:
        key = bytes.fromhex(stdin.readline().decode().strip())
    else:
        key = bytes.fromhex(os.environ.pop(KEY_VARIABLE))

    def receive(into: Path) -> None:
        if args.stdin:
            print("need", flush=True)
            read_frames(stdin, manifest, into)
        else:
            _fetch(args.fetch, key, manifest, into)

    python = realise(home, manifest, receive)
    if args.stdin:
        print("have", flush=True)
    key_file = _key_file(home, key)
    try:
        agent, address = _start_agent(python, args, key_file)
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda n, _f: agent.send_signal(n))
            if args.stdin:
                print(f"agent {address}", flush=True)
                threading.Thread(target=_stop_at_eof, args=(stdin, agent), daemon=True).start()
            else:
                _post(args.fetch, key, f"/agent/{args.name}", address.encode())
            return agent.wait()
        except BaseException:  # (the controller never heard of it: no agent is left)
            agent.kill()
            agent.wait()
            raise
    finally:
        key_file.unlink(missing_ok=True)


def _stop_at_eof(stream: IO[bytes], agent: subprocess.Popen[bytes]) -> None:
    """Stop the agent once ``stream`` ends (the controller's ssh session closed)."""
    while stream.read(1 << 16):
        pass
    if agent.poll() is None:
        agent.terminate()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
