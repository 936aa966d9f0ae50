"""The Host of a ProcMesh spawned from an environment: it brings the target's hosts
up and gives them the environment when the mesh starts, before any process does.

A ProcMesh is made synchronously (so that ``async with`` and ``await`` both start
it), but its hosts need network work first: the wheels fetched into the controller's
cache, the target's launcher opened, each host sent what it lacks and its venv and
workspace tree built. :class:`EnvHost` does that in ``make_room``, the hook that the
mesh's lifecycle awaits before it starts any process, so that every error (a wheel
that does not fetch, a host that cannot be reached, a Python that does not satisfy
the file's) comes before a worker runs. From then on it is the provisioned hosts'
placement (:meth:`amesh.HostMesh.placement`), and ``sync_workspace`` gives the hosts
the workspace as it is now.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from .._depot import HashCache, scan
from .._hosts import EnvPackages, HostMesh, ProvisionError
from .._mesh import Holder, ProcHandle
from ._base import EnvError
from ._file import Target
from ._open import Env
from ._targets import Launcher, launcher_for
from ._wheels import Wheel, fetch_wheels

if TYPE_CHECKING:
    from pathlib import Path

    from .._bootstrap import WorkerSpec
    from .._runtime import Runtime

__all__ = ["EnvHost", "Fetching", "packages_of"]

log = logging.getLogger("amesh.env")


class Fetching:
    """Where an environment's wheels come from (see :func:`fetch_wheels`).

    Args:
        find_links: directories of distributions, besides the index.
        no_index: from ``find_links`` only.
    """

    def __init__(self, find_links: Sequence[str | Path] = (), no_index: bool = False) -> None:
        self.find_links = tuple(find_links)
        self.no_index = no_index

    def wheels(self, env: Env) -> list[Wheel]:
        """``env``'s wheels in the controller's cache, fetched once (blocking)."""
        return fetch_wheels(env.lock, find_links=self.find_links, no_index=self.no_index)


def packages_of(env: Env, wheels: Sequence[Wheel]) -> EnvPackages:
    """``env`` as hosts are given it: every wheel pinned by its hash."""
    lines = []
    for wheel in wheels:
        dist, version = wheel.filename.split("-")[:2]
        lines.append(f"{dist}=={version} --hash=sha256:{wheel.sha256}\n")
    return EnvPackages(
        env_hash=env.hash,
        requirements="".join(sorted(lines)),
        wheels=[(w.filename, w.sha256, w.path) for w in wheels],
        python_spec=env.spec.python,
    )


class EnvHost:
    """Where a ProcMesh of an environment starts its processes: ``per_host`` on each
    host of ``target``, provisioned when the mesh starts (see the module's docstring).

    Args:
        env: the environment.
        target_name: the target's name in the file (for messages).
        target: where it runs.
        per_host: processes on each host.
        fetching: where its wheels come from.
        mesh_name: the persistent mesh it starts processes for ("": none).
    """

    def __init__(
        self,
        env: Env,
        target_name: str,
        target: Target,
        per_host: int,
        fetching: Fetching,
        mesh_name: str = "",
    ) -> None:
        self.env = env
        self.target_name = target_name
        self.target = target
        #: processes per host (ProcMesh reads it: the relay tree goes by host)
        self.per_host = per_host
        self.mesh_name = mesh_name
        self._fetching = fetching
        self._launcher: Launcher | None = None
        self._hosts: HostMesh | None = None
        self._placement: Holder | None = None
        #: file digests of earlier scans: a sync hashes only files that changed
        self._scanned = HashCache()
        self._lock = anyio.Lock()

    def __repr__(self) -> str:
        return f"<environment {self.env.spec.name} on target {self.target_name}>"

    @property
    def hosts(self) -> HostMesh | None:
        """The target's hosts, provisioned (None before the mesh starts)."""
        return self._hosts

    def _where(self) -> str:
        return f"environment {self.env.spec.name}, target {self.target_name!r}"

    def _roots(self) -> list[Path]:
        return self.env.spec.workspace_roots()

    async def _scan(self) -> Any:
        roots, excludes = self._roots(), list(self.env.spec.workspace.exclude)
        try:
            return await anyio.to_thread.run_sync(scan, roots, excludes, self._scanned)
        except (OSError, ValueError) as exc:
            raise EnvError(f"{self._where()}: workspace: {exc}") from exc

    async def _open(self) -> Holder:
        """The provisioned hosts' placement, made on first use."""
        async with self._lock:
            if self._placement is not None:
                return self._placement
            launcher = launcher_for(self.target)
            wheels = await anyio.to_thread.run_sync(self._fetching.wheels, self.env)
            workspace = await self._scan()
            try:
                hosts = await launcher.open(self.target, self.env, wheels)
                hosts = await hosts.provision(packages_of(self.env, wheels), workspace)
            except BaseException as exc:
                # (what the launcher started before it failed, too: ssh sessions)
                with anyio.CancelScope(shield=True):
                    await launcher.close()
                if isinstance(exc, ProvisionError):
                    raise EnvError(f"{self._where()}: {exc}") from exc
                raise
            self._launcher, self._hosts = launcher, hosts
            self._placement = hosts.placement(self.per_host, self.mesh_name)
            return self._placement

    async def make_room(self, slots: Sequence[int]) -> None:
        """Provision the target's hosts (once), then ask them for room for ``slots``.

        Raises:
            EnvError: a wheel did not fetch, a host could not be reached or given
                the environment (the message names it and why).
            OSError: a host has no room (see :meth:`amesh.HostMesh.placement`).
        """
        placement = await self._open()
        room = getattr(placement, "make_room", None)
        if room is not None:
            await room(slots)

    async def start_proc(self, rt: Runtime, spec: WorkerSpec) -> ProcHandle:
        """Start the worker of ``spec.slot`` on its host, in the environment."""
        placement = await self._open()
        return await placement.start_proc(rt, spec)

    async def hold(self, record: dict[str, Any]) -> None:
        """Keep a persistent mesh's record with its agents (see Holder)."""
        await (await self._open()).hold(record)

    async def release(self) -> None:
        """Forget a persistent mesh's record (see Holder)."""
        await (await self._open()).release()

    async def sync_workspace(self, slots: Sequence[int]) -> list[tuple[str, str]]:
        """Send each host the workspace as it is now (only what changed); each of
        ``slots``'s ``(old tree, new tree)`` on its host. Processes started after
        start in the new trees.

        Raises:
            EnvError: a host could not be given it.
        """
        await self._open()
        assert self._hosts is not None
        workspace = await self._scan()
        async with self._lock:
            before = self._hosts.delivered or []
            try:
                hosts = await self._hosts.provision(workspace=workspace)
            except ProvisionError as exc:
                raise EnvError(f"{self._where()}: sync: {exc}") from exc
            self._hosts = hosts
            self._placement = hosts.placement(self.per_host, self.mesh_name)
        after = hosts.delivered or []
        moves = []
        for slot in slots:
            i = slot // self.per_host
            old = before[i].workspace if i < len(before) else ""
            new = after[i].workspace if i < len(after) else ""
            moves.append((old, new))
        return moves

    async def aclose(self) -> None:
        """Close the launcher (the mesh has stopped)."""
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            await launcher.close()
