"""Environments on host agents: two real agents on loopback, each with a depot of its
own, are sent an environment's wheels (amesh's own and its dependencies', and a tiny
one this test makes) and a workspace over the job's authenticated link; workers start
in the venv each builds, with the workspace's tree first on their import path."""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

import amesh
from amesh._depot import MARKER, file_digest, scan
from amesh._hosts import Delivered, EnvPackages, ProvisionError
from amesh._hosts._provision import CHUNK

from .depot_wheels import amesh_wheels, requirement, tiny_wheel
from .test_agent import Agent, shared_key, tcp_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

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
            "python": sys.executable,
            "amesh": amesh.__file__,
            "tinypkg": tinypkg.VALUE,
            "wsmod": wsmod.VALUE,
            "wsmod_file": wsmod.__file__,
            "cwd": os.getcwd(),
        }
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # (the agents are one program: test_agent runs both backends)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """amesh's wheels and a tiny one of the test's, made once for the module."""
    out = tmp_path_factory.mktemp("wheels")
    made = amesh_wheels(out)
    made.append(tiny_wheel(out, "tinypkg", "1.0", {"tinypkg/__init__.py": "VALUE = 41\n"}))
    return made


def packages(wheels: list[Path]) -> EnvPackages:
    requirements = "".join(requirement(w) + "\n" for w in sorted(wheels))
    return EnvPackages(
        env_hash=hashlib.sha256(requirements.encode()).hexdigest()[:32],
        requirements=requirements,
        wheels=[(w.name, file_digest(w), w) for w in wheels],
        python_spec=">=3.11",
    )


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A workspace whose module the controller imports too (it names the actor)."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "probe_actors.py").write_text(PROBE)
    (root / "wsmod.py").write_text("VALUE = 1\n")
    (root / ".gitignore").write_text("*.log\n")
    (root / "debug.log").write_text("left out\n")
    (root / "weights.bin").write_bytes(os.urandom(CHUNK + 17))  # (two chunks)
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("probe_actors", None)


