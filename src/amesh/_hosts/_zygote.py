"""A fork server for workers: one fresh interpreter per controller runtime, forked per worker.

Why: ``python -m amesh._worker`` spends about 0.3 s of CPU importing amesh, anyio,
uvloop, msgspec, pynng and cloudpickle before it listens, and sixteen of those on a
two-core machine take seconds. The zygote pays for the imports once, then forks a
child per worker, which listens a few milliseconds later.

Why forking it is safe: the zygote is exec'd fresh (never forked from the controller,
which may hold threads, an event loop, CUDA), imports only what a worker needs and
never starts a thread or an NNG socket; the one event loop it runs (its rehearsal of a
worker's part, :func:`_rehearse`) is closed before it forks. Before each fork it checks
that it has exactly one thread, so a child inherits no lock that another thread held. torch
and CUDA are never imported in the zygote: a worker imports them after the fork, under
its own environment, so a per-worker ``CUDA_VISIBLE_DEVICES`` works as with exec.
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
  (:func:`amesh._codec.sweep_segments`), before it exits. The signal it asks for at
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
"""

from __future__ import annotations

import array
import codecs
import ctypes
import gc
import importlib
import itertools
import logging
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import msgspec

try:
    from .._native import _ext
except ImportError:  # not built (not Linux): no zygote runs anyway
    _ext = None  # type: ignore[assignment]
from .. import _codec
from .._bootstrap import Bootstrap
from .._config import VARIABLES, loop_options, settings, take_internal
from .._config import reset as reset_settings
from .._limits import raise_open_files, raise_processes
from .._transport import TLS_PREFIX, default_impl

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
    "main",
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
#: Requests forked in one go when several wait (each brings two descriptors).
_BATCH = 64
_PR_SET_PDEATHSIG = 1
#: What a worker imports, so that its children need not: optional ones may be missing.
_PRELOAD = ("amesh._worker", "anyio._backends._asyncio", "cloudpickle")
_PRELOAD_OPTIONAL = ("uvloop",)
#: The NNG transports (pynng, the C extension): preloaded only where they are chosen, as
#: workers on the default stream transport never import them.
_PRELOAD_NNG = "amesh._transport._ext"


# -- messages -------------------------------------------------------------------------


