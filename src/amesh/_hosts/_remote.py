"""Many machines: a :class:`HostMesh` of host agents, and the processes they start.

``hosts = await amesh.attach(["tcp://ADDR:PORT", ...], key_file=PATH)`` reaches an
``amesh agent`` on each machine (see :mod:`amesh._hosts._agent`) and returns a
:class:`HostMesh` with one dimension, ``hosts``. ``hosts.spawn_procs(per_host={"gpus":
8})`` is a :class:`~amesh.ProcMesh` of ``{"hosts": N, "gpus": 8}``: process slot ``s``
runs on host ``s // 8``. Each worker reports to this controller directly (so the
controller must listen where the hosts can reach it: ``AMESH_TRANSPORT=tcp``, which is
TLS between hosts, or ``stream+tcp`` for plain streams, and ``AMESH_HOST`` set to its
address on their network; a controller on the default transport that has not started
anything yet moves there at ``attach``, see :func:`_listen_towards`), and is supervised
as a local one is; the agent reports its exit status the moment it reaps it. The loss
of an agent is the loss of every worker on its host.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import signal
import socket
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from .._bootstrap import WorkerSpec
from .._debug import RemoteDebugger
from .._depot import HashCache, Scanned, scan
from .._errors import ActorError, SupervisionError
from .._identity import adopt_key_file, hold_key, read_key_file
from .._mesh import Holder, ProcHandle, ProcMesh
from .._model import CONTROLLER_KEY, ActorMesh, ControllerAgent, MeshView, Supervisor
from .._runtime import LINK_LOST, Runtime, bridged, current_runtime
from .._shape import Shape
from .._transport import dial_part, open_transport
from .._worker import NativeBeats, start_heartbeats
from ._agent import AGENT_ACTOR, DEFAULT_GRACE, HostAgent, address_towards
from ._deliver import Delivered, EnvPackages, deliver, in_delivered
from ._home import found_agent, local_agent, local_agent_address, local_key
from ._reach import AgentAddress, parse_agent_address, resolves, why_unreachable
from ._ready import ReadyWaiter

__all__ = ["HostMesh", "RemoteProcess", "attach", "attach_mesh", "held_meshes"]

log = logging.getLogger("amesh.hosts")


class RemoteProcess:
    """A worker on another machine, as its host agent reports it (a ``ProcessLike``).

    Attributes:
        lost: why its exit status cannot be known (its agent was lost), else None.
    """

    def __init__(self, agent: ActorMesh[HostAgent], pid: int, where: str) -> None:
        self._agent = agent
        self.pid = pid
        #: its agent, as HOST:PORT
        self._where = where
        self._rc: int | None = None
        self.lost: str | None = None
        self._done = anyio.Event()
        self._waiting = False
        self._killed = anyio.Event()

    @property
    def returncode(self) -> int | None:
        return self._rc

    async def wait(self) -> int:
        # One waiter asks the agent; the others wait for it (and take over if it is
        # cancelled).
        while self._rc is None:
            if self._waiting:
                await self._done.wait()
                continue
            self._waiting, self._done = True, anyio.Event()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._ask, tg.cancel_scope)
                    await self._killed.wait()
                    # killed: the agent confirms by reaping it, unless it cannot be
                    # reached (a cut network) -- then the host is as good as lost
                    await anyio.sleep(KILL_CONFIRM)
                    if self._rc is None:
                        self.lost = (
                            f"was killed, and its host agent at {self._where} did not "
                            f"confirm within {KILL_CONFIRM:g} s"
                        )
                        self._rc = -signal.SIGKILL
                    tg.cancel_scope.cancel()
            finally:
                self._waiting = False
                self._done.set()
        return self._rc

    async def _ask(self, scope: anyio.CancelScope) -> None:
        try:
            self._rc = await self._agent.wait_exit.call_one(self.pid)
        except SupervisionError as exc:
            # the agent is gone, and its workers die with it
            self.lost = f"was lost with its host agent at {self._where}: {_agent_lost(exc)}"
            self._rc = -signal.SIGKILL
        scope.cancel()

    def _signal(self, sig: int) -> None:
        if self._rc is not None:
            return
        if sig == signal.SIGKILL:
            self._killed.set()

        async def send() -> None:
            try:
                await self._agent.kill.call_one(self.pid, sig)
            except SupervisionError:
                pass  # the agent is gone: so is the worker

        current_runtime().start_soon(send)

    async def stacks_by_signal(self, full: bool = False) -> str:
        """Its stacks, taken by its host agent without its event loop (see
        :meth:`HostAgent.stacks <amesh._hosts._agent.HostAgent.stacks>`)."""
        text: str = await self._agent.stacks.call_one(self.pid, full)
        return text

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    async def aclose(self) -> None:
        pass


def _host_port(addr: str) -> str:
    """``HOST:PORT`` of an agent's address (without its scheme and tag)."""
    return dial_part(addr).split("://", 1)[-1]


