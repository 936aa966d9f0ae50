"""Persistent meshes: they outlive their controller, another controller takes them
over with their actors' state, ``amesh list`` shows them, ``amesh stop`` and
``procs.stop()`` end them; meshes that are not persistent still die with their
controller.

Controllers that go away are real processes (SIGKILLed, or returning); the agent that
holds the meshes is this machine's local agent (started on demand, in a state
directory of the test's own) or an ``amesh agent`` on loopback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import anyio.streams.text
import pytest

import amesh
import amesh.testing
from amesh._hosts._home import local_agent_address
from amesh._hosts._remote import local_hosts
from amesh._identity import job_key
from amesh._runtime import open_runtime
from amesh._transport import open_transport

from .test_agent import agents, gone, shared_key

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the controllers are programs of their own; workers run alike


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state directory of this test's own, whose key is this process's job key (so
    that this process may take the meshes over); its local agent is gone at the end."""
    home = tmp_path / "state"
    home.mkdir(mode=0o700)
    fd = os.open(home / "key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, job_key().hex().encode() + b"\n")
    os.close(fd)
    monkeypatch.setenv("AMESH_STATE_DIR", str(home))
    monkeypatch.setenv("AMESH_LOCAL_AGENT_IDLE", "0.5")
    yield home
    # the agent exits by itself once idle; one left running (a failed test) is killed
    pid = _agent_pid(home)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)


def _agent_pid(home: Path) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"agent" in cmd and str(home / "key").encode() in cmd:
                return int(entry.name)
    return None


_CONTROLLER = """
import os, signal, sys
import anyio
import amesh
import amesh.testing
from tests.actors import Counter

async def main():
    procs = await amesh.ProcMesh(
        {"procs": 2}, name="train", persistent=True, settings={"send_window": 128, "fanout": 4}
    )
    counters = await procs.spawn("counters", Counter)
    await counters.incr.call(5)
    await counters.slice(procs=1).incr.call_one(2)
    scratch = await amesh.ProcMesh({"procs": 1})
    print(" ".join(map(str, procs.pids)), scratch.pids[0], flush=True)
    await anyio.sleep(float(sys.argv[2]))  # holds the mesh (its heartbeats) this long
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)

amesh.run(main)
"""


async def _controller(how: str, hold: float = 0.0) -> tuple[list[int], int]:
    """Run a controller that makes persistent mesh ``train`` (with actor mesh
    ``counters`` at 5 and 7) and a scratch mesh, holds them ``hold`` seconds, then is
    SIGKILLed (``kill``) or returns (``return``): (pids of ``train``, pid of the
    scratch process)."""
    out = await anyio.run_process(
        [sys.executable, "-c", _CONTROLLER, how, str(hold)], cwd=ROOT, check=False
    )
    expected = -signal.SIGKILL if how == "kill" else 0
    assert out.returncode == expected, out.stderr.decode()
    *pids, scratch = (int(p) for p in out.stdout.split())
    return pids, scratch


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _amesh(*args: str) -> str:
    out = await anyio.run_process([sys.executable, "-m", "amesh", *args], check=False)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode()


async def test_a_persistent_mesh_outlives_a_killed_controller(state: Path) -> None:
    """Controller SIGKILLed: its persistent mesh runs on (its scratch mesh does not);
    `amesh list` shows it; another controller takes it over with the actors' state,
    calls it, and stops it; then the local agent exits by itself."""
    with anyio.fail_after(120):
        pids, scratch = await _controller("kill")
        await gone(scratch)
        assert all(_alive(p) for p in pids)
        listed = await _amesh("list")
        assert "train  {procs: 2}" in listed and "counters (Counter)" in listed, listed
        for rank, pid in enumerate(pids):
            assert f"{rank}: pid {pid} running" in listed, listed
        raw = json.loads(await _amesh("list", "--json"))["persistent"]
        assert raw["train"]["sizes"] == [2] and raw["train"]["actors"][0]["name"] == "counters"

        async with open_runtime(lambda: open_transport("abstract")):
            procs = await amesh.attach_mesh("train")
            assert procs.persistent and procs.name == "train"
            assert procs.pids == pids
            counters = await procs.actor_mesh("counters")
            assert list((await counters.get.call()).values()) == [5, 7]
            assert await counters.slice(procs=0).incr.call_one() == 6
            with pytest.raises(LookupError, match=r"no actor mesh named 'nope'.*counters"):
                await procs.actor_mesh("nope")
            await procs.stop()
            for pid in pids:
                await gone(pid)
            with pytest.raises(LookupError, match="no persistent mesh named 'train'"):
                await amesh.attach_mesh("train")
        assert "no persistent meshes" in await _amesh("list")
        agent = _agent_pid(state)
        if agent is not None:
            await gone(agent)  # idle: it exits by itself
        assert local_agent_address() is None


