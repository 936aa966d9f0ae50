"""Where an environment runs: a launcher per kind of target brings its hosts up.

A target of the environment file names its launcher (``local``, ``hosts``, ``ssh``,
``slurm``). A :class:`Launcher` turns the target into a :class:`~amesh.HostMesh` of
attached host agents, before anything is sent to them (the environment's venv and
workspace are the caller's work: :mod:`._environment`), and cleans up after: agents
it started, a job it submitted. Launchers are found by name in a registry
(:func:`register_launcher`), so a launcher lives in a module of its own and this one
knows only their protocol. Here: ``local`` (this machine's agent), ``hosts`` (agents
already running), and ``ssh`` and ``slurm`` (agents started on hosts that have nothing
but Python, from an agent bundle of amesh's wheel and its dependencies': see
:class:`amesh._hosts.SshHosts` and :class:`amesh._hosts.SlurmJob`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio

from .._errors import SupervisionError
from .._hosts import AgentBundle, HostMesh, SlurmJob, SshHosts, agent_bundle, attach, local_hosts
from ._base import EnvError, cache_dir
from ._file import HostsTarget, LocalTarget, SlurmTarget, SshTarget, Target
from ._open import Env
from ._wheels import Wheel

__all__ = [
    "HostsLauncher",
    "Launcher",
    "LocalLauncher",
    "SlurmLauncher",
    "SshLauncher",
    "check_launcher",
    "host_count",
    "launcher_for",
    "register_launcher",
]


class Launcher(Protocol):
    """Brings the hosts of one target up for one environment, and down after.

    One launcher serves one mesh: :meth:`open` once, :meth:`close` once after, when
    the mesh has stopped, its first processes failed to start, or giving its hosts
    the environment failed.
    """

    async def open(self, target: Target, env: Env, wheels: Sequence[Wheel]) -> HostMesh:
        """The hosts of ``target``, their agents attached (as many as
        :func:`host_count` says, in a fixed order).

        Args:
            target: the environment file's target.
            env: the environment (its file's directory is where relative paths, a key
                file's, start).
            wheels: its wheels in the controller's cache, amesh's own among them when
                its lock holds amesh's requirements (for hosts that have nothing but
                a Python: the agent's own venv is made of them).

        Raises:
            EnvError: the target cannot be reached; the message names the host and why.
        """
        ...

    async def close(self) -> None:
        """Let go of what :meth:`open` started (nothing, for agents that were there)."""
        ...


LauncherFactory = Callable[[], Launcher]

#: what stands for "the launch failed": an agent not reached, ssh or sbatch refused
_LAUNCH_ERRORS = (OSError, RuntimeError, SupervisionError, TimeoutError, ValueError)


async def _bundle(wheels: Sequence[Wheel]) -> AgentBundle:
    """The agent bundle of the environment's amesh wheel (its lock holds amesh's
    requirements: see ``Environment.spawn_procs``), its dependencies repacked into the
    controller's cache."""
    (wheel,) = [w.path for w in wheels if w.filename.split("-")[0] == "amesh"]
    out = cache_dir() / "agent-wheels"
    return await anyio.to_thread.run_sync(agent_bundle, wheel, out)


def _key(env: Env, key_file: str | None) -> str | None:
    return str(env.spec.resolve(key_file)) if key_file else None


class LocalLauncher:
    """This machine, through its local agent (the one persistent meshes use, started
    on demand): its depot keeps the environment's venvs and trees, for every
    controller of this user on this machine."""

    async def open(self, target: Target, env: Env, wheels: Sequence[Wheel]) -> HostMesh:
        """This machine's local agent, attached (started if none runs)."""
        hosts = await local_hosts(start=True)
        if hosts is None:  # (start=True starts one or raises)
            raise EnvError(f"{env.spec.name}: this machine's agent did not start")
        return hosts

    async def close(self) -> None:
        """Nothing: the local agent stops by itself once idle."""


class HostsLauncher:
    """Machines whose agents run already (``amesh agent``), at the target's addresses."""

    async def open(self, target: Target, env: Env, wheels: Sequence[Wheel]) -> HostMesh:
        """The target's agents, attached with its key file (relative to the
        environment file's directory; none: the controller's key).

        Raises:
            EnvError: an agent cannot be reached or refused us (the message names it).
        """
        assert isinstance(target, HostsTarget)
        try:
            return await attach(list(target.agents), key_file=_key(env, target.key_file))
        except _LAUNCH_ERRORS as exc:
            raise EnvError(f"{env.spec.name}: {exc}") from exc

    async def close(self) -> None:
        """Nothing: the agents were there before, and stay."""


