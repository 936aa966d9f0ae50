"""Host agents: ``amesh keygen``, ``amesh agent``, ``amesh.attach`` and meshes over them.

The agents run as real processes listening on loopback tcp; each stands for a machine.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import pytest

import amesh
from amesh import SupervisionError, _wire
from amesh._hosts._remote import LEASE_PERIOD, lease_period
from amesh._identity import job_key, read_key_file
from amesh._limits import TASKS_PER_PROCESS
from amesh._runtime import open_runtime
from amesh._transport import HybridTransport, open_transport
from amesh._transport._tags import dial_part, tag_of
from amesh.testing._leaks import child_pids

from .actors import Counter
from .test_shm_debris import job_segments
from .test_spawn import _pids_hierarchy, _remove_groups, cmdline_of, in_group

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the agent is one program; both backends run its workers alike


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shared_key(tmp_path: Path) -> Path:
    """A key file holding this test process's own job key (as if from keygen)."""
    path = tmp_path / "key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, job_key().hex().encode() + b"\n")
    os.close(fd)
    return path


class Agent:
    """An ``amesh agent`` process on loopback; a thread collects what it logs."""

    def __init__(
        self,
        key: Path,
        grace: float = 5.0,
        scheme: str = "tcp",
        port: int = 0,
        cgroup: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.addr = f"{scheme}://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "amesh", "agent", "--listen", self.addr]
        cmd += ["--key-file", str(key), "--grace", str(grace)]
        if cgroup is not None:
            cmd = in_group(cgroup, cmd)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self._logged = threading.Condition()
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._logged:
                self.log.append(line)
                self._logged.notify_all()
            if "listening on" in line:
                self._listening.set()
        self._listening.set()  # it exited
        with self._logged:
            self._logged.notify_all()

    async def logged(self, text: str) -> str:
        """Wait until the agent logs a line containing ``text``; that line."""

        def wait() -> str:
            with self._logged:
                while True:
                    for line in self.log:
                        if text in line:
                            return line
                    if self.proc.poll() is not None and not self._reader.is_alive():
                        raise AssertionError(f"the agent exited without logging {text!r}")
                    self._logged.wait(1.0)

        return await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)

    async def listening(self) -> None:
        await anyio.to_thread.run_sync(self._listening.wait)
        assert self.proc.poll() is None, f"the agent exited: {''.join(self.log)}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(30)
        self._reader.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return rc


@asynccontextmanager
async def agents(
    key: Path, n: int, grace: float = 5.0, scheme: str = "tcp"
) -> AsyncIterator[list[Agent]]:
    started = [Agent(key, grace, scheme) for _ in range(n)]
    try:
        for a in started:
            await a.listening()
        yield started
    except BaseException:
        for a in started:  # what each agent saw, beside the failure
            a.stop()
            sys.stderr.write(f"agent {a.addr} logged:\n{''.join(a.log)}")
        raise
    for a in started:
        a.stop()


def ancestors(pid: int) -> list[int]:
    """``pid``'s parent, its parent, ... up to init."""
    out = []
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        out.append(pid)
    return out


