"""SLURM: one batch job whose steps run an ``amesh agent`` on every node.

``job = amesh.SlurmJob(nodes=4, name="train")`` and ``hosts = await job.host_mesh()``
submit the job with ``sbatch`` (one ``srun`` task per node runs ``amesh agent``), wait
until every agent has written its address to the job's directory, and attach to them
(:func:`amesh.attach`). Only the text interfaces of ``sbatch``, ``squeue -h -o`` and
``scancel`` are used, so any SLURM since 20.x works (Debian's 22.05 included, whose
``squeue --json`` ignores ``-j``).

The job is recorded in ``~/.cache/amesh/jobs/NAME/`` (``AMESH_JOBS_DIR``): its id, and
the key its agents admit (this controller's job key unless ``key_file`` is given;
readable by the owner only). A later controller asking for the same name attaches to
the job while it is pending or running instead of queueing a new one. ``job.cancel()``
ends it; it is also cancelled when the controller exits (``atexit``) unless it was made
with ``persistent=True``. Agents listen on their node's address towards the controller,
which must itself listen on tcp where the nodes reach it (``AMESH_TRANSPORT=tcp``, TLS
between hosts, or ``stream+tcp``; ``AMESH_HOST``), and speak as it does.

Without a shared filesystem (``bundle=``, see :class:`~._bundle.AgentBundle`), nothing
of the controller's files is used on the nodes: the job script carries a small
bootstrap (:mod:`._bootstrap_host`, stdlib only) and the job key (in its environment,
as SLURM keeps a job's script: readable by its owner and the cluster's administrators
only); each node's bootstrap fetches the wheels it lacks from a server the controller
runs while the job starts (:class:`~._bundle.LaunchServer`, each request signed with
the key), builds the agent's venv once per bundle, starts the agent in it and posts its
address back. Why not ``sbcast``: it copies a file from the batch host, which sees the
controller's files only on a shared filesystem.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio

from .._config import settings
from .._identity import job_key, read_key_file
from .._runtime import bridged, current_runtime
from ._agent import announce
from ._bootstrap_host import KEY_VARIABLE, source
from ._bundle import AgentBundle, LaunchServer
from ._remote import HostMesh, attach

__all__ = ["SlurmJob", "jobs_dir"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: squeue states in which the job's agents run or will run
_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING"}


def jobs_dir() -> Path:
    """Where jobs are recorded: ``AMESH_JOBS_DIR``, else ``~/.cache/amesh/jobs``."""
    return Path(settings().jobs_dir or Path.home() / ".cache" / "amesh" / "jobs")


def _run(*cmd: str, timeout: float = 30.0) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


class SlurmJob:
    """A SLURM allocation of ``nodes`` nodes running an ``amesh agent`` on each.

    Args:
        nodes: how many nodes.
        name: the job's name; a controller that asks for a running job's name gets it.
        partition: ``sbatch -p``; None for the default.
        time: ``sbatch -t`` (``"1:00:00"``); None for the partition's default.
        key_file: the key the agents admit; None: this controller's own job key.
        persistent: keep the job when the controller exits.
        python: the interpreter on the nodes (default: this one, which suits a shared
            filesystem; with ``bundle``, ``python3``).
        sbatch_args: more arguments for ``sbatch``.
        timeout: seconds to wait for every agent to start once the job runs.
        bundle: the agent's wheels, for nodes that have nothing of amesh (no shared
            filesystem; see the module doc).
        wrap: a command each node's agent runs under (``("apptainer", "exec",
            "img.sif")``, ``("unshare", ...)``), before the interpreter.
    """

    def __init__(
        self,
        nodes: int,
        name: str = "amesh",
        partition: str | None = None,
        time: str | None = None,
        *,
        key_file: str | None = None,
        persistent: bool = False,
        python: str | None = None,
        sbatch_args: tuple[str, ...] = (),
        timeout: float = 120.0,
        bundle: AgentBundle | None = None,
        wrap: tuple[str, ...] = (),
    ) -> None:
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"a SlurmJob needs at least one node, not {nodes!r}")
        if not _NAME.fullmatch(name):
            raise ValueError(f"a job name is 1-64 letters, digits, '_', '.', '-': {name!r}")
        self.nodes = nodes
        self.name = name
        self.partition = partition
        self.time = time
        self.key_file = key_file
        self.persistent = persistent
        self.python = python or ("python3" if bundle else sys.executable)
        self.bundle = bundle
        self.wrap = tuple(wrap)
        self.sbatch_args = tuple(sbatch_args)
        self.timeout = timeout
        self.dir = jobs_dir() / name
        self.job_id: str | None = None

    def __repr__(self) -> str:
        return f"<SlurmJob {self.name!r} {self.nodes} node(s) id={self.job_id}>"

    # -- the record -------------------------------------------------------------------

    def _record(self) -> dict[str, str] | None:
        try:
            data = json.loads((self.dir / "job.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def state(self) -> str:
        """The job's state as ``squeue`` says (``"RUNNING"``...), "" once it is gone."""
        if self.job_id is None:
            return ""
        try:
            return _run("squeue", "-h", "-j", self.job_id, "-o", "%T").strip()
        except RuntimeError:  # squeue forgets finished jobs: "Invalid job id"
            return ""

    # -- start or find ----------------------------------------------------------------

    @bridged
    async def host_mesh(self) -> HostMesh:
        """The job's nodes as a :class:`~amesh.HostMesh` (submitting it if no job of
        this name is pending or running).

        Raises:
            RuntimeError: sbatch failed, the job ended before its agents started, or
                this controller listens where the nodes cannot reach it.
            TimeoutError: the agents did not all start within ``timeout`` seconds of
                the job running.
        """
        rt = current_runtime()
        scheme, _, rest = rt.address.partition("://")
        if scheme not in ("stream+tcp", "tls+tcp"):
            raise RuntimeError(
                f"this controller listens at {rt.address}, which the nodes cannot reach: "
                "start it with AMESH_TRANSPORT=tcp (or tls+tcp) and AMESH_HOST=<its address "
                "on their network>"
            )
        controller = rest.rsplit(":", 1)[0].strip("[]")
        record = self._record()
        if record is not None and int(record.get("nodes", 0)) == self.nodes:
            self.job_id = record["job_id"]
            if self.state() not in _LIVE:
                self.job_id = None
        if self.job_id is None:
            key = await anyio.to_thread.run_sync(self._prepare)
        else:
            assert record is not None
            key = record["key_file"]
        with self._serving(controller, key) as url:
            if self.job_id is None:
                await anyio.to_thread.run_sync(self._submit, key, controller, scheme, url)
            elif not self.persistent:
                atexit.register(self._cancel_quietly)
            addrs = await self._agents()
        return await attach(addrs, key_file=key)

    @contextmanager
    def _serving(self, controller: str, key: str) -> Iterator[str]:
        """With a bundle, serve it (and hear the agents' addresses) while the block
        runs; the server's URL ("" without a bundle: the agents announce themselves
        in the job's directory, on the filesystem the nodes share)."""
        if self.bundle is None:
            yield ""
            return

        def on_agent(node: str, addr: str) -> None:
            if _NAME.fullmatch(node):
                announce(str(self.dir / f"{node}.addr"), addr)

        server = LaunchServer(controller, read_key_file(key), self.bundle, on_agent)
        with server.serving():
            yield server.url

    def _prepare(self) -> str:
        """The job's directory, made afresh but for its key; the key file's path."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        for old in self.dir.glob("*.addr"):
            old.unlink()
        key = self.key_file
        if key is None:
            key = str(self.dir / "key")
            with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(job_key().hex() + "\n")
        read_key_file(key)  # fail here, not on every node
        return key

    def _script(self, key: str, controller: str, listen: str, url: str) -> str:
        """The job script: one agent per node, the nodes' files shared or not."""
        head = "#!/bin/bash\n# written by amesh.SlurmJob: one amesh agent per node\n"
        srun = "exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 "
        if self.bundle is None:
            agent = [self.python, "-m", "amesh", "agent", "--listen", f"{listen}://0.0.0.0:0"]
            agent += ["--route-to", controller, "--key-file", key]
            announce_to = f"{self.dir}/$SLURMD_NODENAME.addr"
            line = "exec " + shlex.join(agent) + " --announce " + announce_to
            return head + srun + f"bash -c {shlex.quote(line)}\n"
        manifest = json.dumps(self.bundle.manifest, separators=(",", ":"))
        boot = [*self.wrap, self.python, "-c", '"$AMESH_BOOT"', "--manifest", manifest]
        boot += ["--listen", f"{listen}://0.0.0.0:0", "--route-to", controller, "--fetch", url]
        # (the key is in the job's environment only: never on a command line, which
        # every user of a node may read)
        return (
            head
            + f"export {KEY_VARIABLE}={read_key_file(key).hex()}\n"
            + "IFS= read -r -d '' AMESH_BOOT <<'AMESH_BOOT_END' || true\n"
            + source()
            + "AMESH_BOOT_END\n"
            + srun
            + " ".join(a if a == '"$AMESH_BOOT"' else shlex.quote(a) for a in boot)
            + "\n"
        )

    def _submit(self, key: str, controller: str, listen: str, url: str) -> None:
        script = self.dir / "job.sh"
        text = self._script(key, controller, listen, url)
        with open(os.open(script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
        cmd = ["sbatch", "--parsable", "-N", str(self.nodes), "-J", self.name]
        cmd += ["-o", str(self.dir / "slurm-%j.out")]
        if self.partition:
            cmd += ["-p", self.partition]
        if self.time:
            cmd += ["-t", self.time]
        cmd += [*self.sbatch_args, str(script)]
        self.job_id = _run(*cmd).strip().split(";")[0]
        record = {"job_id": self.job_id, "nodes": self.nodes, "key_file": key}
        (self.dir / "job.json").write_text(json.dumps(record))
        if not self.persistent:
            atexit.register(self._cancel_quietly)

    async def _agents(self) -> list[str]:
        """The agents' addresses, once every node has announced its agent."""
        deadline: float | None = None
        while True:
            found = sorted(self.dir.glob("*.addr"))
            if len(found) >= self.nodes:
                return [p.read_text().strip() for p in found[: self.nodes]]
            state = await anyio.to_thread.run_sync(self.state)
            if state not in _LIVE:
                log = "".join(p.read_text() for p in self.dir.glob(f"slurm-{self.job_id}.out"))
                raise RuntimeError(
                    f"SLURM job {self.job_id} ({self.name}) ended ({state or 'gone'}) before "
                    f"its agents started: {log[-2000:]}"
                )
            if state == "RUNNING" and deadline is None:
                deadline = anyio.current_time() + self.timeout
            if deadline is not None and anyio.current_time() > deadline:
                raise TimeoutError(
                    f"{len(found)} of {self.nodes} agents of SLURM job {self.job_id} started "
                    f"within {self.timeout:g} s"
                )
            await anyio.sleep(0.1)

    # -- the end ----------------------------------------------------------------------

    def cancel(self) -> None:
        """End the job (``scancel``) and forget it."""
        atexit.unregister(self._cancel_quietly)
        if self.job_id is not None:
            _run("scancel", self.job_id)
            self.job_id = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def _cancel_quietly(self) -> None:
        try:
            self.cancel()
        except (OSError, RuntimeError, subprocess.SubprocessError):
            pass
