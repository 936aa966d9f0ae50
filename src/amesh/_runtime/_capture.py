"""A worker's output, captured and sent to its supervisor, each line tagged with whose
it is.

A worker started by a ProcMesh installs a :class:`Capture` at start (:func:`install`,
from :mod:`amesh._worker`):

- ``sys.stdout`` and ``sys.stderr`` become writers that split what is written into
  lines and tag each with the identity current at write time: the actor mesh's name
  and the actor's rank while one of its handlers runs (``__init__``, ``__cleanup__``
  and ``__supervise__`` included, and threaded endpoints), else the ProcMesh's name
  and the process's slot. A carriage return starts a line over: a progress bar shows
  its last state, when its line ends.
- fds 1 and 2 become pipes that a thread reads: what bypasses ``sys.stdout`` (C
  extensions, subprocesses, ``os.write(1, ...)``) is tagged with the process's
  identity. C's ``stdout`` is made line-buffered, so that its lines are not held back.
  The pipes hold 1 MiB: a process that writes more than that at fd level while its
  main thread holds the GIL waits until it lets go (the reading thread needs it).
- ``logging``: the root logger (level ``AMESH_LOG_LEVEL``, default WARNING) forwards
  each record whole, with its level and logger name. ``warnings`` are written to
  stderr as ``Category: message (file:line)``.

Lines wait in a bounded buffer (:data:`MAX_LINES`, :data:`MAX_CHARS`): past it they
are dropped and counted (the supervisor prints ``[N lines dropped]``), so output never
blocks a handler. A task of the event loop sends them to the process's parent as
:class:`~amesh._wire.Output` frames, :data:`FLUSH_INTERVAL` after the first of a batch
(and one frame at once at start, which tells the parent that this process captures).
Before a reply goes out, the complete lines waiting go out first
(:func:`before_reply`): the caller sees what its call printed through Python before
the call returns. What was written at fd level follows within a batch.

At exit (:meth:`Capture.close`, once the worker was asked to shut down) the pipes are
drained, unfinished lines end, and the rest is sent with ``last`` set, which the
supervisor waits for. A worker that crashes (killed, a segfault, ``os._exit``) loses
at most what it had not sent yet: its last batch (about :data:`FLUSH_INTERVAL` of
output) and what sat in the pipes. Lines that cannot be sent at exit are written to the
worker's original stdout/stderr, with their tag.
"""

from __future__ import annotations

import atexit
import codecs
import ctypes
import fcntl
import io
import logging
import os
import select
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Collection, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TextIO, cast

import anyio

from .. import _wire
from .._wire import LOG, STDERR, STDOUT, OutputLine
from ._context import call_context, call_soon_threadsafe
from ._logfile import LogWriter
from ._output import plain_line

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = [
    "FLUSH_INTERVAL",
    "MAX_CHARS",
    "MAX_LINES",
    "Capture",
    "active",
    "before_reply",
    "install",
    "output_identity",
]

#: Seconds from the first line of a batch until it is sent.
FLUSH_INTERVAL = 0.02
#: What may wait to be sent; more is dropped and counted.
MAX_LINES = 10_000
MAX_CHARS = 8 << 20
#: Characters of lines one frame carries at most (besides MAX_OUTPUT_LINES).
_BATCH_CHARS = 1 << 20
#: How long the last lines may take to leave at exit.
CLOSE_TIMEOUT = 2.0
#: The capacity asked for each fd pipe (Linux; the default is 64 KiB).
_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031
_IOLBF = 1

#: ``(label, rank)`` of the output written in this context, when set: a ProcAgent sets
#: it while an actor's ``__init__`` or ``__cleanup__`` runs in the agent's handler.
output_identity: ContextVar[tuple[str, int] | None] = ContextVar("amesh_output", default=None)

#: The capture of this process (a worker's), if any.
_active: Capture | None = None

Identity = tuple[str, int]


def active() -> Capture | None:
    """This process's capture, if it has one (a worker started by a ProcMesh)."""
    return _active


def before_reply() -> None:
    """Send the complete lines waiting now, ahead of a reply about to be sent."""
    capture = _active
    if capture is not None and capture.pending:
        capture.flush_nowait()


