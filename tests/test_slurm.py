"""amesh.SlurmJob on a real SLURM cluster (scripts/cluster: 4 nodes, each a network
namespace with its own address): agents on every node, a mesh across them, a second
controller that attaches to the running job, and cancel."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import amesh
from amesh import SlurmJob
from amesh._runtime import open_runtime
from amesh._transport import HybridTransport, StreamTransport, open_transport

from .actors import Counter
from .cluster import SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)
from .test_agent import gone

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600), pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_mesh_on_four_slurm_nodes(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.slurm_conf)
    monkeypatch.setenv("AMESH_JOBS_DIR", str(tmp_path / "jobs"))
    job = SlurmJob(nodes=4, name="amesh-test", time="10:00")
    try:
        with anyio.fail_after(300):
            # tcp, the default between hosts: TLS across the nodes (the cut-off test
            # below keeps plain streams)
            async with open_runtime(
                lambda: open_transport("tcp", host=slurm_cluster.host_address)
            ) as rt:
                hosts = await job.host_mesh()
                assert hosts.sizes == {"hosts": 4}
                assert sorted(h["host"] for h in hosts.hosts) == sorted(
                    slurm_cluster.addresses.values()
                )
                assert job.state() == "RUNNING"
                async with hosts.spawn_procs({"gpus": 2}) as procs:
                    c = await procs.spawn("c", Counter)
                    assert list((await c.incr.call()).values()) == [1] * 8
                    await c.incr.broadcast()
                    assert list((await c.get.call()).values()) == [2] * 8
                    # each worker listens on its own node's address, 2 per node
                    stats = (await procs.statistics()).values()
                    hosts_of = [s["address"].split("//")[1].rsplit(":", 1)[0] for s in stats]
                    nodes = [slurm_cluster.addresses[n] for n in sorted(slurm_cluster.nodes)]
                    assert sorted(hosts_of) == sorted(nodes * 2)
                    assert all(s["address"].startswith("tls+tcp://") for s in stats)
                    # no node is the controller's host: nothing went over its streams
                    assert isinstance(rt.transport, HybridTransport)
                    routes = rt.transport.routes()
                    assert routes["tls"].frames_sent > 0
                    assert routes["stream"].frames_sent == 0
                # a second controller (here: a second handle) finds the running job
                again = SlurmJob(nodes=4, name="amesh-test")
                hosts2 = await again.host_mesh()
                assert again.job_id == job.job_id
                assert [h["pid"] for h in hosts2.hosts] == [h["pid"] for h in hosts.hosts]
        job_id = job.job_id
        assert job_id is not None
        job.cancel()
        assert slurm_cluster.wait_job(int(job_id), timeout=60) in ("CANCELLED", None)
        assert not (tmp_path / "jobs" / "amesh-test").exists()
    finally:
        if job.job_id is not None:
            job.cancel()


async def test_a_cut_off_host(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node's link goes down: its rank fails with a SupervisionError within the
    heartbeat timeout, the other host goes on, and the cut-off worker is stopped by
    its own agent (no lease from the controller for the agent's grace period, 5 s).
    Then the other node's agent is SIGKILLed: its rank fails, naming the host."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.slurm_conf)
    monkeypatch.setenv("AMESH_JOBS_DIR", str(tmp_path / "jobs"))
    job = SlurmJob(nodes=2, name="amesh-cut", time="10:00")
    cut = ""
    try:
        with anyio.fail_after(300):
            async with open_runtime(
                lambda: StreamTransport("tcp", host=slurm_cluster.host_address)
            ):
                hosts = await job.host_mesh()
                failed = anyio.Event()
                failures: list[amesh.Failure] = []

                def supervise(f: amesh.Failure) -> bool:
                    failures.append(f)
                    failed.set()
                    return True

                async with hosts.spawn_procs(
                    {"gpus": 1}, supervise=supervise, heartbeat_timeout=2.0
                ) as procs:
                    c = await procs.spawn("c", Counter)
                    assert list((await c.incr.call()).values()) == [1, 1]
                    cut = hosts.hosts[1]["hostname"]
                    victim = procs.pids[1]
                    slurm_cluster.run("ip", "-n", "amesh-sw", "link", "set", cut, "down")
                    await failed.wait()
                    assert [f.rank for f in failures] == [1]
                    assert "no heartbeat" in failures[0].cause, failures[0]
                    assert await c.slice(hosts=0).get.call_one() == 1
                    with anyio.fail_after(30):
                        await gone(victim)  # its agent stopped it
                    # and an agent that dies: every rank of its host fails, named
                    failed = anyio.Event()
                    os.kill(hosts.hosts[0]["pid"], signal.SIGKILL)
                    await failed.wait()
                    assert failures[-1].rank == 0, failures
                    assert failures[-1].host == hosts.hosts[0]["host"], failures[-1]
    finally:
        if cut:
            slurm_cluster.run("ip", "-n", "amesh-sw", "link", "set", cut, "up")
        if job.job_id is not None:
            job.cancel()


_CONTROLLER = """
import amesh

async def main():
    job = amesh.SlurmJob(nodes=1, name="amesh-exit", time="10:00")
    hosts = await job.host_mesh()
    print(job.job_id, hosts.sizes["hosts"], flush=True)

amesh.run(main)
"""


async def test_the_job_ends_with_its_controller(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A job that is not persistent is cancelled when its controller exits."""
    env = {
        **slurm_cluster.env,
        "AMESH_JOBS_DIR": str(tmp_path / "jobs"),
        "AMESH_TRANSPORT": "tcp",
        "AMESH_HOST": slurm_cluster.host_address,
    }
    with anyio.fail_after(120):
        out = await anyio.run_process([sys.executable, "-c", _CONTROLLER], env=env, check=False)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    job_id, n = out.stdout.decode().split()
    assert n == "1"
    assert slurm_cluster.wait_job(int(job_id), timeout=60) in ("CANCELLED", None)
    assert not (tmp_path / "jobs" / "amesh-exit").exists()


def test_train_ddp_on_two_slurm_nodes(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The flagship example trains with gloo across two nodes of the cluster."""
    env = {**slurm_cluster.env, "AMESH_JOBS_DIR": str(tmp_path / "jobs")}
    example = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
    args = ["--slurm=2", "--procs=1", "--steps=40", "--eval-size=1024"]
    args += [f"--listen={slurm_cluster.host_address}", f"--ckpt-dir={tmp_path / 'ckpt'}"]
    proc = subprocess.run(
        [sys.executable, str(example), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the store is at rank 0's node, not on this machine's side of the network
    store = re.search(
        r"2 ranks, backend gloo, store at (\S+) \{'hosts': 2, 'gpus': 1\}", proc.stdout
    )
    assert store is not None, proc.stdout
    assert store.group(1) in slurm_cluster.addresses.values()
    assert "eval accuracy" in proc.stdout
    assert not (tmp_path / "jobs" / "train-ddp").exists()  # cancelled at exit
