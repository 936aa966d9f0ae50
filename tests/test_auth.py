"""Every connection proves it holds the job key before anything it sends is decoded.

The attacker is an unrelated local process that knows the wire schema: a ``python -c``
script using only the standard library and :mod:`amesh._wire`. It sends a well-formed
``Call`` to a worker's ``_proc`` agent whose payload, once unpickled, creates a file.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import socket
import struct
import sys
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from amesh import ProcMesh, _identity, _wire
from amesh._runtime import current_runtime
from amesh._transport import StreamTransport, _auth
from amesh._transport import _stream_framing as wire
from amesh.testing._leaks import child_pids

from .actors import Counter
from .test_spawn import facts
from .test_transport import AnyioStreamTransport, Inbox, recv_exact

pytestmark = pytest.mark.anyio

#: The attacker: connects to ADDR and, for each MODE, sends the forged call raw
#: ("raw"), or behind a handshake answer with a guessed proof ("guessed"); then waits
#: until the target closes the connection and prints what it saw first.
ATTACK = r"""
import os, pickle, socket, sys, time

from amesh import _wire

path, addr, *modes = sys.argv[1:]


class Evil:
    def __reduce__(self):
        return (open, (path, "w"))


payload = pickle.dumps(((Evil(),), {}))
call = _wire.Call("stream+abstract://attacker", 1, 0, "_proc", "statistics", [], [], payload)
frame = _wire.join(_wire.encode(call))
me = b"stream+abstract://attacker"

scheme, _, rest = addr.partition("://")
nng = not scheme.startswith("stream+")
kind = scheme.removeprefix("stream+")
if kind == "abstract":
    family, where = socket.AF_UNIX, "\0" + rest
elif kind == "ipc":
    family, where = socket.AF_UNIX, rest
else:
    host, _, port = rest.split("/")[0].rpartition(":")  # (no tag: see _transport._tags)
    family, where = socket.AF_INET, (host, int(port))


def message(body):
    # NNG's SP framing: a type byte (unix sockets only), a u64 BE length, the body
    return (b"" if kind == "tcp" else b"\x01") + len(body).to_bytes(8, "big") + body


for mode in modes:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(where)
        if nng:
            sock.sendall(b"\x00SP\x00\x00\x50\x00\x00")  # a Push0 peer
            assert len(sock.recv(8)) == 8
            data = message(frame)
            if mode == "guessed":
                hello = (b"AMN1" + os.urandom(16) + time.time_ns().to_bytes(8, "little")
                         + len(me).to_bytes(2, "little") + me + os.urandom(32))
                data = message(hello) + data
        else:
            data = len(frame).to_bytes(4, "little") + frame
            if mode == "guessed":
                challenge = sock.recv(36)
                data = (b"AMA1" + len(me).to_bytes(2, "little") + me + os.urandom(32)
                        + data)
        first = b""
        try:
            sock.sendall(data)
            while True:
                got = sock.recv(4096)
                if not got:
                    break
                first = first or got
        except (ConnectionResetError, BrokenPipeError):
            pass
        print(mode, "closed", len(first))
"""


def forged_call(path: Path) -> bytes:
    """The attacker's frame, built in this process."""

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(path), "w"))

    payload = pickle.dumps(((Evil(),), {}))
    call = _wire.Call("stream+abstract://attacker", 1, 0, "_proc", "statistics", [], [], payload)
    return _wire.join(_wire.encode(call))


def test_the_forged_call_runs_code_when_decoded(tmp_path: Path) -> None:
    """The attack is live: a runtime that decoded the frame would create the file."""
    path = tmp_path / "pwned"
    env, buffers = _wire.decode(forged_call(path))
    assert isinstance(env, _wire.Call) and env.actor == "_proc"
    _wire.loads(env.payload, buffers)
    assert path.exists()


async def attack(addr: str, path: Path, *modes: str) -> list[str]:
    """Run the attacker against ``addr``; what it printed, a line per mode."""
    out = await anyio.run_process(
        [sys.executable, "-c", ATTACK, str(path), addr, *modes], check=True
    )
    return out.stdout.decode().splitlines()


async def refused(procs: ProcMesh, target: str) -> int:
    if target == "controller":
        return current_runtime().statistics().auth_refused
    return int((await procs.statistics()).values()[0]["auth_refused"])


# NNG transports over tcp take longer to set up; abstract and ipc cover them (``tcp``
# is TLS: test_tls and test_hybrid attack it).
CASES = [
    pytest.param("stream", "abstract", id="stream-abstract"),
    pytest.param("stream", "ipc", id="stream-ipc"),
    pytest.param("stream", "stream+tcp", id="stream-tcp"),
    pytest.param("ext", "abstract", id="ext-abstract"),
    pytest.param("nng", "ipc", id="nng-ipc"),
]


