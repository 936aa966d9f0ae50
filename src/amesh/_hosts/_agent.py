"""Host agents: one process per machine that starts workers for controllers elsewhere.

``amesh agent --listen tcp://ADDR:PORT --key-file PATH`` runs :func:`serve_agent`. The
agent is an amesh runtime listening on that address (as ``tls+tcp://ADDR:PORT``: TLS to
other hosts, streams within this one; ``stream+tcp://`` asks for plain streams), with
one actor, :class:`HostAgent`, under the well-known key :data:`AGENT_ACTOR`. Its
listener admits only peers that prove they hold the key in ``PATH`` (the job key, see
:mod:`amesh._transport._auth`), as every amesh listener does: a controller that holds
the key is one of the job.

A controller asks the agent to start a worker (:meth:`HostAgent.start_proc`). The
worker comes from the agent's zygote (else it is exec'd), is a child of the agent, and
reports Ready and heartbeats straight to the controller, which supervises it as it
does a local worker; the agent tells the controller how each worker exited
(:meth:`HostAgent.wait_exit`, answered the moment the agent reaps it) and kills one on
request.

Workers never outlive their controller: a controller that attached keeps a lease on
each agent, a heartbeat every half second sent by a thread of the C extension (so a
controller whose event loop is busy or stopped in a debugger keeps it). An agent that
hears no lease from a controller for ``grace`` seconds (the controller died, or the
network between them is cut) kills that controller's workers. Workers also die with
the agent (parent-death signal, and the pipe watch of :mod:`amesh._worker`). On SIGTERM
or SIGINT the agent stops every worker and exits 0.

``breakpoint()`` in a worker started here pauses it at the agent's own debug listener
(see :mod:`amesh._debug`, started with the first worker): ``amesh debug`` on this
machine attaches to it, and so does ``amesh.debug()`` at a controller that attached
to this agent, through :meth:`HostAgent.debug_sessions` and the ``debug_*`` endpoints
that relay a session.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from .. import _limits, _wire
from .._bootstrap import WorkerSpec
from .._config import settings
from .._debug import current_listener, debug_env
from .._identity import adopt_key, read_key_file
from .._limits import TASKS_PER_PROCESS, raise_open_files, raise_processes
from .._mesh import ProcessLike, pid_alive
from .._model import Actor, endpoint, handlers_of
from .._runtime import (
    ActorInstance,
    Runtime,
    call_context,
    current_runtime,
    open_runtime,
    read_logs,
    stacks_by_signal,
)
from .._transport import HostStreams, HybridTransport, Limits, Transport, default_impl, open_tls
from ._home import hold_agent_lock, state_dir
from ._local import base_env, launch_worker, start_zygote
from ._provision import DepotEndpoints

__all__ = ["AGENT_ACTOR", "DEFAULT_GRACE", "HostAgent", "parse_listen", "serve_agent"]

log = logging.getLogger("amesh.agent")

#: The routing key of the agent's actor, the same on every agent.
AGENT_ACTOR = "amesh-host-agent"
#: Seconds a controller's link may stay broken before its workers are stopped.
DEFAULT_GRACE = 5.0


@dataclass
class _Child:
    """A worker this agent started."""

    process: ProcessLike
    owner: str
    #: the persistent mesh it belongs to ("": none; it dies with its controller)
    mesh: str = ""
    #: its log file (a persistent mesh's worker; see amesh._runtime._logfile)
    log: str = ""
    exited: anyio.Event = field(default_factory=anyio.Event)


def _worker_tasks() -> int:
    """Threads a worker started here runs: a local worker's, and NNG's pool (12 on 2
    CPUs), which it starts to reach other hosts as this agent does: counted in this
    process, where the same library runs it."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return TASKS_PER_PROCESS
    nng = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                nng += f.read().startswith("nng:")
        except OSError:  # (ended meanwhile)
            continue
    return TASKS_PER_PROCESS + nng


