"""Entry point of a worker process: ``python -m amesh._worker``, or :func:`main` in a
child of the zygote (:mod:`amesh._hosts._zygote`), which runs it after its fork.

The worker dies with its parent: the kernel sends it SIGKILL when the parent exits
(PR_SET_PDEATHSIG), and a thread exits the process when the write end of its stdin
pipe closes (which also covers platforms without prctl). An exec'd worker's parent is
the controller, which holds that end. A forked worker's parent is the zygote, and its
stdin is the zygote's lifeline pipe, whose write end only the controller holds: it
dies with the zygote, and with the controller even if the zygote is gone.

The worker learns what it needs (:class:`~amesh._bootstrap.Bootstrap`, with the job
key) over a private channel: an exec'd worker reads it from the start of its stdin
pipe, before it watches that pipe; a forked one gets it from the zygote's request. It
adopts the key before it opens its transport, and proves itself with it to every peer
it connects to (see :mod:`amesh._transport._auth`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import anyio

from . import _wire
from ._actor import handlers_of
from ._bootstrap import Bootstrap, read_bootstrap
from ._proc_agent import AGENT_KEY, ProcAgent
from ._runtime._context import call_context
from ._runtime._mailbox import ActorInstance
from ._runtime._runtime import Runtime, open_runtime
from ._transport import Transport, heartbeat_sender, open_transport
from ._transport._auth import adopt_key

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int, pdeathsig: bool) -> None:
    # The kernel's parent-death signal fires when the *thread* that forked us exits,
    # not the process: only safe when the parent forked from a thread that lives as
    # long as it does (its event loop's thread, under asyncio). trio forks from a
    # cached worker thread that exits when idle, so there only the pipe watch is used.
    if pdeathsig and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before we could watch it
        os._exit(1)

    def watch_stdin() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch_stdin, name="amesh-parent-watch", daemon=True).start()


def _send_heartbeats(boot: Bootstrap, addr: str, stop: threading.Event) -> None:
    """Tell the parent we are alive, from a thread: a busy event loop is not dead."""
    frame = _wire.join(_wire.encode(_wire.Heartbeat(addr, os.getpid())))
    sender = heartbeat_sender(boot.parent, own=addr)
    try:
        while not stop.wait(boot.heartbeat_period):
            sender.send(frame)  # False: the parent is slow or away; a later beat will do
    finally:
        sender.close()


async def serve(
    transport_factory: Callable[[], Transport],
    parent: str,
    token: str,
    heartbeats: Callable[[Runtime], AbstractContextManager[Any]],
) -> None:
    """Run a worker runtime until its owner asks it to exit.

    Args:
        transport_factory: makes the worker's transport.
        parent: the owner's address (gets Ready, heartbeats and failure reports).
        token: echoed in Ready so the owner can match this worker.
        heartbeats: a context manager that sends heartbeats while it is entered.
    """
    call_context.set(None)  # a worker starts outside any actor's call
    shutdown = anyio.Event()
    async with open_runtime(transport_factory) as rt:
        rt.peers.parent = parent  # hears of deaths this process's supervisor sees
        agent = ProcAgent(shutdown)
        rt.add_actor(
            ActorInstance(rt, AGENT_KEY, AGENT_KEY, agent, handlers_of(ProcAgent), parent, 0)
        )
        await rt.send_frame(parent, _wire.Ready(token, rt.address, rt.pid))
        with heartbeats(rt):
            await shutdown.wait()


@contextmanager
def _thread_heartbeats(boot: Bootstrap, rt: Runtime) -> Iterator[None]:
    stop = threading.Event()
    beats = threading.Thread(
        target=_send_heartbeats,
        args=(boot, rt.address, stop),
        name="amesh-heartbeat",
        daemon=True,
    )
    beats.start()
    try:
        yield
    finally:
        stop.set()


async def _serve(boot: Bootstrap) -> None:
    await serve(
        lambda: open_transport(boot.scheme, host=boot.host, reach=boot.parent),
        boot.parent,
        boot.token,
        lambda rt: _thread_heartbeats(boot, rt),
    )


def main(boot: Bootstrap | None = None) -> None:
    """Run the worker: with ``boot`` from the zygote, else read from stdin (exec'd)."""
    if boot is None:
        try:
            boot = read_bootstrap(0)
        except (EOFError, ValueError, OSError) as exc:
            print(f"amesh worker: no bootstrap on stdin: {exc}", file=sys.stderr)
            os._exit(1)
    adopt_key(boot.key)
    # A terminal's Ctrl-C reaches the whole process group; the controller decides
    # what it means and stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(boot.parent_pid, boot.pdeathsig)
    sys.path[:] = boot.sys_path
    logging.basicConfig(
        level=os.environ.get("AMESH_LOG_LEVEL", "WARNING"),
        format=f"[pid {os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    anyio.run(_serve, boot, backend="asyncio", backend_options=options)


if __name__ == "__main__":
    main()