@pytest.mark.parametrize(("impl", "scheme"), CASES)
async def test_a_stranger_cannot_run_code(
    impl: str, scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", impl)
    monkeypatch.setenv("AMESH_TRANSPORT", scheme)
    with anyio.fail_after(120):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            worker = procs._live().addrs[0]
            targets = {"controller": current_runtime().address, "worker": worker}
            for target, addr in targets.items():
                kind = scheme.removeprefix("stream+")
                assert addr.startswith(f"stream+{kind}://" if impl == "stream" else scheme)
                before = await refused(procs, target)
                path = tmp_path / f"pwned-by-{target}"
                lines = await attack(addr, path, "raw", "guessed")
                assert [line.split()[:2] for line in lines] == [
                    ["raw", "closed"],
                    ["guessed", "closed"],
                ]
                # the target keeps serving, ran nothing, and counted both
                assert (await c.incr.call()).values() == [list(targets).index(target) + 1]
                assert not path.exists()
                assert await refused(procs, target) == before + 2


async def test_frames_behind_a_good_answer_are_read() -> None:
    """The dialer pipelines frames right behind its answer: they are delivered, and the
    listener knows (authenticated) which peer the connection belongs to."""
    for cls in (StreamTransport, AnyioStreamTransport):
        a, b, inbox = cls(), cls(), Inbox()
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(b.serve, inbox.deliver)
                    for i in range(3):
                        a.try_send(b.address, bytes([i]))  # before the connection is up
                    assert await inbox.take(3) == [b"\0", b"\1", b"\2"]
                    assert [conn.peer for conn in b._inbound] == [a.address]
                    tg.cancel_scope.cancel()
        finally:
            a.close()
            b.close()


@pytest.fixture(params=[StreamTransport, AnyioStreamTransport], ids=["stream", "stream-anyio"])
async def listener(request: pytest.FixtureRequest) -> AsyncIterator[StreamTransport]:
    t: StreamTransport = request.param()
    yield t
    t.close()


async def open_proven(addr: str) -> socket.socket:
    """A connection to ``addr`` that has answered its challenge (with this job's key)."""
    family, sockaddr = wire.parse_address(addr)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(sockaddr)
    challenge = await anyio.to_thread.run_sync(recv_exact, sock, _auth.CHALLENGE_LEN)
    sock.sendall(_auth.answer(challenge, addr, "stream+abstract://proven"))
    return sock


async def wait_closed(sock: socket.socket) -> None:
    """Until the peer closes ``sock``."""
    sock.setblocking(False)
    while True:
        await anyio.wait_readable(sock)
        try:
            if not sock.recv(4096):
                return
        except ConnectionResetError:
            return


async def test_an_oversize_header_from_a_proven_peer_allocates_nothing(
    listener: StreamTransport,
) -> None:
    """A header above max_frame closes the connection before any allocation; the
    listener goes on."""
    inbox = Inbox()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, inbox.deliver)
            tracemalloc.start()
            try:
                with await open_proven(listener.address) as sock:
                    sock.sendall(struct.pack("<I", 5) + b"fine!" + struct.pack("<I", 2**32 - 1))
                    await wait_closed(sock)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < 16 * 1024 * 1024, peak
            assert await inbox.take(1) == [b"fine!"]
            assert listener.statistics().auth_refused == 0  # proven: not an auth failure
            with await open_proven(listener.address) as sock:
                sock.sendall(struct.pack("<I", 5) + b"again")
                assert await inbox.take(1) == [b"again"]
            tg.cancel_scope.cancel()


async def test_refusals_are_counted_and_logged_sparingly(
    listener: StreamTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """A flood of bad connections: each is refused and counted, the log gets a line."""
    caplog.set_level(logging.WARNING, logger="amesh.transport")
    family, sockaddr = wire.parse_address(listener.address)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, Inbox().deliver)
            for _ in range(50):
                with socket.socket(family, socket.SOCK_STREAM) as sock:
                    sock.connect(sockaddr)
                    sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
                    await wait_closed(sock)
            tg.cancel_scope.cancel()
    assert listener.statistics().auth_refused == 50
    lines = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    assert "not an amesh handshake" in lines[0].getMessage()
    assert f"pid {os.getpid()}" in lines[0].getMessage()


