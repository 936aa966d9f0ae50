"""`amesh logs` and `amesh stacks` on a persistent mesh that no controller holds: its
workers' output is kept in log files at their host agent (bounded, rotated, removed
with the mesh), and their stacks are asked of them, or taken by their agent."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest
from anyio.abc import ByteReceiveStream

import amesh
from amesh._runtime import open_runtime
from amesh._transport import open_transport

from .test_agent import agents, shared_key
from .test_persistent import ROOT, _amesh, state  # noqa: F401  (state: a fixture)

pytestmark = pytest.mark.anyio

#: the cap of each log file the test's workers write (AMESH_LOG_FILE_BYTES)
CAP = 16384

_CONTROLLER = """
import sys
import anyio
import amesh
from tests.actors import Holder
from tests.output_actors import Printer

async def main():
    procs = await amesh.ProcMesh(
        {"procs": 2}, name="logged", persistent=True,
        env={"AMESH_LOG_FILE_BYTES": sys.argv[3]},
    )
    printers = await procs.spawn("printers", Printer)
    await printers.say_mine.call("hello from")
    await printers.slice(procs=0).flood.call_one(2000)
    await printers.slice(procs=0).say.call_one("last of 0")
    holders = await procs.spawn("holders", Holder)
    await holders.slice(procs=1).hold.broadcast(sys.argv[1], sys.argv[2])
    while not os.path.exists(sys.argv[1]):
        await anyio.sleep(0.01)
    print(" ".join(map(str, procs.pids)), flush=True)

import os
amesh.run(main)
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the controller is a program of its own


async def test_logs_and_stacks_without_a_controller(state: Path) -> None:  # noqa: F811
    started, release = state / "started", state / "release"
    with anyio.fail_after(120):
        out = await anyio.run_process(
            [sys.executable, "-c", _CONTROLLER, str(started), str(release), str(CAP)],
            cwd=ROOT,
            check=False,
        )
        assert out.returncode == 0, out.stderr.decode()
        p0, p1 = (int(p) for p in out.stdout.splitlines()[-1].split())
        # the controller is gone: its output is at the agent, with each line's rank
        logs = (await _amesh("logs", "logged", "-n", "5000")).splitlines()
        assert "[printers 1] hello from 1" in logs and "[printers 0] line 1999" in logs, logs
        assert logs[-1] == "[printers 0] last of 0", logs[-3:]
        # (the older lines of rank 0 went with its rotated files; rank 1's are all there)
        assert "[printers 0] line 0" not in logs
        assert await _amesh("logs", "logged", "-n", "2") == (
            "[printers 0] line 1999\n[printers 0] last of 0\n"
        )
        assert await _amesh("logs", "logged", "--rank", "1") == "[printers 1] hello from 1\n"
        files = list((state / "logs").rglob("*.log*"))
        assert len(files) == 3 and any(f.name.endswith(".log.1") for f in files), files
        assert all(f.stat().st_size <= CAP for f in files), [f.stat().st_size for f in files]
        # stacks: rank 0 answers from its event loop, rank 1's (held) taken by its agent
        stacks = await _amesh("stacks", "logged")
        rank0, rank1 = stacks.split(f"=== logged rank 1 (pid {p1})")
        assert f"=== logged rank 0 (pid {p0})" in rank0 and "taken by a signal" not in rank0
        assert "taken by a signal" in rank1 and "in hold\n" in rank1, rank1
        assert "time.sleep(0.01)" in rank1, rank1
        assert "stopped logged: 2 process(es)" in await _amesh("stop", "logged")
        assert not list((state / "logs").rglob("*.log*"))


_SAYER = """
import amesh
from tests.output_actors import Printer

async def main():
    procs = await amesh.ProcMesh({"procs": 2}, name="followed", persistent=True)
    printers = await procs.spawn("printers", Printer)
    await printers.say_mine.call("before")

amesh.run(main)
"""


async def _read_until(stream: ByteReceiveStream, seen: bytearray, text: bytes) -> None:
    while text not in seen:
        seen += await stream.receive()


async def test_logs_follow_a_mesh_whose_controller_left(state: Path) -> None:  # noqa: F811
    """`amesh logs -f` prints the lines of a persistent mesh as they come, taken over by
    a controller meanwhile (they are written by its workers at the agent), and ends
    when the mesh is stopped."""
    with anyio.fail_after(120):
        out = await anyio.run_process([sys.executable, "-c", _SAYER], cwd=ROOT, check=False)
        assert out.returncode == 0, out.stderr.decode()
        cmd = [sys.executable, "-m", "amesh", "logs", "followed", "-f"]
        async with await anyio.open_process(cmd, stderr=None) as follower:
            assert follower.stdout is not None
            seen = bytearray()
            await _read_until(follower.stdout, seen, b"[printers 1] before 1\n")
            async with open_runtime(lambda: open_transport("abstract")):
                procs = await amesh.attach_mesh("followed")
                printers = await procs.actor_mesh("printers")
                await printers.say_mine.call("after")
                await _read_until(follower.stdout, seen, b"[printers 0] after 0\n")
                await _read_until(follower.stdout, seen, b"[printers 1] after 1\n")
                await procs.stop()
            await _read_until(follower.stdout, seen, b"'followed' is gone")
            assert await follower.wait() == 0
        assert sorted(seen.decode().splitlines()[:2]) == [
            "[printers 0] before 0",
            "[printers 1] before 1",
        ]


_FAR = """
import sys
import amesh
from tests.output_actors import Printer

async def main():
    hosts = await amesh.attach(sys.argv[1].split(","), key_file=sys.argv[2])
    procs = await hosts.spawn_procs({"gpus": 2}, name="far", persistent=True)
    printers = await procs.spawn("printers", Printer)
    await printers.say_mine.call("far from")

amesh.run(main)
"""


async def test_logs_and_stacks_on_host_agents(tmp_path: Path) -> None:
    """The same on `amesh agent`s (--hosts, --key-file): each agent keeps the log
    files of its workers, `amesh logs` merges those of every host, `amesh stop`
    removes them."""
    key = shared_key(tmp_path)
    how = ["--hosts", "", "--key-file", str(key)]
    with anyio.fail_after(120):
        async with agents(key, 2, grace=0.5) as (a1, a2):
            how[1] = f"{a1.addr},{a2.addr}"
            out = await anyio.run_process(
                [sys.executable, "-c", _FAR, how[1], str(key)],
                cwd=ROOT,
                check=False,
                env={**os.environ, "AMESH_TRANSPORT": "tcp", "AMESH_KEY_FILE": str(key)},
            )
            assert out.returncode == 0, out.stderr.decode()
            logs = await _amesh("logs", "far", *how)
            assert sorted(logs.splitlines()) == [f"[printers {r}] far from {r}" for r in range(4)]
            assert await _amesh("logs", "far", "--rank", "2", *how) == "[printers 2] far from 2\n"
            files = [
                f
                for a in (a1, a2)
                for f in (Path(os.environ["AMESH_STATE_DIR"]) / "logs").glob(f"{a.proc.pid}-*/*")
            ]
            assert len(files) == 4, files
            stacks = await _amesh("stacks", "far", "3", *how)
            assert stacks.startswith("=== far rank 3 (pid ") and "by a signal" not in stacks
            assert "stopped far: 4 process(es)" in await _amesh("stop", "far", *how)
            assert not any(f.exists() for f in files)
