"""NNG sockets that know who is at the other end: the inbox that admits a pipe only
once it has proven itself, and the link that proves itself and tells when it broke.

The NNG transport's (:mod:`._ext`) and its heartbeat sender's. NNG connects, reconnects and
frames on its own threads and has no handshake of ours, so (see :mod:`._auth`):

- A link's first message is a hello, sent before it dials: the first message of its
  first pipe. A link lives for one pipe: when that pipe goes (the peer closed, or
  refused the hello), or no pipe came within :data:`~._base.FIRST_CONNECT_WINDOW`, the
  loss is reported on the event loop and the link is dropped (a link that never
  connects is noticed by the sweeps that run while the transport serves). Should NNG
  redial before that, the new pipe has no hello and the listener refuses it.
- The inbox keeps the ids of proven pipes. A message from any other pipe must be a
  valid hello: else it is dropped unread, the pipe is closed and counted. A pipe of
  another uid (ipc and abstract sockets) is closed before it starts, and one that has
  not said hello within :data:`~._auth.HANDSHAKE_TIMEOUT` is closed by :meth:`Inbox.sweep`.
- ``tls+tcp`` (see :mod:`._tls`): the listener takes only TLS peers with a certificate
  of the job, and a link takes only a listener with one; the hello then runs inside the
  TLS session. NNG drops a failed handshake before it becomes a pipe, and tells no
  one: the inbox counts those that NNG's listener statistics tell apart (see
  :func:`._tls.handshake_failures`).

Pipe events arrive on NNG's threads (pynng takes the GIL for them): they only add to
and remove from containers, whose single operations the GIL makes atomic, or hand a
call over to the event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import pynng
import sniffio
from pynng import _nng as _pynng_cffi

from ._auth import HANDSHAKE_TIMEOUT, HelloCheck, Refusals, Refused, hello
from ._base import FIRST_CONNECT_WINDOW
from ._guard import Guard, Limits
from ._paths import ensure_ipc_dir
from ._tags import dial_part, listening_address

__all__ = ["Inbox", "NngLink", "fresh_address", "notify_closing", "poster", "tls_dialer_config"]

log = logging.getLogger("amesh.transport")

_SEND_BUFFER = 1024
#: Proven pipes that are gone are forgotten this many removals later: by then nothing
#: they sent can still wait to be received.
_GONE_KEPT = 1024
_PEER_UID = b"ipc:peer-uid"
_PEER_PID = b"ipc:peer-pid"
#: How often serving looks at NNG's count of failed TLS handshakes (statistics() looks
#: every time).
_TLS_POLL = 2.0

Post = Callable[[Callable[[], None]], None]


def _close_at_exit() -> None:
    """At exit, instead of pynng's ``nng_fini()``: close every NNG socket still open
    (what ``nng_fini`` does first) and leave the rest of NNG to the kernel.

    ``nng_fini`` then tears NNG's subsystems down while its threads may still finish
    closing a connection, and NNG 1.11 aborts the process when one does so late: a TLS
    connection that a task queue closes after the reap list was drained is reaped after
    the aio subsystem is gone ("panic: pthread_mutex_lock: Invalid argument", from
    ``tls_reap``; an exit in a few hundred with TLS links did so here). A process that
    exits needs no teardown: its sockets are closed, so no pipe event calls back into
    Python while it finalizes, and the kernel ends NNG's idle threads.
    """
    for obj in gc.get_objects():
        if issubclass(type(obj), pynng.Socket):  # (isinstance would ask proxies' __class__)
            try:
                obj.close()
            except Exception:  # already closed, or a socket NNG has no more
                pass


_pynng_fini = getattr(getattr(pynng, "nng", None), "_pynng_atexit", None)
if _pynng_fini is not None:  # (a pynng without it leaves nothing to replace)
    atexit.unregister(_pynng_fini)
    atexit.register(_close_at_exit)


def notify_closing(fd: int) -> None:
    """Wake tasks waiting on ``fd`` (ClosedResourceError) before NNG closes it."""
    try:
        anyio.notify_closing(fd)
    except RuntimeError:  # no event loop in this thread: nobody here waits on it
        pass


def fresh_address(scheme: str, host: str, port: int = 0) -> str:
    """A new NNG address of ``scheme`` that nobody listens on (tcp: ``port``, 0: any)."""
    name = f"amesh-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if scheme == "abstract":
        return f"abstract://{name}"
    if scheme == "ipc":
        base = ensure_ipc_dir()
        return f"ipc://{os.path.join(base, name)}.sock"
    if scheme in ("tcp", "tls+tcp"):
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{scheme}://{host}:{port}"
    raise ValueError(f"unknown transport scheme {scheme!r} (abstract, ipc, tcp, tls+tcp, auto)")


def tls_dialer_config(addr: str) -> Any:
    """The TLS configuration of a dialer to ``addr``: None unless it is ``tls+tcp``."""
    if not addr.startswith("tls+tcp://"):
        return None
    from . import _tls

    return _tls.client_config()


def poster() -> Post | None:
    """How an NNG thread hands a call to the event loop of the caller (None outside
    any event loop)."""
    try:
        backend = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        backend = "asyncio"  # a loop callback (a deliver, say) runs outside any task
    if backend == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def post_trio(fn: Callable[[], None]) -> None:
            try:
                token.run_sync_soon(fn)
            except trio.RunFinishedError:
                pass

        return post_trio
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None

    def post_asyncio(fn: Callable[[], None]) -> None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is closed
            pass

    return post_asyncio


def _pipe_int(pipe: pynng.Pipe, option: bytes) -> int | None:
    value = _pynng_cffi.ffi.new("uint64_t *")
    if _pynng_cffi.lib.nng_pipe_get_uint64(pipe.pipe, option, value) != 0:
        return None  # not a unix socket (tcp), or the pipe is gone
    return int(value[0])


def _describe(pipe: pynng.Pipe) -> str:
    pid = _pipe_int(pipe, _PEER_PID)
    if pid is not None:
        return f"pid {pid} (uid {_pipe_int(pipe, _PEER_UID)}) on pipe {pipe.id}"
    try:
        return f"{pipe.remote_address} on pipe {pipe.id}"
    except pynng.NNGException:
        return f"pipe {pipe.id}"


def _close_pipe(pipe: pynng.Pipe) -> None:
    try:
        pipe.close()
    except pynng.NNGException:
        pass  # already gone


class Inbox:
    """The Pull0 socket a transport receives on, listening on a fresh address, and
    the proof each of its pipes gave (see the module's docstring).

    Args:
        scheme: ``abstract``, ``ipc``, ``tcp``, ``tls+tcp`` or ``auto`` (abstract on
            Linux, else ipc).
        host: the address to listen on for tcp and tls+tcp.
        max_frame: the largest frame NNG accepts.
        recv_buffer: NNG's receive buffer, in messages.
        port: the tcp port (0: one the kernel picks, and the address gets a fresh tag:
            see :mod:`._tags`).
        tag: the tag of the address (a port given with the tag it was reserved under).
    """

    def __init__(
        self,
        scheme: str,
        host: str,
        max_frame: int,
        recv_buffer: int,
        port: int = 0,
        tag: str = "",
        guard: Limits | None = None,
    ) -> None:
        if scheme == "auto":
            scheme = "abstract" if sys.platform == "linux" else "ipc"
        #: ids of the pipes that said a good hello
        #: proven pipes: id -> the address the dialer proved it speaks for
        self.proven: dict[int, str] = {}
        #: pipes that have not: id -> (pipe, when it must have)
        self._unproven: dict[int, tuple[pynng.Pipe, float]] = {}
        #: proven pipes that are gone, oldest first
        self._gone: deque[int] = deque()
        #: refusals seen on NNG's threads, for the event loop to count: (who, why)
        self._early: deque[tuple[str, str]] = deque()
        #: tls+tcp: NNG's count of connections that failed their handshake, as last seen
        self._tls_failed = 0
        self._tls_polled = 0.0
        tls = None
        if scheme == "tls+tcp":
            from . import _tls

            tls = _tls.server_config()  # raises for bad AMESH_TLS_* settings
        self.sock = pynng.Pull0(
            recv_max_size=max_frame, recv_buffer_size=recv_buffer, tls_config=tls
        )
        try:
            self.sock.add_pre_pipe_connect_cb(self._on_pipe)
            self.sock.add_post_pipe_remove_cb(self._on_pipe_gone)
            listener = self.sock.listen(fresh_address(scheme, host, port))
        except BaseException:
            self.sock.close()
            raise
        self._listener = listener if tls is not None else None
        addr: str = listener.url
        if scheme in ("tcp", "tls+tcp") and addr.endswith(":0"):
            # pynng's InAddr.port is in network byte order; its str() is right.
            bound = str(listener.local_address).rsplit(":", 1)[1]
            addr = addr.rsplit(":", 1)[0] + f":{bound}"
        if scheme in ("tcp", "tls+tcp"):
            addr = listening_address(addr, port, tag)
        #: watches the connections that have not proven themselves (see ._guard)
        self._guard: Guard | None = None
        if guard is not None and scheme in ("tcp", "tls+tcp"):
            self._guard = Guard(int(str(listener.local_address).rsplit(":", 1)[1]), guard)
        self.address = addr
        self.refusals = Refusals(addr)
        self._check = HelloCheck(addr)
        self._ipc_path = addr[len("ipc://") :] if scheme == "ipc" else None

    # NNG's threads ------------------------------------------------------------------

    def _on_pipe(self, pipe: pynng.Pipe) -> None:
        """A new pipe, before it starts (so before any of its messages)."""
        uid = _pipe_int(pipe, _PEER_UID)
        if uid is not None and uid != os.getuid():
            self._early.append((_describe(pipe), f"uid {uid} is not this job's uid"))
            pipe.close()
            return
        self._unproven[pipe.id] = (pipe, time.monotonic() + HANDSHAKE_TIMEOUT)

    def _on_pipe_gone(self, pipe: pynng.Pipe) -> None:
        self._unproven.pop(pipe.id, None)
        if self._guard is not None:
            self._guard.gone(pipe.id)
        if pipe.id in self.proven:
            self._gone.append(pipe.id)
            while len(self._gone) > _GONE_KEPT:
                self.proven.pop(self._gone.popleft(), None)

    # the event loop -------------------------------------------------------------------

    def admit(self, pipe: int, msg: Any) -> None:
        """A message from a pipe that is not proven: its hello, or a refusal. What a
        refused pipe sent after it is dropped unread (and not counted again)."""
        entry = self._unproven.pop(pipe, None)
        if entry is None:
            return  # refused already (every pipe is listed before its first message)
        try:
            peer = self._check.check(msg)
        except Refused as exc:
            self.refusals.refuse(_describe(entry[0]), str(exc))
            _close_pipe(entry[0])
            return
        self.proven[pipe] = peer
        if self._guard is not None:
            try:
                self._guard.proven(pipe, str(entry[0].remote_address))
            except pynng.NNGException:  # gone meanwhile
                pass

    def sweep(self) -> None:
        """Close the pipes that were too slow to say hello, and the connections the
        guard finds past its limits (and log the refusals seen on NNG's threads)."""
        self._count_early()
        if self._guard is not None:
            self._guard.sweep()
        now = time.monotonic()
        if self._listener is not None and now >= self._tls_polled + _TLS_POLL:
            self._count_tls()
        for pid, (pipe, deadline) in list(self._unproven.items()):
            if now >= deadline and self._unproven.pop(pid, None) is not None:
                if pid not in self.proven:
                    self.refusals.refuse(
                        _describe(pipe), f"no hello within {HANDSHAKE_TIMEOUT:g} s"
                    )
                    _close_pipe(pipe)

    def refused(self) -> int:
        """How many peers were refused so far."""
        self._count_early()
        if self._listener is not None:
            self._count_tls()
        return self.refusals.count

    def _count_early(self) -> None:
        while self._early:
            who, why = self._early.popleft()
            self.refusals.refuse(who, why)

    def _count_tls(self) -> None:
        """Count (and log) the connections that failed their TLS handshake since the
        last look: NNG closes them before they are pipes, so nobody else sees them."""
        from . import _tls

        self._tls_polled = time.monotonic()
        assert self._listener is not None
        failed = _tls.handshake_failures(self._listener.listener, listener=True)
        new, self._tls_failed = failed - self._tls_failed, failed
        if new > 0:
            self.refusals.count += new - 1
            self.refusals.refuse(
                f"{new} peers" if new > 1 else "a peer",
                "the TLS handshake failed (no TLS, or no certificate of this job)",
            )

    def close(self) -> None:
        """Close the socket and remove its socket file (ipc)."""
        self._listener = None
        self.sock.close()
        self._unproven.clear()
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass


class NngLink:
    """The Push0 socket towards one peer, for one pipe: it says hello first, and
    reports (``on_lost``, on the event loop) when that pipe goes or never comes.

    Args:
        addr: the peer's address.
        own: this transport's address, which the hello proves it speaks for.
        on_lost: called with the link and why, once.
    """

    __slots__ = (
        "_fd",
        "_on_lost",
        "_post",
        "_tls",
        "addr",
        "busy",
        "connected",
        "deadline",
        "id",
        "lock",
        "sock",
    )

    def __init__(self, addr: str, own: str, on_lost: Callable[[NngLink, str], None]) -> None:
        self.addr = addr
        self._on_lost = on_lost
        self._post = poster()
        self.connected = False
        #: when a link that never connected is given up
        self.deadline = time.monotonic() + FIRST_CONNECT_WINDOW
        self.lock: anyio.Lock | None = None
        #: a large frame is being copied into NNG off the event loop: later frames wait
        self.busy = False
        self._fd = -1
        self._tls = tls_dialer_config(addr)
        sock = pynng.Push0(
            send_buffer_size=_SEND_BUFFER,
            reconnect_time_min=10,
            reconnect_time_max=200,
            tls_config=self._tls,
        )
        try:
            sock.add_post_pipe_connect_cb(self._on_pipe)
            sock.add_post_pipe_remove_cb(self._on_pipe_gone)
            sock.send(hello(addr, own), block=False)  # queued: the first of the first pipe
            sock.dial(dial_part(addr), block=False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.id: int = sock.socket.id

    def _on_pipe(self, pipe: pynng.Pipe) -> None:
        self.connected = True

    def _on_pipe_gone(self, pipe: pynng.Pipe) -> None:
        if self._post is not None:
            self._post(partial(self._on_lost, self, "the connection was lost"))

    def overdue(self, now: float) -> bool:
        """Whether it never connected within its window."""
        return not self.connected and now >= self.deadline

    def never_connected(self) -> str:
        """Why an :meth:`overdue` link is given up, as far as NNG tells."""
        if self._tls is not None:
            from . import _tls

            dialers = self.sock.dialers
            if dialers and _tls.handshake_failures(dialers[0].dialer, listener=False):
                return (
                    "cannot connect (the TLS handshake failed: the listener has no "
                    "certificate of this job, or refused ours)"
                )
        return "cannot connect (nobody listens there)"

    def send_fd(self) -> int:
        if self._fd < 0:
            self._fd = self.sock.send_fd
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            notify_closing(self._fd)
        self.sock.close()
