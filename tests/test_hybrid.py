"""``tcp`` is encrypted between hosts and event-loop streams within one: the
:class:`HybridTransport` (NNG over ``tls+tcp``, and a stream listener on an abstract
socket named after that address for the processes of its host).

The conformance suite of ``test_transport`` runs again over hybrid transports: two of
them on one host talk over streams, and the suite's raw peers (pynng with the job's
certificates) over TLS. Then the routes themselves, a stranger at the alias, a mesh, and
the addresses users write.
"""

from __future__ import annotations

import inspect
import socket
from pathlib import Path
from typing import Any

import anyio
import pytest

from amesh import Actor, ActorError, ProcMesh, _identity, endpoint
from amesh._hosts import parse_listen
from amesh._hosts._remote import _agent_address
from amesh._runtime import current_runtime
from amesh._transport import (
    HostStreams,
    HybridTransport,
    Transport,
    _tls,
    dial_part,
    open_transport,
)
from amesh._transport._ext import ExtTransport
from amesh._transport._hybrid import alias_of, local_alias

from . import test_transport as conformance
from .actors import Counter
from .test_auth import attack
from .test_tls import LOOPBACK, TlsImpl
from .test_transport import Impl, Inbox, Lost, make  # noqa: F401 (make: a fixture)

pytestmark = pytest.mark.anyio


def hybrid(scheme: str = "tls+tcp", *, host: str = LOOPBACK, **kwargs: Any) -> HybridTransport:
    """A hybrid transport; ``scheme`` is always tls+tcp (the suite's factory passes it)."""
    assert scheme == "tls+tcp", scheme
    return HybridTransport(host, **kwargs)


@pytest.fixture
def impl() -> Impl:
    """Overrides test_transport's ``impl``: ``make`` here makes hybrid transports."""
    return TlsImpl(hybrid, _tls.material())


# Every test of the suite that takes ``make`` runs here too (with the ``impl`` above).
for _name, _test in vars(conformance).items():
    if _name.startswith("test_") and "make" in inspect.signature(_test).parameters:
        globals()[_name] = _test
del _name, _test


@pytest.fixture
async def made() -> Any:
    """Transports a test made, closed at its end."""
    out: list[Transport] = []
    yield out
    for t in out:
        t.close()


def sent(t: HybridTransport) -> dict[str, int]:
    """Frames ``t`` sent over each route."""
    return {route: stats.frames_sent for route, stats in t.routes().items()}


# -- the routes ----------------------------------------------------------------------------


async def test_two_processes_of_a_host_talk_over_streams(made: list[Transport]) -> None:
    """Frames go both ways over the streams route, each delivered from the sender's
    tls+tcp address; neither side counts the other's probe of its alias as a refusal."""
    a, b, inbox_a, inbox_b = hybrid(), hybrid(), Inbox(), Inbox()
    made += [a, b]
    assert a.address.startswith(f"tls+tcp://{LOOPBACK}:")
    assert a.alias == f"stream+abstract://{alias_of(a.address)}"
    assert local_alias(a.address) == a.alias
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.serve, inbox_a.deliver)
            tg.start_soon(b.serve, inbox_b.deliver)
            for i in range(100):
                await a.send(b.address, b"a%d" % i)
                assert b.try_send(a.address, b"b%d" % i)
            assert await inbox_b.take(100) == [b"a%d" % i for i in range(100)]
            assert await inbox_a.take(100) == [b"b%d" % i for i in range(100)]
            tg.cancel_scope.cancel()
    assert set(inbox_b.peers) == {a.address} and set(inbox_a.peers) == {b.address}
    assert sent(a) == sent(b) == {"stream": 100, "tls": 0}
    assert a.routes()["tls"].frames_received == b.routes()["tls"].frames_received == 0
    assert a.statistics().frames_sent == 100 and a.statistics().frames_received == 100
    assert a.statistics().auth_refused == b.statistics().auth_refused == 0
    a.forget(b.address)  # closes the stream link, reporting nothing
    assert a.statistics().peers == 0


