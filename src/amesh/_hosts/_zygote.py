"""A fork server for workers: one fresh interpreter per controller runtime, forked per worker.

Why: ``python -m amesh._worker`` spends about 0.3 s of CPU importing amesh, anyio,
uvloop, msgspec, pynng and cloudpickle before it listens, and sixteen of those on a
two-core machine take seconds. The zygote pays for the imports once, then forks a
child per worker, which listens a few milliseconds later.

Why forking it is safe: the zygote is exec'd fresh (never forked from the controller,
which may hold threads, an event loop, CUDA), imports only what a worker needs and
never starts a thread or an NNG socket; the one event loop it runs (its rehearsal of a
worker's part) is closed before it forks. Before each fork it checks that it has
exactly one thread, so a child inherits no lock that another thread held. torch and
CUDA are never imported in the zygote: a worker imports them after the fork, under its
own environment, so a per-worker ``CUDA_VISIBLE_DEVICES`` works as with exec.
What a fork cannot change is what an interpreter or the dynamic loader reads at start
(``PYTHON*``, ``LD_*``, ``MALLOC_*``, ``GLIBC_TUNABLES``): a worker whose environment
differs from the zygote's there is exec'd as before. Workers forked from one zygote
share its hash seed.

Protocol: a ``SOCK_SEQPACKET`` socket pair (a message per request, descriptors
attached with SCM_RIGHTS); the zygote listens on no socket. A request carries the
worker's bootstrap, job key included: it reaches the child in memory, never in its
environment. The zygote sends :class:`Hello` once its imports are done,
:class:`Spawned` with a pidfd of each child, :class:`SpawnFailed`, and :class:`Exited`
after it reaped a child. The controller sends :class:`Spawn` with its own stdout and
stderr (they become the child's, as an exec'd worker inherits them), and shuts its end
for writing to ask the zygote to exit.

Supervision: workers are the zygote's children. It watches a pidfd per child, reaps
each exit with ``waitpid`` and reports the return code in subprocess's convention
(negative: killed by that signal). The controller signals a worker only through the
pidfd the zygote handed over, never by pid: a pidfd names one process for good, so a
kill racing with the exit (even once the pid was reaped and reused) reaches nothing.

Dying together:

- The zygote's stdin is a pipe whose write end only the controller holds (its
  lifeline). The zygote exits when that pipe or the control socket closes, or when a
  pidfd of the controller says it ended. A controller that stops the zygote says so
  first (:data:`_BYE`); one that was killed cannot, and cannot remove its
  shared-memory segments either (results it held, calls in flight, its pool): the
  zygote kills and reaps its workers, waits (at most :data:`DEATH_WAIT`) until the
  controller has surely ended, and removes the segments of every process that has
  (:func:`amesh._wire.sweep_segments`), before it exits. The signal it asks for at
  its parent's death (PR_SET_PDEATHSIG) is SIGCONT, not SIGKILL, which would kill it
  before that: it only wakes a stopped zygote (SIGSTOP, a terminal's Ctrl-Z) to do the
  same, and does nothing where the thread that started it ends before the process.
- Each worker keeps that lifeline as its stdin and exits at EOF (the worker's usual
  stdin watch), so workers die with the controller even if the zygote died first. They
  also ask for SIGKILL at the zygote's death (it forks from its only thread): a zygote
  that dies takes its workers along, and the controller reports them killed by SIGKILL.

Lifetime: a runtime starts its zygote with its first local worker and owns it
(``Runtime.own``): what a runtime owns is stopped at its exit in reverse order, so the
zygote after the meshes started later. Stopping kills any worker still running; the
zygote reaps all its children before it exits, and the controller reaps the zygote, so
nothing outlives the runtime.

Modules: this one is the controller's side (:class:`Zygote`) and the messages of the
protocol; :mod:`amesh._hosts._zygote_main` is the zygote process (its imports, its
rehearsal, its loop, each child's start); :mod:`amesh._hosts._zygote_heap` makes its
memory ready before each fork.
"""

from __future__ import annotations

import array
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import msgspec

from .._bootstrap import Bootstrap
from .._config import settings

__all__ = [
    "Exited",
    "Hello",
    "Spawn",
    "SpawnFailed",
    "Spawned",
    "Zygote",
    "ZygoteError",
    "ZygoteProcess",
    "enabled",
    "startup_key",
]

log = logging.getLogger("amesh.hosts")

