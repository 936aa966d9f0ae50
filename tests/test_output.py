"""Worker output at the controller: tagged with mesh and rank, folded, in the right
stream, through logging, and not lost at exit (amesh._runtime._capture, _output).

The controller here is the test process; ``capfd`` sees what it prints and also what
a worker would write straight to the fds it inherited, so output that leaks past the
capture shows up too.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from amesh import ProcMesh, _wire
from amesh._runtime import _output, current_runtime
from amesh._runtime._capture import MAX_LINES
from amesh._runtime._output import ranks_text
from amesh._transport import StreamTransport

from .output_actors import Goodbye, Printer

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def slow_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines wait for their twins until the call's last reply, however slow the
    machine: what folds then does not depend on timing."""
    monkeypatch.setattr(_output, "FOLD_WINDOW", 3600.0)


def lines_with(text: str, captured: str) -> list[str]:
    return [line for line in captured.splitlines() if text in line]


def ranks_of(prefixed: list[str], label: str) -> list[int]:
    """The ranks that ``[label RANKS] ...`` lines name, in order."""
    found: list[int] = []
    for line in prefixed:
        m = re.match(rf"\[{re.escape(label)} ([0-9,-]+)\] ", line)
        assert m is not None, line
        for part in m.group(1).split(","):
            first, _, last = part.partition("-")
            found += range(int(first), int(last or first) + 1)
    return found


def test_rank_ranges() -> None:
    assert ranks_text([3, 0, 1, 2]) == "0-3"
    assert ranks_text([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert ranks_text([5]) == "5"
    assert ranks_text([4, 2]) == "2,4"


async def test_lines_name_the_actor_mesh_and_rank(
    capfd: pytest.CaptureFixture[str], slow_fold: None
) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"gpus": 4}) as procs:
            p = await procs.spawn("printers", Printer, "ready to print")
            # what __init__ printed was shown before spawn returned, folded
            out = capfd.readouterr().out
            assert lines_with("ready to print", out) == ["[printers 0-3] ready to print"]

            # different lines are not folded; each is shown before the call returns
            await p.say_mine.call("epoch")
            out = capfd.readouterr().out
            assert sorted(lines_with("epoch", out)) == [
                f"[printers {r}] epoch {r}" for r in range(4)
            ]

            # a slice's rank 0 is still rank 2 of the actor mesh
            await p.slice(gpus=slice(2, 4)).say.call("from a slice")
            out = capfd.readouterr().out
            assert lines_with("from a slice", out) == ["[printers 2-3] from a slice"]

            # a threaded endpoint's output is its actor's too
            await p.say_in_thread.call("in a thread")
            out = capfd.readouterr().out
            assert lines_with("in a thread", out) == ["[printers 0-3] in a thread"]


async def test_the_same_line_from_four_ranks_is_printed_once(
    capfd: pytest.CaptureFixture[str], slow_fold: None
) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"gpus": 4}) as procs:
            p = await procs.spawn("trainers", Printer)
            await p.say.call("epoch 3 done")
            await p.say.call("epoch 3 done")
            out = capfd.readouterr().out
    assert lines_with("epoch 3 done", out) == ["[trainers 0-3] epoch 3 done"] * 2


async def test_raw_mode_prints_every_line(capfd: pytest.CaptureFixture[str]) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"gpus": 4}, output="raw") as procs:
            p = await procs.spawn("trainers", Printer)
            await p.say.call("epoch 3 done")
            out = capfd.readouterr().out
    found = lines_with("epoch 3 done", out)
    assert sorted(found) == [f"[trainers {r}] epoch 3 done" for r in range(4)]


async def test_stderr_lines_go_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            p = await procs.spawn("p", Printer)
            await p.complain.call("something is off")
            captured = capfd.readouterr()
    assert sorted(ranks_of(lines_with("something is off", captured.err), "p")) == [0, 1]
    assert lines_with("something is off", captured.out) == []


async def test_logging_keeps_its_level_and_logger(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, slow_fold: None
) -> None:
    caplog.set_level(logging.WARNING, logger="mylib")
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            p = await procs.spawn("p", Printer)
            await p.log.call("mylib", "disk almost full")
            records = [r for r in caplog.records if "disk almost full" in r.getMessage()]
    # the controller's logging decided: pytest's handlers took the record
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [
        ("mylib", logging.WARNING, "[p 0-1] disk almost full")
    ]
    assert records[0].__dict__["amesh_mesh"] == "p"
    assert records[0].__dict__["amesh_ranks"] == "0-1"