def install(
    label: str,
    rank: int,
    level: str,
    system: Collection[str] = (),
    log_file: LogWriter | None = None,
) -> Capture:
    """Capture this process's output from now on (see the module's docstring).

    Args:
        label, rank: the process's identity (its ProcMesh's name and its slot).
        level: the root logger's level (``AMESH_LOG_LEVEL``).
        system: keys of amesh's own actors: output of their handlers is the process's.
        log_file: where the lines sent are kept too (a persistent mesh's worker: see
            :mod:`amesh._runtime._logfile`).
    """
    global _active
    capture = Capture(label, rank, system, log_file)
    capture.start(level)
    _active = capture
    return capture


def _line_end(text: str) -> str:
    """What shows of a finished line: the text after its last carriage return."""
    text = text.rstrip("\r")
    return text[text.rfind("\r") + 1 :]


def _compact(tail: str) -> str:
    """An unfinished line without what a later carriage return overwrote."""
    cut = tail.rfind("\r", 0, len(tail) - 1)
    return tail[cut + 1 :] if cut >= 0 else tail


def _category(category: type[Warning]) -> str:
    if category.__module__ == "builtins":
        return category.__qualname__
    return f"{category.__module__}.{category.__qualname__}"


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` of a captured worker: the category and message first,
    then where (left out when that is no file, as for code made at run time)."""
    where = "" if filename.startswith("<") else f" ({os.path.basename(filename)}:{lineno})"
    try:
        (file or sys.stderr).write(f"{_category(category)}: {message}{where}\n")
    except (OSError, ValueError):
        pass


class Capture:
    """The output of this worker process, on its way to the supervisor.

    Args:
        label, rank: the process's identity.
        system: keys of amesh's own actors (their handlers' output is the process's).
    """

    def __init__(
        self,
        label: str,
        rank: int,
        system: Collection[str] = (),
        log_file: LogWriter | None = None,
    ) -> None:
        self.process: Identity = (label, rank)
        self._log_file = log_file
        self._system = frozenset(system)
        self._lock = threading.Lock()
        self._lines: deque[OutputLine] = deque()
        self._chars = 0
        self._dropped = 0
        #: unfinished lines by (stream, label, rank, written at fd level)
        self._partial: dict[tuple[int, str, int, bool], str] = {}
        #: lines wait to be sent
        self.pending = False
        #: stopped: what is written goes to the original streams
        self.closed = False
        #: in a child forked from the worker: written straight to fds 1 and 2
        self.forked = False
        self._notify: Callable[[], None] | None = None
        self._rt: Runtime | None = None
        self._send_lock: anyio.Lock | None = None
        self._sending = False
        #: what the capture takes over, given back at close
        self._original: dict[int, TextIO] = {STDOUT: sys.stdout, STDERR: sys.stderr}
        self._show_warning = warnings.showwarning
        self._pipes: _Pipes | None = None
        self._handler = _Forward(self)

    # -- writing (any thread) -------------------------------------------------------------

    def identity(self) -> Identity:
        """Whose output is written now: the actor whose handler runs, else the process."""
        ident = output_identity.get()
        if ident is not None:
            return ident
        ctx = call_context.get()
        if ctx is not None:
            inst = ctx.instance
            if inst is not None and inst.key not in self._system:
                return inst.name, inst.rank
        return self.process

    def original(self, stream: int) -> TextIO:
        """The stream that was ``sys.stdout`` (``sys.stderr``) before the capture."""
        return self._original[stream]

    def write(
        self, stream: int, text: str, ident: Identity | None = None, fd: bool = False
    ) -> None:
        """Take ``text`` written to ``stream`` by ``ident`` (now's identity by default)."""
        if ident is None:
            ident = self.identity()
        key = (stream, ident[0], ident[1], fd)
        wake = False
        with self._lock:
            lines = (self._partial.pop(key, "") + text).split("\n")
            tail = _compact(lines.pop())
            while len(tail) > _wire.MAX_LINE:
                lines.append(tail[: _wire.MAX_LINE])
                tail = tail[_wire.MAX_LINE :]
            if tail:
                self._partial[key] = tail
            for line in lines:
                wake = self._add(stream, ident, _line_end(line)) or wake
        if wake:
            self._wake()

    def log(self, level: int, logger: str, text: str) -> None:
        """Take a logging record (its whole text) of ``logger`` at ``level``."""
        ident = self.identity()
        with self._lock:
            wake = self._add(
                LOG,
                ident,
                _wire.clip(text, _wire.MAX_LINE),
                level,
                _wire.clip(logger, _wire.MAX_NAME),
            )
        if wake:
            self._wake()

    def _add(
        self, stream: int, ident: Identity, text: str, level: int = 0, logger: str = ""
    ) -> bool:
        """Queue a line (holding the lock); True when it is the first of a batch."""
        if len(self._lines) >= MAX_LINES or self._chars + len(text) > MAX_CHARS:
            self._dropped += 1
            return False
        self._lines.append(OutputLine(stream, ident[0], ident[1], text, level, logger))
        self._chars += len(text)
        if self.pending:
            return False
        self.pending = True
        return True

    def _wake(self) -> None:
        notify = self._notify
        if notify is not None:
            notify()

    def _take(self) -> tuple[list[OutputLine], int, bool]:
        """``(lines, dropped, more)``: a frame's worth of what waits, in order."""
        with self._lock:
            queue = self._lines
            lines: list[OutputLine] = []
            chars = 0
            while queue and len(lines) < _wire.MAX_OUTPUT_LINES and chars < _BATCH_CHARS:
                line = queue.popleft()
                lines.append(line)
                chars += len(line.text)
            self._chars -= chars
            more = bool(queue)
            dropped = 0
            if not more:  # (the lines were dropped after all those that wait)
                dropped, self._dropped = self._dropped, 0
                self.pending = False
        if self._log_file is not None and (lines or dropped):
            self._log_file.write(self._file_lines(lines, dropped))
        return lines, dropped, more

    def _file_lines(self, lines: list[OutputLine], dropped: int) -> Iterator[str]:
        """``lines`` as the log file holds them: one ``[label rank] text`` a line."""
        for line in lines:
            first, *rest = plain_line(line).split("\n")
            yield first
            yield from (f"[{line.label} {line.rank}] {r}" for r in rest)
        if dropped:
            label, rank = self.process
            yield f"[{label} {rank}] [{dropped} lines dropped]"

    # -- starting and stopping ------------------------------------------------------------

    def start(self, level: str) -> None:
        """Take over stdout, stderr, fds 1 and 2, logging and warnings."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        try:
            pipes = _Pipes(self)
            pipes.start()
            self._pipes = pipes
        except OSError as exc:  # no fds 1 and 2 to take over: Python-level output only
            logging.getLogger("amesh.worker").debug("output at fd level is not captured: %s", exc)
        _line_buffer_c_stdout()
        sys.stdout = cast(TextIO, _Writer(self, STDOUT))
        sys.stderr = cast(TextIO, _Writer(self, STDERR))
        warnings.showwarning = _show_warning
        root = logging.getLogger()
        if root.level != logging.getLevelName(level):  # (setLevel empties every logger's
            root.setLevel(level)  # cache, on pages a zygote's child shares: ~25 copies)
        root.addHandler(self._handler)
        os.register_at_fork(after_in_child=self._after_fork)
        atexit.register(self._at_exit)

    def _after_fork(self) -> None:
        # A child forked from the worker (a DataLoader's): its writes go to fds 1 and 2,
        # the pipes its parent reads. It never takes the lock another thread may have held.
        global _active
        self.forked = True
        _active = None

    def _restore(self) -> None:
        """Give stdout, stderr, logging and warnings back (the capture is closed)."""
        label, rank = self.process
        sys.stdout = self.original(STDOUT)
        sys.stderr = self.original(STDERR)
        warnings.showwarning = self._show_warning
        root = logging.getLogger()
        root.removeHandler(self._handler)
        late = logging.StreamHandler(self.original(STDERR))
        late.setFormatter(
            logging.Formatter(f"[{label} {rank}] %(levelname)s %(name)s: %(message)s")
        )
        root.addHandler(late)

    def _end_lines(self) -> None:
        """Stop taking lines: unfinished ones end as they are."""
        with self._lock:
            self.closed = True
            for (stream, label, rank, _), text in self._partial.items():
                self._add(stream, (label, rank), _line_end(text))
            self._partial.clear()

    def _at_exit(self) -> None:
        """At interpreter exit, if :meth:`close` did not run: keep what is left."""
        if self.forked or self.closed:
            return
        if self._pipes is not None:
            self._pipes.stop()
        self._end_lines()
        self._restore()
        self._spill()

    def _spill(self) -> None:
        """Write what could not be sent to the original streams, tagged."""
        while True:
            lines, dropped, more = self._take()
            for line in lines:
                out = self.original(STDOUT if line.stream == STDOUT else STDERR)
                text = line.text
                if line.stream == LOG:
                    level = logging.getLevelName(line.level)
                    text = f"{level} {line.logger}: {text}"
                try:
                    out.write(f"[{line.label} {line.rank}] {text}\n")
                except (OSError, ValueError):
                    pass
            if dropped:
                label, rank = self.process
                try:
                    self.original(STDERR).write(f"[{label} {rank}] [{dropped} lines dropped]\n")
                except (OSError, ValueError):
                    pass
            if not more:
                break
        for stream in (STDOUT, STDERR):
            try:
                self.original(stream).flush()
            except (OSError, ValueError):
                pass

    # -- sending (the event loop) --------------------------------------------------------

    async def run(self, rt: Runtime) -> None:
        """Send what is written to this process's parent, until cancelled (a task of
        ``rt``, on asyncio or trio)."""
        self._rt = rt
        self._send_lock = anyio.Lock()
        soon = call_soon_threadsafe()
        wake = anyio.Event()

        def set_wake() -> None:
            wake.set()

        def notify() -> None:
            try:
                soon(set_wake)
            except RuntimeError:  # the loop has closed
                pass

        self._notify = notify
        await self._send(first=True)  # says that this process captures (see OutputPrinter)
        while True:
            wake = anyio.Event()
            if not self.pending:
                await wake.wait()
            await anyio.sleep(FLUSH_INTERVAL)
            await self._send()

    async def _send(self, last: bool = False, first: bool = False) -> None:
        rt, lock = self._rt, self._send_lock
        assert rt is not None and lock is not None
        async with lock:
            self._sending = True
            try:
                while True:
                    lines, dropped, more = self._take()
                    end = last and not more
                    parent = rt.peers.parent
                    if parent and (lines or dropped or end or first):
                        try:
                            await rt.send_frame(parent, _wire.Output(lines, dropped, end))
                        except ValueError:  # larger than the transport takes
                            with self._lock:
                                self._dropped += len(lines)
                    if not more:
                        return
            finally:
                self._sending = False

    def flush_nowait(self) -> None:
        """Send the complete lines waiting now, in order, without waiting (skipped while
        a batch is on its way: the link is slow, and the lines follow it)."""
        rt = self._rt
        if rt is None or self._sending or self.closed:
            return
        parent = rt.peers.parent
        while parent:
            lines, dropped, more = self._take()
            if lines or dropped:
                rt.send_frame_nowait(parent, _wire.Output(lines, dropped))
            if not more:
                return

    async def close(self) -> None:
        """Stop capturing, and send what is left with ``last`` set (see the module's
        docstring); what cannot be sent within :data:`CLOSE_TIMEOUT` is written to the
        original streams."""
        global _active
        if self.closed or self.forked:
            return
        if self._pipes is not None:
            self._pipes.stop()
        self._end_lines()
        self._restore()
        _active = None
        if self._rt is not None and self._send_lock is not None:
            with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
                await self._send(last=True)
        self._spill()


class _Writer(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` of a captured worker."""

    encoding = "utf-8"
    errors = "backslashreplace"

    def __init__(self, capture: Capture, stream: int) -> None:
        super().__init__()
        self._capture = capture
        self._stream = stream
        self._bytes: _BytesWriter | None = None

    @property
    def buffer(self) -> _BytesWriter:
        """A binary face (``sys.stdout.buffer``), for code that writes bytes."""
        if self._bytes is None:
            self._bytes = _BytesWriter(self)
        return self._bytes

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def reconfigure(self, **settings: Any) -> None:
        """Nothing to change (``sys.stdout.reconfigure(...)``): lines go out as text."""

    def fileno(self) -> int:
        return self._capture.original(self._stream).fileno()

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        capture = self._capture
        if capture.closed or capture.forked:
            out = capture.original(self._stream)
            out.write(s)
            if "\n" in s:
                out.flush()
        elif s:
            capture.write(self._stream, s)
        return len(s)

    def flush(self) -> None:
        capture = self._capture
        if capture.closed or capture.forked:
            capture.original(self._stream).flush()


class _BytesWriter(io.RawIOBase):
    """``sys.stdout.buffer`` of a captured worker: UTF-8 in, lines out."""

    def __init__(self, text: _Writer) -> None:
        super().__init__()
        self._text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self._text.write(self._decoder.decode(data))
        return len(data)


class _Forward(logging.Handler):
    """Forwards each logging record, whole, with its level and logger name."""

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self._capture = capture
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:
            self.handleError(record)
            return
        capture = self._capture
        if capture.closed or capture.forked:
            out = capture.original(STDERR)
            out.write(f"{record.levelname} {record.name}: {text}\n")
            out.flush()
        else:
            capture.log(record.levelno, record.name, text)


#: C's stdout's buffer, where it is set through ctypes (it must outlive the stream)
_stdout_line: Any = None


def _line_buffer_c_stdout() -> None:
    """Make C's ``stdout`` line-buffered: on a pipe it would hold lines back (glibc),
    and unbuffered (``PYTHONUNBUFFERED``) it writes a line in pieces. In a buffer of
    its own: glibc would keep the unbuffered stream's one byte."""
    global _stdout_line
    if sys.platform != "linux":
        return
    try:
        from .._native._ext import line_buffer_stdout
    except ImportError:  # not built: through ctypes
        pass
    else:
        try:
            line_buffer_stdout()
        except OSError:
            pass
        return
    try:
        libc = ctypes.CDLL(None)
        stdout = ctypes.c_void_p.in_dll(libc, "stdout")
        buf = ctypes.create_string_buffer(8192)
        if libc.setvbuf(stdout, buf, _IOLBF, len(buf)) == 0:
            _stdout_line = buf
    except (OSError, ValueError, AttributeError):
        pass


