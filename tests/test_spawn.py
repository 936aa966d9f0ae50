"""Where workers come from: a zygote forks them (or, with AMESH_ZYGOTE=0, exec)."""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

import amesh
from amesh import Failure, ProcMesh, SupervisionError
from amesh._limits import TASKS_PER_PROCESS
from amesh.testing._leaks import child_pids

from .actors import Counter, Mortal
from .test_lifecycle import python_output, wait_pid_gone

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def zygote_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the zygote, whatever AMESH_ZYGOTE the suite runs with."""
    monkeypatch.delenv("AMESH_ZYGOTE", raising=False)


def _facts(_: object) -> dict[str, Any]:
    """What a worker knows about where it came from (run in the worker)."""
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "path": list(sys.path),
        "env": dict(os.environ),
        "optimize": sys.flags.optimize,
    }


async def facts(procs: ProcMesh) -> list[dict[str, Any]]:
    c = await procs.spawn("facts", Counter)
    return (await c.apply.call(_facts, None)).values()


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def cmdline_of(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


async def test_workers_are_forked_by_one_single_threaded_zygote() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}) as procs:
            seen = await facts(procs)
            zygote = seen[0]["ppid"]
            assert [s["ppid"] for s in seen] == [zygote] * 3
            assert [s["pid"] for s in seen] == procs.pids
            # the zygote is this process's child; the workers are its children
            assert zygote != os.getpid() and zygote in child_pids()
            assert child_pids(zygote) >= set(procs.pids)
            assert "amesh._hosts._zygote_main" in cmdline_of(zygote)
            assert threads_of(zygote) == 1
            # a terminal's Ctrl-C reaches the zygote too; it is the controller's to act on
            os.kill(zygote, signal.SIGINT)
            async with ProcMesh(per_host={"procs": 2}) as more:  # the same runtime
                assert [s["ppid"] for s in await facts(more)] == [zygote] * 2
            assert threads_of(zygote) == 1
            pids = procs.pids
        assert wait_pid_gone(zygote, 0), "the zygote outlived its runtime"
        assert all(wait_pid_gone(pid, 0) for pid in pids)
        assert zygote not in child_pids()


def _threads(_: object) -> tuple[list[str], int]:
    """A worker's Python threads by name, and all its threads (run in the worker)."""
    return sorted(t.name for t in threading.enumerate()), len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("zygote", ["1", "0"])
async def test_a_worker_runs_the_threads_its_mesh_is_counted_for(
    monkeypatch: pytest.MonkeyPatch, zygote: str
) -> None:
    """Before a mesh starts, its threads (TASKS_PER_PROCESS a worker) are checked
    against the user's process limit and a control group's cap: a worker, forked or
    exec'd, runs that many (its loop's, the output reader, the extension's heartbeat
    writer and parent watch) and no Python thread for its heartbeats."""
    monkeypatch.setenv("AMESH_ZYGOTE", zygote)
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            c = await procs.spawn("threads", Counter)
            seen = (await c.apply.call(_threads, None)).values()
    assert seen == [(["MainThread", "amesh-output"], TASKS_PER_PROCESS)] * 2


class Shell(amesh.Actor):
    @amesh.endpoint
    async def run(self, argv: list[str]) -> dict[str, Any]:
        import sniffio

        done = await anyio.run_process(argv)
        loop = ""
        if sniffio.current_async_library() == "asyncio":
            import asyncio

            loop = type(asyncio.get_running_loop()).__module__
        return {
            "returncode": done.returncode,
            "stdout": done.stdout,
            "loop": loop,
            # (a forked worker's __main__ is the zygote's: python -m amesh._hosts._zygote_main)
            "rehearsed": getattr(sys.modules["__main__"], "_rehearsed", None),
            "relocated": getattr(sys.modules["__main__"], "_relocated", None),
            "ppid": os.getppid(),
        }


async def test_the_zygotes_rehearsal_leaves_its_workers_whole(
    anyio_backend: tuple[str, dict[str, object]],
) -> None:
    """The zygote plays a one-process mesh before it forks (_zygote_main._rehearse), and
    what its workers inherit still works: they run on uvloop and start subprocesses
    through it (the rehearsal runs on uvloop too, which leaves libuv a pipe that libuv
    makes anew in each child: a child that closed it with the zygote's descriptors
    aborted at its first subprocess), and the zygote keeps one thread. The code the
    rehearsal ran was copied together (_relocate): the workers run the copies."""
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            shell = await procs.spawn("shell", Shell)
            seen = (await shell.run.call([sys.executable, "-c", "print('hi')"])).values()
            zygote = seen[0]["ppid"]
            assert "amesh._hosts._zygote_main" in cmdline_of(zygote)
            assert threads_of(zygote) == 1
    for s in seen:
        assert (s["returncode"], s["stdout"], s["rehearsed"]) == (0, b"hi\n", True), s
        assert s["relocated"] > 100, s
        assert s["ppid"] == zygote
        if anyio_backend[0] == "asyncio":
            assert s["loop"].startswith("uvloop"), s


