"""A host agent's depot: the blobs, venvs and workspace trees it keeps for
environments (see :mod:`amesh._depot`), and the endpoints controllers reach them by.

Everything arrives over the job's authenticated link, as any call to the agent does:
its listener admits only peers that prove they hold the job key. A controller asks
which blobs the host lacks (:meth:`DepotEndpoints.depot_missing`), sends those in
chunks (:meth:`DepotEndpoints.depot_put`; small ones many to a call,
:meth:`DepotEndpoints.depot_put_many`), then asks the host to build the
environment's venv (:meth:`DepotEndpoints.realise_env`) and the workspace's tree
(:meth:`DepotEndpoints.materialise`). The depot lives in ``AMESH_DEPOT_DIR``, else
``<state dir>/depot``.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Any

import anyio

from .._config import settings
from .._depot import (
    MARKER,
    BlobStore,
    BlobWriter,
    Manifest,
    PythonError,
    check_python,
    materialise,
    python_version,
    realise_venv,
)
from .._model import endpoint
from .._runtime import call_context
from ._home import state_dir

__all__ = ["DepotEndpoints", "HostDepot", "depot_dir"]

log = logging.getLogger("amesh.agent")

#: bytes in one chunk of a blob on the wire (a few travel at once to each host)
CHUNK = 4 << 20


def depot_dir() -> Path:
    """Where this host's depot lives: ``AMESH_DEPOT_DIR``, else ``<state dir>/depot``."""
    path = Path(settings().depot_dir or state_dir() / "depot")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


class HostDepot:
    """The depot of one agent: its store, and the blobs arriving (by sender and digest).

    Args:
        root: the depot's directory.
        host: how errors name this host.
    """

    def __init__(self, root: Path, host: str) -> None:
        self.root = root
        self.host = host
        self.store = BlobStore(root)
        self._arriving: dict[tuple[str, str], BlobWriter] = {}

    def put(self, sender: str, digest: str, offset: int, data: bytes, last: bool) -> None:
        """Write one chunk of blob ``digest`` from ``sender``; store it after the last.

        Raises:
            ValueError: the chunk is not where the blob ends (see :class:`BlobWriter`).
            DigestError: the blob's bytes do not have its digest (nothing is kept).
        """
        key = (sender, digest)
        writer = self._arriving.get(key)
        if writer is None:
            if offset != 0:
                raise ValueError(f"blob {digest[:12]}: a chunk at {offset} of none begun")
            writer = self._arriving[key] = self.store.writer(digest)
        try:
            writer.write(data, offset)
            if last:
                del self._arriving[key]
                writer.commit()
        except BaseException:
            self._arriving.pop(key, None)
            writer.abort()
            raise

    def drop(self, sender: str) -> None:
        """Drop the blobs still arriving from ``sender`` (it is gone)."""
        for key in [k for k in self._arriving if k[0] == sender]:
            self._arriving.pop(key).abort()

    def close(self) -> None:
        """Drop the blobs still arriving (the agent exits)."""
        for writer in self._arriving.values():
            writer.abort()
        self._arriving.clear()


def _sender() -> str:
    ctx = call_context.get()
    return ctx.sender if ctx is not None else ""


class DepotEndpoints:
    """The depot's endpoints, mixed into :class:`~amesh._hosts._agent.HostAgent`."""

    #: made on first use (see :meth:`depot`)
    _depot: HostDepot | None = None
    host: str

    def depot(self) -> HostDepot:
        """This agent's depot (opened on first use)."""
        if self._depot is None:
            self._depot = HostDepot(depot_dir(), f"{socket.gethostname()} ({self.host})")
        return self._depot

    def drop_arriving(self, sender: str) -> None:
        """Drop the blobs still arriving from controller ``sender`` (it is gone)."""
        if self._depot is not None:
            self._depot.drop(sender)

    def close_depot(self) -> None:
        """Drop what is still arriving (the agent exits)."""
        if self._depot is not None:
            self._depot.close()

    @endpoint(concurrent=True)
    def depot_missing(self, digests: list[str]) -> list[str]:
        """Those of the blobs ``digests`` (SHA-256, hex) that this host lacks."""
        return self.depot().store.missing(digests)

    @endpoint(concurrent=True)
    async def depot_put(self, digest: str, offset: int, data: bytes, last: bool) -> None:
        """Write ``data`` at ``offset`` of blob ``digest`` (chunks in order, each
        blob's from one sender); with ``last`` the blob is checked against its digest
        and stored (or refused: nothing is kept)."""
        depot, sender = self.depot(), _sender()
        await anyio.to_thread.run_sync(depot.put, sender, digest, offset, data, last)

    @endpoint(concurrent=True)
    async def depot_put_many(self, blobs: list[tuple[str, bytes]]) -> None:
        """Store each of ``blobs``, ``(digest, bytes)`` whole (small files travel
        together); one whose bytes do not have its digest is refused (raises), and
        those after it in the list are not stored."""
        store = self.depot().store
        await anyio.to_thread.run_sync(lambda: [store.put(d, [data]) for d, data in blobs])

    @endpoint(concurrent=True)
    async def realise_env(
        self,
        env_hash: str,
        requirements: str,
        wheels: list[tuple[str, str]],
        python_spec: str = "",
    ) -> str:
        """The python of environment ``env_hash``'s venv here, built (once) from the
        wheels ``(filename, sha256)`` sent before; see :func:`amesh._depot.realise_venv`."""
        depot = self.depot()
        python = await anyio.to_thread.run_sync(
            lambda: realise_venv(
                depot.store,
                depot.root,
                env_hash,
                requirements,
                wheels,
                sys.executable,
                python_spec=python_spec,
                host=depot.host,
            )
        )
        return str(python)

    @endpoint(concurrent=True)
    async def materialise(self, manifest: Manifest) -> str:
        """The tree of workspace ``manifest`` here (made once, of blobs sent before)."""
        depot = self.depot()
        tree = await anyio.to_thread.run_sync(materialise, depot.store, depot.root, manifest)
        return str(tree)

    @endpoint(concurrent=True)
    async def env_needs(
        self, env_hash: str, python_spec: str, digests: list[str]
    ) -> dict[str, Any]:
        """What this host would need of an environment, without building anything:
        ``python`` (its agent's version, ``"3.11.4"``), ``python_fits`` (""; else
        why its Python does not satisfy ``python_spec``), ``venv`` (the venv of
        ``env_hash`` is built here already; False for ""), ``missing`` (those of the
        blobs ``digests`` that it lacks)."""
        depot = self.depot()

        def ask() -> dict[str, Any]:
            fits = ""
            if python_spec:
                try:
                    check_python(sys.executable, python_spec, depot.host)
                except (PythonError, ValueError) as exc:
                    fits = str(exc)
            built = bool(env_hash) and (depot.root / "venvs" / env_hash / MARKER).exists()
            return {
                "python": ".".join(map(str, python_version(sys.executable))),
                "python_fits": fits,
                "venv": built,
                "missing": depot.store.missing(digests),
            }

        return await anyio.to_thread.run_sync(ask)