def _agent_lost(exc: SupervisionError) -> str:
    """Why an agent was lost, in a few words: the cause of its failure, without the
    layers of the call that found it (its endpoint, its actor, its rank)."""
    cause = exc.failures[0].cause if exc.failures else exc.message
    head = LINK_LOST + " ("
    if cause.startswith(head) and cause.endswith(")"):
        return cause[len(head) : -1]
    return cause


#: Seconds a killed remote worker's agent has to confirm that it reaped it.
KILL_CONFIRM = 5.0
#: Seconds between a controller's leases on its agents at most (see :mod:`._agent`).
LEASE_PERIOD = 0.5


def lease_period(grace: float) -> float:
    """Seconds between leases to an agent that stops a controller's workers after
    ``grace`` seconds without one: four leases a grace period (a late one or two is no
    loss), at most :data:`LEASE_PERIOD` apart, at least 10 ms."""
    return max(0.01, min(LEASE_PERIOD, grace / 4))


class _Leases:
    """This controller's leases on host agents: heartbeats to each, from a thread of
    the C extension that never takes the GIL (else a Python thread), so that a
    controller whose event loop stalls keeps its workers. Stopped with the runtime."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._stop = threading.Event()
        self._beats: list[NativeBeats] = []
        self.agents: set[str] = set()

    def add(self, agent: str, grace: float) -> None:
        if agent in self.agents:
            return
        self.agents.add(agent)
        beats = start_heartbeats(agent, self._rt.address, lease_period(grace), self._stop)
        if beats is not None:
            self._beats.append(beats)

    async def stop(self) -> None:
        self._stop.set()
        for beats in self._beats:
            beats.close()


_LEASES: weakref.WeakKeyDictionary[Runtime, _Leases] = weakref.WeakKeyDictionary()


def _lease(rt: Runtime, agents: Sequence[str], graces: Sequence[float]) -> None:
    leases = _LEASES.get(rt)
    if leases is None:
        leases = _LEASES[rt] = _Leases(rt)
        rt.own(leases, first=True)  # stopped last, after the meshes on the agents
    for agent, grace in zip(agents, graces, strict=True):
        leases.add(agent, grace)


class _AgentDebugger:
    """The ranks paused under one host agent, for ``amesh.debug()`` (a
    :class:`~amesh._debug.RemoteDebugger`)."""

    def __init__(self, addr: str) -> None:
        self._agent = ActorMesh(
            "hosts", AGENT_ACTOR, HostAgent, Shape.from_sizes({"hosts": 1}), [addr], 0
        )

    async def sessions(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = await self._agent.debug_sessions.options(
            timeout=5.0
        ).call_one()
        return found

    async def open(self, ident: int) -> int | None:
        handle: int | None = await self._agent.debug_open.call_one(ident)
        return handle

    async def read(self, handle: int, timeout: float) -> bytes | None:
        data: bytes | None = await self._agent.debug_read.call_one(handle, timeout)
        return data

    async def write(self, handle: int, data: bytes) -> None:
        await self._agent.debug_write.call_one(handle, data)

    async def close(self, handle: int) -> None:
        await self._agent.debug_close.call_one(handle)


def remote_debuggers() -> list[RemoteDebugger]:
    """The host agents this controller holds leases on, as ``amesh.debug()`` sees them."""
    try:
        leases = _LEASES.get(current_runtime())
    except RuntimeError:  # no runtime: no agents
        return []
    return [_AgentDebugger(a) for a in sorted(leases.agents)] if leases is not None else []


class HostMesh(MeshView):
    """Machines with an ``amesh agent`` each: one dimension, ``hosts``.

    Made by :func:`attach`. ``spawn_procs`` gives a :class:`~amesh.ProcMesh` on them.
    """

    def __init__(
        self,
        agents: ActorMesh[HostAgent],
        infos: list[dict[str, Any]],
        delivered: list[Delivered] | None = None,
    ) -> None:
        self._agents = agents
        self._shape = agents.shape
        self._infos = infos
        #: what each host was given (see provision): where its workers start
        self._delivered = delivered

    def _with_shape(self, shape: Shape) -> HostMesh:
        delivered = self._delivered
        return HostMesh(
            self._agents._with_shape(shape),
            [self._infos[s] for s in shape.slots],
            [delivered[s] for s in shape.slots] if delivered is not None else None,
        )

    def __repr__(self) -> str:
        return f"<HostMesh {[i['host'] for i in self._infos]}>"

    @property
    def hosts(self) -> list[dict[str, Any]]:
        """What each agent said of its host: ``hostname``, ``host`` (its address),
        ``addr`` (the agent's), ``pid``, ``cpus``, ``grace`` (seconds it keeps the
        workers of a controller it hears no lease from)."""
        return list(self._infos)

    @property
    def delivered(self) -> list[Delivered] | None:
        """What :meth:`provision` gave each host (None: nothing; its workers run in
        their agent's interpreter and working directory)."""
        return list(self._delivered) if self._delivered is not None else None

    async def provision(
        self, env: EnvPackages | None = None, workspace: Scanned | None = None
    ) -> HostMesh:
        """These hosts, with environment ``env``'s venv and ``workspace``'s tree on
        each (each sent only what it lacks, built once and reused after): the
        processes of their ``spawn_procs`` run in that venv's Python, in that tree,
        which is first on their import path.

        Args:
            env: the environment's wheels and lock (None: the agents' own Python, or
                the venv of an earlier provision).
            workspace: a scanned workspace (see :func:`amesh._depot.scan`; None: the
                tree of an earlier provision, if any).

        Raises:
            ProvisionError: a host failed; the message names it and why.
        """
        done = await deliver(self._agents, [i["host"] for i in self._infos], env, workspace)
        if self._delivered is not None:  # what this call did not change stays
            done = [
                dataclasses.replace(
                    d, python=d.python or old.python, workspace=d.workspace or old.workspace
                )
                for d, old in zip(done, self._delivered)
            ]
        return HostMesh(self._agents, self._infos, done)

    async def sync(
        self,
        roots: Sequence[str | os.PathLike[str]],
        excludes: Sequence[str] = (),
        cache: HashCache | None = None,
    ) -> HostMesh:
        """These hosts with the workspace of ``roots`` as it is now: scanned (see
        :func:`amesh._depot.scan`), only its changed files sent, a tree made of it on
        each host; processes spawned from the mesh returned start in that tree.

        Raises:
            ProvisionError: a host failed; the message names it and why.
        """
        scanned = await anyio.to_thread.run_sync(scan, roots, excludes, cache)
        return await self.provision(workspace=scanned)

    async def env_needs(
        self, env_hash: str, python_spec: str, digests: Sequence[str]
    ) -> list[dict[str, Any]]:
        """What each host would need of an environment (see
        :meth:`~._provision.DepotEndpoints.env_needs`), with its ``host``, in host
        order; nothing is sent or built."""
        answers = await self._agents.env_needs.call(env_hash, python_spec, list(digests))
        return [{"host": i["host"], **a} for i, a in zip(self._infos, answers.values())]

    def placement(self, per_host: int, mesh_name: str = "") -> Holder:
        """The Host of a ProcMesh with ``per_host`` processes on each of these hosts
        (slot ``s`` on host ``s // per_host``), for persistent mesh ``mesh_name`` if
        given: what :meth:`spawn_procs` gives its ProcMesh, for a host that wraps it
        (an environment's, which provisions these hosts first)."""
        return _Placement(self, per_host, mesh_name)

    def spawn_procs(
        self,
        per_host: Mapping[str, int] | None = None,
        *,
        name: str | None = None,
        persistent: bool = False,
        **kwargs: Any,
    ) -> ProcMesh:
        """A :class:`~amesh.ProcMesh` of ``{"hosts": N, **per_host}`` processes, ``per_host``
        on each machine; enter it (or await it) to start them. Takes the keyword
        arguments of :class:`~amesh.ProcMesh` but ``host``.

        With ``persistent=True`` the processes outlive this controller (their agents
        keep them) until the mesh is stopped (``await procs.stop()``, ``amesh stop
        NAME``); another controller takes the mesh over with :func:`attach_mesh`.
        """
        per = dict(per_host or {"procs": 1})
        if "hosts" in per:
            raise ValueError("per_host describes one host: it cannot have a 'hosts' dimension")
        count = len(Shape.from_sizes(per))
        placement = _Placement(self, count, (name or "") if persistent else "")
        return ProcMesh(
            {"hosts": len(self), **per},
            host=placement,
            name=name,
            persistent=persistent,
            **kwargs,
        )


class _Placement:
    """The Host of a ProcMesh on a HostMesh: slot ``s`` goes to host ``s // per_host``.

    For a persistent mesh (``mesh_name``) it is a :class:`~amesh._mesh._host.Holder`:
    its agents keep the processes past this controller, and the mesh's record.
    """

    def __init__(self, hosts: HostMesh, per_host: int, mesh_name: str = "") -> None:
        self._hosts = hosts
        #: processes per host (ProcMesh reads it: the relay tree goes by host)
        self.per_host = per_host
        self.mesh_name = mesh_name

    def __repr__(self) -> str:
        return repr(self._hosts)

    async def hold(self, record: dict[str, Any]) -> None:
        infos = self._hosts._infos
        record = {
            **record,
            "agents": [i["addr"] for i in infos],
            "hosts": [i["host"] for i in infos],
            "per_host": self.per_host,
        }
        await self._hosts._agents.hold.call(self.mesh_name, record)

    async def release(self) -> None:
        await self._hosts._agents.forget.call(self.mesh_name)

    async def make_room(self, slots: Sequence[int]) -> None:
        """Ask the agents whether their machines let them start the threads of
        ``slots``'s processes (each host as many as the one that gets most), before
        any starts.

        Raises:
            OSError: (EAGAIN) a host cannot; the message names it and says why.
        """
        counts = collections.Counter(slot // self.per_host for slot in slots)
        if not counts:
            return
        answers = await self._hosts._agents.make_room.call(max(counts.values()))
        for info, why in zip(self._hosts._infos, answers.values()):
            if why is not None:
                raise OSError(errno.EAGAIN, f"on host {info['host']}: {why}")

    async def start_proc(self, rt: Runtime, spec: WorkerSpec) -> ProcHandle:
        """Start the worker of ``spec.slot`` on its agent (which decides how it
        listens), and wait until it reports."""
        index = spec.slot // self.per_host
        agent = self._hosts._agents.slice(hosts=index)
        where = self._hosts._infos[index]["host"]
        spec = in_delivered(spec, self._hosts._delivered, index)
        ready = ReadyWaiter(rt)
        try:
            pid = await agent.start_proc.call_one(ready.token, spec, self.mesh_name)
        except BaseException:
            ready.cancel()
            raise
        process = RemoteProcess(agent, pid, _host_port(self._hosts._infos[index]["addr"]))
        msg = await ready.started(process, pid, where)
        return ProcHandle(msg.addr, msg.pid, process, local=False, host=where)


def _agent_address(addr: str) -> str:
    """The address to dial for ``addr``: ``tcp://`` means encrypted (``tls+tcp://``);
    ``stream+tcp://`` (plain streams) and ``tls+tcp://`` are kept.

    Raises:
        ValueError: ``addr`` is not an agent's address (see
            :func:`~._reach.parse_agent_address`).
    """
    return parse_agent_address(addr).dial


async def _reach_error(
    exc: SupervisionError, agents: Sequence[AgentAddress], key_file: str | None
) -> SupervisionError:
    """The error of an :func:`attach` whose agents (the ranks of ``exc``) cannot be
    reached or refused us: one sentence each, with the address typed and the cause."""
    ranks = sorted({f.rank for f in exc.failures if 0 <= f.rank < len(agents)})
    if not ranks:
        return exc
    whys = [
        f"the agent at {agents[r].typed} {await why_unreachable(agents[r], key_file)}"
        for r in ranks
    ]
    return SupervisionError("; ".join(whys), exc.failures)


async def _listen_towards(rt: Runtime, agents: Sequence[AgentAddress]) -> None:
    """Have controller ``rt``, which listens where only this machine reaches it, listen
    on the address of the interface that routes to ``agents`` instead (as ``amesh agent
    --route-to`` does): TLS, or plain streams where every agent speaks ``stream+tcp``.

    Raises:
        RuntimeError: the agents are reached through different interfaces, or other
            processes know ``rt``'s address already.
    """
    routes = {a.typed: await anyio.to_thread.run_sync(address_towards, a.host) for a in agents}
    if len(set(routes.values())) > 1:
        raise RuntimeError(
            "this controller reaches the agents through different addresses of its own ("
            + ", ".join(f"{ours} to {theirs}" for theirs, ours in routes.items())
            + "): start it with AMESH_TRANSPORT=tcp and AMESH_HOST=<its address that they "
            "all reach>"
        )
    scheme = "stream+tcp" if all(a.scheme == "stream+tcp" for a in agents) else "tcp"
    rt.listen_instead(open_transport(scheme, host=next(iter(routes.values()))))
    log.info("this controller listens at %s, where its agents reach it", rt.address)


@bridged
async def attach(
    addrs: Sequence[str],
    *,
    key_file: str | None = None,
    timeout: float = 30.0,
    _local: bool = False,
) -> HostMesh:
    """The machines whose ``amesh agent`` listens at ``addrs`` (``tcp://ADDR:PORT``),
    as a :class:`HostMesh`.

    A controller that listens where only this machine reaches it (the default
    transport) listens from here on at its address on the interface that routes to the
    agents (TLS; plain streams to ``stream+tcp`` agents), where their workers report
    to it. It can move only while no other process knows it: attach before starting
    anything else, or start it with ``AMESH_TRANSPORT=tcp`` and ``AMESH_HOST``.

    Args:
        addrs: one agent address per host.
        key_file: the key the agents were started with (``amesh keygen``); this
            process adopts it as its job key. Without it, the job key must already
            be that key (``AMESH_KEY_FILE``).
        timeout: how long to wait for every agent to answer.

    Raises:
        RuntimeError: this controller listens where other machines cannot reach it
            and cannot move (processes here know its address, or the agents are
            reached through different interfaces), or it already uses another key.
        SupervisionError: an agent cannot be reached or refused us; the message
            names its address as given and why (the name does not resolve, nothing
            listens there, it does not answer, it holds another key, or its address
            has another tag).
        TimeoutError: an agent did not answer in time.
        ValueError: an address is not an agent's (a bad port or tag, say).
    """
    if not addrs:
        raise ValueError("attach needs at least one agent address")
    typed = [parse_agent_address(a) for a in addrs]
    for a in typed:
        if not await resolves(a):
            raise SupervisionError(f"the agent at {a.typed} {await why_unreachable(a, key_file)}")
    agents = [a.dial for a in typed]
    if key_file is not None:
        adopt_key_file(key_file)
    rt = current_runtime()
    if not _local and not rt.address.startswith(("stream+tcp://", "tls+tcp://")):
        await _listen_towards(rt, typed)
    for agent in agents:  # an agent may have been restarted since this runtime saw it die
        rt.peers.revive(agent)
    mesh = ActorMesh(
        "hosts", AGENT_ACTOR, HostAgent, Shape.from_sizes({"hosts": len(agents)}), agents, 0
    )
    try:
        infos = list((await mesh.info.options(timeout=timeout).call()).values())
    except SupervisionError as exc:
        raise await _reach_error(exc, typed, key_file) from None
    # (an agent older than its "grace" answer: the default grace's period)
    _lease(rt, agents, [float(i.get("grace", DEFAULT_GRACE)) for i in infos])
    return HostMesh(mesh, infos)


# -- persistent meshes ---------------------------------------------------------------


def _hold_local_key(addrs: Sequence[str] = ()) -> None:
    """Hold the key of this machine's persistent meshes (:mod:`._home`), proving
    ourselves with it to ``addrs`` (their agent's and processes'): as this process's
    job key when it has none yet, else beside it (a notebook session that ran a mesh
    of its own first)."""
    hold_key(read_key_file(str(local_key())), addrs)


async def _answers(addr: str) -> bool:
    """Whether a host agent answers at ``addr`` (quickly: it is on this machine)."""
    _hold_local_key([addr])
    mesh = ActorMesh("hosts", AGENT_ACTOR, HostAgent, Shape.from_sizes({"hosts": 1}), [addr], 0)
    try:
        await mesh.info.options(timeout=5.0).call_one()
    except (SupervisionError, TimeoutError) as exc:
        log.info("no local agent at %s: %s", addr, exc)
        return False
    return True


async def local_hosts(start: bool) -> HostMesh | None:
    """This machine's local agent (:mod:`._home`) as a HostMesh of one; started when
    none runs and ``start``, else None when none runs. This process holds the local
    key (see :func:`_hold_local_key`).

    Raises:
        RuntimeError: the agent runs but does not answer.
    """
    _hold_local_key()
    if start:
        addr: str | None = await local_agent(_answers)
    else:
        addr = local_agent_address()
        if addr is None or not await _answers(addr):
            addr = await found_agent(_answers)  # (none runs: no mesh either)
    if addr is None:
        return None
    _hold_local_key([addr])  # (one just started was not asked yet)
    return await attach([addr], _local=True)


async def local_holder(name: str, count: int) -> Holder:
    hosts = await local_hosts(start=True)
    assert hosts is not None
    return _Placement(hosts, count, name)


async def _hosts_of(
    hosts: HostMesh | Sequence[str] | None, key_file: str | None
) -> HostMesh | None:
    if isinstance(hosts, HostMesh):
        return hosts
    if hosts is None:
        return await local_hosts(start=False)
    return await attach(hosts, key_file=key_file)


async def held_meshes(
    hosts: HostMesh | Sequence[str] | None = None, key_file: str | None = None
) -> dict[str, dict[str, Any]]:
    """The persistent meshes that the agents of ``hosts`` (this machine's local agent
    when None) keep: name -> record (shape, hosts, processes, actor meshes, exits)."""
    mesh = await _hosts_of(hosts, key_file)
    if mesh is None:
        return {}
    found: dict[str, dict[str, Any]] = {}
    for held in (await mesh._agents.held.call()).values():
        for name, record in held.items():
            if name in found:  # several hosts: the exits of each
                found[name]["exits"].update(record["exits"])
            else:
                found[name] = record
    return found


async def find_held(
    name: str, hosts: HostMesh | Sequence[str] | None, key_file: str | None
) -> tuple[HostMesh, dict[str, Any]]:
    """The agents of every host of persistent mesh ``name`` (asked first: those of
    ``hosts``, see :func:`attach_mesh`), and its record.

    Raises:
        LookupError: they keep no such mesh.
    """
    mesh = await _hosts_of(hosts, key_file)
    held = await held_meshes(mesh) if mesh is not None else {}
    record = held.get(name)
    if record is None or mesh is None:
        where = "on this machine" if hosts is None else f"on {mesh!r}"
        known = ", ".join(sorted(held)) or "none"
        raise LookupError(f"no persistent mesh named {name!r} {where} (there are: {known})")
    agents = list(record["agents"])
    if [i["addr"] for i in mesh.hosts] != agents:
        mesh = await attach(agents, key_file=key_file, _local=hosts is None)
    return mesh, record


#: Seconds the controller that holds a persistent mesh has to answer whether it does
#: (it is alive: a gone one's connection is refused at once)
HOLDER_TIMEOUT = 5.0


async def _take_from_holder(name: str, record: dict[str, Any], takeover: bool) -> None:
    """Make sure that no other controller holds persistent mesh ``name`` (``record``
    names the last one): a live holder refuses, or, with ``takeover``, lets go of it
    (its handles raise from then on). A gone one (killed, returned) holds nothing.

    Raises:
        RuntimeError: another controller holds it (or does not answer), and not
            ``takeover``; the message names it and what to do.
    """
    addr = str(record.get("controller") or "")
    if not addr or addr == current_runtime().address:
        return
    holder = ActorMesh(
        CONTROLLER_KEY,
        CONTROLLER_KEY,
        ControllerAgent,
        Shape.from_sizes({"controllers": 1}),
        [addr],
        0,
    )
    held: str | None
    try:
        held = await holder.holder.options(timeout=HOLDER_TIMEOUT).call_one(name)
    except (SupervisionError, LookupError, ActorError) as exc:
        log.info("the last controller of %r, at %s, holds it no longer: %s", name, addr, exc)
        return
    except TimeoutError:
        held = (
            f"pid {record.get('controller_pid')} at {addr}, which did not answer within "
            f"{HOLDER_TIMEOUT:g} s"
        )
    if held is None:
        return
    if not takeover:
        raise RuntimeError(
            f"persistent mesh {name!r} is held by the controller {held}: stop that "
            "controller (or let it return) first, or take the mesh over from it with "
            f"attach_mesh({name!r}, takeover=True)"
        )
    me = f"pid {os.getpid()} on {socket.gethostname()}"
    try:
        await holder.let_go.options(timeout=HOLDER_TIMEOUT).call_one(name, me)
    except (SupervisionError, LookupError, ActorError, TimeoutError) as exc:
        # (the agents take orders for the mesh's workers from its new owner only)
        log.warning(
            "taking %r over from the controller %s, which did not let go: %s", name, held, exc
        )


@bridged
async def attach_mesh(
    name: str,
    *,
    hosts: HostMesh | Sequence[str] | None = None,
    key_file: str | None = None,
    supervise: Supervisor | None = None,
    takeover: bool = False,
) -> ProcMesh:
    """Take over persistent mesh ``name``, made by another controller (which may be
    gone): its processes, with their actors and their state, as a
    :class:`~amesh.ProcMesh` owned by this controller from now on.

    ``await procs.actor_mesh(NAME)`` gives its actor meshes back. The mesh stays
    persistent: it outlives this controller too, until ``await procs.stop()``.

    Args:
        name: the name it was made with (``ProcMesh(..., name=, persistent=True)``).
        hosts: where its agents are: a :class:`HostMesh`, or their addresses (then
            ``key_file`` as for :func:`attach`); None for this machine's local agent.
        key_file: the agents' key, with ``hosts`` given as addresses.
        supervise: as for :class:`~amesh.ProcMesh`: handles its failures from now on
            (one that happened while no controller held it is reported at once).
        takeover: take the mesh from a controller that still holds it: that one is
            told and lets go (its workers run on; its handles raise RuntimeError).
            Without it, a mesh still held elsewhere is refused.

    Raises:
        LookupError: no such persistent mesh there.
        RuntimeError: another controller still holds it (the message names it), and
            not ``takeover``; or this machine's agent runs but does not answer.
        SupervisionError: a process of the mesh is gone (it is reported the way a
            failure of a running mesh is).
    """
    mesh, record = await find_held(name, hosts, key_file)
    if hosts is None:  # its processes, and the controller that held it, hold the local key
        _hold_local_key([addr for addr, _ in record["procs"]] + [str(record["controller"])])
    await _take_from_holder(name, record, takeover)
    per_host = int(record["per_host"])
    placement = _Placement(mesh, per_host, name)
    # the mesh's own settings (for the workers it may start again), and those in
    # effect that were not its own
    own: dict[str, Any] = record.get("settings", {})
    period, timeout = record["heartbeat"]
    effect = {"fanout": record["fanout"], "heartbeat_period": period, "heartbeat_timeout": timeout}
    procs = ProcMesh(
        dict(zip(record["labels"], record["sizes"], strict=True)),
        host=placement,
        name=name,
        persistent=True,
        supervise=supervise,
        settings=own,
        **{n: v for n, v in effect.items() if n not in own},
    )
    handles = []
    exits: dict[int, int] = record["exits"]
    for slot, (addr, pid) in enumerate(record["procs"]):
        index = slot // per_host
        where = mesh._infos[index]["host"]
        at = _host_port(mesh._infos[index]["addr"])
        process = RemoteProcess(mesh._agents.slice(hosts=index), pid, at)
        if pid in exits:
            process._rc = exits[pid]
        handles.append(ProcHandle(addr, pid, process, local=False, host=where))
    await procs._adopt(handles, record["actors"])
    return procs
