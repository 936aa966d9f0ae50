"""The debugger's connections, both ends: dialling a debug listener, proving the job
key both ways, and splicing two sockets (see :mod:`amesh._debug`)."""

from __future__ import annotations

import hmac
import json
import secrets
import socket
from typing import Any

from .._transport import (
    HANDSHAKE_TIMEOUT,
    Refused,
    StreamBeat,
    mac,
)

#: The environment variable that tells a worker where its breakpoints go.
DEBUG_ENV = "AMESH_DEBUG_LISTENER"
#: set (by a host agent) when the listener is not the controller's
RELAYED_ENV = "AMESH_DEBUG_RELAYED"
_TAG = b"amesh debug listener v1\0"
_NONCE = 32
_CHUNK = 65536
#: The longest JSON line a listener takes before a session is attached.
_MAX_LINE = 65536


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