def _flush_c_stdio() -> None:
    if sys.platform != "linux":
        return
    try:
        from .._native._ext import flush_stdio
    except ImportError:  # not built: through ctypes
        pass
    else:
        flush_stdio()
        return
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


class _Pipes:
    """fds 1 and 2 as pipes that a thread reads (output that bypasses Python)."""

    def __init__(self, capture: Capture) -> None:
        self._capture = capture
        #: fd -> a copy of what it was
        self._saved: dict[int, int] = {}
        #: read end -> the stream it carries
        self._ends: dict[int, int] = {}
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}
        #: one reader at a time per pipe (the thread, or the loop at exit)
        self._lock = threading.Lock()
        self._stop_r = self._stop_w = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            for fd, stream in ((1, STDOUT), (2, STDERR)):
                saved = os.dup(fd)
                self._saved[fd] = saved
                r, w = os.pipe()
                self._ends[r] = stream
                self._decoders[r] = codecs.getincrementaldecoder("utf-8")("replace")
                os.set_blocking(r, False)
                try:
                    fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_SIZE)
                except OSError:
                    pass  # the default capacity, then
                os.dup2(w, fd)
                os.close(w)
            self._stop_r, self._stop_w = os.pipe()
        except OSError:
            self._undo()
            raise
        self._thread = threading.Thread(target=self._run, name="amesh-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        for r in self._ends:
            poller.register(r, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._stop_r:
                    return
                if self._drain(fd):
                    poller.unregister(fd)

    def _drain(self, r: int) -> bool:
        """Take what the pipe holds now; True at its end."""
        capture = self._capture
        with self._lock:
            stream = self._ends.get(r)
            if stream is None:  # closed by stop(), which gave up waiting for us
                return True
            while True:
                try:
                    data = os.read(r, 65536)
                except BlockingIOError:
                    return False
                except OSError:
                    return True
                if not data:
                    return True
                text = self._decoders[r].decode(data)
                if text:
                    capture.write(stream, text, capture.process, fd=True)

    def _undo(self) -> None:
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._saved.clear()
        with self._lock:  # the thread may still be draining (a loaded machine)
            for r in self._ends:
                os.close(r)
            self._ends.clear()
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = -1

    def stop(self) -> None:
        """Give fds 1 and 2 back, and take what the pipes still hold."""
        _flush_c_stdio()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join(timeout=1.0)
            self._thread = None
        for r in list(self._ends):
            self._drain(r)
        self._undo()