async def test_a_controller_that_returns_lets_go_and_amesh_stop_ends_it(state: Path) -> None:
    """A controller that returns leaves its persistent mesh running; a second one
    takes it over and returns too (it stays persistent); `amesh stop` ends it."""
    with anyio.fail_after(120):
        pids, scratch = await _controller("return")
        await gone(scratch)
        assert all(_alive(p) for p in pids)
        async with open_runtime(lambda: open_transport("abstract")):
            procs = await amesh.attach_mesh("train")
            # its own settings, for the workers it may start again
            assert procs._life.settings == {"send_window": 128, "fanout": 4}
            assert (procs._fanout, procs._hb_timeout) == (4, 5.0)
            counters = await procs.actor_mesh("counters")
            assert await counters.slice(procs=1).incr.call_one(3) == 10
        assert all(_alive(p) for p in pids)  # leaving lets go of it, nothing more
        assert "stopped train: 2 process(es)" in await _amesh("stop", "train")
        for pid in pids:
            await gone(pid)
        out = await anyio.run_process([sys.executable, "-m", "amesh", "stop", "train"], check=False)
        assert out.returncode == 1 and b"no persistent mesh named 'train'" in out.stderr


async def test_a_persistent_mesh_of_a_controller_on_tcp(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller on ``AMESH_TRANSPORT=tcp`` (as in a shell set up for host agents)
    makes a persistent mesh on this machine's agent, which listens on plain streams:
    the agent answers it at its local alias (its answers were dropped: ``hosts.info:
    no answer within 30 s``), and a controller on the default transport takes the
    mesh over, its workers on ``tls+tcp`` included."""
    monkeypatch.setenv("AMESH_TRANSPORT", "tcp")
    with anyio.fail_after(60):
        pids, scratch = await _controller("return")
        await gone(scratch)
        async with open_runtime(lambda: open_transport("abstract")):
            procs = await amesh.attach_mesh("train")
            assert procs.pids == pids
            counters = await procs.actor_mesh("counters")
            assert list((await counters.get.call()).values()) == [5, 7]
            await procs.stop()
        for pid in pids:
            await gone(pid)


#: the heartbeat period of the meshes held for several periods: short, so that several
#: pass in a second or two
_PERIOD = 0.1
#: how long a controller holds its mesh, and how long the mesh then runs without one
_HOLD = 10 * _PERIOD


@pytest.mark.parametrize("how", ["kill", "return"])
async def test_a_persistent_mesh_runs_on_for_periods_without_a_controller(
    state: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller that held its persistent mesh for several heartbeat periods, then
    was SIGKILLed or returned: the mesh runs on without one for several periods more,
    then another controller takes it over and finds its actors' state (its workers
    used to exit 1 once their heartbeat connection, up longer than a period, ended)."""
    monkeypatch.setenv("AMESH_HEARTBEAT_PERIOD", str(_PERIOD))
    with anyio.fail_after(120):
        pids, scratch = await _controller(how, hold=_HOLD)
        await gone(scratch)
        await anyio.sleep(_HOLD)  # nobody holds it: its workers try to reconnect
        assert all(_alive(p) for p in pids), await _amesh("list")
        async with open_runtime(lambda: open_transport("abstract")):
            procs = await amesh.attach_mesh("train")
            assert procs.pids == pids
            counters = await procs.actor_mesh("counters")
            assert list((await counters.incr.call()).values()) == [6, 8]
            await procs.stop()
        for pid in pids:
            await gone(pid)


async def test_a_persistent_mesh_dead_while_nobody_held_it_fails_on_take_over(
    state: Path,
) -> None:
    """A process of a persistent mesh that died while no controller held it is
    reported, with its exit, to the controller that takes the mesh over."""
    with anyio.fail_after(120):
        pids, _ = await _controller("kill")
        os.kill(pids[1], signal.SIGKILL)
        await gone(pids[1])
        failures: list[amesh.Failure] = []
        reported = anyio.Event()

        def supervise(failure: amesh.Failure) -> bool:
            failures.append(failure)
            reported.set()
            return True

        async with open_runtime(lambda: open_transport("abstract")):
            procs = await amesh.attach_mesh("train", supervise=supervise)
            await reported.wait()
            counters = await procs.actor_mesh("counters")
            with pytest.raises(amesh.SupervisionError, match="SIGKILL"):
                await counters.slice(procs=1).get.call_one()
            assert await counters.slice(procs=0).get.call_one() == 5
            await procs.stop()
            await gone(pids[0])
        assert failures[0].rank == 1 and failures[0].pid == pids[1]
        assert failures[0].signal == signal.SIGKILL


_HOLDER = """
import sys
import anyio
import amesh
from tests.actors import Counter

async def main():
    procs = await amesh.ProcMesh({"procs": 2}, name="held", persistent=True)
    counters = await procs.spawn("counters", Counter)
    await counters.incr.call(5)
    print(" ".join(map(str, procs.pids)), flush=True)
    # each line read: call the actors, print what came back (or the error)
    while await anyio.to_thread.run_sync(sys.stdin.readline):
        try:
            print(list((await counters.incr.call()).values()), flush=True)
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)

amesh.run(main)
"""


class _Holder:
    """A controller that holds persistent mesh ``held`` (actor mesh ``counters`` at 5)
    and calls its actors each time it is asked to (see :data:`_HOLDER`)."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self._lines = anyio.streams.text.TextReceiveStream(proc.stdout)
        self._buffer = ""

    async def line(self) -> str:
        while "\n" not in self._buffer:
            self._buffer += await self._lines.receive()
        line, self._buffer = self._buffer.split("\n", 1)
        return line

    async def calls(self) -> str:
        """What the holder's call of its actors gave."""
        assert self.proc.stdin is not None
        await self.proc.stdin.send(b"call\n")
        return await self.line()


@asynccontextmanager
async def _holding() -> AsyncIterator[tuple[_Holder, list[int]]]:
    """A :class:`_Holder` and its mesh's pids; it returns at the end (its mesh runs on)."""
    env = {**os.environ, "AMESH_HEARTBEAT_PERIOD": str(_PERIOD), "AMESH_HEARTBEAT_TIMEOUT": "1"}
    async with await anyio.open_process(
        [sys.executable, "-c", _HOLDER], cwd=ROOT, env=env, stderr=None
    ) as proc:
        holder = _Holder(proc)
        pids = [int(p) for p in (await holder.line()).split()]
        try:
            yield holder, pids
        finally:
            assert proc.stdin is not None
            await proc.stdin.aclose()
            await proc.wait()


#: longer than the holder's heartbeat timeout (1 s): a holder whose workers' heartbeats
#: went elsewhere would have declared them silent and killed them by then
_OVER_TIMEOUT = 15 * _PERIOD


async def test_a_held_persistent_mesh_is_refused_to_another_controller(state: Path) -> None:
    """A second controller cannot take over a mesh that a live controller holds: the
    error names the holder and the way to take it anyway; the holder keeps driving
    its workers, which are never killed (they were, once the heartbeats went to the
    second controller and the holder declared them silent)."""
    with anyio.fail_after(120):
        async with _holding() as (holder, pids):
            async with open_runtime(lambda: open_transport("abstract")):
                with pytest.raises(RuntimeError) as refused:
                    await amesh.attach_mesh("held")
                # nor does its agent kill the workers for a controller that does not hold
                # them (one they were taken from, say)
                hosts = await local_hosts(start=False)
                assert hosts is not None
                await hosts._agents.kill.call_one(pids[0])
                await anyio.sleep(_OVER_TIMEOUT)
            message = str(refused.value)
            assert (
                f"persistent mesh 'held' is held by the controller pid {holder.proc.pid} on "
                in message
            )
            assert "attach_mesh('held', takeover=True)" in message
            assert await holder.calls() == "[6, 6]"
            assert all(_alive(p) for p in pids)
        # the holder returned: now anyone may take it over
        async with open_runtime(lambda: open_transport("abstract")):
            procs = await amesh.attach_mesh("held")
            counters = await procs.actor_mesh("counters")
            assert list((await counters.incr.call()).values()) == [7, 7]
            await procs.stop()
        for pid in pids:
            await gone(pid)


async def test_takeover_of_a_held_persistent_mesh(state: Path) -> None:
    """``attach_mesh(takeover=True)`` takes a mesh from the controller that holds it:
    that one lets go (its calls raise, saying who took it), and its workers run on
    past its heartbeat timeout under their new owner, with their state."""
    with anyio.fail_after(120):
        async with _holding() as (holder, pids):
            async with open_runtime(lambda: open_transport("abstract")):
                procs = await amesh.attach_mesh("held", takeover=True)
                counters = await procs.actor_mesh("counters")
                assert list((await counters.incr.call()).values()) == [6, 6]
                told = await holder.calls()
                assert told.startswith(
                    f"RuntimeError persistent mesh 'held' was taken over by the controller "
                    f"pid {os.getpid()} on "
                ), told
                await anyio.sleep(_OVER_TIMEOUT)
                assert list((await counters.incr.call()).values()) == [7, 7]
                assert procs.pids == pids
                await procs.stop()
        for pid in pids:
            await gone(pid)


_REMOTE_CONTROLLER = """
import os, signal, sys
import anyio
import amesh
import amesh.testing
from tests.actors import Counter

async def main():
    hosts = await amesh.attach(sys.argv[1].split(","), key_file=sys.argv[2])
    procs = await hosts.spawn_procs({"gpus": 2}, name="far", persistent=True)
    counters = await procs.spawn("counters", Counter)
    await counters.incr.call(4)
    print(" ".join(map(str, procs.pids)), flush=True)
    await anyio.sleep(float(sys.argv[4]))  # holds the mesh (its heartbeats) this long
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)

amesh.run(main)
"""


async def _remote_controller(addrs: str, key: Path, how: str, hold: float = 0.0) -> list[int]:
    """Run a controller that makes persistent mesh ``far`` over the agents at ``addrs``
    (actor mesh ``counters`` at 4), holds it ``hold`` seconds, then is SIGKILLed
    (``kill``) or returns (``return``): the pids of ``far``."""
    out = await anyio.run_process(
        [sys.executable, "-c", _REMOTE_CONTROLLER, addrs, str(key), how, str(hold)],
        cwd=ROOT,
        check=False,
        env={**os.environ, "AMESH_TRANSPORT": "tcp", "AMESH_KEY_FILE": str(key)},
    )
    expected = -signal.SIGKILL if how == "kill" else 0
    assert out.returncode == expected, out.stderr.decode()
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 4
    return pids


async def test_a_persistent_mesh_on_host_agents(tmp_path: Path) -> None:
    """Over two agents: the controller SIGKILLed, its lease ends, the agents keep the
    persistent workers; another controller takes them over and stops them."""
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 2, grace=0.5) as (a1, a2):
            addrs = f"{a1.addr},{a2.addr}"
            pids = await _remote_controller(addrs, key, "kill")
            for agent in (a1, a2):
                line = await agent.logged("is gone")
                assert "stopping its 0 worker(s), keeping 2 of persistent meshes" in line
            assert all(_alive(p) for p in pids)
            listed = await _amesh("list", "--hosts", addrs, "--key-file", str(key))
            assert "far  {hosts: 2, gpus: 2}" in listed, listed
            async with open_runtime(lambda: open_transport("tcp")):
                procs = await amesh.attach_mesh("far", hosts=[a1.addr, a2.addr], key_file=str(key))
                assert procs.sizes == {"hosts": 2, "gpus": 2} and procs.pids == pids
                counters = await procs.actor_mesh("counters")
                assert list((await counters.incr.call()).values()) == [5, 5, 5, 5]
                await procs.stop()
            for pid in pids:
                await gone(pid)


