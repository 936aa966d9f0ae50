"""A real SLURM cluster for the tests marked ``slurm``.

``scripts/cluster/up.sh`` runs once per test session (it installs Debian's slurm, munge and
openssh if they are missing) and ``scripts/cluster/down.sh`` at its end. Use it from a test
module::

    import pytest
    from .cluster import SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)

    pytestmark = pytest.mark.slurm

    def test_x(slurm_cluster: SlurmCluster) -> None:
        job = slurm_cluster.sbatch("-N2", "--wrap", "srun hostname")
        assert slurm_cluster.wait_job(job) == "COMPLETED"

The nodes are namespaces of this machine with their own addresses and hostnames (see the
header of scripts/cluster/up.sh): a process of the test listens on ``host_address`` and
every job step reaches it; steps reach each other on ``addresses[node]``.

The cluster needs root. Elsewhere, or with ``AMESH_CLUSTER_TESTS=0``, the ``slurm`` tests
are deselected (tests/conftest.py calls :func:`deselect_cluster_tests`) and the session ends
with a list of them and how to run them.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = [
    "SlurmCluster",
    "cluster_tests_disabled",
    "deselect_cluster_tests",
    "slurm_cluster",
]

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "cluster"
UP_TIMEOUT = 600.0  # the first up.sh on a machine installs packages
DOWN_TIMEOUT = 120.0
LOCK_TIMEOUT = 60.0  # another session using the cluster

# Job states after which a job runs no more (squeue(1), "JOB STATE CODES").
FINAL_STATES: frozenset[str | None] = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


@dataclass(frozen=True)
class SlurmCluster:
    """The running cluster, as ``slurm_cluster`` yields it."""

    nodes: tuple[str, ...]
    """Node names, ``amesh-n1`` ... (also their hostnames)."""
    addresses: dict[str, str]
    """Node name -> that node's IPv4 address (its namespace's only address)."""
    host_address: str
    """The controller side: this machine's (root namespace) address on the cluster's
    network. Listen here; every job step can connect."""
    slurmctld_address: str
    state_dir: Path
    env: dict[str, str] = field(repr=False)
    """``os.environ`` plus ``SLURM_CONF``: pass as ``env=`` to run slurm's clients."""

    @property
    def slurm_conf(self) -> str:
        return self.env["SLURM_CONF"]

    def run(
        self, *args: str, timeout: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a slurm client (``sbatch``, ``squeue``, ...) against this cluster."""
        return subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout, check=check
        )

    def on_node(
        self, node: str, *args: str, timeout: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a command "on" ``node`` (its namespaces), outside slurm."""
        return self.run("bash", str(SCRIPTS / "node.sh"), node, *args, timeout=timeout, check=check)

    def sbatch(self, *args: str) -> int:
        """Submit a batch job (``sbatch ARGS``); its job id."""
        out = self.run("sbatch", "--parsable", *args).stdout.strip()
        return int(out.split(";")[0])

    def job_state(self, job: int) -> str | None:
        """``JobState`` of ``job`` (``RUNNING``, ``COMPLETED``, ...); None once slurmctld
        has forgotten it."""
        proc = self.run("scontrol", "-o", "show", "job", str(job), check=False)
        match = re.search(r"\bJobState=(\S+)", proc.stdout)
        return match.group(1) if match else None

    def job_field(self, job: int, name: str) -> str | None:
        """Any ``Name=value`` of ``scontrol show job`` (``NodeList``, ``ExitCode``, ...)."""
        proc = self.run("scontrol", "-o", "show", "job", str(job), check=False)
        match = re.search(rf"\b{re.escape(name)}=(\S+)", proc.stdout)
        return match.group(1) if match else None

    def wait_job(
        self,
        job: int,
        states: Collection[str | None] = FINAL_STATES,
        timeout: float = 60.0,
    ) -> str | None:
        """Wait (polling ``scontrol``) until ``job`` is in one of ``states`` (by default:
        finished; None: forgotten); its state. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still {state} after {timeout} s")
            time.sleep(0.1)

    def squeue(self) -> list[dict[str, str]]:
        """The jobs slurmctld knows (text output: 22.05's ``--json`` ignores ``-j``)."""
        fields = {"id": "%i", "name": "%j", "state": "%T", "nodes": "%D", "nodelist": "%N"}
        out = self.run("squeue", "-h", "-t", "all", "-o", "|".join(fields.values())).stdout
        return [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line]


# ---- deselection when the cluster cannot run ------------------------------------------------


def cluster_tests_disabled() -> str | None:
    """Why the ``slurm`` tests cannot run here, or None when they can."""
    if os.environ.get("AMESH_CLUSTER_TESTS") == "0":
        return "AMESH_CLUSTER_TESTS=0"
    if os.geteuid() != 0:
        return "not root (the cluster needs network namespaces and installs packages)"
    return None


class _NotRunReport:
    """A plugin that lists the deselected cluster tests at the end of the session."""

    def __init__(self, why: str, nodeids: list[str]) -> None:
        self.why = why
        self.nodeids = nodeids

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        tr = terminalreporter
        tr.section("cluster tests not run", yellow=True)
        tr.line(f"deselected {len(self.nodeids)} test(s) marked 'slurm': {self.why}")
        for nodeid in self.nodeids:
            tr.line(f"  {nodeid}")
        tr.line("Run them as root: sudo bash scripts/test.sh  (or: sudo .venv/bin/pytest -m slurm)")


def deselect_cluster_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """For ``pytest_collection_modifyitems``: leave out the ``slurm`` tests where they cannot
    run, and say so at the end of the session."""
    why = cluster_tests_disabled()
    if why is None:
        return
    dropped = [item for item in items if item.get_closest_marker("slurm")]
    if not dropped:
        return
    items[:] = [item for item in items if not item.get_closest_marker("slurm")]
    config.hook.pytest_deselected(items=dropped)
    config.pluginmanager.register(
        _NotRunReport(why, [item.nodeid for item in dropped]), "amesh-cluster-not-run"
    )


# ---- the fixture ------------------------------------------------------------------------------


class _Session:
    """One cluster per process, however many test modules import the fixture (each import
    is a fixture definition of its own; they share this)."""

    cluster: SlurmCluster | None = None
    users = 0
    lock_fd: int | None = None


def _scripts_env() -> dict[str, str]:
    env = dict(os.environ)
    env["AMESH_SLURM_LOCK_HELD"] = "1"  # we hold scripts/cluster's lock for the session
    return env


def _lock() -> int:
    """Hold the lock up.sh and down.sh take (on scripts/cluster) for the whole session, so
    that a concurrent session waits instead of taking the cluster down under us."""
    fd = os.open(SCRIPTS, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    deadline = time.monotonic() + LOCK_TIMEOUT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise RuntimeError(
                    f"another session holds the cluster ({SCRIPTS} is locked)"
                ) from None
            time.sleep(0.5)


def _down() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPTS / "down.sh")],
        env=_scripts_env(),
        capture_output=True,
        text=True,
        timeout=DOWN_TIMEOUT,
    )


