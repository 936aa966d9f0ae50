"""What a worker process needs to know at start.

A mesh says what it asks of each worker in a :class:`WorkerSpec`; every host starts a
worker from one (:meth:`amesh._mesh.Host.start_proc`), and the worker gets it, with
what its host adds (its parent, the job key), in its :class:`Bootstrap`. A host
(:mod:`amesh._hosts`) writes that, the worker (:mod:`amesh._worker`) reads it; it
lives below both so that neither imports the other for it. It holds the job key, so
it travels only over private channels, never in an environment or on a command line:
the stdin pipe of an exec'd worker (:meth:`Bootstrap.to_pipe`, :func:`read_bootstrap`)
or the zygote's control socket for a forked one.
"""

from __future__ import annotations

import os
import struct

import msgspec

__all__ = ["Bootstrap", "WorkerSpec", "read_bootstrap", "started_as", "this_worker"]

_LEN = struct.Struct("<I")
#: A bootstrap is a few kilobytes (mostly sys.path); anything far larger is not one.
_MAX_SIZE = 1 << 20


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a mesh asks of one of its workers, whichever host starts it."""

    #: its process slot in the mesh (a host of many machines places it by slot)
    slot: int = 0
    #: how it listens (as its controller does: ``abstract``, ``stream+tcp``,
    #: ``tls+tcp``...), on the interface ``host``; a host agent decides both for its own
    scheme: str = "auto"
    host: str = "127.0.0.1"
    #: the Python interpreter that runs it, and its working directory; "": those of
    #: the process that starts it (the controller, for a worker on its machine; the
    #: host agent on another). A worker of another interpreter (an environment's venv)
    #: is forked by a zygote of that interpreter's own, started with its first worker
    python: str = ""
    cwd: str = ""
    #: entries put first on its import path (an environment's workspace tree); a
    #: worker of its host's own interpreter has that process's path after them, one
    #: of another interpreter (a venv's) that interpreter's own
    path: list[str] = []
    #: environment variables it gets beside its host's own (the mesh's ``env=``)
    env: dict[str, str] = {}
    #: amesh settings by name (``{"fanout": 4}``): those given to
    #: :func:`amesh.configure` under the mesh's own, checked at the controller; the
    #: worker adopts them (:func:`amesh._config.adopt`) before it reads any setting
    settings: dict[str, bool | int | float | str] = {}
    #: how often it sends heartbeats, and how long its supervisor waits for one: it
    #: stops sending them once its main thread has been stuck in the kernel this long
    heartbeat_period: float = 0.5
    heartbeat_timeout: float = 5.0
    #: its event loop: ``asyncio`` or ``trio``
    backend: str = "asyncio"
    #: what becomes of its output (``folded``, ``raw``, ``off``: see
    #: :mod:`amesh._runtime._output`), and the mesh's name its lines carry; with no
    #: label, it writes to the stdout and stderr it inherited
    output: str = "folded"
    output_label: str = ""
    #: a file its output lines also go to (a persistent mesh's worker: its host agent
    #: serves them when no controller is there)
    output_file: str = ""


class Bootstrap(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs to know at start: its spec and what its host adds."""

    spec: WorkerSpec
    parent: str
    parent_pid: int
    token: str
    sys_path: list[str]
    #: whether the worker may ask for the kernel's parent-death signal
    pdeathsig: bool
    #: the job key (:mod:`amesh._identity`), adopted before the worker listens
    key: bytes

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Bootstrap:
        return msgspec.msgpack.decode(data, type=cls)

    def to_pipe(self) -> bytes:
        """What the parent writes first into the worker's stdin pipe."""
        data = self.to_bytes()
        return _LEN.pack(len(data)) + data


#: the spec this process was started from, if it is a worker (see :func:`started_as`)
_this_worker: WorkerSpec | None = None


def started_as(spec: WorkerSpec) -> None:
    """This process is a worker started from ``spec`` (its entry point says so)."""
    global _this_worker
    _this_worker = spec


def this_worker() -> WorkerSpec | None:
    """The spec this process was started from; None outside a worker process (the
    controller, an in-process rank)."""
    return _this_worker


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
