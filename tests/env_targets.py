"""What the tests of ``amesh.Environment`` on hosts with nothing but Python share
(tests/test_env_slurm.py: a ``slurm`` target; tests/test_env_ssh.py: an ``ssh`` one):
an environment file with a package the hosts lack, a setting and a secret; its
workspace, with an actor that reports what each rank sees; a wheelhouse to lock and
fetch it from offline; a controller that listens on the cluster's network."""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from amesh import _config
from amesh._depot import MARKER, repack
from amesh._env import Environment

from .cluster import SlurmCluster
from .depot_wheels import dependencies_of, tiny_wheel

__all__ = [
    "ENV_FILE",
    "SECRET_VALUE",
    "built",
    "check_probes",
    "controller",
    "links",
    "no_secret_in",
    "probe_target",
    "target_project",
    "wait_jobs",
]

#: the real package from PyPI the environment needs (scripts/setup.sh fetched it)
PYPI_WHEEL = "tomli_w-1.0.0-py3-none-any.whl"
ROOT = Path(__file__).resolve().parent.parent

SECRET = "CLUSTER_TEST_TOKEN"
SECRET_VALUE = "tok-cluster-9b2e41"

#: the workspace's actor: where it runs, what it imports, what its environment holds
TARGET_PROBE = f"""
import os
import socket
import sys

import amesh


class Probe(amesh.Actor):
    @amesh.endpoint
    def where(self) -> dict:
        import tinypkg
        import tomli_w
        import wsmod

        return {{
            "host": socket.gethostname(),
            "python": sys.executable,
            "amesh": amesh.__file__,
            "tinypkg": tinypkg.VALUE,
            "tomli_w": tomli_w.__file__,
            "wsmod": wsmod.VALUE,
            "greeting": os.environ.get("GREETING"),
            "secret": os.environ.get("{SECRET}"),
        }}
"""

#: the environment, but its target (a test appends it)
ENV_FILE = f"""\
format = 1
name = "clustertest"
python = ">=3.11"
dependencies = ["tinypkg==1.0", "tomli-w==1.0.0"]
env = {{ GREETING = "hello" }}
secrets = ["{SECRET}"]

[workspace]
paths = ["../project"]

"""


@pytest.fixture(scope="module")
def links(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheelhouse: amesh's dependencies repacked from this interpreter, ``tinypkg``,
    which no host has, and a real package from PyPI, ``tomli-w``, which no host has
    either, fetched once by scripts/setup.sh (environments are locked and fetched
    offline)."""
    out = tmp_path_factory.mktemp("links")
    fetched = ROOT / ".cache" / "test-wheels" / PYPI_WHEEL
    assert fetched.is_file(), f"{fetched} is missing: scripts/setup.sh fetches it"
    shutil.copy(fetched, out / PYPI_WHEEL)
    for dep in dependencies_of("amesh"):
        repack(dep, out)
    tiny_wheel(out, "tinypkg", "1.0", {"tinypkg/__init__.py": "VALUE = 41\n"})
    return out


def wait_jobs(cluster: SlurmCluster) -> None:
    """Wait until every job has ended (their nodes free for the next)."""
    for job in cluster.squeue():
        cluster.wait_job(int(job["id"]), timeout=60)


@pytest.fixture
def controller(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A controller that listens on the cluster's network (``AMESH_HOST``), with its
    own state, cache and jobs directories, and the secret set. Every job of the test
    has ended at the end."""
    for name, value in {
        "SLURM_CONF": slurm_cluster.slurm_conf,
        "AMESH_HOST": slurm_cluster.host_address,
        "AMESH_JOBS_DIR": str(tmp_path / "jobs"),
        "AMESH_STATE_DIR": str(tmp_path / "state"),
        "AMESH_CACHE_DIR": str(tmp_path / "cache"),
        SECRET: SECRET_VALUE,
    }.items():
        monkeypatch.setenv(name, value)
    _config.reset(overrides=False)
    try:
        yield
    finally:
        wait_jobs(slurm_cluster)
        monkeypatch.undo()
        _config.reset(overrides=False)


@pytest.fixture
def target_project(tmp_path: Path) -> Iterator[Path]:
    """The workspace: the probe's module (the controller imports it too), and a
    module of its own that the workers import."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "target_probe.py").write_text(TARGET_PROBE)
    (root / "wsmod.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("target_probe", None)


def built(homes: Path) -> dict[str, int]:
    """The hosts' venvs (the agents' and the environments'), by path: when each was
    completed."""
    markers = sorted(homes.glob(f"*/.cache/amesh/agents/*/{MARKER}"))
    markers += sorted(homes.glob(f"*/.cache/amesh/depot/venvs/*/{MARKER}"))
    return {str(m.relative_to(homes)): m.stat().st_mtime_ns for m in markers}


async def probe_target(
    env: Environment, target: str, sync_to: int = 0
) -> tuple[list[dict[str, Any]], Any]:
    """What each rank of ``env`` on ``target`` (one per host) sees, after a sync of
    ``wsmod`` edited to ``VALUE = sync_to`` when given; and what its hosts were sent."""
    probe = importlib.import_module("target_probe")
    wsmod = env.spec.resolve("../project/wsmod.py")
    async with env.spawn_procs(target=target, per_host={"procs": 1}) as procs:
        probes = await procs.spawn("probe", probe.Probe)
        seen = list((await probes.where.call()).values())
        delivered = procs._host.hosts.delivered
        if sync_to:
            wsmod.write_text(f"VALUE = {sync_to}\n")
            reloaded = await procs.sync()
            assert list(reloaded.values()) == [["wsmod"]] * len(seen)
            seen = list((await probes.where.call()).values())
    return seen, delivered


def check_probes(seen: list[dict[str, Any]], env: Environment, hosts: list[str], ws: int) -> None:
    """Every rank of ``seen`` ran on its own of ``hosts`` in the environment's venv
    (amesh too: the launcher brought it), imported ``tinypkg``, ``tomli_w`` (from
    PyPI, installed in the venv) and the workspace's
    ``wsmod`` (``VALUE = ws``), and has the setting and the secret."""
    venv = f"/root/.cache/amesh/depot/venvs/{env.hash}"
    assert sorted(s["host"] for s in seen) == sorted(hosts)
    for s in seen:
        assert (s["python"], s["tinypkg"], s["wsmod"]) == (f"{venv}/bin/python", 41, ws)
        assert s["amesh"].startswith(f"{venv}/lib/")
        assert s["tomli_w"].startswith(f"{venv}/lib/")  # (PyPI's, into the venv)
        assert (s["greeting"], s["secret"]) == ("hello", SECRET_VALUE)


def no_secret_in(*folders: Path) -> None:
    """The secret's value is in no file under ``folders``."""
    for folder in folders:
        for file in folder.rglob("*"):
            if file.is_file() and not file.is_symlink():
                assert SECRET_VALUE.encode() not in file.read_bytes(), file
