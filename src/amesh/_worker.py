"""Entry point of a worker process: ``python -m amesh._worker``.

The worker dies with its parent: the kernel sends it SIGKILL when the parent exits
(PR_SET_PDEATHSIG), and a thread exits the process when the parent's end of its
stdin pipe closes (which also covers platforms without prctl).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

import anyio
import msgspec
import pynng

from . import _wire
from ._actor import handlers_of
from ._hosts._local import Bootstrap
from ._proc_agent import AGENT_KEY, ProcAgent
from ._runtime._mailbox import ActorInstance
from ._runtime._runtime import open_runtime
from ._transport import NngTransport

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
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
    frame = _wire.encode(_wire.Heartbeat(addr, os.getpid()))
    with pynng.Push0(dial=boot.parent, send_buffer_size=4, send_timeout=1000) as sock:
        while not stop.wait(boot.heartbeat_period):
            try:
                sock.send(frame, block=False)
            except pynng.TryAgain:
                pass  # the parent is slow; a later beat will do


async def _serve(boot: Bootstrap) -> None:
    shutdown = anyio.Event()
    async with open_runtime(lambda: NngTransport(boot.scheme, host=boot.host)) as rt:
        agent = ProcAgent(shutdown)
        rt.add_actor(
            ActorInstance(rt, AGENT_KEY, AGENT_KEY, agent, handlers_of(ProcAgent), boot.parent, 0)
        )
        await rt.send_frame(boot.parent, _wire.Ready(boot.token, rt.address, rt.pid))
        stop = threading.Event()
        beats = threading.Thread(
            target=_send_heartbeats,
            args=(boot, rt.address, stop),
            name="amesh-heartbeat",
            daemon=True,
        )
        beats.start()
        try:
            await shutdown.wait()
        finally:
            stop.set()


def main() -> None:
    boot = msgspec.json.decode(os.environ.pop("AMESH_BOOTSTRAP"), type=Bootstrap)
    # A terminal's Ctrl-C reaches the whole process group; the controller decides
    # what it means and stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(boot.parent_pid)
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
