"""Worker processes on this machine.

A worker is forked from a zygote: one fresh interpreter per controller runtime that
imported everything a worker needs and has never run a thread or an event loop (see
:mod:`amesh._hosts._zygote` for why forking it is safe). The controller itself is
never forked. ``AMESH_ZYGOTE=0`` execs each worker fresh instead (``python -m
amesh._worker``), which is also the fallback when the zygote cannot start or cannot
honour a worker's environment.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import sniffio

from .._bootstrap import Bootstrap, WorkerSpec
from .._debug import debug_env
from .._identity import job_key
from .._limits import TASKS_PER_PROCESS
from .._mesh import ProcessLike, ProcHandle, ProcMesh
from .._runtime import Runtime
from ._home import state_dir
from ._ready import ReadyWaiter

if TYPE_CHECKING:
    from ._zygote import Zygote, ZygoteProcess

__all__ = ["LocalHost", "base_env", "launch_worker", "this_host"]

log = logging.getLogger("amesh.hosts")


class LocalHost:
    """This machine. ``spawn_procs`` gives a :class:`~amesh.ProcMesh` on it."""

    #: its workers' threads count against this user's process limit (see _limits)
    tasks_per_process = TASKS_PER_PROCESS

    def __repr__(self) -> str:
        return "<LocalHost>"

    def spawn_procs(self, per_host: Mapping[str, int] | None = None, **kwargs: Any) -> ProcMesh:
        """A :class:`~amesh.ProcMesh` of processes on this host; enter it to start them."""
        return ProcMesh(per_host, host=self, **kwargs)

    async def start_proc(self, rt: Runtime, spec: WorkerSpec) -> ProcHandle:
        """Start one worker and wait until it listens.

        Raises:
            SupervisionError: it exited, or did not report in time.
        """
        ready = ReadyWaiter(rt)
        child_env = dict(os.environ)
        child_env.update(spec.env)
        child_env.update(debug_env(lambda: state_dir() / "debug"))
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            process, pid = await launch_worker(rt, ready.token, spec, child_env)
        except BaseException:
            ready.cancel()
            raise
        msg = await ready.started(process, pid)
        return ProcHandle(msg.addr, msg.pid, process)


#: what of a host's environment a worker of an environment keeps (the rest, a secret
#: the shell that started the agent exported say, is no business of that environment):
#: who and where it is, its locale, and what machines and schedulers say of
#: themselves (accelerators, SLURM's step), and amesh's own settings
_BASE_ENV = re.compile(
    r"(PATH|HOME|USER|LOGNAME|SHELL|TERM|TMPDIR|TZ|LANG|LANGUAGE|LC_\w+|LD_LIBRARY_PATH"
    r"|CUDA_\w+|NVIDIA_\w+|HIP_VISIBLE_DEVICES|ROCR_VISIBLE_DEVICES|SLURM_\w+|AMESH_\w+)"
)


def base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a worker of an environment starts from, of its host's
    ``environ``: only the variables :data:`_BASE_ENV` names (its own, the file's
    ``env`` and secrets, come on top).

    Args:
        environ: the host's environment (its agent's).

    Returns:
        The variables kept.
    """
    return {k: v for k, v in environ.items() if _BASE_ENV.fullmatch(k)}


async def launch_worker(
    rt: Runtime, token: str, spec: WorkerSpec, child_env: dict[str, str], parent: str = ""
) -> tuple[ProcessLike, int]:
    """Start a worker on this machine as ``spec`` asks (forked by ``rt``'s zygote for
    its interpreter, else exec'd), with environment
    ``child_env``, that reports Ready with ``token`` to
    ``parent`` (``rt`` unless given: a host agent starts workers for a controller
    elsewhere); ``(process, pid)``."""

    # (the zygote is this interpreter, forked; another one, a venv's say, imports
    # what it has: this process's import path is not its own)
    same_python = spec.python in ("", sys.executable)

    def boot(parent_pid: int, pdeathsig: bool) -> Bootstrap:
        return Bootstrap(
            spec=spec,
            parent=parent or rt.address,
            parent_pid=parent_pid,
            token=token,
            sys_path=list(sys.path) if same_python else [],
            pdeathsig=pdeathsig,
            key=job_key(),
        )

    zygote = await _zygote_for(rt, child_env, "" if same_python else spec.python)
    if zygote is not None:
        # The zygote forks from its only thread, which lives as long as it does.
        process = await _fork_worker(zygote, boot(zygote.pid, True), child_env)
        if process is not None:
            return process, process.pid
    # asyncio (and uvloop) fork from the event loop's own thread; trio forks from a
    # cached worker thread that exits when idle, which would fire the signal.
    pdeathsig = (
        sniffio.current_async_library() == "asyncio"
        and threading.current_thread() is threading.main_thread()
    )
    return await _exec_worker(boot(os.getpid(), pdeathsig), child_env)


