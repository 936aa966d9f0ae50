"""``amesh.Environment`` (issue 38, items 2 and 4, and secrets): one environment file
spawns the same mesh on this machine (its local agent) and on two real agents on
loopback, switching the target's name only; its workers run in the environment's
venv (amesh's wheel built from this checkout, its dependencies repacked from this
interpreter, a tiny wheel the test writes: all offline) with the workspace first on
their import path; its secrets reach them and nothing on disk; an edited workspace
reaches the running workers; bad input fails before any worker starts.

One environment is built for the module (its lock, its wheels, its venv on the local
agent), in a state directory and a wheel cache of the module's own."""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from amesh import ProcMesh, _cli, _config
from amesh._depot import MARKER, repack
from amesh._env import (
    EnvError,
    Environment,
    LocalLauncher,
    SlurmLauncher,
    SlurmTarget,
    SshLauncher,
    launcher_for,
    load_spec,
    register_launcher,
)
from amesh._hosts._home import running_agent
from amesh._hosts._remote import held_meshes

from .depot_wheels import dependencies_of, tiny_wheel
from .env_example import example_env, expected_cells, run_example
from .test_agent import Agent, free_port, shared_key, tcp_runtime
from .test_provision import two_agents

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

SECRET = "AMESH_TEST_TOKEN"
SECRET_VALUE = "tok-5f1d0c9e-never-on-disk"
#: a secret the shell that starts the local agent exported: no business of an environment
SHELL_TOKEN = "SHELL_EXPORTED_TOKEN"

PROBE = """
import os
import sys

import amesh


class Probe(amesh.Actor):
    @amesh.endpoint
    def where(self) -> dict:
        import tinypkg
        import wsmod

        return {
            "pid": os.getpid(),
            "python": sys.executable,
            "amesh": amesh.__file__,
            "tinypkg": tinypkg.VALUE,
            "wsmod": wsmod.VALUE,
            "wsmod_file": wsmod.__file__,
            "cwd": os.getcwd(),
            "greeting": os.environ.get("GREETING"),
            "secret": os.environ.get("AMESH_TEST_TOKEN"),
            "shell_token": os.environ.get("SHELL_EXPORTED_TOKEN"),
            "path": os.environ.get("PATH"),
        }
"""

ENV_FILE = f"""\
format = 1
name = "envtest"
python = ">=3.11"
dependencies = ["tinypkg==1.0"]
env = {{ GREETING = "hello" }}
secrets = ["{SECRET}"]

[workspace]
paths = ["../project"]

[targets.laptop]
launcher = "local"
per_host = {{ procs = 2 }}
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # (agents and workers are programs of their own)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's folder: its own state directory (the local agent, its depot), wheel
    cache and wheelhouse; an environment file with its workspace. The local agent is
    stopped at the end."""
    root = tmp_path_factory.mktemp("envs")
    saved = {k: os.environ.get(k) for k in ("AMESH_STATE_DIR", "AMESH_CACHE_DIR", SHELL_TOKEN)}
    os.environ["AMESH_STATE_DIR"] = str(root / "state")
    os.environ["AMESH_CACHE_DIR"] = str(root / "cache")
    os.environ[SHELL_TOKEN] = "shell-only-3a7c"  # (the local agent starts with it)
    _config.reset(overrides=False)
    links = root / "links"
    links.mkdir()
    for dep in dependencies_of("amesh"):
        repack(dep, links)
    tiny_wheel(links, "tinypkg", "1.0", {"tinypkg/__init__.py": "VALUE = 41\n"})
    project = root / "project"
    project.mkdir()
    (project / "probe_actors.py").write_text(PROBE)
    (project / "wsmod.py").write_text("VALUE = 1\n")
    (root / "envs").mkdir()
    (root / "envs" / "envtest.toml").write_text(ENV_FILE)
    sys.path.insert(0, str(project))
    try:
        yield root
    finally:
        sys.path.remove(str(project))
        sys.modules.pop("probe_actors", None)
        running = running_agent()
        if running is not None and running[0] > 0:
            os.kill(running[0], signal.SIGTERM)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _config.reset(overrides=False)


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    return SECRET_VALUE


