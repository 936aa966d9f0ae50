"""``amesh.Environment``: an environment file, opened, that spawns meshes on its targets.

One name switches where the same cells run::

    env = amesh.Environment.load("titan")
    procs = await env.spawn_procs(target="laptop")     # this machine
    procs = await env.spawn_procs(target="cluster")    # the file's cluster

Each mesh's processes run in the environment's venv on every host of the target,
with the workspace's tree first on their import path; its secrets reach their
environment, and nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._mesh import ProcMesh
from .._shape import Shape
from ._base import EnvError
from ._envhost import EnvHost, Fetching
from ._file import PROJECT_MARKERS, EnvSpec, LocalTarget, Target, load_spec
from ._lock import env_hash
from ._open import Env, lock_env, open_env
from ._targets import check_launcher, host_count

__all__ = ["Environment", "find_env_file", "read_secrets_file", "secret_values"]


def find_env_file(name_or_path: str | os.PathLike[str], start: Path | None = None) -> Path:
    """The environment file that ``name_or_path`` names: a path (``*.toml``, or one
    with a folder, or an existing file), else a NAME: ``envs/NAME.toml``, or an
    ``amesh.toml`` whose ``name`` is NAME, in ``start`` (default: the current
    directory) or a folder above it, up to the project's root (the first with
    ``.git`` or ``pyproject.toml``).

    Raises:
        EnvError: no such file (the message says where it looked).
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if text.endswith(".toml") or os.sep in text or path.is_file():
        if not path.is_file():
            raise EnvError(f"{path}: no such environment file")
        return path
    here = (start or Path.cwd()).resolve()
    looked = []
    for folder in (here, *here.parents):
        named = folder / "envs" / f"{text}.toml"
        if named.is_file():
            return named
        top = folder / "amesh.toml"
        if top.is_file() and load_spec(top).name == text:
            return top
        looked.append(str(folder))
        if any((folder / marker).exists() for marker in PROJECT_MARKERS):
            break
    raise EnvError(
        f"no environment {text!r}: no envs/{text}.toml, nor an amesh.toml named "
        f"{text!r}, in {', '.join(looked)}"
    )