def _descriptors(_: object) -> dict[int, str]:
    """What each of a worker's descriptors is (run in the worker)."""
    seen = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            seen[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own, closed meanwhile
            pass
    return seen


async def test_a_forked_worker_holds_none_of_the_zygotes_descriptors() -> None:
    """Its control socket, a pidfd of the controller and one for each worker it forked
    before, and the other requests' stdout and stderr stay in the zygote; only the
    lifeline (stdin) and the worker's own stdout and stderr come along. (24 workers
    first: their pidfds take numbers above the control socket's, and the next requests'
    higher still.)"""
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 24}) as first:
            zygote = (await facts(first))[0]["ppid"]
            async with ProcMesh(per_host={"procs": 3}) as second:
                c = await second.spawn("fds", Counter)
                workers = (await c.apply.call(_descriptors, None)).values()
                theirs = {}
                for fd in os.listdir(f"/proc/{zygote}/fd"):
                    theirs[int(fd)] = os.readlink(f"/proc/{zygote}/fd/{fd}")
    mine = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)}
    assert list(theirs.values()).count("anon_inode:[pidfd]") == 27 + 1  # (+ the controller)
    sockets = {t for fd, t in theirs.items() if fd > 2 and t.startswith("socket:")}
    assert sockets, "the zygote's control socket"
    # the pipe libuv keeps once the rehearsal's loop ran: each child has one of its own
    pipes = {t for fd, t in theirs.items() if fd > 2 and t.startswith("pipe:")}
    assert len(pipes) == 1, theirs
    for fds in workers:
        assert fds[0] == theirs[0]  # the lifeline
        assert "anon_inode:[pidfd]" not in fds.values()
        assert not sockets & set(fds.values())
        assert not pipes & set(fds.values())
        # the controller's stdout and stderr, as the capture keeps them: its own pair only
        # (a request's pair for each worker forked in the same batch, if they leaked)
        assert sorted(t for t in fds.values() if t in mine.values()) == sorted(mine.values())


async def test_environment_cwd_and_path_are_the_controllers_at_each_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMESH_TEST_EARLY", "early")
    monkeypatch.setenv("AMESH_TEST_GONE", "gone")
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as first:
            [before] = await facts(first)
            assert before["env"]["AMESH_TEST_GONE"] == "gone"
            # changed after the zygote started: the next workers still see it
            monkeypatch.setenv("AMESH_TEST_LATE", "late")
            monkeypatch.delenv("AMESH_TEST_GONE")
            monkeypatch.chdir(tmp_path)
            monkeypatch.syspath_prepend(str(tmp_path))
            env = {"CUDA_VISIBLE_DEVICES": "3", "AMESH_TEST_EARLY": "mine"}
            async with ProcMesh(per_host={"procs": 2}, env=env) as second:
                after = await facts(second)
        for worker in after:
            assert worker["ppid"] == before["ppid"]  # forked by the same zygote
            assert worker["env"]["CUDA_VISIBLE_DEVICES"] == "3"
            assert worker["env"]["AMESH_TEST_EARLY"] == "mine"
            assert worker["env"]["AMESH_TEST_LATE"] == "late"
            assert "AMESH_TEST_GONE" not in worker["env"]
            assert "AMESH_BOOTSTRAP" not in worker["env"]
            assert not any(k.startswith("AMESH_ZYGOTE") for k in worker["env"])
            assert worker["cwd"] == str(tmp_path)
            assert worker["path"] == sys.path


