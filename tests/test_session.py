"""The session runtime: amesh outside ``amesh.run`` and ``async with``.

Each scenario is a program of its own, as a user would write it (a synchronous script,
``asyncio.run`` called once per "cell", ``python -m asyncio`` fed line by line): the
session is per process, and these programs must also show that nothing is left when
they exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from .test_agent import gone

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the programs under test pick their own loops


_ACTOR = """
import os, time
import anyio
import amesh
from amesh import Actor, endpoint, current_rank

class Worker(Actor):
    def __init__(self):
        self.n = 0
        self.seen = []

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def note(self, x) -> None:
        self.seen.append(x)

    @endpoint
    def notes(self) -> list:
        return self.seen

    @endpoint
    def rank(self) -> int:
        return current_rank().rank

    @endpoint
    async def nap(self, seconds: float) -> float:
        await anyio.sleep(seconds)
        return seconds

    @endpoint
    def pid(self) -> int:
        return os.getpid()
"""

_SYNC = (
    _ACTOR
    + """
procs = amesh.ProcMesh({"procs": 2}).get()
w = procs.spawn("w", Worker).get()
print("call", list(w.incr.call(3).get().values()))
print("call_one", w.slice(procs=1).incr.call_one(2).get())
print("choose", w.rank.choose().get() in (0, 1))
w.note.broadcast("hi").get()
print("notes", list(w.notes.call().get().values()))
print("stream", sorted((p.rank, v) for p, v in w.rank.stream()))
try:
    w.slice(procs=0).nap.call_one(30).get(timeout=0.3)
except TimeoutError as exc:
    print("timeout", type(exc).__name__)
print("after timeout", w.slice(procs=0).incr.call_one().get())
print("pids", *procs.pids)
procs.stop().get()
print("stopped", procs.stop().get() is None)
"""
)


async def _python(*args: str, stdin: bytes | None = None) -> tuple[str, str]:
    out = await anyio.run_process([sys.executable, *args], cwd=ROOT, check=False, input=stdin)
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr
    return stdout, stderr


async def test_a_synchronous_script_does_everything_with_get() -> None:
    """No async code at all: start, spawn, every adverb, a timeout, stop."""
    with anyio.fail_after(120):
        out, _ = await _python("-c", _SYNC)
    lines = out.splitlines()
    assert "call [3, 3]" in lines
    assert "call_one 5" in lines
    assert "choose True" in lines
    assert "notes [['hi'], ['hi']]" in lines
    assert "stream [(0, 0), (1, 1)]" in lines
    assert "timeout TimeoutError" in lines
    assert "after timeout 4" in lines  # the timed-out call did not break the actor
    assert "stopped True" in lines
    pids = [int(p) for p in next(x for x in lines if x.startswith("pids")).split()[1:]]
    for pid in pids:
        await gone(pid)


_CELLS = (
    _ACTOR
    + """
import asyncio, sys

async def cell1():
    global procs, w
    procs = await amesh.ProcMesh({"procs": 2})
    w = await procs.spawn("w", Worker)

async def cell2():
    print("cell2", list((await w.incr.call()).values()))
    print("stream", sorted([(p.rank, v) async for p, v in w.rank.stream()]))

async def cell3():
    print("cell3", await w.slice(procs=1).incr.call_one(5))
    print("pids", *procs.pids, flush=True)

