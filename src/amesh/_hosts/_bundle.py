"""What a launcher brings to a host that has nothing but Python: the agent's bundle
(amesh's wheel and its dependencies', the ``env`` extra's included), and the
short-lived server from which a batch job's nodes fetch it and announce their agents.

A bundle is content-addressed: its digest (of its wheels' names and hashes) names the
agent's venv on each host (``~/.cache/amesh/agents/<digest>``, see
:mod:`._bootstrap_host`), so that a host builds it once and every later launch of the
same bundle, by any controller, finds it made.
"""

from __future__ import annotations

import hmac
import os
import threading
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._depot import file_digest, repack
from ._bootstrap_host import AUTH_HEADER, bundle_digest, sign

if TYPE_CHECKING:
    import http.server

__all__ = ["AgentBundle", "LaunchServer", "agent_bundle"]

#: the extra whose packages an agent needs besides amesh's own (uv builds venvs)
_AGENT_EXTRA = "env"


@dataclass(frozen=True)
class AgentBundle:
    """The wheels that make an agent's venv on a host.

    Attributes:
        wheels: ``(file name, sha256, local path)`` of each: amesh's, its
            dependencies', and the ``env`` extra's (``uv`` among them).
    """

    wheels: tuple[tuple[str, str, str], ...]

    @property
    def manifest(self) -> list[tuple[str, str]]:
        """``(file name, sha256)`` of each wheel, sorted by name."""
        return sorted((name, sha) for name, sha, _ in self.wheels)

    @property
    def digest(self) -> str:
        """The bundle's identity (names the agent's venv on each host)."""
        return bundle_digest(self.manifest)

    def path(self, sha: str) -> Path | None:
        """The local file of the wheel whose sha256 is ``sha``; None if none is."""
        for _, digest, path in self.wheels:
            if digest == sha:
                return Path(path)
        return None


def _wheel_requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of ``wheel``'s metadata."""
    from email.parser import BytesParser  # (what only a launch needs is imported then)

    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = BytesParser().parsebytes(z.read(name), headersonly=True)
    return metadata.get_all("Requires-Dist") or []


def _requirements_of(requires: list[str], extras: Sequence[str]) -> list[str]:
    """The distributions that ``requires`` (with ``extras``) need, as installed here,
    recursively."""
    import importlib.metadata as md

    from packaging.requirements import Requirement  # (the env extra)

    seen: dict[str, None] = {}
    todo: list[tuple[list[str], tuple[str, ...]]] = [(requires, tuple(extras))]
    while todo:
        lines, wanted = todo.pop()
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": extra}) for extra in ("", *wanted)
            ):
                continue
            key = req.name.lower().replace("_", "-")
            if key not in seen:
                seen[key] = None
                todo.append((md.distribution(key).requires or [], tuple(req.extras)))
    return list(seen)


def agent_bundle(amesh_wheel: str | os.PathLike[str], out: str | os.PathLike[str]) -> AgentBundle:
    """The bundle of ``amesh_wheel`` (built from this amesh's source, see
    :func:`amesh._env.amesh_wheel`) and the wheels of its dependencies as this
    interpreter has them installed, repacked into ``out`` (the same bytes every time:
    hosts that have them are sent nothing).

    Hosts must run the controller's Python version on its platform: the compiled
    wheels (msgspec, cryptography, ...) are this interpreter's.

    Raises:
        PackageNotFoundError: a dependency is not installed here.
    """
    Path(out).mkdir(parents=True, exist_ok=True)
    wheels = [Path(amesh_wheel)]
    deps = _requirements_of(_wheel_requires(wheels[0]), [_AGENT_EXTRA])
    wheels += [repack(dep, out) for dep in deps if dep != "amesh"]
    return AgentBundle(tuple((w.name, file_digest(w), str(w)) for w in wheels))


class LaunchServer:
    """An HTTP server on the controller, for as long as a launch takes: nodes fetch
    the bundle's wheels (``GET /wheel/<sha256>``) and announce their agents (``POST
    /agent/<node>``, the body the agent's address). Every request carries an HMAC of
    itself with the job key (:func:`~._bootstrap_host.sign`); others get 403.

    Args:
        host: the controller's address where the nodes reach it.
        key: the job key.
        bundle: what it serves.
        on_agent: called (in the server's thread) with each node's name and address.
    """

    def __init__(
        self,
        host: str,
        key: bytes,
        bundle: AgentBundle,
        on_agent: Callable[[str, str], None],
    ) -> None:
        import http.server

        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._get(self)

            def do_POST(self) -> None:
                server._post(self)

            def log_message(self, format: str, *args: object) -> None:
                pass  # (quiet: a launch's requests are not worth a line each)

        self.key = key
        self.bundle = bundle
        self.on_agent = on_agent
        self._http = http.server.ThreadingHTTPServer((host, 0), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """Where the nodes reach it."""
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    @contextmanager
    def serving(self) -> Iterator[LaunchServer]:
        """Serve until the block ends."""
        self._thread.start()
        try:
            yield self
        finally:
            self._http.shutdown()
            self._http.server_close()
            self._thread.join()

    def _allowed(self, req: http.server.BaseHTTPRequestHandler, body: bytes) -> bool:
        want = sign(self.key, req.command, req.path, body)
        if hmac.compare_digest(want, req.headers.get(AUTH_HEADER, "")):
            return True
        req.send_error(403)
        return False

    def _get(self, req: http.server.BaseHTTPRequestHandler) -> None:
        if not self._allowed(req, b""):
            return
        prefix = "/wheel/"
        path = self.bundle.path(req.path[len(prefix) :]) if req.path.startswith(prefix) else None
        if path is None:
            req.send_error(404)
            return
        req.send_response(200)
        req.send_header("Content-Length", str(path.stat().st_size))
        req.end_headers()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                req.wfile.write(block)

    def _post(self, req: http.server.BaseHTTPRequestHandler) -> None:
        body = req.rfile.read(int(req.headers.get("Content-Length") or 0))
        if not self._allowed(req, body):
            return
        if not req.path.startswith("/agent/"):
            req.send_error(404)
            return
        self.on_agent(req.path[len("/agent/") :], body.decode())
        req.send_response(204)
        req.end_headers()
