"""Worker output at the controller: printed where the controller prints, each line
with the mesh and rank it came from.

Every ProcMesh has an :class:`OutputPrinter` for the :class:`~amesh._wire.Output`
frames of its processes (captured there: see :mod:`amesh._runtime._capture`). The
runtime's :class:`Outputs` finds it by the address of the process that sent the
frame. Frames of a process that reported Ready to this runtime are kept until its mesh
attaches the printer (a few, for a few moments); frames from any other process are
dropped and counted (``frames_refused``).

Modes (``ProcMesh(output=...)``, default ``AMESH_OUTPUT``, else ``"folded"``):

- ``"folded"``: a line that several ranks of a mesh print within :data:`FOLD_WINDOW`
  seconds is printed once, ``[trainers 0-15] epoch 3 done``. Each rank's lines keep
  their order. A line is held at most :data:`FOLD_WINDOW`, and only until the last
  reply of a call arrives (the output of a call is on screen when it returns).
- ``"raw"``: every line at once, with its own prefix ``[trainers 3] epoch 3 done``.
- ``"off"``: nothing; the workers drop their output (stdout, stderr, logging, fds 1
  and 2), and their failures still reach the controller as exceptions.

Lines written to stdout go to ``sys.stdout``, those written to stderr (warnings
included) to ``sys.stderr``, both looked up at each write: in Jupyter, the output of
the cell that runs. A logging record is emitted again through
``logging.getLogger(name)`` when the controller's logging has a handler for it: the
controller's levels and handlers decide, the message starts with the prefix, and the
record carries ``amesh_mesh`` and ``amesh_ranks``. Without one (logging not
configured), it is printed to ``sys.stderr`` as ``[trainers 3] WARNING mylib: ...``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, TextIO

import anyio

from .._config import settings
from .._wire import LOG, STDERR, STDOUT, Output, OutputLine

__all__ = [
    "FOLD_WINDOW",
    "MODES",
    "SETTLE_TIMEOUT",
    "OutputPrinter",
    "Outputs",
    "output_mode",
    "plain_line",
    "ranks_text",
]

MODES = ("folded", "raw", "off")
#: How long a line waits for the same line from other ranks (folded mode), in seconds.
FOLD_WINDOW = 0.05
#: How long a stopping mesh waits for the last output of processes that exited well.
SETTLE_TIMEOUT = 2.0
#: Frames kept per process until its printer is attached, and processes kept so.
_EARLY_FRAMES = 64
#: Lines of a mesh's output that its controller keeps for ``amesh logs``.
RECENT_LINES = 1000
_EARLY_PROCS = 1024


def output_mode(mode: str | None = None) -> str:
    """``mode``, or ``AMESH_OUTPUT`` when None (default ``"folded"``).

    Raises:
        ValueError: not one of :data:`MODES`.
    """
    if mode is None:
        mode = settings().output
    if mode not in MODES:
        raise ValueError(f"output must be one of {', '.join(map(repr, MODES))}, not {mode!r}")
    return mode


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks as ranges: ``0-3,8,10-11``."""
    parts: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run[-1] = r
            continue
        if run:
            parts.append(_span(run))
        run = [r, r]
    if run:
        parts.append(_span(run))
    return ",".join(parts)


def _span(run: list[int]) -> str:
    return str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}"


