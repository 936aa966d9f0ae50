"""What a worker process needs to know at start.

A host (:mod:`amesh._hosts`) writes it, the worker (:mod:`amesh._worker`) reads it;
it lives below both so that neither imports the other for it. It holds the job key, so
it travels only over private channels, never in an environment or on a command line:
the stdin pipe of an exec'd worker (:meth:`Bootstrap.to_pipe`, :func:`read_bootstrap`)
or the zygote's control socket for a forked one.
"""

from __future__ import annotations

import os
import struct

import msgspec

__all__ = ["Bootstrap", "read_bootstrap"]

_LEN = struct.Struct("<I")
#: A bootstrap is a few kilobytes (mostly sys.path); anything far larger is not one.
_MAX_SIZE = 1 << 20


class Bootstrap(msgspec.Struct, frozen=True):
    """What a worker needs to know at start."""

    parent: str
    parent_pid: int
    token: str
    scheme: str
    host: str
    sys_path: list[str]
    heartbeat_period: float
    #: whether the worker may ask for the kernel's parent-death signal
    pdeathsig: bool
    #: the job key (:mod:`amesh._identity`), adopted before the worker listens
    key: bytes
    #: how long its supervisor waits for a heartbeat: the worker stops sending them
    #: once its main thread has been stuck in the kernel this long
    heartbeat_timeout: float = 5.0

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Bootstrap:
        return msgspec.msgpack.decode(data, type=cls)

    def to_pipe(self) -> bytes:
        """What the parent writes first into the worker's stdin pipe."""
        data = self.to_bytes()
        return _LEN.pack(len(data)) + data


def read_bootstrap(fd: int) -> Bootstrap:
    """Read the bootstrap that :meth:`Bootstrap.to_pipe` wrote into ``fd`` (blocking).

    Raises:
        EOFError: the pipe closed first (the parent is gone).
        ValueError: what came is not a bootstrap.
    """
    (size,) = _LEN.unpack(_read_exact(fd, _LEN.size))
    if size > _MAX_SIZE:
        raise ValueError(f"a bootstrap of {size} bytes")
    try:
        return Bootstrap.from_bytes(_read_exact(fd, size))
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a bootstrap: {exc}") from None


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = os.read(fd, n - len(data))
        if not got:
            raise EOFError("the parent closed the pipe before the bootstrap")
        data += got
    return data
