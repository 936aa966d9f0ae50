"""``amesh env``: init, lock, show and check an environment file (push, pull and list
through a hub: :mod:`._hub_commands`).

``FILE`` is an environment file's path, or a name (``titan`` for ``envs/titan.toml``);
without one, ``./amesh.toml``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from ._base import EnvError
from ._check import probe_hosts
from ._file import EnvSpec, LocalTarget, SlurmTarget, SshTarget, Target, load_spec, parse_spec
from ._hub_commands import COMMANDS as HUB_COMMANDS
from ._hub_commands import add_parsers as add_hub_parsers
from ._hub_commands import run as run_hub
from ._lock import Lock, env_hash, lock_path, read_lock, this_python
from ._open import lock_env, stale_reason
from ._specs import check_requirement, python_satisfies, requirement_name

__all__ = ["HostProbe", "add_parser", "describe_hosts", "main"]

#: What a target's hosts answer (``probe(spec, target name, target)``): a line per
#: host and whether it names a problem (a Python that does not satisfy the file's, an
#: agent that cannot be reached); None where they cannot be asked before a spawn.
#: :func:`._check.probe_hosts` asks host agents; tests give their own.
HostProbe = Callable[[EnvSpec, str, Target], list[tuple[str, bool]] | None]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``env`` and its commands to the ``amesh`` command's subparsers ``sub``."""
    env = sub.add_parser("env", help="environment files: init, lock, show, check, push, pull, list")
    cmds = env.add_subparsers(dest="env_command", metavar="COMMAND", required=True)
    init = cmds.add_parser("init", help="write ./amesh.toml from this project's requirements")
    init.add_argument(
        "--name", default=None, help="the environment's name (default: the project's)"
    )
    init.add_argument(
        "--from",
        dest="source",
        default=None,
        metavar="FILE",
        help="a requirements file or pyproject.toml (default: ./pyproject.toml, else "
        "./requirements.txt, else none)",
    )
    lock = cmds.add_parser("lock", help="resolve the dependencies into FILE's lock (<stem>.lock)")
    show = cmds.add_parser(
        "show", help="what the environment is: hash, packages, settings, targets"
    )
    check = cmds.add_parser("check", help="what each target's hosts would need")
    check.add_argument("--target", default=None, help="this target only")
    for cmd in (lock, show, check):
        cmd.add_argument(
            "file", nargs="?", default=None, metavar="FILE", help="a path or NAME (envs/NAME.toml)"
        )
    lock.add_argument(
        "--find-links", action="append", default=[], metavar="DIR", help="distributions here too"
    )
    lock.add_argument("--no-index", action="store_true", help="only from --find-links")
    lock.add_argument(
        "--without-amesh",
        action="store_true",
        help="leave amesh's own requirements out (for hosts that have amesh already)",
    )
    add_hub_parsers(cmds)


def env_file(arg: str | None) -> Path:
    """The environment file that ``FILE`` names (see the module's docstring)."""
    if arg is None:
        return Path("amesh.toml")
    if arg.endswith(".toml") or os.sep in arg or Path(arg).exists():
        return Path(arg)
    return Path("envs") / f"{arg}.toml"


def main(args: argparse.Namespace, probe: HostProbe | None = None) -> int:
    """Run ``amesh env COMMAND`` with the parsed ``args``; errors go to stderr.

    Args:
        args: from the parser :func:`add_parser` made.
        probe: asks a target's hosts what they lack (default: their agents, see
            :func:`._check.probe_hosts`).

    Returns:
        The exit status.
    """
    try:
        if args.env_command == "init":
            return _init(args.name, args.source)
        if args.env_command in HUB_COMMANDS:
            return run_hub(args, env_file(args.file) if args.env_command == "push" else None)
        path = env_file(args.file)
        if not path.exists():
            raise EnvError(f"{path}: no such environment file (`amesh env init` writes one)")
        spec = load_spec(path)
        if args.env_command == "lock":
            return _lock(spec, args)
        if args.env_command == "show":
            return _show(spec)
        return _check(spec, args.target, probe or probe_hosts)
    except EnvError as exc:
        print(f"amesh env {args.env_command}: {exc}", file=sys.stderr)
        return 1


def _lock(spec: EnvSpec, args: argparse.Namespace) -> int:
    lock = lock_env(
        spec,
        include_amesh=not args.without_amesh,
        find_links=args.find_links,
        no_index=args.no_index,
    )
    print(
        f"wrote {lock_path(spec.file)}: {len(lock.requirements)} requirements for Python "
        f"{lock.python} on {lock.platform}; environment {spec.name} "
        f"{env_hash(spec, lock)[:12]}"
    )
    return 0


def _show(spec: EnvSpec) -> int:
    lock = read_lock(lock_path(spec.file))
    why = stale_reason(spec, lock)
    out = [f"environment {spec.name} (format {spec.format}, {spec.file})"]
    if lock is None or why:
        out.append(f"hash: none: {why}; run `amesh env lock {spec.file}`")
    else:
        out.append(f"hash: {env_hash(spec, lock)[:12]} ({env_hash(spec, lock)})")
        out.append(f"lock: Python {lock.python} on {lock.platform}, amesh {lock.amesh or '-'}")
    out.append(f"python: {spec.python or 'any'}")
    out.extend(_packages(spec, None if why else lock))
    out.append("env: " + (", ".join(f"{k}={v}" for k, v in spec.env.items()) or "-"))
    secrets = [f"{n} ({'set' if n in os.environ else 'NOT set'} here)" for n in spec.secrets]
    out.append("secrets: " + (", ".join(secrets) or "-"))
    ws = spec.workspace
    out.append(f"workspace: {', '.join(ws.paths)}; exclude: {', '.join(ws.exclude) or '-'}")
    out.append("targets:" + ("" if spec.targets else " -"))
    for name, target in spec.targets.items():
        out.append(f"  {name}: {target.launcher}, per host {_shape(target.per_host)}")
        out.extend(f"    {line}" for line in describe_hosts(spec, target))
    print("\n".join(out))
    return 0


