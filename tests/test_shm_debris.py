"""No shared-memory debris: segments go when their message is abandoned, when their
maker exits or is killed, and at the next ProcMesh start for makers that are dead."""

from __future__ import annotations

import os
import pickle
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from amesh import ProcMesh, _identity, _wire
from amesh._wire import _segments
from amesh.testing._leaks import descendant_pids

from .shm_debris_helper import MIB, Echo

pytestmark = pytest.mark.timeout(120)

HELPER = str(Path(__file__).with_name("shm_debris_helper.py"))
#: Seeds of the random kill test; each round draws its victim and kill point from one.
SEED = 20240613
ROUNDS = 16
#: Round trips to wait for (at most) before a kill.
MAX_AFTER = 40


@pytest.fixture(autouse=True)
def _release() -> Iterator[None]:
    """A failing test must not fail the next ones by leaving its own segments behind."""
    yield
    _wire.release_segments()


def job_segments(
    where: str | None = None, job: str | None = None, pooled: bool = False
) -> set[str]:
    """The segments of job ``job`` (this process's by default) in ``where``; without
    ``pooled``, not those handed back to a live sender for its next message (``.free``:
    they go when its runtime closes, which the leak check after each test sees)."""
    prefix = f"amesh-{job}-" if job is not None else _wire.segment_prefix()
    try:
        names = os.listdir(where or _wire.shm_dir())
    except FileNotFoundError:
        return set()
    return {n for n in names if n.startswith(prefix) and (pooled or not n.endswith(".free"))}


# -- names and the cleanup functions, in this process ----------------------------------


def own_owner() -> tuple[int, int, int]:
    pid, start, ns = (int(x) for x in _wire.this_process().split("."))
    return pid, start, ns


def segment_name(job: str, pid: int, start: int, ns: int, n: int = 0) -> str:
    return f"amesh-{job}-{pid}.{start}.{ns}-{n}-{os.urandom(4).hex()}"


def free_pid() -> int:
    """A pid that no process has: pids stay below pid_max."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def test_segment_names_say_job_and_owner() -> None:
    p = _wire.dumps((bytes(2 * MIB), bytearray(MIB)), shm=True)
    assert len(p.segments) == 2
    pid, start, ns = own_owner()
    assert pid == os.getpid() and start > 0 and ns > 0
    with open("/proc/self/stat", "rb") as f:
        assert int(f.read().rsplit(b")", 1)[1].split()[19]) == start
    for path in p.segments:
        where, name = os.path.split(path)
        assert where == _wire.shm_dir()
        assert name.startswith(f"{_wire.segment_prefix()}{pid}.{start}.{ns}-")
    assert len(_identity.job_id()) == 10 and _identity.job_id().isdigit()
    assert _wire.release_payload(p) == 2
    assert _wire.release_payload(p) == 0
    assert job_segments() == set()


def test_sweep_removes_only_segments_of_ended_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMESH_SHM_DIR", str(tmp_path))
    job = _identity.job_id()
    pid, start, ns = own_owner()
    gone = free_pid()
    kept = {
        segment_name(job, pid, start, ns),  # this live process
        segment_name("0000000001", pid, start, ns),  # of another job, alive
        segment_name(job, gone, start, ns + 1),  # another pid namespace: cannot tell
        f"amesh-{pid}-3-0123abcd",  # the old naming, its pid in use
        f"amesh-{gone}-x-0123abcd",  # not a segment name
        "amesh-test-shm-abc",
        "other-file",
    }
    removed = {
        segment_name(job, gone, start, ns),  # its pid is free
        segment_name("0000000001", pid, start + 1, ns, 7),  # its pid was reused since
        f"amesh-{gone}-3-0123abcd",  # the old naming, its pid free
    }
    for name in kept | removed:
        (tmp_path / name).write_bytes(b"x")
    # what is not a plain file is never touched
    specials = {segment_name(job, gone, start, ns, 1), segment_name(job, gone, start, ns, 2)}
    a_dir, a_link = sorted(specials)
    (tmp_path / a_dir).mkdir()
    target = tmp_path / "target"
    target.write_bytes(b"x")
    (tmp_path / a_link).symlink_to(target)
    assert _wire.sweep_segments() == len(removed)
    assert set(os.listdir(tmp_path)) == kept | specials | {"target"}
    assert _wire.sweep_segments() == 0


def test_remove_segments_of_spares_a_reused_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMESH_SHM_DIR", str(tmp_path))
    job = _identity.job_id()
    pid, start, ns = own_owner()
    live = segment_name(job, pid, start, ns)
    earlier = segment_name(job, pid, start - 1, ns)  # a process with this pid before us
    other = segment_name(job, free_pid(), start, ns)
    for name in (live, earlier, other):
        (tmp_path / name).write_bytes(b"x")
    assert _wire.remove_segments_of(pid) == 1
    assert set(os.listdir(tmp_path)) == {live, other}


def test_remove_segments_of_catches_a_segment_handed_back_after_the_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver loading a pooled segment of a process that was just killed renames it
    ``.free`` (back to its sender) between the cleanup's listing and its unlink: the
    cleanup removes it under that name."""
    monkeypatch.setenv("AMESH_SHM_DIR", str(tmp_path))
    job = _identity.job_id()
    _, start, ns = own_owner()
    gone = free_pid()
    loaded, unread, back = (segment_name(job, gone, start, ns, n) for n in range(3))
    for name in (loaded, unread):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / (back + ".free")).write_bytes(b"x")  # handed back before the listing
    listdir = os.listdir

    def listing_then_a_receiver_renames(where: str) -> list[str]:
        names = listdir(where)
        os.rename(tmp_path / loaded, tmp_path / (loaded + ".free"))
        return names

    monkeypatch.setattr(_segments.os, "listdir", listing_then_a_receiver_renames)
    assert _wire.remove_segments_of(gone) == 3
    assert listdir(tmp_path) == []