class _Boot(msgspec.Struct, frozen=True):
    controller_pid: int
    ctl_fd: int
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
        cls, start_soon: Callable[..., Any], register: Callable[[Zygote], None]
    ) -> Zygote:
        """Start a zygote and wait until it serves.

        Args:
            start_soon: starts the zygote's reader task in a task group that outlives
                the zygote (the runtime's).
            register: called with the zygote as soon as it runs, to arrange its stop.

        Raises:
            ZygoteError: it exited or did not report in time.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Popen here, on the event loop's thread (a vfork and exec: a millisecond).
        boot = _Boot(os.getpid(), theirs.fileno(), list(sys.path))
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            popen = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-m", "amesh._hosts._zygote"],
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


# -- the zygote's side ------------------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _Server:
    """The zygote's loop: fork a child per request until the controller goes."""

    def __init__(self, ctl: socket.socket, controller: int) -> None:
        self.ctl = ctl
        #: a pidfd of the controller: readable once it ended
        self.controller = controller
        #: whether the controller said it stops us (see _BYE)
        self.bye = False
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.poller = select.poll()
        self.poller.register(ctl, select.POLLIN)
        self.poller.register(0, select.POLLIN)  # the lifeline: any event means it closed
        self.poller.register(controller, select.POLLIN)
        #: whether this process holds a base environment (see Spawn)
        self.based = False
        #: the requests read and not yet forked
        self.batch: list[tuple[Spawn | None, list[int]]] = []
        #: no descriptor of this process is above this one (a child closes up to it)
        self.top = max(ctl.fileno(), controller)

    def serve(self) -> Spawn | None:
        """None in the zygote when it should exit, and the request in each child.

        A child keeps this object, and what it holds, as they are: freeing them would
        write pages it shares with the zygote.
        """
        ctl = self.ctl
        _send(ctl, Hello(os.getpid(), _threads()))
        while True:
            for fd, _ in self.poller.poll():
                if fd in (0, self.controller):
                    self._shutdown()
                    return None
                if fd == ctl.fileno():
                    if not self._take():  # the controller is gone: fork nothing more
                        self._shutdown()
                        return None
                    if (req := self._fork_all()) is not None:
                        return req
                else:
                    pid = self.children.pop(fd)
                    self.poller.unregister(fd)
                    os.close(fd)
                    _, status = os.waitpid(pid, 0)
                    _report(ctl, Exited(pid, os.waitstatus_to_exitcode(status)))

    def _take(self) -> bool:
        """Read the requests waiting (at most :data:`_BATCH`) into ``batch``, each decoded
        (None: unreadable) with its descriptors (none where they were cut short); False
        once the controller closed its end."""
        batch: list[tuple[Spawn | None, list[int]]] = []
        self.batch = batch
        while len(batch) < _BATCH:
            try:
                # (a blocking socket: the reports wait for room, never dropped)
                data, fds, flags = _recv(self.ctl, _MAX_REQUEST, 2, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data or data == _BYE:
                self.bye = self.bye or data == _BYE
                return False
            if flags & socket.MSG_CTRUNC:
                for fd in fds:
                    os.close(fd)
                fds = []
            elif fds:
                self.top = max(self.top, *fds)
            try:
                batch.append((msgspec.msgpack.decode(data, type=Spawn), fds))
            except msgspec.DecodeError:  # cannot happen: requests are under _MAX_REQUEST
                batch.append((None, fds))
        return True

    def _shutdown(self) -> None:
        """Kill the children still running, reap and report them, and close; then, if
        the controller went without a word (killed), remove what it and they left in
        shared memory, once it surely ended."""
        bye = self._heard_bye()
        _shutdown(self.ctl, self.children)
        if not bye:
            select.select([self.controller], [], [], DEATH_WAIT)
            removed = _codec.sweep_segments()
            if removed:
                log.info("removed %d shared-memory segment(s) of a killed job", removed)
        os.close(self.controller)

    def _heard_bye(self) -> bool:
        """Whether the controller said it stops us: its :data:`_BYE` may wait behind
        requests (dropped: nothing more is forked) when the lifeline's end woke us."""
        while not self.bye:
            try:
                data, fds, _ = _recv(self.ctl, _MAX_REQUEST, 2, socket.MSG_DONTWAIT)
            except OSError:  # nothing more (BlockingIOError), or gone
                break
            for fd in fds:
                os.close(fd)
            if not data:
                break
            self.bye = data == _BYE
        return self.bye

    def _fork_all(self) -> Spawn | None:
        """Fork the child of each request of ``batch``; its request in each child, None
        here.

        Between two forks this process does as little as it can (a fork, and a base
        environment now and then): each page it writes after a fork is copied, as the
        child shares it. The pidfds are opened and reported once all are forked.
        """
        for key in {
            req.boot.key
            for req, _ in self.batch
            if req is not None and req.boot.parent.startswith(TLS_PREFIX)
        }:
            _prepare_tls(key)
        n = _threads()
        keep = self._kept_in_child()
        sys.stdout.flush()
        sys.stderr.flush()
        forked: list[tuple[Spawn, list[int], int]] = []
        failed: list[tuple[int, list[int], str]] = []
        for req, fds in self.batch:
            if req is None:
                self.based = False  # it may have been a base: wait for the next one
                failed.append((-1, fds, "unreadable request"))
                continue
            if req.base is not None:
                try:
                    _adopt_env(req.base)  # here, once: its children share it (see _adopt_env)
                except ValueError as exc:  # a name or value putenv refuses (ProcMesh checks)
                    self.based = False
                    failed.append((req.id, fds, f"its environment: {exc}"))
                    continue
                self.based = True
            elif not self.based:
                failed.append((req.id, fds, "the request's environment is out of step"))
                continue
            if n != 1:
                failed.append((req.id, fds, f"the zygote runs {n} threads: forking it is not safe"))
                continue
            if len(fds) != 2:
                failed.append((req.id, fds, "a request without stdout and stderr"))
                continue
            try:
                pid = os.fork()
            except OSError as exc:
                failed.append((req.id, fds, f"fork: {exc}"))
                continue
            if pid == 0:
                self._become_child(fds, keep)
                return req
            forked.append((req, fds, pid))
        for rid, fds, error in failed:
            _fail(self.ctl, rid, error, fds)
        for req, fds, pid in forked:
            for fd in fds:
                os.close(fd)
            try:
                pidfd = os.pidfd_open(pid)
            except OSError as exc:  # no descriptor left: nobody could supervise it
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                _fail(self.ctl, req.id, f"pidfd_open: {exc}", [])
                continue
            self.children[pidfd] = pid
            self.top = max(self.top, pidfd)
            self.poller.register(pidfd, select.POLLIN)
            _report(self.ctl, Spawned(req.id, pid), [pidfd])
        return None

    def _kept_in_child(self) -> list[int]:
        """The descriptors a child forked now keeps: where libuv's pipe will be.

        Once a libuv loop ran in a process (the rehearsal's, :data:`_kept`), libuv
        keeps a pipe for good, and remakes it in each child as it forks (its
        ``pthread_atfork`` handler: it closes the pair, then opens a new one, which gets
        the two lowest numbers free). A child that closed that pipe with the zygote's
        descriptors aborts at its first subprocess. Which numbers those are follows from
        the descriptors this process holds now (none opens or closes while a batch is
        forked): the lowest ones that are libuv's or free."""
        keep: list[int] = []
        fd = 0
        while len(keep) < len(_kept):
            if fd in _kept or not _is_open(fd):
                keep.append(fd)
            fd += 1
        return keep

    def _become_child(self, fds: list[int], keep: list[int]) -> None:
        """Make ``fds`` stdout and stderr, and close every other descriptor above 2 but
        ``keep`` (libuv's, see :meth:`_kept_in_child`): all are the zygote's (its
        control socket, its children's pidfds, the batch's descriptors). A
        ``close_range`` per stretch (Linux 5.9; elsewhere a loop in C up to
        :attr:`top`): closing the pidfds one by one cost every child ~0.5 µs a child
        forked before it."""
        for target, fd in zip((1, 2), fds):
            os.dup2(fd, target)
        self.ctl.detach()  # (its number is closed below, not by the object)
        low = 3
        for fd in keep:
            os.closerange(low, fd)
            low = max(low, fd + 1)
        os.closerange(low, self.top + 1)


def _adopt_env(env: dict[str, str]) -> None:
    """Make this process's environment ``env`` (a request's base), and parse its
    settings, before forking the children: a child that does it itself writes pages it
    would otherwise share with the zygote (os.environ's dict and its encoded copies,
    libc's environ, the settings): 1,712 -> 1,680 page faults a worker, from start to
    its first answer. A child then sets the few variables it differs in (_take_env)."""
    for name in [name for name in os.environ if name not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    reset_settings()
    try:
        settings()
    except Exception:  # a bad value: the child meets it again, and reports it
        reset_settings()


#: The job keys _prepare_tls has seen.
_prepared: set[bytes] = set()


def _prepare_tls(key: bytes) -> None:
    """Before forking a worker whose parent is reached over ``tls+tcp`` (a host agent's
    workers, and those of a controller on ``tcp``): import what its transport needs
    (pynng, the C extension's NNG functions, ``cryptography``) and make the job CA of
    ``key`` (:func:`amesh._transport.prepare_tls`), here once rather than in every
    child, which then only makes its own leaf key and certificate. Each worker of a
    host agent spent ~45 ms of CPU importing them and ~7 ms deriving the CA and signing
    its certificate, and kept a copy of ``cryptography`` of its own (a worker's CPU to
    its first answer: ~62 -> ~14 ms; PSS: 14.6 -> 8.7 MiB). Nothing here starts a
    thread; what fails is left to the child, which meets it again and reports it."""
    try:
        from .._transport import load_nng

        load_nng()  # first: where it fails, the TLS modules are not imported either
        from .._transport import prepare_tls

        prepare_tls(key)
    except Exception:  # ImportError (no pynng or extension), a failing derivation
        pass
    if key not in _prepared:
        _prepared.add(key)
        _settle()  # what the imports and the CA added, once


def _report(ctl: socket.socket, msg: msgspec.Struct, fds: list[int] | None = None) -> None:
    try:
        _send(ctl, msg, fds)
    except OSError:
        pass  # the controller is gone: the control socket's EOF ends the zygote


def _fail(ctl: socket.socket, rid: int, error: str, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    _report(ctl, SpawnFailed(rid, error))


def _take_env(req: Spawn) -> None:
    """In a child: the request's change to the environment the zygote forked it with
    (its rank, mostly); settings are parsed again if one of theirs changed."""
    for name, value in req.env.items():
        os.environ[name] = value
    for name in req.unset:
        os.environ.pop(name, None)
    if any(name in VARIABLES for name in (*req.env, *req.unset)):
        reset_settings()


def _shutdown(ctl: socket.socket, children: dict[int, int]) -> None:
    """Kill the children still running, reap and report them, and close."""
    for pidfd, pid in children.items():
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        _report(ctl, Exited(pid, os.waitstatus_to_exitcode(status)))
    ctl.close()


#: what fills the free blocks of the allocator's partly used pools (see _fill_pools)
_filler: list[object] = []
#: a line of the size-class table of ``sys._debugmallocstats()``
_POOL_LINE = re.compile(rb"^\s*\d+\s+(\d+)\s+\d+\s+\d+\s+(\d+)\s*$", re.MULTILINE)


def free_blocks() -> dict[int, int]:
    """The free blocks of the small-object allocator's partly used pools, by block
    size, as ``sys._debugmallocstats()`` writes them (to the C ``stderr``); empty where
    it writes none (another allocator)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read()
    return {int(size): int(avail) for size, avail in _POOL_LINE.findall(text)}


def _fill_pools() -> None:
    """Take every free block of the small-object allocator's partly used pools, so
    that a child's allocations go to pools of its own (fresh pages, each written by
    many of its objects) instead of writing one block here and one there in pages it
    shares with the zygote. The counts per size class come from
    ``sys._debugmallocstats()``; the blocks are ``bytes`` (and floats and objects for
    the two smallest classes) of the size that lands in the class. A worker's page
    faults to its first answer, 256 workers: ~910 -> ~869 on 3.13, ~1,629 -> ~1,584 on
    3.11; ~0.2 MiB less memory (PSS) a worker. What it takes stays taken: the blocks
    that were free, a few hundred kB at most."""
    for size, avail in free_blocks().items():
        if size <= 16:
            _filler.extend(object() for _ in range(avail))
        elif size <= 32:
            _filler.extend(float(i) + 0.5 for i in range(avail))
        else:
            n = size - 33  # a bytes object of n bytes asks for 33 + n
            _filler.extend(bytes(n) for _ in range(avail))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


#: what fills the free chunks of the C allocator's heap (see _fill_heap): their addresses
_heap_filler: list[int] = []
#: the request sizes _fill_heap takes free chunks with: large ones first, then each of
#: the C allocator's small size classes (16 bytes apart; the per-thread caches hold up
#: to 1,032 bytes), all under the size it would map on its own (128 KiB)
_HEAP_SIZES = [1 << k for k in range(16, 10, -1)] + list(range(1016, 15, -16))


def _libc() -> Any:
    """glibc's malloc, free, sbrk and mallinfo2, or None (another C library, or a glibc
    before 2.33)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_ssize_t]
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _fill_heap() -> int:
    """Take every free chunk of the C allocator's heap (glibc's ``malloc``: its bins and
    per-thread caches), as :func:`_fill_pools` does for Python's small-object
    allocator, and for the same reason: a child's ``malloc`` then carves its memory from
    the top of the heap, fresh pages each written by many of its allocations, instead of
    a chunk here and there on pages it shares with the zygote (each taken chunk writes
    its own page, and unlinking it the pages of its neighbours in the bin). Returns how
    many chunks it took (0 where the C library is not glibc).

    A size is asked for until ``malloc`` answers from the top chunk (at or above
    ``sbrk(0)`` less the top's size): no free chunk fits it any longer. What it takes
    stays taken, never written again: the free chunks there were, a few hundred kB, and
    one request a size from the top; never more than those (should the top not be
    where ``sbrk`` says, it stops there). The zygote runs one thread, so one heap."""
    libc = _libc()
    if libc is None:
        return 0
    info = libc.mallinfo2()
    # what is free in the bins, and 1 MiB for the per-thread caches (which it counts
    # as used: ~240 kB at most) and one request a size from the top (~160 kB)
    budget = info.fordblks - info.keepcost + (1 << 20)
    taken = 0
    for size in _HEAP_SIZES:
        while budget >= size:
            top = libc.sbrk(0) - libc.mallinfo2().keepcost
            address = libc.malloc(size)
            if address is None:  # out of memory: leave the rest free
                return taken
            _heap_filler.append(address)
            budget -= size
            if address >= top:
                break
            taken += 1
    return taken