async def gone(pid: int) -> None:
    """Wait until process ``pid`` (not our child) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def tcp_runtime() -> open_runtime:
    """A controller on ``tcp``: TLS to other hosts, streams within this one (here)."""
    return open_runtime(lambda: open_transport("tcp"))


def test_keygen_writes_a_private_key_once(tmp_path: Path) -> None:
    path = tmp_path / "job.key"
    run: Callable[..., subprocess.CompletedProcess[str]] = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "amesh", *a], capture_output=True, text=True, timeout=60
    )
    assert run("keygen", str(path)).returncode == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_key_file(str(path))) == 32
    again = run("keygen", str(path))
    assert again.returncode == 1 and "exists" in again.stderr
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="others may read it"):
        read_key_file(str(path))
    refused = run("agent", "--listen", "tcp://127.0.0.1:1", "--key-file", str(path))
    assert refused.returncode == 2 and "chmod 600" in refused.stderr
    bad = run("agent", "--listen", "ipc:///tmp/x", "--key-file", str(path))
    assert bad.returncode == 2 and "tcp://ADDR:PORT" in bad.stderr
    path.chmod(0o600)
    for grace in ("0", "-1", "nan"):
        none = run(
            "agent", "--listen", "tcp://127.0.0.1:1", "--key-file", str(path), "--grace", grace
        )
        assert none.returncode == 2 and "--grace must be more than 0" in none.stderr, none.stderr


def test_leases_come_four_times_a_grace_period() -> None:
    """A controller's lease period follows each agent's grace: a late lease or two (a
    busy machine) never costs a controller its workers, and a long grace costs no more
    than two leases a second."""
    assert lease_period(5.0) == LEASE_PERIOD == 0.5
    assert lease_period(0.5) == 0.125
    assert lease_period(0.001) == 0.01


async def test_a_mesh_over_two_agents(tmp_path: Path) -> None:
    """Processes start on the agent of their host (by slot), run actors, answer every
    adverb; one killed is reported with its exit status; at the end none is left."""
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 2) as (a1, a2), tcp_runtime():
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            assert hosts.sizes == {"hosts": 2}
            assert [h["pid"] for h in hosts.hosts] == [a1.proc.pid, a2.proc.pid]
            failures: list[amesh.Failure] = []
            seen = anyio.Event()

            def supervise(f: amesh.Failure) -> bool:
                failures.append(f)
                seen.set()
                return True

            async with hosts.spawn_procs({"gpus": 2}, supervise=supervise) as procs:
                assert procs.sizes == {"hosts": 2, "gpus": 2}
                for slot, pid in enumerate(procs.pids):
                    agent = (a1, a2)[slot // 2]
                    assert agent.proc.pid in ancestors(pid)
                c = await procs.spawn("c", Counter)
                assert list((await c.incr.call()).values()) == [1, 1, 1, 1]
                await c.incr.broadcast(10)
                assert await c.slice(hosts=1, gpus=0).get.call_one() == 11
                victim = procs.pids[3]
                os.kill(victim, signal.SIGKILL)
                await seen.wait()
                with pytest.raises(SupervisionError, match="SIGKILL"):
                    await c.slice(hosts=1, gpus=1).get.call_one()
                assert await c.slice(hosts=0, gpus=1).get.call_one() == 11
                pids = procs.pids
            assert failures[0].rank == 3 and failures[0].pid == victim
            for pid in pids:
                with anyio.fail_after(10):
                    await gone(pid)
        assert a1.proc.returncode == 0 and a2.proc.returncode == 0


async def test_a_controller_on_the_default_transport_moves_towards_its_agents(
    tmp_path: Path,
) -> None:
    """A controller on the default transport (abstract sockets: no other machine
    reaches them) listens, at attach, on the address that routes to its agents (TLS
    on loopback here); the agents' workers report there and answer. One that started
    a mesh of its own before cannot move (its workers know its address): attach says
    so."""
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 2) as (a1, a2):
            async with open_runtime(lambda: open_transport()) as rt:
                assert rt.address.startswith("stream+abstract://")
                hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
                assert rt.address.startswith("tls+tcp://127.0.0.1:")
                async with hosts.spawn_procs({"gpus": 1}) as procs:
                    c = await procs.spawn("c", Counter)
                    assert list((await c.incr.call(2)).values()) == [2, 2]
                    assert await c.slice(hosts=1).incr.call_one() == 3
            async with open_runtime(lambda: open_transport()) as rt:
                async with amesh.ProcMesh({"procs": 1}) as local:
                    await local.spawn("c", Counter)
                    with pytest.raises(RuntimeError, match="know it already"):
                        await amesh.attach([a1.addr], key_file=str(key))
                assert rt.address.startswith("stream+abstract://")


def zygotes_of(pid: int) -> list[int]:
    """The zygotes among the children of process ``pid``."""
    return [c for c in child_pids(pid) if "amesh._hosts._zygote_main" in cmdline_of(c)]


async def test_an_agent_starts_its_zygote_before_any_mesh(tmp_path: Path) -> None:
    """Every worker of an agent is forked by its zygote: it starts with the agent, so
    the first mesh does not wait for it, and that one zygote serves every mesh."""
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 1) as (a,), tcp_runtime():
            with anyio.fail_after(30):
                line = await a.logged("zygote")
            zygote = int(line.split("zygote ", 1)[1].split()[0])
            assert zygotes_of(a.proc.pid) == [zygote]
            hosts = await amesh.attach([a.addr], key_file=str(key))
            for _ in range(2):
                async with hosts.spawn_procs({"gpus": 2}) as procs:
                    c = await procs.spawn("c", Counter)
                    assert list((await c.incr.call()).values()) == [1, 1]
                    assert child_pids(zygote) >= set(procs.pids)  # forked by it
                assert zygotes_of(a.proc.pid) == [zygote]
        assert a.proc.returncode == 0
        await gone(zygote)


async def test_a_controller_on_the_port_of_a_gone_one_is_another_peer(tmp_path: Path) -> None:
    """The kernel hands a freed port to the next process that asks. A controller started
    on the port of one that the agent saw go is a new peer there (its address has
    another tag, see amesh._transport._tags), and the agent answers it: it was taken
    for the dead one, and its calls timed out, before."""
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 1, grace=0.5) as (agent,):
            async with open_runtime(lambda: HybridTransport()) as rt:
                first = rt.address
                hosts = await amesh.attach([agent.addr], key_file=str(key))
                async with hosts.spawn_procs({"gpus": 1}) as procs:
                    c = await procs.spawn("c", Counter)
                    assert await c.incr.call_one() == 1
            assert tag_of(first)  # the kernel picked its port
            await agent.logged(f"controller {first} is gone")
            port = int(dial_part(first).rsplit(":", 1)[1])
            async with open_runtime(lambda: HybridTransport(port=port)) as rt:
                assert dial_part(rt.address) == dial_part(first) and rt.address != first
                hosts = await amesh.attach([agent.addr], key_file=str(key), timeout=20)
                assert hosts.hosts[0]["pid"] == agent.proc.pid
                async with hosts.spawn_procs({"gpus": 1}) as procs:
                    c = await procs.spawn("c", Counter)
                    assert await c.incr.call_one() == 1
        assert agent.proc.returncode == 0


async def test_attach_reaches_an_agent_started_again_at_its_address(tmp_path: Path) -> None:
    """An agent that died is taken for dead; ``attach`` to its address asks anew, so an
    agent started again there (the same well-known address, no tag) is reached."""
    key = shared_key(tmp_path)
    started: list[Agent] = []
    try:
        with anyio.fail_after(120):
            started.append(Agent(key))
            first = started[0]
            await first.listening()
            async with tcp_runtime() as rt:
                hosts = await amesh.attach([first.addr], key_file=str(key))
                (addr,) = [h["addr"] for h in hosts.hosts]
                first.proc.kill()
                first.proc.wait(10)
                with pytest.raises(SupervisionError):
                    await amesh.attach([first.addr], timeout=20)
                assert addr in rt.peers.dead
                started.append(Agent(key, port=first.port))
                second = started[1]
                await second.listening()
                hosts = await amesh.attach([second.addr], timeout=20)
                assert hosts.hosts[0]["pid"] == second.proc.pid
                assert addr not in rt.peers.dead
            assert second.stop() == 0
    finally:
        for a in started:
            a.stop()


async def test_losing_an_agent_fails_the_ranks_of_its_host(tmp_path: Path) -> None:
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 2) as (a1, a2), tcp_runtime():
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            seen = anyio.Event()
            failures: list[amesh.Failure] = []

            def supervise(f: amesh.Failure) -> bool:
                failures.append(f)
                if len(failures) == 2:
                    seen.set()
                return True

            async with hosts.spawn_procs({"gpus": 2}, supervise=supervise) as procs:
                c = await procs.spawn("c", Counter)
                await c.incr.call()
                a2.proc.kill()
                await seen.wait()
                assert sorted(f.rank for f in failures) == [2, 3]
                for f in failures:  # named by host and cause, in one sentence
                    assert f.host == "127.0.0.1", f
                    assert f.cause.startswith(
                        f"was lost with its host agent at 127.0.0.1:{a2.port}: the "
                    ), f
                    assert "hosts." not in f.cause and "rank" not in f.cause, f
                with pytest.raises(SupervisionError):
                    await c.slice(hosts=1).get.call()
                assert list((await c.slice(hosts=0).get.call()).values()) == [1, 1]
                lost = procs.pids[2:]
            for pid in lost:  # they died with their agent
                with anyio.fail_after(10):
                    await gone(pid)


_CONTROLLER = """
import os, sys, amesh
from amesh import _identity, _wire