async def _exec_worker(boot: Bootstrap, child_env: dict[str, str]) -> tuple[ProcessLike, int]:
    """``python -m amesh._worker``, a child of this process (in the interpreter and
    working directory of its spec, else this process's)."""
    spec = boot.spec
    process = await anyio.open_process(
        [spec.python or sys.executable, "-m", "amesh._worker"],
        stdin=subprocess.PIPE,
        stdout=None,
        stderr=None,
        cwd=spec.cwd or None,
        env=child_env,
    )
    # The bootstrap holds the job key: it goes down the stdin pipe (private to the
    # two of us), never into the environment, which others may read in /proc.
    assert process.stdin is not None
    try:
        await process.stdin.send(boot.to_pipe())
    except (anyio.BrokenResourceError, OSError):
        pass  # it died at once; the start-up watch reports how
    return process, process.pid


async def _fork_worker(
    zygote: Zygote, boot: Bootstrap, child_env: dict[str, str]
) -> ZygoteProcess | None:
    """A worker forked by ``zygote``; None when it cannot (exec one instead)."""
    from ._zygote import ZygoteError

    try:
        return await zygote.spawn(child_env, boot.spec.cwd or os.getcwd(), boot)
    except (ZygoteError, OSError) as exc:
        log.warning("starting a worker without the zygote: %s", exc)
        return None


class _ZygoteSlot:
    """One zygote of a runtime: being started, running, or not to be used."""

    def __init__(self) -> None:
        self.zygote: Zygote | None = None
        self.ready = anyio.Event()


#: The zygotes of each runtime, started with its first local worker: one of this
#: interpreter; and one per other interpreter (an environment's venv) and the variables
#: that its workers' start takes (``PYTHONPATH``: the environment's workspace tree).
_ZYGOTES: weakref.WeakKeyDictionary[Runtime, dict[tuple[str, ...], _ZygoteSlot]] = (
    weakref.WeakKeyDictionary()
)


async def _zygote_for(rt: Runtime, child_env: Mapping[str, str], python: str = "") -> Zygote | None:
    """``rt``'s zygote for ``python`` ("": this interpreter) and a worker's environment
    ``child_env``, started on first use; None where the worker must be exec'd."""
    from ._zygote import Zygote, enabled, startup_key

    if not enabled() or rt.closed:
        return None
    slots = _ZYGOTES.setdefault(rt, {})
    # (this interpreter's zygote forks any worker whose start-up variables it has; one
    # of another interpreter is started with its first worker's)
    key = (python, *startup_key(child_env)) if python else ("",)
    while (slot := slots.get(key)) is not None and not slot.ready.is_set():
        await slot.ready.wait()
    if slot is None:
        slot = slots[key] = _ZygoteSlot()
        try:
            # what the runtime owns is stopped at its exit, in reverse: the zygote,
            # owned before the meshes that use it, stops after them.
            env = child_env if python else None
            slot.zygote = await Zygote.start(rt.start_soon, rt.own, python, env)
        except anyio.get_cancelled_exc_class():
            del slots[key]  # let a later start try again
            raise
        except Exception as exc:
            log.warning(
                "no zygote%s; each worker is exec'd instead: %s", python and f" for {python}", exc
            )
        finally:
            slot.ready.set()
    zygote = slot.zygote
    if zygote is None or not zygote.usable or not zygote.fits(child_env):
        return None
    return zygote


async def start_zygote(rt: Runtime) -> None:
    """Start ``rt``'s zygote now rather than with its first worker: a host agent's
    first mesh then does not wait for it (0.23-0.28 s on the 2-CPU VM of bench/)."""
    zygote = await _zygote_for(rt, os.environ)
    if zygote is not None:
        log.info("zygote %d ready", zygote.pid)


_THIS_HOST = LocalHost()


def this_host() -> LocalHost:
    """The local machine."""
    return _THIS_HOST