async def test_a_silent_peer_is_dropped_at_the_handshake_deadline(
    listener: StreamTransport, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that never answers is closed, for that reason, once the handshake
    deadline has passed."""
    monkeypatch.setattr(listener, "deadline", 0.2)
    family, sockaddr = wire.parse_address(listener.address)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, Inbox().deliver)
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.connect(sockaddr)
                await wait_closed(sock)
            tg.cancel_scope.cancel()
    assert listener.statistics().auth_refused == 1
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 1 and "no handshake within 0.2 s" in refused[0], refused


def stranger_uid_connects(sockaddr: str, data: bytes, nng: bool) -> str:
    """In a forked child that became uid 65534: connect, send ``data``, and say whether
    anything (a challenge; NNG: a message) came back. Blocking; run it in a thread."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child only makes system calls, then _exits
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(20)
                sock.connect(sockaddr)
                if nng:  # its SP header first, which NNG answers before any pipe
                    sock.sendall(b"\x00SP\x00\x00\x50\x00\x00")
                    sock.recv(8)
                    data = b"\x01" + len(data).to_bytes(8, "big") + data
                try:
                    sock.sendall(data)
                    got = sock.recv(64)
                except (ConnectionResetError, BrokenPipeError):
                    got = b""
            os.write(w, b"challenged" if got else b"closed")
        except BaseException as exc:
            os.write(w, repr(exc).encode()[:200])
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            return f.read().decode()
    finally:
        os.waitpid(pid, 0)


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another uid needs root")
@pytest.mark.parametrize("impl", ["stream", "ext"])
async def test_a_peer_of_another_uid_is_refused_before_the_challenge(
    impl: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On unix sockets the listener checks the peer's uid (SO_PEERCRED, NNG's peer
    uid) first. Abstract sockets have no file permissions to stop a stranger."""
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", impl)
    monkeypatch.setenv("AMESH_TRANSPORT", "abstract")
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            c = await procs.spawn("c", Counter)
            addr = procs._live().addrs[0]
            before = await refused(procs, "worker")
            frame = forged_call(tmp_path / "pwned")
            data = frame if impl != "stream" else struct.pack("<I", len(frame)) + frame
            sockaddr = "\0" + addr.split("://", 1)[1]
            seen = await anyio.to_thread.run_sync(
                stranger_uid_connects, sockaddr, data, impl != "stream"
            )
            assert seen == "closed"  # no challenge: refused on sight
            assert await refused(procs, "worker") == before + 1
            assert (await c.incr.call()).values() == [1]
            assert not (tmp_path / "pwned").exists()


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _listening_inodes() -> set[int]:
    """Inodes of every listening socket of this network namespace (unix, tcp, tcp6)."""
    out = set()
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
                out.add(int(fields[6]))
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        out.add(int(fields[9]))
        except FileNotFoundError:
            pass
    return out


async def test_the_zygote_listens_on_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody can connect to the zygote: its only sockets are its socket pair with
    the controller (a worker, for contrast, listens)."""
    monkeypatch.delenv("AMESH_ZYGOTE", raising=False)
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            [worker] = procs.pids
            zygote = _parent_of(worker)
            assert zygote in child_pids() and zygote != os.getpid()
            listening = _listening_inodes()
            zygote_sockets = _socket_inodes(zygote)
            assert zygote_sockets, "the zygote has its control socket"
            assert not zygote_sockets & listening
            assert _socket_inodes(worker) & listening, "a worker listens"


@pytest.mark.parametrize("zygote", ["forked", "execd"])
async def test_the_key_is_in_no_environment_nor_command_line(
    zygote: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if zygote == "execd":
        monkeypatch.setenv("AMESH_ZYGOTE", "0")
    else:
        monkeypatch.delenv("AMESH_ZYGOTE", raising=False)
    key = _identity.job_key()
    spellings = [key, key.hex().encode(), base64.b64encode(key), base64.b64encode(key)[:40]]
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            [seen] = await facts(procs)
            [worker] = procs.pids
            assert (_parent_of(worker) == os.getpid()) == (zygote == "execd")
            assert not any("AMESH_BOOTSTRAP" in k for k in seen["env"])
            env_text = repr(seen["env"]).encode()
            for pid in (worker, _parent_of(worker)):
                for what in ("environ", "cmdline"):
                    with open(f"/proc/{pid}/{what}", "rb") as f:
                        data = f.read()
                    assert not any(s in data for s in spellings), (pid, what)
            assert not any(s in env_text for s in spellings)


def test_a_proof_is_hmac_sha256_of_the_job_key() -> None:
    """The proofs are HMAC-SHA256 (docs/architecture.md), computed with CPython's own
    SHA-256 rather than OpenSSL's: the same bytes as the standard library's OpenSSL
    HMAC, for every length around SHA-256's block."""
    import hmac

    key = _identity.job_key()
    for size in (0, 1, 63, 64, 65, 200, 4096):
        data = os.urandom(size)
        assert _auth.mac(data) == hmac.digest(key, data, "sha256"), size
    # and what a dialer answers is that MAC over the challenge and both addresses
    challenge = b"AMC1" + bytes(range(32))
    answer = _auth.answer(challenge, "stream+abstract://l", "stream+abstract://d")
    me = b"stream+abstract://d"
    target = b"stream+abstract://l"
    signed = _auth._STREAM_TAG + bytes(range(32)) + struct.pack("<H", len(target)) + target + me
    assert answer[-32:] == hmac.digest(key, signed, "sha256")


def test_a_borrowed_key_is_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """borrowed_key (the zygote's rehearsal, before it serves a job): the key within
    the block, and after it, on an error too, the one held before, or none."""
    monkeypatch.setattr(_identity, "_key", None)
    other = bytes(range(32))
    with _identity.borrowed_key(other):
        assert _identity.job_key() == other
    assert not _identity.has_key()
    held = _identity.job_key()  # (made now)
    with pytest.raises(RuntimeError, match="inside"), _identity.borrowed_key(other):
        assert _identity.job_key() == other
        raise RuntimeError("inside")
    assert _identity.job_key() == held
    with pytest.raises(ValueError, match="32 bytes"), _identity.borrowed_key(b"short"):
        pass
    assert _identity.job_key() == held