async def main():
    hosts = await amesh.attach([sys.argv[1]], key_file=sys.argv[2])
    procs = await hosts.spawn_procs({"gpus": 2})
    held = _wire.dumps(bytes(2 << 20), shm=True)  # a segment nobody loads
    assert held.segments
    print(_identity.job_id(), *procs.pids, flush=True)
    sys.stdin.read()  # until killed

amesh.run(main)
"""


async def test_workers_do_not_outlive_their_controller(tmp_path: Path) -> None:
    """A controller SIGKILLed: its agent stops its workers after the grace period,
    removes the shared-memory segment the controller held, and exits cleanly on
    SIGTERM."""
    key = tmp_path / "key"
    made = await anyio.run_process([sys.executable, "-m", "amesh", "keygen", str(key)])
    assert made.returncode == 0
    with anyio.fail_after(120):
        async with agents(key, 1, grace=0.5) as (agent,):
            env = {**os.environ, "AMESH_TRANSPORT": "tcp"}
            ctl = subprocess.Popen(  # noqa: ASYNC220 (its stdout is read in a thread)
                [sys.executable, "-c", _CONTROLLER, agent.addr, str(key)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            try:
                assert ctl.stdout is not None
                line = await anyio.to_thread.run_sync(ctl.stdout.readline)
                job, *pids = line.split()
                assert len(pids) == 2
                for pid in pids:
                    assert agent.proc.pid in ancestors(int(pid))
                assert job_segments(_wire.shm_dir(), job)
                ctl.kill()
                for pid in pids:
                    await gone(int(pid))
                await agent.logged("shared-memory segment(s) of ended processes")
                assert job_segments(_wire.shm_dir(), job) == set()
            finally:
                ctl.kill()
                ctl.wait(10)
                assert ctl.stdin is not None and ctl.stdout is not None
                ctl.stdin.close()
                ctl.stdout.close()
            assert agent.stop() == 0
        assert any("is gone" in line for line in agent.log), agent.log


_STRANGER = """
import sys, anyio, amesh
from amesh._runtime._runtime import open_runtime
from amesh._transport import open_transport