asyncio.run(cell1())
asyncio.run(cell2())
import uvloop
uvloop.run(cell3())  # another kind of loop
# the interpreter exits with the mesh running: the session stops it
"""
)


async def test_meshes_live_across_asyncio_runs_and_end_with_the_interpreter() -> None:
    """Each `asyncio.run` is a cell: a new task on a new loop (asyncio's, then
    uvloop's); the mesh lives on, and is stopped when the interpreter exits."""
    with anyio.fail_after(120):
        out, err = await _python("-c", _CELLS)
    lines = out.splitlines()
    assert "cell2 [1, 1]" in lines, err
    assert "stream [(0, 0), (1, 1)]" in lines
    assert "cell3 6" in lines
    pids = [int(p) for p in next(x for x in lines if x.startswith("pids")).split()[1:]]
    for pid in pids:
        await gone(pid)


_REPL = """import amesh
procs = await amesh.ProcMesh({"procs": 3})
pids = procs.pids
print("started", len(pids))
await procs.stop()
print("stopped", "yes")
"""


async def test_top_level_await_in_python_m_asyncio() -> None:
    with anyio.fail_after(120):
        out, err = await _python("-m", "asyncio", stdin=_REPL.encode())
    assert "started 3" in out, err
    assert "stopped yes" in out, err


_FAILURE = (
    _ACTOR
    + """
import signal
procs = amesh.ProcMesh({"procs": 2}).get()
w = procs.spawn("w", Worker).get()
victim = w.slice(procs=1).pid.call_one().get()
os.kill(victim, signal.SIGKILL)
other = amesh.ProcMesh({"procs": 1}).get()  # another mesh is not concerned
for attempt in range(2):
    try:
        while True:  # until the failure is known here; each call is a real round trip
            w.slice(procs=0).incr.call_one().get()
    except amesh.SupervisionError as exc:
        print("raised", attempt, "SIGKILL" in str(exc), exc.ranks)
o = other.spawn("o", Worker).get()
print("other", o.incr.call_one(7).get())
procs.stop().get()
other.stop().get()
print("done")

async def inside():
    try:
        o.incr.call_one().get()
    except RuntimeError as exc:
        print("inside:", "use `await`" in str(exc))

amesh.run(inside)
"""
)


async def test_a_failure_is_printed_and_raised_by_the_next_use() -> None:
    with anyio.fail_after(120):
        out, err = await _python("-c", _FAILURE)
    lines = out.splitlines()
    assert "raised 0 True [1]" in lines, (out, err)
    assert "raised 1 True [1]" in lines  # every later use, until stopped
    assert "other 7" in lines
    assert "done" in lines
    assert "inside: True" in lines
    assert "amesh: unhandled supervision failure" in err
    # issue 36, item 19: printed once, not logged too ("supervision failure: ...")
    assert err.count("was killed by SIGKILL") == 1, err
    assert "closing the session" not in err  # reported once, not again at exit


_TIMEOUTS = (
    _ACTOR
    + """
import asyncio
procs = amesh.ProcMesh({"procs": 2}).get()
w = procs.spawn("w", Worker).get()

def show(how, fn):
    try:
        fn()
    except TimeoutError as exc:
        print(how, "|", exc, "|", exc.__context__)

async def awaited():
    await w.nap.options(timeout=0.3).call(30)

show("await", lambda: asyncio.run(awaited()))
show("options", lambda: w.nap.options(timeout=0.3).call(30).get())
show("get", lambda: w.nap.call(30).get(timeout=0.3))
show("both", lambda: w.nap.options(timeout=60).call(30).get(timeout=0.3))
show("call_one", lambda: w.slice(procs=1).nap.call_one(30).get(timeout=0.3))
show("spawn", lambda: procs.spawn("v", Worker).get(timeout=0))
procs.stop().get()
"""
)


async def test_a_timeout_through_get_names_the_endpoint_and_ranks_as_await_does() -> None:
    """Issue 36, item 15: `.get()` of a timed-out call raised `<amesh.Op
    MeshEndpoint.call> did not finish within None s` (the endpoint's message only in
    its __context__), and `.get(timeout=...)` named no endpoint."""
    with anyio.fail_after(120):
        out, err = await _python("-c", _TIMEOUTS)
    said = dict(line.split(" | ", 1) for line in out.splitlines() if " | " in line)
    whole = "w.nap: no answer within 0.3 s from ranks 0, 1 (of 2) | None"
    assert said["await"] == whole, (out, err)
    assert said["options"] == whole
    assert said["get"] == whole
    assert said["both"] == whole  # the shorter of the two timeouts
    assert said["call_one"] == "w.nap: no answer within 0.3 s from rank 1 | None"
    # an op that is not an endpoint's adverb: named, with the timeout given to get()
    assert said["spawn"].startswith("ProcMesh.spawn: did not finish within 0 s"), said
