"""``breakpoint()`` in an endpoint: a pdb session at the controller's terminal (through a
pseudo-terminal), with ``amesh.debug()`` or ``amesh debug`` in another terminal."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pexpect
import pytest

from amesh import _debug
from amesh._transport import CHALLENGE_LEN, Gate, Refused
from amesh._transport._stream_framing import fresh_address, parse_address

#: How long any one expected output may take (a worker starts in well under this).
EXPECT = 30
PROMPT = r"\(Pdb\) "

CONTROLLER = """
import os
import sys

import anyio

import amesh

STOP = {int(r) for r in sys.argv[1].split(",")}


class W(amesh.Actor):
    def __init__(self) -> None:
        self.n = 41

    @amesh.endpoint
    async def work(self, x: int) -> int:
        self.n += x
        if amesh.current_rank().rank in STOP:
            breakpoint()  # the pause
        y = self.n + 1
        return y


class E(amesh.Actor):
    @amesh.endpoint
    async def ping(self, x: int) -> str:
        await anyio.sleep(0)
        return f"pong {x} from pid {os.getpid()}"


async def main() -> None:
    async with amesh.ProcMesh(per_host={"procs": 2}) as procs:
        print("pids:", *procs.pids, flush=True)
        w = await procs.spawn("w", W)
        e = await procs.spawn("e", E)
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                values = list((await w.work.call(1)).values())
                print(f"result: {values}", flush=True)  # one write: the debugger prints too

            tg.start_soon(call)
            if sys.argv[2] == "debug":
                await amesh.debug()
            elif sys.argv[2] == "debug-on-enter":  # once the test saw every rank pause
                await anyio.to_thread.run_sync(sys.stdin.readline)
                await amesh.debug()
                await amesh.debug()
            elif sys.argv[2] == "serve":  # once the test saw the rank pause
                await anyio.to_thread.run_sync(sys.stdin.readline)
                for x in range(3):  # another actor of the paused process
                    print(await e.slice(procs=1).ping.call_one(x), flush=True)
                await amesh.debug()


