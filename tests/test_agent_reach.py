"""Why a host agent cannot be reached, said with the address the user typed: bad
addresses refused when typed, a name that does not resolve, nothing listening, a
stopped agent, another key, another tag."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import amesh
from amesh import SupervisionError
from amesh._hosts._reach import parse_agent_address
from amesh._runtime import open_runtime
from amesh._transport import StreamTransport, open_transport

from .test_agent import agents, free_port, shared_key, tcp_runtime

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the agent is one program (as in test_agent)


@pytest.mark.parametrize(
    ("typed", "says"),
    [
        ("tcp://127.0.0.1:70011", "port 70011 is out of range"),
        ("tcp://127.0.0.1:0", "port 0 is out of range"),
        ("tcp://127.0.0.1", "no port"),
        ("tcp://[::1]", "the port must be a number"),
        ("tcp://127.0.0.1:x", "the port must be a number, not 'x'"),
        ("tcp://:7000", "no host"),
        ("tcp://127.0.0.1:7000/zz", "the tag after the port is 12 hex digits"),
        ("tcp://::1:7000", "an IPv6 host is written [ADDR]:PORT"),
        ("ipc:///tmp/agent", "tcp://ADDR:PORT"),
        ("127.0.0.1:7000", "tcp://ADDR:PORT"),
    ],
)
def test_an_agent_address_is_checked_when_typed(typed: str, says: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(repr(typed))) as info:
        parse_agent_address(typed)
    assert says in str(info.value)


def test_agent_addresses_as_dialled() -> None:
    assert parse_agent_address("tcp://10.0.0.5:7000").dial == "tls+tcp://10.0.0.5:7000"
    tagged = parse_agent_address("tcp://10.0.0.5:41234/3f9c0a7b12de")
    assert tagged.dial == "tls+tcp://10.0.0.5:41234/3f9c0a7b12de"
    assert tagged.where == "10.0.0.5:41234"
    v6 = parse_agent_address("stream+tcp://[::1]:7000")
    assert (v6.host, v6.where, v6.dial) == ("::1", "[::1]:7000", "stream+tcp://[::1]:7000")


async def test_attach_refuses_a_bad_port_before_dialling() -> None:
    with anyio.fail_after(30):
        async with tcp_runtime() as rt:
            with pytest.raises(ValueError, match="port 70011 is out of range"):
                await amesh.attach(["tcp://127.0.0.1:70011"])
            assert rt.statistics().frames_sent == 0


async def test_a_name_that_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Told at once, before any dial (the resolver is stubbed: no query leaves)."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "agent.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with anyio.fail_after(30):
        async with tcp_runtime():
            with pytest.raises(SupervisionError) as info:
                await amesh.attach(["tcp://agent.invalid:7000"])
    assert str(info.value) == (
        "the agent at tcp://agent.invalid:7000 cannot be reached: cannot resolve "
        "'agent.invalid' (Name or service not known)"
    )


async def test_nothing_listens_at_the_address() -> None:
    port = free_port()
    with anyio.fail_after(30):
        async with tcp_runtime():
            with pytest.raises(SupervisionError) as info:
                await amesh.attach([f"tcp://127.0.0.1:{port}"])
    assert str(info.value) == (
        f"the agent at tcp://127.0.0.1:{port} cannot be reached: nothing listens on "
        f"127.0.0.1:{port} (connection refused)"
    )


async def test_a_stopped_agent_is_said_not_to_answer(tmp_path: Path) -> None:
    """SIGSTOPped: the kernel takes the connection, nobody answers (the link once said
    "cannot connect: ", a timeout's empty text)."""
    key = shared_key(tmp_path)
    with anyio.fail_after(60):
        async with agents(key, 1) as (agent,), tcp_runtime():
            agent.proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(SupervisionError) as info:
                    await amesh.attach([agent.addr])
            finally:
                agent.proc.send_signal(signal.SIGCONT)
    assert str(info.value) == (
        f"the agent at {agent.addr} accepted the connection but did not answer within "
        "5 s (it is stopped, or overloaded)"
    )


async def test_another_tag_is_named(tmp_path: Path) -> None:
    """An agent on a port it was given has no tag: one typed is a tag mismatch (the
    agent holds our key, as its certificate shows)."""
    key = shared_key(tmp_path)
    with anyio.fail_after(60):
        async with agents(key, 1) as (agent,), tcp_runtime():
            typed = f"{agent.addr}/0123456789ab"
            with pytest.raises(SupervisionError) as info:
                await amesh.attach([typed])
            assert (await amesh.attach([agent.addr])).hosts[0]["pid"] == agent.proc.pid
    assert str(info.value).startswith(
        f"the agent at {typed} refused this controller: it holds our key, but tag "
        "mismatch: its address does not end in /0123456789ab"
    )


async def _announced(path: Path, proc: subprocess.Popen[bytes]) -> str:
    """The address an agent wrote to ``path`` (it replaces the file in one step)."""
    while not path.exists():
        assert proc.poll() is None, "the agent exited"
        await anyio.sleep(0.05)
    return path.read_text().strip()


def _tagged_agent(key: Path, announce: Path) -> subprocess.Popen[bytes]:
    """An agent on a port the kernel picks, which writes its address to ``announce``."""
    cmd = [sys.executable, "-m", "amesh", "agent", "--listen", "tcp://127.0.0.1:0"]
    return subprocess.Popen(
        [*cmd, "--key-file", str(key), "--announce", str(announce)], stderr=subprocess.DEVNULL
    )


async def test_a_missing_tag_is_named(tmp_path: Path) -> None:
    """An agent on a port the kernel picked has a tag; its address without it is
    refused, and the error says so."""
    key = shared_key(tmp_path)
    announce = tmp_path / "agent.addr"
    proc = _tagged_agent(key, announce)
    try:
        with anyio.fail_after(60):
            addr = await _announced(announce, proc)
            bare = "tcp://" + addr.split("://", 1)[1].rsplit("/", 1)[0]
            async with tcp_runtime():
                with pytest.raises(SupervisionError) as info:
                    await amesh.attach([bare])
                assert (await amesh.attach([addr])).hosts[0]["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert str(info.value).startswith(
        f"the agent at {bare} refused this controller: it holds our key, but tag mismatch: "
        "its address ends in a /TAG"
    )


_CONTROLLER = """
import sys, anyio, amesh
from amesh._runtime._runtime import open_runtime
from amesh._transport import open_transport

async def main():
    async with open_runtime(lambda: open_transport("tcp")):
        key = {"key_file": sys.argv[2]} if len(sys.argv) > 2 else {}
        try:
            await amesh.attach([sys.argv[1]], timeout=20, **key)
        except amesh.SupervisionError as exc:
            print(exc)

anyio.run(main)
"""


async def test_a_wrong_or_missing_key_is_named(tmp_path: Path) -> None:
    """attach with another key, with none, and ``amesh list --hosts`` without
    ``--key-file``: the agent at the address refused this controller, for its key."""
    key = shared_key(tmp_path)
    wrong = tmp_path / "wrong.key"
    made = await anyio.run_process([sys.executable, "-m", "amesh", "keygen", str(wrong)])
    assert made.returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "AMESH_KEY_FILE"}
    with anyio.fail_after(120):
        async with agents(key, 1) as (agent,):
            run = [sys.executable, "-c", _CONTROLLER, agent.addr]
            out = await anyio.run_process([*run, str(wrong)], env=env)
            assert out.stdout.decode().strip() == (
                f"the agent at {agent.addr} refused this controller: it holds another key "
                f"(key file {wrong})"
            )
            out = await anyio.run_process(run, env=env)
            assert out.stdout.decode().strip() == (
                f"the agent at {agent.addr} refused this controller: it holds another key "
                "(no key file: this controller made a key of its own)"
            )
            listed = await anyio.run_process(
                [sys.executable, "-m", "amesh", "list", "--hosts", agent.addr],
                env=env,
                check=False,
            )
            assert listed.returncode == 1
            assert (
                f"the agent at {agent.addr} refused this controller: it holds another key"
                in listed.stderr.decode()
            ), listed.stderr.decode()


