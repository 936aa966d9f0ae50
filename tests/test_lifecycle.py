"""Start-up, shutdown and the promise that nothing is left running."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import anyio
import pytest

import amesh
from amesh import ProcMesh, SupervisionError
from amesh.testing._leaks import ipc_dir

from .actors import BadInit, Counter, ExitHooks

pytestmark = pytest.mark.anyio


def wait_pid_gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` has exited (event-driven through a pidfd, not polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


async def test_exit_runs_cleanup_and_stops_processes(tmp_path: Path) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(
            per_host={"procs": 3}, env={"AMESH_TEST_CLEANUP_DIR": str(tmp_path)}
        ) as procs:
            c = await procs.spawn("c", Counter, 5)
            await c.incr.call()
            pids = procs.pids
        for pid in pids:
            assert wait_pid_gone(pid, 0)
        written = {p.name: p.read_text() for p in tmp_path.iterdir()}
        assert written == {f"cleanup-{pid}": "6" for pid in pids}


async def test_a_worker_ends_its_threads_then_its_atexit_handlers(tmp_path: Path) -> None:
    # A worker leaves with os._exit (no interpreter teardown), after what the
    # interpreter's exit would do first: join non-daemon threads, then run atexit.
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            hooks = await procs.spawn("hooks", ExitHooks)
            pids = procs.pids
            await hooks.arm.call(str(tmp_path))
        for pid in pids:
            assert wait_pid_gone(pid, 0)
    written = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert written == {f"exit-{pid}": "thread\natexit\n" for pid in pids}


def test_a_worker_watch_ends_the_process_when_its_pipe_closes() -> None:
    # amesh._native._ext.exit_when_closed: how a worker dies with the pipe its parent holds
    r, w = os.pipe()
    code = (
        "import sys, threading; from amesh._native import _ext; "
        "_ext.exit_when_closed(int(sys.argv[1])); print('watching', flush=True); "
        "threading.Event().wait()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(r)], pass_fds=(r,), stdout=subprocess.PIPE, text=True
    )
    try:
        os.close(r)
        assert proc.stdout is not None
        assert proc.stdout.readline() == "watching\n"
        assert proc.poll() is None  # the pipe is open: it lives
        os.close(w)
        w = -1
        assert proc.wait(timeout=30) == 1
    finally:
        if w >= 0:
            os.close(w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_worker_dies_with_the_thread_that_forked_it() -> None:
    # amesh._native._ext.set_parent_death_signal: the kernel's half of a worker's watch of its
    # parent (prctl PR_SET_PDEATHSIG, without ctypes). A middle process starts a child
    # that asks for SIGKILL at its parent's death, then exits when its stdin closes.
    child = (
        "import signal, threading; from amesh._native import _ext; "
        "_ext.set_parent_death_signal(signal.SIGKILL); print('set', flush=True); "
        "threading.Event().wait()"
    )
    middle = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, "
        "text=True); "
        "assert p.stdout.readline() == 'set\\n'; print(p.pid, flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", middle], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    pid = 0
    try:
        pid = int(proc.stdout.readline())
        assert not wait_pid_gone(pid, 0)  # its parent lives: so does it
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        assert wait_pid_gone(pid, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        if pid and not wait_pid_gone(pid, 0):
            os.kill(pid, signal.SIGKILL)
    with pytest.raises(ValueError, match="not a signal number"):
        from amesh._native import _ext

        _ext.set_parent_death_signal(-1)


async def test_init_failure_raises_with_remote_traceback_and_leaves_nothing() -> None:
    with anyio.fail_after(60):
        with pytest.raises(SupervisionError, match=r"BadInit\.__init__ failed") as info:
            async with ProcMesh(per_host={"procs": 2}) as procs:
                pids = procs.pids
                await procs.spawn("bad", BadInit, 1)
        cause = info.value.__cause__
        assert isinstance(cause, amesh.ActorError)
        assert cause.type_name == "KeyError"
        assert "bad init on purpose" in cause.traceback
        assert cause.point == {"procs": 1, "rank": 1}
        for pid in pids:
            assert wait_pid_gone(pid, 0)


class FailsOnRankOne(amesh.Actor):
    def __init__(self) -> None:
        if amesh.current_rank().rank == 1:
            raise ValueError("bad init")


async def test_init_failure_keeps_the_remote_traceback_of_init() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            with pytest.raises(SupervisionError) as info:
                await procs.spawn("bad", FailsOnRankOne)
    cause = info.value.__cause__
    assert isinstance(cause, amesh.ActorError)
    assert str(cause) == "ValueError: bad init in actor 'bad' at procs=1, rank=1"
    assert 'raise ValueError("bad init")' in cause.traceback
    assert "test_lifecycle.py" in cause.traceback
    # the remote traceback is chained, so it is printed with the error
    remote = cause.__cause__
    assert isinstance(remote, amesh.RemoteTraceback)
    assert remote.text == cause.traceback
    printed = "".join(traceback.format_exception(info.value))
    assert 'raise ValueError("bad init")' in printed
    assert "in __init__" in printed


async def test_init_failure_can_be_caught_and_the_mesh_stays_usable() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            with pytest.raises(SupervisionError):
                await procs.spawn("bad", BadInit, 0)
            good = await procs.spawn("bad", Counter)  # the name is free again
            assert (await good.incr.call()).values() == [1, 1]


async def test_body_exception_propagates_unwrapped() -> None:
    with anyio.fail_after(60):
        with pytest.raises(KeyError, match="mine"):
            async with ProcMesh(per_host={"procs": 1}) as procs:
                await procs.spawn("c", Counter)
                raise KeyError("mine")


async def test_worker_death_fails_calls_and_the_scope() -> None:
    with anyio.fail_after(60):
        with pytest.raises(SupervisionError, match="SIGKILL") as info:
            async with ProcMesh(per_host={"procs": 2}) as procs:
                c = await procs.spawn("c", Counter)
                victim = procs.pids[1]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(c.slice(procs=0).hang.call_one)
                    os.kill(victim, signal.SIGKILL)
                    await c.slice(procs=1).hang.call_one()
        assert str(victim) in str(info.value)


@pytest.mark.parametrize("scheme", ["stream+tcp", "ipc"])
async def test_other_transports(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain streams over tcp (``tcp`` is TLS between hosts: see test_hybrid), and ipc."""
    monkeypatch.setenv("AMESH_TRANSPORT", scheme)
    scheme = scheme.removeprefix("stream+")
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            # stream transport addresses carry a "stream+" prefix
            addrs = [a.removeprefix("stream+") for a in procs._live().addrs]
            assert all(a.startswith(f"{scheme}://") for a in addrs)
            if scheme == "tcp":
                assert all(a.startswith("tcp://127.0.0.1:") for a in addrs)
            else:
                assert all(os.path.dirname(a[len("ipc://") :]) == ipc_dir() for a in addrs)
            c = await procs.spawn("c", Counter)
            assert (await c.incr.call(3)).values() == [3, 3]
            assert sum((await c.incr.call()).values()) == 8


