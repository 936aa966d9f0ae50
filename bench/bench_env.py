"""Environments on hosts: what the first realisation moves and costs, what a second
open costs over a plain spawn, and what a sync of one edited file costs.

Three host agents on loopback, each with a depot of its own (as on three machines:
nothing is shared between them but the controller), get an environment of amesh's
own wheels (amesh built from this checkout, its dependencies repacked from this
interpreter: what a bare host needs) plus a tiny package, and a workspace of
``--files`` files (``--mib`` MiB in all). Measured, in one run:

* ``first``: the first ``HostMesh.provision`` (wheels and workspace blobs to each host
  that lacks them, a venv built by uv offline per host, a tree per host): seconds,
  blobs and bytes moved.
* ``again``: a second provision of the same environment and workspace (each host asked
  what it lacks: nothing): seconds, bytes moved.
* ``spawn``: ``--procs`` workers per host to their first answer, plain (the agents'
  own Python) against in the environment's venv after a provision that moves nothing
  (the "second open"); the overhead per host is (env - plain) / hosts, the issue's
  goal <= 0.5 s.
* ``sync``: one workspace file edited, ``HostMesh.sync``: seconds, blobs, bytes.

Usage::

    .venv/bin/python bench/bench_env.py              # 3 hosts, 5,000 files, 100 MiB
    .venv/bin/python bench/bench_env.py --quick      # 500 files, 10 MiB
    .venv/bin/python bench/bench_env.py --json

Nothing leaves the machine: the wheels come from this checkout and this interpreter,
the agents listen on 127.0.0.1, and everything (agents, depots, wheels, workspace)
lives in a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import anyio

import amesh
from amesh._depot import file_digest, scan
from amesh._env import amesh_wheel
from amesh._hosts import EnvPackages, agent_bundle

PROBE = """
import amesh


