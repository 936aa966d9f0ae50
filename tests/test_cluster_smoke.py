"""The SLURM cluster of scripts/cluster works as the multi-host tests need it: a batch job's
steps run on every node, each from its own address, and reach the controller side and each
other; squeue shows jobs and scancel ends them."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from contextlib import closing, suppress
from pathlib import Path

import pytest

from .cluster import SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]  # the first up.sh may install

IO_TIMEOUT = 30.0

# One task per node: listen on its own address, say hello to the test, connect to the
# successor the test names, then report who connected to it (the ring shows that nodes
# reach each other, not only the controller side).
TASK = r"""
import os, socket, sys

node = os.environ["SLURMD_NODENAME"]
me = socket.gethostbyname(socket.gethostname())  # the cluster's /etc/hosts
listener = socket.create_server((me, 0))
ctl = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
f = ctl.makefile("rw")
port = listener.getsockname()[1]
print("hello", node, socket.gethostname(), me, port, file=f, flush=True)
host, port = f.readline().split()
with socket.create_connection((host, int(port)), timeout=30) as peer:
    peer.sendall(node.encode() + b"\n")
listener.settimeout(30)
conn, (addr, _) = listener.accept()
got = conn.makefile().readline().strip()
print("ring", node, got, addr, file=f, flush=True)
"""


@pytest.fixture
def jobs(slurm_cluster: SlurmCluster) -> Iterator[list[int]]:  # noqa: F811
    """Job ids to cancel after the test, whatever happened."""
    ids: list[int] = []
    yield ids
    if ids:
        slurm_cluster.run("scancel", *map(str, ids), check=False)
        for job in ids:
            with suppress(TimeoutError):
                slurm_cluster.wait_job(job)


class Task:
    """The test's end of one task's connection."""

    def __init__(self, server: socket.socket) -> None:
        self.conn, (self.addr, _) = server.accept()
        self.conn.settimeout(IO_TIMEOUT)
        self.file = self.conn.makefile("rw")

    def read(self) -> list[str]:
        return self.file.readline().split()

    def write(self, line: str) -> None:
        self.file.write(line + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        self.conn.close()


def test_job_steps_reach_the_controller_side_and_each_other(
    slurm_cluster: SlurmCluster,  # noqa: F811
    jobs: list[int],
    tmp_path: Path,
) -> None:
    cluster = slurm_cluster
    n = len(cluster.nodes)
    assert n >= 2

    # A long job that scancel must end; it leaves room (one CPU) for the 4-node job.
    long_job = cluster.sbatch(
        "-J", "amesh-long", "-N1", "-n1", "-o", str(tmp_path / "long.out"), "--wrap", "sleep 600"
    )
    jobs.append(long_job)
    assert cluster.wait_job(long_job, {"RUNNING"}) == "RUNNING"

    server = socket.create_server((cluster.host_address, 0))
    server.settimeout(IO_TIMEOUT)
    with closing(server):
        port = server.getsockname()[1]
        (tmp_path / "task.py").write_text(TASK)
        script = tmp_path / "job.sh"
        script.write_text(
            "#!/bin/bash\nset -e\n"
            f"srun -N{n} --ntasks-per-node=1 {sys.executable} {tmp_path / 'task.py'} "
            f"{cluster.host_address} {port}\n"
        )
        job = cluster.sbatch(
            "-J", "amesh-smoke", f"-N{n}", "--ntasks-per-node=1", "-o", str(tmp_path / "job.out"),
            str(script),
        )  # fmt: skip
        jobs.append(job)

        tasks: list[Task] = []
        try:
            for _ in range(n):
                tasks.append(Task(server))
            by_node: dict[str, tuple[Task, str, int]] = {}  # node -> task, address, port
            for task in tasks:
                word, node, hostname, me, lport = task.read()
                assert word == "hello"
                # Each node reports under its own name (SLURMD_NODENAME and hostname),
                # from its own address.
                assert hostname == node
                assert task.addr == me == cluster.addresses[node], node
                by_node[node] = (task, me, int(lport))
            assert sorted(by_node) == sorted(cluster.nodes)

            # squeue shows both jobs running, this one on all the nodes.
            queue = {int(j["id"]): j for j in cluster.squeue()}
            assert queue[job]["state"] == "RUNNING"
            assert queue[job]["nodes"] == str(n)
            assert queue[long_job]["state"] == "RUNNING"

            # The ring: node i connects to node i+1's listener.
            order = list(cluster.nodes)
            for i, node in enumerate(order):
                _, nxt_addr, nxt_port = by_node[order[(i + 1) % n]]
                by_node[node][0].write(f"{nxt_addr} {nxt_port}")
            for i, node in enumerate(order):
                prev = order[i - 1]
                assert by_node[node][0].read() == ["ring", node, prev, cluster.addresses[prev]]
        finally:
            for task in tasks:
                task.close()

    assert cluster.wait_job(job) == "COMPLETED", (tmp_path / "job.out").read_text()
    assert cluster.job_field(job, "ExitCode") == "0:0"

    cluster.run("scancel", str(long_job))
    assert cluster.wait_job(long_job) == "CANCELLED"
    assert all(int(j["id"]) != long_job or j["state"] == "CANCELLED" for j in cluster.squeue())
