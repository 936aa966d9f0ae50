"""Errors users can read: remote tracebacks with the source of code shipped by value
and without amesh's frames, timeouts and pickling errors that say what, and a clean
SupervisionError at a scope's exit."""

from __future__ import annotations

import linecache
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import pytest

import amesh
from amesh import ActorError, ProcMesh, _wire
from amesh._runtime import current_runtime
from amesh._tracebacks import format_traceback

from .actors import Counter
from .test_agent import gone

AMESH_DIR = str(Path(amesh.__file__).parent)

# A notebook cell, as IPython runs one: compiled under a name that is no file, its
# lines only in this process's linecache. Its module is not importable, so its code
# travels by value.
CELL = "<ipython-input-7-amesh-test>"
CELL_SOURCE = """\
import amesh


def helper(x):
    y = x + 1
    raise ValueError(f"bad value {y}")


class CellActor(amesh.Actor):
    @amesh.endpoint
    async def step(self, x):
        return helper(x)

    @amesh.endpoint(thread=True)
    def step_in_thread(self, x):
        return helper(x)


def twice(x):
    return 2 * x
"""


@pytest.fixture
def cell() -> Iterator[dict[str, Any]]:
    """The namespace of :data:`CELL_SOURCE` run as a notebook cell."""
    lines = CELL_SOURCE.splitlines(keepends=True)
    linecache.cache[CELL] = (len(CELL_SOURCE), None, lines, CELL)
    namespace: dict[str, Any] = {"__name__": "amesh_test_cell"}
    exec(compile(CELL_SOURCE, CELL, "exec"), namespace)
    yield namespace
    linecache.cache.pop(CELL, None)


# -- code shipped by value ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_code_by_value_keeps_its_file_name_and_brings_its_lines(cell: dict[str, Any]) -> None:
    payload = _wire.dumps(cell["helper"])
    del linecache.cache[CELL]  # as in another process
    helper = _wire.loads(payload.data, payload.buffers)
    assert helper.__code__.co_filename == CELL
    assert linecache.getline(CELL, 6) == '    raise ValueError(f"bad value {y}")\n'
    assert linecache.getline(CELL, 1) == "\n"  # outside the function: not shipped
    with pytest.raises(ValueError) as info:
        helper(1)
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{CELL}", line 6, in helper' in text
    assert 'raise ValueError(f"bad value {y}")' in text


@pytest.mark.timeout(60)
def test_lines_of_code_shipped_apart_add_up(cell: dict[str, Any]) -> None:
    helper = _wire.dumps(cell["helper"])
    twice = _wire.dumps(cell["twice"])
    del linecache.cache[CELL]
    _wire.loads(twice.data, twice.buffers)
    assert linecache.getline(CELL, 20) == "    return 2 * x\n"
    assert linecache.getline(CELL, 6) == "\n"
    _wire.loads(helper.data, helper.buffers)
    assert linecache.getline(CELL, 6) == '    raise ValueError(f"bad value {y}")\n'
    assert linecache.getline(CELL, 20) == "    return 2 * x\n"


# -- remote tracebacks -------------------------------------------------------------------


@pytest.mark.anyio
async def test_remote_traceback_shows_the_cell_and_leaves_amesh_out(
    cell: dict[str, Any],
) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            actor = await procs.spawn("cells", cell["CellActor"])
            for ep in (actor.step, actor.step_in_thread):
                with pytest.raises(ActorError) as info:
                    await ep.call_one(1)
                tb = info.value.traceback
                assert tb.startswith("Traceback (most recent call last):\n")
                assert f'  File "{CELL}", line 6, in helper\n' in tb
                assert '    raise ValueError(f"bad value {y}")\n' in tb
                assert "return helper(x)" in tb
                assert tb.endswith("ValueError: bad value 2\n")
                # the user's frames only: not amesh's, nor anyio's that ran the thread
                assert AMESH_DIR not in tb and "anyio" not in tb
                assert tb.count("  File ") == 2


@pytest.mark.anyio
async def test_amesh_debug_keeps_amesh_frames(cell: dict[str, Any]) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}, env={"AMESH_DEBUG": "1"}) as procs:
            actor = await procs.spawn("cells", cell["CellActor"])
            with pytest.raises(ActorError) as info:
                await actor.step.call_one(1)
            assert f"{AMESH_DIR}/_runtime/_mailbox.py" in info.value.traceback
            assert f'File "{CELL}", line 6, in helper' in info.value.traceback