def _take_free() -> None:
    """Collect, then take what the allocators hold free (:func:`_fill_pools`,
    :func:`_fill_heap`): what is allocated next lands on fresh pages."""
    gc.collect()
    _fill_pools()
    _fill_heap()


def _relocate(ran: Mapping[int, types.CodeType]) -> int:
    """Copy the code objects ``ran`` (id to code, in the order they first ran) to pages of
    their own, one after the other, and point their functions (and the code objects
    whose constants they are) at the copies. Returns how many functions now run a copy.

    A call writes the function's code object (its reference count; on 3.11 also its
    warm-up counter and specialized instructions), so a child copies the page of every
    code object it runs; as imported, those lie among all the others and the names,
    tuples and strings unmarshalled with them, a page or so each. Copied together after
    the imports (pools and heap filled first, so they land on fresh pages), the ones a
    worker runs share ~125 pages instead of ~245. Code objects compare by value: they
    are told apart here by identity."""
    _take_free()
    copies: dict[int, types.CodeType] = {}

    def copy(code: types.CodeType) -> types.CodeType:
        if (done := copies.get(id(code))) is not None:
            return done
        consts = tuple(
            copy(c) if type(c) is types.CodeType and id(c) in ran else c for c in code.co_consts
        )
        copies[id(code)] = new = code.replace(co_consts=consts)
        return new

    for code in ran.values():
        copy(code)
    moved = 0
    for f in gc.get_objects():
        if type(f) is types.FunctionType and (new := copies.get(id(f.__code__))) is not None:
            f.__code__ = new  # (the copy has the same free variables)
            moved += 1
    return moved


