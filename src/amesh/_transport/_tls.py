"""Certificates for ``tls+tcp`` links: both ends prove they belong to the job.

NNG (through pynng) speaks TLS with Mbed TLS. A ``tls+tcp`` listener requires a client
certificate signed by the job's CA (``auth_mode`` required), and a dialer verifies the
listener's certificate against the same CA and the name :data:`SERVER_NAME` (hosts are
dialled by IP address, so every certificate carries that one fixed DNS name in its
subject alternative names). TLS 1.3 only, where the build has it. The job-key hello
(:mod:`._auth`) still opens every pipe inside the TLS session: TLS says the peer is of
this job, the hello says which address it speaks for.

Where the certificates come from:

- By default, from the job key. Every process of a job holds the key
  (:func:`amesh._identity.job_key`, adopted from the parent over a private channel
  before the transport opens), so each derives the same CA private key from it: a
  P-256 scalar from HKDF-SHA256(job key, info ``"amesh tls ca v1"``). It self-signs a
  CA certificate (its name carries a fingerprint of the CA's public key) and signs a
  leaf certificate for a fresh key of its own, which never leaves the process. Both are
  valid from an hour ago (clock skew between hosts) for :data:`VALIDITY`, and are
  made again once half of that has passed, so a job may outlive them; connections
  that are up stay up.
- From files, when ``AMESH_TLS_CA``, ``AMESH_TLS_CERT`` and ``AMESH_TLS_KEY`` name
  (all three, or none) a PEM CA bundle, this process's PEM certificate (chain) and its
  unencrypted PEM private key. The certificate must carry :func:`server_name`
  (``AMESH_TLS_SERVER_NAME``, default ``"amesh"``) in its subject alternative names.
  Every process of the job needs them (workers inherit the environment; the files
  must exist at those paths on every host), and they are not renewed.

Is a CA derived from the job key sound? It adds no new secret and no new trust: whoever
holds the job key can mint a certificate, but whoever holds it can already join the job
(the hello). So a ``tls+tcp`` peer is authenticated exactly as well as by the hello (a
256-bit secret that only travels over private channels), and TLS adds what the hello
lacks: the frames are encrypted and integrity-protected for the whole connection, not
only its first message, so nobody on the path reads them or splices into a proven
connection. The key exchange is ephemeral (ECDHE), so a job key that leaks later does
not decrypt recorded traffic; a leak during the job lets the holder impersonate
processes of it, as it already could. The derivation is domain-separated from the
key's other use (HMAC with its own tags), and no other CA (no system store) is
trusted. The short validity is hygiene rather than a defence: the leaf keys are as
secret as the job key that sits next to them. Use the files to root the job in a CA
of your own (then the job key and the certificates are two separate secrets).

What NNG does with a peer that fails the handshake: it closes the connection before
it is a pipe, so nothing the peer sent reaches the inbox (in TLS 1.3 a client may
send data before the listener has checked its certificate: it is dropped unread).
The inbox counts such refusals from NNG's statistics, as far as they tell
(:func:`handshake_failures`). NNG's listener rests 100 ms after a failed handshake
before it takes the next connection (connections that complete meanwhile wait, none
is lost): a stream of bad handshakes slows the acceptance of good ones, no more.

Making keys and signing costs a few milliseconds, so the result is cached per process
(and per job key: a process that adopts another key derives again). The job CA outlives
a fork: a zygote makes it (:func:`prepare`) before it forks workers whose parent is on
``tls+tcp``, and each of them then makes only its own leaf key and certificate, which
share the CA's validity.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import pynng
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .._config import settings
from .._identity import job_key

__all__ = [
    "ENV_CA",
    "ENV_CERT",
    "ENV_KEY",
    "ENV_SERVER_NAME",
    "SCHEME",
    "SERVER_NAME",
    "VALIDITY",
    "Material",
    "client_config",
    "handshake_failures",
    "is_tls_address",
    "job_material",
    "material",
    "prepare",
    "server_config",
    "server_name",
]

#: The NNG scheme of encrypted, mutually verified links.
SCHEME = "tls+tcp"
ENV_CA = "AMESH_TLS_CA"
ENV_CERT = "AMESH_TLS_CERT"
ENV_KEY = "AMESH_TLS_KEY"
ENV_SERVER_NAME = "AMESH_TLS_SERVER_NAME"
#: The DNS name every certificate of a job carries and every dialer checks.
SERVER_NAME = "amesh"
#: How long the certificates derived from the job key are valid.
VALIDITY = datetime.timedelta(days=7)
#: How far back they are valid from (the clocks of hosts differ a little).
_SKEW = datetime.timedelta(hours=1)
_CA_INFO = b"amesh tls ca v1"
#: The order of P-256's group.
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
#: NNG's listener statistics that count TLS handshakes that failed. Not "other": NNG
#: counts there both ordinary pipes that end and some refused handshakes (a client
#: without a certificate, or with one of another CA, that does not check the listener's).
#: And not every failure: after one, NNG's listener cools down for 100 ms, and the
#: handshakes that fail meanwhile are dropped without a word.
_LISTENER_FAILURES = (b"auth", b"proto", b"timeout")
#: ... and a dialer's (a connection nobody answered counts as "refused", not here).
_DIALER_FAILURES = (b"auth", b"proto")


@dataclass(frozen=True)
class Material:
    """What a process needs for ``tls+tcp``: the CA(s) it trusts, its own certificate
    (chain) and key, all PEM, and the name it checks in a listener's certificate."""

    ca: str
    cert: str
    key: str
    server_name: str = SERVER_NAME
    #: when (``time.time()``) to make new ones; never for files
    renew_at: float = float("inf")


