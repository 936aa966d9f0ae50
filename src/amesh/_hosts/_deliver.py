"""The controller's side of environments on host agents: send each host what it lacks
of an environment's wheels and a workspace's files, then have it build the venv and
the tree (see :mod:`._provision` for the agent's side).

Hosts are served in parallel; to each, a few calls travel at once
(:data:`IN_FLIGHT`): a large blob's chunks of :data:`~._provision.CHUNK` bytes, in
order, or a batch of small blobs (:data:`SMALL`) of as many bytes. A
host that has a blob already (an earlier run, another controller) is sent nothing of
it: a second delivery of the same environment and workspace moves no bytes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec

from .._bootstrap import WorkerSpec
from .._depot import Scanned
from .._model import ActorMesh
from ._agent import HostAgent
from ._provision import CHUNK

__all__ = [
    "IN_FLIGHT",
    "Delivered",
    "EnvPackages",
    "ProvisionError",
    "deliver",
    "in_delivered",
]

#: calls in flight to one host at a time (a blob's chunks go one at a time)
IN_FLIGHT = 4
#: a blob this small travels with others, up to a chunk's bytes a call: a workspace's
#: thousands of small files would otherwise cost a round trip each
SMALL = 256 << 10


class ProvisionError(RuntimeError):
    """Hosts could not be given an environment or a workspace; the message names each
    host and what it said."""


@dataclass(frozen=True)
class EnvPackages:
    """An environment as a controller hands it to hosts.

    Attributes:
        env_hash: its identity (names its venv on each host).
        requirements: a requirements text, every line pinned with its ``--hash``.
        wheels: ``(filename, sha256, local path)`` of each wheel it installs.
        python_spec: the versions of Python it takes (``">=3.11,<3.14"``; "": any).
    """

    env_hash: str
    requirements: str
    wheels: Sequence[tuple[str, str, str | os.PathLike[str]]]
    python_spec: str = ""


@dataclass(frozen=True)
class Delivered:
    """What one host has now.

    Attributes:
        host: its address (as its agent said).
        python: the interpreter of the environment's venv there ("": its agent's own).
        workspace: the workspace's tree there ("": none).
        blobs_sent: how many blobs this delivery sent it.
        bytes_sent: their bytes.
    """

    host: str
    python: str = ""
    workspace: str = ""
    blobs_sent: int = 0
    bytes_sent: int = 0


@dataclass
class _Sending:
    """What one delivery to one host sent."""

    blobs: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)


async def _send_blob(agent: ActorMesh[HostAgent], digest: str, path: Path, sent: _Sending) -> None:
    """Send the file at ``path`` (blob ``digest``) to ``agent`` in chunks."""
    with open(path, "rb") as f:  # noqa: ASYNC230 (reads are chunked, in a thread)
        offset = 0
        while True:
            data = await anyio.to_thread.run_sync(f.read, CHUNK)
            last = len(data) < CHUNK
            await agent.depot_put.call_one(digest, offset, data, last)
            offset += len(data)
            if last:
                break
    sent.blobs += 1
    sent.bytes += offset


async def _send_missing(
    agent: ActorMesh[HostAgent], sources: dict[str, Path], in_flight: int, sent: _Sending
) -> None:
    """Send ``agent`` those of ``sources`` (digest -> local file) that it lacks."""
    missing: list[str] = await agent.depot_missing.call_one(list(sources))
    limit = anyio.Semaphore(in_flight)

    async def one(digest: str) -> None:
        async with limit:
            await _send_blob(agent, digest, sources[digest], sent)

    async def batch(digests: list[str]) -> None:
        async with limit:
            await _send_small(agent, [(d, sources[d]) for d in digests], sent)

    sizes = await anyio.to_thread.run_sync(lambda: [os.path.getsize(sources[d]) for d in missing])
    async with anyio.create_task_group() as tg:
        small: list[str] = []
        size = 0
        for digest, n in zip(missing, sizes):
            if n > SMALL:
                tg.start_soon(one, digest)
                continue
            if size + n > CHUNK:
                tg.start_soon(batch, small)
                small, size = [], 0
            small.append(digest)
            size += n
        if small:
            tg.start_soon(batch, small)


async def _send_small(
    agent: ActorMesh[HostAgent], blobs: list[tuple[str, Path]], sent: _Sending
) -> None:
    """Send small blobs ``(digest, local file)`` to ``agent`` in one call."""
    loaded = await anyio.to_thread.run_sync(lambda: [(d, p.read_bytes()) for d, p in blobs])
    await agent.depot_put_many.call_one(loaded)
    sent.blobs += len(loaded)
    sent.bytes += sum(len(data) for _, data in loaded)


async def _deliver_one(
    agent: ActorMesh[HostAgent],
    host: str,
    env: EnvPackages | None,
    workspace: Scanned | None,
    sources: dict[str, Path],
    in_flight: int,
) -> Delivered:
    sent = _Sending()
    await _send_missing(agent, sources, in_flight, sent)
    python = ""
    if env is not None:
        wheels = [(name, digest) for name, digest, _ in env.wheels]
        python = await agent.realise_env.call_one(
            env.env_hash, env.requirements, wheels, env.python_spec
        )
    tree = ""
    if workspace is not None:
        tree = await agent.materialise.call_one(workspace.manifest)
    return Delivered(host, python, tree, sent.blobs, sent.bytes)


async def deliver(
    agents: ActorMesh[HostAgent],
    hosts: Sequence[str],
    env: EnvPackages | None = None,
    workspace: Scanned | None = None,
    *,
    in_flight: int = IN_FLIGHT,
) -> list[Delivered]:
    """Give each host agent of ``agents`` (one dimension, ``hosts``; ``hosts`` names
    them) environment ``env``'s venv and ``workspace``'s tree, sending only the blobs
    it lacks; what each has, in host order.

    Raises:
        ProvisionError: a host failed (its Python does not satisfy the environment's,
            a wheel did not install, a blob arrived damaged); the message names each
            host that failed and why. The others are delivered to all the same.
    """
    sources: dict[str, Path] = {}
    if env is not None:
        sources.update((digest, Path(path)) for _, digest, path in env.wheels)
    if workspace is not None:
        sources.update(workspace.sources)
    done: list[Delivered | None] = [None] * len(hosts)
    errors: list[str] = []

    async def one(i: int) -> None:
        agent = agents.slice(hosts=i)
        try:
            done[i] = await _deliver_one(agent, hosts[i], env, workspace, sources, in_flight)
        except Exception as exc:
            errors.append(f"host {hosts[i]}: {exc}")

    async with anyio.create_task_group() as tg:
        for i in range(len(hosts)):
            tg.start_soon(one, i)
    if errors:
        raise ProvisionError("; ".join(errors))
    return [d for d in done if d is not None]


def in_delivered(spec: WorkerSpec, delivered: list[Delivered] | None, index: int) -> WorkerSpec:
    """``spec`` for a worker on host ``index`` in what it was given (see
    :meth:`~amesh._hosts.HostMesh.provision`): the venv's Python, the workspace's tree
    as its working directory and first on its import path.

    A venv's worker gets ``PYTHONPATH`` set to the tree (or to nothing): the agent's
    own, which it would inherit, names packages of the agent's interpreter, which
    would shadow the venv's; and the processes it starts in turn find the tree too."""
    if delivered is None:
        return spec
    d = delivered[index]
    env = spec.env
    if d.python:
        venv = os.path.dirname(os.path.dirname(d.python))
        env = {"PYTHONPATH": d.workspace, "VIRTUAL_ENV": venv, **spec.env}
    return msgspec.structs.replace(
        spec,
        python=d.python or spec.python,
        cwd=d.workspace or spec.cwd,
        path=[d.workspace, *spec.path] if d.workspace else spec.path,
        env=env,
    )
