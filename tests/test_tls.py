"""``tls+tcp``: NNG links that are encrypted and whose two ends show a certificate of
the job (``amesh._transport._tls``), with the job-key hello still inside.

The conformance suite of ``test_transport`` runs here again over ``tls+tcp``, for the
extension and the pure-pynng transports. Attackers, a wire capture and the certificates
themselves follow. Everything talks over loopback.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import secrets
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pynng
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from amesh import _identity
from amesh._transport import (
    HybridTransport,
    StreamTransport,
    Transport,
    _auth,
    _tls,
    dial_part,
    heartbeat_sender,
    open_transport,
)
from amesh._transport._ext import ExtTransport

from . import test_transport as conformance
from .test_transport import Impl, Inbox, Lost, PynngTransport, RawPeer, make  # noqa: F401 (make: a fixture)

pytestmark = pytest.mark.anyio

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A loopback port that nobody listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def other_material() -> _tls.Material:
    """Certificates of another job: another CA, and a leaf it signed."""
    return _tls.job_material(secrets.token_bytes(_identity.KEY_SIZE))


class TlsImpl(Impl):
    """A transport class over ``tls+tcp``, and raw peers with the job's certificates.

    Args:
        cls: ExtTransport, or PynngTransport (its pynng I/O).
        material: the job's certificates, taken before a test adopts another key (a raw
            peer then still passes TLS, and its hello is what is refused).
    """

    def __init__(self, cls: Callable[..., Transport], material: _tls.Material) -> None:
        def make_tls(scheme: str = "abstract", **kwargs: Any) -> Transport:
            scheme = "tls+tcp" if scheme == "abstract" else scheme
            return cls(scheme, host=LOOPBACK, **kwargs)

        super().__init__(make_tls, stream=False)
        self.material = material

    def nowhere(self) -> str:
        return f"tls+tcp://{LOOPBACK}:{free_port()}"

    @asynccontextmanager
    async def raw_sender(self, addr: str, proven: bool = True) -> AsyncIterator[RawPeer]:
        gone = threading.Event()
        with pynng.Push0(tls_config=_tls.client_config(self.material)) as push:
            push.add_post_pipe_remove_cb(lambda pipe: gone.set())
            push.dial(dial_part(addr), block=True)
            if proven:
                push.send(_auth.hello(addr, "raw"))
            yield RawPeer(push.send, gone)

    @asynccontextmanager
    async def raw_receiver(self, addr: str) -> AsyncIterator[Callable[[], Any]]:
        async with tls_receiver(addr, self.material) as take:
            yield take


@asynccontextmanager
async def tls_receiver(
    listen: str, material: _tls.Material | None, target: str | None = None
) -> AsyncIterator[Callable[[], Any]]:
    """:func:`test_transport.nng_receiver` with TLS from ``material`` (plain if None)."""
    tls = _tls.server_config(material) if material is not None else None
    async with conformance.nng_receiver(listen, tls, target) as take:
        yield take


# -- the conformance suite, over tls+tcp ---------------------------------------------------

TLS_IMPLS = [
    pytest.param(ExtTransport, id="ext-tls"),
    pytest.param(PynngTransport, id="pynng-tls"),
]


@pytest.fixture(params=TLS_IMPLS)
def impl(request: pytest.FixtureRequest) -> Impl:
    """Overrides test_transport's ``impl``: ``make`` here makes tls+tcp transports."""
    return TlsImpl(request.param, _tls.material())


# Every test of the suite that takes ``make`` runs here too (with the ``impl`` above).
for _name, _test in vars(conformance).items():
    if _name.startswith("test_") and "make" in inspect.signature(_test).parameters:
        globals()[_name] = _test
del _name, _test


@pytest.fixture(params=TLS_IMPLS)
def cls(request: pytest.FixtureRequest) -> Callable[..., Transport]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
async def made() -> AsyncIterator[list[Transport]]:
    """Transports a test made, closed at its end."""
    out: list[Transport] = []
    yield out
    for t in out:
        t.close()


async def test_addresses_and_interop(made: list[Transport]) -> None:
    """A tls+tcp transport listens on a tls+tcp address; its extension's I/O and
    pynng's talk both ways."""
    e, n, inbox = ExtTransport("tls+tcp"), PynngTransport("tls+tcp", host=LOOPBACK), Inbox()
    made += [e, n]
    for t in (e, n):
        assert t.address.startswith(f"tls+tcp://{LOOPBACK}:")
        assert not t.address.endswith(":0")
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(e.serve, inbox.deliver)
            tg.start_soon(n.serve, inbox.deliver)
            await e.send(n.address, b"e to n")
            await n.send(e.address, b"n to e")
            assert sorted(await inbox.take(2)) == [b"e to n", b"n to e"]
            tg.cancel_scope.cancel()
    assert sorted(inbox.peers) == sorted([e.address, n.address])