async def main():
    async with open_runtime(lambda: open_transport("tcp")):
        try:
            await amesh.attach([sys.argv[1]], timeout=20)
        except amesh.SupervisionError as exc:
            print("refused:", exc)

anyio.run(main)
"""


def nng_threads(pid: int) -> int:
    names = [(p / "comm").read_text() for p in Path(f"/proc/{pid}/task").iterdir()]
    return sum(name.startswith("nng:") for name in names)


@pytest.mark.skipif(os.getuid() != 0, reason="making a control group needs root")
async def test_a_mesh_a_hosts_pids_cap_cannot_hold_is_refused_before_it_starts(
    tmp_path: Path,
) -> None:
    """An agent in a control group capped with room for one worker's threads: a mesh
    of two processes on its host is refused before either starts, naming the host
    and the cap; one of one runs."""
    key = shared_key(tmp_path)
    group = _pids_hierarchy() / f"amesh-test-{os.getpid()}-{os.urandom(4).hex()}"
    group.mkdir()
    try:
        with anyio.fail_after(120):
            async with AsyncExitStack() as stack:
                agent = Agent(key, cgroup=group)
                stack.callback(agent.stop)
                await agent.listening()
                # room for one worker's threads (and its zygote's, and a few), not two
                worker = TASKS_PER_PROCESS + nng_threads(agent.proc.pid)
                running = int((group / "pids.current").read_text())
                (group / "pids.max").write_text(str(running + worker + 4))
                await stack.enter_async_context(tcp_runtime())
                hosts = await amesh.attach([agent.addr], key_file=str(key))
                with pytest.raises(OSError) as refused:
                    async with hosts.spawn_procs({"gpus": 2}):
                        pass
                message = str(refused.value)
                assert refused.value.errno == errno.EAGAIN
                host = hosts.hosts[0]["host"]
                assert (
                    f"on host {host}: starting these processes needs ~{2 * worker} more" in message
                )
                assert f"the control group {group} lets its processes run" in message
                assert (await hosts._agents.info.call_one())["workers"] == []  # none started
                async with hosts.spawn_procs({"gpus": 1}) as procs:
                    c = await procs.spawn("c", Counter)
                    assert list((await c.incr.call()).values()) == [1]
                    # what the worker runs: no more than counted
                    (pid,) = procs.pids
                    threads = len(os.listdir(f"/proc/{pid}/task"))
                    assert threads <= worker, (threads, worker)
    finally:
        _remove_groups([group])


async def test_an_agent_refuses_a_controller_without_the_key(tmp_path: Path) -> None:
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 1) as (agent,), tcp_runtime():
            out = await anyio.run_process(
                [sys.executable, "-c", _STRANGER, agent.addr], check=False
            )
            assert b"refused:" in out.stdout, out
            hosts = await amesh.attach([agent.addr])  # we hold the key: admitted
            assert hosts.hosts[0]["auth_refused"] >= 1
            assert hosts.hosts[0]["workers"] == []


async def test_one_frame_per_host(tmp_path: Path) -> None:
    """A call or broadcast from the controller to 2 hosts x 3 processes sends one frame
    per host: the relay tree's first level is hosts; each host's first process passes
    it on to the others there, and gathers their replies."""
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 2) as (a1, a2), tcp_runtime() as rt:
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            async with hosts.spawn_procs({"gpus": 3}) as procs:
                c = await procs.spawn("c", Counter)
                before = rt.statistics().frames_sent
                assert list((await c.incr.call()).values()) == [1] * 6
                assert rt.statistics().frames_sent - before == 2
                before = rt.statistics().frames_sent
                await c.incr.broadcast()
                assert rt.statistics().frames_sent - before == 2
                assert list((await c.get.call()).values()) == [2] * 6


async def test_a_process_group_across_hosts(tmp_path: Path) -> None:
    """amesh.torch over two agents: one gloo job, ranks in host-major order, an
    all-reduce across the hosts."""
    from amesh.torch import init_process_group

    from .torch_actors import DistWorker

    key = shared_key(tmp_path)
    with anyio.fail_after(180):
        async with agents(key, 2) as (a1, a2), tcp_runtime():
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            async with hosts.spawn_procs({"gpus": 2}) as procs:
                group = await init_process_group(procs, backend="gloo", timeout=60)
                assert group.master_addr == "127.0.0.1"  # both "hosts" are this machine
                w = await procs.spawn("w", DistWorker)
                assert [g[:2] for g in (await w.group.call()).values()] == [
                    (r, 4) for r in range(4)
                ]
                sums = await w.all_reduce.call(1.0)
                assert list(sums.values()) == [4.0] * 4
                await group.destroy()


async def test_a_stalled_controller_keeps_its_workers(tmp_path: Path) -> None:
    """The controller's leases come from a thread that never takes the GIL: its event
    loop blocked for several grace periods (a long synchronous step, a debugger stop)
    loses no worker."""
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 1, grace=0.5) as (agent,), tcp_runtime():
            hosts = await amesh.attach([agent.addr], key_file=str(key))
            assert hosts.hosts[0]["grace"] == 0.5  # so leases come every 0.125 s
            async with hosts.spawn_procs({"gpus": 2}) as procs:
                c = await procs.spawn("c", Counter)
                pids = procs.pids
                time.sleep(3)  # noqa: ASYNC251  (the stall under test: 6 grace periods)
                assert list((await c.incr.call()).values()) == [1, 1]
                assert procs.pids == pids
        assert not any("is gone" in line for line in agent.log), agent.log


async def test_hosts_over_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents, the controller and every worker on tls+tcp with every link NNG over TLS
    (certificates of the job), within this host too (AMESH_TRANSPORT_IMPL=ext): the mesh
    works, every worker listens on tls+tcp, a death is reported."""
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", "ext")  # the agents inherit it
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with (
            agents(key, 2, scheme="tls+tcp") as (a1, a2),
            open_runtime(lambda: open_transport("tls+tcp")),
        ):
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            assert all(h["addr"].startswith("tls+tcp://") for h in hosts.hosts)
            seen = anyio.Event()
            async with hosts.spawn_procs(
                {"gpus": 2}, supervise=lambda f: seen.set() or True
            ) as procs:
                c = await procs.spawn("c", Counter)
                assert list((await c.incr.call()).values()) == [1] * 4
                stats = (await procs.statistics()).values()
                assert all(s["address"].startswith("tls+tcp://") for s in stats)
                os.kill(procs.pids[0], signal.SIGKILL)
                await seen.wait()
                with pytest.raises(SupervisionError, match="SIGKILL"):
                    await c.slice(hosts=0, gpus=0).get.call_one()
                assert await c.slice(hosts=1, gpus=1).get.call_one() == 1