async def test_a_stream_agent_says_what_may_be_wrong(tmp_path: Path) -> None:
    """A plain-stream agent's refusal tells key from address apart no more than that
    (it shows no certificate): the error names both."""
    key = shared_key(tmp_path)
    with anyio.fail_after(60):
        async with agents(key, 1, scheme="stream+tcp") as (agent,):
            async with open_runtime(lambda: open_transport("stream+tcp")):
                typed = f"{agent.addr}/0123456789ab"
                with pytest.raises(SupervisionError) as info:
                    await amesh.attach([typed])
    assert str(info.value).startswith(
        f"the agent at {typed} refused this controller: it holds another key ("
    )
    assert f"or its address is not {typed} (tag mismatch" in str(info.value)


async def test_a_link_to_a_listener_that_never_answers_says_so() -> None:
    """The kernel takes the connection, nobody sends the challenge: the link's loss
    says so (it said "cannot connect: ", the empty text of a timeout)."""
    lost: list[str] = []
    got = anyio.Event()

    def on_lost(addr: str, why: str) -> None:
        lost.append(why)
        got.set()

    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        transport = StreamTransport("tcp")
        transport.set_lost_handler(on_lost)
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(transport.serve, lambda frame, peer: None)
                    transport.try_send(f"stream+tcp://127.0.0.1:{mute.getsockname()[1]}", b"x")
                    await got.wait()
                    tg.cancel_scope.cancel()
        finally:
            transport.close()
    assert lost == ["cannot connect: no answer within 5 s (the listener is stopped, or overloaded)"]