def load(home: Path, path: Path | None = None, **kwargs: Any) -> Environment:
    """The environment of ``path`` (default: the module's), offline."""
    path = path or home / "envs" / "envtest.toml"
    return Environment.load(path, find_links=[home / "links"], no_index=True, **kwargs)


async def cells(env: Environment, target: str) -> tuple[list[dict[str, Any]], Any]:
    """What a notebook's cells do: spawn on ``target``, ask every rank where it runs."""
    probe_actors = importlib.import_module("probe_actors")
    async with env.spawn_procs(target=target) as procs:
        probes = await procs.spawn("probe", probe_actors.Probe)
        seen = list((await probes.where.call()).values())
        return seen, procs._host.hosts.delivered


def venv_of(python: str) -> Path:
    return Path(python).parent.parent


async def test_found_by_name_from_a_folder_below(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / "pyproject.toml").touch()  # (the project's root: the search stops there)
    below = home / "project"
    monkeypatch.chdir(below)
    env = Environment.load("envtest", find_links=[home / "links"], no_index=True)
    assert (env.name, env.spec.file) == ("envtest", str(home / "envs" / "envtest.toml"))
    assert len(env.hash) == 64 and "tinypkg==1.0" in env.requirements
    assert list(env.targets) == ["laptop"]
    with pytest.raises(EnvError, match=r"no environment 'titan': no envs/titan\.toml"):
        Environment.load("titan")
    relocked = env.lock()  # (resolved again: the same wheels, so the same environment)
    assert (relocked.hash, relocked.requirements) == (env.hash, env.requirements)


async def test_local_target_runs_in_the_venv_and_a_second_spawn_reuses_it(
    home: Path, secret: str
) -> None:
    env = load(home)
    with anyio.fail_after(110):
        seen, delivered = await cells(env, "laptop")
        assert len(seen) == 2 and len(delivered) == 1
        d = delivered[0]
        depot = home / "state" / "depot"
        assert d.python == str(depot / "venvs" / env.hash / "bin" / "python")
        assert Path(d.workspace).parent == depot / "workspaces"
        for s in seen:
            assert s["python"] == d.python
            assert Path(s["amesh"]).is_relative_to(venv_of(d.python))  # not this checkout's
            assert (s["tinypkg"], s["wsmod"], s["greeting"]) == (41, 1, "hello")
            assert (s["cwd"], s["wsmod_file"]) == (d.workspace, f"{d.workspace}/wsmod.py")
            assert s["secret"] == secret
        marker = (venv_of(d.python) / MARKER).stat().st_mtime_ns
        again, delivered = await cells(env, "laptop")
        assert (delivered[0].blobs_sent, delivered[0].bytes_sent) == (0, 0)
        assert (venv_of(d.python) / MARKER).stat().st_mtime_ns == marker  # not built again
        assert [s["tinypkg"] for s in again] == [41, 41]