def reference(path: str) -> bytes:
    """A pickle that loads segment ``path``, as dumps() writes it."""
    return pickle.PROTO + bytes((5,)) + _segments.segment_ref(path, 0) + pickle.STOP


def test_discard_segments_unlinks_only_this_jobs_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _wire.dumps({"a": bytes(2 * MIB), "b": [bytearray(MIB)], "small": b"s"}, shm=True)
    assert len(job_segments()) == 2
    assert _wire.discard_segments(memoryview(p.data)) == 2
    assert job_segments() == set()
    assert _wire.discard_segments(p.data) == 0  # gone already
    assert _wire.discard_segments(_wire.dumps(bytes(2 * MIB)).data) == 0  # none in it
    assert _wire.release_segments() == 0  # forgotten too

    where = tmp_path / "shm"
    where.mkdir()
    monkeypatch.setenv("AMESH_SHM_DIR", str(where))
    pid, start, ns = own_owner()
    ours = segment_name(_identity.job_id(), pid, start, ns)
    elsewhere = tmp_path / ours  # named like ours, but not in shm_dir()
    foreign = segment_name("0000000001", pid, start, ns)  # another job's
    for path in (where / ours, elsewhere, where / foreign, where / "amesh-victim"):
        path.write_bytes(b"x")
    for bad in (elsewhere, where / foreign, where / "amesh-victim", f"{where}/./{ours}"):
        assert _wire.discard_segments(reference(str(bad))) == 0
    assert sorted(os.listdir(where)) == sorted([ours, foreign, "amesh-victim"])
    # bytes that only look like a reference count only when complete
    assert _wire.discard_segments(reference(str(where / ours))[:-3]) == 0
    assert _wire.discard_segments(reference(str(where / ours))) == 1
    assert os.path.exists(elsewhere) and not os.path.exists(where / ours)
    # a path of 256 bytes or more is written with another opcode (BINUNICODE)
    long_dir = where / ("d" * 250)
    long_dir.mkdir()
    monkeypatch.setenv("AMESH_SHM_DIR", str(long_dir))
    p = _wire.dumps(bytes(2 * MIB), shm=True)
    assert len(p.segments[0]) >= 256
    assert _wire.discard_segments(p.data) == 1
    assert os.listdir(long_dir) == []


# -- abandoned calls, with real workers ------------------------------------------------


@pytest.mark.anyio
async def test_late_replies_of_timed_out_calls_leave_no_segments(tmp_path: Path) -> None:
    """A sync handler returns 8 MiB after its caller gave up: the reply arrives late and
    is dropped, and its segment goes with it."""
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            slow = await procs.spawn("slow", Echo)
            worker = await slow.ping.call_one()
            assert job_segments() == set()
            for i in range(3):
                gate = tmp_path / f"gate-{i}"
                try:
                    with pytest.raises(TimeoutError):
                        # blocks until the gate exists, made only after the timeout
                        await slow.big_when_released.options(timeout=0.2).call_one(
                            str(gate), 8 * MIB
                        )
                finally:
                    gate.touch()
                # The worker runs one call at a time and its frames reach us in order:
                # once this answers, the late reply has arrived and was dropped.
                assert await slow.ping.call_one() == worker
                assert job_segments() == set(), f"after {i + 1} late replies"


@pytest.mark.anyio
async def test_abandoned_arguments_leave_no_segments(tmp_path: Path) -> None:
    """A call whose worker is busy times out before its 8 MiB argument was loaded: the
    caller removes the segment it made for it."""
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            busy = await procs.spawn("busy", Echo)
            gate = tmp_path / "gate"
            try:
                with pytest.raises(TimeoutError):
                    await busy.big_when_released.options(timeout=0.2).call_one(str(gate), 1)
                # the worker's event loop is blocked until the gate opens: it cannot
                # load this argument
                with pytest.raises(TimeoutError):
                    await busy.take.options(timeout=0.2).call_one(bytes(8 * MIB))
                assert job_segments() == set()
            finally:
                gate.touch()
            assert await busy.take.call_one(bytes(8 * MIB)) == 8 * MIB
            assert job_segments() == set()


# -- killed controllers and workers ----------------------------------------------------


