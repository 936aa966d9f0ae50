"""The clients: :func:`amesh.debug` and ``amesh debug`` list the paused ranks, here and
at the host agents, and attach to one (see :mod:`amesh._debug`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import anyio
from anyio.from_thread import run as run_on_loop
from anyio.lowlevel import EventLoopToken, current_token

from .._config import take_internal
from .._runtime import bridged
from .._transport import (
    Refused,
)
from ._conn import _CHUNK, DEBUG_ENV, _Conn, _dial, _shut
from ._listener import _GONE, current_listener

#: Seconds between two looks at the remote debuggers while waiting for a rank to pause.
_POLL = 0.2


class RemoteDebugger(Protocol):
    """Ranks paused on another machine, as its host agent relays them."""

    async def sessions(self) -> list[dict[str, Any]]:
        """The ranks paused there that nobody attached to (as the listener lists them).

        Raises:
            Exception: the agent cannot answer.
        """
        ...

    async def open(self, ident: int) -> int | None:
        """Attach to session ``ident``: a handle for :meth:`read` and :meth:`write`;
        None when it is no longer paused, or taken."""
        ...

    async def read(self, handle: int, timeout: float) -> bytes | None:
        """What the session sent (pdb's JSON lines) within ``timeout`` seconds: None
        when nothing, ``b""`` at its end."""
        ...

    async def write(self, handle: int, data: bytes) -> None:
        """Send ``data`` (the user's lines) to the session."""
        ...

    async def close(self, handle: int) -> None:
        """Detach (the rank goes on)."""
        ...


_remote_debuggers: Callable[[], list[RemoteDebugger]] = list


def set_remote_debuggers(debuggers: Callable[[], list[RemoteDebugger]]) -> None:
    """Register where :func:`debug` finds ranks paused on other machines (called on
    the event loop of the controller's runtime)."""
    global _remote_debuggers
    _remote_debuggers = debuggers


#: A paused rank that a client found: where (None: the local listener) and what.
_Found = tuple[RemoteDebugger | None, dict[str, Any]]


class _Client:
    """Lists paused ranks at a listener (``conn``, or none) and at remote debuggers, and
    attaches this terminal (``input()``, ``print()``) to one; from a thread, with the
    remote calls on the event loop of ``token``."""

    def __init__(
        self, conn: _Conn | None, remotes: list[RemoteDebugger], token: EventLoopToken | None
    ) -> None:
        self.conn = conn
        self.remotes = remotes
        self.token = token

    def run(self, wait: float | None) -> bool:
        """Attach to a paused rank chosen by the user (directly when only one is) until
        its session ended; False when none paused within ``wait`` seconds."""
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.remotes:
                left = _POLL if left is None else min(_POLL, left)
            found = self._list(left)
            if not found:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                continue
            chosen = _pick(found)
            if chosen is not None and self._attach(*chosen):
                return True

    def _list(self, wait: float | None) -> list[_Found]:
        """The paused ranks; when none is, this waits up to ``wait`` seconds for one at
        the listener (None: however long it takes).

        Raises:
            ConnectionError: the listener went away.
        """
        found: list[_Found] = []
        for remote in self.remotes:
            try:
                found += [(remote, s) for s in run_on_loop(remote.sessions, token=self.token)]
            except Exception:  # an agent that cannot answer has nothing to attach to
                continue
        if self.conn is None:
            if not found and wait:
                time.sleep(wait)
            return found
        self.conn.send({"op": "list", "wait": 0.0 if found else wait})
        reply = self.conn.recv()
        if reply is None:
            raise ConnectionError("the debug listener went away")
        return [(None, s) for s in reply.get("sessions") or []] + found

    def _attach(self, remote: RemoteDebugger | None, chosen: dict[str, Any]) -> bool:
        if remote is None:
            assert self.conn is not None
            self.conn.send({"op": "attach", "id": chosen["id"]})
            reply = self.conn.recv()
            if reply is None or "attached" not in reply:
                print(f"amesh: {(reply or {}).get('error', 'the listener went away')}")
                return False
            _session(chosen, lambda: _relay(cast(_Conn, self.conn)))
            return True
        handle = run_on_loop(remote.open, chosen["id"], token=self.token)
        if handle is None:
            print(f"amesh: {_GONE}")
            return False
        _session(chosen, lambda: self._relay_remote(remote, handle))
        return True

    def _relay_remote(self, remote: RemoteDebugger, handle: int) -> None:
        """:func:`_relay` over a socket pair whose other end the remote session feeds."""
        mine, theirs = socket.socketpair()

        def down() -> None:
            try:
                while (data := run_on_loop(remote.read, handle, 1.0, token=self.token)) != b"":
                    if data:
                        theirs.sendall(data)
            except Exception:  # the agent, or this controller's runtime, is gone
                pass
            finally:
                _shut(theirs)

        def up() -> None:
            try:
                while data := theirs.recv(_CHUNK):
                    run_on_loop(remote.write, handle, data, token=self.token)
            except Exception:
                pass
            finally:
                with contextlib.suppress(Exception):
                    run_on_loop(remote.close, handle, token=self.token)

        threads = [
            threading.Thread(target=f, name=f"amesh-debug-{f.__name__}", daemon=True)
            for f in (down, up)
        ]
        for t in threads:
            t.start()
        try:
            _relay(_Conn(mine))
        finally:
            _shut(mine)
            for t in threads:
                t.join()
            mine.close()
            theirs.close()


def _pick(found: list[_Found]) -> _Found | None:
    """The paused rank the user picks (the only one, directly); None: list again."""
    if len(found) == 1:
        return found[0]
    print(f"amesh: {len(found)} ranks are paused:")
    for i, (_, s) in enumerate(found, 1):
        print(f"  {i}. {s['title']} (pid {s.get('pid')} on {s.get('host')})")
    answer = input(f"attach to [1-{len(found)}, Enter lists again]: ").strip()
    if not (answer.isdigit() and 1 <= int(answer) <= len(found)):
        return None
    return found[int(answer) - 1]


def _session(chosen: dict[str, Any], relay: Callable[[], None]) -> None:
    print(
        f"amesh: attached to {chosen['title']} (pid {chosen.get('pid')}); `c` lets it go on",
        flush=True,
    )
    relay()
    print(f"amesh: {chosen['title']} goes on", flush=True)


def _relay(conn: _Conn) -> None:
    """Show the pdb session's output and send it the user's lines, until it ends."""
    pending = ""
    try:
        while (msg := conn.recv()) is not None:
            if "out" in msg:
                text = pending + str(msg["out"])
                head, sep, pending = text.rpartition("\n")
                if sep:
                    print(head, flush=True)
            elif "read" in msg:
                prompt, pending = pending, ""
                conn.sock.sendall(input(prompt).encode() + b"\n")
    except EOFError:  # the user's end of input: detach (the rank goes on)
        pass
    if pending:
        print(pending, flush=True)


def attach(
    address: str | None,
    wait: float | None = None,
    remotes: list[RemoteDebugger] | None = None,
    token: EventLoopToken | None = None,
) -> bool:
    """Attach this terminal (``input()``, ``print()``) to a rank paused at the listener
    at ``address`` (or at one of ``remotes``, whose calls run on the event loop of
    ``token``), chosen by the user when several are; returns once its session ended
    (the rank goes on), False when no rank paused within ``wait`` seconds.

    Raises:
        OSError, Refused: cannot reach the listener.
    """
    conn = _dial(address) if address else None
    try:
        if conn is not None:
            conn.send({"role": "client"})
        return _Client(conn, remotes or [], token).run(wait)
    finally:
        if conn is not None:
            conn.close()


@bridged
async def debug(timeout: float | None = None) -> bool:
    """Attach to a rank paused in ``breakpoint()``, on this machine or under a host agent
    this controller attached to: list the paused ranks, let the user pick one (directly
    when only one is), then relay pdb between it and this terminal (or notebook:
    ``input()`` and ``print()``) until ``continue``.

    Args:
        timeout: how long to wait for a rank to pause (None: as long as it takes).

    Returns:
        False when no rank paused within ``timeout``.

    Raises:
        RuntimeError: this controller has started no worker yet.
    """
    listener = current_listener()
    address = listener.address if listener is not None else take_internal(DEBUG_ENV, keep=True)
    remotes = _remote_debuggers()
    if not address and not remotes:
        raise RuntimeError("amesh.debug(): no worker was started here, nothing to debug")
    return await anyio.to_thread.run_sync(
        attach, address, timeout, remotes, current_token(), abandon_on_cancel=True
    )


def cli(files: Path, pid: int | None, wait: float = 0.0) -> int:
    """``amesh debug``: attach to a paused rank of a controller on this machine, found
    by the file it wrote in ``files`` (see :class:`DebugListener`), waiting up to
    ``wait`` seconds (``math.inf``: for ever) for one to pause; an exit status."""
    try:
        return _cli(files, pid, wait)
    except KeyboardInterrupt:
        return 130


def _cli(files: Path, pid: int | None, wait: float) -> int:
    from .._identity import adopt_key

    deadline = time.monotonic() + wait
    late = f"amesh debug: no rank of yours paused within {wait:g} s (--wait)"
    found = _controllers(files, pid)
    if not found and wait:
        print(
            "amesh debug: waiting for a rank to pause (Ctrl-C stops)", file=sys.stderr, flush=True
        )
    # a controller writes its file when its first rank pauses: until then, look again
    while not found and time.monotonic() < deadline:
        time.sleep(max(0.0, min(_POLL, deadline - time.monotonic())))
        found = _controllers(files, pid)
    if not found:
        print(
            late if wait else "amesh debug: no controller of yours has a paused rank",
            file=sys.stderr,
        )
        return 1
    if len(found) > 1:
        pids = ", ".join(str(c["pid"]) for c in found)
        print(
            f"amesh debug: several controllers (pids {pids}): choose one with --pid",
            file=sys.stderr,
        )
        return 2
    adopt_key(bytes.fromhex(found[0]["key"]))
    left = deadline - time.monotonic()
    try:
        if not attach(found[0]["address"], None if left == math.inf else max(0.0, left)):
            print(late if wait else "amesh debug: no rank is paused there now", file=sys.stderr)
            return 1
    except (OSError, Refused) as exc:
        print(f"amesh debug: {exc}", file=sys.stderr)
        return 1
    return 0


def _controllers(files: Path, pid: int | None) -> list[dict[str, Any]]:
    """The live controllers that announced a listener in ``files`` (controller ``pid``'s
    only, unless None): only files of ours that nobody else may read are taken."""
    out = []
    for path in sorted(files.glob("*.json")):
        try:
            st = path.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                continue
            entry = json.loads(path.read_text())
            os.kill(int(entry["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid is None or entry["pid"] == pid:
            out.append(entry)
    return out