async def test_a_worker_with_other_interpreter_settings_is_execd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PYTHON* variables take effect at interpreter start, which a fork skips."""
    monkeypatch.delenv("PYTHONOPTIMIZE", raising=False)
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as forked:
            [zygote_child] = await facts(forked)
            async with ProcMesh(per_host={"procs": 1}, env={"PYTHONOPTIMIZE": "1"}) as execd:
                [fresh] = await facts(execd)
        assert zygote_child["ppid"] != os.getpid()
        assert fresh["ppid"] == os.getpid()
        assert (zygote_child["optimize"], fresh["optimize"]) == (0, 1)


@pytest.mark.parametrize(
    ("how", "exit_code", "signo"),
    [
        ("sigkill", None, signal.SIGKILL),
        ("sigterm", None, signal.SIGTERM),
        ("exit", 3, None),
        ("segv", None, signal.SIGSEGV),
    ],
)
async def test_exit_codes_and_signals_are_reported(
    how: str, exit_code: int | None, signo: int | None
) -> None:
    failures: list[Failure] = []
    seen = anyio.Event()

    def supervise(failure: Failure) -> bool:
        failures.append(failure)
        seen.set()
        return True

    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}, supervise=supervise) as procs:
            m = await procs.spawn("m", Mortal)
            victim = procs.pids[1]
            handle = procs._live().procs[1]
            if how == "sigkill":
                os.kill(victim, signal.SIGKILL)
            elif how == "sigterm":
                handle.process.terminate()
            else:
                with pytest.raises(SupervisionError):
                    await m.slice(procs=1).die.call_one(how)
            await seen.wait()
            assert handle.returncode == (exit_code if exit_code is not None else -(signo or 0))
            handle.process.kill()  # after the exit: reaches nothing, raises nothing
            assert (await m.slice(procs=0).bump.call_one())[1] == 1
        [failure] = failures
        assert (failure.rank, failure.pid) == (1, victim)
        assert (failure.exit_code, failure.signal) == (exit_code, signo)
        if signo is not None:
            assert f"was killed by {signal.Signals(signo).name}" in failure.cause
        else:
            assert f"exited with code {exit_code}" in failure.cause


async def test_a_dead_zygote_takes_its_workers_and_later_workers_are_execd() -> None:
    failures: list[Failure] = []
    all_seen = anyio.Event()

    def supervise(failure: Failure) -> bool:
        failures.append(failure)
        if len(failures) == 2:
            all_seen.set()
        return True

    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}, supervise=supervise) as procs:
            seen = await facts(procs)
            zygote = seen[0]["ppid"]
            assert zygote != os.getpid() and zygote in child_pids()
            os.kill(zygote, signal.SIGKILL)
            await all_seen.wait()
            assert sorted(f.rank for f in failures) == [0, 1]
            assert all("was killed by SIGKILL" in f.cause for f in failures)
            assert all(wait_pid_gone(s["pid"], 10) for s in seen)
            assert zygote not in child_pids()  # reaped
            async with ProcMesh(per_host={"procs": 1}) as later:
                [fresh] = await facts(later)
                assert fresh["ppid"] == os.getpid()


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
async def test_cancelled_while_starting_leaves_nothing(delay: float) -> None:
    with anyio.fail_after(60):
        with anyio.move_on_after(delay):
            async with ProcMesh(per_host={"procs": 4}) as procs:
                await procs.spawn("c", Counter)
    # the autouse leak check sees no zygote and no worker here


async def test_exec_path_without_the_zygote(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMESH_ZYGOTE", "0")
    failures: list[Failure] = []
    seen = anyio.Event()

    def supervise(failure: Failure) -> bool:
        failures.append(failure)
        seen.set()
        return True

    with anyio.fail_after(60):
        async with ProcMesh(
            per_host={"procs": 2}, env={"AMESH_TEST_VAR": "x"}, supervise=supervise
        ) as procs:
            seen_facts = await facts(procs)
            assert [s["ppid"] for s in seen_facts] == [os.getpid()] * 2
            assert [s["env"]["AMESH_TEST_VAR"] for s in seen_facts] == ["x", "x"]
            assert child_pids() >= set(procs.pids)
            os.kill(procs.pids[0], signal.SIGKILL)
            await seen.wait()
        assert "was killed by SIGKILL" in failures[0].cause
        assert failures[0].signal == signal.SIGKILL


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_zygote_lives_as_long_as_amesh_run(backend: str) -> None:
    """A mesh owned by the controller (``await ProcMesh``) stops before the zygote."""

    async def main() -> tuple[int, list[int]]:
        procs = await ProcMesh(per_host={"procs": 2})
        c = await procs.spawn("c", Counter)
        assert (await c.incr.call()).values() == [1, 1]
        seen = await facts(procs)
        return seen[0]["ppid"], procs.pids

    zygote, pids = amesh.run(main, backend=backend)
    assert zygote != os.getpid()
    assert wait_pid_gone(zygote, 0)
    assert all(wait_pid_gone(pid, 0) for pid in pids)


_CONTROLLER = """
import os, signal, sys, anyio, amesh
from amesh import Actor, ProcMesh, endpoint

class Idle(Actor):
    @endpoint
    def ppid(self) -> int:
        return os.getppid()

async def main() -> None:
    async with ProcMesh(per_host={"procs": 3}) as procs:
        idle = await procs.spawn("idle", Idle)
        zygote = (await idle.ppid.call()).values()[0]
        assert zygote != os.getpid(), "the workers were not forked by a zygote"
        if sys.argv[2] == "stop-zygote":
            # the workers must go on their own: through the lifeline pipe
            os.kill(zygote, signal.SIGSTOP)
        print(zygote, " ".join(map(str, procs.pids)), flush=True)
        await anyio.sleep_forever()

amesh.run(main, backend=sys.argv[1])
"""


@pytest.mark.parametrize("zygote_state", ["running", "stop-zygote"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_controller_sigkilled_takes_zygote_and_workers(
    tmp_path: Path, backend: str, zygote_state: str
) -> None:
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(_CONTROLLER))
    ctl = subprocess.Popen(
        [sys.executable, str(script), backend, zygote_state],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert ctl.stdout is not None
        assert select.select([ctl.stdout], [], [], 60)[0], "the controller did not start"
        zygote, *pids = (int(p) for p in ctl.stdout.readline().split())
        assert len(pids) == 3
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=30)
        for pid in pids:
            assert wait_pid_gone(pid, 10), f"worker {pid} outlived its controller"
        assert wait_pid_gone(zygote, 10), "the zygote outlived its controller"
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        if ctl.stdout is not None:
            ctl.stdout.close()


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "exec"])
async def test_parent_death_signal_only_where_the_forking_thread_lives_on(
    anyio_backend: tuple[str, dict[str, object]], zygote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's parent-death signal follows the thread that forked, not the process.
    The zygote forks from its only thread, so its workers always ask for it. A worker
    exec'd under trio comes from a cached thread that exits after 10 s idle: it must rely
    on its stdin pipe alone, or it would die 10 s after start."""
    if not zygote:
        monkeypatch.setenv("AMESH_ZYGOTE", "0")
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            stats = (await procs.statistics()).values()[0]
            trio_exec = anyio_backend[0] == "trio" and not zygote
            assert stats["parent_death_signal"] == (0 if trio_exec else signal.SIGKILL)