def test_workers_exit_when_the_controller_is_sigkilled(tmp_path: Path) -> None:
    script = tmp_path / "controller.py"
    script.write_text(
        textwrap.dedent(
            """
            import anyio, amesh
            from amesh import Actor, ProcMesh, endpoint

            class Idle(Actor):
                @endpoint
                def ping(self) -> int:
                    return 1

            async def main() -> None:
                async with ProcMesh(per_host={"procs": 3}) as procs:
                    idle = await procs.spawn("idle", Idle)
                    await idle.ping.call()
                    print(" ".join(map(str, procs.pids)), flush=True)
                    await anyio.sleep_forever()

            amesh.run(main)
            """
        )
    )
    ctl = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert ctl.stdout is not None
        ready = select.select([ctl.stdout], [], [], 60)[0]
        assert ready, "the controller did not start its mesh"
        pids = [int(p) for p in ctl.stdout.readline().split()]
        assert len(pids) == 3
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=30)
        for pid in pids:
            assert wait_pid_gone(pid, 10), f"worker {pid} outlived its controller"
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        if ctl.stdout is not None:
            ctl.stdout.close()


def python_output(code: str) -> str:
    """What a fresh interpreter running ``code`` prints (it must succeed in 60 s)."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


_BARE_ASYNCIO = """
import asyncio
import amesh
from amesh._runtime._runtime import current_runtime

class Counter(amesh.Actor):
    def __init__(self):
        self.n = 0

    @amesh.endpoint
    def incr(self):
        self.n += 1
        return self.n

async def main():
    async with amesh.ProcMesh(
        per_host={"procs": 2}, heartbeat_period=0.05, heartbeat_timeout=0.5
    ) as procs:
        counter = await procs.spawn("counter", Counter)
        rt = current_runtime()
        while rt.statistics().heartbeats_received < 40:  # ~1 s: two heartbeat timeouts
            await asyncio.sleep(0.05)
        print((await counter.incr.call()).values(), rt.statistics().frames_dropped)

asyncio.run(main())
"""


def test_a_mesh_under_asyncio_run_hears_its_workers_heartbeats() -> None:
    """A script under ``asyncio.run`` (not ``amesh.run``) that opens a ProcMesh itself:
    nothing told sniffio which library runs, so only a task knew, and the heartbeats,
    which arrive in the transport's protocol callbacks, were dropped (anyio could not
    tell the time there): every worker was failed for silence after
    ``heartbeat_timeout``. Now the runtime says so for its context, as anyio.run does."""
    assert python_output(_BARE_ASYNCIO).split() == ["[1,", "1]", "0"]


_BARE_ASYNCIO_TOUR = """
import asyncio, os, signal
import amesh

