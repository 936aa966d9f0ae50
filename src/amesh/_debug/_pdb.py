"""The worker's side: ``breakpoint()`` connects to the debug listener and runs pdb on
the caller's frame over that connection (see :mod:`amesh._debug`)."""

from __future__ import annotations

import os
import pdb
import socket
import sys
import threading
from types import FrameType
from typing import IO, Any, cast

from .._config import settings, take_internal
from .._runtime import call_context, debugged_here, paused_outside, wait_off_loop
from .._tracebacks import RUNNERS
from .._transport import (
    Refused,
)
from ._conn import DEBUG_ENV, RELAYED_ENV, _Conn, _dial
from ._listener import _title


class _Channel:
    """pdb's stdin and stdout: output goes out as it is written, each line of input
    is asked for; a closed connection reads as the end of input."""

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self._open = True

    @property
    def open(self) -> bool:
        """Whether the session is still on (the client may still be there)."""
        return self._open

    def write(self, text: str) -> int:
        if text and self._open:
            try:
                self._conn.send({"out": text})
            except OSError:
                self._open = False
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        if not self._open:
            return ""
        try:
            self._conn.send({"read": 1})
            # a handler on the event loop waits in a worker thread: the loop goes on
            return wait_off_loop(self._conn.readline).decode(errors="replace")
        except OSError:
            self._open = False
            return ""

    def close(self) -> None:
        self._open = False
        self._conn.close()


class _RemotePdb(pdb.Pdb):
    """pdb over a connection to the controller; leaving it (``continue``, ``quit``, the
    end of input) lets the program go on and closes the connection."""

    def __init__(self, channel: _Channel) -> None:
        io = cast("IO[str]", channel)  # what pdb uses of a file, no more
        # Stepping never stops in amesh's frames (nor those of the loop and threads it
        # runs handlers with): `n` past an endpoint's return would show the greenlet
        # that drove its coroutine, and its StopIteration. AMESH_DEBUG=1 shows all.
        skip = (
            None
            if settings().debug
            else [f"{m}{t}" for m in ("amesh", *RUNNERS) for t in ("", ".*")]
        )
        super().__init__(stdin=io, stdout=io, skip=skip, nosigint=True, readrc=False)
        self._channel = channel
        self.prompt = "(Pdb) "

    def user_exception(self, frame: FrameType, exc_info: Any) -> None:
        # bdb stops at the StopIteration of a coroutine stepped past its return in the
        # frame that drove it, even a skipped one (amesh's greenlet): not there
        if self.skip and self.is_skipped_module(frame.f_globals.get("__name__", "")):
            return
        super().user_exception(frame, exc_info)

    def _leave(self) -> bool:
        # the session ends with the connection: breakpoints set in it cannot stop again
        self.clear_all_breaks()
        self.set_continue()
        self._channel.close()
        return True

    def handler_ended(self) -> None:
        """The paused handler returned or raised while the session was on."""
        if self._channel.open:
            self.message("amesh: the handler ended; the session ends with it")
            self._leave()

    def do_continue(self, arg: str) -> bool:
        """c(ont(inue)): go on; this session ends."""
        return self._leave()

    def do_quit(self, arg: str) -> bool:
        """q(uit): detach; the handler goes on (it is not aborted)."""
        self.message("amesh: detached, the handler goes on")
        return self._leave()

    def do_EOF(self, arg: str) -> bool:
        return self._leave()

    do_c = do_cont = do_continue
    do_q = do_exit = do_quit


def _where(frame: FrameType) -> dict[str, Any]:
    ctx = call_context.get()
    inst = ctx.instance if ctx is not None else None
    return {
        "role": "worker",
        "label": inst.name if inst is not None else f"pid {os.getpid()}",
        "rank": inst.rank if inst is not None else None,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "thread": threading.current_thread().name,
        "file": frame.f_code.co_filename,
        "line": frame.f_lineno,
        "function": frame.f_code.co_name,
    }


def breakpointhook(*args: Any, **kwargs: Any) -> Any:
    """A worker's ``sys.breakpointhook``: pdb on the caller's frame, driven by the
    controller (see the module doc); ``PYTHONBREAKPOINT`` still chooses another hook,
    or none."""
    if os.environ.get("PYTHONBREAKPOINT"):
        return sys.__breakpointhook__(*args, **kwargs)
    frame = sys._getframe(1)
    address = take_internal(DEBUG_ENV, keep=True)
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    if not address:
        print(
            f"amesh: breakpoint() at {where} skipped: no debugger reaches this worker",
            file=sys.stderr,
            flush=True,
        )
        return None
    try:
        conn = _dial(address)
        conn.send(_where(frame))
    except (OSError, ValueError, Refused) as exc:
        print(f"amesh: breakpoint() at {where} skipped: {exc}", file=sys.stderr, flush=True)
        return None
    if take_internal(RELAYED_ENV, keep=True):  # a host agent's listener, not the controller's
        info = _where(frame)
        print(
            f"amesh: {_title(info)} paused (pid {info['pid']} on {info['host']}): attach "
            f"with `await amesh.debug()` at the controller, or `amesh debug` on {info['host']}",
            file=sys.stderr,
            flush=True,
        )
    debugger = _RemotePdb(_Channel(conn))
    ctx = call_context.get()
    if (
        ctx is not None
        and ctx.instance is not None
        and paused_outside()
        and ctx.instance.pause_in_greenlet(ctx.method)
    ):
        # This pause holds the event loop (the handler has no greenlet of its own):
        # say so; the endpoint has one from its next call on.
        print(
            f"amesh: {where} paused outside a greenlet: this process serves nothing "
            "else until the session ends (later calls of this endpoint pause alone; "
            "AMESH_PAUSE_ANYWHERE=1 makes every handler pausable alone)",
            file=sys.stderr,
            flush=True,
        )
    debugged_here(debugger.handler_ended)
    debugger.set_trace(frame)
    return None