def _pickling_error() -> TypeError:
    """An error raised inside amesh (its traceback has amesh's frames)."""
    try:
        _wire.dumps(threading.Lock())
    except TypeError as exc:
        return exc
    raise AssertionError("a lock pickled")


def test_format_traceback_leaves_amesh_out_of_causes_and_groups() -> None:
    def user() -> None:
        try:
            _wire.dumps(threading.Lock())
        except TypeError as exc:
            raise ExceptionGroup("both", [_pickling_error(), ValueError("a")]) from exc

    with pytest.raises(ExceptionGroup) as info:
        user()
    text = format_traceback(info.value)
    assert "in user" in text and "in _pickling_error" in text and "ValueError: a" in text
    assert text.count("TypeError: cannot pickle '_thread.lock' object") == 2
    assert AMESH_DIR not in text
    assert f"{AMESH_DIR}/_wire/_pickling.py" in format_traceback(info.value, with_amesh=True)


# -- timeouts and arguments --------------------------------------------------------------


@pytest.mark.anyio
async def test_timeout_names_the_endpoint_and_the_ranks_that_did_not_answer() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}) as procs:
            c = await procs.spawn("counters", Counter)
            await c.slice(procs=1).release.call_one()
            with pytest.raises(TimeoutError) as info:
                await c.wait_released.options(timeout=0.5).call()
            assert str(info.value) == (
                "counters.wait_released: no answer within 0.5 s from ranks 0, 2 (of 3)"
            )
            assert info.value.__cause__ is None and info.value.__suppress_context__
            with pytest.raises(TimeoutError, match=r"^counters.wait_released: .* ranks 0, 2"):
                async for _ in c.wait_released.options(timeout=0.2).stream():
                    pass
            # a slice names the ranks of the mesh
            with pytest.raises(
                TimeoutError, match=r"^counters.wait_released: no answer within 0.2 s from rank 2$"
            ):
                await c.slice(procs=2).wait_released.options(timeout=0.2).call_one()
            with pytest.raises(TimeoutError, match=r"^counters\.hang: no answer within 0\.2 s"):
                await c.hang.options(timeout=0.2).choose()


@pytest.mark.anyio
async def test_an_unpicklable_argument_is_named() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("counters", Counter)
            rt = current_runtime()
            before = rt.statistics().calls_sent
            lock = threading.Lock()
            with pytest.raises(TypeError) as info:
                await c.apply.call(len, lock)
            assert str(info.value) == (
                "cannot pickle argument 1 of counters.apply: cannot pickle '_thread.lock' object"
            )
            with pytest.raises(TypeError) as info:
                await c.echo.call_one(x=lock)
            assert str(info.value) == (
                "cannot pickle argument 'x' of counters.echo: cannot pickle '_thread.lock' object"
            )
            with pytest.raises(TypeError, match=r"^cannot pickle argument 0 of counters\.echo"):
                await c.echo.broadcast(lock)
            assert rt.statistics().calls_sent == before
            assert await c.echo.call_one("fine") == "fine"
            with pytest.raises(TypeError) as info:
                await procs.spawn("more", Counter, lock)
            assert str(info.value) == (
                "cannot pickle argument 0 of Counter(): cannot pickle '_thread.lock' object"
            )


# -- what Python prints for an uncaught failure --------------------------------------------

CONTROLLER = """\
import os
import sys

import anyio

import amesh


class Worker(amesh.Actor):
    @amesh.endpoint
    def boom(self):
        raise KeyError("from the script")

    @amesh.endpoint
    def die(self):
        os._exit(3)


async def main(scoped):
    if not scoped:
        procs = await amesh.ProcMesh(per_host={"procs": 2})
        w = await procs.spawn("w", Worker)
        await w.slice(procs=1).die.broadcast()
        await anyio.sleep_forever()
    async with amesh.ProcMesh(per_host={"procs": 2}) as procs:
        w = await procs.spawn("w", Worker)
        try:
            await w.slice(procs=0).boom.call_one()
        except amesh.ActorError as err:
            print(err.traceback, flush=True)
        await w.slice(procs=1).die.broadcast()
        await anyio.sleep_forever()


amesh.run(main, sys.argv[1] == "scope", backend=sys.argv[2])
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("mode", "backend"), [("scope", "asyncio"), ("scope", "trio"), ("root", "asyncio")]
)
def test_an_unhandled_death_prints_the_supervision_error_alone(
    tmp_path: Path, mode: str, backend: str
) -> None:
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    proc = subprocess.run(
        [sys.executable, str(script), mode, backend],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("amesh._errors.SupervisionError: ")
    assert "rank 1" in last and "exited with code 3" in last
    for internal in ("CancelledError", "Cancelled", "_escalate", "escalate", "During handling"):
        assert internal not in proc.stderr
    if mode == "scope":
        # code of the script (__main__, shipped by value) names its file and lines
        assert f'  File "{script}", line 12, in boom\n' in proc.stdout
        assert '    raise KeyError("from the script")\n' in proc.stdout
        assert AMESH_DIR not in proc.stdout


SCRIPT_ERROR = """
import sys
import amesh
from amesh import Actor, endpoint