async def test_amesh_log_level_sets_the_workers_level(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mylib")
    with anyio.fail_after(60):
        async with (
            ProcMesh(per_host={"procs": 1}) as quiet,
            ProcMesh(per_host={"procs": 1}, env={"AMESH_LOG_LEVEL": "INFO"}) as chatty,
        ):
            for procs, name in ((quiet, "quiet"), (chatty, "chatty")):
                p = await procs.spawn(name, Printer)
                await p.log.call("mylib", f"info from {name}", logging.INFO)
            messages = [r.getMessage() for r in caplog.records if r.name == "mylib"]
    # WARNING by default: the quiet worker's info never left it
    assert messages == ["[chatty 0] info from chatty"]


async def test_warnings_show_their_category_and_message(
    capfd: pytest.CaptureFixture[str], slow_fold: None
) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            p = await procs.spawn("p", Printer)
            await p.warn.call("this is deprecated")
            err = capfd.readouterr().err
    assert lines_with("this is deprecated", err) == [
        "[p 0-1] UserWarning: this is deprecated (output_actors.py:40)"
    ]


async def test_fd_level_output_is_the_process_s(capfd: pytest.CaptureFixture[str]) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}, name="workers") as procs:
            p = await procs.spawn("p", Printer)
            await p.raw_fd.call(b"straight to fd 1\n")
        # (it comes through a pipe, within a batch: the exit waits for it)
        out = capfd.readouterr().out
    found = lines_with("straight to fd 1", out)
    assert sorted(ranks_of(found, "workers")) == [0, 1, 2]
    assert all(line.endswith("] straight to fd 1") for line in found)


@pytest.mark.parametrize("unbuffered", ["1", ""])
async def test_c_stdout_is_line_buffered_and_flushed_at_exit(
    capfd: pytest.CaptureFixture[str], unbuffered: str
) -> None:
    # A worker's C stdout is line-buffered: not fully buffered, as glibc makes it on a
    # pipe (holding finished lines back), nor unbuffered, as PYTHONUNBUFFERED (which
    # workers get unless told otherwise) makes it (a write per call, or per byte). What
    # C still holds at the exit is flushed before the pipes are read for the last time.
    with anyio.fail_after(60):
        async with ProcMesh(
            per_host={"procs": 2}, name="workers", env={"PYTHONUNBUFFERED": unbuffered}
        ) as procs:
            p = await procs.spawn("p", Printer)
            held = await p.c_write.call("half a line")
            assert held.values() == [len("half a line")] * 2  # until its end
            held = await p.c_write.call(", ended\nand a rest")
            assert held.values() == [len("and a rest")] * 2  # the line went
        out = capfd.readouterr().out
    found = lines_with("half a line, ended", out)
    assert sorted(ranks_of(found, "workers")) == [0, 1]
    assert sorted(ranks_of(lines_with("and a rest", out), "workers")) == [0, 1]


@pytest.mark.parametrize("ext", ["c", "ctypes"])
def test_c_stdout_is_line_buffered_with_or_without_the_extension(ext: str) -> None:
    # What a worker's capture does to C's stdout, in a process of its own that starts
    # unbuffered (PYTHONUNBUFFERED), through amesh._native._ext or, hidden, through ctypes.
    code = (
        "import ctypes, sys\n"
        + ("sys.modules['amesh._native._ext'] = None\n" if ext == "ctypes" else "")
        + "from amesh._runtime import _capture\n"
        "_capture._line_buffer_c_stdout()\n"
        "libc = ctypes.CDLL(None)\n"
        "out = ctypes.c_void_p.in_dll(libc, 'stdout')\n"
        "pending = getattr(libc, '__fpending')\n"
        "pending.restype = ctypes.c_size_t\n"
        "libc.fputs(b'half', out)\n"
        "held = pending(out)\n"
        "libc.fputs(b' a line\\n', out)\n"
        "print(held, pending(out), file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.split() == ["4", "0"]  # held until the line ended, then written
    assert proc.stdout == "half a line\n"


async def test_output_off_shows_nothing(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mylib")
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}, output="off") as procs:
            p = await procs.spawn("p", Printer, "secret init")
            await p.say.call("secret out")
            await p.complain.call("secret err")
            await p.raw_fd.call(b"secret fd\n")
            await p.log.call("mylib", "secret log")
            await p.warn.call("secret warning")
    captured = capfd.readouterr()
    assert "secret" not in captured.out + captured.err
    assert not [r for r in caplog.records if "secret" in r.getMessage()]