amesh.run(main)
"""


Start = Callable[[str, str], pexpect.spawn]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def _spawn(argv: list[str], tmp_path: Path, state: Path) -> pexpect.spawn:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONBREAKPOINT", "AMESH_OUTPUT")}
    env["AMESH_STATE_DIR"] = str(state)
    with warnings.catch_warnings():
        # 3.12+ warns of forkpty() in a process with threads (this test process has
        # anyio's); pexpect's child only sets its terminal up and execs
        warnings.filterwarnings("ignore", r".*use of forkpty\(\)", DeprecationWarning)
        child = pexpect.spawn(
            sys.executable,
            argv,
            cwd=str(tmp_path),
            env=env,
            timeout=EXPECT,
            encoding="utf-8",
            dimensions=(50, 200),
        )
    child.logfile_read = sys.stdout  # shown when a test fails
    return child


@pytest.fixture
def controller(tmp_path: Path, state: Path) -> Iterator[Start]:
    """Starts ``controller.py STOP MODE`` in a pseudo-terminal: ``.start(stop, mode)``."""
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    children: list[pexpect.spawn] = []

    def start(stop: str, mode: str) -> pexpect.spawn:
        child = _spawn([str(script), stop, mode], tmp_path, state)
        children.append(child)
        return child

    yield start
    for child in children:
        child.close(force=True)


def _breakpoint_line() -> int:
    return CONTROLLER.splitlines().index("            breakpoint()  # the pause") + 1


#: where pdb stands once ``breakpoint()`` returned control: at the next line up to 3.12,
#: at the call's own line from 3.13 on ("breakpoint() ... now enter the debugger
#: immediately"); amesh reports the call's line either way
_STOPS_AT_CALL = sys.version_info >= (3, 13)


def _stop_line() -> int:
    return _breakpoint_line() + (0 if _STOPS_AT_CALL else 1)


def _source(line: int) -> str:
    """Line ``line`` of the controller, stripped, as a pattern."""
    return re.escape(CONTROLLER.splitlines()[line - 1].strip())


def _worker_pids(child: pexpect.spawn) -> list[int]:
    child.expect(r"pids: ([\d ]+)\r\n")
    return [int(p) for p in child.match.group(1).split()]


def _finish(child: pexpect.spawn, pids: list[int]) -> None:
    """The call returns its normal values, the controller exits 0, no worker is left."""
    child.expect(pexpect.EOF)
    assert "result: [43, 43]" in child.before
    child.close()
    assert child.exitstatus == 0
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), pid


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _pdb_session(child: pexpect.spawn) -> None:
    """list, print, next and continue in the session of a rank paused at the pause."""
    line, stop = _breakpoint_line(), _stop_line()
    child.expect(PROMPT)
    child.sendline("l")
    child.expect(rf"{line}\s+(->\s+)?breakpoint\(\)  # the pause")
    child.expect(PROMPT)
    child.sendline("p self.n")
    child.expect(r"\r\n42\r\n")
    child.expect(PROMPT)
    child.sendline("n")
    child.expect(rf"controller\.py\({stop + 1}\)work\(\)")
    child.expect(rf"-> {_source(stop + 1)}")
    child.expect(PROMPT)
    child.sendline("c")


@pytest.mark.timeout(120)
def test_a_breakpoint_is_debugged_at_the_controller(controller: Start) -> None:
    child = controller("1", "debug")
    pids = _worker_pids(child)
    child.expect(rf"w\[1\] at controller\.py:{_breakpoint_line()}")
    _pdb_session(child)
    _finish(child, pids)
    assert "amesh: w[1] at controller.py" in child.before  # "... goes on"


@pytest.mark.timeout(120)
def test_next_past_the_return_ends_the_session(controller: Start) -> None:
    """``n`` over the endpoint's last lines and past its return leaves the debugger,
    as the handler ends: amesh's frames (the greenlet that drove the coroutine, its
    StopIteration) are not stepped into."""
    child = controller("1", "debug")
    pids = _worker_pids(child)
    child.expect(PROMPT)
    for _ in range(5):  # (y = ..., return y, past it)
        child.sendline("n")
        if child.expect([PROMPT, r"amesh: the handler ended"]) == 1:
            break
    else:
        raise AssertionError("still in the debugger after 5 'n'")
    seen = child.before
    child.expect(pexpect.EOF)
    seen += child.before
    child.close()
    assert child.exitstatus == 0
    assert "result: [43, 43]" in seen
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), pid
    assert "StopIteration" not in seen and "_pausable.py" not in seen, seen


@pytest.mark.timeout(120)
def test_ranks_paused_at_once_are_listed_and_one_is_chosen(controller: Start) -> None:
    child = controller("0,1", "debug-on-enter")
    pids = _worker_pids(child)
    paused = set()
    while len(paused) < 2:
        child.expect(r"amesh: w\[(\d)\] at controller\.py:\d+ paused")
        paused.add(child.match.group(1))
    child.sendline("")  # both paused: the script calls amesh.debug()
    line = _breakpoint_line()
    listed = {}
    for _ in range(2):
        child.expect(rf"  (\d)\. w\[(\d)\] at controller\.py:{line} \(pid \d+")
        listed[child.match.group(2)] = child.match.group(1)
    child.expect(r"attach to \[1-2")
    child.sendline(listed["1"])
    child.expect(r"attached to w\[1\]")
    _pdb_session(child)
    # the second amesh.debug(): only rank 0 is left, attached at once
    child.expect(r"attached to w\[0\]")
    child.expect(PROMPT)
    child.sendline("c")
    _finish(child, pids)


@pytest.mark.timeout(120)
def test_other_actors_of_a_paused_process_keep_serving(controller: Start) -> None:
    child = controller("1", "serve")
    pids = _worker_pids(child)
    child.expect(r"amesh: w\[1\] at controller\.py:\d+ paused")
    child.sendline("")
    for x in range(3):  # answered by the process whose handler is paused
        child.expect(rf"pong {x} from pid {pids[1]}\r\n")
    child.expect(r"attached to w\[1\]")
    _pdb_session(child)
    _finish(child, pids)


def _announced(state: Path) -> tuple[Path, dict[str, object]]:
    (path,) = (state / "debug").glob("*.json")
    return path, json.loads(path.read_text())


def _cli_session(tmp_path: Path, state: Path, cli: pexpect.spawn | None = None) -> None:
    """`amesh debug` (or ``cli``, one already started) attaches to w[0], and ends with
    its session."""
    cli = cli or _spawn(["-m", "amesh", "debug"], tmp_path, state)
    try:
        cli.expect(rf"attached to w\[0\] at controller\.py:{_breakpoint_line()}")
        cli.expect(rf"-> {_source(_stop_line())}\r\n{PROMPT}")  # untouched: still at the pause
        cli.sendline("p self.n")
        cli.expect(r"\r\n42\r\n")
        cli.expect(PROMPT)
        cli.sendline("c")
        cli.expect(pexpect.EOF)
        cli.close()
        assert cli.exitstatus == 0
    finally:
        cli.close(force=True)


@pytest.mark.timeout(120)
def test_amesh_debug_attaches_from_another_terminal(
    controller: Start,
    tmp_path: Path,
    state: Path,
) -> None:
    child = controller("0", "wait")
    pids = _worker_pids(child)
    child.expect(r"amesh: w\[0\] at controller\.py:\d+ paused")
    path, _ = _announced(state)
    assert path.stat().st_mode & 0o777 == 0o600
    _cli_session(tmp_path, state)
    _finish(child, pids)
    assert not path.exists()


@pytest.mark.timeout(120)
def test_amesh_debug_waits_for_a_rank_to_pause(
    controller: Start,
    tmp_path: Path,
    state: Path,
) -> None:
    """Issue 36, item 19: `amesh debug` exited at once when no rank was paused; with
    --wait it waits, here from before the controller started."""
    cli = _spawn(["-m", "amesh", "debug", "--wait"], tmp_path, state)
    try:
        cli.expect("amesh debug: waiting for a rank to pause")
        child = controller("0", "wait")
        pids = _worker_pids(child)
        _cli_session(tmp_path, state, cli)
        _finish(child, pids)
    finally:
        cli.close(force=True)
    late = _spawn(["-m", "amesh", "debug", "--wait", "0.2"], tmp_path, state)
    late.expect(r"no rank of yours paused within 0\.2 s \(--wait\)")
    late.expect(pexpect.EOF)
    late.close()
    assert late.exitstatus == 1


@pytest.mark.timeout(120)
def test_the_listener_refuses_peers_without_the_key(
    controller: Start,
    tmp_path: Path,
    state: Path,
) -> None:
    child = controller("0", "wait")
    pids = _worker_pids(child)
    child.expect(r"amesh: w\[0\] at controller\.py:\d+ paused")
    _, entry = _announced(state)
    address = str(entry["address"])
    # this process holds another job key than the controller's
    with pytest.raises(Refused):
        _debug._conn._dial(address)
    # a peer that skips the handshake: its lines never reach the paused pdb
    family, sockaddr = parse_address(address)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(EXPECT)
        sock.connect(sockaddr)
        assert len(sock.recv(CHALLENGE_LEN)) > 0
        with contextlib.suppress(ConnectionError):  # refused: closed, maybe mid-send
            sock.sendall(b'{"role": "client"}\n{"op": "attach", "id": 1}\nc\n')
            while sock.recv(4096):
                pass  # until the listener closes the connection
    _cli_session(tmp_path, state)
    _finish(child, pids)


@pytest.mark.timeout(30)
def test_a_worker_refuses_a_listener_without_the_key() -> None:
    """An impostor at the address takes the worker's answer but cannot prove itself."""
    address = fresh_address("abstract")
    family, sockaddr = parse_address(address)
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind(sockaddr)
    listener.listen(1)

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            gate = Gate(address)
            conn.sendall(gate.challenge)
            conn.recv(4096)  # the answer and the nonce
            conn.sendall(b"\0" * 32)  # not a proof
            conn.recv(4096)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(Refused, match="did not prove"):
            _debug._conn._dial(address)
    finally:
        thread.join(EXPECT)
        listener.close()