class Lines:
    """Lines of a child's stdout, each read under a deadline (no sleeping)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.buf = b""
        self.eof = False
        self.seen: list[str] = []

    def next(self, timeout: float = 30.0) -> str | None:
        """The next line; None at the end of the output."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no output for {timeout} s after {self.seen[-5:]}")
            chunk = os.read(self.fd, 65536)
            self.eof = not chunk
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        text = line.decode()
        self.seen.append(text)
        return text

    def expect(self, word: str) -> list[str]:
        line = self.next()
        assert line is not None and line.split()[0] == word, (
            f"expected {word!r}, got {line!r} after {self.seen[-5:]}"
        )
        return line.split()[1:]

    def rest(self) -> list[str]:
        out: list[str] = []
        while (line := self.next()) is not None:
            out.append(line)
        return out


def wait_gone(pidfds: dict[int, int], timeout: float) -> None:
    """Wait until every process (by pidfd) has exited."""
    deadline = time.monotonic() + timeout
    for pid, fd in pidfds.items():
        left = max(0.0, deadline - time.monotonic())
        assert select.select([fd], [], [], left)[0], f"process {pid} did not exit"


def open_pidfds(pids: set[int]) -> dict[int, int]:
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
    return fds


def controller_env(tmp_path: Path, shm: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    # A killed controller's segments are removed by its zygote, which outlives it
    # (exec'd workers die with it, and nobody is left: the next mesh's sweep is).
    env["AMESH_ZYGOTE"] = "1"
    ipc = tmp_path / "ipc"
    ipc.mkdir(mode=0o700, exist_ok=True)
    env["AMESH_IPC_DIR"] = str(ipc)
    env.pop("AMESH_SHM_DIR", None)
    if shm is not None:
        env["AMESH_SHM_DIR"] = str(shm)
    return env


def start_controller(env: dict[str, str]) -> None:
    """A fresh controller that starts a mesh (and so sweeps) and exits."""
    out = subprocess.run(
        [sys.executable, HELPER, "start"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.split() == [b"started"], out


def kill_round(
    env: dict[str, str], how: str, after: int, rng: random.Random
) -> tuple[str, set[str]]:
    """Run a traffic controller and kill ``how`` after ``after`` round trips; wait until
    every process of the job has exited. Returns the job id and its segments just
    before the kill (none when it was killed starting)."""
    proc = subprocess.Popen(
        [sys.executable, HELPER, "traffic"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        bufsize=0,
    )
    pidfds: dict[int, int] = {}
    try:
        lines = Lines(proc)
        (job,) = lines.expect("job")
        held: set[str] = set()
        if how == "controller-starting":
            pidfds = open_pidfds({proc.pid} | descendant_pids(proc.pid))
            proc.kill()
        else:
            workers = [int(p) for p in lines.expect("pids")]
            for _ in range(after):
                lines.expect("done")
            # the zygote and the workers, before anything dies: pidfds are for good
            pidfds = open_pidfds({proc.pid} | descendant_pids(proc.pid))
            assert set(workers) <= set(pidfds)
            if how == "controller":
                held = job_segments(env.get("AMESH_SHM_DIR", "/dev/shm"), job, pooled=True)
                proc.kill()
            elif how == "worker":
                os.kill(rng.choice(workers), signal.SIGKILL)
            else:
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
        rest = lines.rest()
        proc.wait(timeout=60)
        wait_gone(pidfds, 30)
        if how.startswith("worker"):
            # the controller saw it, stopped its mesh and exited by itself
            assert proc.returncode == 0 and rest and rest[-1].startswith("failed"), rest[-3:]
        return job, held
    finally:
        for fd in pidfds.values():
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_random_kills_leave_no_debris(tmp_path: Path) -> None:
    """Whoever is killed, once every process of the job has exited nothing of it is
    left, with no later amesh program to sweep: a killed worker's segments go with its
    controller's mesh, a killed controller's (and its workers') with its zygote."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = controller_env(tmp_path, shm)
    before = set(os.listdir(shm))
    kinds = ["controller", "controller", "controller-starting", "worker", "workers"]
    for i in range(ROUNDS):
        rng = random.Random(SEED + i)
        how, after = rng.choice(kinds), rng.randrange(MAX_AFTER + 1)
        what = f"round {i} (seed {SEED + i}): kill {how} after {after} round trips"
        kill_round(env, how, after, rng)
        debris = set(os.listdir(shm)) - before
        assert debris == set(), f"{what}: left {sorted(debris)}"
    start_controller(env)  # (a mesh still starts there, and leaves nothing either)
    assert set(os.listdir(shm)) == before


def test_a_killed_controller_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    """The same with the default directory, /dev/shm, shared with whatever else runs:
    the killed controller held segments (its own, its workers', pooled ones handed
    back) and had calls in flight; once its workers and zygote have exited, none of
    its job's segments is there, and no other amesh program ran meanwhile."""
    env = controller_env(tmp_path, None)
    job, held = kill_round(env, "controller", 5, random.Random(SEED))
    assert len(held) >= 3, held  # one held by each worker and by the controller
    assert job_segments("/dev/shm", job, pooled=True) == set()