def _packages(spec: EnvSpec, lock: Lock | None) -> list[str]:
    versions = {r.name: r.version for r in lock.requirements} if lock else {}
    out = ["dependencies:" + ("" if spec.dependencies else " -")]
    for dep in spec.dependencies:
        pinned = versions.get(requirement_name(dep))
        out.append(f"  {dep}" + (f" -> {pinned}" if pinned else ""))
    if lock is not None:
        named = {requirement_name(d) for d in spec.dependencies}
        others = [f"{r.name}=={r.version}" for r in lock.requirements if r.name not in named]
        out.append(f"also locked ({len(others)}): " + (", ".join(others) or "-"))
    return out


def _shape(per_host: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k} = {v}" for k, v in per_host.items()) + "}"


def describe_hosts(spec: EnvSpec, target: Target) -> list[str]:
    """The hosts of ``target``, in words (one line each; a SLURM job's are not known
    before it runs)."""
    if isinstance(target, LocalTarget):
        return ["this machine"]
    if isinstance(target, SlurmTarget):
        where = f"partition {target.partition}" if target.partition else "the default partition"
        extra = "".join(
            f", {k} {v}" for k, v in (("time", target.time), ("account", target.account)) if v
        )
        return [f"{target.nodes} node(s) of {where}{extra}, known once the job runs"]
    key = f" (key {spec.resolve(target.key_file)})" if target.key_file else ""
    if isinstance(target, SshTarget):
        user = f"{target.user}@" if target.user else ""
        return [
            f"ssh {h if '@' in h else user + h}, python {target.python}{key}" for h in target.hosts
        ]
    return [f"agent {a}{key}" for a in target.agents]


def _check(spec: EnvSpec, only: str | None, probe: HostProbe) -> int:
    if only is not None and only not in spec.targets:
        known = ", ".join(spec.targets) or "none"
        raise EnvError(f"{spec.file}: no target {only!r} (the targets: {known})")
    problems = 0
    lock = read_lock(lock_path(spec.file))
    why = stale_reason(spec, lock)
    if why:
        print(f"lock: {why}: `amesh env lock {spec.file}` makes it")
        problems += 1
    ok = not spec.python or python_satisfies(spec.python)
    said = "satisfies" if ok else "does NOT satisfy"
    print(f"this controller's Python {this_python()} {said} python = {spec.python or 'any'!r}")
    problems += not ok
    for name, target in spec.targets.items():
        if only is not None and name != only:
            continue
        print(f"{name} ({target.launcher}):")
        for line in describe_hosts(spec, target):
            print(f"  {line}")
        answers = probe(spec, name, target)
        if answers is None:
            print(f"  hosts not asked: the {target.launcher} launcher starts their agents at spawn")
            continue
        for line, problem in answers:
            problems += problem
            print(f"  {line}")
    return 1 if problems else 0


def _init(name: str | None, source: str | None) -> int:
    target = Path("amesh.toml")
    if target.exists():
        raise EnvError(f"{target} exists, and init never overwrites one")
    deps, python, project = _requirements(source)
    name = name or _name(project or Path.cwd().name)
    text = _render(name, python, deps)
    parse_spec(text, str(target))  # (what init writes, the file reads back)
    with target.open("x", encoding="utf-8") as out:
        out.write(text)
    print(f"wrote {target}: environment {name}, {len(deps)} dependencies")
    return 0


def _name(project: str) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", project.lower()).lstrip("._-")
    return name or "env"


def _requirements(source: str | None) -> tuple[list[str], str, str]:
    """``(dependencies, python, project name)`` of ``source`` (see ``--from``)."""
    if source is None:
        found = [p for p in ("pyproject.toml", "requirements.txt") if Path(p).is_file()]
        if not found:
            return [], "", ""
        source = found[0]
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EnvError(f"{path}: cannot read it: {exc}") from None
    if path.name == "pyproject.toml" or path.suffix == ".toml":
        try:
            project = tomllib.loads(text).get("project", {})
        except tomllib.TOMLDecodeError as exc:
            raise EnvError(f"{path}: not valid TOML: {exc}") from None
        deps = list(project.get("dependencies", []))
        return deps, str(project.get("requires-python", "")), str(project.get("name", ""))
    return _requirements_file(path, text), "", ""


def _requirements_file(path: Path, text: str) -> list[str]:
    deps = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*", "", raw).strip()
        if not line:
            continue
        if line.startswith("-"):
            print(f"amesh env init: {path}:{number}: option {line!r} left out", file=sys.stderr)
            continue
        problem = check_requirement(line)
        if problem:
            raise EnvError(f"{path}:{number}: {problem}")
        deps.append(line)
    return deps


def _render(name: str, python: str, deps: Sequence[str]) -> str:
    python = python or f">={this_python()}"
    listed = "".join(f"    {json.dumps(d)},\n" for d in deps)
    return (
        "# An amesh environment (docs: Guides > Environments)\n"
        "format = 1\n"
        f"name = {json.dumps(name)}\n"
        f"python = {json.dumps(python)}\n"
        f"dependencies = [\n{listed}]\n"
        "env = {}\n"
        "secrets = []\n"
        "\n[workspace]\n"
        'paths = ["."]\n'
        "exclude = []\n"
        "\n[targets.local]\n"
        'launcher = "local"\n'
        "per_host = { procs = 2 }\n"
    )
