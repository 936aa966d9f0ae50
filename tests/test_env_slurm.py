"""Environments on SLURM nodes that have nothing but Python (scripts/cluster): each
node's agent runs in a mount namespace where the checkout, the controller's venv and
interpreter, and every cache are hidden (tmpfs over /work and /tmp, a home of the
node's own over /root), so the only Python there is the system's. The launcher brings
amesh (its bundle), the environment brings a package the nodes lack, and a second job
reuses what the first built. Then the same through the public API only: an environment
file whose ``cluster`` target is ``launcher = "slurm"``, and examples/environments.ipynb
run on that target."""

from __future__ import annotations

import importlib
import json
import stat
from pathlib import Path
from typing import Any

import anyio
import pytest

from amesh import SlurmJob
from amesh._depot import MARKER, scan
from amesh._env import Environment
from amesh._hosts import AgentBundle, EnvPackages
from amesh._identity import read_key_file
from amesh._runtime import open_runtime
from amesh._transport import open_transport

from .cluster import SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)
from .env_example import example_env, expected_cells, run_example
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
    wait_jobs,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240), pytest.mark.anyio]

NODES = ("amesh-n1", "amesh-n2")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def on_node(cluster: SlurmCluster, homes: Path, node: str, code: str) -> str:
    """What ``code`` prints, run by the system's Python on ``node`` as agents run."""
    done = cluster.run(
        "srun", "-N1", "-w", node, *hide(homes), SYSTEM_PYTHON, "-c", code, timeout=60
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
        wrap=hide(homes),
        sbatch_args=("-w", ",".join(NODES)),
    )
    try:
        async with open_runtime(lambda: open_transport("tcp", host=cluster.host_address)):
            hosts = await job.host_mesh()
            # the key reached the nodes in the job script (the owner's only), and no log
            key = read_key_file(str(job.dir / "key")).hex()
            assert stat.S_IMODE((job.dir / "job.sh").stat().st_mode) == 0o600
            log = (job.dir / f"slurm-{job.job_id}.out").read_text()
            assert key not in log
            print("".join(line for line in log.splitlines(True) if "bootstrap" in line))
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
    env_project: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.slurm_conf)
    monkeypatch.setenv("AMESH_JOBS_DIR", str(tmp_path / "jobs"))
    homes = tmp_path / "homes"
    for node in NODES:
        (homes / node).mkdir(parents=True, mode=0o700)
    bundle, env = made(tmp_path)

    # the nodes have Python, and nothing of amesh, its dependencies or the test's
    for node in NODES:
        assert on_node(slurm_cluster, homes, node, LOOKUP) == NOTHING

    with anyio.fail_after(150):
        delivered, seen = await open_and_probe(slurm_cluster, homes, bundle, env, env_project)
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
        delivered, seen = await open_and_probe(slurm_cluster, homes, bundle, env, env_project)
    assert [(d.blobs_sent, d.bytes_sent) for d in delivered] == [(0, 0)] * len(NODES)
    assert [s["tinypkg"] for s in seen] == [41] * len(NODES)
    assert [(v / MARKER).stat().st_mtime_ns for v in venvs + envs] == built


# ---- the same through amesh.Environment: an environment file's slurm target -----------------


def cluster_target(homes: Path) -> str:
    """The ``[targets.cluster]`` of the tests' files: NODES, in the cluster's partition,
    each node's agent in a namespace that hides the controller's files (``wrap``)."""
    return (
        "[targets.cluster]\n"
        'launcher = "slurm"\n'
        f"nodes = {len(NODES)}\n"
        'partition = "amesh"\n'
        'time = "10:00"\n'
        f'python = "{SYSTEM_PYTHON}"\n'
        f"sbatch_args = {json.dumps(['-w', ','.join(NODES)])}\n"
        f"wrap = {json.dumps(list(hide(homes)))}\n"
        "per_host = { procs = 1 }\n"
    )


@pytest.fixture
def homes(tmp_path: Path) -> Path:
    """The nodes' homes (what a node keeps between jobs), empty."""
    out = tmp_path / "homes"
    for node in NODES:
        (out / node).mkdir(parents=True, mode=0o700)
    return out


@pytest.mark.usefixtures("controller", "target_project")
async def test_an_environment_file_s_slurm_target_spawns_on_nodes_with_nothing_but_python(
    slurm_cluster: SlurmCluster,  # noqa: F811
    homes: Path,
    links: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    for node in NODES:
        assert on_node(slurm_cluster, homes, node, LOOKUP) == NOTHING
    (tmp_path / "envs").mkdir()
    path = tmp_path / "envs" / "clustertest.toml"
    path.write_text(ENV_FILE + cluster_target(homes))
    env = Environment.load(path, find_links=[links], no_index=True)

    with anyio.fail_after(150):
        seen, _ = await probe_target(env, "cluster", sync_to=2)
    check_probes(seen, env, list(NODES), 2)
    first = built(homes)
    assert len(first) == 2 * len(NODES)  # (an agent's venv and the environment's, each)
    wait_jobs(slurm_cluster)

    # a second open, a job of its own: nothing is sent again, nothing rebuilt
    with anyio.fail_after(90):
        seen, delivered = await probe_target(env, "cluster")
    assert [(d.blobs_sent, d.bytes_sent) for d in delivered] == [(0, 0)] * len(NODES)
    check_probes(seen, env, list(NODES), 2)
    assert built(homes) == first
    # the secret reached the workers, and none of the jobs' files nor the nodes' homes
    no_secret_in(tmp_path / "jobs", homes)


@pytest.mark.usefixtures("controller")
async def test_the_example_notebook_runs_its_cells_on_the_cluster_target(
    homes: Path,
    links: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """examples/environments.ipynb, the same cells as on ``laptop``
    (tests/test_environment.py), on the ``cluster`` target: a rank per node, each in
    the environment's venv, and the edit synced to both."""
    path = example_env(tmp_path, links, cluster_target(homes))
    cells = await run_example(path, "cluster", tmp_path)
    assert cells == expected_cells(list(NODES))
