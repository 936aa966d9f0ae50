"""The zygote process (``python -m amesh._hosts._zygote_main``): it imports what a
worker needs, rehearses a worker's part once, then serves its controller's requests:
it forks a child per :class:`~amesh._hosts._zygote.Spawn`, which becomes that worker,
and reaps and reports each child's exit. :mod:`amesh._hosts._zygote` says why and how,
and is the controller's side; :mod:`amesh._hosts._zygote_heap` makes its memory ready
before each fork.
"""

from __future__ import annotations

import codecs
import ctypes
import importlib
import logging
import os
import secrets
import select
import signal
import socket
import sys
import threading
import types

import anyio
import msgspec

from .. import _wire
from .._config import VARIABLES, loop_options, settings, take_internal
from .._config import reset as reset_settings
from .._limits import raise_open_files, raise_processes
from .._transport import TLS_PREFIX, default_impl
from ._zygote import (
    _BOOT_VAR,
    _BYE,
    _MAX_REQUEST,
    DEATH_WAIT,
    Exited,
    Hello,
    Spawn,
    Spawned,
    SpawnFailed,
    _Boot,
    _recv,
    _send,
)
from ._zygote_heap import _relocate, _settle

__all__ = ["main"]

log = logging.getLogger("amesh.hosts")

#: Requests forked in one go when several wait (each brings two descriptors).
_BATCH = 64
_PR_SET_PDEATHSIG = 1
#: What a worker imports, so that its children need not: optional ones may be missing.
_PRELOAD = ("amesh._worker", "anyio._backends._asyncio", "cloudpickle")
_PRELOAD_OPTIONAL = ("uvloop",)
#: The NNG transports (pynng, the C extension): preloaded only where they are chosen, as
#: workers on the default stream transport never import them.
_PRELOAD_NNG = "amesh._transport._ext"


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
            removed = _wire.sweep_segments()
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
    if boot.sys_path:  # (a zygote of another interpreter, an environment's, keeps its own)
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
