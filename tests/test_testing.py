"""amesh.testing: the in-memory transport, the faulty transport, in-process meshes."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from amesh import ActorError, Failure, ProcMesh, SupervisionError
from amesh._transport import open_transport
from amesh.testing import (
    FaultyTransport,
    InProcessHost,
    LeakError,
    MemoryTransport,
    _pytest,
    no_leaks,
    open_runtime,
)
from amesh.testing._leaks import abstract_sockets

from .actors import Counter, Mortal
from .test_shm_debris import free_pid, own_owner

pytestmark = pytest.mark.anyio


async def test_in_process_mesh_on_memory_transport() -> None:
    host = InProcessHost()
    with anyio.fail_after(30):
        async with open_runtime(MemoryTransport()) as rt:
            assert rt.address.startswith("memory://")
            async with ProcMesh(per_host={"x": 2, "y": 2}, host=host) as procs:
                c = await procs.spawn("c", Counter, 1)
                assert (await c.incr.call()).values() == [2, 2, 2, 2]
                assert [w[1] for w in (await c.slice(x=1).where.call()).values()] == [0, 1]
                with pytest.raises(ActorError, match="boom"):
                    await c.slice(x=0, y=0).fail.call_one("boom")
                async with anyio.create_task_group() as tg:
                    tg.start_soon(c.slice(x=0, y=0).hang_concurrent.call_one)
                    await c.slice(x=0, y=0).wait_started.call_one()
                    tg.cancel_scope.cancel()
                assert (await c.slice(x=0, y=0).cancelled_count.call_one()) == 1


async def test_in_process_kill_pause_resume() -> None:
    host = InProcessHost()
    failures: list[Failure] = []

    def handle(failure: Failure) -> bool:
        failures.append(failure)
        return True

    with anyio.fail_after(30):
        async with open_runtime(MemoryTransport()):
            async with ProcMesh(
                per_host={"procs": 3},
                host=host,
                supervise=handle,
                heartbeat_period=0.05,
                heartbeat_timeout=2.0,
            ) as procs:
                m = await procs.spawn("m", Mortal)
                pid0, pid1, pid2 = procs.pids
                host.worker(pid1).kill()
                with pytest.raises(SupervisionError, match="SIGKILL"):
                    await m.slice(procs=1).hang.call_one()
                # a pause shorter than the timeout is harmless
                host.worker(pid0).pause()
                host.worker(pid0).resume()
                assert (await m.slice(procs=0).bump.call_one())[1] == 1
                # a pause longer than the timeout is a failure (and the worker is killed)
                host.worker(pid2).pause()
                with pytest.raises(SupervisionError, match="no heartbeat"):
                    await m.slice(procs=2).bump.call_one()
        assert [(f.rank, f.pid) for f in failures] == [(1, pid1), (2, pid2)]
        assert "was killed by SIGKILL" in failures[0].cause


async def test_faulty_transport_duplicates_run_once_and_drops_time_out() -> None:
    faulty = FaultyTransport(open_transport())
    with anyio.fail_after(60):
        async with open_runtime(faulty) as rt:
            async with ProcMesh(per_host={"procs": 2}) as procs:
                c = await procs.spawn("c", Counter)
                faulty.duplicate(kinds={"Call", "Cast"})
                assert (await c.incr.call()).values() == [1, 1]
                await c.incr.broadcast()
                assert (await c.get.call()).values() == [2, 2]  # each ran exactly once
                faulty.clear()
                stats = await procs.statistics()
                assert [s["duplicates_dropped"] for s in stats.values()] == [3, 3]
                faulty.drop_inbound(kinds={"Reply"}, count=1)
                with pytest.raises(TimeoutError):
                    await c.slice(procs=0).get.options(timeout=0.5).call_one()
                assert await c.slice(procs=0).get.call_one() == 2  # the link still works
                faulty.cut(procs._live().addrs[1])
                with pytest.raises(TimeoutError):
                    await c.slice(procs=1).get.options(timeout=0.5).call_one()
                faulty.heal()
                assert await c.slice(procs=1).incr.call_one() == 3
                assert faulty.dropped >= 2 and faulty.duplicated == 6
            assert not rt.calls.pending  # nothing is left waiting


async def test_faulty_transport_delay_keeps_order() -> None:
    faulty = FaultyTransport(open_transport())
    with anyio.fail_after(60):
        async with open_runtime(faulty):
            async with ProcMesh(per_host={"procs": 1}) as procs:
                c = await procs.spawn("c", Counter)
                faulty.delay(0.05, kinds={"Cast"}, count=3)
                for i in range(6):
                    await c.record.broadcast(i)
                assert await c.seen_items.call_one() == list(range(6))
                assert faulty.delayed == 3


def test_no_leaks_catches_a_listening_abstract_socket_and_its_descriptor() -> None:
    name = f"amesh-{os.getpid()}-leak-on-purpose"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(LeakError, match=f"leaked listening abstract sockets.*{name}"):
            with no_leaks():
                sock.bind("\0" + name)
                sock.listen(1)
        assert f"@{name}" in abstract_sockets()
    finally:
        sock.close()
    assert f"@{name}" not in abstract_sockets()
    # a socket that never listens still holds a descriptor
    with pytest.raises(LeakError, match=r"leaked socket descriptors \d+ -> socket:\["):
        with no_leaks():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.close()
    with no_leaks():  # closed in the block: nothing to report
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()


def test_the_pytest_plugin_sweeps_only_the_directories_of_ended_sessions(
    tmp_path: Path,
) -> None:
    me, start, ns = own_owner()
    gone = free_pid()
    removed = {
        f"amesh-test-{gone}.{start}.{ns}-ab12_cd3",  # its pid is free
        f"amesh-test-shm-{gone}.0.{ns}-x9y8z7w6",  # (its start not known)
        f"amesh-test-shm-{me}.{start + 1}.{ns}-r3us3d00",  # its pid was reused since
    }
    kept = {
        f"amesh-test-{me}.{start}.{ns}-k33p1ng0",  # this live session
        f"amesh-test-shm-{gone}.{start}.{ns + 1}-0th3rns0",  # another pid namespace
        "amesh-test-shm-0ldn4m3s",  # the old naming: whose, cannot tell
        "amesh-test-other",
    }
    for name in removed | kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "amesh-segment").write_bytes(b"x")
    # a plain file and a link of a gone session's name are not directories it made
    target = tmp_path / "target"
    target.mkdir()
    specials = {f"amesh-test-{gone}.{start}.{ns}-f1l30000", f"amesh-test-{gone}.0.{ns}-l1nk0000"}
    a_file, a_link = sorted(specials)
    (tmp_path / a_file).write_bytes(b"x")
    (tmp_path / a_link).symlink_to(target)
    assert _pytest.sweep_sessions(str(tmp_path)) == len(removed)
    assert set(os.listdir(tmp_path)) == kept | specials | {"target"}
    assert _pytest.sweep_sessions(str(tmp_path)) == 0


_KILLED_SESSION = """
import os, signal

def test_killed():
    print("dirs", os.environ["AMESH_IPC_DIR"], os.environ["AMESH_SHM_DIR"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_test_sessions_directories_go_at_the_next_session(tmp_path: Path) -> None:
    """A session killed before its end (SIGKILL, or pytest-timeout's ``thread``
    method) leaves its socket and segment directories; the next session that loads
    the plugin removes them."""
    (tmp_path / "test_killed.py").write_text(_KILLED_SESSION)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["amesh.testing.pytest_plugin"]\n')
    env = {k: v for k, v in os.environ.items() if k not in ("AMESH_IPC_DIR", "AMESH_SHM_DIR")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    run = functools.partial(
        subprocess.run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    killed = run([*cmd, "test_killed.py"])
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    line = next(x for x in killed.stdout.splitlines() if x.startswith("dirs "))
    ipc, shm = line.split()[1:]
    assert os.path.isdir(ipc) and os.path.isdir(shm)  # left behind
    (tmp_path / "test_killed.py").write_text("def test_nothing():\n    pass\n")
    after = run([*cmd, "test_killed.py"])
    assert after.returncode == 0, after.stdout + after.stderr
    assert not os.path.exists(ipc) and not os.path.exists(shm)