# -- peers without a certificate of the job ------------------------------------------------


#: NNG's SP header of a Push0 peer, and its framing of one message over tcp
SP_PUSH0 = b"\x00SP\x00\x00\x50\x00\x00"


def sp_message(body: bytes) -> bytes:
    return len(body).to_bytes(8, "big") + body


def raw_attack(port: int, tls: ssl.SSLContext | None, data: bytes) -> str:
    """Connect to ``port`` (through ``tls`` where given), send ``data`` at once and read
    until the listener drops the connection; how it ended."""
    with socket.create_connection((LOOPBACK, port), timeout=20) as raw:
        sock: socket.socket = raw
        try:
            if tls is not None:
                # TLS 1.3: the client's side of the handshake completes before the
                # listener has checked its certificate, so what follows is sent.
                sock = tls.wrap_socket(raw)
            sock.sendall(data)
            while sock.recv(4096):
                pass
        except (ssl.SSLError, ConnectionError) as exc:
            return type(exc).__name__
        return "closed"


def ssl_client(tmp_path: Path, material: _tls.Material | None) -> ssl.SSLContext:
    """A Python TLS client that checks nothing, with ``material``'s certificate (or
    none)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if material is not None:
        (tmp_path / "cert.pem").write_text(material.cert)
        (tmp_path / "key.pem").write_text(material.key)
        ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    return ctx


async def test_peers_without_a_job_certificate_are_refused(
    cls: Callable[..., Transport], made: list[Transport], tmp_path: Path
) -> None:
    """Dialers without a certificate of the job are refused, though each holds the job
    key and says a valid hello: plain tcp, TLS with a certificate of another CA, TLS
    without one; raw ones that send at once, and pynng ones. Nothing they send is
    delivered, and a peer of the job goes on."""
    a, b, inbox = cls("tls+tcp"), cls("tls+tcp"), Inbox()
    made += [a, b]
    port = int(dial_part(b.address).rsplit(":", 1)[1])
    forged = b"forged frame"
    data = SP_PUSH0 + sp_message(_auth.hello(b.address, "raw attacker")) + sp_message(forged)
    stranger = other_material()
    dialers = {
        "plain tcp": (f"tcp://{LOOPBACK}:{port}", None),
        # neither checks the listener's certificate: only the listener's check refuses
        "another CA": (
            b.address,
            pynng.TLSConfig(
                pynng.TLSConfig.MODE_CLIENT,
                own_cert_string=stranger.cert,
                own_key_string=stranger.key,
                auth_mode=pynng.TLSConfig.AUTH_MODE_NONE,
            ),
        ),
        "no certificate": (
            b.address,
            pynng.TLSConfig(pynng.TLSConfig.MODE_CLIENT, auth_mode=pynng.TLSConfig.AUTH_MODE_NONE),
        ),
    }
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            for tls in (None, ssl_client(tmp_path, stranger), ssl_client(tmp_path, None)):
                ended = await anyio.to_thread.run_sync(raw_attack, port, tls, data)
                assert ended in ("closed", "SSLError", "ConnectionResetError"), ended
            for name, (url, config) in dialers.items():
                with pynng.Push0(tls_config=config, send_buffer_size=4) as push:
                    push.send(_auth.hello(b.address, f"attacker {name}"), block=False)
                    push.send(forged, block=False)
                    with pytest.raises(pynng.NNGException):
                        await anyio.to_thread.run_sync(
                            functools.partial(push.dial, url, block=True)
                        )
            # NNG counts failed handshakes on its threads, and not all of them (none
            # while its listener cools down after one): poll for the first.
            while b.statistics().auth_refused < 1:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            await a.send(b.address, b"proven")
            assert await inbox.take(1) == [b"proven"]
            tg.cancel_scope.cancel()
    assert [bytes(f) for f in inbox.kept] == [b"proven"]
    assert inbox.peers == [a.address]
    assert b.statistics().frames_received == 1


async def test_a_listener_of_another_ca_is_refused(
    cls: Callable[..., Transport], made: list[Transport]
) -> None:
    """A link checks the listener's certificate: to one of another CA it never
    connects, is reported lost for that, and the listener gets nothing."""
    a = cls("tls+tcp")
    made.append(a)
    lost = Lost()
    a.set_lost_handler(lost)
    rogue = pynng.TLSConfig(
        pynng.TLSConfig.MODE_SERVER,
        own_cert_string=(stranger := other_material()).cert,
        own_key_string=stranger.key,
        auth_mode=pynng.TLSConfig.AUTH_MODE_NONE,  # takes anyone
    )
    with pynng.Pull0(tls_config=rogue) as pull:
        listener = pull.listen(f"tls+tcp://{LOOPBACK}:0")
        addr = f"tls+tcp://{listener.local_address}"
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.serve, Inbox().deliver)
                assert a.try_send(addr, b"secret")
                await lost.wait()
                tg.cancel_scope.cancel()
        with pytest.raises(pynng.TryAgain):
            pull.recv(block=False)
    assert lost.reports[0][0] == addr
    assert "TLS handshake failed" in lost.reports[0][1], lost.reports


# -- the wire ------------------------------------------------------------------------------


class Recorder:
    """A TCP proxy on loopback that forwards to ``port`` and records every byte."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.wire = bytearray()

    async def handle(self, client: anyio.abc.SocketStream) -> None:
        async with client, await anyio.connect_tcp(LOOPBACK, self.port) as server:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._pump, client, server)
                    tg.start_soon(self._pump, server, client)
            finally:
                # Closed in full even when the test cancels this handler: a cancelled
                # aclose() on asyncio skips its abort(), and a socket with unsent bytes
                # then stays open until the loop drains it, after the test's leak check.
                with anyio.CancelScope(shield=True):
                    await server.aclose()
                    await client.aclose()

    async def _pump(self, src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream) -> None:
        try:
            async for chunk in src:
                self.wire += chunk
                await dst.send(chunk)
            await dst.send_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass


@pytest.mark.parametrize("scheme", ["tls+tcp", "tcp"])
async def test_the_wire_is_encrypted(
    cls: Callable[..., Transport], made: list[Transport], scheme: str
) -> None:
    """What a tls+tcp link sends (frames, and the hello with its address) is not on the
    wire in the clear, yet arrives; plain tcp, the control, shows it all."""
    a = cls(scheme)
    made.append(a)
    marker = b"AMESH-MARKER-" + secrets.token_hex(8).encode()
    frame = marker * 4096
    port = free_port()
    material = _tls.material() if scheme == "tls+tcp" else None
    recorder = Recorder(port)
    with anyio.fail_after(30):
        async with await anyio.create_tcp_listener(local_host=LOOPBACK) as proxy:
            # the link dials the proxy: its hello is for the proxy's address
            via = f"{scheme}://{LOOPBACK}:{proxy.extra(anyio.abc.SocketAttribute.local_port)}"
            async with (
                tls_receiver(f"{scheme}://{LOOPBACK}:{port}", material, target=via) as take,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(proxy.serve, recorder.handle)
                await a.send(via, frame)
                assert await take() == frame
                tg.cancel_scope.cancel()
    wire = bytes(recorder.wire)
    assert len(wire) > len(frame)
    if scheme == "tcp":
        assert marker in wire and a.address.encode() in wire
    else:
        assert wire[0] == 0x16  # a TLS handshake record
        assert marker not in wire
        assert a.address.encode() not in wire  # in the hello


# -- heartbeats, open_transport ------------------------------------------------------------


async def test_heartbeat_sender_over_tls(made: list[Transport]) -> None:
    """A worker's heartbeat thread dials a tls+tcp parent with the job's certificate."""
    t, inbox = ExtTransport("tls+tcp"), Inbox()
    made.append(t)
    sender = heartbeat_sender(t.address, own="tls+tcp://127.0.0.1:1")
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(t.serve, inbox.deliver)
                assert await anyio.to_thread.run_sync(sender.send, b"beat")
                assert await inbox.take(1) == [b"beat"]
                tg.cancel_scope.cancel()
    finally:
        sender.close()
    assert inbox.peers == ["tls+tcp://127.0.0.1:1"]
    assert t.statistics().auth_refused == 0


def test_open_transport_takes_tls_to_nng(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the NNG transport speaks TLS: tls+tcp picks it whatever the default (under
    a HybridTransport, which adds streams within the host, unless it is named: `ext`,
    or `nng`, which once named the pure-pynng transport and now means the same)."""
    for impl in ("stream", "ext", "nng"):
        monkeypatch.setenv("AMESH_TRANSPORT_IMPL", impl)
        t = open_transport("tls+tcp")
        t.close()
        assert not isinstance(t, StreamTransport)
        assert t.address.startswith("tls+tcp://127.0.0.1:")
        assert isinstance(t, HybridTransport) == (impl == "stream")
        assert isinstance(t, ExtTransport) == (impl != "stream")


# -- the certificates ----------------------------------------------------------------------


def cert(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def public(c: x509.Certificate) -> bytes:
    return c.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def test_the_job_ca_comes_from_the_job_key() -> None:
    """Every process of a job derives the same CA from the key, so each one's leaf is
    verified by every other's CA; another key makes another CA."""
    key = secrets.token_bytes(_identity.KEY_SIZE)
    one, two = _tls.job_material(key), _tls.job_material(key)
    ca1, ca2 = cert(one.ca), cert(two.ca)
    assert public(ca1) == public(ca2) and ca1.subject == ca2.subject
    cert(two.cert).verify_directly_issued_by(ca1)
    cert(one.cert).verify_directly_issued_by(ca2)
    assert one.key != two.key  # each process has its own leaf key
    stranger = other_material()
    assert public(cert(stranger.ca)) != public(ca1)
    with pytest.raises(ValueError):  # another issuer
        cert(stranger.cert).verify_directly_issued_by(ca1)
    leaf = cert(one.cert)
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
    assert leaf.public_key().curve.name == ec.SECP256R1().name
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= _tls.VALIDITY + (
        datetime.timedelta(hours=1)
    )
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.DNSName) == [_tls.SERVER_NAME]
    assert cert(one.ca).extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_certificates_are_cached_per_job_key_and_renewed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = _tls.material()
    assert _tls.material() is first
    assert _tls.server_config() is _tls.server_config()
    key = _identity.job_key()
    try:
        _identity.adopt_key(secrets.token_bytes(_identity.KEY_SIZE))
        assert public(cert(_tls.material().ca)) != public(cert(first.ca))
    finally:
        _identity.adopt_key(key)
    again = _tls.material()
    assert public(cert(again.ca)) == public(cert(first.ca))
    # made again once half their validity has passed
    entry = _tls._entry
    assert entry is not None
    monkeypatch.setattr(_tls, "_entry", replace(entry, material=replace(again, renew_at=0.0)))
    renewed = _tls.material()
    assert renewed is not again and renewed.cert != again.cert
    assert public(cert(renewed.ca)) == public(cert(again.ca))


def write_material(path: Path, m: _tls.Material) -> dict[str, str]:
    files = {_tls.ENV_CA: m.ca, _tls.ENV_CERT: m.cert, _tls.ENV_KEY: m.key}
    out = {}
    for var, text in files.items():
        (path / var).write_text(text)
        out[var] = str(path / var)
    return out


def test_a_prepared_job_ca_serves_every_leaf_until_it_ages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prepare() makes the job CA once (as a zygote does before it forks): leaves made
    after it are signed by that very certificate, each for a key of its own; past half
    its validity, or for another key, a new CA is made; a fork keeps it."""
    for name in ("_job_ca", "_entry", "_lock"):  # put back afterwards
        monkeypatch.setattr(_tls, name, getattr(_tls, name))
    key = secrets.token_bytes(_identity.KEY_SIZE)
    _tls.prepare(key)
    made = _tls._job_ca
    assert made is not None
    one, two = _tls.job_material(key), _tls.job_material(key)
    assert one.ca == two.ca == made.pem  # the same certificate, not just the same key
    assert one.key != two.key and one.cert != two.cert
    cert(one.cert).verify_directly_issued_by(cert(made.pem))
    assert one.renew_at == made.renew_at
    _tls._forget_in_child()  # what a forked child runs
    assert _tls._job_ca is made
    aged = _tls.job_material(key, now=made.renew_at + 1)
    assert aged.ca != made.pem and public(cert(aged.ca)) == public(cert(made.pem))
    assert aged.renew_at > made.renew_at
    stranger = _tls.job_material(secrets.token_bytes(_identity.KEY_SIZE))
    assert public(cert(stranger.ca)) != public(cert(made.pem))


async def test_workers_forked_for_tls_share_the_zygotes_job_ca() -> None:
    """A controller on tcp (TLS between hosts): its zygote makes the job CA before it
    forks the workers (and imports cryptography once), so two workers show the very
    same CA certificate, each with a leaf key of its own that the CA signed."""
    from amesh import ProcMesh
    from amesh._runtime import open_runtime

    from .actors import TlsIdentity

    with anyio.fail_after(120):
        async with open_runtime(lambda: open_transport("tcp")) as rt:
            assert rt.address.startswith("tls+tcp://")
            async with ProcMesh({"procs": 2}) as procs:
                ids = await procs.spawn("ids", TlsIdentity)
                (ca1, leaf1, key1, zygote1), (ca2, leaf2, key2, zygote2) = (
                    await ids.material.call()
                ).values()
    assert zygote1 == zygote2 != os.getpid()  # both forked by the zygote
    assert ca1 == ca2
    assert public(cert(ca1)) == public(cert(_tls.material().ca))  # the job's CA
    assert key1 != key2 and leaf1 != leaf2
    for leaf in (leaf1, leaf2):
        cert(leaf).verify_directly_issued_by(cert(ca1))


async def test_certificates_from_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: list[Transport]
) -> None:
    """AMESH_TLS_CA/CERT/KEY replace the job's certificates; transports use them."""
    m = other_material()
    for var, path in write_material(tmp_path, m).items():
        monkeypatch.setenv(var, path)
    got = _tls.material()
    assert (got.ca, got.cert, got.key) == (m.ca, m.cert, m.key)
    a, b, inbox = ExtTransport("tls+tcp"), PynngTransport("tls+tcp"), Inbox()
    made += [a, b]
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.serve, inbox.deliver)
            await a.send(b.address, b"with files")
            assert await inbox.take(1) == [b"with files"]
            tg.cancel_scope.cancel()


