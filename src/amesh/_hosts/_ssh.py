"""ssh: agents on machines reached with the user's own ssh, for any fleet of machines
(cloud VMs, a lab's workstations) that have nothing but Python.

``hosts = await SshHosts(["10.0.0.5", "10.0.0.6"], bundle).host_mesh()`` runs, on each
machine, ``ssh -o BatchMode=yes HOST python3 -c BOOTSTRAP ...`` (the bootstrap of
:mod:`._bootstrap_host`, sent as text) and talks to it over the session's stdin and
stdout: the job key first (never on a command line), then, if the host lacks the
agent's venv for this bundle, the bundle's wheels; the bootstrap builds the venv once
(``~/.cache/amesh/agents/<bundle digest>``), starts ``amesh agent`` in it and answers
with its address, which this controller attaches to. The agents live as long as their
ssh sessions: :meth:`SshHosts.close` (or this controller's exit, which closes the
sessions' stdin) ends them, and their workers with them.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from typing import IO

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from .._identity import job_key, read_key_file
from .._runtime import bridged, current_runtime
from ._bootstrap_host import source
from ._bundle import AgentBundle
from ._remote import HostMesh, attach

__all__ = ["SshHosts"]

#: the longest line the bootstrap says (an agent's address)
_LINE = 4096
#: seconds a closed session's bootstrap has to stop its agent before ssh is killed
_CLOSE_GRACE = 10.0
#: bytes of a failed session's stderr an error shows
_SHOWN = 2000


class SshHosts:
    """Machines reached over ssh, each running an ``amesh agent`` from ``bundle``.

    Args:
        hosts: ssh destinations (``HOST`` or ``USER@HOST``), one agent each.
        bundle: the agent's wheels (see :func:`~._bundle.agent_bundle`).
        user: ``ssh -l``; None: ssh's own choice.
        python: the interpreter on the hosts.
        identity: ``ssh -i``; None: ssh's own keys (or agent).
        port: ``ssh -p``; None: ssh's own choice.
        ssh_args: more ssh options (``("-o", "UserKnownHostsFile=...")``).
        key_file: the key the agents admit; None: this controller's job key.
        wrap: a command each agent runs under, before the interpreter.
        timeout: seconds for every agent to start (a first start builds its venv).
    """

    def __init__(
        self,
        hosts: Sequence[str],
        bundle: AgentBundle,
        *,
        user: str | None = None,
        python: str = "python3",
        identity: str | None = None,
        port: int | None = None,
        ssh_args: Sequence[str] = (),
        key_file: str | None = None,
        wrap: Sequence[str] = (),
        timeout: float = 300.0,
    ) -> None:
        if not hosts:
            raise ValueError("SshHosts needs at least one host")
        self.hosts = list(hosts)
        self.bundle = bundle
        self.python = python
        self.key_file = key_file
        self.wrap = tuple(wrap)
        self.timeout = timeout
        self._ssh = ["ssh", "-o", "BatchMode=yes", "-T"]
        if user:
            self._ssh += ["-l", user]
        if identity:
            self._ssh += ["-i", identity, "-o", "IdentitiesOnly=yes"]
        if port:
            self._ssh += ["-p", str(port)]
        self._ssh += list(ssh_args)
        self._sessions: list[Process] = []
        #: each session's stderr (ssh's and the agent's log), for errors
        self._logs: list[IO[bytes]] = []

    def __repr__(self) -> str:
        return f"<SshHosts {len(self.hosts)} host(s), {len(self._sessions)} session(s)>"

    @bridged
    async def host_mesh(self) -> HostMesh:
        """Start an agent on every host (building its venv where it lacks one) and
        attach to them.

        Raises:
            RuntimeError: a host's session failed (ssh refused, no Python, the venv
                did not build); the message names the host and what it said. Every
                session started is closed again.
            TimeoutError: the agents did not all start within ``timeout`` seconds.
        """
        rt = current_runtime()
        scheme, _, rest = rt.address.partition("://")
        if scheme not in ("stream+tcp", "tls+tcp"):
            raise RuntimeError(
                f"this controller listens at {rt.address}, which other machines cannot "
                "reach: start it with AMESH_TRANSPORT=tcp and AMESH_HOST=<its address>"
            )
        controller = rest.rsplit(":", 1)[0].strip("[]")
        key = read_key_file(self.key_file) if self.key_file else job_key()
        addrs: list[str] = [""] * len(self.hosts)
        try:
            with anyio.fail_after(self.timeout):
                async with anyio.create_task_group() as tg:
                    for i in range(len(self.hosts)):
                        tg.start_soon(
                            self._start, i, key, f"{scheme}://0.0.0.0:0", controller, addrs
                        )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.close()
            raise
        return await attach(addrs, key_file=self.key_file)

    def _remote(self, listen: str, controller: str) -> str:
        manifest = json.dumps(self.bundle.manifest, separators=(",", ":"))
        cmd = [*self.wrap, self.python, "-c", source(), "--manifest", manifest, "--stdin"]
        cmd += ["--listen", listen, "--route-to", controller]
        return shlex.join(cmd)

    async def _start(
        self, i: int, key: bytes, listen: str, controller: str, addrs: list[str]
    ) -> None:
        host = self.hosts[i]
        cmd = [*self._ssh, host, self._remote(listen, controller)]
        log = tempfile.TemporaryFile()
        self._logs.append(log)
        proc = await anyio.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
        )
        self._sessions.append(proc)
        assert proc.stdin is not None and proc.stdout is not None
        said = BufferedByteReceiveStream(proc.stdout)
        try:
            await proc.stdin.send(key.hex().encode() + b"\n")
            line = await said.receive_until(b"\n", _LINE)
            if line == b"need":
                await self._send_wheels(proc)
                line = await said.receive_until(b"\n", _LINE)
            if line != b"have":
                raise RuntimeError(f"the bootstrap said {line[:200]!r}")
            line = await said.receive_until(b"\n", _LINE)
            if not line.startswith(b"agent "):
                raise RuntimeError(f"the bootstrap said {line[:200]!r}")
            addrs[i] = line[len(b"agent ") :].decode()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            ended = await _ended(proc)
            raise RuntimeError(
                f"host {host}: its ssh session ended ({ended}): {_tail(log)}"
            ) from None
        except RuntimeError as exc:
            raise RuntimeError(f"host {host}: {exc}: {_tail(log)}") from None

    async def _send_wheels(self, proc: Process) -> None:
        """The bundle's wheels, framed as :func:`~._bootstrap_host.read_frames` reads."""
        assert proc.stdin is not None
        for name, sha in self.bundle.manifest:
            path = self.bundle.path(sha)
            assert path is not None, name
            await proc.stdin.send(f"{path.stat().st_size}\n".encode())
            with open(path, "rb") as f:  # noqa: ASYNC230 (chunked reads, in a thread)
                while block := await anyio.to_thread.run_sync(f.read, 1 << 20):
                    await proc.stdin.send(block)

    @bridged
    async def close(self) -> None:
        """End every session: the bootstraps stop their agents (and those their
        workers); ssh is killed if one has not ended within a grace period."""
        sessions, self._sessions = self._sessions, []
        logs, self._logs = self._logs, []
        for proc in sessions:
            if proc.stdin is not None:
                await proc.stdin.aclose()
        for proc in sessions:
            with anyio.move_on_after(_CLOSE_GRACE):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await proc.aclose()
        for log in logs:
            log.close()


async def _ended(proc: Process) -> str:
    """How a session ended, for an error (its exit status)."""
    with anyio.move_on_after(5):
        await proc.wait()
    return f"exit status {proc.returncode}"


def _tail(log: IO[bytes]) -> str:
    """The end of a session's stderr."""
    log.seek(0, 2)
    size = log.tell()
    log.seek(max(0, size - _SHOWN))
    return log.read().decode(errors="replace").strip()