async def test_each_worker_has_its_meshs_environment_whichever_came_before() -> None:
    """The zygote holds one mesh's environment and each request says how its worker's
    differs: a mesh that differs in many variables sends its whole environment."""
    many = {f"AMESH_TEST_MANY_{i}": str(i) for i in range(40)}
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as first:
            plain = await facts(first)
            async with (
                ProcMesh(per_host={"procs": 3}, env=many) as second,
                ProcMesh(per_host={"procs": 2}, env={"AMESH_TEST_FEW": "x"}) as third,
            ):
                mixed = await facts(second), await facts(third)
            async with ProcMesh(per_host={"procs": 2}) as fourth:
                again = await facts(fourth)
    zygote = plain[0]["ppid"]
    for worker in [*plain, *mixed[0], *mixed[1], *again]:
        assert worker["ppid"] == zygote
    for worker in mixed[0]:
        assert {k: worker["env"].get(k) for k in many} == many
        assert "AMESH_TEST_FEW" not in worker["env"]
    for worker in mixed[1]:
        assert worker["env"]["AMESH_TEST_FEW"] == "x"
        assert not any(k.startswith("AMESH_TEST_MANY") for k in worker["env"])
    for worker in [*plain, *again]:
        assert not any(k.startswith(("AMESH_TEST_MANY", "AMESH_TEST_FEW")) for k in worker["env"])
        # (what the mesh asks of a worker is in its spec, not in its environment)
        internal = {"AMESH_OUTPUT_LABEL", "AMESH_OUTPUT_RANK", "AMESH_WORKER_BACKEND"}
        assert not internal & worker["env"].keys()


async def test_a_worker_takes_settings_that_differ_from_the_zygotes() -> None:
    """A setting given to one mesh only reaches its workers, parsed there."""
    env = {"AMESH_SHM_THRESHOLD": "12345"}
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as first:
            c = await first.spawn("c", Counter)
            default = (await c.apply.call(_shm_threshold, None)).values()
            async with ProcMesh(per_host={"procs": 2}, env=env) as second:
                d = await second.spawn("d", Counter)
                given = (await d.apply.call(_shm_threshold, None)).values()
            async with ProcMesh(per_host={"procs": 1}) as third:
                e = await third.spawn("e", Counter)
                again = (await e.apply.call(_shm_threshold, None)).values()
    assert given == [12345, 12345]
    assert default == again != given


def _shm_threshold(_: object) -> int:
    from amesh._config import settings

    return settings().shm_threshold


#: What sys.getrefcount says of an immortal object (CPython 3.12 and 3.13, 64-bit).
IMMORTAL = 2**32 - 1


def _refcounts(_: object) -> dict[str, int]:
    """Reference counts, in a worker, of what its zygote loaded and of what it makes."""
    from amesh import _worker

    return {
        "function": sys.getrefcount(_worker.main),
        "code": sys.getrefcount(_worker.main.__code__),
        "module": sys.getrefcount(_worker),
        "made here": sys.getrefcount(object()),
        "ppid": os.getppid(),
    }