async def test_output_right_before_the_exit_is_not_lost(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            await procs.spawn("bye", Goodbye, "goodbye from cleanup")
            p = await procs.spawn("p", Printer)
            await p.say_and_stay.call("a line without its end")
            await p.raw_fd.call(b"fd output, then the exit\n")
    out = capfd.readouterr().out
    # __cleanup__ runs at the mesh's exit; the unfinished line ends when the worker does
    assert sorted(ranks_of(lines_with("goodbye from cleanup", out), "bye")) == [0, 1]
    assert sorted(ranks_of(lines_with("a line without its end", out), "p")) == [0, 1]
    assert sorted(ranks_of(lines_with("fd output, then the exit", out), "procs")) == [0, 1]


async def test_a_flood_is_cut_and_counted(capfd: pytest.CaptureFixture[str]) -> None:
    """A handler that prints faster than the lines can leave (it never yields) loses
    what does not fit in the worker's buffer, and says how much."""
    with anyio.fail_after(120):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            p = await procs.spawn("p", Printer)
            await p.flood.call(MAX_LINES + 500)
            captured = capfd.readouterr()
    assert len(lines_with("] line ", captured.out)) == MAX_LINES
    assert lines_with("lines dropped", captured.err) == ["[procs 0] [500 lines dropped]"]


async def test_output_from_a_process_not_supervised_here_is_refused(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}):
            rt = current_runtime()
            before = rt.statistics().frames_refused
            mole = StreamTransport()
            try:
                forged = _wire.Output([_wire.OutputLine(_wire.STDOUT, "forged", 0, "forged line")])
                await mole.send(rt.address, _wire.encode(forged))
                # frames of one connection arrive in order: once this one is in, the
                # forged output before it was handled
                done = anyio.Event()
                rt.expect_ready("mole", lambda env: done.set())
                await mole.send(rt.address, _wire.encode(_wire.Ready("mole", mole.address, 1)))
                await done.wait()
            finally:
                mole.close()
            assert rt.statistics().frames_refused == before + 1
    assert "forged line" not in capfd.readouterr().out


CONTROLLER = """
import sys

import amesh
from tests.output_actors import Printer


async def main():
    async with amesh.ProcMesh(per_host={"procs": 2}, name="workers") as procs:
        p = await procs.spawn("printers", Printer)
        await p.say_mine.call("to stdout")
        await p.complain.call("to stderr")
        await p.log.call("mylib", "through logging")
        await p.raw_fd.call(b"through fd 1\\n")
        print("the controller's own line", flush=True)


amesh.run(main, backend=sys.argv[1])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_controller_script_sees_every_line_tagged(tmp_path: Path, backend: str) -> None:
    """A controller whose logging is not configured: log records are printed to its
    stderr with level and logger; no worker line reaches it untagged."""
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    proc = subprocess.run(
        [sys.executable, str(script), backend],
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={**_env(), "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout, proc.stderr
    assert sorted(lines_with("to stdout", out)) == [
        "[printers 0] to stdout 0",
        "[printers 1] to stdout 1",
    ]
    assert sorted(ranks_of(lines_with("to stderr", err), "printers")) == [0, 1]
    logged = lines_with("through logging", err)
    assert sorted(ranks_of(logged, "printers")) == [0, 1]
    assert all(line.endswith("] WARNING mylib: through logging") for line in logged)
    assert sorted(ranks_of(lines_with("through fd 1", out), "workers")) == [0, 1]
    assert not lines_with("to stderr", out) and not lines_with("to stdout", err)
    for line in out.splitlines() + err.splitlines():
        assert line.startswith("[") or line == "the controller's own line", line


def _env() -> dict[str, str]:
    """This environment, without a default output mode (the script's is folded)."""
    return {k: v for k, v in os.environ.items() if k != "AMESH_OUTPUT"}
