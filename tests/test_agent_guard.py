"""A host agent under a flood of connections that never prove themselves: idle TCP
connections and a slowloris ClientHello. The agent shuts them down (by its handshake
deadline, its caps, its reserve of descriptors), a controller still attaches and
starts workers meanwhile, and the agent's log stays a few lines long."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import anyio
import pytest

import amesh
from amesh._runtime import open_runtime
from amesh._transport import open_tls, open_transport

from .actors import Counter
from .test_agent import free_port, shared_key

pytestmark = pytest.mark.anyio

#: Per scheme: the agent's descriptor limit (hard: it cannot raise it), and the idle
#: connections from each of several loopback addresses. tcp (TLS): more than the limit
#: holds, each address under the cap per address (the deadline and the reserve shut
#: them down); stream+tcp: more than the cap in all (512).
_FLOOD = {"tcp": (400, 20, 25), "stream+tcp": (1024, 40, 20)}
#: The start of a TLS ClientHello, sent a byte at a time.
_HELLO = bytes.fromhex("16030100f4010000f00303") + bytes(64)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the agent is one program (as in test_agent)


class _Agent:
    """An ``amesh agent`` with a low descriptor limit and a 1 s handshake deadline,
    its log collected by a thread."""

    def __init__(self, key: Path, scheme: str, fds: int) -> None:
        self.port = free_port()
        self.addr = f"{scheme}://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "amesh", "agent", "--listen", self.addr]
        self.proc = subprocess.Popen(
            [*cmd, "--key-file", str(key)],
            env={**os.environ, "AMESH_HANDSHAKE_TIMEOUT": "1"},
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (fds, fds)),
        )
        self.log: list[str] = []
        self.listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if "listening on" in line:
                self.listening.set()
        self.listening.set()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        rc = self.proc.wait(30)
        self._reader.join(10)
        return rc


@contextmanager
def _idle_connections(port: int, sources: int, each: int) -> Iterator[list[socket.socket]]:
    """Connections that send nothing, ``each`` from 127.0.0.2, 127.0.0.3, ..."""
    with ExitStack() as stack:
        socks = []
        for source in range(sources):
            for _ in range(each):
                s = stack.enter_context(socket.socket())
                s.bind((f"127.0.0.{2 + source}", 0))
                s.connect(("127.0.0.1", port))
                s.setblocking(False)
                socks.append(s)
        yield socks


async def _closed(sock: socket.socket) -> None:
    """Wait until the peer has closed (or reset) ``sock``."""
    while True:
        await anyio.wait_readable(sock)
        try:
            if sock.recv(4096) == b"":
                return
        except BlockingIOError:
            continue
        except OSError:  # reset
            return


async def _slowloris(port: int, done: anyio.Event) -> None:
    """A ClientHello a byte at a time from 127.0.0.200, until the agent closes it (it
    never ends before: the hello is longer than the deadline allows at this pace)."""
    with socket.socket() as s:
        s.bind(("127.0.0.200", 0))
        s.connect(("127.0.0.1", port))
        s.setblocking(False)
        async with anyio.create_task_group() as tg:

            async def drip() -> None:
                for byte in _HELLO:
                    try:
                        s.send(bytes([byte]))
                    except OSError:  # closed under us
                        return
                    await anyio.sleep(0.1)  # the attack's pace, not a synchronisation
                raise AssertionError("the agent kept a slowloris past its deadline")

            tg.start_soon(drip)
            await _closed(s)
            tg.cancel_scope.cancel()
    done.set()


def _controller(scheme: str) -> open_runtime:
    """A controller that reaches the agent as one on another host would: over TLS (not
    the local alias), or over plain streams."""
    if scheme == "tcp":
        return open_runtime(lambda: open_tls("127.0.0.1"))
    return open_runtime(lambda: open_transport("stream+tcp"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", ["tcp", "stream+tcp"])
async def test_an_agent_sheds_connections_that_never_prove_themselves(
    tmp_path: Path, scheme: str
) -> None:
    key = shared_key(tmp_path)
    fds, sources, each = _FLOOD[scheme]
    agent = _Agent(key, scheme, fds)
    try:
        with anyio.fail_after(90):
            await anyio.to_thread.run_sync(agent.listening.wait)
            assert agent.proc.poll() is None, "".join(agent.log)
            with _idle_connections(agent.port, sources, each) as idle:
                async with anyio.create_task_group() as tg:
                    slow_done = anyio.Event()
                    tg.start_soon(_slowloris, agent.port, slow_done)
                    # while they are held: a controller attaches and starts workers
                    async with _controller(scheme):
                        hosts = await amesh.attach([agent.addr], key_file=str(key))
                        async with hosts.spawn_procs({"gpus": 2}) as procs:
                            c = await procs.spawn("c", Counter)
                            assert list((await c.incr.call()).values()) == [1, 1]
                        for sock in idle:  # every idle one is closed by the agent
                            await _closed(sock)
                        await slow_done.wait()
                        # past the deadline: the controller's own connection is kept
                        async with hosts.spawn_procs({"gpus": 1}) as procs:
                            c = await procs.spawn("c", Counter)
                            assert list((await c.incr.call()).values()) == [1]
    finally:
        rc = agent.stop()
    assert rc == 0, "".join(agent.log)
    # a few lines (start, zygote, a summary every 5 s at most), never one per connection
    assert len(agent.log) < 20, "".join(agent.log)
    assert not any("Traceback" in line for line in agent.log), "".join(agent.log)
    summary = "did not prove themselves" if scheme == "tcp" else "over the cap in all"
    assert any(summary in line for line in agent.log), "".join(agent.log)


_CROWDED = """
import logging, resource, sys
import anyio
from amesh._transport import StreamTransport

async def main():
    t = StreamTransport("tcp")
    async with anyio.create_task_group() as tg:
        tg.start_soon(t.serve, lambda frame, peer: None)
        print(t.address, flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        tg.cancel_scope.cancel()
    t.close()

logging.basicConfig(stream=sys.stderr, level=logging.INFO)
resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
anyio.run(main)
"""


def _crowded_listener() -> subprocess.Popen[str]:
    """A stream listener (asyncio's server) in a process of 48 descriptors at most."""
    return subprocess.Popen(
        [sys.executable, "-c", _CROWDED],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(60)
async def test_a_listener_out_of_descriptors_logs_a_line_per_interval() -> None:
    """asyncio logs each failed accept with its traceback (and retries a second later):
    held at its limit for 3 s, a listener logs one line, no traceback."""
    proc = _crowded_listener()
    assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
    lines: list[str] = []
    failed = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "accept" in line:
                failed.set()
        failed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with anyio.fail_after(45):
            addr = await anyio.to_thread.run_sync(proc.stdout.readline)
            host, port = addr.strip().split("://", 1)[1].rsplit("/", 1)[0].rsplit(":", 1)
            with ExitStack() as stack:
                for _ in range(80):  # more than it can hold: its accepts fail
                    s = stack.enter_context(socket.socket())
                    s.connect((host, int(port)))
                await anyio.to_thread.run_sync(failed.wait)
                assert proc.poll() is None, "".join(lines)
                await anyio.sleep(3)  # held at the limit: asyncio retries each second
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert await anyio.to_thread.run_sync(proc.wait) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
    said = [line for line in lines if "accept" in line]
    assert len(said) == 1 and "cannot accept a connection" in said[0], "".join(lines)
    assert not any("Traceback" in line for line in lines), "".join(lines)
