"""The environment file: TOML, read with ``tomllib`` and checked into an :class:`EnvSpec`.

Each error names the file, the line and the key (``envs/titan.toml:7:
targets.cluster.nodes: expected an int, got "four"``): the checks walk the parsed
value, and :mod:`._locate` finds the line of the path where one fails. Unknown keys
are errors that name the closest known key, so a misspelt key is never ignored.

The format is versioned (``format = 1``); a file of a newer format than this amesh
reads is refused rather than half-read.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path as FsPath
from typing import Any, NoReturn

import msgspec

from ._base import EnvError
from ._locate import Path, key_lines, line_of, show_path
from ._specs import check_requirement, check_specifier

__all__ = [
    "FORMAT",
    "EnvSpec",
    "HostsTarget",
    "LocalTarget",
    "SlurmTarget",
    "SshTarget",
    "Target",
    "Workspace",
    "canonical",
    "load_spec",
    "parse_spec",
]

#: the newest format of the file this amesh reads
FORMAT = 1

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIM = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: what a host agent listens on (see ``amesh agent --listen``)
_AGENT = re.compile(r"(tcp|tls\+tcp|stream\+tcp)://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}")
_SSH_HOST = re.compile(r"[^\s@]+(@[^\s@]+)?")


class Workspace(msgspec.Struct, frozen=True, kw_only=True):
    """What of the controller's files travels to the hosts.

    Attributes:
        paths: directories or files, relative to the environment file's directory;
            none: the project's directory (see :meth:`EnvSpec.workspace_roots`).
        exclude: gitignore-style patterns of what not to send (each path's
            ``.gitignore`` counts too).
    """

    paths: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()


class LocalTarget(msgspec.Struct, frozen=True, kw_only=True):
    """This machine.

    Attributes:
        per_host: the processes' shape, e.g. ``{"procs": 2}``.
    """

    launcher: str = "local"
    per_host: dict[str, int] = msgspec.field(default_factory=lambda: {"procs": 1})


class HostsTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Machines that run a host agent (``amesh agent``).

    Attributes:
        agents: the agents' addresses (``tcp://ADDR:PORT``).
        key_file: the job key they admit, relative to the file's directory (None:
            the controller's own).
        per_host: the processes' shape on each host.
    """

    launcher: str = "hosts"
    agents: tuple[str, ...]
    key_file: str | None = None
    per_host: dict[str, int] = msgspec.field(default_factory=lambda: {"procs": 1})


class SshTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Machines reached with the user's ssh, where agents are started over ssh.

    Attributes:
        hosts: the machines (``name``, ``user@name``).
        user: the user on them, where a host does not say.
        python: the interpreter on them that builds the environment's venv.
        key_file: the job key, relative to the file's directory (None: a fresh one).
        ssh_args: more arguments of ``ssh`` (``["-p", "2222"]``, ``["-J", "bastion"]``).
        per_host: the processes' shape on each host.
    """

    launcher: str = "ssh"
    hosts: tuple[str, ...]
    user: str | None = None
    python: str = "python3"
    key_file: str | None = None
    ssh_args: tuple[str, ...] = ()
    per_host: dict[str, int] = msgspec.field(default_factory=lambda: {"procs": 1})


class SlurmTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Nodes of a SLURM job (``sbatch``).

    Attributes:
        nodes: how many.
        partition: ``sbatch -p`` (None: the default one).
        time: ``sbatch -t``, e.g. ``"2:00:00"`` (None: the partition's default).
        account: ``sbatch -A`` (None: the user's default).
        python: the interpreter on the nodes that builds the agent's venv.
        sbatch_args: more arguments of ``sbatch`` (``["--gres=gpu:8"]``).
        wrap: a command prefix each node's agent runs under (a container's
            ``["apptainer", "exec", "img.sif"]``, a namespace's ``["unshare", ...]``).
        per_host: the processes' shape on each node.
    """

    launcher: str = "slurm"
    nodes: int
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    python: str = "python3"
    sbatch_args: tuple[str, ...] = ()
    wrap: tuple[str, ...] = ()
    per_host: dict[str, int] = msgspec.field(default_factory=lambda: {"procs": 1})


Target = LocalTarget | HostsTarget | SshTarget | SlurmTarget
_LAUNCHERS: dict[str, type[Target]] = {
    "local": LocalTarget,
    "hosts": HostsTarget,
    "ssh": SshTarget,
    "slurm": SlurmTarget,
}