def is_tls_address(addr: str) -> bool:
    """Whether ``addr`` is a ``tls+tcp`` address."""
    return addr.startswith(SCHEME + "://")


def server_name() -> str:
    """The name dialers check in a listener's certificate: ``AMESH_TLS_SERVER_NAME``,
    else :data:`SERVER_NAME`."""
    return settings().tls_server_name or SERVER_NAME


# -- certificates from the job key -----------------------------------------------------


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _ca_key(key: bytes) -> ec.EllipticCurvePrivateKey:
    """The job's CA key: the same in every process that holds ``key``."""
    okm = HKDF(algorithm=hashes.SHA256(), length=48, salt=None, info=_CA_INFO).derive(key)
    # 384 bits reduced modulo a 256-bit order: the bias is below 2**-128.
    scalar = int.from_bytes(okm, "big") % (_P256_ORDER - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


@dataclass(frozen=True)
class _JobCa:
    """A job CA made in this process (or in the zygote it was forked from)."""

    digest: bytes  # SHA-256 of the job key
    key: ec.EllipticCurvePrivateKey
    name: x509.Name
    ski: x509.SubjectKeyIdentifier
    pem: str
    begin: datetime.datetime
    end: datetime.datetime
    #: when (``time.time()``) to make a new one: half of its validity
    renew_at: float


#: The last job CA made here. Unlike the leaf (see _forget_in_child), a forked child
#: keeps it: a zygote that made it (:func:`prepare`) spares each of its workers the
#: derivation and a signature.
_job_ca: _JobCa | None = None


def _make_ca(key: bytes, when: float) -> _JobCa:
    start = datetime.datetime.fromtimestamp(when, datetime.UTC)
    begin, end = start - _SKEW, start + VALIDITY
    ca_key = _ca_key(key)
    ca_public = ca_key.public_key()
    point = ca_public.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "amesh"),
            x509.NameAttribute(
                NameOID.COMMON_NAME, f"amesh job CA {hashlib.sha256(point).hexdigest()[:16]}"
            ),
        ]
    )
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_public)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _JobCa(
        hashlib.sha256(key).digest(),
        ca_key,
        ca_name,
        ca_ski,
        _pem(ca),
        begin,
        end,
        when + VALIDITY.total_seconds() / 2,
    )


def _ca_for(key: bytes, when: float) -> _JobCa:
    """The job CA of ``key`` valid at ``when``: the one made last if it is still young
    enough, else a new one (kept)."""
    global _job_ca
    ca = _job_ca
    if (
        ca is None
        or ca.digest != hashlib.sha256(key).digest()
        or not (ca.begin.timestamp() <= when < ca.renew_at)
    ):
        ca = _job_ca = _make_ca(key, when)
    return ca