class HostAgent(DepotEndpoints, Actor):
    """The actor of a host agent: starts, reports and stops workers for controllers,
    and keeps what their environments need (see :mod:`._provision`).

    Args:
        host: the address workers listen on (the one controllers reach this host at).
        grace: see :data:`DEFAULT_GRACE`.
    """

    def __init__(self, host: str, grace: float = DEFAULT_GRACE) -> None:
        self.host = host
        self.grace = grace
        self.children: dict[int, _Child] = {}
        #: persistent meshes with workers here: name -> what their controller recorded
        #: (see :meth:`hold`)
        self.meshes: dict[str, dict[str, Any]] = {}
        #: controllers with workers here, whose leases are watched
        self._watched: set[str] = set()
        self._expiring = False
        #: set whenever a worker exits or a lease expires (the idle watch waits on it)
        self.changed = anyio.Event()
        #: debug sessions relayed to controllers: handle -> our end of the session
        self._debugging: dict[int, socket.socket] = {}
        self._handles = itertools.count(1)
        #: the log files of persistent meshes' workers (made with the first one)
        self._logs: Path | None = None

    @endpoint(concurrent=True)
    def info(self) -> dict[str, Any]:
        """This host: its name, the agent's address and pid, CPUs, workers running, and
        the grace it gives a controller's lease (which sets how often leases come).

        The caller is a controller that attaches: its leases are heard from now on, so
        that an agent that exits when idle waits for its first worker."""
        ctx = call_context.get()
        if ctx is not None and ctx.sender:
            self._watch(current_runtime(), ctx.sender)
        return {
            "hostname": socket.gethostname(),
            "addr": current_runtime().address,
            "host": self.host,
            "pid": os.getpid(),
            "cpus": os.cpu_count() or 1,
            "workers": sorted(pid for pid, c in self.children.items() if not c.exited.is_set()),
            "auth_refused": current_runtime().statistics().auth_refused,
            "grace": self.grace,
        }

    @endpoint(concurrent=True)
    def make_room(self, processes: int) -> str | None:
        """Whether this machine lets the agent's user run the threads of ``processes``
        more workers (raising its soft process limit if it must), asked before a mesh
        starts any: None if it does, else why not (a control group's ``pids.max``, the
        hard process limit or the kernel's, and what to raise)."""
        try:
            _limits.make_room(0, processes * _worker_tasks())
        except OSError as exc:
            return exc.strerror
        return None

    @endpoint(concurrent=True)
    async def start_proc(self, token: str, spec: WorkerSpec, persistent: str = "") -> int:
        """Start a worker as ``spec`` asks (listening as this agent decides) that
        reports Ready with ``token`` to the caller; its pid.

        With ``persistent`` (a mesh's name) the worker outlives the caller: it is not
        stopped when the caller's lease ends, but by :meth:`stop_mesh` (or ``kill``).
        """
        ctx = call_context.get()
        assert ctx is not None
        owner = ctx.sender
        rt = current_runtime()
        # a worker of an environment (its venv's Python) gets what it needs of ours,
        # a plain one all of it (as on the controller's machine)
        child_env = base_env(os.environ) if spec.python else dict(os.environ)
        child_env.update(spec.env)
        child_env.update(debug_env(lambda: state_dir() / "debug", relayed=True))
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        log_file = str(self._logs_dir() / f"{token}.log") if persistent else ""
        # the worker listens the way its controller does: TLS between hosts (and
        # streams within this one), or plain tcp streams
        scheme = "tls+tcp" if owner.startswith("tls+tcp://") else "stream+tcp"
        spec = msgspec.structs.replace(spec, scheme=scheme, host=self.host, output_file=log_file)
        process, pid = await launch_worker(rt, token, spec, child_env, parent=owner)
        child = self.children[pid] = _Child(process, owner, persistent, log_file)
        rt.start_soon(self._reap, pid, child)
        self._watch(rt, owner)
        log.info(
            "started worker %d for %s%s",
            pid,
            owner,
            f" (persistent mesh {persistent!r})" if persistent else "",
        )
        return pid

    @endpoint(concurrent=True)
    async def wait_exit(self, pid: int) -> int:
        """The exit status of worker ``pid`` once it has exited (negative: killed by
        that signal), as soon as the agent reaps it."""
        child = self.children.get(pid)
        if child is None:
            raise LookupError(f"no worker {pid} was started by this agent")
        await child.exited.wait()
        rc = child.process.returncode
        assert rc is not None
        return rc

    @endpoint(concurrent=True)
    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``pid`` (nothing if it is gone). A persistent mesh's
        worker takes it from the controller that holds the mesh now, only: one that it
        was taken from (see ``attach_mesh(takeover=True)``) and did not hear of it
        would kill it for the silence of heartbeats that now go elsewhere."""
        child = self.children.get(pid)
        if child is None or child.process.returncode is not None:
            return
        ctx = call_context.get()
        holder = self.meshes.get(child.mesh, {}).get("controller") if child.mesh else None
        if holder and ctx is not None and ctx.sender != holder:
            log.warning(
                "refused to kill worker %d of persistent mesh %r for %s: %s holds it now",
                pid,
                child.mesh,
                ctx.sender,
                holder,
            )
            return
        if sig == signal.SIGTERM:
            child.process.terminate()
        else:
            child.process.kill()

    def _logs_dir(self) -> Path:
        if self._logs is None:
            self._logs = _make_logs_dir()
        return self._logs

    @endpoint(concurrent=True)
    async def logs(
        self,
        name: str,
        n: int = 100,
        rank: int | None = None,
        cursor: dict[str, list[int]] | None = None,
    ) -> tuple[list[tuple[float, str]], dict[str, list[int]]]:
        """The output of persistent mesh ``name``'s workers here, from their log files
        (of rank ``rank`` only, when given): ``(time, line)`` in time order, the last
        ``n``, or those written since ``cursor`` (from the answer before); and the
        cursor after them. See :func:`amesh._runtime.read_logs`."""
        if name not in self.meshes:
            raise LookupError(f"no persistent mesh named {name!r} here")
        paths = [c.log for c in self.children.values() if c.mesh == name and c.log]
        return await anyio.to_thread.run_sync(read_logs, paths, n, rank, cursor)

    def _remove_logs(self, name: str) -> None:
        """Remove the log files of persistent mesh ``name``'s workers (it stopped)."""
        for child in self.children.values():
            if child.mesh == name and child.log:
                for path in (child.log, child.log + ".1"):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                child.log = ""

    def remove_all_logs(self) -> None:
        """Remove this agent's log directory (it is exiting)."""
        if self._logs is not None:
            shutil.rmtree(self._logs, ignore_errors=True)
            self._logs = None

    @endpoint(concurrent=True)
    async def stacks(self, pid: int, full: bool = False) -> str:
        """The stacks of worker ``pid``, whose event loop did not answer, taken by a
        signal (see :mod:`amesh._runtime._stackdump`)."""
        if pid not in self.children:
            raise LookupError(f"no worker {pid} was started by this agent")
        return await stacks_by_signal(pid, full)

    async def _reap(self, pid: int, child: _Child) -> None:
        try:
            await child.process.wait()
        finally:
            child.exited.set()
            self._changed()
            log.info("worker %d exited (%s)", pid, child.process.returncode)
            # what it sent through shared memory that nobody took (it was killed)
            _wire.remove_segments_of(pid)
            await child.process.aclose()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def idle(self) -> bool:
        """No worker runs here and no controller holds a lease."""
        return not self._watched and all(c.exited.is_set() for c in self.children.values())

    # -- ranks paused in breakpoint() --------------------------------------------------

    @endpoint(concurrent=True)
    def debug_sessions(self) -> list[dict[str, Any]]:
        """The ranks paused here that nobody attached to: ``id``, ``title`` (``w[1] at
        train.py:42``), and where (``pid``, ``host``, ``file``, ``line``, ...)."""
        listener = current_listener()
        return [p.describe() for p in listener.sessions()] if listener is not None else []

    @endpoint(concurrent=True)
    def debug_open(self, ident: int) -> int | None:
        """Attach the caller to paused session ``ident``: a handle for the other
        ``debug_*`` endpoints; None when it is no longer paused, or taken."""
        listener = current_listener()
        sock = listener.open(ident) if listener is not None else None
        if sock is None:
            return None
        handle = next(self._handles)
        self._debugging[handle] = sock
        return handle

    @endpoint(concurrent=True)
    async def debug_read(self, handle: int, timeout: float) -> bytes | None:
        """What session ``handle`` sent within ``timeout`` seconds (pdb's JSON lines):
        None when nothing, ``b""`` once it ended."""
        sock = self._debugging.get(handle)
        if sock is None:
            return b""
        return await anyio.to_thread.run_sync(_read_some, sock, timeout, abandon_on_cancel=True)

    @endpoint(concurrent=True)
    async def debug_write(self, handle: int, data: bytes) -> None:
        """Send ``data`` (the user's lines) to session ``handle``."""
        sock = self._debugging.get(handle)
        if sock is not None:
            with contextlib.suppress(OSError):  # it ended: the reader sees that
                await anyio.to_thread.run_sync(sock.sendall, data)

    @endpoint(concurrent=True)
    def debug_close(self, handle: int) -> None:
        """Detach from session ``handle`` (the rank goes on)."""
        sock = self._debugging.pop(handle, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    # -- persistent meshes ------------------------------------------------------------

    @endpoint(concurrent=True)
    def hold(self, name: str, record: dict[str, Any]) -> None:
        """Keep ``record`` (what a controller needs to take persistent mesh ``name``
        over: shape, processes, actor meshes) until the mesh is stopped."""
        self.meshes[name] = record

    @endpoint(concurrent=True)
    def held(self) -> dict[str, dict[str, Any]]:
        """The persistent meshes with workers here, each record with ``exits``: the
        exit status of each of its workers here that has exited, by pid."""
        out = {}
        for name, record in self.meshes.items():
            exits = {
                pid: c.process.returncode
                for pid, c in self.children.items()
                if c.mesh == name and c.exited.is_set()
            }
            out[name] = {**record, "exits": exits}
        return out

    @endpoint(concurrent=True)
    async def stop_mesh(self, name: str, forget: bool = True) -> int:
        """Kill the workers of persistent mesh ``name`` here and wait until they are
        reaped; with ``forget``, drop its record. How many were running."""
        mine = [c for c in self.children.values() if c.mesh == name and not c.exited.is_set()]
        for child in mine:
            child.process.kill()
        for child in mine:
            await child.exited.wait()
        if forget:
            self.meshes.pop(name, None)
            self._remove_logs(name)
        if mine:
            log.info("stopped persistent mesh %r: %d worker(s)", name, len(mine))
        return len(mine)

    @endpoint(concurrent=True)
    def forget(self, name: str) -> None:
        """Drop persistent mesh ``name``'s record (its controller stopped it), and its
        workers' log files."""
        self.meshes.pop(name, None)
        self._remove_logs(name)

    # -- controllers that are gone ----------------------------------------------------

    def _watch(self, rt: Runtime, owner: str) -> None:
        """Hear ``owner``'s leases (heartbeats from a thread of its, see
        :func:`amesh._hosts._remote.attach`); a broken link alone proves nothing."""
        if owner not in self._watched:
            self._watched.add(owner)
            rt.peers.watch(owner, lambda why: None, anyio.current_time())
            if not self._expiring:
                self._expiring = True
                rt.start_soon(self._expire, rt)

    async def _expire(self, rt: Runtime) -> None:
        """Stop the workers of every controller silent for ``grace`` seconds."""
        tick = min(0.25, self.grace / 4) or 0.05
        held_up = False
        while True:
            before = anyio.current_time()
            await anyio.sleep(tick)
            now = anyio.current_time()
            if now - before > 2 * tick and not held_up:
                # This loop was held up (a busy machine, a slow step of its own): leases
                # that came meanwhile may still be unread. Judge at the next tick, once
                # they are, not on what the stall kept from us.
                held_up = True
                continue
            held_up = False
            for owner in list(self._watched):
                last = rt.peers.last_heartbeat(owner) or now
                if now - last > self.grace:
                    self._watched.discard(owner)
                    rt.peers.unwatch(owner)
                    self._stop_workers_of(owner, f"no lease for {now - last:.1f} s")
                    self.drop_arriving(owner)
                    self._changed()
                    # A controller on this host that was killed left its segments (its
                    # workers' go as each is reaped); remove whatever dead processes left.
                    removed = _wire.sweep_segments()
                    if removed:
                        log.warning(
                            "removed %d shared-memory segment(s) of ended processes", removed
                        )

    def _stop_workers_of(self, owner: str, why: str) -> None:
        mine = [
            p
            for p, c in self.children.items()
            if c.owner == owner and not c.mesh and not c.exited.is_set()
        ]
        kept = sum(
            1
            for c in self.children.values()
            if c.owner == owner and c.mesh and not c.exited.is_set()
        )
        # (a controller that only attached, such as `amesh list`, is no news)
        log.log(
            logging.WARNING if mine or kept else logging.INFO,
            "controller %s is gone (%s): stopping its %d worker(s)%s",
            owner,
            why,
            len(mine),
            f", keeping {kept} of persistent meshes" if kept else "",
        )
        for pid in mine:
            child = self.children[pid]
            if child.process.returncode is None:
                child.process.kill()

    def stop_all(self) -> None:
        """Kill every worker (the agent is exiting)."""
        for child in self.children.values():
            if child.process.returncode is None:
                child.process.kill()


def _make_logs_dir() -> Path:
    """A directory of this agent's own under ``<state dir>/logs`` (named from its pid:
    those of agents that are gone, killed, are removed first)."""
    root = state_dir() / "logs"
    root.mkdir(mode=0o700, exist_ok=True)
    for old in root.iterdir():
        pid = old.name.split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))