class Probe(amesh.Actor):
    @amesh.endpoint
    def ping(self) -> str:
        import benchpkg

        return benchpkg.VALUE
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Agent:
    def __init__(self, key: Path, depot: Path) -> None:
        self.addr = f"tcp://127.0.0.1:{_free_port()}"
        env = dict(os.environ, AMESH_DEPOT_DIR=str(depot))
        cmd = [sys.executable, "-m", "amesh", "agent", "--listen", self.addr]
        self.proc = subprocess.Popen(
            [*cmd, "--key-file", str(key)], stderr=subprocess.PIPE, text=True, env=env
        )
        self.up = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "listening on" in line:
                self.up.set()
        self.up.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _tiny_wheel(out: Path) -> Path:
    """A wheel of ``benchpkg`` (one module), written by hand."""
    info = "benchpkg-1.0.dist-info"
    files = {
        "benchpkg/__init__.py": 'VALUE = "from the environment"\n',
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: benchpkg\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{name},sha256={b64},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = out / "benchpkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), text)
    return path


def _workspace(root: Path, files: int, mib: int) -> Path:
    """``files`` files of ``mib`` MiB in all, in 50 folders, and the probe's module."""
    size = max(1, (mib << 20) // files)
    for i in range(files):
        folder = root / f"pkg{i % 50}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i}.bin").write_bytes(os.urandom(size))
    (root / "bench_probe.py").write_text(PROBE)
    return root


def _env_packages(wheels: list[tuple[str, str, str]]) -> EnvPackages:
    lines = []
    for name, sha, _ in sorted(wheels):
        dist, version = name.split("-")[:2]
        lines.append(f"{dist}=={version} --hash=sha256:{sha}\n")
    requirements = "".join(lines)
    return EnvPackages(
        env_hash=hashlib.sha256(requirements.encode()).hexdigest()[:32],
        requirements=requirements,
        wheels=wheels,
        python_spec=f"=={sys.version_info.major}.{sys.version_info.minor}.*",
    )


def _moved(delivered: list[Any]) -> tuple[int, int]:
    return sum(d.blobs_sent for d in delivered), sum(d.bytes_sent for d in delivered)


async def _spawn_first_answer(hosts: amesh.HostMesh, procs: int) -> float:
    import bench_probe  # the workspace's module (the tree is first on the workers' path)

    t0 = time.perf_counter()
    async with hosts.spawn_procs({"procs": procs}) as mesh:
        probes = await mesh.spawn("probe", bench_probe.Probe)
        await probes.ping.call()
        return time.perf_counter() - t0


async def _plain_first_answer(hosts: amesh.HostMesh, procs: int) -> float:
    class Plain(amesh.Actor):
        @amesh.endpoint
        def ping(self) -> int:
            return os.getpid()

    t0 = time.perf_counter()
    async with hosts.spawn_procs({"procs": procs}) as mesh:
        await (await mesh.spawn("plain", Plain)).ping.call()
        return time.perf_counter() - t0


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"hosts": args.hosts, "files": args.files, "mib": args.mib}
    t0 = time.perf_counter()
    wheel = amesh_wheel(cache=tmp / "cache")
    bundle = agent_bundle(wheel.path, tmp / "wheels")
    wheels = [*bundle.wheels]
    tiny = _tiny_wheel(tmp / "wheels")
    wheels.append((tiny.name, file_digest(tiny), str(tiny)))
    out["wheels"] = len(wheels)
    out["wheels_mib"] = round(sum(Path(p).stat().st_size for *_, p in wheels) / 2**20, 1)
    out["wheels_s"] = round(time.perf_counter() - t0, 2)
    project = _workspace(tmp / "project", args.files, args.mib)
    sys.path.insert(0, str(project))
    env = _env_packages(wheels)
    key = tmp / "key"
    await anyio.run_process([sys.executable, "-m", "amesh", "keygen", str(key)])
    agents = [_Agent(key, tmp / f"depot{i}") for i in range(args.hosts)]
    try:
        for a in agents:
            await anyio.to_thread.run_sync(a.up.wait, 60)
        hosts = await amesh.attach([a.addr for a in agents], key_file=str(key))
        out["plain_spawn_s"] = round(await _plain_first_answer(hosts, args.procs), 3)

        t = time.perf_counter()
        scanned = await anyio.to_thread.run_sync(scan, [project], [], None)
        out["scan_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        first = await hosts.provision(env, scanned)
        out["first_s"] = round(time.perf_counter() - t, 2)
        out["first_blobs"], moved = _moved(first.delivered)
        out["first_mib"] = round(moved / 2**20, 1)
        out["env_spawn_first_s"] = round(await _spawn_first_answer(first, args.procs), 3)

        t = time.perf_counter()
        again = await hosts.provision(env, await anyio.to_thread.run_sync(scan, [project]))
        env_spawn = await _spawn_first_answer(again, args.procs)
        out["again_s"] = round(time.perf_counter() - t - env_spawn, 3)
        out["again_bytes"] = _moved(again.delivered)[1]
        out["env_spawn_s"] = round(env_spawn, 3)
        plain_again = await _plain_first_answer(hosts, args.procs)
        out["plain_spawn_again_s"] = round(plain_again, 3)
        # the second open (provision that moves nothing + spawn) over a plain spawn
        overhead = out["again_s"] + env_spawn - plain_again
        out["second_open_overhead_per_host_s"] = round(overhead / args.hosts, 3)

        edited = project / "pkg0" / "f0.bin"
        edited.write_bytes(os.urandom(edited.stat().st_size))
        t = time.perf_counter()
        synced = await again.sync([project])
        out["sync_s"] = round(time.perf_counter() - t, 3)
        out["sync_blobs"], out["sync_bytes"] = _moved(synced.delivered)
    finally:
        for a in agents:
            a.stop()
        sys.path.remove(str(project))
        sys.modules.pop("bench_probe", None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--procs", type=int, default=2, help="workers per host")
    p.add_argument("--files", type=int, default=5000)
    p.add_argument("--mib", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="500 files, 10 MiB")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.files, args.mib = 500, 10
    tmp = Path(tempfile.mkdtemp(prefix="amesh-bench-env-"))
    try:
        result = amesh.run(run, args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