class EnvSpec(msgspec.Struct, frozen=True, kw_only=True):
    """An environment file, checked.

    Attributes:
        name: the environment's name (``[a-z0-9][a-z0-9._-]*``).
        format: the file format's version.
        python: a PEP 440 specifier set the hosts' Python must satisfy ("": any).
        dependencies: PEP 508 requirements.
        env: environment variables of the workers.
        secrets: names of variables whose values come from the controller at start
            (never written anywhere).
        workspace: the files that travel.
        targets: where it runs, by name.
        file: the file it was read from ("" if none): paths in it are relative to
            its directory. Not part of the environment's identity.
    """

    name: str
    format: int = FORMAT
    python: str = ""
    dependencies: tuple[str, ...] = ()
    env: dict[str, str] = msgspec.field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    workspace: Workspace = Workspace()
    targets: dict[str, Target] = msgspec.field(default_factory=dict)
    file: str = ""

    @property
    def root(self) -> FsPath:
        """The directory that the file's relative paths start from."""
        return FsPath(self.file).resolve().parent if self.file else FsPath.cwd()

    def resolve(self, path: str) -> FsPath:
        """``path`` of the file (a workspace path, a key file) as a path on this machine."""
        return self.root / FsPath(path).expanduser()

    def workspace_roots(self) -> list[FsPath]:
        """The workspace's paths on this machine; when the file names none, the
        project's directory (:func:`project_root` of the file's)."""
        if self.workspace.paths:
            return [self.resolve(p) for p in self.workspace.paths]
        return [project_root(self.root)]


#: what makes a folder a project's root
PROJECT_MARKERS = (".git", "pyproject.toml")


def project_root(start: FsPath) -> FsPath:
    """The project that ``start`` is in: the first folder from it up that holds
    ``.git`` or ``pyproject.toml``; ``start`` itself if none does."""
    for folder in (start, *start.parents):
        if any((folder / marker).exists() for marker in PROJECT_MARKERS):
            return folder
    return start


class _Checker:
    """Checks a parsed file; each failure raises an :class:`EnvError` that names the
    file, the line and the key."""

    def __init__(self, text: str, shown: str) -> None:
        self.text = text
        self.shown = shown
        self._lines: dict[Path, int] | None = None

    def fail(self, path: Sequence[str | int], message: str) -> NoReturn:
        if self._lines is None:  # (scanned once, when the first error needs it)
            self._lines = key_lines(self.text)
        line = line_of(self._lines, path)
        raise EnvError(f"{self.shown}:{line}: {show_path(path)}: {message}")

    def table(self, path: Path, value: Any, known: Sequence[str]) -> dict[str, Any]:
        """``value``, a table whose keys are all among ``known``."""
        if not isinstance(value, dict):
            self.fail(path, f"expected a table, got {_shown(value)}")
        for key in value:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.fail((*path, key), f"unknown key{hint} (known: {', '.join(known)})")
        return value

    def typed(self, path: Path, value: Any, kind: type, noun: str) -> Any:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(path, f"expected {noun}, got {_shown(value)}")
        return value

    def string(self, path: Path, value: Any, pattern: re.Pattern[str] | None = None) -> str:
        text: str = self.typed(path, value, str, "a string")
        if pattern is not None and not pattern.fullmatch(text):
            self.fail(path, f"{_shown(text)} is not of the form {pattern.pattern}")
        return text

    def strings(
        self, path: Path, value: Any, pattern: re.Pattern[str] | None = None
    ) -> tuple[str, ...]:
        items = self.typed(path, value, list, "an array of strings")
        return tuple(self.string((*path, i), item, pattern) for i, item in enumerate(items))

    def mapping(self, path: Path, value: Any) -> dict[str, str]:
        table = self.typed(path, value, dict, "a table of strings")
        for key, item in table.items():
            if not _VARIABLE.fullmatch(key):
                self.fail((*path, key), "not an environment variable's name")
            self.string((*path, key), item)
        return dict(table)

    def per_host(self, path: Path, value: Any) -> dict[str, int]:
        table = self.typed(path, value, dict, "a table of dimension sizes, e.g. { procs = 2 }")
        if not table:
            self.fail(path, "expected at least one dimension, e.g. { procs = 2 }")
        for dim, size in table.items():
            if dim == "hosts":
                self.fail((*path, dim), "'hosts' is the hosts' own dimension, not one per host")
            if not _DIM.fullmatch(dim):
                self.fail((*path, dim), "a dimension's name is a Python identifier")
            if self.typed((*path, dim), size, int, "an int") < 1:
                self.fail((*path, dim), f"expected a positive int, got {size}")
        return dict(table)