#: How long the zygote may take to import everything, and to exit when asked.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 5.0
#: How long a zygote whose controller went without a word waits for it to have surely
#: ended before it removes the controller's segments: a dying process closes its
#: descriptors (which wakes the zygote) a moment before it becomes a zombie.
DEATH_WAIT = 2.0
#: What a controller sends before it closes its end of the control socket to stop
#: the zygote (never a valid request, which is msgpack).
_BYE = b"bye"

_BOOT_VAR = "AMESH_ZYGOTE_BOOT"
#: Read when an interpreter or the dynamic loader starts: a fork cannot change them.
_STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES")
#: Largest request (its environment, mostly); a larger one is exec'd instead.
_MAX_REQUEST = 1 << 20
#: A request differing from the zygote's environment in more variables than this
#: sends its whole environment as the new base (another mesh's, say).
_MAX_CHANGES = 16


# -- messages -------------------------------------------------------------------------


class _Boot(msgspec.Struct, frozen=True):
    controller_pid: int
    ctl_fd: int
    #: the import path it takes (empty: its interpreter's own, as set at its start)
    sys_path: list[str]


class Hello(msgspec.Struct, frozen=True, tag=True):
    """The zygote has imported everything and serves requests."""

    pid: int
    threads: int


class Spawn(msgspec.Struct, frozen=True, tag=True):
    """Fork a worker with this environment, working directory and bootstrap (which
    holds the job key, so it stays out of the environment).

    The environment comes as a change: ``base``, when given, becomes the zygote's own
    environment (before it forks, and for the requests after this one); the child then
    sets ``env`` and removes ``unset`` in its own. The workers of one mesh differ from
    the base in a variable (their rank), so the zygote neither decodes nor sets a whole
    environment per worker: every page it writes between two forks is copied again,
    as the child it just forked shares it.
    """

    id: int
    env: dict[str, str]
    unset: list[str]
    base: dict[str, str] | None
    cwd: str
    boot: Bootstrap


class Spawned(msgspec.Struct, frozen=True, tag=True):
    """The child of request ``id`` runs; its pidfd comes with this message."""

    id: int
    pid: int


class SpawnFailed(msgspec.Struct, frozen=True, tag=True):
    id: int
    error: str


class Exited(msgspec.Struct, frozen=True, tag=True):
    """A child was reaped; ``returncode`` is negative for a signal, as in subprocess."""

    pid: int
    returncode: int


_FromZygote = Hello | Spawned | SpawnFailed | Exited


def _recv(
    sock: socket.socket, size: int, maxfds: int, how: int = 0
) -> tuple[bytes, list[int], int]:
    """One message, its descriptors (close-on-exec) and the message's flags; ``how``:
    more flags for ``recvmsg`` (MSG_DONTWAIT)."""
    msg, ancdata, flags, _ = sock.recvmsg(
        size, socket.CMSG_SPACE(maxfds * 4), socket.MSG_CMSG_CLOEXEC | how
    )
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds), flags


def _send(sock: socket.socket, msg: msgspec.Struct, fds: list[int] | None = None) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([msgspec.msgpack.encode(msg)], anc, socket.MSG_NOSIGNAL)


def enabled() -> bool:
    """Whether workers come from a zygote (``AMESH_ZYGOTE=0`` turns it off; Linux only)."""
    return settings().zygote and sys.platform == "linux" and hasattr(os, "pidfd_open")


def _startup_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)}


def startup_key(env: Mapping[str, str]) -> tuple[str, ...]:
    """The variables of ``env`` that a worker's start takes (a forked worker keeps
    its zygote's), as ``NAME=value`` in order: workers alike in these may share a
    zygote."""
    return tuple(f"{k}={v}" for k, v in sorted(_startup_env(env).items()))


# -- the controller's side --------------------------------------------------------------


class ZygoteError(Exception):
    """The zygote cannot start this worker (the caller execs one instead)."""


class ZygoteProcess:
    """A worker forked by the zygote, with the face of an OS process handle."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        #: set from the zygote's report, once the process is reaped
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._exited = anyio.Event()

    def __repr__(self) -> str:
        return f"<ZygoteProcess {self.pid} returncode={self.returncode}>"

    def _set_exit(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._exited.set()
        self._close()

    def _close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the process, unless it is known to have exited (through its pidfd)."""
        if self._pidfd < 0:
            return
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            pass  # it exited; the zygote's report is on its way

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.wait()


class _Request:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.process: ZygoteProcess | None = None
        self.error = ""