class Outputs:
    """The printers of one runtime, by the address of each process they print for."""

    def __init__(self) -> None:
        self._printers: dict[str, tuple[OutputPrinter, int]] = {}
        #: frames of processes started here whose printer is not attached yet
        self._early: dict[str, list[Output]] = {}
        #: printers that hold lines back (folded)
        self.holding: set[OutputPrinter] = set()

    def started(self, addr: str) -> None:
        """A process this runtime started reported Ready from ``addr``: keep its
        output until its printer is attached (its mesh learns of it a moment later)."""
        if addr in self._printers or addr in self._early:
            return
        if len(self._early) >= _EARLY_PROCS:  # (processes whose start was given up)
            del self._early[next(iter(self._early))]
        self._early[addr] = []

    def add(self, addr: str, printer: OutputPrinter, slot: int) -> None:
        """Print the output of ``addr`` (slot ``slot`` of its mesh) with ``printer``."""
        self._printers[addr] = (printer, slot)
        for env in self._early.pop(addr, ()):
            printer.on_output(addr, slot, env)

    def remove(self, addr: str, printer: OutputPrinter) -> None:
        if self._printers.get(addr, (None, 0))[0] is printer:
            del self._printers[addr]

    def recent(self, label: str, n: int, since: int | None = None) -> tuple[list[str], int]:
        """The last ``n`` lines of output of the meshes named ``label`` (ProcMeshes), or
        (with ``since``, a count this returned before) those that came since, of the
        last :data:`RECENT_LINES`; and how many lines came in all."""
        printers = {p for p, _ in self._printers.values() if p.label == label}
        lines = [line for p in printers for line in p.recent]
        total = sum(p.lines_seen for p in printers)
        if since is not None:
            n = total - since
        return (lines[-n:] if n > 0 else []), total

    def deliver(self, env: Output, peer: str) -> bool:
        """Print ``env`` from ``peer``; False when no printer takes its output."""
        found = self._printers.get(peer)
        if found is None:
            early = self._early.get(peer)
            if early is None:
                return False
            if len(early) < _EARLY_FRAMES:
                early.append(env)
            return True
        printer, slot = found
        printer.on_output(peer, slot, env)
        return True

    def release(self) -> None:
        """Print every line held back now (a call's last reply has arrived)."""
        for printer in list(self.holding):
            printer.release()


class _Group:
    """One line, and the ranks that printed it (folded mode)."""

    __slots__ = ("deadline", "line", "ranks", "seq")

    def __init__(self, line: OutputLine, seq: int, deadline: float) -> None:
        self.line = line
        self.seq = seq
        self.deadline = deadline
        self.ranks: set[int] = set()


