"""The controller's debug listener (and a host agent's): it keeps the paused sessions
and splices a client to the one it chose (see :mod:`amesh._debug`)."""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._config import take_internal
from .._identity import job_key
from .._transport import (
    HANDSHAKE_TIMEOUT,
    Gate,
    Refusals,
    Refused,
    check_peer,
    fresh_stream_address,
    parse_stream_address,
)
from ._conn import _MAX_LINE, _NONCE, DEBUG_ENV, RELAYED_ENV, _Conn, _copy, _listener_proof, _shut


def _title(info: dict[str, Any]) -> str:
    """``trainers[3] at train.py:42``, from a worker's hello (:func:`_where`)."""
    rank = info.get("rank")
    who = f"{info.get('label')}[{rank}]" if rank is not None else str(info.get("label"))
    return f"{who} at {os.path.basename(str(info.get('file')))}:{info.get('line')}"


class _Paused:
    """A rank paused in pdb, waiting for (or attached to) a client."""

    def __init__(self, ident: int, info: dict[str, Any], conn: _Conn) -> None:
        self.ident = ident
        self.info = info
        self.conn = conn
        self.attached = False

    @property
    def title(self) -> str:
        """``trainers[3] at train.py:42``."""
        return _title(self.info)

    def describe(self) -> dict[str, Any]:
        return {"id": self.ident, "title": self.title, **self.info}

    def alive(self) -> bool:
        pid = self.info.get("pid")
        if not isinstance(pid, int):
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class DebugListener:
    """Where the workers' breakpoints go: the paused sessions of this controller, and
    clients that attach to them (see the module doc).

    Args:
        files: the directory of the file that ``amesh debug`` finds us by (called when
            the first rank pauses).

    Raises:
        OSError: cannot listen.
    """

    def __init__(self, files: Callable[[], Path]) -> None:
        self.address = fresh_stream_address("abstract")
        family, sockaddr = parse_stream_address(self.address)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind(sockaddr)
            self._sock.listen(64)
        except BaseException:
            self._sock.close()
            raise
        self._files = files
        self._file: Path | None = None
        self._paused: dict[int, _Paused] = {}
        self._cond = threading.Condition()
        self._next = 1
        self._refusals = Refusals(self.address)
        self._closed = False
        threading.Thread(target=self._accept, name="amesh-debug", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(sock,), name="amesh-debug-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        who, why = check_peer(sock)
        try:
            if why:
                raise Refused(why)
            conn = self._handshake(sock)
            hello = conn.recv(_MAX_LINE)
            sock.settimeout(None)
        except (OSError, EOFError, ValueError, Refused) as exc:
            self._refusals.refuse(who, str(exc) or type(exc).__name__)
            sock.close()
            return
        role = (hello or {}).get("role")
        if role == "worker" and hello is not None:
            self._add(hello, conn)
        elif role == "client":
            try:
                self._serve_client(conn)
            except (OSError, ValueError):
                pass
            finally:
                conn.close()
        else:
            conn.close()

    def _handshake(self, sock: socket.socket) -> _Conn:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        gate = Gate(self.address)
        sock.sendall(gate.challenge)
        rest = None
        while rest is None:
            n = sock.recv_into(gate.get_buffer())
            if not n:
                raise Refused("closed during the handshake")
            rest = gate.buffer_updated(n)
        conn = _Conn(sock, bytes(rest))
        sock.sendall(_listener_proof(conn.read_exact(_NONCE), self.address))
        return conn

    def _add(self, info: dict[str, Any], conn: _Conn) -> None:
        with self._cond:
            if self._closed:
                conn.close()
                return
            paused = _Paused(self._next, info, conn)
            self._next += 1
            self._paused[paused.ident] = paused
            self._cond.notify_all()
        self._announce()
        print(
            f"amesh: {paused.title} paused (pid {info.get('pid')}): attach with "
            "`await amesh.debug()` here or `amesh debug` in another terminal",
            file=sys.stderr,
            flush=True,
        )

    def _announce(self) -> None:
        """Write the file that ``amesh debug`` finds this listener by (once)."""
        if self._file is not None:
            return
        try:
            folder = self._files()
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = folder / f"{os.getpid()}.json"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "address": self.address, "key": job_key().hex()}, f)
        except OSError as exc:
            print(f"amesh: `amesh debug` cannot find this controller: {exc}", file=sys.stderr)
            return
        self._file = path

    def sessions(self, wait: float | None = 0.0) -> list[_Paused]:
        """The paused sessions nobody is attached to, once there is one (or ``wait``
        seconds passed; None: however long it takes)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._live()), wait)
            return self._live()

    def _live(self) -> list[_Paused]:
        for p in [p for p in self._paused.values() if not p.alive()]:
            del self._paused[p.ident]
            p.conn.close()
        return [p for p in self._paused.values() if not p.attached]

    def _serve_client(self, conn: _Conn) -> None:
        while (msg := conn.recv(_MAX_LINE)) is not None:
            if msg.get("op") == "list":
                wait = msg.get("wait")
                found = self.sessions(wait if isinstance(wait, int | float) else None)
                conn.send({"sessions": [p.describe() for p in found]})
            elif msg.get("op") == "attach":
                paused = self._take(msg.get("id"))
                if paused is None:
                    conn.send({"error": _GONE})
                    continue
                conn.send({"attached": paused.ident})
                self._splice(paused, conn)
                return

    def _take(self, ident: Any) -> _Paused | None:
        """Paused session ``ident``, now attached; None when it is gone or taken."""
        with self._cond:
            paused = self._paused.get(ident)
            if paused is None or paused.attached:
                return None
            paused.attached = True
            return paused

    def open(self, ident: int) -> socket.socket | None:
        """A connection spliced to paused session ``ident``, as a client that attached
        to it has (pdb's JSON lines out, raw lines in; closing it detaches); None when
        it is no longer paused, or taken."""
        paused = self._take(ident)
        if paused is None:
            return None
        mine, theirs = socket.socketpair()

        def splice() -> None:
            try:
                self._splice(paused, _Conn(theirs))
            finally:
                theirs.close()

        threading.Thread(target=splice, name="amesh-debug-open", daemon=True).start()
        return mine

    def _splice(self, paused: _Paused, client: _Conn) -> None:
        down = threading.Thread(
            target=_copy, args=(paused.conn, client.sock), name="amesh-debug-out", daemon=True
        )
        down.start()
        _copy(client, paused.conn.sock)
        down.join()
        with self._cond:
            self._paused.pop(paused.ident, None)
        paused.conn.close()

    def close(self) -> None:
        """Stop listening, let every paused rank go on, remove the file."""
        with self._cond:
            self._closed = True
            paused, self._paused = list(self._paused.values()), {}
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for p in paused:
            _shut(p.conn.sock)
        if self._file is not None:
            self._file.unlink(missing_ok=True)
            self._file = None


_GONE = "that rank is no longer paused, or taken"
_listener: DebugListener | None = None
_listener_lock = threading.Lock()


def current_listener() -> DebugListener | None:
    """This process's listener, once :func:`debug_env` started it."""
    return _listener


def debug_env(files: Callable[[], Path], relayed: bool = False) -> dict[str, str]:
    """What the environment of a worker started on this machine needs for its
    breakpoints: the address of this process's listener (started on first use;
    ``files``: see :class:`DebugListener`), or nothing in a worker, whose children
    inherit its controller's. ``relayed``: we are a host agent, whose listener the
    controller's user reaches through us; the worker says itself that it paused (in
    its output, which reaches the controller)."""
    global _listener
    if take_internal(DEBUG_ENV, keep=True):
        return {}
    with _listener_lock:
        if _listener is None:
            try:
                _listener = DebugListener(files)
            except OSError as exc:
                print(f"amesh: no remote debugging ({exc})", file=sys.stderr)
                return {}
            atexit.register(_listener.close)
        return (
            {DEBUG_ENV: _listener.address, RELAYED_ENV: "1"}
            if relayed
            else {DEBUG_ENV: _listener.address}
        )