def test_certificate_files_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some of the variables, unreadable or mismatched files: a clear error, before any
    socket opens."""
    m = other_material()
    paths = write_material(tmp_path, m)

    def expect(match: str) -> None:
        with pytest.raises(ValueError, match=match):
            _tls.material()
        with pytest.raises(ValueError, match=match):
            ExtTransport("tls+tcp")

    monkeypatch.setenv(_tls.ENV_CA, paths[_tls.ENV_CA])
    monkeypatch.setenv(_tls.ENV_KEY, paths[_tls.ENV_KEY])
    expect("all three or none.*missing: AMESH_TLS_CERT")
    monkeypatch.setenv(_tls.ENV_CERT, str(tmp_path / "missing.pem"))
    expect("AMESH_TLS_CERT=.*cannot read")
    monkeypatch.setenv(_tls.ENV_CERT, paths[_tls.ENV_KEY])
    expect("AMESH_TLS_CERT=.*not PEM certificates")
    monkeypatch.setenv(_tls.ENV_CERT, paths[_tls.ENV_CERT])
    (tmp_path / "other.key").write_text(other_material().key)
    monkeypatch.setenv(_tls.ENV_KEY, str(tmp_path / "other.key"))
    expect("is not the key of the certificate")
    key = serialization.load_pem_private_key(m.key.encode(), password=None)
    (tmp_path / "locked.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    monkeypatch.setenv(_tls.ENV_KEY, str(tmp_path / "locked.key"))
    expect("encrypted")
    monkeypatch.setenv(_tls.ENV_KEY, paths[_tls.ENV_KEY])
    monkeypatch.setenv(_tls.ENV_SERVER_NAME, "elsewhere")
    expect("does not name 'elsewhere'")
    monkeypatch.delenv(_tls.ENV_SERVER_NAME)
    assert _tls.material().cert == m.cert


@pytest.mark.parametrize("impl_name", ["ext", "nng"])
async def test_a_mesh_over_tls(impl_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A controller and its workers on tls+tcp: spawn, the adverbs, a remote error."""
    from amesh import ActorError, ProcMesh
    from amesh._runtime import open_runtime
    from amesh._transport import open_transport

    from .actors import Counter

    monkeypatch.setenv("AMESH_TRANSPORT_IMPL", impl_name)
    with anyio.fail_after(120):
        async with open_runtime(lambda: open_transport("tls+tcp")) as rt:
            assert rt.address.startswith("tls+tcp://127.0.0.1:")
            async with ProcMesh({"procs": 2}) as procs:
                c = await procs.spawn("c", Counter)
                assert list((await c.incr.call()).values()) == [1, 1]
                await c.incr.broadcast(2)
                assert await c.slice(procs=1).get.call_one() == 3
                stats = (await procs.statistics()).values()
                assert all(s["address"].startswith("tls+tcp://") for s in stats)
                with pytest.raises(ActorError, match="boom"):
                    await c.slice(procs=0).fail.call_one("boom")
