"""Many hosts: how long an agent takes to serve, a mesh over agents to start, and a
lost host to be noticed.

    python bench/bench_hosts.py [--json] [--slurm]

Rows (agents on loopback; with ``--slurm``, as root, also through the SLURM cluster of
``scripts/cluster``, whose nodes are network namespaces of this machine). Everything
listens on ``tcp``, the default between hosts: TLS from host to host, event-loop
streams within one (so on loopback, streams):

- agent start to first answer: ``amesh agent`` exec'd until ``attach()`` returns
  (python start-up, imports, listening, the authenticated handshake, one call);
- 2 hosts x 4 processes: ``spawn_procs`` entered until a call to all 8 answered;
- 1 host x N processes (``--procs``, default 32; the agent's zygote already runs): the
  same, and a worker's CPU (every thread's ``schedstat``) and page faults from its start
  to its first answer (medians), and the workers' PSS each;
- agent SIGKILLed: until the supervisor has seen the failure of every rank of its host;
- remote worker SIGKILLed: until the supervisor has seen its failure;
- SLURM 4 nodes x 4 processes: ``SlurmJob.host_mesh()`` plus ``spawn_procs`` until a
  call to all 16 answered, and the same again attaching to the running job.

Figures move by tens of percent between runs on this 2-CPU VM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio

import amesh
from amesh._identity import job_key
from amesh._runtime import open_runtime
from amesh._transport import open_transport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import _faults, _proc_cpu, _pss_mib

REPO = Path(__file__).resolve().parent.parent


class Ping(amesh.Actor):
    @amesh.endpoint
    def ping(self) -> int:
        return os.getpid()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_agent(key: str, grace: float = 5.0) -> tuple[subprocess.Popen[str], str]:
    addr = f"tcp://127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "amesh", "agent", "--listen", addr, "--key-file", key]
    proc = subprocess.Popen([*cmd, "--grace", str(grace)], stderr=subprocess.PIPE, text=True)
    listening = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "listening on" in line:
                listening.set()
        listening.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, addr


async def _attach_when_up(addr: str, key: str) -> amesh.HostMesh:
    while True:
        try:
            return await amesh.attach([addr], key_file=key, timeout=10)
        except amesh.SupervisionError:
            await anyio.sleep(0.01)  # not listening yet: the bench polls, that is its job


async def loopback(key: str, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    agents: list[subprocess.Popen[str]] = []
    try:
        async with open_runtime(lambda: open_transport("tcp")):
            t0 = time.perf_counter()
            p1, a1 = _start_agent(key)
            agents.append(p1)
            await _attach_when_up(a1, key)
            out["agent start to first answer (s)"] = time.perf_counter() - t0
            p2, a2 = _start_agent(key)
            agents.append(p2)
            await _attach_when_up(a2, key)
            hosts = await amesh.attach([a1, a2], key_file=key)
            seen: list[float] = []
            done = anyio.Event()
            expect = [1]

            def supervise(f: amesh.Failure) -> bool:
                seen.append(time.perf_counter())
                if len(seen) >= expect[0]:
                    done.set()
                return True

            t0 = time.perf_counter()
            async with hosts.spawn_procs({"gpus": 4}, supervise=supervise) as procs:
                p = await procs.spawn("p", Ping)
                await p.ping.call()
                out["2 hosts x 4 procs, start to first answer (s)"] = time.perf_counter() - t0
                out.update(await _many_on_one(a1, key, n))
                t0 = time.perf_counter()
                os.kill(procs.pids[0], signal.SIGKILL)
                await done.wait()
                out["remote worker SIGKILLed, to failure (ms)"] = 1e3 * (seen[0] - t0)
                seen.clear()
                done = anyio.Event()
                expect[0] = 4
                t0 = time.perf_counter()
                p2.kill()
                await done.wait()
                out["agent SIGKILLed, to failure of all 4 ranks (ms)"] = 1e3 * (seen[-1] - t0)
    finally:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
            a.wait(30)
    return out


async def _many_on_one(addr: str, key: str, n: int) -> dict[str, float]:
    one = await amesh.attach([addr], key_file=key)
    t0 = time.perf_counter()
    async with one.spawn_procs({"procs": n}) as procs:
        p = await procs.spawn("p", Ping)
        await p.ping.call()
        spawn = time.perf_counter() - t0
        pids = list(procs.pids)
        cpu = sorted(_proc_cpu(pid) for pid in pids)[n // 2]
        faults = sorted(_faults(pid) for pid in pids)[n // 2]
        pss = _pss_mib(pids) / n
    return {
        f"1 host x {n} procs, start to first answer (s)": spawn,
        f"1 host x {n} procs, a worker's CPU to its first answer (ms)": cpu * 1e3,
        f"1 host x {n} procs, a worker's page faults to its first answer": faults,
        f"1 host x {n} procs, PSS per worker (MiB)": pss,
    }


async def slurm() -> dict[str, float]:
    env_file = Path(os.environ.get("AMESH_SLURM_DIR", "/run/amesh-slurm")) / "cluster.env"
    host = "10.77.0.1"
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            name, _, value = line.partition("=")
            os.environ[name.removeprefix("export ").strip()] = value.strip().strip('"')
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as jobs:
        os.environ["AMESH_JOBS_DIR"] = jobs
        async with open_runtime(lambda: open_transport("tcp", host=host)):
            for label in ("submit", "attach to the running job"):
                job = amesh.SlurmJob(nodes=4, name="amesh-bench", time="10:00")
                t0 = time.perf_counter()
                hosts = await job.host_mesh()
                async with hosts.spawn_procs({"gpus": 4}) as procs:
                    p = await procs.spawn("p", Ping)
                    await p.ping.call()
                out[f"SLURM 4 x 4 procs, {label}, to first answer (s)"] = time.perf_counter() - t0
            job.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--slurm", action="store_true", help="also through scripts/cluster (root)")
    ap.add_argument("--procs", type=int, default=32, help="processes on one agent (default 32)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        key = os.path.join(tmp, "key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, job_key().hex().encode() + b"\n")
        os.close(fd)
        results: dict[str, Any] = anyio.run(loopback, key, args.procs)
    if args.slurm:
        up = subprocess.run(["bash", str(REPO / "scripts/cluster/up.sh")], capture_output=True)
        if up.returncode:
            sys.exit(f"scripts/cluster/up.sh failed:\n{up.stderr.decode()}")
        try:
            results.update(anyio.run(slurm))
        finally:
            subprocess.run(["bash", str(REPO / "scripts/cluster/down.sh")], capture_output=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, value in results.items():
            print(f"| {name} | {value:.3g} |")


if __name__ == "__main__":
    main()
