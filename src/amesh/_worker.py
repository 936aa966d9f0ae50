"""Entry point of a worker process: ``python -m amesh._worker``, or :func:`main` in a
child of the zygote (:mod:`amesh._hosts._zygote`), which runs it after its fork.

The worker dies with its parent: the kernel sends it SIGKILL when the parent exits
(PR_SET_PDEATHSIG), and a thread exits the process when the write end of its stdin
pipe closes (which also covers platforms without prctl). An exec'd worker's parent is
the controller, which holds that end. A forked worker's parent is the zygote, and its
stdin is the zygote's lifeline pipe, whose write end only the controller holds: it
dies with the zygote, and with the controller even if the zygote is gone.

The worker learns what it needs (:class:`~amesh._bootstrap.Bootstrap`, with the job
key) over a private channel: an exec'd worker reads it from the start of its stdin
pipe, before it watches that pipe; a forked one gets it from the zygote's request. It
adopts its mesh's settings (:attr:`~amesh._bootstrap.WorkerSpec.settings`) before
anything reads one, and the key before it opens its transport, with which it proves
itself to every peer it connects to (see :mod:`amesh._transport._auth`).

The worker sends its parent a heartbeat every ``heartbeat_period``; the parent's
supervisor kills a worker that was silent for ``heartbeat_timeout``. A thread of the C
extension writes them (:class:`amesh._native._ext.Beat`), which never takes the GIL: Python
only connects (and proves itself on) the heartbeat connection and hands the socket
over, and the event loop connects again when the C thread finds it broken or the
parent ends it (rare, so that a loop busy in a handler puts that off does not matter;
it waits on the connection rather than waking every period: with the watchdog thread
that did this before, the idle workers of a mesh of 256 took ~7% of a CPU, now ~3%).
What a heartbeat proves:

- the process is scheduled: not stopped (SIGSTOP, a debugger), not frozen, not gone;
- its main thread is not stuck in uninterruptible sleep in the kernel (state D, a hung
  filesystem or driver): the C thread reads the main thread's state from ``/proc`` and
  withholds the beats once it was D in every look for ``heartbeat_timeout``.

It does not prove that the event loop makes progress: a handler busy in Python, or in
one long C call that holds the GIL (``sum(range(10**9))``, a large allocation), is
alive. Without the extension a Python thread sends the heartbeats, and a main thread
that holds the GIL for ``heartbeat_timeout`` silences it.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (signal.py wraps it; no stub)
import atexit
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from . import _debug, _wire
from ._bootstrap import Bootstrap, WorkerSpec, read_bootstrap, started_as
from ._config import adopt, loop_options, settings
from ._identity import adopt_key
from ._model import AGENT_KEY, ProcAgent, handlers_of
from ._runtime import (
    ActorInstance,
    LogWriter,
    Runtime,
    active_capture,
    call_context,
    install_capture,
    install_stack_dump,
    open_runtime,
)
from ._transport import (
    STREAM_HEADER,
    StreamBeat,
    Transport,
    heartbeat_sender,
    is_stream_address,
    local_route,
    open_transport,
)

if TYPE_CHECKING:
    from ._native._ext import Beat
    from ._transport import NngBeat

_PR_SET_PDEATHSIG = 1

log = logging.getLogger("amesh.worker")


def _die_with_parent(parent_pid: int, pdeathsig: bool) -> None:
    try:
        from ._native import _ext
    except ImportError:  # not built: ctypes and a Python thread do it
        _ext = None  # type: ignore[assignment]
    # The kernel's parent-death signal fires when the *thread* that forked us exits,
    # not the process: only safe when the parent forked from a thread that lives as
    # long as it does (its event loop's thread, under asyncio). trio forks from a
    # cached worker thread that exits when idle, so there only the pipe watch is used.
    if pdeathsig and sys.platform == "linux":
        if _ext is not None:
            _ext.set_parent_death_signal(signal.SIGKILL)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before we could watch it
        os._exit(1)
    if _ext is not None:
        _ext.exit_when_closed(0)
        return

    def watch_stdin() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch_stdin, name="amesh-parent-watch", daemon=True).start()


def _heartbeat_frame(addr: str) -> bytes:
    return _wire.join(_wire.encode(_wire.Heartbeat(addr, os.getpid())))


class NativeBeats:
    """Heartbeats written by :class:`amesh._native._ext.Beat`, a thread that never takes the
    GIL; this object only makes the connection it writes to, and makes it again when
    the thread finds it broken or its listener ends it (:meth:`renew`, from a thread of
    its own, :meth:`watch`, or from the event loop, :meth:`keep`).

    Args:
        parent: where the heartbeats go (a stream or an NNG address).
        own: this worker's address, which the connection proves it speaks for.
        period: seconds between heartbeats.
        watch_tid: the native id of the thread whose hang in the kernel silences them.

    Raises:
        ImportError: no extension, or (for an NNG ``parent``) no pynng.
    """

    def __init__(
        self, parent: str, own: str, period: float, watch_tid: int, hung_after: float
    ) -> None:
        from ._native import _ext

        frame = _heartbeat_frame(own)
        stream = is_stream_address(parent)
        self._nng: NngBeat | None = None
        if not stream:
            from ._transport import NngBeat, load_nng

            load_nng()  # the extension's Beat sends through NNG's functions
            self._nng = NngBeat(parent, own)
        self._make = _ext.Beat
        self._parent, self._own, self._period, self._tid = parent, own, period, watch_tid
        self._hung_after = hung_after
        self._frame = STREAM_HEADER.pack(len(frame)) + frame if stream else frame
        self._lock = threading.Lock()
        self._beat: Beat | None = None
        #: the stream socket ``_beat`` writes to (-1: none, or NNG); and the one that
        #: :meth:`keep` waits on now (-1: none)
        self._fd = -1
        self._watched = -1
        self._closed = False

    @property
    def beat(self) -> Beat | None:
        """The thread that writes the heartbeats now (None while not connected)."""
        return self._beat

    def _sound(self) -> bool:
        old = self._beat
        return old is not None and not old.broken and not (self._nng and self._nng.stale)

    def renew(self, ended: bool = False) -> None:
        """Connect if there is no connection, or again if the last one broke (or
        ``ended``: its listener closed it)."""
        old = self._beat
        if not ended and self._sound():
            return
        with self._lock:
            if self._closed:
                return
            self._beat, self._fd = None, -1
        if old is not None:
            old.close()  # first: an NNG socket is replaced below
        new: Beat | None
        try:
            new, fd = self._connect()
        except Exception as exc:  # OSError, Refused, pynng's: try again next period
            log.debug("cannot connect the heartbeats to %s: %s", self._parent, exc)
            return
        with self._lock:
            if not self._closed:
                self._beat, self._fd, new = new, fd, None
        if new is not None:
            new.close()

    def _connect(self) -> tuple[Beat, int]:
        fd = sock = -1
        if self._nng is None:
            fd = StreamBeat(self._parent, self._own).connect_fd()
        else:
            sock = self._nng.socket_id()
        beat = self._make(
            self._frame,
            self._period,
            fd=fd,
            socket=max(sock, 0),
            watch_tid=self._tid,
            hung_after=self._hung_after,
        )
        return beat, fd

    async def keep(self) -> None:
        """Keep the heartbeats connected until cancelled, from the event loop (what
        :meth:`watch` does from a thread of its own): a stream connection is waited on
        until it ends (its listener never writes to it, so it turns readable only
        then), an NNG one looked at every period; a new one is made in a worker thread
        (its handshake blocks). Wakes nobody while the connection holds."""
        while not self._closed:
            fd = self._fd
            ended = False
            if fd >= 0:
                since = anyio.current_time()
                self._watched = fd
                try:
                    await anyio.wait_readable(fd)
                    ended = True
                except anyio.ClosedResourceError:  # close(), on this loop
                    return
                finally:
                    self._watched = -1
                # a listener that takes the connection and drops it at once is asked
                # again once a period, not in a loop; one that held it longer is asked
                # at once (anyio >= 4.16 refuses a negative delay)
                await anyio.sleep(max(0.0, since + self._period - anyio.current_time()))
            else:
                await anyio.sleep(self._period)
                if self._sound():
                    continue
            await anyio.to_thread.run_sync(self.renew, ended)

    def watch(self, stop: threading.Event) -> None:
        """Keep the heartbeats connected until ``stop`` (a plain thread's loop)."""
        try:
            while not stop.wait(self._period):
                self.renew()
        finally:
            if self._nng is not None:
                self._nng.close()

    def close(self) -> None:
        """Stop the heartbeats now; idempotent. (On the event loop of :meth:`keep`
        when that runs: it may be waiting on the connection.)"""
        if self._watched >= 0:
            anyio.notify_closing(self._watched)
        with self._lock:
            self._closed = True
            beat, self._beat, self._fd = self._beat, None, -1
        if beat is not None:
            beat.close()


def _send_heartbeats(to: str, own: str, period: float, stop: threading.Event) -> None:
    """Heartbeats from a Python thread (without the extension)."""
    frame = _heartbeat_frame(own)
    sender = heartbeat_sender(to, own=own)
    try:
        while not stop.wait(period):
            sender.send(frame)  # False: the receiver is slow or away; a later beat will do
    finally:
        sender.close()


def start_heartbeats(
    to: str,
    own: str,
    period: float,
    stop: threading.Event,
    watch_tid: int = 0,
    hung_after: float = 0.0,
    kept: bool = False,
) -> NativeBeats | None:
    """Send heartbeats from ``own`` to ``to`` every ``period`` seconds until ``stop``:
    from the extension's thread (see :class:`NativeBeats`; close what it returns after
    ``stop``), else from a Python thread (None).

    The extension's connection is made here, before returning (blocking for one
    handshake): a caller that then holds the GIL is heard all along. A thread of its
    own keeps it connected (:meth:`NativeBeats.watch`), or with ``kept`` the caller's
    event loop does (it runs :meth:`NativeBeats.keep`). A ``tls+tcp`` receiver on this
    host is reached at its local alias (see :class:`~amesh._transport.HybridTransport`).
    """
    to = local_route(to)
    native: NativeBeats | None = None
    try:
        native = NativeBeats(to, own, period, watch_tid, hung_after)
    except ImportError:
        pass
    except Exception as exc:  # pynng's, for an NNG receiver
        log.warning("heartbeats from a Python thread: %s", exc)
    target: Callable[..., None]
    args: tuple[Any, ...]
    if native is None:
        target, args = _send_heartbeats, (to, own, period, stop)
    else:
        native.renew()
        if kept:
            return native
        target, args = native.watch, (stop,)
    threading.Thread(target=target, args=args, name="amesh-heartbeat", daemon=True).start()
    return native


async def serve(
    transport_factory: Callable[[], Transport],
    parent: str,
    token: str,
    heartbeats: Callable[[Runtime, str], AbstractContextManager[Any]],
) -> None:
    """Run a worker runtime until its owner asks it to exit.

    Args:
        transport_factory: makes the worker's transport.
        parent: the owner's address (gets Ready, heartbeats and failure reports).
        token: echoed in Ready so the owner can match this worker.
        heartbeats: ``heartbeats(rt, to)`` is a context manager that sends heartbeats
            to ``to`` while it is entered.
    """
    call_context.set(None)  # a worker starts outside any actor's call
    shutdown = anyio.Event()
    async with open_runtime(transport_factory) as rt:
        with _Beating(rt, heartbeats, parent) as beating:
            rt.peers.parent = parent  # hears of deaths this process's supervisor sees
            agent = ProcAgent(shutdown, beating.adopt)
            rt.add_actor(
                ActorInstance(rt, AGENT_KEY, AGENT_KEY, agent, handlers_of(ProcAgent), parent, 0)
            )
            capture = active_capture()
            try:
                await rt.send_frame(parent, _wire.Ready(token, rt.address, rt.pid))
                if capture is not None:  # (its first frame must follow the Ready)
                    rt.start_soon(capture.run, rt)
                await shutdown.wait()
            finally:
                if capture is not None:
                    await capture.close()  # the last output goes before the exit


class _Beating:
    """The heartbeats of a worker, to its owner; :meth:`adopt` gives it a new owner (a
    persistent mesh taken over by another controller)."""

    def __init__(
        self,
        rt: Runtime,
        heartbeats: Callable[[Runtime, str], AbstractContextManager[Any]],
        parent: str,
    ) -> None:
        self._rt = rt
        self._make = heartbeats
        self._parent = parent
        self._cm: AbstractContextManager[Any] | None = None

    def __enter__(self) -> _Beating:
        self._cm = self._make(self._rt, self._parent)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
            self._cm = None

    def adopt(self, parent: str) -> None:
        """From now on ``parent`` owns this worker: it gets the heartbeats, the death
        notices and every actor's failure reports."""
        rt = self._rt
        if parent == self._parent:
            return
        log.info("adopted by %s (was %s)", parent, self._parent)
        self._parent = parent
        rt.peers.parent = parent
        for inst in rt.dispatch.actors.values():
            inst.owner = parent
        self.__exit__()
        self.__enter__()


@contextmanager
def _worker_heartbeats(boot: Bootstrap, rt: Runtime, to: str) -> Iterator[None]:
    """The extension's heartbeat thread, kept connected by this runtime's event loop
    (a thread fewer in every worker, and none that wakes every period); without the
    extension, a Python thread."""
    stop = threading.Event()
    # this thread runs the event loop: its hang in the kernel silences the beats
    native = start_heartbeats(
        to,
        rt.address,
        boot.spec.heartbeat_period,
        stop,
        threading.get_native_id(),
        boot.spec.heartbeat_timeout,
        kept=True,
    )
    keeping = anyio.CancelScope()
    if native is not None:
        rt.start_soon(_keep, native, keeping)
    try:
        yield
    finally:
        stop.set()
        keeping.cancel()
        if native is not None:
            native.close()


async def _keep(native: NativeBeats, scope: anyio.CancelScope) -> None:
    with scope:
        await native.keep()


async def _serve(boot: Bootstrap) -> None:
    spec = boot.spec
    await serve(
        lambda: open_transport(spec.scheme, host=spec.host, reach=boot.parent),
        boot.parent,
        boot.token,
        lambda rt, to: _worker_heartbeats(boot, rt, to),
    )


def _take_output(spec: WorkerSpec, level: str) -> None:
    """Send this worker's output to its supervisor, each line tagged with the mesh's
    name and the worker's slot, or drop it, as its spec asks; see
    :mod:`amesh._runtime._capture`. A worker with no label writes to the stdout and
    stderr it inherited. ``level``: the root logger's."""
    label, mode = spec.output_label, spec.output
    if label and mode != "off":
        # a persistent mesh's worker keeps its lines in a file its host agent reads too
        path = spec.output_file
        log_file = LogWriter(path, settings().log_file_bytes) if path else None
        install_capture(label, spec.slot, level, system=(AGENT_KEY,), log_file=log_file)
        return
    if label and mode == "off":
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    logging.basicConfig(
        level=level, format=f"[pid {os.getpid()}] %(levelname)s %(name)s: %(message)s"
    )


def main(boot: Bootstrap | None = None) -> None:
    """Run the worker: with ``boot`` from the zygote, else read from stdin (exec'd)."""
    if boot is None:
        try:
            boot = read_bootstrap(0)
        except (EOFError, ValueError, OSError) as exc:
            print(f"amesh worker: no bootstrap on stdin: {exc}", file=sys.stderr)
            os._exit(1)
    adopt(boot.spec.settings)  # its mesh's settings, before anything reads one
    adopt_key(boot.key)
    started_as(boot.spec)
    sys.breakpointhook = _debug.breakpointhook  # pdb at the controller
    # A terminal's Ctrl-C reaches the whole process group; the controller decides
    # what it means and stops the workers itself. (A zygote's child ignores it
    # already; asking through the signal module, which wraps each answer in an enum,
    # copies ~15 of the zygote's pages.)
    if _signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(boot.parent_pid, boot.pdeathsig)
    sys.path[:] = [*boot.spec.path, *(boot.sys_path or sys.path)]
    _take_output(boot.spec, settings().log_level or "WARNING")
    install_stack_dump()  # its stacks when its event loop cannot answer
    backend = boot.spec.backend  # the event loop its ProcMesh asks for
    if backend not in ("asyncio", "trio"):
        print(f"amesh worker: no event loop {backend!r}; running asyncio", file=sys.stderr)
        backend = "asyncio"
    code = 0
    try:
        anyio.run(_serve, boot, backend=backend, backend_options=loop_options(backend))
    except SystemExit as exc:  # what the interpreter would exit with
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    leave(code)


def leave(code: int) -> NoReturn:
    """End this process as a forked ``multiprocessing`` child does, plus its atexit
    handlers: wait for its non-daemon threads, run the atexit handlers, flush stdout
    and stderr, and ``os._exit(code)``, without tearing the interpreter down.

    The teardown would free every object, and so write every page a zygote's child
    still shares with the zygote: ~5,000 page copies a worker, 17 s for 1,024 workers
    on 2 CPUs. A file the worker wrote without closing or flushing it loses what its
    buffer held, as in a ``multiprocessing`` child.
    """
    try:
        shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # closed or broken: nothing left to do with it
                pass
        os._exit(code)


if __name__ == "__main__":
    main()
