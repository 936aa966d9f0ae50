"""Where an environment runs: a launcher per kind of target brings its hosts up.

A target of the environment file names its launcher (``local``, ``hosts``, ``ssh``,
``slurm``). A :class:`Launcher` turns the target into a :class:`~amesh.HostMesh` of
attached host agents, before anything is sent to them (the environment's venv and
workspace are the caller's work: :mod:`._environment`), and cleans up after: agents
it started, a job it submitted. Launchers are found by name in a registry
(:func:`register_launcher`), so a launcher lives in a module of its own and this one
knows only their protocol; ``local`` (this machine's agent) and ``hosts`` (agents
already running) are here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from .._errors import SupervisionError
from .._hosts import HostMesh, attach, local_hosts
from ._base import EnvError
from ._file import HostsTarget, LocalTarget, SlurmTarget, SshTarget, Target
from ._open import Env
from ._wheels import Wheel

__all__ = [
    "HostsLauncher",
    "Launcher",
    "LocalLauncher",
    "check_launcher",
    "host_count",
    "launcher_for",
    "register_launcher",
]


class Launcher(Protocol):
    """Brings the hosts of one target up for one environment, and down after.

    One launcher serves one mesh: :meth:`open` once, :meth:`close` once after (also
    when what followed :meth:`open` failed).
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
        key = str(env.spec.resolve(target.key_file)) if target.key_file else None
        try:
            return await attach(list(target.agents), key_file=key)
        except (OSError, RuntimeError, SupervisionError, TimeoutError, ValueError) as exc:
            raise EnvError(f"{env.spec.name}: {exc}") from exc

    async def close(self) -> None:
        """Nothing: the agents were there before, and stay."""


_LAUNCHERS: dict[str, LauncherFactory] = {"local": LocalLauncher, "hosts": HostsLauncher}


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
