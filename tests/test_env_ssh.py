"""Environments on machines reached over ssh that have nothing but Python: on two nodes
of scripts/cluster (each its own network namespace and address), the test starts
Debian's sshd on a port of its own, with a throwaway host key and an authorized key it
makes, in a mount namespace that hides the controller's files (tests/env_hosts.py); the
`ssh` launcher brings amesh over the sessions, an environment brings a package the
hosts lack, and a second open reuses what the first built. Then the same through the
public API only: an environment file whose ``cloud`` target is ``launcher = "ssh"``."""

from __future__ import annotations

import importlib
import json
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from amesh._depot import MARKER, scan
from amesh._env import Environment
from amesh._hosts import AgentBundle, EnvPackages, SshHosts
from amesh._runtime import open_runtime
from amesh._transport import open_transport

from .cluster import SCRIPTS, SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)
from .env_hosts import LOOKUP, NOTHING, SYSTEM_PYTHON, env_project, hide, made  # noqa: F401
from .env_targets import (  # noqa: F401  (the fixtures)
    ENV_FILE,
    built,
    check_probes,
    controller,
    links,
    no_secret_in,
    probe_target,
    target_project,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240), pytest.mark.anyio]

NODES = ("amesh-n3", "amesh-n4")
PORT = 2222  # not ssh's own
SSHD_TIMEOUT = 30.0

SSHD_CONFIG = """\
Port {port}
ListenAddress {address}
HostKey /root/sshd/host_key
PidFile none
UsePAM no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
AuthorizedKeysFile /root/sshd/authorized_keys
StrictModes no
LogLevel ERROR
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def keygen(path: Path) -> str:
    """A new ed25519 key pair at ``path``; its public key."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "amesh-test", "-f", str(path)],
        check=True,
        timeout=30,
    )
    return path.with_suffix(".pub").read_text().strip()


def wait_listening(address: str, sshd: subprocess.Popen[bytes]) -> None:
    """Until sshd accepts connections on ``address``."""
    deadline = time.monotonic() + SSHD_TIMEOUT
    while True:
        try:
            socket.create_connection((address, PORT), timeout=1).close()
            return
        except OSError:
            if sshd.poll() is not None:
                raise RuntimeError(f"sshd on {address} exited ({sshd.returncode})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sshd on {address} did not listen in {SSHD_TIMEOUT} s"
                ) from None
            time.sleep(0.1)


@pytest.fixture
def sshd(slurm_cluster: SlurmCluster, tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:  # noqa: F811
    """sshd on each of NODES, with the controller's files hidden; the directory of
    the nodes' homes, and the ssh options that reach them (key, known hosts)."""
    homes = tmp_path / "homes"
    client = tmp_path / "client"
    client.mkdir()
    public = keygen(client / "id")
    known = []
    started: list[subprocess.Popen[bytes]] = []
    try:
        for node in NODES:
            address = slurm_cluster.addresses[node]
            conf = homes / node / "sshd"
            conf.mkdir(parents=True, mode=0o700)
            (conf / "authorized_keys").write_text(public + "\n")
            (conf / "sshd_config").write_text(SSHD_CONFIG.format(port=PORT, address=address))
            host_key = keygen(conf / "host_key")
            known.append(f"[{address}]:{PORT} {host_key}\n")
            # /run is a tmpfs of its own there: sshd's privilege separation dir goes in it
            cmd = ["bash", str(SCRIPTS / "node.sh"), node, *hide(homes)]
            cmd += ["sh", "-c", 'mkdir /run/sshd && exec "$@"', "sh"]
            cmd += ["/usr/sbin/sshd", "-D", "-e", "-f", "/root/sshd/sshd_config"]
            with open(tmp_path / f"sshd-{node}.log", "wb") as log:
                started.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=log))
            wait_listening(address, started[-1])
        (client / "known_hosts").write_text("".join(known))
        options = ["-o", f"UserKnownHostsFile={client / 'known_hosts'}"]
        options += ["-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10"]
        yield homes, options
    finally:
        for proc in started:
            proc.terminate()
        for proc in started:
            proc.wait(timeout=30)


def ssh(options: list[str], node_address: str, code: str, homes: Path) -> str:
    """What ``code`` prints, run over ssh by the host's Python."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-p", str(PORT), "-i", str(homes.parent / "client" / "id")]
    cmd += [*options, node_address, shlex.join([SYSTEM_PYTHON, "-c", code])]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()


async def open_and_probe(
    cluster: SlurmCluster,
    homes: Path,
    options: list[str],
    bundle: AgentBundle,
    env: EnvPackages,
    project: Path,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Agents on NODES over ssh, the environment provisioned, a worker per node probed;
    what was delivered and what the workers saw. The sessions are closed at the end."""
    fleet = SshHosts(
        [cluster.addresses[n] for n in NODES],
        bundle,
        python=SYSTEM_PYTHON,
        identity=str(homes.parent / "client" / "id"),
        port=PORT,
        ssh_args=options,
    )
    async with open_runtime(lambda: open_transport("tcp", host=cluster.host_address)):
        try:
            hosts = await fleet.host_mesh()
            given = await hosts.provision(env, scan([project]))
            assert given.delivered is not None
            probe = importlib.import_module("env_probe")
            async with given.spawn_procs({"procs": 1}) as procs:
                probes = await procs.spawn("probe", probe.Probe)
                seen = list((await probes.where.call()).values())
            return list(given.delivered), seen
        finally:
            await fleet.close()