def _read_some(sock: socket.socket, timeout: float) -> bytes | None:
    """What ``sock`` has within ``timeout`` seconds: None when nothing, ``b""`` at its
    end (or once it is closed)."""
    try:
        ready, _, _ = select.select([sock], [], [], timeout)
        return sock.recv(65536) if ready else None
    except (OSError, ValueError):  # closed under us (debug_close)
        return b""


def parse_listen(listen: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``tcp://ADDR:PORT`` or ``tls+tcp://ADDR:PORT`` (both
    scheme ``tls+tcp``: encrypted between hosts), or ``stream+tcp://ADDR:PORT`` (plain
    streams); IPv6 in brackets, port 0: any.

    Raises:
        ValueError: not such an address.
    """
    scheme, sep, rest = listen.partition("://")
    host, colon, port = rest.rpartition(":")
    if (
        scheme not in ("tcp", "tls+tcp", "stream+tcp")
        or not sep
        or not colon
        or not host
        or not port.isdigit()
        or not 0 <= int(port) < 65536
    ):
        raise ValueError(
            "an agent listens on tcp://ADDR:PORT (encrypted), or stream+tcp://ADDR:PORT "
            f"(plain), not {listen!r}"
        )
    return ("tls+tcp" if scheme == "tcp" else scheme), host.strip("[]"), int(port)


def _listener(scheme: str, host: str, port: int) -> Transport:
    """The agent's transport: TLS to other hosts and streams within this one (a
    :class:`HybridTransport`) for ``tls+tcp``, NNG over TLS alone when
    ``AMESH_TRANSPORT_IMPL`` names an NNG transport, plain streams for ``stream+tcp``."""
    # open to other hosts: connections that never prove themselves are shut down
    guard = Limits(deadline=settings().handshake_timeout)
    if scheme == "stream+tcp":
        # (and to this host's controllers on tls+tcp, at their alias)
        return HostStreams("tcp", host=host, port=port, guard=guard)
    if default_impl() == "stream":
        return HybridTransport(host, port=port, guard=guard)
    return open_tls(host, port, guard=guard)


def address_towards(peer: str) -> str:
    """This machine's address on the interface that routes to ``peer`` (an IP): the
    one a process there can reach us at. No packet is sent."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return str(s.getsockname()[0])