@pytest.mark.parametrize("immortal", ["1", "0"])
async def test_the_zygote_makes_what_it_loaded_immortal_where_python_can(
    immortal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPython 3.12 and 3.13 (AMESH_ZYGOTE_IMMORTAL on) a worker's references to the
    zygote's objects write no reference counts (so no copies of their pages); on 3.11,
    or with it off, they stay as they were. Either way the workers are the zygote's:
    a zygote that failed to start would leave them exec'd, which this would hide."""
    from amesh._native import _ext

    monkeypatch.setenv("AMESH_ZYGOTE_IMMORTAL", immortal)
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            c = await procs.spawn("c", Counter)
            seen = (await c.apply.call(_refcounts, None)).values()
            zygote = _zygote_of_this_runtime().pid
            assert "amesh._hosts._zygote_main" in cmdline_of(zygote)
            assert [s["ppid"] for s in seen] == [zygote] * 2
    expect = _ext.CAN_IMMORTALIZE and immortal == "1"
    assert _ext.CAN_IMMORTALIZE == ((3, 12) <= sys.version_info[:2] <= (3, 13))
    for s in seen:
        loaded = [s["function"], s["code"], s["module"]]
        assert (loaded == [IMMORTAL] * 3) == expect, s
        assert s["made here"] < 10  # what a worker makes stays mortal
        if not expect:
            assert all(n < 1000 for n in loaded), s


def test_immortalize_makes_objects_and_what_only_they_hold_immortal() -> None:
    """_ext.immortalize: the listed objects, what they refer to that the collector does
    not track (a code object, its constants), never the list; 0 and nothing where the
    interpreter cannot (3.11). And each listed type gets its version tag."""
    import _testcapi  # type: ignore[import-not-found]

    from amesh._native import _ext

    class Thing:
        pass

    def function(x: int) -> tuple[int, str, float]:
        return (x, "a constant of this test's own", 2.5)

    class Untouched:  # (no attribute of it looked up yet: no version tag)
        pass

    thing, table = Thing(), {"key": [1, 2]}
    objects: list[object] = [thing, function, table, Untouched]
    assert _testcapi.type_get_version(Untouched) == 0
    before = [sys.getrefcount(o) for o in (thing, function, table, function.__code__)]
    made = _ext.immortalize(objects)
    after = [sys.getrefcount(o) for o in (thing, function, table, function.__code__)]
    consts = function.__code__.co_consts
    if not _ext.CAN_IMMORTALIZE:
        assert made == 0 and after == before
        assert _testcapi.type_get_version(Untouched) == 0
    else:
        assert made >= 6
        assert _testcapi.type_get_version(Untouched) != 0  # a child need not write one
        assert after == [IMMORTAL] * 4
        assert sys.getrefcount(consts) == IMMORTAL
        assert [sys.getrefcount(c) for c in consts if isinstance(c, (str, float))] == [
            IMMORTAL,
            IMMORTAL,
        ]
        assert sys.getrefcount(Thing) == IMMORTAL  # its type, which it refers to
        assert sys.getrefcount(table["key"]) == IMMORTAL  # (a tracked list: made, as a referent)
        assert sys.getrefcount(objects) < 10  # the list is left alone
    with pytest.raises(TypeError, match="takes a list"):
        _ext.immortalize((thing,))  # type: ignore[arg-type]


def test_the_zygote_takes_the_free_blocks_of_its_partly_used_pools() -> None:
    """_zygote_heap._fill_pools (before each fork's settling): nearly every free block of
    the allocator's partly used pools is taken, so a child allocates on pages of its
    own; the two smallest classes and a bytes-sized one included."""
    from amesh._hosts import _zygote_heap

    spare = [bytes(15) for _ in range(3000)] + [object() for _ in range(3000)]
    del spare[::2]  # free blocks in partly used pools, of 16 and 48 bytes
    before = _zygote_heap.free_blocks()
    assert len(before) >= 16 and before[16] > 100 and before[48] > 100, before
    try:
        _zygote_heap._fill_pools()
        after = _zygote_heap.free_blocks()
    finally:
        _zygote_heap._filler.clear()
    assert after[16] < 20 and after[48] < before[48] / 4, (before, after)
    assert sum(after.values()) < sum(before.values()) / 4, (before, after)


_RELOCATE = """
import gc, json
from amesh._hosts import _zygote_heap

def outer(x):
    def inner(y):
        return x + y
    return inner

def plain(a, b=2, *, c=1):
    return a * b + c

def left_alone():
    return "same"

[inner_code] = [c for c in outer.__code__.co_consts if type(c) is type(plain.__code__)]
before = outer.__code__, plain.__code__, inner_code, left_alone.__code__
made_before = outer(1)
ran = {id(c): c for c in (plain.__code__, outer.__code__, inner_code)}
moved = _zygote_heap._relocate(ran)
made_after = outer(1)
print(json.dumps({
    "moved": moved,
    "copied": [f.__code__ is not old for f, old in zip((outer, plain), before)],
    "equal": [outer.__code__ == before[0], plain.__code__ == before[1]],
    "inner": [
        made_after.__code__ is not inner_code,
        made_after.__code__ in outer.__code__.co_consts,
    ],
    "results": [made_before(2), made_after(2), plain(3), plain(3, 4, c=0), left_alone()],
    "left_alone": left_alone.__code__ is before[3],
}))
"""


def test_the_zygote_copies_the_code_it_rehearsed_together() -> None:
    """_zygote_heap._relocate: each function whose code object ran (an outer one, the
    closure it makes, a plain one) runs an equal copy afterwards, and a closure made
    afterwards runs the copy of its code (the outer's constants are copied too);
    other functions are left alone, and every one answers as before."""
    import json

    assert json.loads(python_output(_RELOCATE)) == {
        "moved": 3,  # outer, plain, and the closure made before
        "copied": [True, True],
        "equal": [True, True],
        "inner": [True, True],
        "results": [3, 3, 7, 12, "same"],
        "left_alone": True,
    }


_FILL_HEAP = """
from amesh._hosts import _zygote_heap

libc = _zygote_heap._libc()
spare = [libc.malloc(s) for s in (100, 200, 700, 3000, 20000) for _ in range(60)]
for address in spare[::2]:  # free chunks between used ones, in each of the C bins
    libc.free(address)
before = libc.mallinfo2()
taken = _zygote_heap._fill_heap()
after = libc.mallinfo2()
print(taken, before.ordblks, before.smblks, before.fordblks - before.keepcost,
      after.ordblks, after.smblks, after.fordblks - after.keepcost)
"""


def test_the_zygote_takes_the_free_chunks_of_its_heap() -> None:
    """_zygote_heap._fill_heap (in each settling): every free chunk of glibc's heap is
    taken, small and large, so that a child's malloc carves fresh pages from the top
    instead of writing shared ones: afterwards the top is the heap's only free chunk."""
    out = python_output(_FILL_HEAP)
    taken, chunks, _, free, chunks_after, fast_after, free_after = map(int, out.split())
    assert taken >= 150 and chunks >= 100 and free >= 150 * 100, out
    assert (chunks_after, fast_after, free_after) == (1, 0, 0), out


_FILL_HEAP_LIED_TO = """
from amesh._hosts import _zygote_heap

real = _zygote_heap._libc()

class Lying:
    def __getattr__(self, name):
        return getattr(real, name)

    def sbrk(self, increment):
        return 1 << 62  # the top is never where it says: every answer looks like a hole

_zygote_heap._libc = Lying
before = real.mallinfo2()
_zygote_heap._fill_heap()
after = real.mallinfo2()
print(after.uordblks + after.hblkhd - before.uordblks - before.hblkhd,
      before.fordblks - before.keepcost)
"""


def test_the_zygotes_heap_filling_takes_no_more_than_was_free() -> None:
    """Should glibc's top chunk not be where ``sbrk`` says, _fill_heap would never see
    an answer from the top: it still stops once it took what was free, and 1 MiB."""
    grown, free = map(int, python_output(_FILL_HEAP_LIED_TO).split())
    assert 0 < grown <= free + (2 << 20), (grown, free)


def _send_raw(zygote: Any, change: dict[str, str], base: dict[str, str] | None) -> Any:
    """Send the zygote a request as the controller would not; its pending request."""
    import array
    import socket

    import msgspec

    from amesh._bootstrap import Bootstrap, WorkerSpec
    from amesh._hosts import _zygote

    rid = next(zygote._ids)
    req = zygote._requests[rid] = _zygote._Request()
    boot = Bootstrap(
        spec=WorkerSpec(),
        parent="unused",
        parent_pid=0,
        token="",
        sys_path=[],
        pdeathsig=False,
        key=b"",
    )
    spawn = _zygote.Spawn(rid, change, [], base, os.getcwd(), boot)
    zygote._sock.sendmsg(
        [msgspec.msgpack.encode(spawn)],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [1, 2]))],
    )
    return req