def agents_on(cluster: SlurmCluster, node: str) -> list[str]:
    """The command lines of amesh's processes on ``node``."""
    pids = subprocess.run(
        ["ip", "netns", "pids", node], capture_output=True, text=True, timeout=10
    ).stdout.split()
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # (gone meanwhile)
        if "-m amesh" in cmdline or "--manifest" in cmdline:  # agents, workers, bootstraps
            found.append(cmdline)
    return found


async def test_an_environment_reaches_ssh_hosts_with_nothing_but_python(
    slurm_cluster: SlurmCluster,  # noqa: F811
    sshd: tuple[Path, list[str]],
    tmp_path: Path,
    env_project: Path,  # noqa: F811
) -> None:
    homes, options = sshd
    bundle, env = made(tmp_path)

    # the hosts have Python, and nothing of amesh, its dependencies or the test's
    for node in NODES:
        assert ssh(options, slurm_cluster.addresses[node], LOOKUP, homes) == NOTHING

    args = (slurm_cluster, homes, options, bundle, env, env_project)
    with anyio.fail_after(150):
        delivered, seen = await open_and_probe(*args)
    venvs = [homes / node / ".cache" / "amesh" / "agents" / bundle.digest for node in NODES]
    envs = [homes / node / ".cache" / "amesh" / "depot" / "venvs" / env.env_hash for node in NODES]
    for d, s in zip(delivered, seen):
        assert d.python == f"/root/.cache/amesh/depot/venvs/{env.env_hash}/bin/python"
        assert (s["python"], s["tinypkg"]) == (d.python, 41)
        assert s["amesh"].startswith(f"/root/.cache/amesh/depot/venvs/{env.env_hash}/lib/")
    built = [(v / MARKER).stat().st_mtime_ns for v in venvs + envs]
    # the sessions closed: their agents (and workers) are gone
    assert [agents_on(slurm_cluster, node) for node in NODES] == [[], []]

    with anyio.fail_after(90):
        delivered, seen = await open_and_probe(*args)
    assert [(d.blobs_sent, d.bytes_sent) for d in delivered] == [(0, 0)] * len(NODES)
    assert [s["tinypkg"] for s in seen] == [41] * len(NODES)
    assert [(v / MARKER).stat().st_mtime_ns for v in venvs + envs] == built


# ---- the same through amesh.Environment: an environment file's ssh target -------------------


@pytest.mark.usefixtures("controller", "target_project")
async def test_an_environment_file_s_ssh_target_spawns_on_hosts_with_nothing_but_python(
    slurm_cluster: SlurmCluster,  # noqa: F811
    sshd: tuple[Path, list[str]],
    links: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    homes, options = sshd
    addresses = [slurm_cluster.addresses[node] for node in NODES]
    for address in addresses:
        assert ssh(options, address, LOOKUP, homes) == NOTHING
    identity = str(tmp_path / "client" / "id")
    ssh_args = ["-p", str(PORT), "-i", identity, "-o", "IdentitiesOnly=yes", *options]
    (tmp_path / "envs").mkdir()
    path = tmp_path / "envs" / "clustertest.toml"
    path.write_text(
        ENV_FILE
        + "[targets.cloud]\n"
        + 'launcher = "ssh"\n'
        + f"hosts = {json.dumps(addresses)}\n"
        + f'python = "{SYSTEM_PYTHON}"\n'
        + f"ssh_args = {json.dumps(ssh_args)}\n"
    )
    env = Environment.load(path, find_links=[links], no_index=True)

    with anyio.fail_after(150):
        seen, _ = await probe_target(env, "cloud", sync_to=2)
    check_probes(seen, env, list(NODES), 2)
    first = built(homes)
    assert len(first) == 2 * len(NODES)  # (an agent's venv and the environment's, each)
    # the mesh's end closed the sessions: their agents (and workers) are gone
    assert [agents_on(slurm_cluster, node) for node in NODES] == [[], []]

    with anyio.fail_after(90):
        seen, delivered = await probe_target(env, "cloud")
    assert [(d.blobs_sent, d.bytes_sent) for d in delivered] == [(0, 0)] * len(NODES)
    check_probes(seen, env, list(NODES), 2)
    assert built(homes) == first
    no_secret_in(homes)