class Checker(Actor):
    @endpoint
    def check(self, x: int) -> None:
        if x < 0:
            raise ValueError(f"negative: {x}")

async def main():
    async with amesh.ProcMesh({"procs": 1}) as procs:
        checker = await procs.spawn("checker", Checker)
        await checker.check.call_one(-1)

if sys.argv[1] == "run":
    amesh.run(main, backend=sys.argv[2])
else:  # the session: no async at all
    procs = amesh.ProcMesh({"procs": 1}).get()
    checker = procs.spawn("checker", Checker).get()
    checker.check.call_one(-1).get()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("how", "backend"), [("run", "asyncio"), ("run", "trio"), ("get", "asyncio")]
)
@pytest.mark.parametrize("debug", [False, True])
def test_a_controller_prints_its_traceback_without_amesh_frames(
    tmp_path: Path, how: str, backend: str, debug: bool
) -> None:
    """A script's uncaught error shows the user's frames, here and remote, not those of
    amesh (nor of the event loop it runs main on); ``AMESH_DEBUG=1`` shows them all."""
    script = tmp_path / "controller.py"
    script.write_text(SCRIPT_ERROR)
    env = {**os.environ, "AMESH_DEBUG": "1" if debug else "0"}
    proc = subprocess.run(
        [sys.executable, str(script), how, backend],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert err.rstrip().splitlines()[-1].startswith("amesh._errors.ActorError: ValueError")
    local = err[err.index("The above exception was the direct cause") :]
    assert f'  File "{script}", line ' in local
    if debug:
        assert f'  File "{AMESH_DIR}/_model/_endpoint.py", line ' in local, err
    else:
        assert AMESH_DIR not in err, err
        for library in ("anyio", "asyncio", "trio", "uvloop", "concurrent/futures"):
            assert f"/{library}/" not in local, err
        # the remote part: the endpoint's own frame only
        frames = 3 if how == "run" else 2  # (and here: the script, and main under run)
        assert err.count(f'  File "{script}", line ') == frames, err


CTRL_C = """
import os, sys
import anyio
import amesh
from amesh import Actor, endpoint

class Waiter(Actor):
    @endpoint
    async def wait(self) -> None:
        await anyio.sleep_forever()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

async def main():
    async with amesh.ProcMesh({"procs": 2}) as procs:
        waiters = await procs.spawn("waiters", Waiter)
        print(*(await waiters.pid.call()).values(), flush=True)
        await waiters.wait.call()

amesh.run(main, backend=sys.argv[1])
"""


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
async def test_ctrl_c_under_amesh_run_says_keyboardinterrupt_and_stops_the_mesh(
    tmp_path: Path, backend: str
) -> None:
    """SIGINT to the controller's process group, as Ctrl-C sends it, while a call
    waits: the meshes stop and Python's own four lines are printed (it was 63 lines of
    the body's cancellation and amesh's frames)."""
    script = tmp_path / "controller.py"
    script.write_text(CTRL_C)
    with anyio.fail_after(60):
        async with await anyio.open_process(
            [sys.executable, str(script), backend], start_new_session=True
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            first = b""
            while not first.endswith(b"\n"):
                first += await proc.stdout.receive()
            pids = [int(p) for p in first.split()]
            assert len(pids) == 2
            os.killpg(proc.pid, signal.SIGINT)
            err = b""
            with suppress(anyio.EndOfStream):
                while True:
                    err += await proc.stderr.receive()
            await proc.wait()
        for pid in pids:
            await gone(pid)
    text = err.decode()
    assert proc.returncode == -signal.SIGINT, text
    assert text.splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 22, in <module>',
        "    amesh.run(main, backend=sys.argv[1])",
        "KeyboardInterrupt",
    ], text