def announce(path: str, addr: str) -> None:
    """Write ``addr`` to ``path`` in one step (a reader sees all of it or nothing)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(addr + "\n")
    os.replace(tmp, path)


async def serve_agent(
    listen: str,
    key_file: str,
    grace: float = DEFAULT_GRACE,
    *,
    route_to: str = "",
    announce_to: str = "",
    idle_exit: float = 0.0,
    lock_file: str = "",
    task_status: Any = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a host agent until SIGTERM or SIGINT (or cancellation); see the module doc.

    Args:
        listen: ``tcp://ADDR:PORT`` (port 0: any free one; see :func:`parse_listen`).
        key_file: the job key (see ``amesh keygen``).
        grace: see :data:`DEFAULT_GRACE`.
        route_to: an IP (the controller's): listen on the address of the interface
            that routes there, whatever ``ADDR`` says.
        announce_to: a file to write the agent's address to once it listens (a batch
            job's agents tell their controller where they are), removed at exit.
        idle_exit: exit once no worker has run and no controller held a lease for
            this many seconds (0: never; the local agent that holds this machine's
            persistent meshes is started with it).
        lock_file: a file to hold an exclusive lock on while running, with the
            agent's pid and address in it: how controllers find this machine's own
            agent whatever its ``agent.addr`` says (see :mod:`._home`). Another agent
            holds it: this one exits.

    ``task_status.started`` gets the agent's address once it listens.
    """
    raise_open_files()  # a few descriptors per worker it starts (see amesh._limits)
    raise_processes()  # and each worker's threads count against the user's limit
    scheme, host, port = parse_listen(listen)
    if route_to:
        host = address_towards(route_to)
    adopt_key(read_key_file(key_file))
    async with open_runtime(lambda: _listener(scheme, host, port)) as rt:
        agent = HostAgent(host, grace)
        inst = ActorInstance(rt, AGENT_ACTOR, AGENT_ACTOR, agent, handlers_of(HostAgent), "", 0)
        rt.add_actor(inst)
        lock = hold_agent_lock(lock_file, rt.address) if lock_file else None
        if lock_file and lock is None:
            log.error("amesh agent: another agent holds %s, stopping", lock_file)
            return
        # every worker here comes from the zygote: have it ready for the first mesh
        rt.start_soon(start_zygote, rt)
        log.info("amesh agent %d listening on %s", os.getpid(), rt.address)
        if announce_to:
            announce(announce_to, rt.address)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_until_signalled, tg.cancel_scope)
                if idle_exit > 0:
                    tg.start_soon(_until_idle, agent, idle_exit, tg.cancel_scope)
                task_status.started(rt.address)
        finally:
            with anyio.CancelScope(shield=True):
                agent.stop_all()
                for child in list(agent.children.values()):
                    with anyio.move_on_after(5):
                        await child.exited.wait()
                agent.remove_all_logs()
                agent.close_depot()
            if lock is not None:
                os.close(lock)  # (its content still names this agent: it is not held)
            if announce_to:
                _unannounce(announce_to, rt.address)