async def test_the_same_cells_run_on_two_agents_by_the_target_name(
    home: Path, secret: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = shared_key(tmp_path)
    with anyio.fail_after(110):
        async with two_agents(tmp_path, key, monkeypatch) as (a1, a2), tcp_runtime():
            lab = f'\n[targets.lab]\nlauncher = "hosts"\nagents = ["{a1.addr}", "{a2.addr}"]\n'
            path = home / "envs" / "lab.toml"  # (its own lock: the same as the module's)
            path.write_text(ENV_FILE + lab + f'key_file = "{key}"\nper_host = {{ procs = 1 }}\n')
            env = load(home, path)
            assert env.hash == load(home).hash  # where it runs is no part of it
            local, _ = await cells(env, "laptop")
            remote, delivered = await cells(env, "lab")
            assert [s["tinypkg"] for s in local + remote] == [41] * 4
            for s, d, name in zip(remote, delivered, ("a1", "a2")):
                assert d.python == str(
                    tmp_path / f"depot-{name}" / "venvs" / env.hash / "bin" / "python"
                )
                assert (s["python"], s["wsmod"], s["secret"]) == (d.python, 1, secret)
            for a in (a1, a2):
                assert not any(secret in line for line in a.log)


async def test_workers_get_a_clean_environment_not_the_agent_s(home: Path, secret: str) -> None:
    """The local agent was started with a secret its shell exported; an environment's
    workers have none of it, only what they need of the agent's (PATH...), the file's
    ``env`` and the environment's own secrets."""
    env = load(home)
    with anyio.fail_after(110):
        seen, _ = await cells(env, "laptop")
    running = running_agent()
    assert running is not None
    agent_env = Path(f"/proc/{running[0]}/environ").read_bytes().split(b"\0")
    assert f"{SHELL_TOKEN}=shell-only-3a7c".encode() in agent_env  # (the agent has it)
    for s in seen:
        assert (s["shell_token"], s["greeting"], s["secret"]) == (None, "hello", secret)
        assert s["path"] == os.environ["PATH"]


class CountingLauncher(LocalLauncher):
    """This machine's agent, counting the launcher's opens and closes."""

    opened = closed = 0

    async def open(self, *args: Any) -> Any:
        CountingLauncher.opened += 1
        return await super().open(*args)

    async def close(self) -> None:
        CountingLauncher.closed += 1


async def test_the_launcher_closes_when_the_first_workers_fail_to_start(
    home: Path, secret: str
) -> None:
    """The hosts were brought up and given the environment, then no worker started
    (an interpreter that cannot start: a PYTHONHOME of nothing): the launcher is
    closed all the same."""
    env = load(home)
    register_launcher("local", CountingLauncher)
    try:
        with anyio.fail_after(110):
            with pytest.raises(ExceptionGroup) as failed:
                async with env.spawn_procs(target="laptop", env={"PYTHONHOME": "/nonexistent"}):
                    pytest.fail("no worker starts")
    finally:
        register_launcher("local", LocalLauncher)
    # (provisioned: it got as far as starting the workers)
    assert all("while starting" in str(e) for e in failed.value.exceptions), failed.value
    assert (CountingLauncher.opened, CountingLauncher.closed) == (1, 1)


async def test_a_sync_reaches_the_running_workers(home: Path, secret: str) -> None:
    env = load(home)
    probe_actors = importlib.import_module("probe_actors")
    wsmod = home / "project" / "wsmod.py"
    with anyio.fail_after(110):
        async with env.spawn_procs(target="laptop") as procs:
            probes = await procs.spawn("probe", probe_actors.Probe)
            before = list((await probes.where.call()).values())
            try:
                wsmod.write_text("VALUE = 2\n")
                reloaded = await procs.sync()
                # nothing changed since: nothing reloads
                unchanged = await procs.sync()
            finally:
                wsmod.write_text("VALUE = 1\n")
            assert list(reloaded.values()) == [["wsmod"], ["wsmod"]]
            assert list(unchanged.values()) == [[], []]
            after = list((await probes.where.call()).values())
            assert [a["pid"] for a in after] == [b["pid"] for b in before]
            assert [a["wsmod"] for a in after] == [2, 2]
            new_tree = procs._host.hosts.delivered[0].workspace
            assert new_tree != before[0]["cwd"]
            assert {(a["cwd"], a["wsmod_file"]) for a in after} == {
                (new_tree, f"{new_tree}/wsmod.py")
            }


async def test_a_secret_reaches_workers_and_nothing_on_disk_nor_any_log(
    home: Path, secret: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    env = load(home)
    with anyio.fail_after(110):
        seen, _ = await cells(env, "laptop")
    assert [s["secret"] for s in seen] == [secret, secret]
    out, err = capfd.readouterr()
    assert secret not in out + err + caplog.text
    for folder in (home / "state", home / "cache", home / "envs"):
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert secret.encode() not in path.read_bytes(), path


async def test_errors_come_before_any_worker_starts(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = load(home)
    monkeypatch.delenv(SECRET, raising=False)
    with pytest.raises(EnvError, match=f"secrets: {SECRET} not set"):
        env.spawn_procs(target="laptop")
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    with pytest.raises(EnvError, match=r"no target 'cluster' \(the targets: laptop\)"):
        env.spawn_procs(target="cluster")
    # a secrets file holds what the environment lacks
    monkeypatch.delenv(SECRET)
    secrets = tmp_path / "secrets.env"
    secrets.write_text(f"# mine\nexport {SECRET}='{SECRET_VALUE}'\n")
    from_file = load(home, secrets_file=secrets)
    assert from_file.spawn_procs(target="laptop").sizes == {"hosts": 1, "procs": 2}
    # a Python that the controller's does not satisfy: at load, nothing is locked
    old = tmp_path / "old.toml"
    old.write_text('name = "old"\npython = "<3.0"\n')
    with pytest.raises(EnvError, match=r"does not satisfy '<3\.0'"):
        load(home, old)
    assert not (tmp_path / "old.lock").exists()
    # every kind of target has its launcher (ssh and slurm: tests/test_env_ssh.py and
    # tests/test_env_slurm.py start theirs on hosts that have nothing but Python)
    cloud = tmp_path / "cloud.toml"
    cloud.write_text('name = "cloud"\n[targets.cloud]\nlauncher = "ssh"\nhosts = ["a.example"]\n')
    spec = load_spec(cloud)
    assert isinstance(launcher_for(spec.targets["cloud"]), SshLauncher)
    assert isinstance(launcher_for(SlurmTarget(nodes=2)), SlurmLauncher)
    # an agent that is not there: named, and no worker starts
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    port = free_port()
    dead = home / "envs" / "dead.toml"
    dead.write_text(
        ENV_FILE + f'[targets.dead]\nlauncher = "hosts"\nagents = ["tcp://127.0.0.1:{port}"]\n'
    )
    with anyio.fail_after(60):
        with pytest.raises(EnvError, match=f"agent at tcp://127.0.0.1:{port} cannot be reached"):
            async with load(home, dead).spawn_procs(target="dead"):
                pytest.fail("no worker starts")
    # a mesh of no environment has no workspace to sync
    with anyio.fail_after(30):
        async with ProcMesh({"procs": 1}) as plain:
            with pytest.raises(RuntimeError, match="has no workspace to sync"):
                await plain.sync()


async def test_the_example_notebook_spawns_in_an_environment_and_syncs(
    home: Path, tmp_path: Path
) -> None:
    """examples/environments.ipynb in a kernel on its ``laptop`` target (its
    ``cluster``: tests/test_env_slurm.py): every rank in the venv, the edit synced."""
    path = example_env(home, home / "links")
    cells = await run_example(path, "laptop", tmp_path)
    assert cells == expected_cells([socket.gethostname()] * 2)


def test_check_asks_a_target_s_agents_what_they_would_need(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``amesh env check --target``: an agent's Python, venv and missing packages; a
    Python that does not fit is a problem (exit 1). Nothing is sent or built."""
    key = shared_key(tmp_path)
    monkeypatch.setenv("AMESH_DEPOT_DIR", str(tmp_path / "depot"))
    agent = Agent(key)
    monkeypatch.delenv("AMESH_DEPOT_DIR")
    try:
        assert agent._listening.wait(30), agent.log
        target = f'\n[targets.lab]\nlauncher = "hosts"\nagents = ["{agent.addr}"]\n'
        path = home / "envs" / "check.toml"
        path.write_text(ENV_FILE + target + f'key_file = "{key}"\n')
        env = load(home, path)
        monkeypatch.chdir(home)
        assert _cli.main(["env", "check", str(path), "--target", "lab"]) == 0
        out = capsys.readouterr().out
        ours = ".".join(map(str, sys.version_info[:3]))
        count = len(env.requirements)
        assert f": Python {ours} fits; venv not built yet (the first spawn builds it); " in out
        assert f"{count} of {count} locked packages to send" in out
        path.write_text(path.read_text().replace('python = ">=3.11"', 'python = "<3.0"'))
        assert _cli.main(["env", "check", str(path), "--target", "lab"]) == 1
        assert f"Python {ours} does NOT satisfy python = '<3.0'" in capsys.readouterr().out
    finally:
        assert agent.stop() == 0, agent.log
    assert not (tmp_path / "depot" / "venvs").exists()


async def test_a_persistent_mesh_of_an_environment_is_held_by_the_local_agent(
    home: Path, secret: str
) -> None:
    env = load(home)
    probe_actors = importlib.import_module("probe_actors")
    with anyio.fail_after(110):
        async with env.spawn_procs(target="laptop", name="envheld", persistent=True) as procs:
            probes = await procs.spawn("probe", probe_actors.Probe)
            seen = list((await probes.where.call()).values())
            assert [s["python"] for s in seen] == [procs._host.hosts.delivered[0].python] * 2
            record = (await held_meshes())["envheld"]
            assert [pid for _, pid in record["procs"]] == procs.pids
            await procs.stop()
            assert "envheld" not in await held_meshes()