def _read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value
    return out


def _up() -> SlurmCluster:
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "up.sh")],
        env=_scripts_env(),
        capture_output=True,
        text=True,
        timeout=UP_TIMEOUT,
    )
    if proc.returncode != 0:
        _down()
        raise RuntimeError(f"scripts/cluster/up.sh failed ({proc.returncode}):\n{proc.stderr}")
    try:
        return _describe()
    except BaseException:
        _down()
        raise


def _describe() -> SlurmCluster:
    state = Path(os.environ.get("AMESH_SLURM_DIR") or "/run/amesh-slurm")
    info = _read_env(state / "cluster.env")
    nodes = tuple(info["AMESH_SLURM_NODE_NAMES"].split(","))
    addrs = info["AMESH_SLURM_NODE_ADDRS"].split(",")
    env = dict(os.environ)
    env["SLURM_CONF"] = info["SLURM_CONF"]
    return SlurmCluster(
        nodes=nodes,
        addresses=dict(zip(nodes, addrs, strict=True)),
        host_address=info["AMESH_SLURM_HOST_ADDR"],
        slurmctld_address=info["AMESH_SLURM_CTLD_ADDR"],
        state_dir=Path(info["AMESH_SLURM_DIR"]),
        env=env,
    )


def _acquire() -> SlurmCluster:
    if _Session.cluster is None:
        why = cluster_tests_disabled()
        if why is not None:  # a `slurm` test the hook did not deselect, or no marker
            pytest.skip(f"SLURM cluster tests disabled: {why}")
        _Session.lock_fd = _lock()
        try:
            _Session.cluster = _up()
        except BaseException:
            os.close(_Session.lock_fd)
            _Session.lock_fd = None
            raise
    _Session.users += 1
    return _Session.cluster


def _release() -> None:
    _Session.users -= 1
    if _Session.users > 0:
        return
    _Session.cluster = None
    try:
        proc = _down()
        if proc.returncode != 0:  # a job step still ending as we took it down: once more
            first = proc.stderr
            proc = _down()
            if proc.returncode == 0:
                print(f"scripts/cluster/down.sh needed a second run; the first said:\n{first}")
    finally:
        if _Session.lock_fd is not None:
            os.close(_Session.lock_fd)
            _Session.lock_fd = None
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/cluster/down.sh failed ({proc.returncode}):\n{proc.stderr}")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The cluster of scripts/cluster/up.sh, up for the whole session (root only)."""
    cluster = _acquire()
    try:
        yield cluster
    finally:
        _release()