class Zygote:
    """The controller's handle on one zygote process; :meth:`stop` ends it."""

    def __init__(
        self, popen: subprocess.Popen[bytes], sock: socket.socket, env: dict[str, str]
    ) -> None:
        self.pid = popen.pid
        self._popen = popen
        self._sock = sock
        self._pidfd = os.pidfd_open(popen.pid)
        self._startup = _startup_env(env)
        self._ids = itertools.count(1)
        self._requests: dict[int, _Request] = {}
        #: processes whose exit the zygote has not reported yet, by pid
        self._live: dict[int, ZygoteProcess] = {}
        self._send_lock = anyio.Lock()
        #: the environment the zygote holds (the base of the next request's change);
        #: None: send one with the next request (as the first does)
        self._base: dict[str, str] | None = None
        self._hello: Hello | None = None
        self._greeted = anyio.Event()
        #: set once the zygote is reaped and its descriptors closed
        self._reader_done = anyio.Event()
        self._stopping = False

    def __repr__(self) -> str:
        return f"<Zygote {self.pid}>"

    @property
    def usable(self) -> bool:
        return self._hello is not None and not self._reader_done.is_set() and not self._stopping

    def fits(self, env: Mapping[str, str]) -> bool:
        """Whether a worker with ``env`` can be forked (same start-up-only settings)."""
        return _startup_env(env) == self._startup

    @classmethod
    async def start(
        cls,
        start_soon: Callable[..., Any],
        register: Callable[[Zygote], None],
        python: str = "",
        env: Mapping[str, str] | None = None,
    ) -> Zygote:
        """Start a zygote and wait until it serves.

        Args:
            start_soon: starts the zygote's reader task in a task group that outlives
                the zygote (the runtime's).
            register: called with the zygote as soon as it runs, to arrange its stop.
            python: its interpreter ("": this one, whose import path it takes; another,
                an environment's venv's, keeps its own).
            env: its environment (the base of its children's; default this process's).

        Raises:
            ZygoteError: it exited or did not report in time.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Popen here, on the event loop's thread (a vfork and exec: a millisecond).
        own = python in ("", sys.executable)
        boot = _Boot(os.getpid(), theirs.fileno(), list(sys.path) if own else [])
        env = dict(os.environ if env is None else env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            popen = subprocess.Popen(  # noqa: ASYNC220
                [python or sys.executable, "-m", "amesh._hosts._zygote_main"],
                stdin=subprocess.PIPE,
                env={**env, _BOOT_VAR: msgspec.json.encode(boot).decode()},
                pass_fds=[theirs.fileno()],
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _MAX_REQUEST)
        except OSError:
            pass
        zygote = cls(popen, ours, env)
        try:
            start_soon(zygote._read)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await zygote._on_exit()
            raise
        register(zygote)
        try:
            with anyio.fail_after(START_TIMEOUT):
                await zygote._greeted.wait()
            hello = zygote._hello
            if hello is None:
                raise ZygoteError(f"zygote {popen.pid} exited while starting")
            if hello.threads != 1:
                raise ZygoteError(f"zygote {popen.pid} runs {hello.threads} threads")
        except BaseException as exc:
            await zygote.stop()
            if isinstance(exc, TimeoutError):
                raise ZygoteError(f"zygote {popen.pid} did not start in time") from None
            raise
        return zygote

    async def spawn(self, env: dict[str, str], cwd: str, boot: Bootstrap) -> ZygoteProcess:
        """Fork a worker with this environment, working directory and bootstrap.

        Raises:
            ZygoteError: the zygote is gone or could not fork; exec the worker instead.
        """
        if not self.usable:
            raise ZygoteError("the zygote has exited")
        rid = next(self._ids)
        req = self._requests[rid] = _Request()
        try:
            async with self._send_lock:
                # (under the lock: the zygote takes each change against the one before)
                data, base = self._request(rid, env, cwd, boot)
                if len(data) > _MAX_REQUEST:
                    raise ZygoteError("the environment is too large for a zygote request")
                while True:
                    try:
                        # the child writes where this process writes now
                        self._sock.sendmsg(
                            [data],
                            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [1, 2]))],
                            socket.MSG_NOSIGNAL,
                        )
                        break
                    except BlockingIOError:
                        await anyio.wait_writable(self._sock)
                if base is not None:
                    self._base = base
            await req.done.wait()
        except (OSError, anyio.ClosedResourceError) as exc:
            raise ZygoteError(f"cannot reach the zygote: {exc}") from exc
        except BaseException:
            if req.process is not None:  # forked, but its starter was cancelled
                req.process.kill()
            raise
        finally:
            self._requests.pop(rid, None)
        if req.process is None:
            raise ZygoteError(req.error or "the zygote has exited")
        return req.process

    def _request(
        self, rid: int, env: dict[str, str], cwd: str, boot: Bootstrap
    ) -> tuple[bytes, dict[str, str] | None]:
        """The request for a worker with ``env``, and the new base it sends (or None)."""
        if (old := self._base) is not None:
            changed = {k: v for k, v in env.items() if old.get(k) != v}
            unset = [k for k in old if k not in env]
            if len(changed) + len(unset) <= _MAX_CHANGES:
                return msgspec.msgpack.encode(Spawn(rid, changed, unset, None, cwd, boot)), None
        return msgspec.msgpack.encode(Spawn(rid, {}, [], env, cwd, boot)), dict(env)

    async def _read(self) -> None:
        eof = False
        try:
            while not eof:
                await anyio.wait_readable(self._sock)
                while True:
                    try:
                        data, fds, _ = _recv(self._sock, 4096, 1)
                    except BlockingIOError:
                        break
                    except OSError:
                        data, fds = b"", []
                    if not data:
                        eof = True
                        break
                    self._on_message(msgspec.msgpack.decode(data, type=_FromZygote), fds)
        finally:
            if eof and not self._stopping:
                log.error("zygote %d exited unexpectedly; its workers die with it", self.pid)
            with anyio.CancelScope(shield=True):
                await self._on_exit()

    def _on_message(self, msg: _FromZygote, fds: list[int]) -> None:
        if isinstance(msg, Spawned):
            req = self._requests.get(msg.id)
            if not fds:  # cannot happen: the zygote sends a pidfd with each
                log.error("zygote %d sent no pidfd for worker %d", self.pid, msg.pid)
                if req is not None:
                    req.error = "the zygote sent no pidfd"
                    req.done.set()
                return
            proc = self._live[msg.pid] = ZygoteProcess(msg.pid, fds.pop(0))
            if req is not None:
                req.process = proc
                req.done.set()
            else:  # its starter was cancelled: nobody will supervise it
                proc.kill()
        elif isinstance(msg, SpawnFailed):
            self._base = None  # it may not have taken the request's base: send one again
            req = self._requests.get(msg.id)
            if req is not None:
                req.error = msg.error
                req.done.set()
        elif isinstance(msg, Exited):
            gone = self._live.pop(msg.pid, None)
            if gone is not None:
                gone._set_exit(msg.returncode)
        elif isinstance(msg, Hello):
            self._hello = msg
            self._greeted.set()
        for fd in fds:
            os.close(fd)

    def _let_go(self) -> None:
        """Kill the workers still running and tell the zygote to exit (no wait)."""
        for proc in self._live.values():
            proc.kill()
        try:
            self._sock.send(_BYE)  # (not a death: nothing of ours for the zygote to remove)
        except OSError:  # full or gone: the zygote waits DEATH_WAIT for our end, no more
            pass
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        assert self._popen.stdin is not None
        self._popen.stdin.close()

    async def _on_exit(self) -> None:
        """The reader ends: end the zygote, reap it and settle what it would have told
        (in that order: whoever hears of its workers' ends finds it reaped)."""
        self._let_go()
        for req in self._requests.values():
            req.done.set()
        with anyio.move_on_after(STOP_TIMEOUT):
            await anyio.wait_readable(self._pidfd)
        if self._popen.poll() is None:
            log.warning("zygote %d did not exit when asked; killing it", self.pid)
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            await anyio.wait_readable(self._pidfd)
        self._popen.wait()
        # Only the zygote could tell how its children ended; they were killed above,
        # or by the kernel at the zygote's death. Their pidfds tell when.
        for proc in list(self._live.values()):
            await anyio.wait_readable(proc._pidfd)
            proc._set_exit(-signal.SIGKILL)
        self._live.clear()
        anyio.notify_closing(self._sock)
        self._sock.close()
        os.close(self._pidfd)
        self._reader_done.set()
        self._greeted.set()

    async def stop(self) -> None:
        """Kill workers still running, end the zygote and reap it (idempotent)."""
        if not self._stopping:
            self._stopping = True
            if self._live:
                log.warning(
                    "killing %d worker(s) still running as their runtime closes", len(self._live)
                )
            self._let_go()
        with anyio.CancelScope(shield=True):
            await self._reader_done.wait()
