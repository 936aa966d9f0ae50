"""Remote debugging: ``breakpoint()`` in an endpoint, on any rank, pauses that handler in
a pdb session that the controller's user attaches to (:func:`debug`, or ``amesh debug``
in another terminal).

Worker side: :func:`breakpointhook` is the worker's ``sys.breakpointhook``. It connects
to the controller's debug listener (the address in ``AMESH_DEBUG_LISTENER``, which the controller
gives the workers it starts on its machine), from the thread that hit the breakpoint and
without the event loop (which may be that thread), announces the paused rank, and runs
pdb on the caller's frame with the connection as its input and output. ``continue``,
``quit`` or the end of the connection (the user detached) ends the session: the
handler goes on.

Controller side: :class:`DebugListener`, one listening socket (a Linux abstract unix
socket) and a thread per connection, started when the controller starts its first
local worker. It keeps the paused sessions, and splices a client (:func:`debug`, ``amesh
debug``) to the one it chose. A host agent runs one too, for the workers it starts
(:mod:`amesh._hosts._agent`). Once a rank pauses, it writes
``<state dir>/debug/<pid>.json`` (mode 0600: the address and the job key, in hex, as
readable as the key file of the state directory) for ``amesh debug``, and removes it
when the controller exits.

Both ends prove that they hold the job key: the dialer answers the listener's stream
challenge (:mod:`amesh._transport._auth`), then the listener answers the dialer's nonce
(:func:`_listener_proof`), so that a squatter of the address gets no pdb session either.
A peer of another uid is refused before the challenge.

After the handshake each side sends JSON lines: the first says who it is (``role``
``worker`` with where it paused, or ``client``); a worker then sends its output
(``{"out": text}``) and asks for each line of input (``{"read": 1}``), which comes back
as one raw line; a client lists (``{"op": "list"}``) and attaches (``{"op": "attach"}``).

Ranks paused on other machines: :func:`debug` also lists those of the host agents this
controller attached to (the :class:`RemoteDebugger` s that the hosts layer registers
with :func:`set_remote_debuggers`), polling them while it waits, and relays a session
through its agent, over the amesh link to it.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import json
import math
import os
import pdb
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Any, Protocol, cast

import anyio
from anyio.from_thread import run as run_on_loop
from anyio.lowlevel import EventLoopToken, current_token

from ._config import settings, take_internal
from ._identity import job_key
from ._runtime import bridged, call_context, debugged_here, paused_outside, wait_off_loop
from ._tracebacks import RUNNERS
from ._transport import (
    HANDSHAKE_TIMEOUT,
    Gate,
    Refusals,
    Refused,
    StreamBeat,
    check_peer,
    fresh_stream_address,
    mac,
    parse_stream_address,
)

__all__ = [
    "DEBUG_ENV",
    "DebugListener",
    "RemoteDebugger",
    "breakpointhook",
    "cli",
    "current_listener",
    "debug",
    "debug_env",
    "set_remote_debuggers",
]

#: The environment variable that tells a worker where its breakpoints go.
DEBUG_ENV = "AMESH_DEBUG_LISTENER"
#: set (by a host agent) when the listener is not the controller's
RELAYED_ENV = "AMESH_DEBUG_RELAYED"
_TAG = b"amesh debug listener v1\0"
_NONCE = 32
_CHUNK = 65536
#: The longest JSON line a listener takes before a session is attached.
_MAX_LINE = 65536
#: Seconds between two looks at the remote debuggers while waiting for a rank to pause.
_POLL = 0.2


# -- connections (both ends) -------------------------------------------------------------


class _Conn:
    """A blocking socket with a read buffer: JSON lines and raw lines."""

    def __init__(self, sock: socket.socket, pending: bytes = b"") -> None:
        self.sock = sock
        self._buf = bytearray(pending)

    def _fill(self) -> bool:
        data = self.sock.recv(_CHUNK)
        self._buf += data
        return bool(data)

    def read_exact(self, n: int) -> bytes:
        """The next ``n`` bytes.

        Raises:
            EOFError: the peer closed the connection first.
        """
        while len(self._buf) < n:
            if not self._fill():
                raise EOFError("the peer closed the connection")
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    def readline(self, limit: int | None = None) -> bytes:
        """The next line with its ``\\n`` (without one at the end of the stream).

        Raises:
            ValueError: no line end within ``limit`` bytes.
        """
        while (end := self._buf.find(b"\n")) < 0:
            if limit is not None and len(self._buf) > limit:
                raise ValueError(f"a line longer than {limit} bytes")
            if not self._fill():
                end = len(self._buf) - 1
                break
        line = bytes(self._buf[: end + 1])
        del self._buf[: end + 1]
        return line

    def recv(self, limit: int | None = None) -> dict[str, Any] | None:
        """The next JSON object, None at the end of the stream.

        Raises:
            ValueError: what came is not a JSON object.
        """
        line = self.readline(limit)
        if not line.endswith(b"\n"):
            return None
        msg = json.loads(line)
        if not isinstance(msg, dict):
            raise ValueError("not a JSON object")
        return msg

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def take(self) -> bytes:
        """What was read but not consumed (handed over by a splice)."""
        data = bytes(self._buf)
        self._buf.clear()
        return data

    def close(self) -> None:
        self.sock.close()


def _listener_proof(nonce: bytes, address: str) -> bytes:
    return mac(_TAG + nonce + address.encode())


def _dial(address: str) -> _Conn:
    """An authenticated connection to the debug listener at ``address``, both ways.

    Raises:
        OSError: cannot connect.
        Refused: the listener refused us, or did not prove that it holds the job key.
    """
    fd = StreamBeat(address, timeout=HANDSHAKE_TIMEOUT).connect_fd()
    sock = socket.socket(fileno=fd)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        nonce = secrets.token_bytes(_NONCE)
        conn = _Conn(sock)
        try:
            sock.sendall(nonce)
            proof = conn.read_exact(len(_listener_proof(nonce, address)))
        except (EOFError, ConnectionError):  # it closed on a wrong answer
            raise Refused("the debug listener refused the connection") from None
        if not hmac.compare_digest(proof, _listener_proof(nonce, address)):
            raise Refused("the debug listener did not prove that it holds the job key")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return conn


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _copy(src: _Conn, dst: socket.socket) -> None:
    """Forward ``src`` to ``dst`` until either end closes; then end ``dst``'s stream."""
    try:
        data = src.take()
        while True:
            if data:
                dst.sendall(data)
            data = src.sock.recv(_CHUNK)
            if not data:
                break
    except OSError:
        pass
    finally:
        _shut(dst)


# -- the controller's listener -------------------------------------------------------------


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


# -- the worker's side ----------------------------------------------------------------------


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


# -- clients: amesh.debug() and `amesh debug` --------------------------------------------


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
    address = _listener.address if _listener is not None else take_internal(DEBUG_ENV, keep=True)
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
    from ._identity import adopt_key

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
