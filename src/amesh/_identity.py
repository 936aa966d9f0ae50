"""The job's key: who a process belongs to.

A job is one controller and every process it starts. The controller makes the key (32
random bytes) on first use; a worker gets it from its parent over a private channel (the
stdin pipe of an exec'd worker, the control socket of the zygote for a forked one) and
adopts it before it opens its transport. The key is never on a command line or in the
environment of an exec'd process, and in a file only where one is named
(``AMESH_KEY_FILE``, ``amesh keygen``: host agents) or kept for this machine's
persistent meshes (:func:`amesh._hosts._home.local_key`).

A process may hold other keys beside its job key (:func:`hold_key`: a notebook session
that ran a mesh of its own, then makes or takes over a persistent mesh, whose agent and
workers hold the key of this machine's persistent meshes). Its listeners take a proof
made with any of its keys (:func:`held_keys`); it proves itself with the key of the
address it dials (:func:`key_for`): one given with :func:`hold_key`, or the one a peer
at that address proved itself with, else the job key.

The job's id (:func:`job_id`, 10 digits from a hash of the key) names the job where
others can see it: in the names of its shared-memory segments.

This module is below the transport, which proves the key to peers
(:mod:`amesh._transport._auth`), and the wire, which names the job in what it shares
(:mod:`amesh._wire`): both take the key and the id from here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ._config import settings

__all__ = [
    "KEY_SIZE",
    "adopt_key",
    "adopt_key_file",
    "borrowed_key",
    "has_key",
    "held_keys",
    "hold_key",
    "job_id",
    "job_key",
    "key_for",
    "read_key_file",
    "same_process",
    "write_key_file",
]

KEY_SIZE = 32

_key: bytes | None = None
_key_lock = threading.Lock()
#: the keys this process holds beside its job key (see :func:`hold_key`)
_other_keys: list[bytes] = []
#: address -> the key (not the job key) to prove ourselves with when dialling it
_dial_keys: dict[str, bytes] = {}
#: another address of a process -> the address it is known by (its local alias -> its
#: ``tls+tcp`` address): dialled with that address's key
_aliases: dict[str, str] = {}
_JOB_TAG = b"amesh shm job v1\0"
_job: tuple[bytes, str] | None = None  # (job key, its job id)


def has_key() -> bool:
    """Whether this process holds its job key yet (adopted, read or made by
    :func:`job_key`): from then on it is the key its peers prove themselves with."""
    return _key is not None


def job_key() -> bytes:
    """This job's key: the one adopted from the parent, else the one in the file
    ``AMESH_KEY_FILE`` names, else a fresh one (the controller's, made on first use)."""
    global _key
    key = _key
    if key is None:
        path = settings().key_file
        fresh = read_key_file(path) if path else secrets.token_bytes(KEY_SIZE)
        with _key_lock:
            if _key is None:
                _key = fresh
            key = _key
    return key


def job_id() -> str:
    """This job's id in segment names: 10 digits from a hash of the job key, the same in
    the controller and every process it started (workers adopt its key)."""
    global _job
    key = job_key()
    cached = _job
    if cached is None or cached[0] is not key:
        digest = hashlib.sha256(_JOB_TAG + key).digest()
        cached = _job = (key, f"{int.from_bytes(digest[:4], 'big'):010d}")
    return cached[1]


def write_key_file(path: str) -> None:
    """Write a new key (hex, one line) to ``path``, readable by its owner only.

    Raises:
        FileExistsError: ``path`` exists (a key is never overwritten).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_bytes(KEY_SIZE).hex() + "\n")


def read_key_file(path: str) -> bytes:
    """The key in ``path`` (see :func:`write_key_file`).

    Raises:
        PermissionError: the file belongs to another user, or others may read it.
        ValueError: it does not hold a key.
        OSError: it cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid():
            raise PermissionError(f"key file {path} belongs to uid {st.st_uid}, not to us")
        if st.st_mode & 0o077:
            raise PermissionError(
                f"key file {path} has mode {st.st_mode & 0o777:o}: others may read it "
                f"(chmod 600 {path})"
            )
        text = f.read(4 * KEY_SIZE).strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_SIZE:
        raise ValueError(f"key file {path} does not hold a key ({2 * KEY_SIZE} hex digits)")
    return key


def adopt_key_file(path: str) -> None:
    """Make the key in ``path`` this process's job key (a controller that joins host
    agents which hold it).

    Raises:
        RuntimeError: this process already uses another key (its workers prove
            themselves with it).
        PermissionError, ValueError, OSError: see :func:`read_key_file`.
    """
    global _key
    key = read_key_file(path)
    with _key_lock:
        if _key is not None and not hmac.compare_digest(_key, key):
            raise RuntimeError(
                "this process already uses another job key; start it with "
                f"AMESH_KEY_FILE={path}, or attach before it starts any mesh"
            )
        _key = key


def hold_key(key: bytes, addrs: Iterable[str] = ()) -> None:
    """Hold ``key`` too: as this process's job key when it has none yet, else beside
    it, proving ourselves with it to ``addrs`` (its holders we dial first; those that
    dial us are known by their proof).

    Raises:
        ValueError: ``key`` is not :data:`KEY_SIZE` bytes.
    """
    global _key
    if len(key) != KEY_SIZE:
        raise ValueError(f"a job key has {KEY_SIZE} bytes, not {len(key)}")
    with _key_lock:
        if _key is None:
            _key = bytes(key)
        if hmac.compare_digest(_key, key):
            return
        if not any(hmac.compare_digest(k, key) for k in _other_keys):
            _other_keys.append(bytes(key))
        for addr in addrs:
            _dial_keys[addr] = key


def key_for(addr: str) -> bytes:
    """The key to prove ourselves with to the process at ``addr`` (see
    :func:`hold_key`, :func:`same_process`); the job key unless it holds another."""
    return _dial_keys.get(addr) or _dial_keys.get(_aliases.get(addr, "")) or job_key()


def same_process(alias: str, addr: str) -> None:
    """``alias`` is another address of the process at ``addr`` (the transport sends to
    a ``tls+tcp`` address of this host at its local alias): dial it with the key of
    ``addr``, as learnt now or later (a worker of another key, this machine's
    persistent meshes' say, proves itself from its ``tls+tcp`` address)."""
    _aliases[alias] = addr


def held_keys() -> list[bytes]:
    """Every key this process holds, its job key first."""
    return [job_key(), *_other_keys]


def adopt_key(key: bytes) -> None:
    """Use ``key`` (the parent's) from now on; a worker does this before it opens its
    transport.

    Raises:
        ValueError: ``key`` is not :data:`KEY_SIZE` bytes.
    """
    global _key
    if len(key) != KEY_SIZE:
        raise ValueError(f"a job key has {KEY_SIZE} bytes, not {len(key)}")
    with _key_lock:
        _key = bytes(key)


@contextmanager
def borrowed_key(key: bytes) -> Iterator[None]:
    """Use ``key`` within the block, and afterwards the key this process held before
    (or none): the zygote's rehearsal (:mod:`amesh._hosts._zygote`) runs a mesh of its
    own before it knows the job it serves."""
    global _key
    with _key_lock:
        held = _key
    adopt_key(key)
    try:
        yield
    finally:
        with _key_lock:
            _key = held