@pytest.mark.parametrize("how", ["kill", "return"])
async def test_a_persistent_mesh_on_host_agents_runs_on_for_periods_without_a_controller(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on this machine's agent: held for several heartbeat periods, its controller
    SIGKILLed or returned, the mesh runs on under its agents for several periods more
    and another controller finds its actors' state."""
    monkeypatch.setenv("AMESH_HEARTBEAT_PERIOD", str(_PERIOD))
    key = shared_key(tmp_path)
    with anyio.fail_after(120):
        async with agents(key, 2, grace=0.5) as (a1, a2):
            pids = await _remote_controller(f"{a1.addr},{a2.addr}", key, how, hold=_HOLD)
            for agent in (a1, a2):
                await agent.logged("keeping 2 of persistent meshes")
            await anyio.sleep(_HOLD)  # nobody holds it: its workers try to reconnect
            assert all(_alive(p) for p in pids), "".join(a1.log + a2.log)
            async with open_runtime(lambda: open_transport("tcp")):
                procs = await amesh.attach_mesh("far", hosts=[a1.addr, a2.addr], key_file=str(key))
                assert procs.pids == pids
                counters = await procs.actor_mesh("counters")
                assert list((await counters.incr.call()).values()) == [5, 5, 5, 5]
                await procs.stop()
            for pid in pids:
                await gone(pid)


async def test_amesh_list_skips_registry_files_that_hold_no_record(state: Path) -> None:
    """A file of the mesh registry that holds no record (a damaged or hand-written
    ``meshes/<pid>.json``) is skipped with a warning naming it: ``amesh list`` still
    lists the others (it failed outright)."""
    meshes = state / "meshes"
    meshes.mkdir(mode=0o700)
    bad = {os.getppid(): '{"pid": "x"}', 1: "[1, 2]"}  # (live pids: files of the dead go)
    for pid, text in bad.items():
        (meshes / f"{pid}.json").write_text(text)
    with anyio.fail_after(60):
        async with (
            open_runtime(lambda: open_transport("abstract")),
            amesh.ProcMesh({"procs": 1}, name="fine") as procs,
        ):
            out = await anyio.run_process([sys.executable, "-m", "amesh", "list"], check=False)
            pid = procs.pids[0]
    assert out.returncode == 0, out.stderr.decode()
    assert f"0: pid {pid}" in out.stdout.decode(), out.stdout.decode()
    for bad_pid in bad:
        path = meshes / f"{bad_pid}.json"
        assert f"skipping {path}, which is not a mesh registry file" in out.stderr.decode()


def _agent_pids(home: Path) -> list[int]:
    """The local agents of state directory ``home`` that run."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"agent" in cmd and str(home / "key").encode() in cmd:
                found.append(int(entry.name))
    return found


async def test_a_damaged_agent_addr_neither_hides_a_mesh_nor_starts_a_second_agent(
    state: Path,
) -> None:
    """With garbage in ``agent.addr``, the running agent is found through its lock:
    its mesh is taken over (it was 'no persistent mesh named'), and the next
    persistent mesh goes to it (a second agent started, orphaning the first). An
    agent that runs but does not answer is said to, not taken for no mesh."""
    with anyio.fail_after(120):
        pids, _ = await _controller("return")
        (agent,) = _agent_pids(state)
        (state / "agent.addr").write_text("garbage\n")
        async with open_runtime(lambda: open_transport("abstract")):
            procs = await amesh.attach_mesh("train")
            counters = await procs.actor_mesh("counters")
            assert list((await counters.get.call()).values()) == [5, 7]
            more = await amesh.ProcMesh({"procs": 1}, name="more", persistent=True)
            assert _agent_pids(state) == [agent]
            os.kill(agent, signal.SIGSTOP)
            try:
                (state / "agent.addr").write_text("garbage\n")
                with pytest.raises(RuntimeError, match=rf"agent \(pid {agent}\) runs but does"):
                    await amesh.attach_mesh("train", takeover=True)
            finally:
                os.kill(agent, signal.SIGCONT)
            await more.stop()
            await procs.stop()
        for pid in pids:
            await gone(pid)


_OWN_MESH_FIRST = """
import sys
import anyio
import amesh
from tests.actors import Counter

async def main():
    # a mesh of its own first: this process's job key is its own, not the local one
    scratch = await amesh.ProcMesh({"procs": 1}, name="scratch")
    own = await scratch.spawn("own", Counter)
    await own.incr.call_one()
    if sys.argv[1] == "make":
        procs = await amesh.ProcMesh({"procs": 2}, name="nb", persistent=True)
        counters = await procs.spawn("counters", Counter)
    else:
        procs = await amesh.attach_mesh("nb")
        counters = await procs.actor_mesh("counters")
    print(list((await counters.incr.call()).values()), await own.incr.call_one(), flush=True)
    listed = await anyio.run_process([sys.executable, "-m", "amesh", "list"])
    print(listed.stdout.decode(), flush=True)
    if sys.argv[1] == "stop":
        await procs.stop()

amesh.run(main)
"""


async def test_a_process_that_ran_a_mesh_of_its_own_makes_and_takes_persistent_meshes(
    state: Path,
) -> None:
    """A controller (a notebook session, say) that started a mesh of its own, under
    its own job key, then makes a persistent mesh (whose agent and workers hold the
    key of this machine's persistent meshes) drives both; so does one that takes it
    over; ``amesh list`` reads each mesh's workers with its key. It raised 'this
    process already uses another job key'."""
    with anyio.fail_after(120):
        for how, counts in (("make", "[1, 1] 2"), ("stop", "[2, 2] 2")):
            out = await anyio.run_process(
                [sys.executable, "-c", _OWN_MESH_FIRST, how], cwd=ROOT, check=False
            )
            assert out.returncode == 0, out.stderr.decode()
            first, listed = out.stdout.decode().split("\n", 1)
            assert first == counts
            nb = listed[listed.index("nb  {procs: 2}") : listed.index("persistent meshes:")]
            assert nb.count("now: idle") == 2, listed  # its workers answered `amesh list`
        assert "no persistent meshes" in await _amesh("list")


_SESSION_OWN_MESH_FIRST = """
import amesh
from tests.actors import Counter

scratch = amesh.ProcMesh({"procs": 1}).get()
own = scratch.spawn("own", Counter).get()
own.incr.call_one().get()
procs = amesh.ProcMesh({"procs": 2}, name="nb", persistent=True).get()
counters = procs.spawn("counters", Counter).get()
print(list(counters.incr.call().get().values()), own.incr.call_one().get(), flush=True)
procs.stop().get()
"""


async def test_a_session_that_ran_a_mesh_of_its_own_makes_a_persistent_mesh(
    state: Path,
) -> None:
    """The same in a session (synchronous code, as a notebook's cells run it)."""
    with anyio.fail_after(60):
        out = await anyio.run_process(
            [sys.executable, "-c", _SESSION_OWN_MESH_FIRST], cwd=ROOT, check=False
        )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode() == "[1, 1] 2\n"


def test_bad_names_and_hosts_are_refused() -> None:
    with pytest.raises(ValueError, match="needs a name"):
        amesh.ProcMesh({"procs": 1}, persistent=True)
    with pytest.raises(ValueError, match="a mesh name has"):
        amesh.ProcMesh({"procs": 1}, name="no spaces", persistent=True)
    with pytest.raises(ValueError, match="runs on host agents"):
        amesh.ProcMesh({"procs": 1}, name="x", persistent=True, host=amesh.testing.InProcessHost())
    # this machine is a fine place: its local agent holds it
    assert amesh.this_host().spawn_procs(name="x", persistent=True).persistent
