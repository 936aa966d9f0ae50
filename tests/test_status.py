"""Seeing what runs: ProcMesh.status() and stacks(), and `amesh list`, `amesh stacks`,
`amesh logs` (the registry of live meshes), on asyncio (uvloop) and trio."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from amesh import Actor, ProcMesh, endpoint

pytestmark = pytest.mark.anyio

_OPEN: dict[str, anyio.Event] = {}


def _door() -> anyio.Event:
    """One event per process (made on first use, on the worker's loop)."""
    if "door" not in _OPEN:
        _OPEN["door"] = anyio.Event()
    return _OPEN["door"]


class Waiter(Actor):
    """Serial: each ``wait_for_door`` blocks the ones queued behind it."""

    @endpoint
    async def wait_for_door(self) -> int:
        await _door().wait()
        return 1


class Mixed(Waiter):
    """The same, with a concurrent endpoint (a task per message)."""

    @endpoint(concurrent=True)
    async def ping(self) -> None:
        pass


class Doorman(Actor):
    """Opens the door: another actor, so another mailbox."""

    @endpoint
    def open(self) -> None:
        _door().set()

    @endpoint
    def say(self, text: str) -> None:
        print(text)


async def _until(procs: ProcMesh, test: Any) -> list[dict[str, Any]]:
    """Poll ``procs.status()`` until ``test`` holds for the actor list of rank 1."""
    while True:
        actors = (await procs.status()).values()[1]["actors"]
        if test(actors):
            return list(actors)
        await anyio.sleep(0.01)


def _waiter(actors: list[dict[str, Any]]) -> dict[str, Any]:
    return next(a for a in actors if a["name"] == "waiters")


@pytest.mark.parametrize("cls", [Waiter, Mixed])
async def test_status_shows_running_and_queued_calls(cls: type[Waiter]) -> None:
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 2}) as procs:
            waiters = await procs.spawn("waiters", cls)
            door = await procs.spawn("door", Doorman)
            idle = (await procs.status()).values()
            assert [s["pid"] for s in idle] == procs.pids
            assert _waiter(idle[0]["actors"]) | {"handled": 0} == {
                "name": "waiters",
                "rank": 0,
                "queued": 0,
                "running": 0,
                "now": [],
                "handled": 0,
                "failed": None,
            }
            one = waiters.slice(procs=1)
            results: list[int] = []
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(lambda: _append(results, one.wait_for_door.call_one()))
                busy = _waiter(
                    await _until(
                        procs, lambda a: (_waiter(a)["queued"], _waiter(a)["running"]) == (2, 1)
                    )
                )
                assert busy["now"] == ["wait_for_door"]
                assert _waiter((await procs.status()).values()[0]["actors"])["running"] == 0
                stacks = await procs.stacks(1)
                # the user's task first, amesh's frames folded, its own threads counted
                assert stacks.startswith("--- task"), stacks
                assert "in wait_for_door\n    await _door().wait()" in stacks, stacks
                assert "frames of " in stacks and "_mailbox.py" not in stacks, stacks
                assert "threads and" in stacks.splitlines()[-1], stacks
                full = await procs.stacks(1, full=True)
                assert "--- thread" in full and "_mailbox.py" in full, full
                assert "wait_for_door" not in await procs.stacks(0)
                every = await procs.stacks()
                assert "wait_for_door" in every.values()[1]
                await door.slice(procs=1).open.call_one()
            assert results == [1, 1, 1]
            # (a reply may be on its way while its handler's bookkeeping ends)
            done = _waiter(await _until(procs, lambda a: _waiter(a)["running"] == 0))
            assert (done["queued"], done["now"]) == (0, [])
            with pytest.raises(IndexError):
                await procs.stacks(2)


class Stuck(Actor):
    """Its endpoint holds the event loop's thread in a synchronous call."""

    @endpoint
    def hold(self, started: str, release: str) -> None:
        Path(started).touch()
        _hold_until(release)


def _hold_until(release: str) -> None:
    while not os.path.exists(release):
        time.sleep(0.01)