async def test_a_restart_stays_on_its_host(tmp_path: Path) -> None:
    """A restart policy across hosts: the killed rank comes back on the same host (its
    agent starts the new process), and the mesh answers again."""
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 2) as (a1, a2), tcp_runtime():
            hosts = await amesh.attach([a1.addr, a2.addr], key_file=str(key))
            async with hosts.spawn_procs({"gpus": 2}) as procs:
                c = await procs.spawn("c", Counter, restart=amesh.RestartPolicy(max_restarts=1))
                await c.incr.call()
                old = procs.pids[3]
                os.kill(old, signal.SIGKILL)
                while procs.pids[3] == old:  # the supervisor restarts it
                    with pytest.raises(SupervisionError):
                        await c.slice(hosts=1, gpus=1).get.call_one()
                    await procs.ready()
                new = procs.pids[3]
                assert a2.proc.pid in ancestors(new)
                assert list((await c.get.call()).values()) == [1, 1, 1, 0]


async def test_train_ddp_over_agents(tmp_path: Path) -> None:
    """The flagship example with --hosts: one rank on each of two agents, gloo."""
    key = tmp_path / "key"
    made = await anyio.run_process([sys.executable, "-m", "amesh", "keygen", str(key)])
    assert made.returncode == 0
    example = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
    with anyio.fail_after(240):
        async with agents(key, 2) as (a1, a2):
            args = [f"--hosts={a1.addr},{a2.addr}", f"--key-file={key}", "--listen=127.0.0.1"]
            args += ["--procs=1", "--steps=40", "--eval-size=1024", f"--ckpt-dir={tmp_path}"]
            out = await anyio.run_process(
                [sys.executable, str(example), *args], check=False, stdin=subprocess.DEVNULL
            )
    text = out.stdout.decode()
    assert out.returncode == 0, text + out.stderr.decode()
    assert "2 ranks, backend gloo, store at 127.0.0.1 {'hosts': 2, 'gpus': 1}" in text
    assert "eval accuracy" in text
