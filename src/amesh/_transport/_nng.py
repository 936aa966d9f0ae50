"""The heartbeat sender for an NNG address: a Push0 socket of pynng's (the transport
itself is :class:`~._ext.ExtTransport`)."""

from __future__ import annotations

from functools import partial

import pynng

from ._auth import hello
from ._nng_pipes import tls_dialer_config
from ._tags import dial_part

__all__ = ["NngBeat"]


class NngBeat:
    """A Push0 socket that drops a frame rather than wait. It says hello first (see
    :mod:`._nng_pipes`); when its pipe goes, the next send starts a new socket, as a
    pipe that NNG redials on its own would be refused for want of a hello.

    Args:
        addr: the NNG address to send to.
        own: the sender's own listening address, which it proves it speaks for.
    """

    def __init__(self, addr: str, own: str = "") -> None:
        self._addr = addr
        self._own = own
        self._broken = False
        self._sock: pynng.Push0 | None = None
        self._sock = self._open()

    def _open(self) -> pynng.Push0:
        sock = pynng.Push0(
            send_buffer_size=4, send_timeout=1000, tls_config=tls_dialer_config(self._addr)
        )
        try:
            sock.add_post_pipe_remove_cb(partial(self._on_pipe_gone, sock))
            sock.send(hello(self._addr, self._own), block=False)
            sock.dial(dial_part(self._addr), block=False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _on_pipe_gone(self, sock: pynng.Push0, pipe: pynng.Pipe) -> None:
        if sock is self._sock:  # on an NNG thread: the sending thread acts on it
            self._broken = True

    @property
    def stale(self) -> bool:
        """Whether the next frame needs a new socket: there is none, or its pipe went."""
        return self._broken or self._sock is None

    def _current(self) -> pynng.Push0:
        if self._broken or self._sock is None:
            self._broken = False
            if self._sock is not None:
                self._sock.close()
            self._sock = None
            self._sock = self._open()
        return self._sock

    def socket_id(self) -> int:
        """The NNG id of the socket to send on, a new one if :attr:`stale` (for a
        sender outside Python, such as :class:`amesh._native._ext.Beat`: close that sender
        before calling this again, since it closes the socket it replaces)."""
        return int(self._current().socket.id)

    def send(self, frame: bytes) -> bool:
        try:
            self._current().send(frame, block=False)
        except pynng.TryAgain:
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