def _zygote_of_this_runtime() -> Any:
    from amesh._hosts import _local
    from amesh._runtime import current_runtime

    zygote = _local._ZYGOTES[current_runtime()][("",)].zygote  # (this interpreter's)
    assert zygote is not None and zygote._base is not None
    return zygote


async def test_the_zygote_refuses_a_change_without_its_base_and_recovers() -> None:
    """A request the zygote cannot read may have carried the environment that later
    ones change: it refuses those until the controller sends a whole one again."""
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as first:
            [before] = await facts(first)
            zygote = _zygote_of_this_runtime()
            zygote._sock.sendmsg([b"\xc1"])  # a byte msgpack never uses
            req = _send_raw(zygote, {"AMESH_TEST_X": "1"}, None)
            await req.done.wait()
            assert req.process is None
            assert req.error == "the request's environment is out of step"
            assert zygote._base is None  # the next request sends a whole one
            async with ProcMesh(per_host={"procs": 2}, env={"AMESH_TEST_X": "2"}) as second:
                after = await facts(second)
        for worker in after:
            assert worker["ppid"] == before["ppid"]  # forked, not exec'd
            assert worker["env"]["AMESH_TEST_X"] == "2"


async def test_an_environment_putenv_refuses_fails_its_request_not_the_zygote() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as first:
            c = await first.spawn("c", Counter)
            [before] = (await c.apply.call(_facts, None)).values()
            zygote = _zygote_of_this_runtime()
            req = _send_raw(zygote, {}, {**os.environ, "A=B": "1"})
            await req.done.wait()
            assert req.process is None
            assert req.error.startswith("its environment: ")
            # the zygote lives, and so do its workers
            assert (await c.apply.call(_facts, None)).values() == [before]
            async with ProcMesh(per_host={"procs": 2}) as second:
                after = await facts(second)
        assert [w["ppid"] for w in after] == [before["ppid"]] * 2


@pytest.mark.parametrize(
    "env",
    [{"A=B": "1"}, {"": "1"}, {"A\0": "1"}, {"A": "x\0y"}, {"A": 1}, {1: "x"}],
    ids=["equals", "empty", "nul-name", "nul-value", "int-value", "int-name"],
)
def test_a_variable_that_cannot_be_set_is_refused_before_anything_starts(env: Any) -> None:
    with pytest.raises(ValueError, match=r"^env: "):
        ProcMesh(per_host={"procs": 1}, env=env)


_FDS = """
import os, resource, sys, amesh
from amesh import Actor, ProcMesh, endpoint

class Where(Actor):
    @endpoint
    def ppid(self) -> int:
        return os.getppid()

async def main() -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    async with ProcMesh(per_host={"procs": 1}) as small:
        w = await small.spawn("w", Where)
        [zygote] = (await w.ppid.call()).values()
        # a small mesh leaves the limit alone
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft
        try:
            async with ProcMesh(per_host={"procs": 110}) as big:
                w = await big.spawn("w", Where)
                ppids = (await w.ppid.call()).values()
        except OSError as exc:
            print("refused:", exc, flush=True)
            return
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print("forked:", sorted(set(ppids)) == [zygote], "soft:", soft, flush=True)

resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
amesh.run(main)
"""


