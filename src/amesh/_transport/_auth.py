"""How a peer proves that it holds the job key before anything it sends is read.

The key itself, and the other keys a process may hold, are :mod:`amesh._identity`'s.

Stream transport, once per connection (the listener speaks first)::

    listener -> dialer   "AMC1" | nonce (32 random bytes)
    dialer -> listener   "AMA1" | n (u16 LE) | dialer address (n bytes, UTF-8) | proof (32)
                         ... and then frames, pipelined behind the answer

    proof = HMAC-SHA256(key, STREAM_TAG | nonce | m (u16 LE) | listener address (m bytes)
                             | dialer address)

The listener's address is the one it advertises (and the dialer dialled): an answer
given to whoever squats an address proves nothing to another listener. Before the
challenge, a listener on a unix socket refuses a peer of another uid (SO_PEERCRED).

NNG transports, the first message of every pipe (NNG speaks no handshake of ours)::

    "AMN1" | nonce (16 random bytes) | time (u64 LE, ns since the epoch) | n (u16 LE)
           | dialer address (n bytes) | proof (32)

    proof = HMAC-SHA256(key, NNG_TAG | nonce | time | m (u16 LE) | listener address
                             | dialer address)

The listener takes a hello within :data:`HELLO_WINDOW` of its time and remembers its
nonce as long, so a recorded hello cannot be replayed.

A process may hold other keys beside its job key (:func:`amesh._identity.hold_key`).
Its listeners take a proof made with any of its keys; it proves itself with the key of
the address it dials (:func:`amesh._identity.key_for`), and dials a peer that proved
itself with another key than the job key with that one from then on. (TLS certificates
come from the job key alone.)

Every refusal is counted and logged with the peer, at most one line per
:data:`LOG_INTERVAL` seconds (a flood of bad connections costs one line).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import logging
import os
import secrets
import socket
import struct
import sys
import time
from typing import Any

from .._identity import held_keys, hold_key, job_key, key_for
from .._ratelog import RateLimitedLog

__all__ = [
    "ANSWER_MAX",
    "CHALLENGE_LEN",
    "HANDSHAKE_TIMEOUT",
    "HELLO_WINDOW",
    "Gate",
    "HelloCheck",
    "Refusals",
    "Refused",
    "answer",
    "check_peer",
    "describe_peer",
    "hello",
    "mac",
]

log = logging.getLogger("amesh.transport")

#: A peer that has not proven itself this many seconds after it connected is dropped.
HANDSHAKE_TIMEOUT = 5.0
#: An NNG hello is taken this long either side of the listener's clock.
HELLO_WINDOW = 60.0
#: At most one log line per this many seconds for refused peers.
LOG_INTERVAL = 5.0
#: The longest address a peer may claim (ours are well under 200 bytes).
MAX_ADDRESS = 1024

_STREAM_TAG = b"amesh stream auth v1\0"
_NNG_TAG = b"amesh nng hello v1\0"
_CHALLENGE = b"AMC1"
_ANSWER = b"AMA1"
_HELLO = b"AMN1"
_NONCE = 32
_HELLO_NONCE = 16
_PROOF = 32
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
CHALLENGE_LEN = len(_CHALLENGE) + _NONCE
_ANSWER_HEAD = len(_ANSWER) + _U16.size
ANSWER_MAX = _ANSWER_HEAD + MAX_ADDRESS + _PROOF
_HELLO_HEAD = len(_HELLO) + _HELLO_NONCE + _U64.size + _U16.size
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _own_sha256() -> Any:
    """CPython's own SHA-256 constructor (``_sha2`` from 3.12, ``_sha256`` before), for
    the proofs: a freshly forked worker's first HMAC through OpenSSL costs it ~0.4 ms
    and ~150 page copies (OpenSSL sets itself up again after a fork), of the ~10 ms
    that starting a worker costs; this one ~0.1 ms. The same bytes either way."""
    # (by version: a failed import would search all of sys.path at every start)
    name = "_sha2" if sys.version_info >= (3, 12) else "_sha256"
    try:
        return importlib.import_module(name).sha256
    except (ImportError, AttributeError):
        return hashlib.sha256  # a build without CPython's own hashes


_sha256 = _own_sha256()


class Refused(Exception):
    """A peer did not prove that it holds the job key (or a listener refused us)."""


def mac(data: bytes, key: bytes | None = None) -> bytes:
    """HMAC-SHA256 of ``data`` under ``key``, this job's key by default (the 32 bytes
    of a proof)."""
    return hmac.new(job_key() if key is None else key, data, _sha256).digest()


def _proven(proof: bytes, data: bytes, peer: bytes) -> bool:
    """Whether ``proof`` is the MAC of ``data`` under a key of ours; a peer that used
    another than the job key is dialled with that one from then on."""
    for i, key in enumerate(held_keys()):
        if hmac.compare_digest(proof, mac(data, key)):
            if i:
                hold_key(key, (peer.decode(errors="replace"),))
            return True
    return False


def _address_bytes(addr: str) -> bytes:
    data = addr.encode()
    if len(data) > MAX_ADDRESS:
        raise ValueError(f"address longer than {MAX_ADDRESS} bytes: {addr[:80]!r}...")
    return data


def _bound(target: str) -> bytes:
    data = _address_bytes(target)
    return _U16.pack(len(data)) + data


# -- stream transport ------------------------------------------------------------------


def _stream_signed(nonce: bytes, target: str, dialer: bytes) -> bytes:
    return _STREAM_TAG + nonce + _bound(target) + dialer


def answer(challenge: bytes, target: str, own: str) -> bytes:
    """The dialer's answer to the ``challenge`` of the listener at ``target``.

    Args:
        challenge: the :data:`CHALLENGE_LEN` bytes the listener sent.
        target: the address the dialer dialled (the listener's own).
        own: the dialer's listening address ("" for one that does not listen).

    Raises:
        Refused: ``challenge`` is not an amesh challenge.
    """
    if len(challenge) != CHALLENGE_LEN or not challenge.startswith(_CHALLENGE):
        raise Refused("the peer did not send an amesh challenge")
    me = _address_bytes(own)
    proof = mac(_stream_signed(challenge[4:], target, me), key_for(target))
    return _ANSWER + _U16.pack(len(me)) + me + proof


class Gate:
    """The listener's side of one connection's handshake, without I/O.

    Send :attr:`challenge`, then read into :meth:`get_buffer` and report the count to
    :meth:`buffer_updated` until it returns the bytes that followed the answer.

    Args:
        target: the listener's own address.
    """

    __slots__ = ("_buf", "_filled", "_nonce", "_target", "challenge", "peer")

    def __init__(self, target: str) -> None:
        self._nonce = secrets.token_bytes(_NONCE)
        self._target = target
        self._buf = bytearray(ANSWER_MAX)
        self._filled = 0
        #: what to send first
        self.challenge = _CHALLENGE + self._nonce
        #: the dialer's address, once it proved itself
        self.peer = ""

    def get_buffer(self) -> memoryview:
        return memoryview(self._buf)[self._filled :]

    def buffer_updated(self, n: int) -> memoryview | None:
        """Account ``n`` bytes read into the buffer.

        Returns:
            None while the answer is incomplete; then what the dialer sent behind it.

        Raises:
            Refused: the answer is not one, or its proof is wrong.
        """
        self._filled += n
        buf, filled = self._buf, self._filled
        head = min(filled, len(_ANSWER))
        if buf[:head] != _ANSWER[:head]:
            raise Refused("not an amesh handshake")
        if filled < _ANSWER_HEAD:
            return None
        (size,) = _U16.unpack_from(buf, len(_ANSWER))
        if size > MAX_ADDRESS:
            raise Refused(f"an address of {size} bytes")
        end = _ANSWER_HEAD + size + _PROOF
        if filled < end:
            return None
        dialer = bytes(buf[_ANSWER_HEAD : _ANSWER_HEAD + size])
        proof = bytes(buf[end - _PROOF : end])
        if not _proven(proof, _stream_signed(self._nonce, self._target, dialer), dialer):
            raise Refused("wrong proof (not of this job)")
        try:
            self.peer = dialer.decode()
        except UnicodeDecodeError:
            raise Refused("an address that is not UTF-8") from None
        return memoryview(buf)[end:filled]


def describe_peer(sock: Any) -> tuple[str, int | None]:
    """Who is at the other end of an accepted ``sock``: a description for the log, and
    its uid where the kernel tells (unix sockets on Linux), else None."""
    if sock.family == socket.AF_UNIX and hasattr(socket, "SO_PEERCRED"):
        try:
            pid, uid, _ = _CRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
            )
        except OSError as exc:
            return f"a unix socket peer ({exc})", -1
        return f"pid {pid} (uid {uid})", uid
    try:
        name = sock.getpeername()
    except OSError:
        return "a peer that is gone", None
    return (f"{name[0]}:{name[1]}" if isinstance(name, tuple) else repr(name)), None


def check_peer(sock: Any) -> tuple[str, str]:
    """``(who, why)`` for an accepted ``sock``: ``why`` is not empty when the peer is
    refused before any challenge (a unix socket peer of another uid than ours)."""
    who, uid = describe_peer(sock)
    if uid is not None and uid != os.getuid():
        return who, f"uid {uid} is not this job's uid {os.getuid()}"
    return who, ""


# -- NNG transports --------------------------------------------------------------------


def _nng_signed(signed: bytes, target: str, dialer: bytes) -> bytes:
    return _NNG_TAG + signed + _bound(target) + dialer


def hello(target: str, own: str) -> bytes:
    """The first message of an NNG link from ``own`` to the listener at ``target``."""
    me = _address_bytes(own)
    signed = secrets.token_bytes(_HELLO_NONCE) + _U64.pack(time.time_ns())
    proof = mac(_nng_signed(signed, target, me), key_for(target))
    return _HELLO + signed + _U16.pack(len(me)) + me + proof


class HelloCheck:
    """Checks the hellos that open the pipes of one NNG listener, and remembers their
    nonces for :data:`HELLO_WINDOW` so that none is taken twice.

    Args:
        target: the listener's own address.
    """

    def __init__(self, target: str) -> None:
        self._target = target
        self._seen: dict[bytes, int] = {}  # nonce -> its time (ns)
        self._prune_at = 64

    def check(self, msg: Any) -> str:
        """The dialer's address, if ``msg`` is a fresh hello with the right proof.

        Raises:
            Refused: it is not.
        """
        data = bytes(msg[: _HELLO_HEAD + MAX_ADDRESS + _PROOF + 1])
        if len(data) < _HELLO_HEAD or not data.startswith(_HELLO):
            raise Refused("the first message is not an amesh hello")
        (size,) = _U16.unpack_from(data, _HELLO_HEAD - _U16.size)
        if size > MAX_ADDRESS or len(msg) != _HELLO_HEAD + size + _PROOF:
            raise Refused("a malformed hello")
        signed = data[len(_HELLO) : _HELLO_HEAD - _U16.size]
        dialer = data[_HELLO_HEAD : _HELLO_HEAD + size]
        proof = data[_HELLO_HEAD + size :]
        if not _proven(proof, _nng_signed(signed, self._target, dialer), dialer):
            raise Refused("wrong proof (not of this job)")
        nonce = signed[:_HELLO_NONCE]
        (sent,) = _U64.unpack_from(signed, _HELLO_NONCE)
        now = time.time_ns()
        window = int(HELLO_WINDOW * 1e9)
        if abs(now - sent) > window:
            raise Refused("a hello out of its time window")
        if nonce in self._seen:
            raise Refused("a replayed hello")
        self._seen[nonce] = sent
        if len(self._seen) >= self._prune_at:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= window}
            self._prune_at = 2 * len(self._seen) + 64
        try:
            return dialer.decode()
        except UnicodeDecodeError:
            raise Refused("an address that is not UTF-8") from None


# -- refusals --------------------------------------------------------------------------


class Refusals:
    """Counts the peers a transport refused, and logs them (rate-limited).

    Args:
        own: the transport's address, for the log.
    """

    def __init__(self, own: str) -> None:
        self.count = 0
        self._own = own
        self._log = RateLimitedLog(log, LOG_INTERVAL)

    def refuse(self, who: str, why: str) -> None:
        self.count += 1
        self._log.warning("refused a connection from %s to %s: %s", who, self._own, why)