DEEP = """
import os
import sys

import anyio

import amesh


def deeper(x: int) -> int:
    breakpoint()  # the deep pause
    return x + 1


class W(amesh.Actor):
    @amesh.endpoint
    def step(self, x: int) -> int:
        return deeper(x)


class E(amesh.Actor):
    @amesh.endpoint
    async def ping(self, x: int) -> str:
        return f"pong {x} from pid {os.getpid()}"


async def main() -> None:
    async with amesh.ProcMesh(per_host={"procs": 1}) as procs:
        print("pids:", *procs.pids, flush=True)
        w = await procs.spawn("w", W)
        e = await procs.spawn("e", E)
        for turn in range(2):
            async with anyio.create_task_group() as tg:

                async def call() -> None:
                    print(f"result {turn}: {await w.step.call_one(41)}", flush=True)

                tg.start_soon(call)
                await anyio.to_thread.run_sync(sys.stdin.readline)  # the test saw it pause
                with anyio.move_on_after(0.5 if turn == 0 else EXPECT) as waited:
                    print(await e.ping.call_one(turn), flush=True)
                if waited.cancelled_caught:
                    print(f"ping {turn} waits", flush=True)
                await amesh.debug()


amesh.run(main)
"""


@pytest.mark.timeout(120)
def test_a_breakpoint_below_an_endpoint_holds_the_loop_once(tmp_path: Path, state: Path) -> None:
    """An endpoint without ``breakpoint()`` in its own code runs without a greenlet: a
    pause in a function it calls holds its process (another actor's call there waits),
    the worker says so, and from then on the endpoint pauses alone."""
    script = tmp_path / "controller.py"
    script.write_text(DEEP.replace("EXPECT", str(EXPECT)))
    child = _spawn([str(script)], tmp_path, state)
    try:
        (pid,) = _worker_pids(child)
        for turn in range(2):
            child.expect(r"amesh: w\[0\] at controller\.py:\d+ paused")
            child.sendline("")
            if turn == 0:  # the process serves nothing while the handler is paused
                child.expect(r"ping 0 waits\r\n")
            else:  # the endpoint now has a greenlet: the pause holds it alone
                child.expect(rf"pong 1 from pid {pid}\r\n")
            child.expect(r"attached to w\[0\]")
            child.expect(PROMPT)
            child.sendline("p x")
            child.expect(r"\r\n41\r\n")
            child.expect(PROMPT)
            child.sendline("c")
            if turn == 0:  # printed by the handler: before its result
                child.expect(r"paused outside a greenlet: this process serves nothing else")
            child.expect(rf"result {turn}: 42\r\n")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    finally:
        child.close(force=True)


def test_may_pause_reads_the_code_of_an_endpoint() -> None:
    import functools
    import pdb

    from amesh._runtime import may_pause

    def plain(x: int) -> int:
        return x + 1

    def pauses(x: int) -> int:
        breakpoint()
        return x

    def traces() -> None:
        pdb.set_trace()

    def nested() -> object:
        return lambda: breakpoint()

    @functools.wraps(pauses)
    def wrapper(x: int) -> int:
        return pauses(x)

    class Callable_:
        def __call__(self) -> None:
            breakpoint()

    assert not may_pause(plain)
    assert not may_pause(lambda: None)
    assert may_pause(pauses)
    assert may_pause(traces)
    assert may_pause(nested)
    assert may_pause(wrapper)  # what it wraps pauses
    assert may_pause(Callable_())
    assert may_pause(len)  # no Python code to read: assume it may
