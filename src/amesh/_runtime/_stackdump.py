"""The stacks of a worker whose event loop does not answer, taken by a signal.

A rank stuck in a long synchronous call (``time.sleep(600)``, a busy loop, one C call
that holds the GIL) cannot run the ``stacks`` endpoint. So every worker asks
:mod:`faulthandler` at start (:func:`install`) to write the stacks of all its threads
when it gets :data:`STACKS_SIGNAL`, to an anonymous file of its own (a ``memfd``
named :data:`MEMFD_NAME`). The handler is C, signal-safe, and needs neither the GIL nor
the event loop. Whoever may see the process (the same user, on the same machine: its
controller, its host agent, ``amesh stacks``) takes them with :func:`dump`: it opens
that file through ``/proc/PID/fd``, sends the signal to the main thread, waits until
the handler has returned, and reads what it wrote.

Why not py-spy: it reads the process's memory from outside, which needs ptrace
permission (refused by Yama's ``ptrace_scope`` to all but a parent, and in containers
without ``CAP_SYS_PTRACE``), is another binary to install and lags new CPython
versions. What faulthandler cannot give: source lines (read back by the taker, see
:func:`amesh._runtime._stacks.format_dump`), the event loop's tasks, and more than 100
frames a thread. A healthy rank is never signalled: its loop answers first.

Linux only (``memfd``, ``/proc``, ``tgkill``); elsewhere :func:`install` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import faulthandler
import fcntl
import logging
import os
import signal
import sys

import anyio

from ._stacks import format_dump

__all__ = [
    "DUMP_TIMEOUT",
    "LOOP_TIMEOUT",
    "MEMFD_NAME",
    "STACKS_SIGNAL",
    "dump",
    "install",
    "stacks_by_signal",
]

log = logging.getLogger("amesh.worker")

#: The name of the file each worker writes its stacks to (``/memfd:`` in /proc).
MEMFD_NAME = "amesh-stacks"
#: The signal that asks for them: a real-time one, from the middle of the range
#: (libraries that take one take it from either end: timers SIGRTMIN, profilers
#: SIGRTMAX). Its default action would kill, so :func:`dump` sends it only to a
#: process that catches it.
STACKS_SIGNAL = getattr(signal, "SIGRTMIN", 34) + 12
#: Seconds a worker's event loop has to answer for its stacks before they are taken
#: by the signal instead.
LOOP_TIMEOUT = 2.0
#: Seconds the worker has to take the signal and write its stacks.
DUMP_TIMEOUT = 5.0
#: Seconds between two looks at whether the handler has returned.
_POLL = 0.002

#: the file this process writes to (kept open for as long as it lives)
_fd = -1


def install() -> None:
    """Write every thread's stack to this process's memfd on :data:`STACKS_SIGNAL`
    (at a worker's start; a no-op where it cannot)."""
    global _fd
    if sys.platform != "linux" or _fd >= 0:
        return
    try:
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    except OSError as exc:
        log.debug("no stacks by signal: %s", exc)
        return
    # O_APPEND: each dump goes at the end, which the taker empties (ftruncate) first
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True, chain=False)
    _fd = fd


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def _open_memfd(pid: int) -> int:
    """A descriptor of ``pid``'s stacks file (opened anew, read-write).

    Raises:
        LookupError: no such process, or it writes no stacks (not an amesh worker).
    """
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        raise LookupError(f"no process {pid} on this machine") from None
    for name in names:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(f"/memfd:{MEMFD_NAME} "):
                return os.open(f"/proc/{pid}/fd/{name}", os.O_RDWR | os.O_CLOEXEC)
    raise LookupError(f"process {pid} writes no stacks on a signal (not an amesh worker?)")


def _tgkill(pid: int, sig: int) -> None:
    """Send ``sig`` to the main thread of ``pid`` (whose thread id is ``pid``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, pid, sig) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot signal process {pid}: {os.strerror(err)}")


async def dump(pid: int, timeout: float = DUMP_TIMEOUT) -> str:
    """The stacks of every thread of process ``pid`` (on this machine), as
    :mod:`faulthandler` writes them (most recent call first), taken without its event
    loop (see the module's docstring).

    Raises:
        LookupError: no such process, or it writes no stacks on a signal.
        TimeoutError: it did not take the signal within ``timeout`` seconds (stopped,
            or its main thread in uninterruptible sleep: its state says which).
        OSError: it cannot be signalled or read (another user's).
    """
    if sys.platform != "linux":
        raise LookupError("stacks by signal are taken on Linux only")
    fd = _open_memfd(pid)
    bit = 1 << (STACKS_SIGNAL - 1)
    try:
        if not int(_status(pid).get("SigCgt", "0"), 16) & bit:
            raise LookupError(f"process {pid} does not catch the stacks signal")
        with anyio.fail_after(timeout):
            await _lock(fd)  # one taker at a time (the file's lock, across processes)
            os.ftruncate(fd, 0)
            _tgkill(pid, STACKS_SIGNAL)
            # The handler has returned once it wrote (the size grew) and the signal is
            # neither pending nor blocked: the kernel blocks it while its handler runs.
            # The size is read first: the signal is unblocked, and so seen done, also
            # in the moment between its delivery and its handler's start.
            while True:
                size = os.fstat(fd).st_size
                status = _status(pid)
                pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
                if size and not (pending | int(status["SigBlk"], 16)) & bit:
                    break
                await anyio.sleep(_POLL)
        text = os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "replace")
        os.ftruncate(fd, 0)  # (its pages)
        return text
    except TimeoutError:
        raise TimeoutError(
            f"process {pid} did not write its stacks within {timeout:g} s (state: {_state(pid)})"
        ) from None
    except FileNotFoundError:
        raise LookupError(f"process {pid} ended") from None
    finally:
        os.close(fd)


async def _lock(fd: int) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
        await anyio.sleep(_POLL)


def _state(pid: int) -> str:
    try:
        return _status(pid).get("State", "?")
    except OSError:
        return "ended"


async def stacks_by_signal(pid: int, full: bool = False) -> str:
    """The stacks of worker ``pid`` (on this machine) as ``ProcMesh.stacks`` shows them
    for a rank whose event loop did not answer within :data:`LOOP_TIMEOUT`: taken by
    :func:`dump`, or why they could not be."""
    waited = f"its event loop did not answer within {LOOP_TIMEOUT:g} s"
    try:
        raw = await dump(pid)
    except (LookupError, TimeoutError, OSError) as exc:
        return f"({waited}, and its stacks could not be taken by a signal: {exc})\n"
    note = f"{waited}: stacks taken by a signal, of its threads only (no tasks)"
    return format_dump(raw, note, full)