def _settle() -> None:
    """Make what this process has loaded last for the children it forks: keep the
    collector off it (``gc.freeze``: the children share these pages until they write
    them), and where the interpreter can (CPython 3.12 and 3.13, ``AMESH_ZYGOTE_IMMORTAL``
    on), make it immortal, so that a child's references to it write nothing either
    (PEP 683; :func:`amesh._native._ext.immortalize`). A worker's page faults from its start to
    its first answer, on 3.13 (256 workers): ~1,485 -> ~955; PSS 5.6 -> 3.5 MiB (3.11:
    ~1,650 and 6.3 MiB). Objects made immortal are never freed: what the zygote drops
    later (an environment it replaces) stays, a few kB."""
    _take_free()  # (what the children allocate goes to pages of their own)
    if _ext is not None and _ext.CAN_IMMORTALIZE:
        try:
            immortal = settings().zygote_immortal
        except Exception:  # a bad value: each child meets it again, and reports it
            immortal = False
        if immortal:
            _ext.immortalize(gc.get_objects())
    gc.freeze()


def _preload() -> None:
    for name in _PRELOAD:
        importlib.import_module(name)
    optional = list(_PRELOAD_OPTIONAL)
    if default_impl() != "stream":
        optional.append(_PRELOAD_NNG)
    for name in optional:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