class Worker(amesh.Actor):
    @amesh.endpoint
    def hello(self):
        print("hello from a worker")
        return os.getpid()

    @amesh.endpoint
    def boom(self):
        raise ValueError("boom")

    @amesh.endpoint
    async def slow(self):
        await asyncio.sleep(60)

    @amesh.endpoint
    def double(self, x):
        return 2 * x

async def main():
    try:
        async with amesh.ProcMesh(per_host={"procs": 2}) as procs:
            w = await procs.spawn("w", Worker)
            pids = sorted((await w.hello.call()).values())
            try:
                await w.slice(procs=0).boom.call_one()
            except amesh.ActorError as exc:
                print("remote error:", exc.type_name, exc.message)
            try:
                await asyncio.wait_for(w.slow.call(), 0.2)
            except asyncio.TimeoutError:
                print("cancelled")
            print("stream:", sorted([v async for _, v in w.double.stream(21)]))
            os.kill(pids[0], signal.SIGKILL)
            await w.hello.call()
    except amesh.SupervisionError as exc:
        print("supervision:", "killed by SIGKILL" in str(exc))

asyncio.run(main())
"""


def test_a_mesh_under_asyncio_run_does_what_it_does_under_amesh_run() -> None:
    """The tests' controllers run under anyio's runner, as ``amesh.run`` does; this one
    runs under a bare ``asyncio.run``: output, a remote error, a cancelled call, a
    stream and a killed rank's failure behave the same."""
    out = python_output(_BARE_ASYNCIO_TOUR)
    for line in (
        "[w 0-1] hello from a worker",  # (the same line from both ranks, folded)
        "remote error: ValueError boom",
        "cancelled",
        "stream: [42, 42]",
        "supervision: True",
    ):
        assert line in out, out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_keyboard_interrupt_propagates_out_of_amesh_run(backend: str) -> None:
    code = textwrap.dedent(
        f"""
        import os, signal, anyio, amesh
        from amesh import ProcMesh

        # Python leaves SIGINT ignored when it started so (a background job of a shell
        # without job control): a terminal's Ctrl-C is what this test is about
        signal.signal(signal.SIGINT, signal.default_int_handler)

        async def main():
            async with ProcMesh(per_host={{"procs": 1}}) as procs:
                print(procs.pids[0], flush=True)
                os.kill(os.getpid(), signal.SIGINT)
                await anyio.sleep_forever()

        try:
            amesh.run(main, backend={backend!r})
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
        """
    )
    worker, last = python_output(code).split()
    assert last == "KeyboardInterrupt"
    assert wait_pid_gone(int(worker), 10)


@pytest.mark.parametrize("zygote", ["1", "0"], ids=["forked", "execd"])
async def test_workers_ignore_sigint(zygote: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zygote's child inherits the zygote's SIGINT ignored; an exec'd worker ignores
    it itself."""
    monkeypatch.setenv("AMESH_ZYGOTE", zygote)
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            with open(f"/proc/{procs.pids[0]}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            assert (ppid == os.getpid()) == (zygote == "0")
            os.kill(procs.pids[0], signal.SIGINT)  # as a terminal's Ctrl-C would
            assert await c.incr.call_one() == 1


@pytest.mark.parametrize("impl", ["stream", "ext", "nng"])
async def test_every_transport_implementation_end_to_end(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each transport implementation carries a whole mesh: calls, broadcasts, large
    payloads, and a relay tree."""
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", impl)
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}, fanout=2) as procs:
            addrs = procs._live().addrs
            assert all(a.startswith("stream+") == (impl == "stream") for a in addrs)
            c = await procs.spawn("c", Counter)
            await c.incr.broadcast(2)
            assert (await c.incr.call()).values() == [3, 3, 3]
            blob = bytes(range(256)) * 8192  # 2 MiB: out of band, shared memory
            assert await c.slice(procs=2).echo.call_one(blob) == blob
            assert (await c.echo.call(blob)).values() == [blob] * 3


async def test_leaving_a_mesh_does_not_wait_for_its_heartbeat_monitor() -> None:
    """The monitor of a mesh's heartbeats ends with the mesh, not at its next tick:
    with heartbeats a minute apart, entering, using and leaving a mesh takes far less
    (it waited out the tick, half a second a mesh by default, before)."""
    with anyio.fail_after(30):
        async with ProcMesh(
            per_host={"procs": 2}, heartbeat_period=60.0, heartbeat_timeout=240.0
        ) as procs:
            c = await procs.spawn("c", Counter)
            assert (await c.incr.call()).values() == [1, 1]