class OutputPrinter:
    """Prints the output of one ProcMesh's processes (see the module's docstring).

    Args:
        outputs: the runtime's table of printers.
        mode: one of :data:`MODES`.
        label: the mesh's name, for lines that name no rank (dropped lines).
        new_event: the event loop's own Event class.
    """

    def __init__(self, outputs: Outputs, mode: str, label: str, new_event: Any) -> None:
        self._outputs = outputs
        self.mode = mode
        self.label = label
        self._new_event = new_event
        #: set when the process at an address has sent its last output
        self._ends: dict[str, Any] = {}
        #: processes that capture their output (they sent a frame)
        self._capturing: set[str] = set()
        self._addrs: set[str] = set()
        # folded mode: lines held back in order, the one open for each text, and the
        # newest that each process added to
        self._held: deque[_Group] = deque()
        self._open: dict[tuple[str, int, int, str, str], _Group] = {}
        self._last: dict[str, int] = {}
        self._seq = 0
        self._wakeup: Any = None
        self._scope = anyio.CancelScope()
        #: the last lines, each with its own rank (``amesh logs``)
        self.recent: deque[str] = deque(maxlen=RECENT_LINES)
        #: lines that came in all
        self.lines_seen = 0

    def attach(self, addr: str, slot: int) -> None:
        """Print the output of the process at ``addr``, slot ``slot`` of the mesh."""
        self._addrs.add(addr)
        self._ends[addr] = self._new_event()
        self._outputs.add(addr, self, slot)

    async def settle(self, addrs: Iterable[str], timeout: float = SETTLE_TIMEOUT) -> None:
        """Wait (at most ``timeout``) for the last output of the processes at ``addrs``,
        which have exited well: it may still be on its way. A process that captures
        its output says so with an empty frame at start, and sends a last one at exit."""
        events = [self._ends[a] for a in addrs if a in self._capturing]
        with anyio.move_on_after(timeout):
            for event in events:
                await event.wait()

    def close(self) -> None:
        """Print what is held back, and take no more output."""
        self.release()
        for addr in self._addrs:
            self._outputs.remove(addr, self)
        self._addrs.clear()
        self._capturing.clear()
        self._scope.cancel()

    # -- printing -----------------------------------------------------------------------

    def on_output(self, addr: str, slot: int, env: Output) -> None:
        """An :class:`~amesh._wire.Output` frame from the process at ``addr``."""
        self._capturing.add(addr)
        self.recent.extend(plain_line(line) for line in env.lines)
        self.lines_seen += len(env.lines)
        if self.mode != "off":
            lines: list[OutputLine] = list(env.lines)
            if env.dropped:
                lines.append(OutputLine(STDERR, self.label, slot, f"[{env.dropped} lines dropped]"))
            if self.mode == "raw":
                for line in lines:
                    _print(line, str(line.rank))
                _flush()
            else:
                for line in lines:
                    self._fold(addr, line)
        if env.last:
            end = self._ends.get(addr)
            if end is not None:
                end.set()

    def _fold(self, addr: str, line: OutputLine) -> None:
        key = (line.label, line.stream, line.level, line.logger, line.text)
        group = self._open.get(key)
        # A process's line must not join a group printed before its previous line, and
        # a rank that prints a line twice prints it twice.
        if group is None or group.seq < self._last.get(addr, 0) or line.rank in group.ranks:
            self._seq += 1
            group = self._open[key] = _Group(line, self._seq, time.monotonic() + FOLD_WINDOW)
            self._held.append(group)
            if len(self._held) == 1:
                self._outputs.holding.add(self)
                if self._wakeup is not None:
                    self._wakeup.set()
        group.ranks.add(line.rank)
        self._last[addr] = group.seq

    def release(self, until: float | None = None) -> None:
        """Print the groups held back (those due by ``until``, or all)."""
        held = self._held
        if not held:
            return
        while held and (until is None or held[0].deadline <= until):
            group = held.popleft()
            line = group.line
            key = (line.label, line.stream, line.level, line.logger, line.text)
            if self._open.get(key) is group:
                del self._open[key]
            _print(line, ranks_text(group.ranks))
        if not held:
            self._outputs.holding.discard(self)
        _flush()

    async def run(self) -> None:
        """Print the held-back lines when they are due (folded mode), until closed."""
        with self._scope:
            while True:
                if not self._held:
                    self._wakeup = self._new_event()
                    await self._wakeup.wait()
                    self._wakeup = None
                    continue
                delay = self._held[0].deadline - time.monotonic()
                if delay > 0:
                    await anyio.sleep(delay)
                self.release(time.monotonic())


def plain_line(line: OutputLine) -> str:
    """``line`` as ``amesh logs`` shows it: its own rank, and a record's level and
    logger (the log files of :mod:`amesh._runtime._logfile` hold the same)."""
    text = line.text
    if line.stream == LOG:
        text = f"{logging.getLevelName(line.level)} {line.logger or 'root'}: {text}"
    return f"[{line.label} {line.rank}] {text}"


def _stream(line: OutputLine) -> TextIO:
    return sys.stdout if line.stream == STDOUT else sys.stderr


def _print(line: OutputLine, ranks: str) -> None:
    prefix = f"[{line.label} {ranks}]"
    try:
        if line.stream == LOG:
            _log(line, prefix, ranks)
        else:
            _stream(line).write(f"{prefix} {line.text}\n" if line.text else f"{prefix}\n")
    except (OSError, ValueError):  # the controller's stream is closed or broken
        pass


def _log(line: OutputLine, prefix: str, ranks: str) -> None:
    logger = logging.getLogger(line.logger if line.logger not in ("", "root") else None)
    if logger.hasHandlers():
        if logger.isEnabledFor(line.level):
            extra = {"amesh_mesh": line.label, "amesh_ranks": ranks}
            record = logger.makeRecord(
                logger.name, line.level, "", 0, "%s %s", (prefix, line.text), None, extra=extra
            )
            logger.handle(record)
        return
    head = f"{prefix} {logging.getLevelName(line.level)} {line.logger or 'root'}:"
    first, *rest = line.text.split("\n")
    sys.stderr.write("".join([f"{head} {first}\n", *(f"{prefix} {r}\n" for r in rest)]))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