def _shown(value: Any) -> str:
    """``value`` as TOML writes it (``"four"``, ``true``), short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 60 else text[:57] + '..."'
    return str(value)


def _target(check: _Checker, name: str, value: Any) -> Target:
    path: Path = ("targets", name)
    if not _TARGET_NAME.fullmatch(name):
        check.fail(path, f"a target's name is of the form {_TARGET_NAME.pattern}")
    table = check.typed(path, value, dict, "a table")
    if "launcher" not in table:
        check.fail(path, f"no launcher: expected one of {', '.join(_LAUNCHERS)}")
    launcher = check.string((*path, "launcher"), table["launcher"])
    kind = _LAUNCHERS.get(launcher)
    if kind is None:
        close = difflib.get_close_matches(launcher, list(_LAUNCHERS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        check.fail(
            (*path, "launcher"),
            f"unknown launcher {_shown(launcher)}{hint} (known: {', '.join(_LAUNCHERS)})",
        )
    check.table(path, table, kind.__struct_fields__)
    out: dict[str, Any] = {}
    for key, item in table.items():
        at = (*path, key)
        if key == "per_host":
            out[key] = check.per_host(at, item)
        elif key == "agents":
            out[key] = check.strings(at, item, _AGENT)
        elif key == "hosts":
            out[key] = check.strings(at, item, _SSH_HOST)
        elif key in ("sbatch_args", "ssh_args", "wrap"):
            out[key] = check.strings(at, item)
        elif key == "nodes":
            if check.typed(at, item, int, "an int") < 1:
                check.fail(at, f"expected a positive int, got {item}")
            out[key] = item
        else:
            out[key] = check.string(at, item)
    for key in ("agents", "hosts", "nodes"):
        if key in kind.__struct_fields__ and key not in out:
            check.fail(path, f"a {launcher} target needs {key}")
    if not out.get("agents", out.get("hosts", True)):
        check.fail((*path, "agents" if "agents" in out else "hosts"), "expected at least one")
    return kind(**out)


_TOP = tuple(f for f in EnvSpec.__struct_fields__ if f != "file")


def _spec(check: _Checker, data: dict[str, Any], file: str) -> EnvSpec:
    check.table((), data, _TOP)
    fmt = check.typed(("format",), data.get("format", FORMAT), int, "an int")
    if fmt > FORMAT:
        check.fail(("format",), f"format {fmt} is newer than this amesh reads ({FORMAT}): upgrade")
    if fmt < 1:
        check.fail(("format",), f"expected a format from 1 to {FORMAT}, got {fmt}")
    if "name" not in data:
        check.fail((), 'no name: give the environment one, e.g. name = "titan"')
    out: dict[str, Any] = {"format": fmt, "name": check.string(("name",), data["name"], _NAME)}
    if "python" in data:
        python = check.string(("python",), data["python"])
        problem = check_specifier(python)
        if problem:
            check.fail(("python",), problem)
        out["python"] = python
    if "dependencies" in data:
        deps = check.strings(("dependencies",), data["dependencies"])
        for i, dep in enumerate(deps):
            problem = check_requirement(dep)
            if problem:
                check.fail(("dependencies", i), problem)
        out["dependencies"] = deps
    if "env" in data:
        out["env"] = check.mapping(("env",), data["env"])
    if "secrets" in data:
        out["secrets"] = check.strings(("secrets",), data["secrets"], _VARIABLE)
    if "workspace" in data:
        table = check.table(("workspace",), data["workspace"], Workspace.__struct_fields__)
        out["workspace"] = Workspace(
            **{key: check.strings(("workspace", key), item) for key, item in table.items()}
        )
    if "targets" in data:
        targets = check.typed(("targets",), data["targets"], dict, "a table of targets")
        out["targets"] = {name: _target(check, name, item) for name, item in targets.items()}
    return EnvSpec(**out, file=file)


def parse_spec(text: str, file: str = "<string>") -> EnvSpec:
    """An environment from the TOML ``text`` of ``file``.

    Args:
        text: the file's text.
        file: its path, as errors name it and relative paths start from.

    Returns:
        The checked environment.

    Raises:
        EnvError: the text is not TOML, or not an environment file; the message names
            the file, the line and (but for TOML syntax) the key.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        found = re.search(r"\(at line (\d+), column \d+\)$", message)
        line = found.group(1) if found else "1"
        raise EnvError(f"{file}:{line}: not valid TOML: {message}") from None
    return _spec(_Checker(text, file), data, file)


def load_spec(path: str | FsPath) -> EnvSpec:
    """The environment of the file at ``path``.

    Raises:
        EnvError: it cannot be read, or is no valid environment file (the message
            names the file, the line and the key).
    """
    try:
        text = FsPath(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(f"{path}: cannot read the environment file: {exc}") from None
    return parse_spec(text, str(path))


def canonical(spec: EnvSpec) -> dict[str, Any]:
    """What of ``spec`` makes the environment's identity: not its targets (where it
    runs), not its file's path, and of its secrets only their names."""
    return {
        "format": spec.format,
        "name": spec.name,
        "python": spec.python,
        "dependencies": list(spec.dependencies),
        "env": dict(sorted(spec.env.items())),
        "secrets": sorted(spec.secrets),
        "workspace": {"paths": list(spec.workspace.paths), "exclude": list(spec.workspace.exclude)},
    }