@pytest.mark.parametrize("hard", [4096, 110])
def test_a_mesh_needing_more_open_files_raises_the_limit_or_says_so(
    tmp_path: Path, hard: int
) -> None:
    """A soft limit of 110 open files holds a mesh of 1, not one of 110 (~4 descriptors
    each in the controller, a pidfd each in the zygote, which started with the small
    one): the controller and the zygote raise theirs up to the hard limit, and where
    that is too low the mesh is refused before anything starts, with an error that
    says what to raise."""
    script = tmp_path / "fds.py"
    script.write_text(textwrap.dedent(_FDS))
    out = subprocess.run(
        [sys.executable, str(script), "110", str(hard)],
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    if hard == 4096:
        assert out.stdout == "forked: True soft: 4096\n"
    else:
        assert out.stdout.startswith("refused: [Errno 24] starting these processes needs ~")
        assert "it may open 110: raise its hard limit" in out.stdout


_NPROC = """
import os, resource, sys, amesh
from amesh import Actor, ProcMesh, endpoint

def soft() -> int:
    return resource.getrlimit(resource.RLIMIT_NPROC)[0]

class Limit(Actor):
    @endpoint
    def soft(self) -> int:
        return soft()

async def main() -> None:
    async with ProcMesh(per_host={"procs": 1}) as small:
        w = await small.spawn("w", Limit)
        # a small mesh leaves the limit alone (the zygote, started now, raises its own)
        print("small:", soft(), (await w.soft.call()).values(), flush=True)
        try:
            async with ProcMesh(per_host={"procs": 16}) as big:
                w = await big.spawn("w", Limit)
                print("big:", soft(), sorted(set((await w.soft.call()).values())), flush=True)
        except OSError as exc:
            print("refused:", exc, flush=True)

resource.setrlimit(resource.RLIMIT_NPROC, (int(sys.argv[1]), int(sys.argv[2])))
amesh.run(main)
"""

#: run "$@" as nobody, in a mount namespace of its own where /root (mode 700 here)
#: is an empty tmpfs and the interpreter's tree under it is mounted back
_AS_NOBODY = """
set -e
mount --bind "$PYROOT" "$SPARE"
mount -t tmpfs -o mode=755 tmpfs /root
mkdir -p "$PYROOT"
mount --bind "$SPARE" "$PYROOT"
exec setpriv --reuid=65534 --regid=65534 --clear-groups "$@"
"""


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another uid needs root")
@pytest.mark.parametrize(("hard", "zygote"), [(4096, "1"), (4096, "0"), (60, "1")])
def test_a_mesh_needing_more_threads_than_the_users_soft_limit_raises_it_or_says_so(
    tmp_path: Path, hard: int, zygote: str
) -> None:
    """The kernel counts a user's threads against RLIMIT_NPROC (never root's, so the
    controller runs as nobody here). A mesh of 1 fits a soft limit of 60; one of 16
    (~64 threads) does not: the controller raises its limit to the hard one, and so
    did the zygote when the first mesh started it; their workers inherit it (forked, or
    exec'd with AMESH_ZYGOTE=0). Where the hard limit is too low the mesh is refused
    before anything starts, with what to raise."""
    prefix = Path(sys.base_prefix).resolve()
    spare = tmp_path / "spare"
    spare.mkdir()
    env = {**os.environ, "PYROOT": str(prefix.parent), "SPARE": str(spare)}
    env["AMESH_ZYGOTE"] = zygote
    isolated = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _AS_NOBODY, "sh"]
    out = subprocess.run(
        [*isolated, sys.executable, "-c", _NPROC, "60", str(hard)],
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
        cwd="/",
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    small, big = out.stdout.splitlines()
    # a forked worker has the zygote's limit, raised to the hard one; an exec'd one the
    # controller's, still 60
    assert small == f"small: 60 [{hard if zygote == '1' else 60}]", out.stderr[-3000:]
    if hard == 4096:
        assert big == "big: 4096 [4096]", out.stderr[-3000:]
    else:
        assert big.startswith("refused: [Errno 11] starting these processes needs ~64 more")
        assert "may run 60: raise the hard process limit (`ulimit -Hu`" in big
        # nobody's threads: the controller's, the zygote and the first mesh's worker (4)
        running = re.search(r"who runs (\d+) already", big)
        assert running is not None and int(running.group(1)) >= 6, big


_PIDS = """
import amesh
from amesh import Actor, ProcMesh, endpoint
from amesh._limits import pids_cap

class Cap(Actor):
    @endpoint
    def cap(self) -> tuple[str, int] | None:
        cap = pids_cap()
        return None if cap is None else (cap.path, cap.limit)

async def main() -> None:
    async with ProcMesh(per_host={"procs": 2}) as small:
        w = await small.spawn("w", Cap)
        print("small:", sorted(set((await w.cap.call()).values())), flush=True)
        try:
            async with ProcMesh(per_host={"procs": 16}) as big:
                print("big: started", flush=True)
        except OSError as exc:
            print("refused:", exc, flush=True)

amesh.run(main)
"""


def _pids_hierarchy() -> Path:
    """Where this machine's pids controller is mounted (cgroup v1's hierarchy, or
    v2's root where it hands the controller down)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split()[:3]
        point = Path(left.split()[4])
        if fstype == "cgroup" and "pids" in options.split(","):
            return point
        if fstype == "cgroup2" and "pids" in (point / "cgroup.subtree_control").read_text():
            return point
    raise AssertionError("no pids controller to make a control group with")


@pytest.mark.skipif(os.getuid() != 0, reason="making a control group needs root")
def test_a_mesh_its_control_groups_pids_cap_cannot_hold_is_refused_before_it_starts() -> None:
    """A control group's pids.max caps root too, and no process inside may raise it: a
    mesh of 16 (~64 threads) under a cap of 60 is refused with the cap it met, before
    any of its processes starts (not a worker dying in the middle of its start with
    "can't start new thread"); one of 2 runs, and its workers see the cap, set on the
    group above their own."""
    capped = _pids_hierarchy() / f"amesh-test-{os.getpid()}-{os.urandom(4).hex()}"
    inner = capped / "inner"  # (uncapped: the cap is found above it)
    inner.mkdir(parents=True)
    try:
        (capped / "pids.max").write_text("60")
        out = subprocess.run(
            in_group(inner, [sys.executable, "-c", _PIDS]),
            capture_output=True,
            text=True,
            timeout=90,
            stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        small, big = out.stdout.splitlines()
        assert small == f"small: [('{capped}', 60)]", out.stderr[-3000:]
        assert big.startswith("refused: [Errno 11] starting these processes needs ~64 more")
        assert f"the control group {capped} lets its processes run 60," in big
        assert "raise its pids.max" in big
        # counted: the controller, the zygote and the first mesh's two workers (4 each)
        running = re.search(r"run 60, (\d+) of which run already", big)
        assert running is not None and 10 <= int(running.group(1)) < 60, big
    finally:
        _remove_groups([inner, capped])


def in_group(group: Path, cmd: list[str]) -> list[str]:
    """``cmd``, run in control group ``group`` from its start."""
    return ["sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh", str(group), *cmd]


def _remove_groups(groups: list[Path]) -> None:
    """Kill what is left in each group (only where the test failed), and remove it."""
    for group in groups:
        pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert all(wait_pid_gone(pid, 10) for pid in pids)
        group.rmdir()


def _fake_proc(tmp_path: Path, cgroup: str, mounts: list[str]) -> str:
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    lines = [f"{30 + i} 23 0:{40 + i} {m}" for i, m in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "proc")


def _group(path: Path, limit: str | None, current: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if limit is not None:
        (path / "pids.max").write_text(limit + "\n")
    (path / "pids.current").write_text(f"{current}\n")
    return path


@pytest.mark.parametrize("layout", ["v2", "v1 in a container", "v1 beside v2", "none"])
def test_the_pids_cap_is_the_tightest_group_from_a_process_up(tmp_path: Path, layout: str) -> None:
    """Read from /proc/PID/cgroup and mountinfo (here fake ones): the group with the
    least room left between the process's own and the hierarchy's mount, wherever
    that is mounted and whatever part of it a container sees."""
    from amesh._limits import PidsCap, pids_cap

    cg = tmp_path / "cg"
    if layout == "v2":
        proc = _fake_proc(
            tmp_path,
            "0::/user.slice/job/step\n",
            [f"/ {cg} rw,nosuid - cgroup2 cgroup2 rw", f"/ {tmp_path} rw - tmpfs tmpfs rw"],
        )
        _group(cg, None, 500)  # the root: no cap
        top = _group(cg / "user.slice", "100", 90)  # 10 left
        job = _group(cg / "user.slice/job", "40", 20)  # 20 left
        _group(cg / "user.slice/job/step", "max", 12)
        assert pids_cap(proc=proc) == PidsCap(str(top), 100, 90)
        (top / "pids.max").write_text("max")
        assert pids_cap(proc=proc) == PidsCap(str(job), 40, 20)
    elif layout == "v1 in a container":
        # the container's own group is mounted as the hierarchy's root
        proc = _fake_proc(
            tmp_path,
            "12:pids:/docker/abc/svc\n11:memory:/docker/abc\n0::/\n",
            [f"/docker/abc {cg} rw - cgroup cgroup rw,pids", f"/ {tmp_path}/u - cgroup2 x rw"],
        )
        _group(cg, "4096", 4000)  # 96 left
        svc = _group(cg / "svc", "50", 20)  # 30 left
        assert pids_cap(proc=proc) == PidsCap(str(svc), 50, 20)
    elif layout == "v1 beside v2":  # the pids controller is v1's; v2's groups do not count
        proc = _fake_proc(
            tmp_path,
            "0::/b\n8:pids:/a\n",
            [f"/ {cg} rw - cgroup cgroup rw,pids", f"/ {tmp_path}/u rw - cgroup2 cgroup2 rw"],
        )
        a = _group(cg / "a", "60", 1)
        _group(tmp_path / "u" / "b", "5", 4)
        assert pids_cap(proc=proc) == PidsCap(str(a), 60, 1)
    else:
        proc = _fake_proc(tmp_path, "3:cpu:/\n", [f"/ {cg} rw - cgroup cgroup rw,cpu"])
        assert pids_cap(proc=proc) is None
        assert pids_cap(proc=str(tmp_path / "nowhere")) is None


def test_a_mesh_the_kernels_thread_limit_cannot_hold_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kernel.pid_max and kernel.threads-max bound every user's threads together, root's
    too: a mesh whose threads would pass them is refused, naming the setting."""
    from amesh import _limits

    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    threads_max = int(Path("/proc/sys/kernel/threads-max").read_text())
    assert _limits._kernel_tasks() == min(
        (pid_max - 300, "kernel.pid_max"), (threads_max, "kernel.threads-max")
    )
    monkeypatch.setattr(_limits, "_kernel_tasks", lambda: (1000, "kernel.pid_max"))
    monkeypatch.setattr(_limits, "_loadavg_tasks", lambda: 950)
    _limits.make_room(0, 50)  # fits exactly
    with pytest.raises(
        OSError, match=r"runs 950 of the 1000 its kernel allows: raise kernel.pid_max"
    ) as refused:
        _limits.make_room(0, 51)
    assert refused.value.errno == errno.EAGAIN
    monkeypatch.setattr(_limits, "_loadavg_tasks", lambda: None)  # unknown: not refused
    _limits.make_room(0, 51)