async def _until_signalled(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            log.info("amesh agent: %s, stopping", signal.Signals(sig).name)
            break
    scope.cancel()


async def _until_idle(agent: HostAgent, idle: float, scope: anyio.CancelScope) -> None:
    while True:
        changed = agent.changed
        if agent.idle():
            with anyio.move_on_after(idle):
                await changed.wait()
            if agent.idle() and changed is agent.changed:
                log.info("amesh agent: idle for %g s, stopping", idle)
                scope.cancel()
                return
        else:
            await changed.wait()


def _unannounce(path: str, addr: str) -> None:
    """Remove ``path`` if it still names ``addr`` (a newer agent may have replaced it)."""
    try:
        with open(path) as f:
            if f.read().strip() != addr:
                return
        os.unlink(path)
    except OSError:
        pass


def main(
    listen: str,
    key_file: str,
    grace: float,
    route_to: str = "",
    announce_to: str = "",
    idle_exit: float = 0.0,
    lock_file: str = "",
) -> int:
    """The ``amesh agent`` command."""
    logging.basicConfig(
        stream=sys.stderr,
        level=settings().log_level or "INFO",
        format="%(asctime)s amesh agent %(levelname)s %(name)s: %(message)s",
    )
    anyio.run(
        lambda: serve_agent(
            listen,
            key_file,
            grace,
            route_to=route_to,
            announce_to=announce_to,
            idle_exit=idle_exit,
            lock_file=lock_file,
        )
    )
    return 0