class SshLauncher:
    """Machines reached with the user's ssh: an agent started on each over its ssh
    session, from an agent bundle (see :class:`amesh._hosts.SshHosts`); the agents
    end with their sessions, at :meth:`close`."""

    def __init__(self) -> None:
        self._hosts: SshHosts | None = None

    async def open(self, target: Target, env: Env, wheels: Sequence[Wheel]) -> HostMesh:
        """Start the target's agents over ssh and attach to them.

        Raises:
            EnvError: a host could not be reached or its agent did not start.
        """
        assert isinstance(target, SshTarget)
        self._hosts = SshHosts(
            list(target.hosts),
            await _bundle(wheels),
            user=target.user,
            python=target.python,
            key_file=_key(env, target.key_file),
            ssh_args=target.ssh_args,
        )
        try:
            return await self._hosts.host_mesh()
        except _LAUNCH_ERRORS as exc:
            raise EnvError(f"{env.spec.name}: ssh: {exc}") from exc

    async def close(self) -> None:
        """End the ssh sessions, and with them the agents and their workers."""
        hosts, self._hosts = self._hosts, None
        if hosts is not None:
            await hosts.close()


class SlurmLauncher:
    """Nodes of a SLURM job submitted for the mesh (see :class:`amesh._hosts.SlurmJob`),
    an agent on each from an agent bundle; the job is cancelled at :meth:`close`."""

    def __init__(self) -> None:
        self._job: SlurmJob | None = None

    async def open(self, target: Target, env: Env, wheels: Sequence[Wheel]) -> HostMesh:
        """Submit the job, wait for its agents and attach to them.

        Raises:
            EnvError: ``sbatch`` refused the job, or its agents did not start.
        """
        assert isinstance(target, SlurmTarget)
        account = ("-A", target.account) if target.account else ()
        self._job = SlurmJob(
            target.nodes,
            # (a name of its own: SlurmJob gives a running job of the same name back)
            name=f"{env.spec.name[:48]}-{uuid.uuid4().hex[:12]}",
            partition=target.partition,
            time=target.time,
            python=target.python,
            sbatch_args=(*account, *target.sbatch_args),
            bundle=await _bundle(wheels),
            wrap=target.wrap,
        )
        try:
            return await self._job.host_mesh()
        except _LAUNCH_ERRORS as exc:
            await self.close()
            raise EnvError(f"{env.spec.name}: slurm: {exc}") from exc

    async def close(self) -> None:
        """Cancel the job (``scancel``)."""
        job, self._job = self._job, None
        if job is not None:
            await anyio.to_thread.run_sync(job.cancel)


_LAUNCHERS: dict[str, LauncherFactory] = {
    "local": LocalLauncher,
    "hosts": HostsLauncher,
    "ssh": SshLauncher,
    "slurm": SlurmLauncher,
}


def register_launcher(name: str, factory: LauncherFactory) -> None:
    """Make ``factory()`` the launcher of targets whose ``launcher`` is ``name``
    (``ssh``, ``slurm``), replacing any before."""
    _LAUNCHERS[name] = factory


def check_launcher(target: Target) -> LauncherFactory:
    """What makes ``target``'s launchers.

    Raises:
        EnvError: no launcher of that name is registered yet.
    """
    factory = _LAUNCHERS.get(target.launcher)
    if factory is None:
        raise EnvError(
            f"launcher {target.launcher!r} is not available yet "
            f"(available: {', '.join(sorted(_LAUNCHERS))})"
        )
    return factory


def launcher_for(target: Target) -> Launcher:
    """A new launcher for ``target``.

    Raises:
        EnvError: no launcher of that name is registered yet.
    """
    return check_launcher(target)()


def host_count(target: Target) -> int:
    """How many hosts ``target`` has: known from the file, before any starts."""
    if isinstance(target, LocalTarget):
        return 1
    if isinstance(target, HostsTarget):
        return len(target.agents)
    if isinstance(target, SshTarget):
        return len(target.hosts)
    assert isinstance(target, SlurmTarget)
    return target.nodes