def prepare(key: bytes) -> None:
    """Make the job CA of ``key`` now, and warm what signing a certificate needs, so
    that the children this process forks next (a zygote's workers) only make their own
    leaf key and certificate (see :func:`job_material`)."""
    _ca_for(key, time.time())


def job_material(key: bytes, now: float | None = None) -> Material:
    """The job CA of ``key`` and a leaf certificate for a fresh key of this process,
    valid from ``now`` (default: the present) for :data:`VALIDITY`.

    The CA made last (here, or before the fork in the zygote this process came from:
    :func:`prepare`) is used again while it is younger than half its validity; the
    leaf then shares its validity, and both are made again at the same time."""
    when = time.time() if now is None else now
    ca = _ca_for(key, when)
    ca_key, ca_name, ca_ski, begin, end = ca.key, ca.name, ca.ski, ca.begin, ca.end
    own = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
        .issuer_name(ca_name)
        .public_key(own.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    own_pem = own.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return Material(
        ca=ca.pem,
        cert=_pem(leaf),
        key=own_pem,
        server_name=SERVER_NAME,
        renew_at=ca.renew_at,
    )


# -- certificates from files -----------------------------------------------------------


def _read(var: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{var}={path!r}: cannot read it ({exc.strerror or exc})") from None


def _names(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return san.value.get_values_for_type(x509.DNSName)


def files_material(ca_path: str, cert_path: str, key_path: str, name: str) -> Material:
    """The :class:`Material` in the PEM files at the paths given, checked.

    Raises:
        ValueError: a file cannot be read or parsed, the key is encrypted or is not the
            certificate's, or the certificate does not carry ``name``.
    """
    ca_data = _read(ENV_CA, ca_path)
    cert_data = _read(ENV_CERT, cert_path)
    key_data = _read(ENV_KEY, key_path)
    for var, path, data in ((ENV_CA, ca_path, ca_data), (ENV_CERT, cert_path, cert_data)):
        try:
            x509.load_pem_x509_certificates(data)
        except ValueError as exc:
            raise ValueError(f"{var}={path!r} is not PEM certificates: {exc}") from None
    leaf = x509.load_pem_x509_certificates(cert_data)[0]
    try:
        own: Any = serialization.load_pem_private_key(key_data, password=None)
    except TypeError:
        raise ValueError(f"{ENV_KEY}={key_path!r} is encrypted: amesh reads no passwords") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"{ENV_KEY}={key_path!r} is not a PEM private key: {exc}") from None
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if own.public_key().public_bytes(*fmt) != leaf.public_key().public_bytes(*fmt):
        raise ValueError(
            f"{ENV_KEY}={key_path!r} is not the key of the certificate {ENV_CERT}={cert_path!r}"
        )
    if name not in _names(leaf):
        raise ValueError(
            f"the certificate {ENV_CERT}={cert_path!r} does not name {name!r} among its "
            f"subject alternative names (DNS: {_names(leaf)}); dialers check that name "
            f"(set {ENV_SERVER_NAME} to the one your certificates carry)"
        )
    return Material(
        ca=ca_data.decode(), cert=cert_data.decode(), key=key_data.decode(), server_name=name
    )


def _env_paths() -> tuple[str, str, str] | None:
    config = settings()
    values = {ENV_CA: config.tls_ca, ENV_CERT: config.tls_cert, ENV_KEY: config.tls_key}
    given = [var for var, value in values.items() if value]
    if not given:
        return None
    if len(given) != len(values):
        missing = [var for var in values if var not in given]
        raise ValueError(
            f"{', '.join(values)} go together: set all three or none "
            f"(set: {', '.join(given)}; missing: {', '.join(missing)})"
        )
    return values[ENV_CA], values[ENV_CERT], values[ENV_KEY]


# -- the cache -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    source: tuple[object, ...]
    material: Material
    server: Any  # pynng.TLSConfig
    client: Any


_lock = threading.Lock()
_entry: _Entry | None = None


def _forget_in_child() -> None:
    """A forked child makes its own leaf key (and TLS configurations of its own NNG);
    it keeps the job CA (_job_ca)."""
    global _entry, _lock
    _entry = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_forget_in_child)


def _config(mode: int, m: Material) -> Any:
    cfg = pynng.TLSConfig(
        mode,
        server_name=m.server_name if mode == pynng.TLSConfig.MODE_CLIENT else None,
        ca_string=m.ca,
        own_cert_string=m.cert,
        own_key_string=m.key,
        auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED,
    )
    lib = pynng.lib
    # TLS 1.3 only (the certificates travel encrypted), unless the build lacks it.
    if lib.nng_tls_config_version(cfg._tls_config, lib.NNG_TLS_1_3, lib.NNG_TLS_1_3) != 0:
        pynng.check_err(
            lib.nng_tls_config_version(cfg._tls_config, lib.NNG_TLS_1_2, lib.NNG_TLS_1_3)
        )
    return cfg


def _current() -> _Entry:
    global _entry
    paths = _env_paths()
    source: tuple[object, ...]
    if paths is not None:
        source = ("files", *paths, server_name())
    else:
        source = ("job", hashlib.sha256(job_key()).digest())
    entry = _entry
    if entry is not None and entry.source == source and time.time() < entry.material.renew_at:
        return entry
    with _lock:
        entry = _entry
        if entry is None or entry.source != source or time.time() >= entry.material.renew_at:
            if paths is not None:
                m = files_material(*paths, name=server_name())
            else:
                m = job_material(job_key())
            entry = _entry = _Entry(
                source,
                m,
                _config(pynng.TLSConfig.MODE_SERVER, m),
                _config(pynng.TLSConfig.MODE_CLIENT, m),
            )
    return entry


def material() -> Material:
    """This process's certificates (see the module's docstring), cached.

    Raises:
        ValueError: the ``AMESH_TLS_*`` variables are set wrong, or their files are.
    """
    return _current().material


def server_config(m: Material | None = None) -> Any:
    """The ``pynng.TLSConfig`` of a ``tls+tcp`` listener: its own certificate, and a
    client certificate of the job required. ``m`` makes one of other certificates
    (tests do)."""
    if m is None:
        return _current().server
    return _config(pynng.TLSConfig.MODE_SERVER, m)


def client_config(m: Material | None = None) -> Any:
    """The ``pynng.TLSConfig`` of a ``tls+tcp`` dialer: the listener's certificate is
    checked against the job CA and :func:`server_name`, and its own is presented.
    ``m`` makes one of other certificates (tests do)."""
    if m is None:
        return _current().client
    return _config(pynng.TLSConfig.MODE_CLIENT, m)


# -- handshakes that failed ------------------------------------------------------------


def handshake_failures(endpoint: Any, listener: bool) -> int:
    """How many TLS handshakes of an NNG listener (or dialer, ``listener=False``)
    failed, as far as NNG's statistics tell: a peer that speaks no TLS, or that refused
    our certificate. A client that shows none, or one of another CA, without checking
    ours is refused as well but not counted (NNG files those under "other" errors,
    with the pipes that end), nor is a failure during the 100 ms that NNG's listener
    rests after one: a lower bound, then. 0 where NNG keeps no statistics. It costs a
    snapshot of all of NNG's statistics (µs).

    Args:
        endpoint: the ``nng_listener`` (or ``nng_dialer``) handle.
    """
    ffi, lib = pynng.ffi, pynng.lib
    snapshot = ffi.new("nng_stat **")
    if lib.nng_stats_get(snapshot) != 0:
        return 0
    try:
        find = lib.nng_stat_find_listener if listener else lib.nng_stat_find_dialer
        node = find(snapshot[0], endpoint)
        names = _LISTENER_FAILURES if listener else _DIALER_FAILURES
        total = 0
        child = lib.nng_stat_child(node) if node != ffi.NULL else ffi.NULL
        while child != ffi.NULL:
            if ffi.string(lib.nng_stat_name(child)) in names:
                total += int(lib.nng_stat_value(child))
            child = lib.nng_stat_next(child)
        return total
    finally:
        lib.nng_stats_free(snapshot[0])