async def test_plain_streams_reach_a_process_of_their_host_on_tls(made: list[Transport]) -> None:
    """A process on plain streams (the default transport, this machine's own agent)
    sends to one on tls+tcp of its host at its alias, which answers it there; a
    tls+tcp address with no alias here is reported lost at once, its frames dropped
    (they were dropped, and logged, until the calls timed out)."""
    a, b, inbox_a, inbox_b = HostStreams("abstract"), hybrid(), Inbox(), Inbox()
    made += [a, b]
    lost: list[tuple[str, str]] = []
    reported = anyio.Event()

    def on_lost(addr: str, why: str) -> None:
        lost.append((addr, why))
        reported.set()

    a.set_lost_handler(on_lost)
    nobody = "tls+tcp://127.0.0.1:1/0123456789ab"
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.serve, inbox_a.deliver)
            tg.start_soon(b.serve, inbox_b.deliver)
            await a.send(b.address, b"to tls")
            assert await inbox_b.take(1) == [b"to tls"]
            await b.send(a.address, b"back")
            assert await inbox_a.take(1) == [b"back"]
            assert a.try_send(nobody, b"lost")
            await reported.wait()
            tg.cancel_scope.cancel()
    assert inbox_b.peers == [a.address] and inbox_a.peers == [b.address]
    assert lost == [(nobody, lost[0][1])] and "no process of this host listens" in lost[0][1]
    assert sent(b) == {"stream": 1, "tls": 0}


async def test_a_transport_without_an_alias_is_reached_over_tls(made: list[Transport]) -> None:
    """An NNG transport over tls+tcp alone has no alias: the hybrid's frames to it go
    over TLS, and its frames come in over TLS, each from the right peer."""
    a, b, inbox_a, inbox_b = hybrid(), ExtTransport("tls+tcp"), Inbox(), Inbox()
    made += [a, b]
    assert local_alias(b.address) is None
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.serve, inbox_a.deliver)
            tg.start_soon(b.serve, inbox_b.deliver)
            await a.send(b.address, b"to nng")
            await b.send(a.address, b"from nng")
            assert await inbox_b.take(1) == [b"to nng"]
            assert await inbox_a.take(1) == [b"from nng"]
            tg.cancel_scope.cancel()
    assert inbox_b.peers == [a.address] and inbox_a.peers == [b.address]
    assert sent(a) == {"stream": 0, "tls": 1}
    assert a.routes()["tls"].frames_received == 1


async def test_a_stranger_at_the_alias_is_refused(made: list[Transport], tmp_path: Path) -> None:
    """A local process without the job key that connects to the alias (raw frames, or
    an answer with a guessed proof) is refused and counted; nothing it sent is
    delivered, and a peer of the job goes on."""
    a, b, inbox = hybrid(), hybrid(), Inbox()
    made += [a, b]
    assert b.alias is not None
    for _ in range(3):  # probes: they send nothing and are not refusals
        assert local_alias(b.address) == b.alias
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            lines = await attack(b.alias, tmp_path / "pwned", "raw", "guessed")
            assert [line.split()[:2] for line in lines] == [
                ["raw", "closed"],
                ["guessed", "closed"],
            ]
            await a.send(b.address, b"proven")
            assert await inbox.take(1) == [b"proven"]
            tg.cancel_scope.cancel()
    assert b.statistics().auth_refused == b.routes()["stream"].auth_refused == 2
    assert [bytes(f) for f in inbox.kept] == [b"proven"] and inbox.peers == [a.address]
    assert not (tmp_path / "pwned").exists()