#: whether :func:`_rehearse` played its part, and how many functions' code it copied
#: (see :func:`_relocate`); its children inherit them, as their ``__main__``'s: tests
#: ask them
_rehearsed = False
_relocated = 0
#: descriptors the rehearsal left open: the pipe libuv keeps once a loop of its ran
_kept: set[int] = set()


def _rehearse() -> None:
    """Play a worker's part once here, before forking any: a one-process mesh in this
    process (the in-process host, :mod:`._inprocess`, on the stream transport), an
    actor class sent by value as a script's is, and each adverb a few times. What a
    child would otherwise do first, writing on pages it shares with the zygote, is
    then done once: the interpreter's specialized instructions and their caches in
    the code a worker runs, the versions of the dictionaries and functions they check,
    the types' caches. ~10 ms here, once.

    It runs on a throwaway key, is written in no registry of meshes (``amesh list``),
    on the event loop a worker runs (uvloop's, where it is installed), and leaves
    nothing behind: no thread (forking needs this process to have one), no settings,
    and no descriptor but the pipe libuv keeps for good once one of its loops ran
    (:data:`_kept`; a child keeps the one libuv makes anew at the fork, see
    :meth:`_Server._kept_in_child`). Only on the default stream transport: NNG keeps
    threads of its own once used. What fails is left alone; the workers then do that
    work themselves, as before. A worker's page faults to its first answer, 256
    workers on 3.13: ~986 -> ~938, its CPU ~9% less (3.11: ~2% fewer faults). On
    uvloop rather than asyncio's own loop (which the rehearsal ran on until libuv's
    pipe was kept), 256 workers: 3.11 ~1,422 -> ~1,398, 3.13 ~705 -> ~689.

    The first play notes each code object it runs (``sys.setprofile``): those are the
    ones :func:`_relocate` copies together; a second play specializes the copies."""
    global _rehearsed, _relocated
    if default_impl() != "stream":
        return
    from .._identity import KEY_SIZE, borrowed_key
    from .._mesh import unlisted
    from .._model import Actor, endpoint
    from .._runtime import Capture, open_runtime
    from .._transport import open_transport
    from ._inprocess import InProcessHost

    def start() -> None:
        # What a worker's start does before its loop runs, less what it changes for
        # good (descriptors, threads, the streams): each call leaves nothing behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (as it is here already)
        Capture("rehearsal", 0, ())
        codecs.getincrementaldecoder("utf-8")("replace")
        threading.Thread(target=start, name="rehearsal", daemon=True)

    async def play() -> None:
        start()

        class Part(Actor):  # (a local class: cloudpickle sends it by value)
            def __init__(self) -> None:
                self.n = 0

            @endpoint
            def bump(self, x: int) -> int:
                self.n += x
                return self.n

        async with (
            open_runtime(lambda: open_transport()),
            InProcessHost().spawn_procs({"procs": 1}) as procs,
        ):
            part = await procs.spawn("rehearsal", Part)
            for _ in range(3):
                await part.bump.call(1)
                await part.bump.call_one(1)
                await part.bump.broadcast(1)

    ran: dict[int, types.CodeType] = {}

    def note(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call":
            ran.setdefault(id(frame.f_code), frame.f_code)

    # on the event loop a worker runs (uvloop, where it is installed)
    options = loop_options("asyncio")
    before = _open_fds()
    try:
        with borrowed_key(secrets.token_bytes(KEY_SIZE)), unlisted():
            profile = sys.getprofile()
            sys.setprofile(note)
            try:
                anyio.run(play, backend="asyncio", backend_options=options)
            finally:
                sys.setprofile(profile)
            _relocated = _relocate(ran)
            # again, on the copies: their instructions are specialized here once more
            anyio.run(play, backend="asyncio", backend_options=options)
        _rehearsed = True
    except Exception as exc:
        log.debug("the zygote's rehearsal failed: %r", exc)
    finally:
        reset_settings()
        # what a loop leaves for good: libuv's pipe (see _Server._kept_in_child);
        # anything else a child closes, as it does every descriptor of this process
        left = sorted(_open_fds() - before)
        ends = {_fd_kind(fd) for fd in left}
        if len(left) == 2 and len(ends) == 1 and ends.pop().startswith("pipe:"):
            _kept.update(left)
        elif left:
            log.debug("the zygote's rehearsal left descriptors open: %s", left)


def _fd_kind(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _open_fds() -> set[int]:
    """The descriptors this process holds (without the listing's own)."""
    return {fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd)}


def main() -> None:
    """The zygote: ``python -m amesh._hosts._zygote``, started by :meth:`Zygote.start`."""
    boot = msgspec.json.decode(take_internal(_BOOT_VAR), type=_Boot)
    # Ctrl-C reaches the whole process group; the controller decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGCONT, 0, 0, 0)
    try:
        controller = os.pidfd_open(boot.controller_pid)
    except ProcessLookupError:
        os._exit(1)
    if os.getppid() != boot.controller_pid:  # the controller died before we could watch
        os._exit(1)
    sys.path[:] = boot.sys_path
    raise_open_files()  # a pidfd per child, two descriptors per request; its children too
    raise_processes()  # its children and their threads count against its user's limit
    ctl = socket.socket(fileno=boot.ctl_fd)
    _preload()
    _rehearse()
    _settle()
    # Empty the attribute cache of types: a child's first lookups miss it anyway
    # (the zygote's were the imports'), and each miss then writes the name it evicts
    # (its reference count), on a page of its own; evicting None writes one page.
    # 1,684 -> 1,612 page faults a worker, from start to its first answer, on 3.11;
    # on 3.13, with an immortal heap, keeping it cost +56.
    sys._clear_type_cache()
    server = _Server(ctl, controller)
    req = server.serve()
    if req is None:
        return
    # In a fresh child: become what `python -m amesh._worker` would have been. (Its
    # environment and settings are its base's already, see _adopt_env: it takes the
    # rest.)
    _take_env(req)
    os.chdir(req.cwd)
    from .. import _worker

    sys.argv[:] = [_worker.__file__ or "amesh._worker"]
    _worker.main(req.boot)


if __name__ == "__main__":
    main()
