"""Environments on SLURM nodes that have nothing but Python (scripts/cluster): each
node's agent runs in a mount namespace where the checkout, the controller's venv and
interpreter, and every cache are hidden (tmpfs over /work and /tmp, a home of the
node's own over /root), so the only Python there is the system's. The launcher brings
amesh (its bundle), the environment brings a package the nodes lack, and a second job
reuses what the first built."""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from amesh import SlurmJob
from amesh._depot import MARKER, file_digest, scan
from amesh._env import amesh_wheel
from amesh._hosts import AgentBundle, EnvPackages, agent_bundle
from amesh._runtime import open_runtime
from amesh._transport import open_transport

from .cluster import SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)
from .depot_wheels import requirement, tiny_wheel

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240), pytest.mark.anyio]

NODES = ("amesh-n1", "amesh-n2")
SYSTEM_PYTHON = "/usr/bin/python3"
# On each node: a home of its own over /root (hiding the controller's interpreter,
# ~/.cache and everything else of root's), then tmpfs over /work (the checkout and its
# venv) and /tmp (the worktrees, pytest's directories, the controller's wheel cache).
HIDE = (
    'mount --bind "$1/$(hostname)" /root && mount -t tmpfs tmpfs /work '
    '&& mount -t tmpfs tmpfs /tmp && shift && exec "$@"'
)

PROBE = """
import sys

import amesh


class Probe(amesh.Actor):
    @amesh.endpoint
    def where(self) -> dict:
        import tinypkg

        return {"python": sys.executable, "amesh": amesh.__file__, "tinypkg": tinypkg.VALUE}
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def hidden(homes: Path) -> tuple[str, ...]:
    """The command prefix that hides the controller's files on a node."""
    return (
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        HIDE,
        "sh",
        str(homes),
    )


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A workspace with the actor's module (the controller imports it too)."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "env_probe.py").write_text(PROBE)
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("env_probe", None)


def packages(wheels: list[Path]) -> EnvPackages:
    requirements = "".join(requirement(w) + "\n" for w in sorted(wheels))
    return EnvPackages(
        env_hash=hashlib.sha256(requirements.encode()).hexdigest()[:32],
        requirements=requirements,
        wheels=[(w.name, file_digest(w), w) for w in wheels],
        python_spec=">=3.11",
    )


def on_node(cluster: SlurmCluster, homes: Path, node: str, code: str) -> str:
    """What ``code`` prints, run by the system's Python on ``node`` as agents run."""
    done = cluster.run(
        "srun", "-N1", "-w", node, *hidden(homes), SYSTEM_PYTHON, "-c", code, timeout=60
    )
    return done.stdout.strip()


async def open_and_probe(
    cluster: SlurmCluster, homes: Path, bundle: AgentBundle, env: EnvPackages, project: Path
) -> tuple[list[Any], list[dict[str, Any]]]:
    """One job: agents on NODES, the environment provisioned, a worker per node probed;
    what was delivered and what the workers saw. The job is cancelled at the end."""
    job = SlurmJob(
        nodes=len(NODES),
        name="amesh-env",
        time="10:00",
        python=SYSTEM_PYTHON,
        bundle=bundle,
        wrap=hidden(homes),
        sbatch_args=("-w", ",".join(NODES)),
    )
    try:
        async with open_runtime(lambda: open_transport("tcp", host=cluster.host_address)):
            hosts = await job.host_mesh()
            given = await hosts.provision(env, scan([project]))
            assert given.delivered is not None
            probe = importlib.import_module("env_probe")
            async with given.spawn_procs({"procs": 1}) as procs:
                probes = await procs.spawn("probe", probe.Probe)
                seen = list((await probes.where.call()).values())
            return list(given.delivered), seen
    finally:
        job_id = job.job_id
        job.cancel()
        if job_id is not None:
            cluster.wait_job(int(job_id), timeout=60)  # (its nodes free for the next)


async def test_an_environment_reaches_nodes_with_nothing_but_python(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.slurm_conf)
    monkeypatch.setenv("AMESH_JOBS_DIR", str(tmp_path / "jobs"))
    homes = tmp_path / "homes"
    for node in NODES:
        (homes / node).mkdir(parents=True, mode=0o700)
    bundle = agent_bundle(amesh_wheel(tmp_path / "cache").path, tmp_path / "deps")
    tiny = tiny_wheel(tmp_path / "tiny", "tinypkg", "1.0", {"tinypkg/__init__.py": "VALUE = 41\n"})
    env = packages([Path(path) for _, _, path in bundle.wheels] + [tiny])

    # the nodes have Python, and nothing of amesh, its dependencies or the test's
    lookup = (
        "import importlib.util as u, os, sys; "
        "print(sys.executable, [u.find_spec(m) is None for m in "
        "('amesh', 'msgspec', 'tinypkg', 'uv')], os.path.exists('/work/main'))"
    )
    for node in NODES:
        said = on_node(slurm_cluster, homes, node, lookup)
        assert said == f"{SYSTEM_PYTHON} [True, True, True, True] False"

    with anyio.fail_after(150):
        delivered, seen = await open_and_probe(slurm_cluster, homes, bundle, env, project)
    venvs = [homes / node / ".cache" / "amesh" / "agents" / bundle.digest for node in NODES]
    envs = [homes / node / ".cache" / "amesh" / "depot" / "venvs" / env.env_hash for node in NODES]
    for d, s in zip(delivered, seen):
        assert d.python == f"/root/.cache/amesh/depot/venvs/{env.env_hash}/bin/python"
        assert d.blobs_sent == len(env.wheels) + 1  # and the workspace's file
        assert (s["python"], s["tinypkg"]) == (d.python, 41)
        assert s["amesh"].startswith(f"/root/.cache/amesh/depot/venvs/{env.env_hash}/lib/")
    built = [(v / MARKER).stat().st_mtime_ns for v in venvs + envs]

    # a second job: the agents' venvs and the environment's are used as they are
    with anyio.fail_after(90):
        delivered, seen = await open_and_probe(slurm_cluster, homes, bundle, env, project)
    assert [(d.blobs_sent, d.bytes_sent) for d in delivered] == [(0, 0)] * len(NODES)
    assert [s["tinypkg"] for s in seen] == [41] * len(NODES)
    assert [(v / MARKER).stat().st_mtime_ns for v in venvs + envs] == built