async def test_a_lost_link_is_reported_with_the_tls_address(made: list[Transport]) -> None:
    """A peer of the host that closes is reported lost under its tls+tcp address, not its
    alias; the next send decides the route again (over TLS: the alias went with it)."""
    a, b, inbox = hybrid(), hybrid(), Inbox()
    made += [a, b]
    lost = Lost()
    a.set_lost_handler(lost)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.serve, Inbox().deliver)
            async with anyio.create_task_group() as serving:
                serving.start_soon(b.serve, inbox.deliver)
                await a.send(b.address, b"hello")
                assert await inbox.take(1) == [b"hello"]
                serving.cancel_scope.cancel()
            b.close()
            await lost.wait()
            assert [addr for addr, _ in lost.reports] == [b.address]
            assert a.statistics().peers == 0
            assert a.try_send(b.address, b"again")
            assert sent(a) == {"stream": 1, "tls": 1}
            await lost.wait()  # nobody listens there any more
            tg.cancel_scope.cancel()
    assert [addr for addr, _ in lost.reports] == [b.address, b.address], lost.reports


async def test_the_tls_side_waits_for_the_job_key(
    made: list[Transport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that holds no job key yet (a controller about to adopt its agents')
    reserves its port and opens the TLS listener there at its first send to a tls+tcp
    address, with the key it holds by then; a serve() already running serves it."""
    key = _identity.job_key()
    monkeypatch.setattr(_identity, "_key", None)
    a = hybrid()
    made.append(a)
    assert not _identity.has_key()  # opening it chose no key
    port = int(dial_part(a.address).rsplit(":", 1)[1])
    with socket.socket() as other, pytest.raises(OSError):
        other.bind((LOOPBACK, port))  # the port is ours meanwhile
    assert a.routes()["tls"].frames_sent == 0
    _identity.adopt_key(key)  # as attach(key_file=...) does
    b, inbox_a, inbox_b = ExtTransport("tls+tcp"), Inbox(), Inbox()
    made.append(b)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.serve, inbox_a.deliver)
            tg.start_soon(b.serve, inbox_b.deliver)
            await anyio.wait_all_tasks_blocked()
            await a.send(b.address, b"first")
            assert await inbox_b.take(1) == [b"first"]
            await b.send(a.address, b"back")
            assert await inbox_a.take(1) == [b"back"]
            tg.cancel_scope.cancel()
    assert inbox_b.peers == [a.address] and inbox_a.peers == [b.address]


# -- a mesh ------------------------------------------------------------------------------


class Routes(Actor):
    """Reports its process's transport routes."""

    @endpoint
    def sent(self) -> dict[str, int]:
        t = current_runtime().transport
        assert isinstance(t, HybridTransport)
        return sent(t)


async def test_a_mesh_over_tcp_stays_on_streams_within_its_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AMESH_TRANSPORT=tcp: the controller and its workers listen on tls+tcp, and all of
    them on this host talk over streams (calls, a broadcast, a remote error, replies,
    heartbeats): no frame goes over TLS."""
    monkeypatch.setenv("AMESH_TRANSPORT", "tcp")
    monkeypatch.delenv("AMESH_TRANSPORT_IMPL", raising=False)
    with anyio.fail_after(120):
        async with ProcMesh({"procs": 2}, heartbeat_period=0.05) as procs:
            rt = current_runtime()
            t = rt.transport
            assert isinstance(t, HybridTransport)
            assert rt.address.startswith("tls+tcp://127.0.0.1:")
            c = await procs.spawn("c", Counter)
            assert list((await c.incr.call()).values()) == [1, 1]
            await c.incr.broadcast(2)
            assert await c.slice(procs=1).get.call_one() == 3
            with pytest.raises(ActorError, match="boom"):
                await c.slice(procs=0).fail.call_one("boom")
            stats = (await procs.statistics()).values()
            assert all(s["address"].startswith("tls+tcp://127.0.0.1:") for s in stats)
            r = await procs.spawn("r", Routes)
            for worker in (await r.sent.call()).values():
                assert worker["tls"] == 0 and worker["stream"] > 0, worker
            # nothing in flight now: what still comes in are the workers' heartbeats
            received = t.statistics().frames_received
            while t.statistics().frames_received < received + 4:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            assert sent(t)["tls"] == 0 and sent(t)["stream"] > 0
            assert t.routes()["tls"].frames_received == 0


# -- what users write ----------------------------------------------------------------------


def test_tcp_means_encrypted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tcp`` (and ``tls+tcp``) is a hybrid transport on a tls+tcp address, or NNG over
    TLS alone when an NNG implementation is named; ``stream+tcp`` is plain streams. A
    worker follows its parent's address. Agent addresses read the same way."""
    monkeypatch.delenv("AMESH_TRANSPORT_IMPL", raising=False)
    expect = [
        (("tcp",), HybridTransport, "tls+tcp://"),
        (("tls+tcp",), HybridTransport, "tls+tcp://"),
        (("stream+tcp",), HostStreams, "stream+tcp://"),
        (("tls+tcp", "tls+tcp://127.0.0.1:1"), HybridTransport, "tls+tcp://"),
        (("stream+tcp", "stream+tcp://127.0.0.1:1"), HostStreams, "stream+tcp://"),
    ]
    for args, cls, prefix in expect:
        t = open_transport(args[0], reach=args[1] if len(args) > 1 else None)
        t.close()
        assert type(t) is cls, args
        assert t.address.startswith(prefix + "127.0.0.1:"), (args, t.address)
    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", "ext")
    t = open_transport("tcp")
    t.close()
    assert type(t) is ExtTransport and t.address.startswith("tls+tcp://127.0.0.1:")
    assert _agent_address("tcp://10.0.0.5:7000") == "tls+tcp://10.0.0.5:7000"
    for kept in ("tls+tcp://10.0.0.5:7000", "stream+tcp://10.0.0.5:7000"):
        assert _agent_address(kept) == kept
    assert parse_listen("tcp://0.0.0.0:7000") == ("tls+tcp", "0.0.0.0", 7000)
    assert parse_listen("tls+tcp://[::1]:0") == ("tls+tcp", "::1", 0)
    assert parse_listen("stream+tcp://10.0.0.5:7000") == ("stream+tcp", "10.0.0.5", 7000)
    with pytest.raises(ValueError, match="tcp://ADDR:PORT"):
        parse_listen("ipc:///tmp/x")


def test_only_tls_addresses_with_a_listener_have_an_alias() -> None:
    assert local_alias("stream+tcp://127.0.0.1:1") is None
    assert local_alias("tcp://127.0.0.1:1") is None
    assert local_alias("tls+tcp://127.0.0.1:1") is None  # nobody listens on its alias


async def test_the_alias_link_is_the_tls_address_s_own(made: list[Transport]) -> None:
    """The link a process on plain streams makes to a tls+tcp process of its host is
    held under both addresses (frames to the tls+tcp one go like any other); its
    loss is reported under the tls+tcp address, once, and forgetting that address
    forgets the alias's link too."""
    a, b, inbox_a, inbox_b = HostStreams("abstract"), hybrid(), Inbox(), Inbox()
    made += [a, b]
    lost: list[str] = []
    reported = anyio.Event()

    def on_lost(addr: str, why: str) -> None:
        lost.append(addr)
        reported.set()

    a.set_lost_handler(on_lost)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.serve, inbox_a.deliver)
            async with anyio.create_task_group() as serving_b:
                serving_b.start_soon(b.serve, inbox_b.deliver)
                for i in range(20):
                    assert a.try_send(b.address, b"%d" % i)
                assert await inbox_b.take(20) == [b"%d" % i for i in range(20)]
                assert a.statistics().peers == 1
                a.forget(b.address)
                assert a.statistics().peers == 0
                await a.send(b.address, b"again")
                assert await inbox_b.take(1) == [b"again"]
                assert b.alias is not None
                a.forget(b.alias)  # (by the alias: the tls+tcp address goes too)
                assert a.statistics().peers == 0
                await a.send(b.address, b"and again")
                assert await inbox_b.take(1) == [b"and again"]
                serving_b.cancel_scope.cancel()
            b.close()
            await reported.wait()
            tg.cancel_scope.cancel()
    assert lost == [b.address]
    assert a.statistics().peers == 0