def read_secrets_file(path: Path) -> dict[str, str]:
    """The ``NAME=VALUE`` lines of the secrets file at ``path`` (blank lines and
    ``#`` comments skipped, ``export`` and one pair of quotes around a value allowed).

    Raises:
        EnvError: it cannot be read, or a line is not ``NAME=VALUE`` (the message
            names the line, never a value).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(f"{path}: cannot read the secrets file: {exc}") from None
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, eq, value = line.removeprefix("export ").partition("=")
        name = name.strip()
        if not eq or not name.isidentifier():
            raise EnvError(f"{path}:{number}: expected NAME=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[name] = value
    return out


def secret_values(spec: EnvSpec, secrets_file: Path | None = None) -> dict[str, str]:
    """The values of ``spec``'s secrets: each from the controller's environment, else
    from ``secrets_file``.

    Raises:
        EnvError: one is in neither; the message names each missing one (and never
            a value).
    """
    if not spec.secrets:
        return {}
    from_file = read_secrets_file(secrets_file) if secrets_file is not None else {}
    values: dict[str, str] = {}
    missing = []
    for name in spec.secrets:
        value = os.environ.get(name, from_file.get(name))
        if value is None:
            missing.append(name)
        else:
            values[name] = value
    if missing:
        where = "this controller's environment" + (f" nor {secrets_file}" if secrets_file else "")
        raise EnvError(
            f"{spec.file or spec.name}: secrets: {', '.join(missing)} not set (not in "
            f"{where}): set them before spawning"
        )
    return values


class Environment:
    """An environment file, opened and locked: the packages, settings, secrets'
    names, workspace and targets of a piece of work (docs: Guides > Environments).

    Made by :meth:`load`. :meth:`spawn_procs` starts a
    :class:`~amesh.ProcMesh` on one of its targets, in its venv and workspace.
    """

    def __init__(
        self,
        env: Env,
        *,
        find_links: Sequence[str | os.PathLike[str]] = (),
        no_index: bool = False,
        secrets_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self._env = env
        self._find_links = [os.fspath(f) for f in find_links]
        self._no_index = no_index
        self._secrets_file = Path(secrets_file) if secrets_file is not None else None

    @classmethod
    def load(
        cls,
        name_or_path: str | os.PathLike[str],
        *,
        locked: bool = False,
        find_links: Sequence[str | os.PathLike[str]] = (),
        no_index: bool = False,
        secrets_file: str | os.PathLike[str] | None = None,
    ) -> Environment:
        """The environment of a file: a path, or a NAME found as ``envs/NAME.toml``
        or an ``amesh.toml`` named NAME, here or in a folder above, up to the
        project's root. Its lock is read, and made again (with a warning) when
        missing or stale.

        Args:
            name_or_path: the file's path, or the environment's name.
            locked: refuse a missing or stale lock rather than make it.
            find_links: directories of distributions to lock and fetch from, besides
                the index (for hosts with no index: a wheelhouse).
            no_index: from ``find_links`` only.
            secrets_file: a file of ``NAME=VALUE`` lines where secrets that the
                controller's environment lacks are found (kept on this machine;
                never sent but the values that the file's ``secrets`` name).

        Raises:
            EnvError: no such file, a bad file (the message names the file, line and
                key), a missing or stale lock with ``locked``, dependencies that do
                not resolve, or this controller's Python does not satisfy ``python``.
        """
        path = find_env_file(name_or_path)
        links = [os.fspath(f) for f in find_links]
        env = open_env(path, locked=locked, find_links=links, no_index=no_index)
        return cls(env, find_links=find_links, no_index=no_index, secrets_file=secrets_file)

    def __repr__(self) -> str:
        return f"<Environment {self.name} {self._env.short_hash} ({self.spec.file})>"

    @property
    def name(self) -> str:
        """The environment's name."""
        return self._env.spec.name

    @property
    def hash(self) -> str:
        """Its identity: sha256 (hex) of its settings and lock; its venvs are named by it."""
        return self._env.hash

    @property
    def spec(self) -> EnvSpec:
        """Its file, checked."""
        return self._env.spec

    @property
    def targets(self) -> dict[str, Target]:
        """Where it runs, by name (as the file says)."""
        return dict(self._env.spec.targets)

    @property
    def requirements(self) -> list[str]:
        """What its lock pins, ``name==version`` each."""
        return [f"{r.name}=={r.version}" for r in self._env.lock.requirements]

    def lock(self) -> Environment:
        """Resolve the file's dependencies again (newer versions that its
        specifiers allow), write the lock, and return the environment of that lock.

        Raises:
            EnvError: the dependencies do not resolve.
        """
        spec = load_spec(self.spec.file)
        lock = lock_env(spec, find_links=self._find_links, no_index=self._no_index)
        return Environment(
            Env(spec, lock, env_hash(spec, lock)),
            find_links=self._find_links,
            no_index=self._no_index,
            secrets_file=self._secrets_file,
        )

    def target(self, name: str | None = None) -> tuple[str, Target]:
        """The target called ``name``; None: the file's only one, or this machine
        when the file has none.

        Raises:
            EnvError: no such target, or None where the file has several (the
                message lists them).
        """
        targets = self._env.spec.targets
        known = ", ".join(targets) or "none"
        if name is None:
            if not targets:
                return "local", LocalTarget()
            if len(targets) == 1:
                return next(iter(targets.items()))
            raise EnvError(f"{self.spec.file}: name a target (the targets: {known})")
        if name not in targets:
            raise EnvError(f"{self.spec.file}: no target {name!r} (the targets: {known})")
        return name, targets[name]

    def spawn_procs(
        self,
        target: str | None = None,
        per_host: Mapping[str, int] | None = None,
        *,
        name: str | None = None,
        persistent: bool = False,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> ProcMesh:
        """A :class:`~amesh.ProcMesh` on the hosts of ``target``, ``{"hosts": N,
        **per_host}`` processes; enter it (``async with``) or await it to start them.

        Starting it first gives each host the environment: the wheels are fetched
        into the controller's cache (once), the target's hosts brought up (``local``:
        this machine's agent; ``hosts``: the file's agents), each sent only what it
        lacks of the wheels and the workspace, its venv built (once per environment
        hash) and the workspace's tree made. The processes then start in that venv,
        in that tree (first on their import path), with the file's ``env`` and the
        secrets' values (from this controller, read now) in their environment.
        ``await procs.sync()`` later brings them an edited workspace.

        Args:
            target: the target's name in the file (see :meth:`target`).
            per_host: the processes on each host (default: the target's ``per_host``).
            name: the mesh's name.
            persistent: the processes outlive this controller (see ProcMesh).
            env: more environment variables for the processes, over the file's.
            kwargs: the other keyword arguments of :class:`~amesh.ProcMesh` but ``host``.

        Raises:
            EnvError: no such target, its launcher is not available, a secret is
                not set, the lock leaves amesh out: here, before anything starts.
                Starting the mesh raises EnvError too where a wheel does not fetch,
                a host cannot be reached or given the environment (its Python does
                not satisfy ``python``, a package does not install), naming it,
                before any worker starts.
        """
        target_name, chosen = self.target(target)
        if not self._env.lock.amesh:
            raise EnvError(
                f"{self.spec.file}: the lock leaves amesh out (`--without-amesh`): its "
                f"venv would not run amesh workers; lock it again with amesh"
            )
        shape = dict(per_host if per_host is not None else chosen.per_host)
        if "hosts" in shape:
            raise ValueError("per_host describes one host: it cannot have a 'hosts' dimension")
        check_launcher(chosen)
        values = secret_values(self.spec, self._secrets_file)
        host = EnvHost(
            self._env,
            target_name,
            chosen,
            len(Shape.from_sizes(shape)),
            Fetching(self._find_links, self._no_index),
            (name or "") if persistent else "",
        )
        return ProcMesh(
            {"hosts": host_count(chosen), **shape},
            host=host,
            name=name,
            persistent=persistent,
            env={**self.spec.env, **values, **(env or {})},
            **kwargs,
        )