#: the line the stuck rank is on
_HELD_AT = f"line {_hold_until.__code__.co_firstlineno + 2}, in _hold_until"


async def test_stacks_of_a_rank_stuck_in_a_sync_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose event loop is held by a synchronous call still shows its stacks
    (taken by a signal, and said so), the user's frames first: procs.stacks(), `amesh
    stacks`; `amesh list` shows it busy. A rank whose loop answers answers itself."""
    monkeypatch.setenv("AMESH_STATE_DIR", str(tmp_path))
    started, release = tmp_path / "started", tmp_path / "release"
    with anyio.fail_after(90):
        async with ProcMesh({"procs": 2}, name="stuck") as procs:
            stuck = await procs.spawn("stuck", Stuck)
            async with anyio.create_task_group() as tg:
                tg.start_soon(stuck.slice(procs=1).hold.call_one, str(started), str(release))
                while not started.exists():  # noqa: ASYNC110  (another process's file)
                    await anyio.sleep(0.01)
                text = await procs.stacks(1)
                assert "did not answer within 2 s: stacks taken by a signal" in text, text
                lines = text.splitlines()
                assert lines[1].startswith("--- thread") and "(main" in lines[1], text
                assert _HELD_AT in "\n".join(lines[:8]), text
                assert "in hold\n    _hold_until(release)" in text, text
                assert "_mailbox.py" not in text and "frames of " in text, text
                full = await procs.stacks(1, full=True)
                assert _HELD_AT in full and "_mailbox.py" in full, full
                assert "taken by a signal" not in (await procs.stacks()).values()[0]
                p1 = procs.pids[1]
                listed = await _amesh("list")
                assert f"1: pid {p1}  busy: its event loop did not answer" in listed, listed
                assert "`amesh stacks stuck 1` shows where" in listed, listed
                out = await _amesh("stacks", "stuck", "1")
                assert f"=== stuck rank 1 (pid {p1})" in out and _HELD_AT in out, out
                assert "taken by a signal" in out, out
                release.touch()


async def _append(results: list[int], call: Any) -> None:
    results.append(await call)


async def _amesh(*args: str) -> str:
    out = await anyio.run_process([sys.executable, "-m", "amesh", *args], check=False)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode()


async def test_amesh_list_stacks_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A controller's live mesh is in the registry while it runs: `amesh list` (and
    --json) shows its pids and the endpoint running, `amesh stacks` the blocked
    handler's frame; the file is gone once the mesh stops."""
    monkeypatch.setenv("AMESH_STATE_DIR", str(tmp_path))
    registry = tmp_path / "meshes" / f"{os.getpid()}.json"
    with anyio.fail_after(120):
        async with ProcMesh({"procs": 2}, name="watched") as procs:
            waiters = await procs.spawn("waiters", Waiter)
            door = await procs.spawn("door", Doorman)
            assert registry.stat().st_mode & 0o777 == 0o600
            record = json.loads(registry.read_text())
            assert [m["name"] for m in record["meshes"]] == ["watched"]
            assert record["meshes"][0]["actors"] == ["waiters", "door"]
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiters.slice(procs=1).wait_for_door.call_one)
                await _until(procs, lambda a: _waiter(a)["running"] == 1)
                listed = await _amesh("list")
                assert f"watched  {{procs: 2}}  controller pid {os.getpid()}" in listed, listed
                assert "actor meshes: waiters, door" in listed, listed
                p0, p1 = procs.pids
                assert f"0: pid {p0}  queued=0 running=0  now: idle" in listed, listed
                assert f"1: pid {p1}  queued=0 running=1  now: waiters.wait_for_door" in listed
                assert "no persistent meshes" in listed, listed
                raw = json.loads(await _amesh("list", "--json"))
                (live,) = raw["live"]
                assert live["name"] == "watched" and live["pids"] == procs.pids
                assert live["ranks"][1]["actors"][0]["now"] == ["wait_for_door"]
                assert raw["persistent"] == {}
                stacks = await _amesh("stacks", "watched", "1")
                assert f"=== watched rank 1 (pid {p1})" in stacks and "wait_for_door" in stacks
                assert "rank 0" not in stacks
                await door.say.call("hello")
                await door.slice(procs=1).say.call_one("bye")
                logs = await _amesh("logs", "watched")
                assert sorted(logs.splitlines()[:2]) == ["[door 0] hello", "[door 1] hello"]
                assert logs.splitlines()[2:] == ["[door 1] bye"], logs
                assert await _amesh("logs", "watched", "-n", "1") == "[door 1] bye\n"
                ones = await _amesh("logs", "watched", "--rank", "1")
                assert ones == "[door 1] hello\n[door 1] bye\n", ones
                cmd = [sys.executable, "-m", "amesh", "logs", "watched", "-n", "1", "-f"]
                async with await anyio.open_process(cmd, stderr=None) as follower:
                    assert follower.stdout is not None
                    seen = b""
                    while b"\n" not in seen:  # the last line: it follows from there
                        seen += await follower.stdout.receive()
                    await door.slice(procs=0).say.call_one("later")
                    while b"[door 0] later\n" not in seen:
                        seen += await follower.stdout.receive()
                    assert seen == b"[door 1] bye\n[door 0] later\n", seen
                    follower.terminate()
                await door.slice(procs=1).open.call_one()
            assert registry.exists()
        assert not registry.exists()
        assert "no live meshes" in await _amesh("list")
        out = await anyio.run_process(
            [sys.executable, "-m", "amesh", "stacks", "watched"], check=False
        )
        assert out.returncode == 1 and b"no live mesh named 'watched'" in out.stderr


async def test_amesh_stop_of_a_live_mesh_that_is_not_persistent_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36, item 19: `amesh stop NAME` of a live mesh that is not persistent said
    `no persistent mesh named 'NAME' on this machine (there are: none)`."""
    monkeypatch.setenv("AMESH_STATE_DIR", str(tmp_path))
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}, name="live") as procs:
            out = await anyio.run_process(
                [sys.executable, "-m", "amesh", "stop", "live"], check=False
            )
            assert out.returncode == 1
            assert out.stderr.decode() == (
                "amesh stop: 'live' is not a persistent mesh but a live one, of controller "
                f"pid {os.getpid()}: it stops with its controller (procs.stop() there, or "
                "end that program)\n"
            )
            assert len(await procs.status()) == 1  # untouched
        out = await anyio.run_process([sys.executable, "-m", "amesh", "stop", "live"], check=False)
        assert b"no persistent mesh named 'live'" in out.stderr  # once it is gone


async def test_stale_registry_files_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file of a controller that is gone (killed) is ignored and removed."""
    monkeypatch.setenv("AMESH_STATE_DIR", str(tmp_path))
    with anyio.fail_after(60):
        dead = await anyio.run_process([sys.executable, "-c", "import os; print(os.getpid())"])
        stale = tmp_path / "meshes" / f"{int(dead.stdout)}.json"
        stale.parent.mkdir(mode=0o700)
        stale.write_text(json.dumps({"pid": int(dead.stdout), "key": "00", "meshes": []}))
        assert "no live meshes" in await _amesh("list")
        assert not stale.exists()


def test_an_unlisted_mesh_is_written_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within _registry.unlisted() (the zygote's rehearsal) a mesh that starts is in no
    file that `amesh list` or `amesh stop` would find; after it, meshes are written."""
    from amesh._mesh import _registry

    monkeypatch.setenv("AMESH_STATE_DIR", str(tmp_path))
    registry = tmp_path / "meshes" / f"{os.getpid()}.json"

    class Stub:
        def listing(self) -> dict[str, Any]:
            return {"name": "stub"}

    stub = Stub()
    with _registry.unlisted():
        _registry.update(stub)
        assert not registry.exists()
        _registry.forget(stub)
    _registry.update(stub)
    try:
        assert [m["name"] for m in json.loads(registry.read_text())["meshes"]] == ["stub"]
    finally:
        _registry.forget(stub)
    assert not registry.exists()