@asynccontextmanager
async def two_agents(
    tmp_path: Path, key: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[list[Agent]]:
    """Two agents, each with a depot directory of its own (as on two machines)."""
    started: list[Agent] = []
    try:
        for name in ("a1", "a2"):
            monkeypatch.setenv("AMESH_DEPOT_DIR", str(tmp_path / f"depot-{name}"))
            started.append(Agent(key))
        monkeypatch.delenv("AMESH_DEPOT_DIR")
        for a in started:
            await a.listening()
        yield started
    except BaseException:
        for a in started:
            a.stop()
            sys.stderr.write(f"agent {a.addr} logged:\n{''.join(a.log)}")
        raise
    for a in started:
        assert a.stop() == 0


async def probe_all(hosts: amesh.HostMesh) -> list[dict[str, Any]]:
    probe_actors = importlib.import_module("probe_actors")
    async with hosts.spawn_procs({"procs": 1}) as procs:
        probes = await procs.spawn("probe", probe_actors.Probe)
        return list((await probes.where.call()).values())


async def test_workers_run_in_the_env_venv_and_workspace_and_a_sync_reaches_them(
    tmp_path: Path, wheels: list[Path], project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = shared_key(tmp_path)
    env = packages(wheels)
    with anyio.fail_after(110):
        async with two_agents(tmp_path, key, monkeypatch) as (a1, a2), tcp_runtime():
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            workspace = scan([project])
            assert sorted(workspace.manifest.files) == [
                ".gitignore",
                "probe_actors.py",
                "weights.bin",
                "wsmod.py",
            ]
            given = await hosts.provision(env, workspace)
            delivered = given.delivered
            assert delivered is not None
            total = sum(w.stat().st_size for w in wheels) + workspace.manifest.size()
            for d, name in zip(delivered, ("a1", "a2")):
                depot = tmp_path / f"depot-{name}"
                assert d.python == str(depot / "venvs" / env.env_hash / "bin" / "python")
                assert d.workspace == str(depot / "workspaces" / workspace.manifest.digest())
                assert (d.blobs_sent, d.bytes_sent) == (len(wheels) + 4, total)
                weights = Path(d.workspace) / "weights.bin"
                assert weights.read_bytes() == (project / "weights.bin").read_bytes()
            for d, seen in zip(delivered, await probe_all(given)):
                venv = Path(d.python).parent.parent
                assert seen["python"] == d.python
                assert Path(seen["amesh"]).is_relative_to(venv / "lib")  # not this checkout's
                assert seen["tinypkg"] == 41
                assert (seen["wsmod"], seen["cwd"]) == (1, d.workspace)
                assert seen["wsmod_file"] == f"{d.workspace}/wsmod.py"

            # a second provision moves nothing and builds nothing
            markers = [
                (Path(d.python).parent.parent / MARKER).stat().st_mtime_ns for d in delivered
            ]
            again = await hosts.provision(env, scan([project]))
            assert again.delivered == [
                Delivered(d.host, d.python, d.workspace, 0, 0) for d in delivered
            ]
            assert markers == [
                (Path(d.python).parent.parent / MARKER).stat().st_mtime_ns for d in delivered
            ]

            # an edit moves one file, into a new tree that new workers start in
            (project / "wsmod.py").write_text("VALUE = 2\n")
            synced = await again.sync([project])
            assert synced.delivered is not None
            for d, old in zip(synced.delivered, delivered):
                assert (d.python, d.blobs_sent, d.bytes_sent) == (old.python, 1, 10)
                assert d.workspace != old.workspace
            assert [s["wsmod"] for s in await probe_all(synced)] == [2, 2]


async def test_two_environments_live_side_by_side_on_one_host(
    tmp_path: Path, wheels: list[Path], project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two environments that differ in one package's version, on the same two hosts at
    once: each has a venv of its own there, and each mesh's workers see their own."""
    key = shared_key(tmp_path)
    amesh_only = [w for w in wheels if not w.name.startswith("tinypkg-")]
    other = tiny_wheel(
        tmp_path / "other", "tinypkg", "2.0", {"tinypkg/__init__.py": "VALUE = 42\n"}
    )
    first, second = packages(wheels), packages([*amesh_only, other])
    assert first.env_hash != second.env_hash
    with anyio.fail_after(110):
        async with two_agents(tmp_path, key, monkeypatch) as (a1, a2), tcp_runtime():
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            workspace = scan([project])
            in_first = await hosts.provision(first, workspace)
            in_second = await hosts.provision(second, workspace)
            async with anyio.create_task_group() as tg:  # both meshes up at once
                seen: dict[str, list[dict[str, Any]]] = {}

                async def probe(name: str, where: amesh.HostMesh) -> None:
                    seen[name] = await probe_all(where)

                tg.start_soon(probe, "first", in_first)
                tg.start_soon(probe, "second", in_second)
            assert [s["tinypkg"] for s in seen["first"]] == [41, 41]
            assert [s["tinypkg"] for s in seen["second"]] == [42, 42]
            for name in ("a1", "a2"):
                venvs = tmp_path / f"depot-{name}" / "venvs"
                for env in (first, second):
                    assert (venvs / env.env_hash / MARKER).exists()
            # the second sent each host only the wheel it lacked
            assert in_second.delivered is not None
            assert [d.blobs_sent for d in in_second.delivered] == [1, 1]


async def test_a_host_whose_python_does_not_fit_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Python spec that no host satisfies: each host is named with its version, and
    no venv is made."""
    key = shared_key(tmp_path)
    wheel = tiny_wheel(tmp_path / "wheels", "tinypkg", "1.0", {"tinypkg/__init__.py": ""})
    env = EnvPackages("e1", requirement(wheel), [(wheel.name, file_digest(wheel), wheel)], "<3.0")
    ours = ".".join(map(str, sys.version_info[:3]))
    with anyio.fail_after(60):
        async with two_agents(tmp_path, key, monkeypatch) as (a1, a2), tcp_runtime():
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            with pytest.raises(ProvisionError) as info:
                await hosts.provision(env)
            for i in hosts.hosts:
                assert f"host {i['host']}: " in str(info.value)
            assert str(info.value).count(f"Python {ours}") == 2
            assert "does not satisfy the environment's python '<3.0'" in str(info.value)
    assert not list(tmp_path.glob("depot-*/venvs/e1"))


_STRANGER = """
import sys, anyio
from amesh._hosts._agent import AGENT_ACTOR, HostAgent
from amesh._hosts._reach import parse_agent_address
from amesh._model import ActorMesh
from amesh._runtime import open_runtime
from amesh._shape import Shape
from amesh._transport import open_transport

async def main():
    addr, digest = sys.argv[1:]
    async with open_runtime(lambda: open_transport("tcp")):
        agent = ActorMesh(
            "hosts", AGENT_ACTOR, HostAgent, Shape.from_sizes({"hosts": 1}),
            [parse_agent_address(addr).dial], 0,
        )
        try:
            await agent.depot_put.options(timeout=20).call_one(digest, 0, b"payload", True)
            print("stored")
        except Exception as exc:
            print("refused:", type(exc).__name__)

anyio.run(main)
"""


async def test_a_peer_without_the_key_cannot_put_a_blob_nor_one_with_damaged_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = shared_key(tmp_path)
    digest = hashlib.sha256(b"payload").hexdigest()
    with anyio.fail_after(60):
        async with two_agents(tmp_path, key, monkeypatch) as (a1, _), tcp_runtime():
            out = await anyio.run_process(
                [sys.executable, "-c", _STRANGER, a1.addr, digest], check=False
            )
            assert out.stdout.decode().startswith("refused:"), out
            hosts = await amesh.attach([a1.addr], key_file=str(key))
            assert hosts.hosts[0]["auth_refused"] >= 1
            agent = hosts._agents
            assert await agent.depot_missing.call_one([digest]) == [digest]
            # a holder of the key is admitted, and still cannot store damaged bytes
            with pytest.raises(amesh.ActorError, match="refused"):
                await agent.depot_put.call_one(digest, 0, b"damaged", True)
            assert await agent.depot_missing.call_one([digest]) == [digest]
            assert not list(tmp_path.glob("depot-a1/blobs/parts/*"))
            await agent.depot_put.call_one(digest, 0, b"payload", True)
            assert await agent.depot_missing.call_one([digest]) == []
